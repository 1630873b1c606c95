"""
The OpenAI shim (protocol.md section 11) and the discovery routes, driven by the
official `openai` Python SDK against a core in front of a real tone worker: speech in
each way the SDK asks for it, server-sent audio events, the errors in OpenAI's envelope
with the SDK retrying exactly what the taxonomy calls retryable, discovery as Open WebUI
reads it, and the batch.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import openai
import pytest
import pytest_twisted
from test_core_proxy import Core, call, chatty_env
from test_core_proxy import start_core as start
from twisted.internet.threads import deferToThread

from _worker import decode_pcm, probed_rate, rms

RATE = 24000


class Limits:
    """
    Admission settings a test sets: one speaker per engine and nobody waiting.
    """

    def concurrent_per_engine(self, engine: str) -> int:
        return 1

    def queued_per_engine(self, engine: str) -> int:
        return 0

    def queue_wait_seconds(self) -> float:
        return 30.0

    def buffered_bytes(self) -> int:
        return 256 * 1024 * 1024


@pytest_twisted.async_yield_fixture()
async def core(tmp_path: Path) -> AsyncIterator[Core]:
    """
    A core on a loopback port whose one engine, "tone", is a real worker.
    """
    async for running in start(tmp_path):
        yield running


def sdk(core: Core, retries: int = 2) -> openai.OpenAI:
    host, port = core.address
    return openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="sk-not-a-real-key", max_retries=retries)


def counted(core: Core) -> list[float]:
    """
    Count the requests the shim translates (each retry is one).
    """
    seen: list[float] = []
    shim = core.app.openai.translation
    original = shim.native

    async def native(body: Any, **kwargs: Any) -> Any:
        seen.append(time.monotonic())
        return await original(body, **kwargs)

    shim.native = native  # type: ignore[method-assign]
    return seen


def in_thread(work: Callable[[], Any]) -> Any:
    return deferToThread(work)


def events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """
    The server-sent events in a whole body, as (event name, data as JSON).
    """
    found = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        found.append((fields["event"], json.loads(fields["data"])))
    return found


@pytest_twisted.ensureDeferred
async def test_sdk_speech_create_gets_wav_and_mp3_by_default(core: Core) -> None:
    """
    `audio.speech.create` gets the audio asked for: a WAV when it says wav, and an MP3
    when it says nothing, because mp3 is OpenAI's default; the bearer key it must send
    is ignored.
    """
    client = sdk(core)

    def speak() -> tuple[bytes, bytes, str]:
        wav = client.audio.speech.create(model="tone", input="Hello there.", voice="alto", response_format="wav")
        mp3 = client.audio.speech.create(model="tone", input="Hello there.", voice="alto")
        return wav.content, mp3.content, mp3.response.headers["content-type"]

    wav, mp3, mp3_type = await in_thread(speak)
    assert wav[:4] == b"RIFF" and wav[8:12] == b"WAVE" and len(wav) > 10_000
    assert rms(decode_pcm(wav, "wav", RATE)) > 1000
    assert mp3_type == "audio/mpeg" and (mp3[:3] == b"ID3" or mp3[0] == 0xFF)


@pytest_twisted.ensureDeferred
async def test_sdk_voice_object_and_variant_model(core: Core) -> None:
    """
    The voice may be the SDK's `{"id": ...}` object, and a model of `engine:variant`
    speaks that variant.
    """
    client = sdk(core)

    def speak() -> bytes:
        answer = client.audio.speech.create(
            model="tone:classic", input="Hello there.", voice={"id": "bass"}, response_format="pcm"
        )
        assert answer.response.headers["content-type"] == f"audio/L16; rate={RATE}; channels=1"
        return answer.content

    pcm = await in_thread(speak)
    assert len(pcm) > 10_000 and rms(pcm) > 1000
    assert core.app.residency.state("tone")["variant"] == "classic"


@pytest_twisted.ensureDeferred
async def test_sdk_streaming_response_arrives_in_pieces(core: Core) -> None:
    """
    `with_streaming_response` reads the audio as the server writes it: several pieces,
    together the same length as a buffered answer would be.
    """
    client = sdk(core)
    text = " ".join(f"Sentence number {i} of a longer reading." for i in range(6))

    def stream() -> list[int]:
        sizes = []
        with client.audio.speech.with_streaming_response.create(
            model="tone", input=text, voice="alto", response_format="pcm"
        ) as response:
            for piece in response.iter_bytes():
                sizes.append(len(piece))
        return sizes

    sizes = await in_thread(stream)
    assert len(sizes) > 1 and sum(sizes) > 100_000


@pytest_twisted.ensureDeferred
async def test_sdk_sse_stream_carries_the_audio_as_delta_events(core: Core) -> None:
    """
    `stream_format="sse"` answers text/event-stream: speech.audio.delta events whose
    base64 decodes to PCM as long as a raw stream's of the same text (tone's expressive
    voice varies its sound from take to take, not its length), then speech.audio.done.
    """
    client = sdk(core)

    def both() -> tuple[bytes, str, bytes]:
        sse = client.audio.speech.create(
            model="tone", input="Hello there, events.", voice="alto", response_format="pcm", stream_format="sse"
        )
        raw = client.audio.speech.create(model="tone", input="Hello there, events.", voice="alto", response_format="pcm")
        return sse.content, sse.response.headers["content-type"], raw.content

    body, content_type, raw = await in_thread(both)
    assert content_type == "text/event-stream"
    found = events(body)
    assert [name for name, _ in found[:-1]] == ["speech.audio.delta"] * (len(found) - 1)
    assert found[-1] == ("speech.audio.done", {"type": "speech.audio.done"})
    audio = b"".join(base64.b64decode(data["audio"]) for name, data in found[:-1])
    assert len(audio) == len(raw) and rms(audio) > 1000


@pytest.mark.parametrize("fmt", ["mp3", "opus", "flac", "aac"])
@pytest_twisted.ensureDeferred
async def test_sse_carries_every_format_as_base64_of_the_encoded_bytes(core: Core, fmt: str) -> None:
    """
    SSE in a compressed format (LiveKit's default is mp3 over SSE): the deltas' bytes,
    joined, are one file in that format, which decodes to audio as long as pcm's.
    """
    client = sdk(core)

    def both() -> tuple[bytes, bytes]:
        sse = client.audio.speech.create(
            model="tone", input="Hello there, events.", voice="alto", response_format=fmt,  # type: ignore[arg-type]
            stream_format="sse",
        )
        raw = client.audio.speech.create(model="tone", input="Hello there, events.", voice="alto", response_format="pcm")
        return sse.content, raw.content

    body, raw = await in_thread(both)
    found = events(body)
    assert found[-1][0] == "speech.audio.done" and len(found) > 1
    encoded = b"".join(base64.b64decode(data["audio"]) for name, data in found[:-1])
    assert {"mp3": encoded[:3] in (b"ID3",) or encoded[0] == 0xFF, "opus": encoded[:4] == b"OggS",
            "flac": encoded[:4] == b"fLaC", "aac": encoded[0] == 0xFF and encoded[1] & 0xF0 == 0xF0}[fmt]
    audio = await deferToThread(decode_pcm, encoded, fmt, RATE)
    # A lossy codec's priming and padding: at most two frames (2 x 1152 samples).
    assert abs(len(audio) - len(raw)) <= 2 * 2 * 1152 + 2 * RATE // 50 and rms(audio) > 1000


@pytest.mark.parametrize(
    "body, status, code, param",
    [
        ({"model": "tts-1", "input": "Hi."}, 404, "unknown_engine", "model"),
        ({"model": "tone", "input": "Hi.", "voice": "alloy"}, 404, "unknown_voice", "voice"),
        ({"model": "tone", "input": "Hi.", "instructions": "Whisper it."}, 422, "unsupported", "instructions"),
        ({"model": "tone", "input": "Hi.", "response_format": "wma"}, 422, "unsupported", "response_format"),
        ({"model": "tone", "input": "Hi.", "response_format": "opus", "sample_rate": 22050}, 422, "unsupported",
         "sample_rate"),
        ({"model": "tone", "input": "Hi.", "speed": 1.5}, 422, "unsupported", "speed"),
        ({"model": "tone", "input": "Hi.", "seed": 3}, 400, "bad_request", "seed"),
        ({"model": "tone", "input": ""}, 400, "bad_request", "input"),
        ({"model": "tone:turbo", "input": "Hi."}, 422, "unsupported", "model"),
        ({"input": "Hi."}, 400, "bad_request", "model"),
    ],
)
@pytest_twisted.ensureDeferred
async def test_refusals_are_in_openais_envelope(core: Core, body: dict[str, Any], status: int, code: str, param: str) -> None:
    """
    Each refusal has the taxonomy's status and code in OpenAI's envelope, names the
    OpenAI field it is about as param (in the message too), and says x-should-retry.
    """
    answer = await call(core, "POST", "/v1/audio/speech", body)
    error = json.loads(answer.body)["error"]
    assert answer.status == status
    assert error["code"] == code and error["param"] == param and error["retryable"] is False
    assert error["type"] == "invalid_request_error"
    assert answer.headers["x-should-retry"] == "false"
    assert '"text"' not in error["message"]


@pytest_twisted.ensureDeferred
async def test_sdk_tries_a_refusal_once(core: Core) -> None:
    """
    The SDK sends a request the taxonomy calls not retryable exactly once: an unknown
    voice (404) and an unknown engine raise at once, with the code and param readable.
    """
    seen = counted(core)
    client = sdk(core)

    def refused() -> list[Any]:
        caught = []
        for model, voice in (("tone", "alloy"), ("tts-1", "alloy")):
            try:
                client.audio.speech.create(model=model, input="Hello.", voice=voice)
            except openai.APIStatusError as error:
                caught.append(error)
        return caught

    caught = await in_thread(refused)
    assert [(e.status_code, e.code, e.param) for e in caught] == [(404, "unknown_voice", "voice"), (404, "unknown_engine", "model")]
    assert len(seen) == 2


@pytest_twisted.async_yield_fixture()
async def busy_core(tmp_path: Path) -> AsyncIterator[Core]:
    """
    A core in front of a slow chatty engine that lets one request speak at a time and
    none wait: a second is overloaded (429, retryable).
    """
    env = chatty_env(CHATTY_SECONDS_PER_SEGMENT="0.3")
    async for running in start(tmp_path, engine="chatty", module="chatty_engine", extra_env=env, admission=Limits()):
        yield running


@pytest_twisted.ensureDeferred
async def test_sdk_retries_a_retryable_refusal(busy_core: Core) -> None:
    """
    An overloaded answer (429, retryable, Retry-After 1) is retried by the SDK twice, so
    three requests arrive; then the SDK raises RateLimitError with the taxonomy's code.
    """
    from twisted.internet import reactor

    host, port = busy_core.address
    # One long stream (a minute of chatty) holds the only turn until the SDK has given up,
    # however slow the box; it is known to hold the turn before the SDK asks.
    release = threading.Event()
    holder = deferToThread(_hold_stream, host, port, release, 120.0)
    deadline = time.monotonic() + 60
    while busy_core.app.relay.turnstile.state("chatty")["speaking"] < 1:
        assert time.monotonic() < deadline, "the holding stream never got its turn"
        await _sleep(reactor, 0.02)
    seen = counted(busy_core)
    client = sdk(busy_core)

    def refused() -> Any:
        try:
            # Chatty has no voices: omitted, the engine's default speaks.
            client.audio.speech.create(model="chatty", input="Hello.", voice=openai.omit, response_format="wav")
        except openai.RateLimitError as error:
            return error
        return None

    try:
        error = await in_thread(refused)
    finally:
        release.set()
        await holder
    assert error is not None and error.code == "overloaded"
    assert error.response.headers["x-should-retry"] == "true"
    assert len(seen) == 3


def _hold_stream(host: str, port: int, release: threading.Event, seconds: float) -> None:
    """
    A long stream (200 sentences of chatty's 0.3 s), read until C{release} is set, the
    stream ends, or C{seconds} pass (a hang guard), then hung up.
    """
    import socket

    body = json.dumps({"engine": "chatty", "text": " ".join(["Word."] * 200), "format": "pcm"}).encode()
    with socket.create_connection((host, port)) as sock:
        sock.sendall(b"POST /speak HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        sock.settimeout(0.1)
        ends = time.monotonic() + seconds
        while not release.is_set() and time.monotonic() < ends:
            try:
                if not sock.recv(4096):
                    break
            except socket.timeout:
                continue


async def _sleep(reactor: Any, seconds: float) -> None:
    from twisted.internet.task import deferLater

    await deferLater(reactor, seconds, lambda: None)


@pytest_twisted.async_yield_fixture()
async def tiny_core(tmp_path: Path) -> AsyncIterator[Core]:
    """
    A core in front of a chatty engine whose whole answer is 32 bytes: under the floor.
    """
    async for running in start(tmp_path, engine="chatty", module="chatty_engine", extra_env=chatty_env(CHATTY_SEGMENT_MS="1")):
        yield running


@pytest_twisted.ensureDeferred
async def test_sdk_does_not_retry_an_internal_error(tiny_core: Core) -> None:
    """
    A worker that answers 200 with too few bytes to be audio is an internal error:
    over SSE nothing has gone yet, so it is a 500 envelope with x-should-retry false,
    and the SDK, which retries every 5xx by status, sends it once.
    """
    seen = counted(tiny_core)
    client = sdk(tiny_core)

    def refused() -> Any:
        try:
            client.audio.speech.create(
                model="chatty", input="Hi.", voice=openai.omit, response_format="pcm", stream_format="sse"
            )
        except openai.InternalServerError as error:
            return error
        return None

    error = await in_thread(refused)
    assert error is not None and error.status_code == 500 and error.code == "internal"
    assert len(seen) == 1


@pytest_twisted.async_yield_fixture()
async def slow_core(tmp_path: Path) -> AsyncIterator[Core]:
    """
    A core in front of the chatty test engine, speaking a segment every 0.3 s.
    """
    async for running in start(tmp_path, engine="chatty", module="chatty_engine",
                               extra_env=chatty_env(CHATTY_SECONDS_PER_SEGMENT="0.3")):
        yield running


@pytest_twisted.ensureDeferred
async def test_sse_failure_after_the_first_event_is_an_error_event(slow_core: Core) -> None:
    """
    A worker killed mid-stream ends an SSE answer with a speech.audio.error event and a
    clean end (an event stream can say so), never with speech.audio.done.
    """
    from twisted.internet import reactor

    def kill() -> None:
        os.kill(slow_core.worker.pid, signal.SIGKILL)

    body = {"model": "chatty", "input": " ".join(["Word."] * 30), "response_format": "pcm", "stream_format": "sse"}
    pending = call(slow_core, "POST", "/v1/audio/speech", body, on_body=lambda: reactor.callFromThread(kill))
    answer = await pending
    found = events(b"".join(answer.chunks))
    assert answer.status == 200 and answer.complete
    assert found[0][0] == "speech.audio.delta"
    assert found[-1][0] == "speech.audio.error"
    assert found[-1][1]["error"]["type"] == "server_error"
    assert all(name != "speech.audio.done" for name, _ in found)


@pytest_twisted.ensureDeferred
async def test_discovery_as_open_webui_reads_it(core: Core) -> None:
    """
    Open WebUI's reads: /v1/audio/models has "models", /v1/models has "data" (the engine
    and each engine:variant, no tts-1), /v1/audio/voices has voices[].id and .name,
    and LocalAI-style data[].voices; the SDK's models.list reads the same list.
    """
    models = json.loads((await call(core, "GET", "/v1/audio/models")).body)
    ids = [m["id"] for m in models["models"]]
    assert ids[0] == "tone" and "tone:expressive" in ids and "tone:classic" in ids and "tts-1" not in ids
    voices = json.loads((await call(core, "GET", "/v1/audio/voices")).body)
    assert {"id": "alto", "name": "Alto", "engine": "tone"}.items() <= voices["voices"][0].items() or any(
        v["id"] == "alto" and v["name"] == "Alto" for v in voices["voices"])
    assert voices["data"][0]["model"] == "tone" and any(v["id"] == "alto" for v in voices["data"][0]["voices"])
    filtered = json.loads((await call(core, "GET", "/v1/audio/voices?model=tone:classic")).body)
    assert filtered["data"][0]["model"] == "tone"
    client = sdk(core)
    listed = await in_thread(lambda: [m.id for m in client.models.list()])
    assert listed == ids
    one = await in_thread(lambda: client.models.retrieve("tone:classic"))
    assert one.id == "tone:classic" and one.owned_by == "rhapsode"
    assert core.app.residency.state("tone")["resident"] is False  # listing loads no model


@pytest_twisted.ensureDeferred
async def test_discovery_of_an_unknown_model_names_the_ones_there_are(core: Core) -> None:
    """
    An unknown model, in /v1/models/{id} or as a voice filter, is unknown_engine in
    OpenAI's envelope, naming the engines this server has.
    """
    for target in ("/v1/models/tts-1", "/v1/audio/voices?model=tts-1", "/v1/models/tone:turbo"):
        answer = await call(core, "GET", target)
        error = json.loads(answer.body)["error"]
        assert answer.status == 404 and error["code"] == "unknown_engine" and "tone" in error["message"], target


@pytest_twisted.ensureDeferred
async def test_batch_answers_each_item_and_refuses_past_the_cap(core: Core) -> None:
    """
    A batch speaks each item as a buffered /speak (wav by default), an item's failure
    is its own (with the taxonomy's code), and 33 items are refused whole.
    """
    body = {"model": "tone", "voice": "alto", "items": [
        {"input": "First line."}, {"input": "Second.", "voice": "nobody"}, {"input": "Third.", "response_format": "pcm"}]}
    answer = await call(core, "POST", "/v1/audio/speech/batch", body)
    result = json.loads(answer.body)
    assert answer.status == 200 and result["total"] == 3 and result["succeeded"] == 2 and result["failed"] == 1
    first, second, third = result["results"]
    assert first["media_type"] == "audio/wav" and base64.b64decode(first["audio_data"])[:4] == b"RIFF"
    assert second["status"] == "error" and second["error"]["code"] == "unknown_voice"
    assert third["media_type"].startswith("audio/L16") and len(base64.b64decode(third["audio_data"])) > 10_000
    assert core.app.budget.held == 0
    over = await call(core, "POST", "/v1/audio/speech/batch", {"model": "tone", "items": [{"input": "x"}] * 33})
    assert over.status == 400 and json.loads(over.body)["error"]["param"] == "items"


@pytest_twisted.ensureDeferred
async def test_speed_sets_the_variants_rate_dial(core: Core) -> None:
    """
    speed on tone:classic sets its rate dial (which its capability document names):
    twice as fast is about half as long, half as fast twice; speed 1 is the dial's
    default; the expressive variant, which has no rate dial, refuses a speed.
    """
    client = sdk(core)
    text = "A sentence long enough to time, read at three speeds."

    def three() -> list[int]:
        return [len(client.audio.speech.create(model="tone:classic", input=text, voice="alto", response_format="pcm",
                                               speed=speed).content) for speed in (1.0, 2.0, 0.5)]

    plain, fast, slow = await in_thread(three)
    assert 0.4 < fast / plain < 0.6 and 1.7 < slow / plain < 2.3
    answer = await call(core, "GET", "/engines/tone/capabilities")
    assert json.loads(answer.body)["variants"]["classic"]["speed"] == {"dial": "rate", "scale": "proportional"}
    refused = await call(core, "POST", "/v1/audio/speech", {"model": "tone:expressive", "input": "Hi.", "speed": 2})
    error = json.loads(refused.body)["error"]
    assert refused.status == 422 and error["param"] == "speed" and "expressive" in error["message"]


@pytest_twisted.ensureDeferred
async def test_sample_rate_resamples_in_every_format(core: Core) -> None:
    """
    sample_rate (vLLM-Omni's field) asks the worker's encoder to resample: pcm's
    Content-Type says the rate and its length follows it, a wav's header and an mp3's
    frames carry it, and the audio is not silent; the native /speak takes sampleRate.
    """
    client = sdk(core)
    text = "Resampled, and still speech."

    def speak() -> tuple[Any, bytes, bytes, bytes]:
        pcm = client.audio.speech.create(model="tone:classic", input=text, voice="alto", response_format="pcm",
                                         extra_body={"sample_rate": 16000})
        native = client.audio.speech.create(model="tone:classic", input=text, voice="alto", response_format="pcm")
        wav = client.audio.speech.create(model="tone:classic", input=text, voice="alto", response_format="wav",
                                         extra_body={"sample_rate": 22050})
        mp3 = client.audio.speech.create(model="tone:classic", input=text, voice="alto", response_format="mp3",
                                         extra_body={"sample_rate": 44100})
        return pcm, native.content, wav.content, mp3.content

    pcm, native, wav, mp3 = await in_thread(speak)
    assert pcm.response.headers["content-type"] == "audio/L16; rate=16000; channels=1"
    assert abs(len(pcm.content) / len(native) - 16000 / RATE) < 0.01 and rms(pcm.content) > 1000
    assert await deferToThread(probed_rate, wav) == 22050 and int.from_bytes(wav[24:28], "little") == 22050
    assert await deferToThread(probed_rate, mp3) == 44100
    assert rms(await deferToThread(decode_pcm, mp3, "mp3", 44100)) > 1000
    answer = await call(core, "POST", "/speak",
                        {"engine": "tone", "variant": "classic", "text": text, "format": "pcm", "sampleRate": 8000})
    assert answer.status == 200 and answer.headers["content-type"] == "audio/L16; rate=8000; channels=1"
