"""
The core's public routes in front of a real tone worker (protocol.md sections 4, 6, 7):
streaming relay with the duration trailer, buffered responses, cue stripping and
delivery dropping before dispatch, keep-alive never forwarded, previewUrl rewriting, and
an abort when the worker dies mid-stream.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
import pytest_twisted
from _worker import Worker, engine_of, spawn_worker
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.threads import deferToThread

from rhapsode._fleet.registry import EngineHandle, Registry
from rhapsode._service import Core, build_core
from rhapsode._speech.relay import FLOOR_BYTES
from rhapsode._upstream.pool import WorkerClient

RATE = 24000


class Core:
    def __init__(self, port: Any, app: Core, worker: Worker) -> None:
        self.port = port
        self.app = app
        self.worker = worker

    @property
    def address(self) -> tuple[str, int]:
        host = self.port.getHost()
        return host.host, host.port


async def start_core(tmp_path: Path, engine: str = "tone", admission: Any = None, **spawn: Any) -> AsyncIterator[Core]:
    from twisted.internet import reactor

    worker = await spawn_worker(reactor, tmp_path, engine=engine, **spawn)
    client = WorkerClient(reactor, f"unix:{worker.socket_path}")
    app = build_core(Registry({engine: EngineHandle(engine, client, None)}), reactor=reactor, admission=admission)
    port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(app.site())
    yield Core(port, app, worker)
    app.close()
    await port.stopListening()
    await client.close()
    await worker.stop()


@pytest_twisted.async_yield_fixture()
async def core(tmp_path: Path) -> AsyncIterator[Core]:
    """
    A core on a loopback port whose one engine, "tone", is a real worker reached by URL.
    """
    async for running in start_core(tmp_path):
        yield running


def chatty_env(**knobs: str) -> dict[str, str]:
    env = {"PYTHONPATH": str(Path(__file__).parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.update(knobs)
    return env


@pytest_twisted.async_yield_fixture()
async def slow_core(tmp_path: Path) -> AsyncIterator[Core]:
    """
    A core in front of the chatty test engine, speaking a segment every 0.3 s.
    """
    env = chatty_env(CHATTY_SECONDS_PER_SEGMENT="0.3", CHATTY_SEGMENT_LOG=str(tmp_path / "segments.log"))
    async for running in start_core(tmp_path, engine="chatty", module="chatty_engine", extra_env=env):
        yield running


@pytest_twisted.async_yield_fixture()
async def tiny_core(tmp_path: Path) -> AsyncIterator[Core]:
    """
    A core in front of a chatty engine whose whole answer is 32 bytes: under the floor.
    """
    env = chatty_env(CHATTY_SEGMENT_MS="1")
    async for running in start_core(tmp_path, engine="chatty", module="chatty_engine", extra_env=env):
        yield running


def tcp_request(
    address: tuple[str, int],
    method: str,
    target: str,
    body: bytes = b"",
    stop_after: int | None = None,
    on_body: Any = None,
    content_type: str = "application/json",
) -> Any:
    """
    Blocking raw HTTP/1.1 over TCP, parsed by hand (chunks, trailers, truncation).
    """
    import socket

    from _worker import RawResponse

    sock = socket.create_connection(address)
    sock.sendall(
        f"{method} {target} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
        f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
    )
    data = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
            if on_body is not None and b"\r\n\r\n" in data and not data.endswith(b"\r\n\r\n"):
                on_body()
                on_body = None
            if stop_after is not None and len(data) > stop_after:
                break
    except ConnectionResetError:
        pass
    finally:
        sock.close()
    if not data:
        # The server dropped the connection before any byte: status 0, nothing complete.
        return RawResponse(0, {}, [], {}, False, [], [])
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    chunks: list[bytes] = []
    trailers: dict[str, str] = {}
    complete = False
    if headers.get("transfer-encoding") == "chunked":
        while b"\r\n" in rest:
            size_line, rest = rest.split(b"\r\n", 1)
            size = int(size_line, 16)
            if size == 0:
                block, _, _ = rest.partition(b"\r\n\r\n")
                complete = rest.endswith(b"\r\n\r\n") or rest == b"\r\n"
                for line in block.decode("latin-1").split("\r\n"):
                    if ":" in line:
                        k, v = line.split(":", 1)
                        trailers[k.strip().lower()] = v.strip()
                break
            if len(rest) < size + 2:
                chunks.append(rest[:size])
                break
            chunks.append(rest[:size])
            rest = rest[size + 2:]
    else:
        chunks.append(rest)
        complete = len(rest) == int(headers.get("content-length", -1))
    return RawResponse(status, headers, chunks, trailers, complete, [], [])


async def call(core: Core, method: str, target: str, body: Any = None, **kw: Any) -> Any:
    raw = b"" if body is None else json.dumps(body).encode()
    return await deferToThread(tcp_request, core.address, method, target, raw, **kw)


TEXT = " ".join(f"This is sentence {i}, spoken through the core." for i in range(8))


@pytest_twisted.ensureDeferred
async def test_stream_relayed_in_pieces_with_trailer(core: Core) -> None:
    """
    A streamed /speak arrives chunked and in pieces, byte-identical to the worker's own
    audio for the same seed, and ends with a duration trailer computed from the bytes.
    """
    through = await call(core, "POST", "/speak", {"engine": "tone", "text": TEXT, "format": "pcm", "seed": 5})
    assert through.status == 200 and through.complete
    assert len(through.chunks) > 1
    direct = await core.worker.json("GET", "/health")
    assert direct[0] == 200
    from _worker import deferred_raw

    worker_own = await deferred_raw(
        core.worker.socket_path, "POST", "/speak", json.dumps({"text": TEXT, "format": "pcm", "seed": 5, "variant": "expressive"}).encode()
    )
    assert through.body == worker_own.body
    assert int(through.trailers["x-rhapsode-duration-ms"]) == round(len(through.body) // 2 * 1000 / RATE)


@pytest_twisted.ensureDeferred
async def test_buffered_speak_sets_length_and_duration(core: Core) -> None:
    """
    C{stream: false} through the core carries Content-Length and the duration header.
    """
    response = await call(core, "POST", "/speak", {"engine": "tone", "text": "Hello there.", "stream": False})
    assert response.status == 200 and response.complete
    assert response.headers["content-type"] == "audio/wav"
    assert int(response.headers["content-length"]) == len(response.body)
    assert int(response.headers["x-rhapsode-duration-ms"]) > 300


@pytest.mark.parametrize(
    ("body", "status", "code", "field"),
    [
        ({"engine": "nope", "text": "hi"}, 404, "unknown_engine", "engine"),
        ({"engine": "tone", "text": "hi", "colour": "red"}, 400, "bad_request", "colour"),
        ({"text": "hi"}, 400, "bad_request", "engine"),
        ({"engine": "tone", "text": "hi", "variant": "turbo"}, 422, "unsupported", "variant"),
        ({"engine": "tone", "text": "hi", "keepAliveSeconds": -2}, 400, "bad_request", "keepAliveSeconds"),
        ({"engine": "tone", "text": "hi", "params": {"pitch": 5}, "variant": "classic"}, 400, "bad_request", "params.pitch"),
    ],
)
@pytest_twisted.ensureDeferred
async def test_refusals_carry_the_taxonomy(core: Core, body: dict[str, Any], status: int, code: str, field: str) -> None:
    """
    Bad requests are refused with the code, status and field; an unknown engine lists
    the engines there are; a worker's own refusal is relayed as it gave it.
    """
    response = await call(core, "POST", "/speak", body)
    assert response.status == status
    error = json.loads(response.body)["error"]
    assert (error["code"], error["field"]) == (code, field)
    if code == "unknown_engine":
        assert "tone" in error["message"]


@pytest_twisted.ensureDeferred
async def test_speak_by_another_method_is_refused_like_any_route(core: Core) -> None:
    """
    POST /speak skips the router, but GET /speak and a path below it are refused like
    any other request the router has no route for, at the head, in the envelope: 405
    with Allow for the wrong method, 404 for no such path.
    """
    response = await call(core, "GET", "/speak", {"engine": "tone", "text": "hi"})
    error = json.loads(response.body)["error"]
    assert (response.status, error["code"], error["field"]) == (405, "bad_request", "method")
    assert response.headers.get("allow") == "POST"
    response = await call(core, "POST", "/speak/now", {"engine": "tone", "text": "hi"})
    error = json.loads(response.body)["error"]
    assert (response.status, error["code"], error["field"]) == (404, "bad_request", "path")
    assert error["message"] == "no route /speak/now"


@pytest_twisted.ensureDeferred
async def test_core_strips_cues_and_drops_deliveries_and_keepalive(core: Core) -> None:
    """
    Before dispatch the core strips cues the variant does not claim (closing the space),
    drops a delivery it does not perform, and never forwards keepAliveSeconds: each
    request speaks exactly what the plain one does.
    """
    plain = await call(core, "POST", "/speak", {"engine": "tone", "text": "hi there", "variant": "classic", "format": "pcm", "seed": 2, "stream": False})
    cued = await call(core, "POST", "/speak", {"engine": "tone", "text": "hi [laugh] there", "variant": "classic", "format": "pcm", "seed": 2, "stream": False, "keepAliveSeconds": -1})
    assert cued.status == 200 and cued.body == plain.body
    expressive = await call(core, "POST", "/speak", {"engine": "tone", "text": "hi there", "variant": "expressive", "format": "pcm", "seed": 2, "stream": False})
    hushed = await call(core, "POST", "/speak", {"engine": "tone", "text": "hi there", "variant": "expressive", "delivery": "hushed", "format": "pcm", "seed": 2, "stream": False})
    assert hushed.status == 200 and hushed.body == expressive.body


@pytest_twisted.ensureDeferred
async def test_resident_variant_is_the_effective_default(core: Core) -> None:
    """
    With no variant named, the core resolves the one it last loaded, not the default.
    """
    first = await call(core, "POST", "/speak", {"engine": "tone", "text": "hi", "variant": "classic", "stream": False})
    assert first.status == 200
    # classic takes dials; expressive does not: the dial is accepted only if classic is used.
    second = await call(core, "POST", "/speak", {"engine": "tone", "text": "hi", "params": {"pitch": 1.5}, "stream": False})
    assert second.status == 200


@pytest_twisted.ensureDeferred
async def test_voices_preview_urls_rewritten(core: Core) -> None:
    """
    previewUrl is the one field the core edits: rewritten under the engine's prefix, and
    following it plays the preview.
    """
    response = await call(core, "GET", "/engines/tone/voices")
    voices = json.loads(response.body)
    assert voices and all(v["previewUrl"] == f"/engines/tone/voices/{v['id']}/preview" for v in voices)
    preview = await call(core, "GET", voices[0]["previewUrl"])
    assert preview.status == 200 and preview.headers["content-type"] == "audio/wav"


@pytest_twisted.ensureDeferred
async def test_engines_and_health_never_spawn(core: Core) -> None:
    """
    /engines lists configured engines with what the core knows; /health reports version
    and contract; neither touches the worker.
    """
    engines = json.loads((await call(core, "GET", "/engines")).body)
    assert [e["id"] for e in engines] == ["tone"]
    health = json.loads((await call(core, "GET", "/health")).body)
    assert health["version"] == "0.1.0" and health["contract"] == 1
    # Remote: never asked yet (no health check has run), so taken to be up.
    assert engine_of(health, "tone")["remote"] is True and engine_of(health, "tone")["process"] == "up"


@pytest_twisted.ensureDeferred
async def test_worker_killed_mid_stream_aborts_the_client(slow_core: Core) -> None:
    """
    A worker that dies after headers makes the core abort the client's connection:
    the client sees a truncated body, never a clean short 200.
    """
    text = " ".join(["A sentence of about forty characters."] * 10)
    response = await call(
        slow_core,
        "POST",
        "/speak",
        {"engine": "chatty", "text": text, "format": "pcm"},
        on_body=lambda: os.kill(slow_core.worker.pid, signal.SIGKILL),
    )
    assert response.status == 200
    assert not response.complete
    assert "x-rhapsode-duration-ms" not in response.trailers


def wav_clip(frequency: float = 140.0) -> bytes:
    from test_voices_dialogue import sine_wav

    return sine_wav(frequency)


def raw_tcp(address: tuple[str, int], head: bytes, body: bytes = b"") -> bytes:
    """
    Blocking: send raw bytes and read the answer until the server closes.
    """
    import socket

    sock = socket.create_connection(address)
    sock.sendall(head + body)
    answer = b""
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    except ConnectionResetError:
        pass
    sock.close()
    return answer


@pytest_twisted.ensureDeferred
async def test_voice_upload_streams_through_the_core(core: Core) -> None:
    """
    A voice created through the core is the worker's own (previewUrl under the engine's
    prefix), is listed, speaks, and is deleted through the core.
    """
    from test_voices_dialogue import multipart

    data, ctype = multipart({"id": "viacore", "label": "Via core"}, {"reference": ("clip.wav", wav_clip())})
    answer = await deferToThread(tcp_request, core.address, "POST", "/engines/tone/voices", data, content_type=ctype)
    assert answer.status == 201, answer.body
    voice = json.loads(answer.body)
    assert voice["id"] == "viacore" and voice["previewUrl"] == "/engines/tone/voices/viacore/preview"
    listed = json.loads((await call(core, "GET", "/engines/tone/voices")).body)
    assert "viacore" in [v["id"] for v in listed]
    spoken = await call(core, "POST", "/speak", {"engine": "tone", "text": "hello", "voice": "viacore", "stream": False})
    assert spoken.status == 200
    deleted = await call(core, "DELETE", "/engines/tone/voices/viacore")
    assert (deleted.status, deleted.body) == (204, b"")


def chunked_upload(address: tuple[str, int], target: str, data: bytes, content_type: str) -> tuple[int, bytes]:
    """
    Blocking: POST C{data} with chunked transfer encoding, in 4 KB pieces sent a little
    apart (no length known up front), and read the whole answer.
    """
    import socket
    import time

    sock = socket.create_connection(address)
    try:
        sock.sendall(
            f"POST {target} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
            f"Content-Type: {content_type}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
        )
        for start in range(0, len(data), 4096):
            piece = data[start : start + 4096]
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            time.sleep(0.002)
        sock.sendall(b"0\r\n\r\n")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    finally:
        sock.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        pieces = []
        while True:
            size_line, _, body = body.partition(b"\r\n")
            size = int(size_line, 16)
            if not size:
                break
            pieces.append(body[:size])
            body = body[size + 2 :]
        body = b"".join(pieces)
    return int(head.split()[1]), body


@pytest_twisted.ensureDeferred
async def test_chunked_voice_upload_goes_through_as_it_comes(core: Core) -> None:
    """
    An upload whose length the client does not declare (chunked) is streamed on to the
    worker chunked, and the voice it makes is the worker's.
    """
    from test_voices_dialogue import multipart

    data, ctype = multipart({"id": "chunky", "label": "Chunky"}, {"reference": ("clip.wav", wav_clip())})
    status, body = await deferToThread(chunked_upload, core.address, "/engines/tone/voices", data, ctype)
    assert status == 201, body
    assert json.loads(body)["id"] == "chunky"
    listed = json.loads((await call(core, "GET", "/engines/tone/voices")).body)
    assert "chunky" in [v["id"] for v in listed]


@pytest.mark.parametrize(
    ("extra", "length", "status", "code"),
    [
        ("Origin: https://evil.example\r\n", 1000, 403, "forbidden"),
        ("Origin: null\r\n", 1000, 403, "forbidden"),
        ("", 26_000_001, 413, "bad_request"),
    ],
)
@pytest_twisted.ensureDeferred
async def test_upload_refused_before_its_body_is_read(core: Core, extra: str, length: int, status: int, code: str) -> None:
    """
    A foreign Origin, or a declared upload over 25 MB, is refused from the headers alone:
    the answer comes back although the body was never sent.
    """
    head = (
        f"POST /engines/tone/voices HTTP/1.1\r\nHost: localhost\r\n{extra}"
        f"Content-Type: multipart/form-data; boundary=x\r\nContent-Length: {length}\r\n\r\n"
    ).encode()
    answer = await deferToThread(raw_tcp, core.address, head)
    assert answer.startswith(f"HTTP/1.1 {status} ".encode()), answer[:200]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == code


@pytest_twisted.ensureDeferred
async def test_upload_to_unknown_engine_is_unknown_engine(core: Core) -> None:
    """
    An upload for an engine the registry does not have is refused with unknown_engine.
    """
    head = (
        b"POST /engines/ghost/voices HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Type: multipart/form-data; boundary=x\r\nContent-Length: 5000\r\n\r\n"
    )
    answer = await deferToThread(raw_tcp, core.address, head, b"x" * 5000)
    assert answer.startswith(b"HTTP/1.1 404 ")
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "unknown_engine"


@pytest_twisted.ensureDeferred
async def test_rebound_host_refused_on_delete(core: Core) -> None:
    """
    A loopback caller naming a foreign Host (a DNS-rebound page) cannot delete a voice.
    """
    head = b"DELETE /engines/tone/voices/alto HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n"
    answer = await deferToThread(raw_tcp, core.address, head)
    assert answer.startswith(b"HTTP/1.1 403 ")
    assert "host" in json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["message"]


@pytest_twisted.ensureDeferred
async def test_openapi_document_served_at_running_version(core: Core) -> None:
    """
    GET /openapi.json is the public API's document, versioned as the running core, with
    no worker route in it.
    """
    from rhapsode import __version__

    document = json.loads((await call(core, "GET", "/openapi.json")).body)
    assert document["openapi"] == "3.1.0" and document["info"]["version"] == __version__
    assert "/speak" in document["paths"] and "/terminate" not in document["paths"]


@pytest_twisted.ensureDeferred
async def test_buffered_floor_is_an_error_envelope(tiny_core: Core) -> None:
    """
    A buffered 200 under 256 bytes is not audio: the core answers an error envelope
    instead, since no header has gone out yet.
    """
    response = await call(tiny_core, "POST", "/speak", {"engine": "chatty", "text": "hi", "format": "pcm", "stream": False})
    assert response.status == 500
    error = json.loads(response.body)["error"]
    assert error["code"] == "internal" and "32 bytes" in error["message"]


@pytest_twisted.ensureDeferred
async def test_streamed_floor_is_an_abort(tiny_core: Core) -> None:
    """
    A streamed 200 that ends under 256 bytes is aborted: the client may see the status
    (or, if the abort beat the flush, nothing at all) but never a clean end, so it cannot
    mistake the click for audio.
    """
    response = await call(tiny_core, "POST", "/speak", {"engine": "chatty", "text": "hi", "format": "pcm"})
    assert response.status in (0, 200)
    assert not response.complete and len(response.body) < 256


@pytest_twisted.ensureDeferred
async def test_client_hangup_stops_the_worker(slow_core: Core, tmp_path: Path) -> None:
    """
    A client that hangs up mid-stream through the core cancels the worker's request: a
    drain asked of the worker right after finishes once the abandoned segment returns,
    having begun a few of the text's hundred segments (the engine logs each it begins),
    instead of speaking on to the end of a stream nobody will read.
    """
    text = " ".join(["A sentence of about forty characters."] * 100)
    response = await call(slow_core, "POST", "/speak", {"engine": "chatty", "text": text, "format": "pcm"}, stop_after=200)
    assert not response.complete
    code, _ = await slow_core.worker.json("POST", "/terminate")
    assert code == 202
    assert await slow_core.worker.protocol.ended == 0
    begun = (tmp_path / "segments.log").read_text().split()
    assert 1 <= len(begun) < 50, begun


@pytest.mark.parametrize("fmt", ["opus", "mp3", "flac", "wav", "pcm"])
@pytest_twisted.ensureDeferred
async def test_trailer_carries_the_workers_duration_in_every_format(core: Core, fmt: str) -> None:
    """
    A streamed response through the core ends with the duration the worker reported,
    compressed formats included: the same number the same request streamed as pcm
    ends with, which is its audio's length.  (A buffered answer states its own in its
    header: it is cut without the short first segment, so it differs by a joint.)
    """
    body = {"engine": "tone", "text": TEXT, "format": fmt, "seed": 3}
    reference = await call(core, "POST", "/speak", {**body, "format": "pcm"})
    streamed = await call(core, "POST", "/speak", body)
    assert reference.complete and int(reference.trailers["x-rhapsode-duration-ms"]) == round(
        len(reference.body) // 2 * 1000 / RATE
    )
    assert streamed.status == 200 and streamed.complete
    assert streamed.trailers["x-rhapsode-duration-ms"] == reference.trailers["x-rhapsode-duration-ms"]


def read_responses(data: bytes) -> list[tuple[int, dict[str, str], bytes, dict[str, str]]]:
    """
    Every whole response in C{data}, in order: status, fields, body, trailers.
    """
    answers = []
    while data:
        head, _, data = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        fields = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        body, trailers = b"", {}
        if fields.get("transfer-encoding") == "chunked":
            while True:
                size_line, _, data = data.partition(b"\r\n")
                size = int(size_line, 16)
                if size == 0:
                    block, _, data = data.partition(b"\r\n\r\n") if not data.startswith(b"\r\n") else (b"", b"", data[2:])
                    trailers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in block.decode().split("\r\n") if line)}
                    break
                body, data = body + data[:size], data[size + 2 :]
        else:
            length = int(fields["content-length"])
            body, data = data[:length], data[length:]
        answers.append((int(lines[0].split()[1]), fields, body, trailers))
    return answers


@pytest_twisted.ensureDeferred
async def test_one_connection_carries_speech_and_other_routes_in_order(core: Core) -> None:
    """
    Requests sent together on one kept-alive connection (speech, a health read, speech
    again: the first read by the core's front door, the rest by twisted.web once the
    connection is handed to it) are all answered, in order, each whole.
    """
    def speak(fmt: str, close: bool = False) -> bytes:
        body = json.dumps({"engine": "tone", "text": "Hello there.", "format": fmt, "seed": 2}).encode()
        return (
            b"POST /speak HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n%s"
            b"Content-Length: %d\r\n\r\n%s" % (b"Connection: close\r\n" if close else b"", len(body), body)
        )

    sent = speak("pcm") + speak("wav") + b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n" + speak("pcm", close=True)
    answers = read_responses(await deferToThread(raw_tcp, core.address, sent))
    assert [(status, fields["content-type"].split(";")[0]) for status, fields, _, _ in answers] == [
        (200, "audio/L16"), (200, "audio/wav"), (200, "application/json"), (200, "audio/L16"),
    ]
    pcm, wav, health, again = answers
    assert pcm[2] == again[2] and len(pcm[2]) > FLOOR_BYTES and wav[2].startswith(b"RIFF")
    assert int(pcm[3]["x-rhapsode-duration-ms"]) == round(len(pcm[2]) // 2 * 1000 / RATE)
    assert int(again[3]["x-rhapsode-duration-ms"]) == int(pcm[3]["x-rhapsode-duration-ms"])
    assert json.loads(health[2])["status"] == "ok"


def read_to_close(address: tuple[str, int] | str, raw: bytes, seconds: float = 30) -> tuple[bytes, int]:
    """
    Blocking: send C{raw} to a TCP address or a Unix socket's path, then read until
    the server closes, waiting at most C{seconds} for any one read; returns the head
    and the number of bytes after it.
    """
    import socket

    if isinstance(address, str):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(address)
    else:
        sock = socket.create_connection(address)
    sock.settimeout(seconds)
    sock.sendall(raw)
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        head, _, rest = data.partition(b"\r\n\r\n")
        total = len(rest)
        while True:
            piece = sock.recv(262144)
            if not piece:
                return head, total
            total += len(piece)
    finally:
        sock.close()


@pytest_twisted.ensureDeferred
async def test_a_long_stream_to_a_client_that_asked_to_close_ends_with_the_close(core: Core) -> None:
    """
    A stream long enough to fill its socket, to a client that sent Connection: close,
    ends with the connection closed once the last byte has gone, not left open: through
    the core, and straight from the worker on its Unix socket (whose small buffer is
    full whenever the last audio is written, the case that left connections open).
    """
    text = " ".join(["A long sentence of speech that fills every socket on its way."] * 60)
    cases: list[tuple[Any, dict[str, Any]]] = [(core.address, {"engine": "tone", "text": text, "format": "pcm", "seed": 3})]
    # When the last write fills the socket depends on timing: a few requests make it
    # all but certain that one does.
    cases += [(core.worker.socket_path, {"text": text, "format": "pcm", "seed": seed}) for seed in range(1, 7)]
    for address, payload in cases:
        body = json.dumps(payload).encode()
        raw = (
            b"POST /speak HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        head, size = await deferToThread(read_to_close, address, raw, 10)
        assert head.startswith(b"HTTP/1.1 200 OK") and b"Connection: close" in head
        assert size > 4 * 1024 * 1024
