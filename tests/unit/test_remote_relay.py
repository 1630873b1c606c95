"""
The remote engine's speech request on the reactor thread (engines/remote, _relay), in
memory: its SSE events parser (the rules the answers are read by), its body reader
against a StringTransport and a Clock (backpressure, the stall clock that runs only while
audio is awaited, letting go), and its endpoint's receive buffer.  The same client
against a real server on loopback is tests/integration/test_remote_relay_live.py.  The
adapter's modules are loaded from the tree (tests/_remote_adapter.py).
"""

from __future__ import annotations

import socket
from typing import Any

import pytest
from _remote_adapter import DONE, delta, event, load, pcm_of
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone, ResponseFailed
from twisted.web.http import PotentialDataLoss

from rhapsode_worker import ModelUnavailable

config, client, stream, relay_module = load("_config", "_client", "_stream", "_relay")
Relay, Reader, HOLD = relay_module.Relay, relay_module.Reader, relay_module.HOLD
Unreachable = client.Unreachable


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


def test_the_first_audio_wakes_the_puller_at_once_and_later_audio_at_the_end_of_the_turn() -> None:
    """
    The first delta goes to a waiting puller as it arrives (first audio waits for
    nothing); after it, the deltas one read brings (Twisted hands them over one at a
    time) reach the puller in one piece at the end of the reactor's turn, so the worker
    sends them as one write; and a reader let go meanwhile leaves no call behind.
    """
    clock = Clock()
    reader, _ = reader_on(clock)
    first = pulled(reader)
    reader.dataReceived(delta(pcm_of(0, 10)))
    assert result(first) == pcm_of(0, 10)
    second = pulled(reader)
    reader.dataReceived(delta(pcm_of(10, 10)))
    reader.dataReceived(delta(pcm_of(20, 10)))
    assert not second.called
    clock.advance(0)
    assert result(second) == pcm_of(10, 10) + pcm_of(20, 10)
    third = pulled(reader)
    reader.dataReceived(delta(pcm_of(30, 10)))
    third.cancel()
    with pytest.raises(CancelledError):
        result(third)
    reader.release()
    clock.advance(0)
    assert clock.getDelayedCalls() == []


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


