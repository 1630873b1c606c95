"""
The remote engine (engines/remote) in front of fake vLLM-Omni servers on loopback
(fake_vllm_omni.py, built from vLLM-Omni's documented API), through a real `rhapsode
serve`: what it declares (each variant's model, server, instructions and cloning, the
voices with their languages, licences per model), each Qwen3-TTS task type with what the
server is sent, a voice cloned by upload (with the operator's consent id) and one sent
per request (Fish's reference), instructions on /speak, the OpenAI shim, MCP and the
WebSocket (and refused by a variant without them), residency (shown with its server,
unload unsupported), a reader that stops reading (the server is paused, memory bounded),
a server that dies mid-stream or fails in its SSE (the client's body is cut short, never
ended clean), a server that hangs (fenced, 503 retryable, until it answers), and the
worker conformance checker on the adapter.
"""

from __future__ import annotations

import base64
import io
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import wave
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest
from _worker import engine_of, engine_python, free_port, get, resident_kib, rms, serving_core, wait_for

FAKE = Path(__file__).resolve().parent / "fake_vllm_omni.py"
CUSTOM = "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice"
DESIGN = "Qwen/Qwen3-TTS-12Hz-1.7B-VoiceDesign"
BASE = "Qwen/Qwen3-TTS-12Hz-1.7B-Base"
FISH = "fishaudio/s2-pro"
CONSENT = "studio-consent-42"


