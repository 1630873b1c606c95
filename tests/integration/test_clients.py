"""
Other people's clients, configured only as their own docs say for an OpenAI-compatible
server or a Wyoming one, against a real `rhapsode serve` with Piper and tone: LiveKit
Agents' OpenAI TTS with its defaults (mp3 over SSE, the voice "ash"), Pipecat's
OpenAITTSService with the voice "alloy", the openai Node SDK, and the wyoming library and
wyoming-bench against the Wyoming door.

LiveKit, Pipecat and wyoming-bench run in their own virtualenv (.venvs/clients), the Node
SDK in its own project (tests/clients/node), both built by `make clients`; each client
writes the audio it was given to a folder, and this judges it: it decodes, it is at the
rate the client plays it at, it lasts as long as speech of that text, and it is not
silence.  The operator's config is the one docs/openai.md and docs/wyoming.md show: the
aliases ash and alloy mean piper's joe, and Piper is asked for 24 kHz on the shim.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from _worker import decode_pcm, free_port, probed_rate, rms, serving_core

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = ROOT / "tests" / "clients"
PYTHON = ROOT / ".venvs" / "clients" / "bin" / "python"
NODE = CLIENTS / "node"
PIPER = ROOT / ".venvs" / "piper" / "bin" / "python"
#: Per client: a hang guard, generous for a box ten times slower.
LIMIT = 300


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """
    One core for every client here: Piper (its own virtualenv) and tone, the aliases,
    Piper's shim rate, and the Wyoming door on a loopback port.
    """
    for needed, made_by in ((PYTHON, "make clients"), (NODE / "node_modules", "make clients"), (PIPER, "make engines")):
        if not needed.exists():
            pytest.fail(f"{needed} is missing: {made_by} builds it")
    tmp_path = tmp_path_factory.mktemp("clients")
    wyoming = free_port()
    engines = {
        "piper": {"module": "rhapsode_engine_piper", "python": str(PIPER), "openaiSampleRate": 24000},
        "tone": {"module": "rhapsode_engine_tone"},
    }
    with serving_core(
        tmp_path, engines,
        voices={"aliases": {"ash": "piper:joe", "alloy": "piper:joe"}},
        wyoming={"port": wyoming, "host": "127.0.0.1"},
    ) as (_, port):
        yield {"base": f"http://127.0.0.1:{port}/v1", "wyoming": wyoming, "tmp": tmp_path}


def run(argv: list[str], cwd: Path) -> str:
    result = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=LIMIT,
                            env={**os.environ, "OPENAI_API_KEY": "sk-not-a-real-key"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def spoken(pcm: bytes, rate: int, text: str) -> None:
    """
    PCM that is speech of C{text}: loud enough, and about as long as Piper reads it
    (13-20 characters a second; a client that played it at the wrong rate would be 9%
    out, which the rate checks catch, not this).
    """
    seconds = len(pcm) / 2 / rate
    assert rms(pcm) > 500, "silence"
    assert len(text) / 25 < seconds < len(text) / 8, f"{seconds:.2f} s for {len(text)} characters"


def test_livekit_with_its_defaults(core: dict[str, Any], tmp_path: Path) -> None:
    """
    livekit-plugins-openai with its defaults (mp3, stream_format "sse", voice "ash"):
    synthesize and the StreamAdapter path an agent session uses both give 24 kHz mono
    frames of speech, the request id the core made reaches the plugin, and pcm (which
    LiveKit plays as 24 kHz) is speech as long as the mp3 is, resampled by the core.
    """
    run([str(PYTHON), str(CLIENTS / "livekit_tts.py"), core["base"], "piper", str(tmp_path)], tmp_path)
    found = json.loads((tmp_path / "found.json").read_text())
    assert found["defaults"] == {"format": "mp3", "voice": "ash"}
    text = "Rhapsode speaks to LiveKit. Every frame is real audio, decoded from mp3."
    for path in ("synthesize", "stream", "pcm"):
        assert found[path]["rates"] == [24000] and found[path]["channels"] == [1], path
        spoken((tmp_path / f"{path}.pcm").read_bytes(), 24000, text)
    [request_id] = found["synthesize"]["request_ids"]
    assert len(request_id) == 32
    mp3_seconds = found["synthesize"]["bytes"] / 2 / 24000
    pcm_seconds = found["pcm"]["bytes"] / 2 / 24000
    # Piper's noise varies a take's length a little; a rate mistake is 9%.
    assert abs(pcm_seconds / mp3_seconds - 1) < 0.06


def test_pipecat_with_an_alias(core: dict[str, Any], tmp_path: Path) -> None:
    """
    Pipecat's OpenAITTSService, outside a pipeline, with voice "alloy" (it refuses any
    name outside OpenAI's before sending, "joe" included): the alias speaks Piper's joe,
    as 24 kHz pcm frames of speech.
    """
    run([str(PYTHON), str(CLIENTS / "pipecat_tts.py"), core["base"], "piper", "alloy", str(tmp_path)], tmp_path)
    found = json.loads((tmp_path / "found.json").read_text())
    assert found["errors"] == [] and found["frames"] > 0 and found["rates"] == [24000]
    assert "not supported" in found["refused_joe"][0]
    spoken((tmp_path / "pipecat.pcm").read_bytes(), 24000,
           "Pipecat asked for alloy, and the operator's alias gave it a real voice.")


def test_the_openai_node_sdk(core: dict[str, Any], tmp_path: Path) -> None:
    """
    The openai Node SDK: its default mp3 buffered, pcm streamed (at the operator's 24
    kHz, the Content-Type says so), and mp3 as server-sent events, each decoding to
    speech; the SDK saw the request id.
    """
    run(["node", str(NODE / "speech.mjs"), core["base"], "piper", "joe", str(tmp_path)], NODE)
    found = json.loads((tmp_path / "found.json").read_text())
    text = "The Node client hears Rhapsode, in every way it asks."
    assert found["mp3"]["type"] == "audio/mpeg" and len(found["mp3"]["requestId"]) == 32
    assert found["pcm"]["type"] == "audio/L16; rate=24000; channels=1"
    assert found["sse"]["type"] == "text/event-stream" and found["last"] == "speech.audio.done"
    for name in ("node.mp3", "node-sse.mp3"):
        encoded = (tmp_path / name).read_bytes()
        assert probed_rate(encoded) == 24000
        spoken(decode_pcm(encoded, "mp3", 24000), 24000, text)
    spoken((tmp_path / "node.pcm").read_bytes(), 24000, text)


def _wyoming(port: int, work: Any) -> Any:
    async def session() -> Any:
        from wyoming.client import AsyncTcpClient

        async with AsyncTcpClient("127.0.0.1", port) as client:
            return await asyncio.wait_for(work(client), LIMIT)

    return asyncio.run(session())


async def _audio(client: Any, until: str) -> tuple[list[Any], bytes, list[Any]]:
    from wyoming.audio import AudioChunk, AudioStart

    starts, pcm, seen = [], b"", []
    while True:
        event = await client.read_event()
        assert event is not None, "the door closed the connection"
        seen.append(event.type)
        if AudioStart.is_type(event.type):
            starts.append(AudioStart.from_event(event))
        elif AudioChunk.is_type(event.type):
            pcm += AudioChunk.from_event(event).audio
        elif event.type == "error":
            raise AssertionError(event.data)
        if event.type == until:
            return starts, pcm, seen


def test_the_wyoming_client_describes_and_synthesizes(core: dict[str, Any]) -> None:
    """
    The wyoming library's client: describe is one TTS program per engine, Piper's joe
    among the voices with its language and licence; synthesize is audio-start at
    Piper's 22.05 kHz, speech, audio-stop; an unknown voice is an error event naming the
    engine's voices.
    """
    from wyoming.info import Describe, Info
    from wyoming.tts import Synthesize, SynthesizeVoice

    text = "Home Assistant hears the Wyoming door. Then a second sentence."

    async def work(client: Any) -> Any:
        await client.write_event(Describe().event())
        info = Info.from_event(await client.read_event())
        await client.write_event(Synthesize(text, voice=SynthesizeVoice(name="piper:joe")).event())
        heard = await _audio(client, "audio-stop")
        await client.write_event(Synthesize("Hi.", voice=SynthesizeVoice(name="piper:nobody")).event())
        refused = await client.read_event()
        return info, heard, refused

    info, (starts, pcm, seen), refused = _wyoming(core["wyoming"], work)
    assert [program.name for program in info.tts] == ["piper", "tone"]
    piper = info.tts[0]
    assert piper.supports_synthesize_streaming and "GPL-3.0-or-later" in piper.attribution.name
    [joe] = piper.voices
    assert joe.name == "piper:joe" and joe.languages == ["en-US"] and "not for commercial use" in joe.attribution.name
    assert [(s.rate, s.width, s.channels) for s in starts] == [(22050, 2, 1)]
    assert seen[0] == "audio-start" and seen[-1] == "audio-stop" and seen.count("audio-chunk") > 1
    spoken(pcm, 22050, text)
    assert refused.type == "error" and refused.data["code"] == "unknown_voice" and "joe" in refused.data["text"]


def test_the_wyoming_streaming_form(core: dict[str, Any]) -> None:
    """
    synthesize-start, the text in chunks that split sentences, the compatibility
    synthesize, synthesize-stop: one audio cycle per sentence, then synthesize-stopped,
    all of it speech.
    """
    from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeVoice

    text = "The first sentence arrives in pieces. A second one follows! And a third?"

    async def work(client: Any) -> Any:
        await client.write_event(SynthesizeStart(voice=SynthesizeVoice(name="piper:joe")).event())
        for at in range(0, len(text), 7):
            await client.write_event(SynthesizeChunk(text[at : at + 7]).event())
        await client.write_event(Synthesize(text, voice=SynthesizeVoice(name="piper:joe")).event())
        await client.write_event(SynthesizeStop().event())
        return await _audio(client, "synthesize-stopped")

    starts, pcm, seen = _wyoming(core["wyoming"], work)
    assert seen.count("audio-start") == seen.count("audio-stop") == 3 and len(starts) == 3
    spoken(pcm, 22050, text)


def test_wyoming_bench_runs_against_the_door(core: dict[str, Any], tmp_path: Path) -> None:
    """
    wyoming-bench (offline: it needs nothing but the server) measures both of its modes
    against the door without a failure.
    """
    out = run([str(PYTHON.parent / "wyoming-bench"), "tts", f"127.0.0.1:{core['wyoming']}", "--rounds", "1",
               "--warmup", "0", "--programs", "piper", "--config", '{"voice": "piper:joe"}',
               "--texts", "Benchmarking the door. Two sentences long."], tmp_path)
    assert "[non_streaming] ok=1 fail=0" in out and "[streaming] ok=1 fail=0" in out, out[-2000:]


def _browse(seconds: float, name: str) -> tuple[Any, Any, list[str]]:
    """
    Browse for C{_wyoming._tcp} as Home Assistant's zeroconf discovery does (the same
    python-zeroconf); return the browser's zeroconf, the info of the service C{name}
    (None if it was not heard within C{seconds}), and the names heard removed since.
    """
    import threading

    from zeroconf import ServiceBrowser, ServiceListener, Zeroconf

    heard, removed = threading.Event(), []

    class Listener(ServiceListener):
        def add_service(self, zc: Zeroconf, type_: str, found: str) -> None:
            if found == name:
                heard.set()

        def update_service(self, zc: Zeroconf, type_: str, found: str) -> None:
            self.add_service(zc, type_, found)

        def remove_service(self, zc: Zeroconf, type_: str, found: str) -> None:
            removed.append(found)

    zc = Zeroconf()
    ServiceBrowser(zc, "_wyoming._tcp.local.", Listener())
    info = zc.get_service_info("_wyoming._tcp.local.", name, timeout=3000) if heard.wait(seconds) else None
    return zc, info, removed


def _can_multicast() -> bool:
    """Whether this machine hears its own multicast DNS at all (a bare round trip)."""
    import socket

    from zeroconf import ServiceInfo, Zeroconf

    name = f"rhapsode-probe-{os.getpid()}._wyoming._tcp.local."
    own = Zeroconf()
    try:
        own.register_service(ServiceInfo("_wyoming._tcp.local.", name, addresses=[socket.inet_aton("127.0.0.1")],
                                         port=9))
        zc, info, _ = _browse(10, name)
        zc.close()
        return info is not None
    except OSError:
        return False
    finally:
        own.close()


def test_home_assistant_discovers_the_door_over_zeroconf(tmp_path: Path) -> None:
    """
    With wyoming.zeroconf a core is heard on the local network as <name>._wyoming._tcp,
    as Home Assistant's discovery browses for it, at the door's address and port; the
    wyoming client describes the door found there; a core that stops withdraws it.
    """
    name = f"rhapsode-test-{os.getpid()}"
    wyoming = free_port()
    engines = {"tone": {"module": "rhapsode_engine_tone"}}
    with serving_core(tmp_path, engines, wyoming={"port": wyoming, "host": "127.0.0.1", "zeroconf": True,
                                                   "zeroconfName": name}) as (process, _):
        zc, info, removed = _browse(30, f"{name}._wyoming._tcp.local.")
        try:
            if info is None and not _can_multicast():
                pytest.skip("this machine hears no multicast DNS, not even its own")
            assert info is not None, (tmp_path / "core.log").read_text()[-3000:]
            assert info.port == wyoming and info.parsed_addresses() == ["127.0.0.1"]

            async def describe(client: Any) -> Any:
                from wyoming.info import Describe, Info

                await client.write_event(Describe().event())
                return Info.from_event(await client.read_event())

            assert [program.name for program in _wyoming(info.port, describe).tts] == ["tone"]
            process.terminate()
            process.wait(LIMIT)
            for _ in range(100):
                if removed:
                    break
                time.sleep(0.1)
            assert removed == [f"{name}._wyoming._tcp.local."]
        finally:
            zc.close()


def _counts(base: str) -> dict[tuple[str, str], float]:
    """rhapsode_requests_total by (route, code) for piper, as a Prometheus scrape reads it."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base.removesuffix("/v1") + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return {(s.labels["route"], s.labels["code"]): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == "rhapsode_requests_total" and s.labels.get("engine") == "piper"}


def test_the_wyoming_door_speaks_through_the_shared_speech_path(core: dict[str, Any]) -> None:
    """
    A Wyoming synthesize is counted in /metrics under the route wyoming, as /speak is
    under its own: one ok for speech, one unknown_voice for a refusal.
    """
    from wyoming.tts import Synthesize, SynthesizeVoice

    async def work(client: Any) -> Any:
        await client.write_event(Synthesize("Counted once.", voice=SynthesizeVoice(name="piper:joe")).event())
        await _audio(client, "audio-stop")
        await client.write_event(Synthesize("Refused once.", voice=SynthesizeVoice(name="piper:nobody")).event())
        return await client.read_event()

    before = _counts(core["base"])
    refused = _wyoming(core["wyoming"], work)
    after = _counts(core["base"])
    assert refused.type == "error"
    grew = {key: after[key] - before.get(key, 0) for key in after if after[key] != before.get(key, 0)}
    assert grew == {("wyoming", "ok"): 1, ("wyoming", "unknown_voice"): 1}
