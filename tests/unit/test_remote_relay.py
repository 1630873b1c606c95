"""
The remote engine's speech request on the reactor thread (engines/remote, _relay): its
SSE events parser (the rules the answers are read by), its body reader against a
StringTransport and a Clock (backpressure, the stall clock that runs only while audio is
awaited, letting go), and Twisted's HTTP client against a real twisted.web server on
loopback in this process (pytest-twisted's reactor): SSE and raw PCM read as they
stream, a slow puller pausing the server, a reader let go mid-stream closing its
connection, an error event, an end without done, a stall, no head in time, a refused
connection, a kept-alive connection reused (and replaced once when the server dropped
it), refusals read to a cap, and HTTPS.

The adapter's package is not installed in the core's virtualenv (its Engine reads the
installed distribution's version), so its modules are loaded under an empty package as
test_engine_remote_pure does; these import nothing of the engine but Twisted and the SDK.
No test bounds time but as a hang guard.
"""

from __future__ import annotations

import base64
import datetime
import importlib.machinery
import importlib.util
import json
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import pytest
import pytest_twisted
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IPushProducer
from twisted.internet.task import Clock, deferLater
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.web import resource, server
from twisted.web.client import ResponseDone, ResponseFailed
from twisted.web.http import PotentialDataLoss
from zope.interface import implementer

from rhapsode_worker import ModelUnavailable

SRC = Path(__file__).resolve().parents[2] / "engines" / "remote" / "src" / "rhapsode_engine_remote"
MODULES = ("_config", "_client", "_stream", "_relay")

#: A hang guard, never a bound on how fast anything is.
GUARD = 30.0


def _load() -> tuple[Any, ...]:
    name = "rhapsode_engine_remote"
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    package = importlib.util.module_from_spec(spec)
    package.__path__ = [str(SRC)]
    saved = sys.modules.get(name)
    sys.modules[name] = package
    try:
        loaded = []
        for module in MODULES:
            module_spec = importlib.util.spec_from_file_location(f"{name}.{module}", SRC / f"{module}.py")
            assert module_spec is not None and module_spec.loader is not None
            found = importlib.util.module_from_spec(module_spec)
            sys.modules[f"{name}.{module}"] = found
            module_spec.loader.exec_module(found)
            loaded.append(found)
        return tuple(loaded)
    finally:
        for module in MODULES:
            sys.modules.pop(f"{name}.{module}", None)
        if saved is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = saved


config, client, stream, relay_module = _load()
Relay, Reader, HOLD = relay_module.Relay, relay_module.Reader, relay_module.HOLD
Unreachable = client.Unreachable


# -- what servers send -------------------------------------------------------------------