class FakeServer:
    """A fake vLLM-Omni server in a process of its own, and its control routes."""

    def __init__(self, model: str, *extra: str) -> None:
        self.process = subprocess.Popen([sys.executable, str(FAKE), "--model", model, *extra],
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert self.process.stdout is not None
        self.port = int(json.loads(self.process.stdout.readline())["port"])
        self.url = f"http://127.0.0.1:{self.port}"

    def call(self, method: str, path: str, body: Any = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, method=method)
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def mode(self, **mode: Any) -> None:
        self.call("POST", "/_fake/mode", mode)

    def requests(self) -> list[dict[str, Any]]:
        answered: list[dict[str, Any]] = self.call("GET", "/_fake/requests")
        return answered

    def stats(self) -> dict[str, Any]:
        answered: dict[str, Any] = self.call("GET", "/_fake/stats")
        return answered

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()
        assert self.process.stdout is not None
        self.process.stdout.close()


@contextmanager
def fakes(*models: str) -> Iterator[list[FakeServer]]:
    servers: list[FakeServer] = []
    try:
        for model in models:
            servers.append(FakeServer(model))
        yield servers
    finally:
        for server in servers:
            server.stop()


def remote(variants: dict[str, dict[str, Any]], **more: Any) -> dict[str, Any]:
    """A config entry for the remote engine with these variants."""
    document = {"variants": variants, **more}
    return {"module": "rhapsode_engine_remote", "python": engine_python("remote"),
            "env": {"RHAPSODE_REMOTE_CONFIG": json.dumps(document)}}


def post(port: int, path: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    data = json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def pcm_of(wav_bytes: bytes) -> tuple[int, bytes]:
    with wave.open(io.BytesIO(wav_bytes)) as wav:
        return wav.getframerate(), wav.readframes(wav.getnframes())


def multipart(fields: list[tuple[str, str | None, bytes]]) -> tuple[bytes, str]:
    boundary = "testboundary7f3a"
    parts = []
    for name, filename, data in fields:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        parts.append(f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + data + b"\r\n")
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def reference_wav() -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(24000)
        wav.writeframes(bytes(range(256)) * 400)
    return out.getvalue()


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """
    One core with the remote engine "qwen" (three Qwen3-TTS servers, one model each, as
    variants custom, design and base), the remote engine "fish" (Fish S2 Pro, whose
    rate differs, so an engine of its own) and tone, which takes no instructions.
    """
    tmp = tmp_path_factory.mktemp("remote")
    with fakes(CUSTOM, DESIGN, BASE, FISH) as (custom, design, base, fish):
        engines = {
            "qwen": remote({
                "custom": {"url": custom.url},
                "design": {"url": design.url},
                "base": {"url": base.url, "consent": CONSENT},
            }, defaultVariant="custom"),
            "fish": remote({"s2": {"url": fish.url}}),
            "tone": {"module": "rhapsode_engine_tone", "python": engine_python("tone")},
        }
        with serving_core(tmp, engines, workers={"healthCheckSeconds": 0.5}) as (core, port):
            yield {"port": port, "custom": custom, "design": design, "base": base, "fish": fish, "tmp": tmp}


def test_the_capabilities_say_what_each_server_serves(box: dict[str, Any]) -> None:
    """
    Each variant names its model and server, takes style instructions (CustomVoice), a
    required voice description (VoiceDesign) or clones (Base), speaks Qwen3-TTS's
    languages (mul, for Auto, first) at 24 kHz; the licences are the models' own,
    Apache-2.0 for Qwen3-TTS and Fish's research licence, not for commercial use.
    """
    port = box["port"]
    caps = get(port, "/engines/qwen/capabilities")
    variants = caps["variants"]
    assert variants["custom"]["remote"] == {"server": box["custom"].url, "model": CUSTOM}
    assert variants["custom"]["instructions"] == {"kind": "style", "maxCharacters": 1000, "required": False}
    assert variants["design"]["instructions"] == {"kind": "design", "maxCharacters": 1000, "required": True}
    assert "instructions" not in variants["base"] and variants["base"]["cloning"]["supported"] is True
    assert variants["custom"]["cloning"] == {"supported": False}
    assert variants["custom"]["languages"][:3] == ["mul", "zh", "en"]
    assert caps["nativeFormat"]["sampleRate"] == 24000
    assert caps["license"]["weights"] == "Apache-2.0" and caps["license"]["weightsCommercialUse"] is True
    fish = get(port, "/engines/fish/capabilities")
    assert fish["nativeFormat"]["sampleRate"] == 44100
    assert fish["license"]["weights"] == "LicenseRef-Fish-Audio-Research-License"
    assert fish["license"]["weightsCommercialUse"] is False
    assert fish["variants"]["s2"]["cues"] == ["laugh", "chuckle", "sigh", "clear throat"]
    voices = {v["id"]: v for v in get(port, "/engines/qwen/voices")}
    assert voices["ryan"]["tags"] == ["en", "preset"] and voices["ono_anna"]["tags"] == ["ja", "preset"]
    assert voices["ryan"]["previewUrl"] == "/engines/qwen/voices/ryan/preview"
    engines = {e["id"]: e for e in get(port, "/engines")}
    assert engines["fish"]["license"]["weightsCommercialUse"] is False and engines["qwen"]["adapter"] == "remote"


def test_a_remote_model_times_nothing_and_a_timed_request_is_refused(box: dict[str, Any]) -> None:
    """
    The server's answer is audio only, so no variant declares timestamps, and a request
    for them is unsupported naming the field, before it reaches the server.
    """
    port, custom = box["port"], box["custom"]
    caps = get(port, "/engines/qwen/capabilities")
    assert all("timestamps" not in variant for variant in caps["variants"].values())
    asked = len(custom.requests())
    status, _, refused = post(port, "/speak", {"engine": "qwen", "variant": "custom", "text": "Hi there.",
                                              "voice": "aiden", "timestamps": "word"},
                              {"Accept": "text/event-stream"})
    error = json.loads(refused)["error"]
    assert (status, error["code"], error["field"]) == (422, "unsupported", "timestamps")
    assert len(custom.requests()) == asked

def test_each_task_type_sends_what_its_checkpoint_takes(box: dict[str, Any]) -> None:
    """
    CustomVoice gets its speaker, the language by name and the style instructions;
    VoiceDesign gets its task type and the description; the audio comes back as the
    format asked for, at the model's rate, and instructions change it; a speed other
    than 1 is asked for whole (vLLM-Omni streams only at 1) and comes back shorter.
    """
    port = box["port"]
    custom, design = box["custom"], box["design"]
    status, headers, plain = post(port, "/speak", {"engine": "qwen", "text": "Good morning to you.", "voice": "ryan",
                                                   "language": "en", "format": "wav", "stream": False})
    assert status == 200 and headers["Content-Type"] == "audio/wav"
    status, _, styled = post(port, "/speak", {"engine": "qwen", "text": "Good morning to you.", "voice": "ryan",
                                              "language": "en", "format": "wav", "stream": False,
                                              "instructions": "Very excited, fast."})
    assert status == 200
    sent = custom.requests()[-1]
    assert {k: sent[k] for k in ("model", "voice", "language", "task_type", "instructions", "stream_format")} == {
        "model": CUSTOM, "voice": "ryan", "language": "English", "task_type": "CustomVoice",
        "instructions": "Very excited, fast.", "stream_format": "sse"}
    (rate, pcm), (_, other) = pcm_of(plain), pcm_of(styled)
    assert rate == 24000 and len(pcm) == len(other) and pcm != other and rms(pcm) > 1000
    status, _, designed = post(port, "/speak", {"engine": "qwen", "variant": "design", "text": "Hello there.",
                                                "instructions": "A warm, low narrator.", "format": "pcm"})
    assert status == 200 and len(designed) > 10000
    assert design.requests()[-1]["task_type"] == "VoiceDesign"
    assert design.requests()[-1]["instructions"] == "A warm, low narrator."
    status, _, refused = post(port, "/speak", {"engine": "qwen", "variant": "design", "text": "Hello there."})
    error = json.loads(refused)["error"]
    assert (status, error["code"], error["field"]) == (400, "bad_request", "instructions")
    status, _, faster = post(port, "/speak", {"engine": "qwen", "text": "Good morning to you.", "voice": "ryan",
                                              "format": "wav", "stream": False, "params": {"speed": 2.0}})
    sent = custom.requests()[-1]
    # vLLM-Omni streams only at speed 1: any other is asked for whole.
    assert status == 200 and sent["speed"] == 2.0 and "stream_format" not in sent and "stream" not in sent
    assert len(pcm_of(faster)[1]) < len(pcm) * 0.6


def test_instructions_through_every_door_and_refused_where_undeclared(box: dict[str, Any]) -> None:
    """
    The OpenAI shim passes instructions to a variant that takes them and refuses them
    for tone (unsupported, in OpenAI's envelope); MCP's speak tool takes them; the
    WebSocket's session.config carries them to each piece.
    """
    from test_speech_stream import speak as stream_speak

    port, custom = box["port"], box["custom"]
    status, _, audio = post(port, "/v1/audio/speech", {"model": "qwen:custom", "input": "Hi there.", "voice": "aiden",
                                                       "instructions": "Whisper it.", "response_format": "pcm"})
    assert status == 200 and len(audio) > 1000 and custom.requests()[-1]["instructions"] == "Whisper it."
    status, headers, refused = post(port, "/v1/audio/speech", {"model": "tone", "input": "Hi.", "instructions": "Whisper."})
    error = json.loads(refused)["error"]
    assert (status, error["code"], error["param"]) == (422, "unsupported", "instructions")
    call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "speak", "arguments": {
        "engine": "qwen", "text": "Hello from a tool.", "instructions": "Slowly and calmly."}}}
    status, _, answered = post(port, "/mcp", call, {"Accept": "application/json, text/event-stream"})
    result = json.loads(answered)["result"]
    assert status == 200 and not result.get("isError") and result["content"][0]["type"] == "audio"
    assert custom.requests()[-1]["instructions"] == "Slowly and calmly."
    stream = stream_speak(port, "One sentence. And another one.", model="qwen", voice="vivian",
                          instructions="Like a sports commentator.", response_format="pcm")
    assert len(stream.audio()) > 1000
    assert custom.requests()[-1]["instructions"] == "Like a sports commentator."
    stream.close()


