"""
The core's budget for buffered audio (limits.bufferedBytes, issue 23 section 1) counts what
the core really holds until it has left the process: every route that buffers, through
the core's own site, to a client that reads nothing (a socket whose kernel takes no byte),
keeps its answer counted until the socket has sent it; past the budget a request is
overloaded, retryable, with a Retry-After, and what was admitted is whole.  The batch
counts its items' base64 and the JSON around them, and MCP its tool result's; a timed
answer counts the worker's frames until its document has left.
"""

from __future__ import annotations

import base64
import io
import json
import wave
from typing import Any

import pytest
from _fakes import FakeClient, FakeSupervisor
from _sockets import FakeSocket
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, succeed
from twisted.internet.error import ConnectionLost
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http_headers import Headers

from rhapsode._fleet.registry import EngineHandle, Registry
from rhapsode._service import build_core
from rhapsode_protocol import frames

VARIANT = {
    "cues": [],
    "deliveries": [],
    "dials": {},
    "languages": ["en"],
    "maxCharacters": 4096,
    "segmentation": {"supported": False},
    "streaming": {"supported": True, "granularity": "chunk"},
}
CAPABILITIES = {
    "contract": 1,
    "engine": {"id": "tone", "displayName": "Tone", "adapterVersion": "0.1.0"},
    "license": {"code": "MIT", "weights": "MIT", "weightsCommercialUse": True, "notes": ""},
    "device": {"type": "cpu"},
    "defaultVariant": "expressive",
    "variants": {"expressive": {**VARIANT, "dialogue": {"maxSpeakers": 2}}},
    "formats": ["wav", "pcm"],
    "nativeFormat": {"encoding": "pcm_s16le", "sampleRate": 24000, "channels": 1},
}
VOICES = [{"id": "alto", "label": "Alto", "spec": "alto@1", "tags": [], "previewUrl": "/voices/alto/preview",
           "builtin": True}]
#: A second and a bit of wav: big next to the transport's own 64 KiB buffer.
FRAMES = 100_000


def wav_of(frames: int) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as writer:
        writer.setnchannels(1)
        writer.setsampwidth(2)
        writer.setframerate(24000)
        writer.writeframes(b"\x01\x00" * frames)
    return out.getvalue()


AUDIO = wav_of(FRAMES)


class Limits:
    """
    Admission settings with a buffer budget a test sets.
    """

    def __init__(self, buffered: int) -> None:
        self.buffered = buffered

    def concurrent_per_engine(self, engine: str) -> int:
        return 8

    def queued_per_engine(self, engine: str) -> int:
        return 8

    def queue_wait_seconds(self) -> float:
        return 30.0

    def buffered_bytes(self) -> int:
        return self.buffered


class AudioResponse:
    """
    A worker's buffered answer, delivered at once in the 64 KiB pieces a socket reads.
    """

    code = 200

    def __init__(self, body: bytes) -> None:
        self.headers = Headers({b"Content-Type": [b"audio/wav"], b"X-Rhapsode-Duration-Ms": [b"4166"]})
        self._body = body

    def deliverBody(self, protocol: Any) -> None:
        protocol.makeConnection(StringTransport())
        for at in range(0, len(self._body), 65536):
            protocol.dataReceived(self._body[at:at + 65536])
        protocol.connectionLost(Failure(ResponseDone()))


class Worker(FakeClient):
    """
    A tone worker's client: its capabilities and voices, and AUDIO for every utterance.
    """

    def __init__(self) -> None:
        super().__init__({
            (b"GET", "/capabilities"): (200, CAPABILITIES),
            (b"GET", "/voices"): (200, VOICES),
            (b"GET", "/health"): (200, {}),
        })

    def request(self, method: bytes, path: str, body: Any = None, headers: Any = None) -> "Deferred[Any]":
        self.calls.append((method, path))
        return succeed(AudioResponse(AUDIO))


class Core:
    """
    A core over one fake tone worker, reached through its own site on sockets whose
    kernel takes nothing until a test says so.
    """

    def __init__(self, budget: int, worker: FakeClient | None = None) -> None:
        handle = EngineHandle("tone", worker or Worker(), FakeSupervisor())
        self.app = build_core(Registry({"tone": handle}), reactor=MemoryReactorClock(), admission=Limits(budget))
        self.site = self.app.site(access_log=False)

    @property
    def held(self) -> int:
        return self.app.budget.held

    def send(self, method: bytes, path: bytes, body: Any, *, room: int | None = 0) -> FakeSocket:
        """
        One request on a connection of its own whose client reads nothing (C{room} 0).
        """
        sock = FakeSocket(room=room)
        channel = self.site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 8080))
        channel.makeConnection(sock)
        sock.protocol = channel
        if body is None:
            channel.dataReceived(b"%s %s HTTP/1.1\r\nHost: localhost\r\n\r\n" % (method, path))
            return sock
        data = json.dumps(body).encode()
        channel.dataReceived(
            b"%s %s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (method, path, len(data), data)
        )
        return sock