def event(kind: str, **more: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + json.dumps({"type": kind, **more}).encode() + b"\n\n"


def delta(pcm: bytes) -> bytes:
    return event("speech.audio.delta", audio=base64.b64encode(pcm).decode(), response_format="pcm")


DONE = event("speech.audio.done", usage={})


def pcm_of(n: int, size: int = 4800) -> bytes:
    return bytes([n % 256, 0]) * (size // 2)


# -- the events parser -------------------------------------------------------------------

def parsed(*pieces: bytes) -> list[bytes]:
    events = stream.Events("x")
    out: list[bytes] = []
    for piece in pieces:
        out.extend(events.feed(piece))
    return out


def test_events_are_the_deltas_pcm_until_done_however_the_bytes_are_cut() -> None:
    """
    Each delta's PCM in order, nothing after speech.audio.done, whether the body comes
    whole, a byte at a time, or with CRLF line ends; comments and ids are skipped.
    """
    body = b": comment\nid: 1\n" + delta(pcm_of(1)) + delta(pcm_of(2)) + DONE + delta(pcm_of(3))
    for sent in (body, body.replace(b"\n", b"\r\n")):
        assert parsed(sent) == [pcm_of(1), pcm_of(2)]
        assert b"".join(parsed(*(sent[i:i + 1] for i in range(len(sent))))) == pcm_of(1) + pcm_of(2)
        assert b"".join(parsed(*(sent[i:i + 1000] for i in range(0, len(sent), 1000)))) == pcm_of(1) + pcm_of(2)
    events = stream.Events("x")
    list(events.feed(body))
    assert events.done
    events.end()  # ended whole: nothing to raise


@pytest.mark.parametrize("tail, said", [
    (event("speech.audio.error", error={"message": "CUDA error"}), "failed while speaking: CUDA error"),
    (b"data: {not json}\n\n", "not JSON"),
    (b"data: " + b"[" * 5000 + b"]" * 5000 + b"\n\n", "not JSON"),
    (b'data: {"type": "speech.audio.delta", "audio": "***"}\n\n', "not base64"),
    (b'data: {"type": "speech.audio.delta", "audio": 7}\n\n', "not base64"),
])
def test_an_event_that_fails_or_cannot_be_read_fails_after_the_audio_before_it(tail: bytes, said: str) -> None:
    """
    An error event (its message kept), an event that is not JSON or nests too deep, or a
    delta that is not base64: model_unavailable, raised after the PCM fed before it.
    """
    events = stream.Events("http://gpu:8091")
    got: list[bytes] = []
    with pytest.raises(ModelUnavailable) as failed:
        for pcm in events.feed(delta(pcm_of(1)) + tail):
            got.append(pcm)
    assert got == [pcm_of(1)]
    assert said in str(failed.value) and "http://gpu:8091" in str(failed.value)


def test_an_end_without_done_fails() -> None:
    """The body ending before speech.audio.done is a failure, never a short success."""
    events = stream.Events("x")
    assert list(events.feed(delta(pcm_of(1)))) == [pcm_of(1)]
    with pytest.raises(ModelUnavailable, match="without speech.audio.done"):
        events.end()


def test_a_line_or_an_event_longer_than_the_limit_is_refused_not_held() -> None:
    """
    A line with no end past the limit fails as it grows, as does an event whose data
    lines add up past it: what a server sends is never held without bound.
    """
    events = stream.Events("x")
    with pytest.raises(ModelUnavailable, match="longer than"):
        for piece in range(stream._LINE_LIMIT // 65536 + 2):
            list(events.feed(b"x" * 65536))
    line = b"data: " + b"A" * (1024 * 1024) + b"\n"
    events = stream.Events("x")
    with pytest.raises(ModelUnavailable, match="longer than"):
        for piece in range(9):
            list(events.feed(line))


# -- the body reader, on a StringTransport and a Clock ------------------------------------

def reader_on(clock: Clock, sse: bool = True, stall: float = 5.0) -> tuple[Any, StringTransport]:
    reader = Reader(clock, "http://gpu:8091", stall, stream.Events("http://gpu:8091") if sse else None)
    transport = StringTransport()
    reader.makeConnection(transport)
    return reader, transport


def pulled(reader: Any) -> "Deferred[bytes | None]":
    return Deferred.fromCoroutine(reader.next())


def result(d: "Deferred[Any]") -> Any:
    box: list[Any] = []
    d.addBoth(box.append)
    assert box, "the Deferred has not fired"
    if isinstance(box[0], Failure):
        box[0].raiseException()
    return box[0]


def test_audio_held_past_the_bound_pauses_the_transport_and_a_pull_resumes_it() -> None:
    """
    Deltas arriving while nobody pulls are held up to the bound, then the transport is
    paused; one pull takes everything held, in one piece, and resumes it.
    """
    clock = Clock()
    reader, transport = reader_on(clock)
    sent = b""
    while transport.producerState == "producing":
        piece = pcm_of(len(sent), 16384)
        reader.dataReceived(delta(piece))
        sent += piece
        assert reader.held <= HOLD + 16384
    assert reader.paused and reader.held > HOLD
    assert result(pulled(reader)) == sent
    assert transport.producerState == "producing" and not reader.paused and reader.held == 0


def test_only_silence_while_audio_is_awaited_counts_as_a_stall() -> None:
    """
    A reader that does not pull lets the server be silent as long as it likes; once it
    waits for audio, the stall time runs (restarted by part of an event), and when it
    passes the pull fails as model_unavailable and the connection is closed.
    """
    clock = Clock()
    reader, transport = reader_on(clock, stall=5.0)
    reader.dataReceived(delta(pcm_of(1)))
    clock.advance(500)
    assert not transport.disconnecting
    assert result(pulled(reader)) == pcm_of(1)
    waiting = pulled(reader)
    clock.advance(4)
    reader.dataReceived(b"data: {")  # a piece of an event: not silence
    clock.advance(4)
    assert not waiting.called
    clock.advance(1.5)
    with pytest.raises(ModelUnavailable, match="stall"):
        result(waiting)
    assert transport.disconnecting and clock.getDelayedCalls() == []


def test_a_body_read_to_its_end_is_left_for_the_pool_and_one_let_go_mid_stream_is_closed() -> None:
    """
    After speech.audio.done and the body's end the reader lets go without touching the
    connection (Twisted pools it); one let go mid-stream closes it, and what comes after
    is not kept.
    """
    clock = Clock()
    reader, transport = reader_on(clock)
    reader.dataReceived(delta(pcm_of(1)) + DONE)
    assert result(pulled(reader)) == pcm_of(1)
    ending = pulled(reader)  # waits a turn for the body's end, which Twisted is parsing
    reader.connectionLost(Failure(ResponseDone()))
    assert result(ending) is None
    reader.release()
    assert not transport.disconnecting and clock.getDelayedCalls() == []

    reader, transport = reader_on(clock)
    reader.dataReceived(delta(pcm_of(1)))
    assert result(pulled(reader)) == pcm_of(1)
    reader.release()
    clock.advance(0)  # closed a turn later, out of the parsing of any read
    assert transport.disconnecting
    reader.dataReceived(delta(pcm_of(2)))
    assert reader.held == 0 and clock.getDelayedCalls() == []


def test_done_whose_body_end_does_not_come_is_closed_after_the_stall_time() -> None:
    """
    A body that goes on after speech.audio.done: its end is waited for a reactor turn
    before the reader ends, and once let go, at most the stall time; then it is closed
    rather than pooled.
    """
    clock = Clock()
    reader, transport = reader_on(clock, stall=5.0)
    reader.dataReceived(delta(pcm_of(1)) + DONE)
    assert result(pulled(reader)) == pcm_of(1)
    ending = pulled(reader)
    clock.advance(0)
    assert result(ending) is None
    reader.release()
    assert not transport.disconnecting
    clock.advance(5)
    assert transport.disconnecting


def test_a_cancelled_pull_leaves_no_timer_and_the_reader_can_be_let_go() -> None:
    """
    The SDK cancels the pull its reader no longer wants: the wait fails with
    CancelledError, its stall timer goes with it, and letting go closes the connection.
    """
    clock = Clock()
    reader, transport = reader_on(clock)
    waiting = pulled(reader)
    waiting.cancel()
    with pytest.raises(CancelledError):
        result(waiting)
    assert clock.getDelayedCalls() == []
    reader.release()
    clock.advance(0)
    assert transport.disconnecting


def test_a_raw_body_ends_whole_only_at_its_end() -> None:
    """
    Raw PCM as it arrives; the body's end (or a close that is its end) ends it; a body
    that breaks off fails as model_unavailable.
    """
    for end in (ResponseDone(), PotentialDataLoss()):
        reader, _ = reader_on(Clock(), sse=False)
        reader.dataReceived(b"\x01\x02\x03")
        reader.connectionLost(Failure(end))
        assert result(pulled(reader)) == b"\x01\x02\x03"
        assert result(pulled(reader)) is None
    reader, _ = reader_on(Clock(), sse=False)
    reader.dataReceived(b"\x01\x02")
    reader.connectionLost(Failure(ResponseFailed([Failure(ConnectionResetError())])))
    assert result(pulled(reader)) == b"\x01\x02"
    with pytest.raises(ModelUnavailable, match="broke off"):
        result(pulled(reader))


def test_each_new_connection_gets_the_small_receive_buffer() -> None:
    """
    The endpoint sets SO_RCVBUF to RECEIVE_BUFFER on each connection it opens (so that a
    paused reader's pause reaches the server), and counts them.
    """
    set_options: list[tuple[int, int, int]] = []

    class Socket:
        def setsockopt(self, level: int, option: int, value: int) -> None:
            set_options.append((level, option, value))

    class Transport:
        def getHandle(self) -> Socket:
            return Socket()

    class Connected:
        transport = Transport()

    class Endpoint:
        def connect(self, factory: Any) -> "Deferred[Any]":
            d: Deferred[Any] = Deferred()
            d.callback(Connected())
            return d

    endpoints = relay_module._Endpoints(Clock(), config.ServerConfig(url="http://10.0.0.9:8091"), None)
    counted = relay_module._Counted(Endpoint(), endpoints)
    result(counted.connect(None))
    assert set_options == [(socket.SOL_SOCKET, socket.SO_RCVBUF, client.RECEIVE_BUFFER)]
    assert endpoints.opened == 1


# -- a real server on loopback -----------------------------------------------------------

@pytest.fixture
def reactor() -> Any:
    """The global reactor, which pytest-twisted runs (imported here, never at module level)."""
    from twisted.internet import reactor as running

    return running


@implementer(IPushProducer)
class Endless:
    """An SSE answer that never ends, written as fast as its transport takes it."""

    def __init__(self, reactor: Any, request: Any) -> None:
        self.reactor, self.request = reactor, request
        self.sent = self.pauses = 0
        self.paused = self.gone = False
        self._call: Any = None
        request.registerProducer(self, True)
        request.notifyFinish().addBoth(lambda _: self.stopProducing())
        self._schedule()

    def _schedule(self) -> None:
        if self._call is None and not (self.paused or self.gone):
            self._call = self.reactor.callLater(0, self._write)

    def _write(self) -> None:
        self._call = None
        piece = pcm_of(self.sent, 12288)
        self.request.write(delta(piece))
        self.sent += len(piece)
        self._schedule()

    def pauseProducing(self) -> None:
        self.paused = True
        self.pauses += 1

    def resumeProducing(self) -> None:
        self.paused = False
        self._schedule()

    def stopProducing(self) -> None:
        self.gone = True
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None


class Speaker(resource.Resource):
    """
    POST answers as C{answer} says (one of the methods below, set by the test); records
    what each request carried, and which requests lost their connection.
    """

    isLeaf = True

    def __init__(self, reactor: Any) -> None:
        super().__init__()
        self.reactor = reactor
        self.answer: Callable[[Any], Any] = self.sse
        self.bodies: list[bytes] = []
        self.keys: list[str | None] = []
        self.types: list[str | None] = []
        self.lost: list[Any] = []
        self.open: list[Any] = []
        #: Each connection a request came on, to be closed after the test.
        self.transports: list[Any] = []
        self.streams: list[Endless] = []
        self.drops = 0

    def render_POST(self, request: Any) -> Any:
        self.bodies.append(request.content.read())
        self.keys.append(request.getHeader("authorization"))
        self.types.append(request.getHeader("content-type"))
        if request.channel.transport not in self.transports:
            self.transports.append(request.channel.transport)
        self.open.append(request)
        request.notifyFinish().addCallbacks(lambda _: self.open.remove(request),
                                            lambda _: (self.open.remove(request), self.lost.append(request)))
        return self.answer(request)

    def sse(self, request: Any) -> Any:
        for n in range(3):
            request.write(delta(pcm_of(n)))
        request.write(DONE)
        request.finish()
        return server.NOT_DONE_YET

    def endless(self, request: Any) -> Any:
        self.streams.append(Endless(self.reactor, request))
        return server.NOT_DONE_YET

    def error_event(self, request: Any) -> Any:
        request.write(delta(pcm_of(1)))
        request.write(event("speech.audio.error", error={"message": "CUDA out of memory"}))
        request.finish()
        return server.NOT_DONE_YET

    def no_done(self, request: Any) -> Any:
        request.write(delta(pcm_of(1)))
        request.finish()
        return server.NOT_DONE_YET

    def one_then_silence(self, request: Any) -> Any:
        request.write(delta(pcm_of(1)))
        return server.NOT_DONE_YET

    def silence(self, request: Any) -> Any:
        return server.NOT_DONE_YET

    def raw(self, request: Any) -> Any:
        return pcm_of(7, 10000)  # with its Content-Length

    def raw_cut_short(self, request: Any) -> Any:
        request.setHeader("Content-Length", "10000")
        request.write(pcm_of(7, 1000))
        self.reactor.callLater(0, request.transport.loseConnection)  # what was written goes first
        return server.NOT_DONE_YET

    def refuse(self, request: Any) -> Any:
        request.setResponseCode(400)
        return json.dumps({"error": {"message": "Unknown speaker 'nobody'", "param": "voice"}}).encode()

    def refuse_at_length(self, request: Any) -> Any:
        request.setResponseCode(503)
        return b"overloaded " * (client.ANSWER_LIMIT // 5)

    def drop_once(self, request: Any) -> Any:
        # A kept-alive connection the server closes as the request arrives: what the
        # client finds when the server dropped an idle connection just as it was reused.
        self.answer = self.sse
        self.drops += 1
        request.transport.abortConnection()
        return server.NOT_DONE_YET

    def drop(self, request: Any) -> Any:
        self.drops += 1
        request.transport.abortConnection()
        return server.NOT_DONE_YET


class Counted(server.Site):
    """A site that counts the connections it accepted."""

    def __init__(self, root: Any) -> None:
        super().__init__(root)
        self.channels: list[Any] = []

    def buildProtocol(self, addr: Any) -> Any:
        channel = super().buildProtocol(addr)
        self.channels.append(channel)
        return channel


@dataclass
class Served:
    reactor: Any
    speaker: Speaker
    site: Counted
    url: str
    relays: list[Any] = field(default_factory=list)

    def relay(self, url: str | None = None, tls: Any = None, **settings: Any) -> Any:
        made = Relay(config.ServerConfig(url=url or self.url, key="sk-test", **settings), self.reactor, tls=tls)
        self.relays.append(made)
        return made


async def until(reactor: Any, check: Callable[[], bool], what: str) -> None:
    """Poll C{check} on the reactor until it holds; fail past the hang guard."""
    waited = 0.0
    while not check():
        assert waited < GUARD, f"waited past the hang guard for {what}"
        await deferLater(reactor, 0.01, lambda: None)
        waited += 0.01


async def cleaned(reactor: Any, served: Served, listening: Any) -> None:
    # A turn first: what the test did last may have run inside the parsing of a read,
    # which pools its connection once it is parsed.
    await deferLater(reactor, 0, lambda: None)
    for made in served.relays:
        await made.close()
    for transport in served.speaker.transports:
        if transport.connected:
            transport.abortConnection()
    await listening.stopListening()
    await until(reactor, lambda: not any(t.connected for t in served.speaker.transports),
                "the server's connections to close")
    await deferLater(reactor, 0, lambda: None)
    # Nothing of the relay's left timed on the reactor: no reader's timer, no pool's.
    from twisted.web.client import HTTPConnectionPool

    left = [call for call in reactor.getDelayedCalls()
            if isinstance(getattr(call.func, "__self__", None), (Reader, HTTPConnectionPool))]
    assert left == []


@pytest_twisted.async_yield_fixture
async def served(reactor: Any) -> AsyncIterator[Served]:
    """A speech server on a loopback port in this process, closed after the test."""
    speaker = Speaker(reactor)
    site = Counted(speaker)
    listening = reactor.listenTCP(0, site, interface="127.0.0.1")
    done = Served(reactor, speaker, site, f"http://127.0.0.1:{listening.getHost().port}")
    yield done
    await cleaned(reactor, done, listening)


async def speech(relay: Any, sse: bool = True) -> AsyncIterator[bytes]:
    """What the engine's speak() does with a relay: the request, then the audio as pulled."""
    response = await relay.request(b"POST", "/v1/audio/speech", b'{"input": "Hello."}')
    assert response.code == 200
    reader = relay.read(response, sse=sse, where=relay.origin)
    try:
        while (pcm := await reader.next()) is not None:
            yield pcm
    finally:
        reader.release()


async def collected(chunks: AsyncIterator[bytes]) -> bytes:
    return b"".join([pcm async for pcm in chunks])


@pytest_twisted.ensureDeferred
async def test_an_sse_answer_is_read_as_it_streams_with_the_key_and_body_sent(served: Served) -> None:
    """
    The deltas' PCM in order, the request carrying its JSON body and the bearer key.
    """
    relay = served.relay()
    assert await collected(speech(relay)) == pcm_of(0) + pcm_of(1) + pcm_of(2)
    assert served.speaker.bodies == [b'{"input": "Hello."}'] and served.speaker.keys == ["Bearer sk-test"]
    assert served.speaker.types == ["application/json"]


@pytest_twisted.ensureDeferred
async def test_a_kept_alive_connection_serves_the_next_request(served: Served) -> None:
    """
    Two answers read to their end, one after the other, over one connection: the
    server accepted one, and the relay opened one.
    """
    relay = served.relay()
    for _ in range(2):
        assert len(await collected(speech(relay))) == 3 * 4800
    assert len(served.site.channels) == 1 and relay.opened == 1
    served.speaker.answer = served.speaker.raw
    assert await collected(speech(relay, sse=False)) == pcm_of(7, 10000)
    assert len(served.site.channels) == 1


@pytest_twisted.ensureDeferred
async def test_a_slow_puller_pauses_the_server_holding_a_bounded_amount(served: Served) -> None:
    """
    A server that writes as fast as it may, to a puller that takes one piece and stops:
    the reader pauses its transport, holds no more than its bound and one read, and the
    server is paused and stops sending; a pull resumes it all; letting go mid-stream
    closes the connection.
    """
    reactor, speaker = served.reactor, served.speaker
    speaker.answer = speaker.endless
    relay = served.relay()
    response = await relay.request(b"POST", "/v1/audio/speech", b"{}")
    reader = relay.read(response, sse=True, where=relay.origin)
    try:
        assert await reader.next()
        most = 0
        quiet = 0
        last = -1

        def settled() -> bool:
            # Paused, and nothing more sent for a while: the kernel's buffers on the way
            # (the server's send buffer grows on its own) are full.
            nonlocal most, quiet, last
            most = max(most, reader.held)
            if not speaker.streams:
                return False
            endless = speaker.streams[0]
            quiet = quiet + 1 if endless.paused and endless.sent == last else 0
            last = endless.sent
            return quiet >= 30

        await until(reactor, settled, "the server to be paused for good")
        endless = speaker.streams[0]
        assert reader.paused and endless.pauses > 0
        assert most <= HOLD + 65536, f"held {most} bytes"
        sent = endless.sent
        assert sent < 64 * 1024 * 1024  # the kernel's buffers, not an endless stream
        assert await reader.next()
        assert not reader.paused
        await until(reactor, lambda: endless.sent > sent, "the server to send again")
    finally:
        reader.release()
    await until(reactor, lambda: speaker.lost != [], "the server to see the connection closed")
    assert speaker.streams[0].gone


@pytest_twisted.ensureDeferred
async def test_closing_the_speech_mid_stream_closes_its_connection(served: Served) -> None:
    """
    aclose() on the audio mid-stream (the client went away) closes the connection: the
    server sees it lost, and the next request opens another rather than reuse half a body.
    """
    served.speaker.answer = served.speaker.endless
    relay = served.relay()
    chunks = speech(relay)
    assert await chunks.__anext__()
    await chunks.aclose()
    await until(served.reactor, lambda: served.speaker.lost != [], "the server to see the connection closed")
    served.speaker.answer = served.speaker.sse
    assert len(await collected(speech(relay))) == 3 * 4800
    assert len(served.site.channels) == 2 and relay.opened == 2


@pytest_twisted.ensureDeferred
async def test_an_error_event_fails_after_the_audio_before_it(served: Served) -> None:
    """speech.audio.error: the audio before it, then model_unavailable with the server's message."""
    served.speaker.answer = served.speaker.error_event
    got: list[bytes] = []
    with pytest.raises(ModelUnavailable, match="CUDA out of memory"):
        async for pcm in speech(served.relay()):
            got.append(pcm)
    assert got == [pcm_of(1)]


@pytest_twisted.ensureDeferred
async def test_an_sse_answer_that_ends_without_done_fails(served: Served) -> None:
    """A body that ends whole but without speech.audio.done is a failure, not a short answer."""
    served.speaker.answer = served.speaker.no_done
    with pytest.raises(ModelUnavailable, match="without speech.audio.done"):
        await collected(speech(served.relay()))


@pytest_twisted.ensureDeferred
async def test_a_raw_body_cut_short_fails(served: Served) -> None:
    """A PCM body that breaks off before its Content-Length is model_unavailable."""
    served.speaker.answer = served.speaker.raw_cut_short
    with pytest.raises(ModelUnavailable, match="broke off"):
        await collected(speech(served.relay(), sse=False))


@pytest_twisted.ensureDeferred
async def test_a_server_silent_mid_stream_stalls_and_is_let_go(served: Served) -> None:
    """
    Silence past stall_seconds while audio is awaited: model_unavailable, and the
    connection closed.
    """
    served.speaker.answer = served.speaker.one_then_silence
    chunks = speech(served.relay(stall_seconds=0.2))
    assert await chunks.__anext__() == pcm_of(1)
    with pytest.raises(ModelUnavailable, match="stall"):
        await chunks.__anext__()
    await until(served.reactor, lambda: served.speaker.lost != [], "the server to see the connection closed")


@pytest_twisted.ensureDeferred
async def test_no_head_in_time_is_unreachable_and_the_connection_closed(served: Served) -> None:
    """
    A server that takes the request and answers nothing: Unreachable past head_seconds,
    saying so, and its connection closed.
    """
    served.speaker.answer = served.speaker.silence
    relay = served.relay(head_seconds=0.2)
    with pytest.raises(Unreachable, match="did not answer within 0.2 s"):
        await relay.request(b"POST", "/v1/audio/speech", b"{}")
    await until(served.reactor, lambda: served.speaker.lost != [], "the server to see the connection closed")


@pytest_twisted.ensureDeferred
async def test_a_cancelled_wait_for_the_head_is_cancelled_not_unreachable(served: Served) -> None:
    """
    The SDK cancelling the pull that waits for the head (its client went away) ends it
    with CancelledError, never as a server that cannot be reached, and closes the
    connection.
    """
    served.speaker.answer = served.speaker.silence
    relay = served.relay()
    waiting = Deferred.fromCoroutine(relay.request(b"POST", "/v1/audio/speech", b"{}"))
    await until(served.reactor, lambda: served.speaker.open != [], "the request to arrive")
    waiting.cancel()
    with pytest.raises(CancelledError):
        await waiting
    await until(served.reactor, lambda: served.speaker.lost != [], "the server to see the connection closed")


@pytest_twisted.ensureDeferred
async def test_a_refused_connection_is_unreachable(reactor: Any) -> None:
    """Nothing listening: Unreachable, saying the connection was refused."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    relay = Relay(config.ServerConfig(url=f"http://127.0.0.1:{port}"), reactor)
    with pytest.raises(Unreachable, match="could not be reached .*refused"):
        await relay.request(b"POST", "/v1/audio/speech", b"{}")
    await relay.close()


@pytest_twisted.ensureDeferred
async def test_a_kept_alive_connection_the_server_dropped_is_replaced_once(served: Served) -> None:
    """
    A reused connection the server closes as the request arrives: the request goes once
    more, on a new connection, and is answered.  A new connection dropped is not tried
    again: Unreachable.
    """
    relay = served.relay()
    await collected(speech(relay))
    served.speaker.answer = served.speaker.drop_once
    assert len(await collected(speech(relay))) == 3 * 4800
    assert served.speaker.drops == 1 and len(served.site.channels) == 2
    served.speaker.answer = served.speaker.drop
    fresh = served.relay()
    with pytest.raises(Unreachable, match="dropped the connection"):
        await fresh.request(b"POST", "/v1/audio/speech", b"{}")
    assert served.speaker.drops == 2


@pytest_twisted.ensureDeferred
async def test_a_refusal_is_read_to_the_cap(served: Served) -> None:
    """
    An error status's body is read for the server's message and param (its connection
    then serves the next request), and one longer than ANSWER_LIMIT is read no further
    (its connection closed, not pooled).
    """
    relay = served.relay()
    served.speaker.answer = served.speaker.refuse
    response = await relay.request(b"POST", "/v1/audio/speech", b"{}")
    error = await relay.error_of(response)
    assert (error.status, error.message, error.param) == (400, "Unknown speaker 'nobody'", "voice")
    refused = stream.refusal(error, relay.origin, "nobody")
    assert refused.code == "unknown_voice"
    served.speaker.answer = served.speaker.refuse_at_length
    response = await relay.request(b"POST", "/v1/audio/speech", b"{}")
    error = await relay.error_of(response)
    assert error.status == 503 and error.message.startswith("overloaded")
    await until(served.reactor, lambda: not served.speaker.transports[-1].connected,
                "the long answer's connection to close")
    assert len(served.speaker.transports) == 1  # the refusal, read whole, left its connection for the next


def self_signed() -> tuple[bytes, bytes]:
    """A certificate for localhost and its key, PEM."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


@pytest.mark.filterwarnings("ignore:Passing pyOpenSSL:DeprecationWarning")  # the test server's own certificate
@pytest_twisted.ensureDeferred
async def test_an_https_server_is_spoken_to_over_tls(reactor: Any) -> None:
    """
    A URL that says https: TLS to the server (verified against the roots given), the
    SSE read as over plain HTTP, the connection kept alive for the next request.
    """
    ssl = pytest.importorskip("twisted.internet.ssl")
    cert_pem, key_pem = self_signed()
    certificate = ssl.PrivateCertificate.loadPEM(cert_pem + key_pem)
    speaker = Speaker(reactor)
    site = Counted(speaker)
    listening = reactor.listenSSL(0, site, certificate.options(), interface="127.0.0.1")
    url = f"https://localhost:{listening.getHost().port}"
    served = Served(reactor, speaker, site, url)
    try:
        trusted = ssl.Certificate.loadPEM(cert_pem)
        relay = served.relay(tls=lambda host: ssl.optionsForClientTLS(host, trustRoot=trusted))
        for _ in range(2):
            assert await collected(speech(relay)) == pcm_of(0) + pcm_of(1) + pcm_of(2)
        assert len(site.channels) == 1
    finally:
        await cleaned(reactor, served, listening)