def test_a_voice_is_uploaded_with_consent_and_another_sent_per_request(box: dict[str, Any]) -> None:
    """
    A voice made through the core is uploaded to the Base server's voices API with the
    operator's consent id and its transcript, spoken by name there (task Base), refused
    by the CustomVoice variant that cannot clone; on Fish, which has no uploads, the
    reference goes with each request as ref_audio with its ref_text.
    """
    port, base, fish = box["port"], box["base"], box["fish"]
    clip = reference_wav()
    body, content_type = multipart([("id", None, b"anna_clone"), ("label", None, b"Anna"),
                                    ("reference", "anna.wav", clip), ("transcript", None, b"The words Anna said.")])
    for engine in ("qwen", "fish"):
        request = urllib.request.Request(f"http://127.0.0.1:{port}/engines/{engine}/voices", data=body, method="POST",
                                         headers={"Content-Type": content_type})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 201 and json.loads(response.read())["id"] == "anna_clone"
    listed = base.call("GET", "/v1/audio/voices")["uploaded_voices"]
    assert [(v["name"], v["consent"], v.get("ref_text")) for v in listed] == [("anna_clone", CONSENT, "The words Anna said.")]
    status, _, audio = post(port, "/speak", {"engine": "qwen", "variant": "base", "text": "Cloned words.",
                                             "voice": "anna_clone", "format": "pcm"})
    assert status == 200 and len(audio) > 1000
    assert {k: base.requests()[-1].get(k) for k in ("voice", "task_type")} == {"voice": "anna_clone", "task_type": "Base"}
    status, _, refused = post(port, "/speak", {"engine": "qwen", "variant": "custom", "text": "Hi.", "voice": "anna_clone"})
    assert status == 404 and json.loads(refused)["error"]["code"] == "unknown_voice"
    status, _, audio = post(port, "/speak", {"engine": "fish", "text": "Cloned [laugh] words.", "voice": "anna_clone",
                                             "format": "pcm"})
    sent = fish.requests()[-1]
    assert status == 200 and sent["voice"] == "default" and sent["ref_text"] == "The words Anna said."
    assert sent["ref_audio"] == "data:audio/wav;base64," + base64.b64encode(clip).decode()
    assert sent["input"] == "Cloned [laughing] words."
    request = urllib.request.Request(f"http://127.0.0.1:{port}/engines/qwen/voices/anna_clone", method="DELETE")
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 204
    assert base.stats()["uploaded"] == []


