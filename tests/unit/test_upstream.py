"""
The core's HTTP/1.1 client for worker connections (rhapsode._upstream.wire and the pool in
rhapsode._upstream.pool), on StringTransport: framing, trailers, flow control, cancellation,
failures mid-body and connection reuse.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import pytest
from _sockets import FakeSocket, recorded
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.protocol import Protocol
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone, ResponseFailed
from twisted.web.iweb import UNKNOWN_LENGTH

from rhapsode._upstream.pool import BytesProducer, WorkerClient
from rhapsode._upstream.wire import Connection, ProtocolError, encode_request
from rhapsode_protocol.errors import Internal, ModelUnavailable


class Reader(Protocol):
    def __init__(self) -> None:
        self.pieces: list[bytes] = []
        self.ended: Failure | None = None

    def dataReceived(self, data: bytes) -> None:
        self.pieces.append(data)

    def connectionLost(self, reason: Failure = Failure(ResponseDone())) -> None:
        self.ended = reason

    @property
    def body(self) -> bytes:
        return b"".join(self.pieces)


class Wire:
    """
    A connection on a StringTransport, with what it reported to its pool.
    """

    def __init__(self) -> None:
        self.idle: list[Connection] = []
        self.lost: list[Connection] = []
        self.connection = Connection(self.idle.append, self.lost.append)
        self.transport = StringTransport()
        self.connection.makeConnection(self.transport)

    def ask(self, method: bytes = b"GET", body: Any = None, length: Any = None) -> "Deferred[Any]":
        head = encode_request(method, b"/x", b"worker", {}, length)
        return self.connection.request(method, head, body)

    def answer(self, data: bytes) -> None:
        self.connection.dataReceived(data)


def result_of(d: "Deferred[Any]") -> Any:
    results: list[Any] = []

    def keep(result: Any) -> Any:
        results.append(result)
        return None if isinstance(result, Failure) else result

    d.addBoth(keep)
    assert results, "the Deferred has not fired"
    if isinstance(results[0], Failure):
        results[0].raiseException()
    return results[0]


CHUNKED = (
    b"HTTP/1.1 200 OK\r\nContent-Type: audio/pcm\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nX-Rhapsode-Duration-Ms: 812\r\nX-Other:  a b \r\n\r\n"
)


def test_request_head_and_small_body_go_out_in_one_write() -> None:
    """
    A JSON body known in full is written with its head, framed by Content-Length, so a
    request to a worker is one send.
    """
    wire = Wire()
    writes: list[bytes] = []
    wire.transport.write = writes.append  # type: ignore[method-assign]
    head = encode_request(b"POST", b"/speak", b"worker", {b"Content-Type": [b"application/json"]}, 2)
    wire.connection.request(b"POST", head, b"{}")
    assert writes == [
        b"POST /speak HTTP/1.1\r\nHost: worker\r\nContent-Type: application/json\r\n"
        b"Content-Length: 2\r\n\r\n{}"
    ]


def test_header_with_line_break_is_refused() -> None:
    """
    A header value carrying CR or LF could smuggle a second request: refused.
    """
    with pytest.raises(ValueError):
        encode_request(b"GET", b"/", b"worker", {b"X-A": [b"a\r\nX-B: b"]}, None)


def test_chunked_body_and_its_trailer() -> None:
    """
    A chunked body reaches the reader without its framing (chunk extensions ignored),
    and the trailer fields are kept on the response, names lower-cased.
    """
    wire = Wire()
    pending = wire.ask()
    wire.answer(CHUNKED)
    response = result_of(pending)
    assert response.code == 200 and response.phrase == b"OK"
    assert response.headers.getRawHeaders(b"content-type") == [b"audio/pcm"]
    reader = Reader()
    response.deliverBody(reader)
    assert reader.body == b"hello world"
    assert reader.ended is not None and reader.ended.check(ResponseDone)
    assert response.trailers == {b"x-rhapsode-duration-ms": b"812", b"x-other": b"a b"}


def test_a_reader_that_gathers_gets_one_read_s_pieces_and_end_inside_one_gathering() -> None:
    """
    A reader with C{gathered} (a relay) has what each read of the worker's brings, its
    body's pieces and its end, delivered inside one gathering of its own, so that they
    can leave the core in one send.
    """
    events: list[str] = []

    class GatheringReader(Reader):
        def gathered(self) -> AbstractContextManager[None]:
            return recorded(events)

        def dataReceived(self, data: bytes) -> None:
            super().dataReceived(data)
            events.append(data.decode())

        def connectionLost(self, reason: Failure = Failure(ResponseDone())) -> None:
            super().connectionLost(reason)
            events.append("end")

    wire = Wire()
    pending = wire.ask()
    head, _, body = CHUNKED.partition(b"\r\n\r\n")
    wire.answer(head + b"\r\n\r\n")
    reader = GatheringReader()
    result_of(pending).deliverBody(reader)
    events.clear()
    wire.answer(body[:10])  # the first chunk
    wire.answer(body[10:])
    assert events == ["gather", "hello", "sent", "gather", " world", "end", "sent"]


class GatheringReader(Reader):
    """
    A reader that gathers as a relay does, noting its gatherings among what it reads.
    """

    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.events = events

    def gathered(self) -> AbstractContextManager[None]:
        return recorded(self.events)

    def dataReceived(self, data: bytes) -> None:
        super().dataReceived(data)
        self.events.append(data.decode())

    def connectionLost(self, reason: Failure = Failure(ResponseDone())) -> None:
        super().connectionLost(reason)
        self.events.append("end")


def test_the_read_that_brings_the_head_gathers_for_the_reader_its_answer_attached() -> None:
    """
    When one read brings the head and the body after it (a short answer, or a fast
    engine's first pieces), the reader that answering the head attaches has the rest of
    that read, its end among it, in one gathering: the relay sends them as one write,
    not one send per piece.
    """
    events: list[str] = []
    wire = Wire()
    wire.ask().addCallback(lambda response: response.deliverBody(GatheringReader(events)))
    wire.answer(CHUNKED)
    assert events == ["gather", "hello", " world", "end", "sent"]


def test_pieces_held_for_a_late_reader_reach_it_in_one_gathering() -> None:
    """
    A body that came before anybody read it (held, its socket paused) reaches the reader
    that comes later, its end among it, inside one gathering of the reader's.
    """
    events: list[str] = []
    wire = Wire()
    pending = wire.ask()
    wire.answer(CHUNKED)
    assert events == []
    result_of(pending).deliverBody(GatheringReader(events))
    assert events == ["gather", "hello", " world", "end", "sent"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=len(CHUNKED) - 1), unique=True, max_size=12))
def test_any_split_of_the_bytes_reads_the_same(cuts: list[int]) -> None:
    """
    However the worker's bytes are cut into reads, the body, the trailer and the
    connection's return to the pool come out the same.
    """
    wire = Wire()
    pending = wire.ask()
    reader = Reader()
    pending.addCallback(lambda response: (response.deliverBody(reader), response)[1])
    bounds = [0, *sorted(cuts), len(CHUNKED)]
    for start, end in zip(bounds, bounds[1:]):
        wire.answer(CHUNKED[start:end])
    response = result_of(pending)
    assert reader.body == b"hello world" and reader.ended is not None and reader.ended.check(ResponseDone)
    assert response.trailers[b"x-rhapsode-duration-ms"] == b"812"
    assert wire.idle == [wire.connection] and not wire.connection.busy


def test_content_length_body_and_reuse() -> None:
    """
    A body framed by Content-Length ends at its length, and the connection then carries
    the next request.
    """
    wire = Wire()
    first = wire.ask()
    wire.answer(b"HTTP/1.1 404 Not Found\r\nContent-Length: 4\r\n\r\nnope")
    response = result_of(first)
    reader = Reader()
    response.deliverBody(reader)
    assert (response.code, reader.body) == (404, b"nope") and reader.ended.check(ResponseDone)  # type: ignore[union-attr]
    assert wire.idle == [wire.connection]
    wire.transport.clear()
    second = wire.ask()
    assert wire.transport.value().startswith(b"GET /x HTTP/1.1\r\n")
    wire.answer(b"HTTP/1.1 204 No Content\r\n\r\n")
    empty = Reader()
    result_of(second).deliverBody(empty)
    assert empty.body == b"" and empty.ended.check(ResponseDone)  # type: ignore[union-attr]


def test_body_that_came_before_its_reader_is_held_and_the_socket_paused() -> None:
    """
    Bytes that arrive with the head, before anyone reads the body, are held (not lost)
    and the worker's socket is paused until a reader comes.
    """
    wire = Wire()
    pending = wire.ask()
    wire.answer(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n01234")
    response = result_of(pending)
    assert wire.transport.producerState == "paused"
    reader = Reader()
    response.deliverBody(reader)
    assert wire.transport.producerState == "producing" and reader.body == b"01234"
    wire.answer(b"56789")
    assert reader.body == b"0123456789" and reader.ended.check(ResponseDone)  # type: ignore[union-attr]


def test_a_slow_reader_pauses_the_workers_socket() -> None:
    """
    The reader's transport is the worker socket's producer: pausing it stops reading
    the socket, resuming starts again, stopping closes the connection and fails the body.
    """
    wire = Wire()
    pending = wire.ask()
    reader = Reader()
    wire.answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    result_of(pending).deliverBody(reader)
    reader.transport.pauseProducing()  # type: ignore[union-attr]
    assert wire.transport.producerState == "paused"
    reader.transport.resumeProducing()  # type: ignore[union-attr]
    assert wire.transport.producerState == "producing"
    wire.answer(b"3\r\nabc\r\n")
    reader.transport.stopProducing()  # type: ignore[union-attr]
    assert reader.body == b"abc" and reader.ended.check(ResponseFailed)  # type: ignore[union-attr]
    assert wire.transport.disconnecting and wire.idle == []


def test_worker_gone_mid_body_fails_the_body() -> None:
    """
    A connection lost inside a chunked body is a failed body, never a clean end, and the
    connection is reported gone.
    """
    wire = Wire()
    pending = wire.ask()
    reader = Reader()
    wire.answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nab")
    result_of(pending).deliverBody(reader)
    wire.connection.connectionLost(Failure(ConnectionError("killed")))
    assert reader.body == b"ab" and reader.ended.check(ResponseFailed)  # type: ignore[union-attr]
    assert wire.lost == [wire.connection] and wire.idle == []


def test_worker_gone_before_the_head_fails_the_request() -> None:
    """
    A connection lost before any answer fails the request itself.
    """
    wire = Wire()
    pending = wire.ask()
    wire.connection.connectionLost(Failure(ConnectionError("refused")))
    with pytest.raises(ConnectionError):
        result_of(pending)


def test_body_framed_by_the_connections_end() -> None:
    """
    With neither length nor chunking, the body ends with the connection, cleanly, and
    the connection is not reused.
    """
    wire = Wire()
    pending = wire.ask()
    reader = Reader()
    wire.answer(b"HTTP/1.0 200 OK\r\n\r\nall of it")
    result_of(pending).deliverBody(reader)
    wire.connection.connectionLost(Failure(ConnectionError("closed")))
    assert reader.body == b"all of it" and reader.ended.check(ResponseDone)  # type: ignore[union-attr]
    assert wire.idle == []


def test_connection_close_is_not_reused() -> None:
    """
    A response saying Connection: close is read to its end and the connection closed.
    """
    wire = Wire()
    pending = wire.ask()
    wire.answer(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok")
    reader = Reader()
    result_of(pending).deliverBody(reader)
    assert reader.body == b"ok" and wire.idle == [] and wire.transport.disconnecting


@pytest.mark.parametrize(
    "garbage",
    [
        b"SPDY/3 200 OK\r\n\r\n",
        b"HTTP/1.1 2x0 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
    ],
)
def test_a_head_that_is_not_http_fails_the_request(garbage: bytes) -> None:
    """
    A status line, header or framing this client cannot trust fails the request with a
    protocol error and drops the connection.
    """
    wire = Wire()
    pending = wire.ask()
    wire.answer(garbage)
    with pytest.raises(ProtocolError):
        result_of(pending)
    assert wire.transport.disconnecting


def test_bad_chunk_fails_the_body() -> None:
    """
    A chunk size that is not hex, after the head, fails the body rather than ending it.
    """
    wire = Wire()
    pending = wire.ask()
    reader = Reader()
    wire.answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    result_of(pending).deliverBody(reader)
    wire.answer(b"zz\r\n")
    assert reader.ended.check(ResponseFailed)  # type: ignore[union-attr]


@pytest.mark.parametrize("size", [b"0x5", b"0_5", b" +5", b"-5", b"5 5", b"", b"1" * 16])
def test_a_chunk_size_is_hex_digits_only(size: bytes) -> None:
    """
    Python's int(x, 16) reads "0x5", "0_5" and " +5" as 5; a chunk size is hex digits
    and nothing else, so each of these fails the body rather than framing it.
    """
    wire = Wire()
    pending = wire.ask()
    reader = Reader()
    wire.answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    result_of(pending).deliverBody(reader)
    wire.answer(size + b"\r\nhello\r\n0\r\n\r\n")
    assert reader.ended.check(ResponseFailed)  # type: ignore[union-attr]
    assert reader.body == b""


def test_trailers_are_bounded() -> None:
    """
    A body ending with more trailer fields than a worker ever sends fails rather than
    growing a table without end; a malformed trailer line fails it too.
    """
    for trailer in (b"".join(b"X-T%d: v\r\n" % i for i in range(17)), b"no colon\r\n"):
        wire = Wire()
        pending = wire.ask()
        reader = Reader()
        wire.answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        result_of(pending).deliverBody(reader)
        wire.answer(b"5\r\nhello\r\n0\r\n" + trailer + b"\r\n")
        assert reader.ended.check(ResponseFailed)  # type: ignore[union-attr]


@pytest.mark.parametrize("encoding", [b"gzip, chunked", b"chunked, chunked", b"identity"])
def test_only_chunked_exactly_is_a_transfer_encoding(encoding: bytes) -> None:
    """
    "gzip, chunked" would relay gzip bytes as audio: any transfer-encoding but exactly
    chunked fails the request.
    """
    wire = Wire()
    pending = wire.ask()
    wire.answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: " + encoding + b"\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
    with pytest.raises(ProtocolError):
        result_of(pending)


def test_informational_answers_are_skipped() -> None:
    """
    A 100 Continue before the answer is not the answer.
    """
    wire = Wire()
    pending = wire.ask()
    wire.answer(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    assert result_of(pending).code == 200


def test_cancel_before_the_head_drops_the_connection() -> None:
    """
    Cancelling before the worker answered abandons the request and its connection.
    """
    wire = Wire()
    pending = wire.ask()
    pending.cancel()
    with pytest.raises(CancelledError):
        result_of(pending)
    assert wire.transport.disconnecting


def test_bytes_nobody_asked_for_drop_an_idle_connection() -> None:
    """
    An idle connection that receives bytes is out of step and is dropped.
    """
    wire = Wire()
    wire.answer(b"HTTP/1.1 200 OK\r\n\r\n")
    assert wire.transport.disconnecting


class Streamed:
    """
    A body producer of unknown length, fed by hand.
    """

    length = UNKNOWN_LENGTH

    def __init__(self) -> None:
        self.consumer: Any = None
        self.done: Deferred[None] = Deferred()
        self.stopped = False

    def startProducing(self, consumer: Any) -> "Deferred[None]":
        self.consumer = consumer
        return self.done

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        self.stopped = True


def test_streamed_body_goes_chunked_and_the_producer_is_registered() -> None:
    """
    A body of unknown length is sent chunked as it is produced, with the producer
    registered on the socket (a full socket pauses the source), and ended with the last
    chunk.
    """
    wire = Wire()
    producer = Streamed()
    wire.ask(b"POST", producer, UNKNOWN_LENGTH)
    assert wire.transport.producer is producer
    head = wire.transport.value()
    assert b"Transfer-Encoding: chunked\r\n" in head
    wire.transport.clear()
    producer.consumer.write(b"abc")
    producer.done.callback(None)
    assert wire.transport.value() == b"3\r\nabc\r\n0\r\n\r\n"
    assert wire.transport.producer is None


def test_failed_upload_fails_the_request() -> None:
    """
    A body producer that fails fails the request and drops the connection, so the
    worker gives up the request (and what it spooled of the body) at once rather than
    waiting for the rest until its idle timeout.
    """
    wire = Wire()
    producer = Streamed()
    pending = wire.ask(b"POST", producer, UNKNOWN_LENGTH)
    producer.done.errback(ValueError("client went away"))
    with pytest.raises(ValueError):
        result_of(pending)
    assert wire.transport.disconnecting


def test_answer_before_the_upload_ended_closes_after_it() -> None:
    """
    A worker that answers before the body is all sent: the answer is read, and the
    connection is closed (not reused) once the body has gone.
    """
    wire = Wire()
    producer = Streamed()
    pending = wire.ask(b"POST", producer, UNKNOWN_LENGTH)
    wire.answer(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 2\r\n\r\n{}")
    reader = Reader()
    result_of(pending).deliverBody(reader)
    assert reader.ended.check(ResponseDone) and wire.idle == []  # type: ignore[union-attr]
    assert not wire.transport.disconnecting
    producer.done.callback(None)
    assert wire.transport.disconnecting


# -- the pool ----------------------------------------------------------------------------


class Pool:
    """
    A WorkerClient over a MemoryReactor: each connection is completed by hand.
    """

    def __init__(self, address: str = "unix:/tmp/w.sock") -> None:
        self.reactor = MemoryReactorClock()
        self.client = WorkerClient(self.reactor, address)

    def factories(self) -> list[Any]:
        if self.client.address.startswith("unix:"):
            return [entry[1] for entry in self.reactor.unixClients]
        return [entry[2] for entry in self.reactor.tcpClients]

    def accept(self) -> tuple[Any, StringTransport]:
        """
        Complete the newest connection attempt: (what the socket delivers to, transport).
        """
        protocol = self.factories()[-1].buildProtocol(None)
        transport = StringTransport()
        protocol.makeConnection(transport)
        return protocol, transport


def read_all(response: Any) -> bytes:
    reader = Reader()
    response.deliverBody(reader)
    assert reader.ended is not None and reader.ended.check(ResponseDone)
    return reader.body


def test_pool_reuses_a_connection_and_names_host_and_prefix() -> None:
    """
    Two requests one after the other share one connection; a remote worker's host and
    path prefix are on the request line, and a small body goes with its head.
    """
    pool = Pool("http://10.0.0.5:9000/prefix/")
    first = pool.client.request(b"POST", "/speak", BytesProducer(b"{}"), {b"Content-Type": [b"application/json"]})
    # (MemoryReactorClock's resolver answers 127.0.0.1 for every name.)
    assert [entry[1] for entry in pool.reactor.tcpClients] == [9000]
    socket, transport = pool.accept()
    assert transport.value() == (
        b"POST /prefix/speak HTTP/1.1\r\nHost: 10.0.0.5:9000\r\nContent-Type: application/json\r\n"
        b"Content-Length: 2\r\n\r\n{}"
    )
    socket.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc")
    assert read_all(result_of(first)) == b"abc"
    transport.clear()
    second = pool.client.request(b"GET", "/health")
    assert len(pool.factories()) == 1, "a second connection was opened"
    assert transport.value() == b"GET /prefix/health HTTP/1.1\r\nHost: 10.0.0.5:9000\r\n\r\n"
    socket.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
    assert read_all(result_of(second)) == b"{}"


def test_busy_connection_is_not_shared() -> None:
    """
    A request while another is in flight opens its own connection.
    """
    pool = Pool()
    pool.client.request(b"GET", "/voices")
    pool.accept()
    pool.client.request(b"GET", "/health")
    assert len(pool.factories()) == 2


def test_a_kept_connection_found_closed_is_retried_once_for_a_repeatable_request() -> None:
    """
    A GET on a kept connection the worker had closed is sent again on a fresh one; a
    POST is not (it may have been acted on) and fails as model_unavailable.
    """
    pool = Pool()
    first = pool.client.request(b"GET", "/health")
    socket, _ = pool.accept()
    socket.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    read_all(result_of(first))
    again = pool.client.request(b"GET", "/health")
    socket.connectionLost(Failure(ConnectionError("closed while idle")))
    assert len(pool.factories()) == 2 and not again.called
    fresh, _ = pool.accept()
    fresh.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    assert result_of(again).code == 200
    read_all(result_of(again))
    post = pool.client.request(b"POST", "/speak", BytesProducer(b"{}"))
    fresh.connectionLost(Failure(ConnectionError("closed while idle")))
    with pytest.raises(ModelUnavailable):
        result_of(post)


def test_cancel_while_connecting() -> None:
    """
    Cancelling a request whose connection is still being made cancels the attempt.
    """
    pool = Pool()
    pending = pool.client.request(b"GET", "/health")
    pending.cancel()
    with pytest.raises(CancelledError):
        result_of(pending)
    assert pool.reactor.connectors[0].stoppedConnecting


def test_unreachable_worker_is_model_unavailable() -> None:
    """
    A worker that refuses the connection is a retryable model_unavailable saying what
    went wrong, and not where the worker is: a socket's path or a URL stays out of a
    message any caller can read.
    """
    pool = Pool()
    pending = pool.client.request(b"GET", "/health")
    pool.factories()[0].clientConnectionFailed(pool.reactor.connectors[0], Failure(ConnectionRefusedError("no socket")))
    with pytest.raises(ModelUnavailable) as caught:
        result_of(pending)
    assert caught.value.retryable and "ConnectionRefusedError" in str(caught.value)
    assert "/tmp" not in str(caught.value)


def test_close_closes_idle_connections_and_waits_for_them() -> None:
    """
    Closing the client closes its idle connections and fires once they are gone.
    """
    pool = Pool()
    first = pool.client.request(b"GET", "/health")
    socket, transport = pool.accept()
    socket.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    read_all(result_of(first))
    closing = pool.client.close()
    assert transport.disconnecting and not closing.called
    socket.connectionLost(Failure(ConnectionError("closed")))
    assert closing.called


def test_a_finished_bodys_transport_cannot_touch_the_next_request() -> None:
    """
    After a body has ended and the connection carries another request, pausing or
    stopping the old body's transport does nothing to the new one.
    """
    wire = Wire()
    first = wire.ask()
    wire.answer(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    reader = Reader()
    result_of(first).deliverBody(reader)
    second = wire.ask()
    reader.transport.pauseProducing()  # type: ignore[union-attr]
    reader.transport.stopProducing()  # type: ignore[union-attr]
    assert wire.transport.producerState == "producing" and not wire.transport.disconnecting
    wire.answer(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nnew")
    later = Reader()
    result_of(second).deliverBody(later)
    assert later.body == b"new" and later.ended.check(ResponseDone)  # type: ignore[union-attr]


def test_an_endless_chunk_size_line_fails_the_body() -> None:
    """
    A chunk-size or trailer line that never ends is refused once it passes 8 KB, rather
    than buffered without bound.
    """
    for prefix in (b"", b"0\r\n"):
        wire = Wire()
        pending = wire.ask()
        reader = Reader()
        wire.answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + prefix)
        result_of(pending).deliverBody(reader)
        wire.answer(b"1" * 9000)
        assert reader.ended is not None and reader.ended.check(ResponseFailed), prefix


def test_a_request_is_sent_at_once_not_on_the_next_turn() -> None:
    """
    The request to a worker goes to the socket, head and body in one send, as soon as
    it is written, rather than waiting for the reactor's next poll for writability.
    """
    idle: list[Connection] = []
    connection = Connection(idle.append, idle.append)
    sock = FakeSocket()
    connection.makeConnection(sock)
    connection.request(b"POST", encode_request(b"POST", b"/speak", b"worker", {}, 2), b"{}")
    assert sock.sent == [b"POST /speak HTTP/1.1\r\nHost: worker\r\nContent-Length: 2\r\n\r\n{}"]
    assert not sock.polled_for_writing


class SocketLikeTransport(StringTransport):
    bufferSize = 64 * 1024  # what a Twisted socket transport reads at most, by default


def test_reads_from_a_worker_are_about_twice_twisteds_default() -> None:
    """
    A worker connection raises its socket's read size from Twisted's 64 KiB to
    READ_SIZE (just under 128 KiB), so a worker's audio batch is relayed in fewer,
    larger chunks, each of which, framed as a chunk for the client, still fits one of
    Twisted's sends; a transport without a read size is left as it is.
    """
    from twisted.internet.abstract import FileDescriptor

    from rhapsode._upstream.wire import READ_SIZE

    transport = SocketLikeTransport()
    Connection(lambda c: None, lambda c: None).makeConnection(transport)
    assert READ_SIZE > 2 * 64 * 1024 - 1024
    assert len(b"%x\r\n" % READ_SIZE) + READ_SIZE + 2 <= FileDescriptor.SEND_LIMIT
    assert transport.bufferSize == READ_SIZE
    plain = StringTransport()
    Connection(lambda c: None, lambda c: None).makeConnection(plain)
    assert not hasattr(plain, "bufferSize")


def _cyclic_garbage(run: Any) -> list[str]:
    """
    The types of the objects that C{run()} left behind in reference cycles (found by a
    collection with the collector otherwise off).
    """
    import gc

    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        run()
        gc.collect()
        left = [type(o).__qualname__ for o in gc.garbage]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    return left


def test_a_request_leaves_no_reference_cycle_behind() -> None:
    """
    A request through the pool, answered, read and done with, is freed as soon as it
    is dropped: nothing of it waits in a reference cycle for the garbage collector
    (which then ran every few dozen requests and stalled one of them).  A cancelled
    request likewise.
    """
    pool = Pool()
    pending = pool.client.request(b"GET", "/health")
    socket, _ = pool.accept()
    socket.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
    read_all(result_of(pending))
    del pending

    def answered() -> None:
        for _ in range(20):
            d = pool.client.request(b"POST", "/speak", BytesProducer(b"{}"))
            socket.dataReceived(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n")
            assert read_all(result_of(d)) == b"abc"

    def cancelled() -> None:
        for _ in range(5):
            d = pool.client.request(b"GET", "/voices")
            d.addErrback(lambda f: f.trap(CancelledError))
            d.cancel()

    assert _cyclic_garbage(answered) == []
    assert not any(name in ("_Attempt", "Deferred", "BytesProducer") for name in _cyclic_garbage(cancelled))


@pytest.mark.parametrize("body", [b"[" * 1100 + b"]" * 1100, b"not json"])
def test_a_workers_json_answer_that_cannot_be_read_is_the_workers_fault(body: bytes) -> None:
    """
    A worker (a remote one is any server at a URL) answering a JSON exchange with a
    body that is not JSON, or JSON nested too deep to parse, fails it as internal
    (500, not retryable), never as the caller's bad_request nor an unmapped error.
    """
    pool = Pool()
    asked = Deferred.fromCoroutine(pool.client.json(b"GET", "/capabilities"))
    socket, _ = pool.accept()
    socket.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    with pytest.raises(Internal) as caught:
        result_of(asked)
    assert caught.value.status == 500 and "/capabilities" in str(caught.value)