def read(sock: FakeSocket) -> tuple[int, dict[bytes, bytes], bytes]:
    """
    Let the client read everything: the status, the headers and the body it got.
    """
    sock.room = None
    sock.doWrite()
    head, _, body = b"".join(sock.sent).partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = dict(line.lower().split(b": ", 1) for line in lines[1:])
    if headers.get(b"transfer-encoding") == b"chunked":
        pieces = []
        while True:
            size, _, body = body.partition(b"\r\n")
            if not int(size, 16):
                break
            pieces.append(body[:int(size, 16)])
            body = body[int(size, 16) + 2:]
        body = b"".join(pieces)
    return int(lines[0].split()[1]), headers, body


SPEAK = {"engine": "tone", "text": "Hello there.", "stream": False}
DIALOGUE = {"turns": [{"speaker": "A", "text": "Hello."}, {"speaker": "B", "text": "Hi."}], "stream": False}
ROUTES = {
    "speak": (b"POST", b"/speak", SPEAK),
    "dialogue": (b"POST", b"/engines/tone/dialogue", DIALOGUE),
    "preview": (b"GET", b"/engines/tone/voices/alto/preview", None),
}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_buffered_answer_stays_counted_until_it_has_left_the_process(route: str) -> None:
    """
    A stream:false answer to a client that reads nothing stays counted against the
    budget after it is handed to the transport, so the next one past the budget is
    overloaded (429, retryable, Retry-After) while the first is still queued; once the
    first client reads, its answer is whole and the budget is free again.
    """
    method, path, body = ROUTES[route]
    core = Core(budget=len(AUDIO) * 3 // 2)
    first = core.send(method, path, body)
    assert first.queued() > 0
    assert core.held == len(AUDIO)
    second = core.send(method, path, body, room=None)
    status, headers, refused = read(second)
    assert status == 429 and headers[b"retry-after"] == b"1"
    error = json.loads(refused)["error"]
    assert error["code"] == "overloaded" and error["retryable"] is True
    assert core.held == len(AUDIO)
    status, headers, whole = read(first)
    assert status == 200 and whole == AUDIO and headers[b"content-length"] == b"%d" % len(AUDIO)
    assert core.held == 0
    status, _, again = read(core.send(method, path, body))
    assert status == 200 and again == AUDIO and core.held == 0


def test_a_client_that_goes_gives_its_answer_back() -> None:
    """
    A client that hangs up with its answer still queued frees what the answer held.
    """
    core = Core(budget=len(AUDIO) * 2)
    sock = core.send(*ROUTES["speak"])
    assert core.held == len(AUDIO)
    sock.protocol.connectionLost(Failure(ConnectionLost("gone")))
    assert core.held == 0


def test_an_answer_nobody_reads_for_the_idle_timeout_is_cut_off_and_given_back() -> None:
    """
    A buffered answer is written a piece at a time as its client takes them: one whose
    client takes nothing for the site's idle timeout is cut off, and what it held is
    given back, so a reader that never reads cannot hold the budget for ever.
    """
    core = Core(budget=len(AUDIO) * 2)
    sock = core.send(*ROUTES["speak"])
    assert 0 < sock.queued() < len(AUDIO) // 2  # the socket holds a piece or two, not the answer
    core.app.reactor.advance(59)
    assert not sock.aborted and core.held == len(AUDIO)
    core.app.reactor.advance(2)
    assert sock.aborted and core.held == 0


def batch(*texts: str) -> dict[str, Any]:
    return {"model": "tone", "items": [{"input": text} for text in texts]}


def test_a_batch_counts_its_json_until_the_json_has_left_the_process() -> None:
    """
    A batch's answer is counted whole, its items' base64 and the JSON around them, for
    as long as its client has not read it; the answer is the items' audio in base64.
    """
    core = Core(budget=len(AUDIO) * 4)
    sock = core.send(b"POST", b"/v1/audio/speech/batch", batch("One.", "Two."))
    assert sock.queued() > 0
    held = core.held
    status, headers, body = read(sock)
    assert status == 200 and held == len(body) == int(headers[b"content-length"])
    answer = json.loads(body)
    assert (answer["total"], answer["succeeded"], answer["failed"]) == (2, 2, 0)
    assert [base64.b64decode(r["audio_data"]) for r in answer["results"]] == [AUDIO, AUDIO]
    assert [r["index"] for r in answer["results"]] == [0, 1]
    assert core.held == 0


def test_a_batch_that_crosses_the_budget_is_refused_whole() -> None:
    """
    A batch whose audio and base64 would take the core past its budget is refused as a
    whole, overloaded with Retry-After in OpenAI's envelope, rather than answered with
    the items that fitted; it holds nothing afterwards.
    """
    core = Core(budget=len(AUDIO) * 2)
    status, headers, body = read(core.send(b"POST", b"/v1/audio/speech/batch", batch("One.", "Two."), room=None))
    assert status == 429 and headers[b"retry-after"] == b"1" and headers[b"x-should-retry"] == b"true"
    assert json.loads(body)["error"]["code"] == "overloaded"
    assert core.held == 0


def mcp_call(text: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
            "params": {"name": "speak", "arguments": {"engine": "tone", "text": text}}}


def test_an_mcp_speak_counts_its_result_until_it_has_left_the_process() -> None:
    """
    MCP's speak answers its audio in base64 inside JSON-RPC: the whole answer stays
    counted while its client has not read it, and the audio is what the worker said.
    """
    core = Core(budget=len(AUDIO) * 3)
    sock = core.send(b"POST", b"/mcp", mcp_call("Hello."))
    assert sock.queued() > 0
    held = core.held
    status, _, body = read(sock)
    assert status == 200 and held == len(body)
    content = json.loads(body)["result"]["content"]
    assert base64.b64decode(content[0]["data"]) == AUDIO
    assert core.held == 0


def test_an_mcp_speak_past_the_budget_is_an_overloaded_tool_error_with_retry_after() -> None:
    """
    A speak whose result the budget has no room for is a tool error saying overloaded
    and that a retry can help, and its HTTP answer carries the Retry-After.
    """
    core = Core(budget=len(AUDIO) * 2)
    first = core.send(b"POST", b"/mcp", mcp_call("Hello."))
    status, headers, body = read(core.send(b"POST", b"/mcp", mcp_call("Again."), room=None))
    result = json.loads(body)["result"]
    assert status == 200 and result["isError"] is True and headers[b"retry-after"] == b"1"
    assert result["content"][0]["text"].startswith("overloaded:")
    assert result["content"][0]["text"].endswith("(retryable: true)")
    assert read(first)[0] == 200 and core.held == 0


WORD = {"unit": "word", "text": "Hello", "start": 0.0, "end": 0.4, "textStart": 0, "textEnd": 5}


def timed_frames() -> bytes:
    """A worker's buffered timed answer in frames: its timings, its audio, its end."""
    end = {"format": "wav", "contentType": "audio/wav", "sampleRate": 24000, "channels": 1, "durationMs": 4166}
    return b"".join([
        frames.frame(frames.TIMINGS, json.dumps([WORD]).encode()),
        frames.frame(frames.AUDIO, AUDIO),
        frames.frame(frames.DONE, json.dumps(end).encode()),
    ])


class TimedWorker(Worker):
    """The tone worker, its variant timing words, answering a timed request in frames."""

    def __init__(self) -> None:
        super().__init__()
        timed = {**CAPABILITIES["variants"]["expressive"],  # type: ignore[dict-item]
                 "timestamps": {"units": ["word"], "source": "synthesizer", "textOffsets": True}}
        self.answers[(b"GET", "/capabilities")] = (200, {**CAPABILITIES, "variants": {"expressive": timed}})

    def request(self, method: bytes, path: str, body: Any = None, headers: Any = None) -> "Deferred[Any]":
        self.calls.append((method, path))
        response = AudioResponse(timed_frames())
        response.headers = Headers({b"Content-Type": [frames.FRAMES.encode()]})
        return succeed(response)


def test_a_buffered_timed_answer_stays_counted_until_it_has_left_the_process() -> None:
    """
    With timestamps, the worker's frames stay counted while the document waits for a
    client that reads nothing, and are given back once it has read the whole document.
    """
    core = Core(len(AUDIO) * 2, TimedWorker())
    body = {**SPEAK, "timestamps": "word"}
    sock = FakeSocket(room=0)
    channel = core.site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 8080))
    channel.makeConnection(sock)
    sock.protocol = channel
    data = json.dumps(body).encode()
    channel.dataReceived(
        b"POST /speak HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nAccept: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(data), data)
    )
    assert core.held == len(timed_frames())
    status, headers, raw = read(sock)
    document = json.loads(raw)
    assert status == 200 and headers[b"content-type"] == b"application/json"
    assert base64.b64decode(document["audio"]) == AUDIO and document["alignment"] == [WORD]
    assert core.held == 0