def test_residency_shows_the_server_and_unload_is_unsupported(box: dict[str, Any]) -> None:
    """
    A model spoken with is listed with its server, outside the count and never
    expiring; an unload answers unsupported naming the server rather than pretending.
    """
    port = box["port"]
    assert post(port, "/speak", {"engine": "qwen", "text": "Hello.", "format": "pcm"})[0] == 200
    residency = get(port, "/residency")
    served = [m for m in residency["models"] if m["engine"] == "qwen"]
    assert {m["variant"]: m["server"] for m in served}["custom"] == box["custom"].url
    assert all(m["keepAliveSeconds"] == -1 and "expiresAt" not in m for m in served)
    assert engine_of(get(port, "/health"), "qwen")["model"] == "loaded"
    status, _, answer = post(port, "/engines/qwen/unload", {})
    error = json.loads(answer)["error"]
    assert (status, error["code"]) == (422, "unsupported") and box["custom"].url in error["message"]


def raw_stream(port: int, body: dict[str, Any], receive_buffer: int = 4096) -> socket.socket:
    """A request sent on a socket the test reads (or does not read) itself."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    data = json.dumps(body).encode()
    sock.sendall(b"POST /speak HTTP/1.1\r\nHost: core\r\nContent-Type: application/json\r\nConnection: close\r\n"
                 + b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return sock


def read_all(sock: socket.socket, seconds: float = 60) -> bytes:
    """Everything until the end (or a reset, or a silence of C{seconds}); then it closes."""
    with sock:
        sock.settimeout(seconds)
        received = b""
        while True:
            try:
                data = sock.recv(65536)
            except (ConnectionResetError, socket.timeout):
                break
            if not data:
                break
            received += data
        return received


def chunked_complete(raw: bytes) -> bool:
    """Whether a chunked HTTP body ended with its last chunk, not a dropped connection."""
    _, _, body = raw.partition(b"\r\n\r\n")
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        try:
            size = int(size_line.split(b";")[0], 16)
        except ValueError:
            return False
        if size == 0:
            return True
        if len(rest) < size + 2:
            return False
        body = rest[size + 2:]
    return False


def worker_pid(port: int, engine: str) -> int:
    return int(engine_of(get(port, "/health"), engine)["pid"])


def test_a_reader_that_stops_reading_pauses_the_server(box: dict[str, Any]) -> None:
    """
    An utterance of eighteen minutes streamed to a client that reads its head and stops:
    the server is paused after a bounded amount (the kernel buffers along the way and a
    batch, not the utterance: 7.7 MB of 52.8 here), sends nothing more while nobody
    reads, the worker grows by little (1.4 MB here), and once the client hangs up the
    server's stream is let go.
    """
    port, custom = box["port"], box["custom"]
    assert post(port, "/speak", {"engine": "qwen", "text": "Warm up.", "format": "pcm"})[0] == 200
    custom.mode(seconds_per_char=100)  # "A long one." is 1100 s: 52.8 MB of PCM
    try:
        pid = worker_pid(port, "qwen")
        before = resident_kib(pid)
        sent_before = custom.stats()["sent"]
        sock = raw_stream(port, {"engine": "qwen", "text": "A long one.", "format": "pcm"})
        head = sock.recv(4096)
        assert head.startswith(b"HTTP/1.1 200")
        wait_for(lambda: custom.stats()["pauses"] > 0, 30, "the fake server to be paused")
        time.sleep(2)
        first = custom.stats()["sent"] - sent_before
        time.sleep(2)
        second = custom.stats()["sent"] - sent_before
        full = 2 * 24000 * 1100
        # What may wait on the way: the fake's TCP send buffer and the core's to the
        # client, each up to the kernel's tcp_wmem maximum, and a few MB of smaller ones.
        wmem = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
        bound = 2 * wmem + 4 * 1024 * 1024
        assert second < bound < full / 2, f"{second} bytes sent while nobody read (bound {bound})"
        assert second - first < 512 * 1024, "the server went on sending while nobody read"
        assert resident_kib(pid) - before < 32 * 1024
        sock.close()
        wait_for(lambda: custom.stats()["open"] == 0, 30, "the server's stream to be let go")
    finally:
        custom.mode()


def test_a_server_that_dies_mid_stream_cuts_the_body_short(box: dict[str, Any]) -> None:
    """
    A server that drops the connection mid-answer, or sends speech.audio.error, leaves
    the client a chunked body without its last chunk: never a clean short answer.  A
    buffered request gets the taxonomy's error instead, since nothing had gone.
    """
    port, custom = box["port"], box["custom"]
    for mode in ({"die_after": 48000}, {"sse_error_after": 48000}):
        custom.mode(seconds_per_char=1, **mode)
        try:
            raw = read_all(raw_stream(port, {"engine": "qwen", "text": "Speak for a while please.", "format": "pcm"},
                                      receive_buffer=1 << 20))
            assert raw.startswith(b"HTTP/1.1 200") and len(raw) > 4800  # audio went, then the cut
            assert not chunked_complete(raw), f"{mode}: the body ended clean"
            status, _, answer = post(port, "/speak", {"engine": "qwen", "text": "Speak for a while please.",
                                                      "format": "wav", "stream": False})
            error = json.loads(answer)["error"]
            assert (status, error["code"], error["retryable"]) == (503, "model_unavailable", True)
        finally:
            custom.mode()


def test_a_server_that_hangs_is_fenced_until_it_answers(tmp_path: Path) -> None:
    """
    A server that takes connections and answers nothing: a request to it fails within
    its head time as model_unavailable, retryable; the worker reports the variant
    unreachable and the core refuses it at once (503) while the other variant speaks;
    once the server answers again the fence is lifted.
    """
    with fakes(CUSTOM, DESIGN) as (custom, design):
        engines = {"qwen": remote({"custom": {"url": custom.url, "headSeconds": 1, "probeSeconds": 0.5},
                                   "design": {"url": design.url, "probeSeconds": 0.5}})}
        with serving_core(tmp_path, engines, workers={"healthCheckSeconds": 0.5}) as (core, port):
            # Known from its capabilities alone, before anything spoke: nothing to unload here.
            get(port, "/engines/qwen/capabilities")
            status, _, answer = post(port, "/engines/qwen/unload", {})
            assert (status, json.loads(answer)["error"]["code"]) == (422, "unsupported")
            assert post(port, "/speak", {"engine": "qwen", "text": "Hello.", "format": "pcm"})[0] == 200
            custom.mode(hang=True)
            # Answered at all: without the head time the request would hang past post's
            # own 60 s timeout, which raises.
            status, headers, answer = post(port, "/speak", {"engine": "qwen", "text": "Hello.", "format": "pcm"})
            assert (status, json.loads(answer)["error"]["retryable"]) == (503, True)
            wait_for(lambda: "custom" in engine_of(get(port, "/health"), "qwen").get("unreachable", {}), 30,
                     "the core to fence the hung variant")
            assert get(port, "/health")["status"] == "degraded"
            # Refused at once: told by what the hung server holds, not by a clock (a
            # speech request let through would be held there until the head time).
            def speeches() -> list[str]:
                return [path for path in custom.stats()["held"] if path == "/v1/audio/speech"]

            before = speeches()
            assert before, "the request that hung is not among those the server holds"
            status, _, answer = post(port, "/speak", {"engine": "qwen", "text": "Hello.", "format": "pcm"})
            error = json.loads(answer)["error"]
            assert (status, error["code"], error["retryable"]) == (503, "model_unavailable", True)
            assert "custom" in error["message"] and speeches() == before
            status, _, _ = post(port, "/speak", {"engine": "qwen", "variant": "design", "text": "Hello.",
                                                 "instructions": "A calm voice.", "format": "pcm"})
            assert status == 200
            custom.mode()
            wait_for(lambda: "unreachable" not in engine_of(get(port, "/health"), "qwen"), 30, "the fence to lift")
            assert post(port, "/speak", {"engine": "qwen", "text": "Hello.", "format": "pcm"})[0] == 200


def test_the_conformance_checker_passes_the_adapter(tmp_path: Path) -> None:
    """
    rhapsode_conform against the adapter's worker in front of a CustomVoice and a
    VoiceDesign server: every check passes or cannot be decided, none fails.
    """
    with fakes(CUSTOM, DESIGN) as (custom, design):
        port = free_port()
        config = {"variants": {"custom": {"url": custom.url}, "design": {"url": design.url}}}
        env = {**os.environ, "RHAPSODE_WORKER_LISTEN": f"tcp:127.0.0.1:{port}", "RHAPSODE_WORKER_ENGINE": "qwen",
               "RHAPSODE_WORKER_CONTRACT": "1", "RHAPSODE_WORKER_VOICE_DIR": str(tmp_path / "voices"),
               "RHAPSODE_REMOTE_CONFIG": json.dumps(config)}
        worker = subprocess.Popen([engine_python("remote"), "-m", "rhapsode_engine_remote"], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            assert worker.stdout is not None
            assert json.loads(worker.stdout.readline())["ready"] is True
            checked = subprocess.run([sys.executable, "-m", "rhapsode_conform", f"http://127.0.0.1:{port}"],
                                     capture_output=True, text=True, timeout=600)
        finally:
            worker.kill()
            worker.wait()
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "FAIL" not in checked.stdout and "instructions are taken in variant custom" in checked.stdout
    assert "a request without instructions is refused in variant design" in checked.stdout


def test_a_misconfigured_engine_fails_its_start_saying_why(tmp_path: Path) -> None:
    """
    Two variants of different native rates in one engine, or a server that answers
    nothing with no rate to fall back on, end the worker before its handshake (the core
    answers internal), and the worker's log line in the core's log says why.
    """
    with fakes(CUSTOM, FISH) as (custom, fish):
        engines = {"mixed": remote({"custom": {"url": custom.url}, "fish": {"url": fish.url}}),
                   "gone": remote({"x": {"url": f"http://127.0.0.1:{free_port()}"}})}
        with serving_core(tmp_path, engines) as (core, port):
            for engine in ("mixed", "gone"):
                status, _, answer = post(port, "/speak", {"engine": engine, "text": "Hello."})
                assert (status, json.loads(answer)["error"]["code"]) == (500, "internal"), answer
            log = (tmp_path / "core.log").read_text()
            assert "one engine speaks one native rate" in log
            assert "its sample rate is known neither from the catalog nor the configuration" in log


def test_a_known_model_whose_server_is_down_starts_fenced(tmp_path: Path) -> None:
    """
    A variant whose model the configuration names and the catalog knows starts while its
    server is down (its facts are the catalog's), reported unreachable from the first
    health check, refused 503 and retryable, and spoken as soon as the server is there.
    """
    port = free_port()
    engines = {"qwen": remote({"custom": {"url": f"http://127.0.0.1:{port}", "model": CUSTOM, "probeSeconds": 0.5}})}
    with serving_core(tmp_path, engines, workers={"healthCheckSeconds": 0.5}) as (core, core_port):
        assert get(core_port, "/engines/qwen/capabilities")["nativeFormat"]["sampleRate"] == 24000
        wait_for(lambda: "custom" in engine_of(get(core_port, "/health"), "qwen").get("unreachable", {}), 30,
                 "the variant to be reported unreachable")
        status, _, answer = post(core_port, "/speak", {"engine": "qwen", "text": "Hello.", "format": "pcm"})
        assert (status, json.loads(answer)["error"]["retryable"]) == (503, True)
        server = FakeServer(CUSTOM, "--port", str(port))
        try:
            wait_for(lambda: "unreachable" not in engine_of(get(core_port, "/health"), "qwen"), 30,
                     "the server to be reached")
            assert post(core_port, "/speak", {"engine": "qwen", "text": "Hello.", "format": "pcm"})[0] == 200
        finally:
            server.stop()
