"""
Sending at once (L{send_now}) and the channel and request built on it: bytes go to the
kernel when nothing is queued ahead of them, and Twisted's buffering and backpressure
take over exactly when the kernel does not take them all.
"""

from __future__ import annotations

from typing import Any

from _sockets import FakeSocket, Producer
from twisted.internet.error import ConnectionLost
from twisted.internet.testing import StringTransport
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from rhapsode_protocol.http.answers import write_trailer
from rhapsode_protocol.http.site import QUEUE_ATTRIBUTES, DirectSite, gathered, send_now


def test_a_real_socket_transport_has_what_send_now_reads() -> None:
    """
    Twisted's own TCP and Unix socket transports still carry every attribute send_now
    reads to know nothing is queued (Twisted has no public way to ask); a release that
    renamed one would otherwise make every write silently fall back to the slow path.
    """
    import socket

    from twisted.internet import tcp, unix
    from twisted.internet.protocol import Protocol
    from twisted.internet.testing import MemoryReactor

    for family, kind in ((socket.AF_INET, tcp.Server), (socket.AF_UNIX, unix.Server)):
        left, right = socket.socketpair(family if family == socket.AF_UNIX else socket.AF_UNIX)
        try:
            address: Any = ("127.0.0.1", 1) if kind is tcp.Server else "sock"
            transport = kind(left, Protocol(), address, None, 1, MemoryReactor())  # type: ignore[arg-type]
            missing = [name for name in QUEUE_ATTRIBUTES if not hasattr(transport, name)]
            assert missing == [], kind
            sent: list[bytes] = []
            transport.writeSomeData = lambda data: sent.append(bytes(data)) or len(data)  # type: ignore[method-assign]
            send_now(transport, b"straight to the kernel")
            assert sent == [b"straight to the kernel"]
        finally:
            left.close()
            right.close()


def test_bytes_the_kernel_takes_are_sent_without_polling() -> None:
    """
    With nothing queued, a write is one send, and the socket is never registered for
    writability (the two poll-set changes and the loop turn a plain write costs).
    """
    sock = FakeSocket()
    send_now(sock, b"hello")
    send_now(sock, b"world")
    assert sock.sent == [b"hello", b"world"]
    assert not sock.polled_for_writing and sock.queued() == 0


def test_a_write_larger_than_one_send_goes_in_several() -> None:
    """
    A write larger than one send takes (Twisted's sockets send at most 128 KiB at a
    time) goes on in further sends at once, in order, and nothing is queued.
    """
    sock = FakeSocket()
    sock.cap = 4
    send_now(sock, b"abcdefghij")
    assert sock.sent == [b"abcd", b"efgh", b"ij"] and sock.queued() == 0 and not sock.polled_for_writing


def test_what_the_kernel_refuses_is_queued_and_polled_for() -> None:
    """
    A send the kernel takes only part of leaves the rest queued in order, with the
    socket polled for writability; the next write queues behind it, and the reactor's
    doWrite sends both when there is room.
    """
    sock = FakeSocket(room=3)
    send_now(sock, b"abcdef")
    assert sock.sent == [b"abc"] and sock.queued() == 3 and sock.polled_for_writing
    send_now(sock, b"gh")
    assert sock.sent == [b"abc"] and sock.queued() == 5
    sock.room = 100
    sock.doWrite()
    assert b"".join(sock.sent) == b"abcdefgh" and sock.queued() == 0 and not sock.polled_for_writing


def test_a_failed_send_is_left_for_the_reactor_to_find() -> None:
    """
    A send that fails queues the bytes as a plain write would, so the reactor's next
    doWrite meets the failure and closes the connection as usual.
    """
    sock = FakeSocket()
    sock.fail = ConnectionLost()
    send_now(sock, b"audio")
    assert sock.sent == [] and sock.queued() == 5 and sock.polled_for_writing
    assert isinstance(sock.doWrite(), ConnectionLost)


def test_closing_sockets_and_other_transports_are_written_as_usual() -> None:
    """
    A socket that is closing queues its bytes (its close waits for them); a transport
    that is not a socket at all is simply written to.
    """
    closing = FakeSocket()
    closing.disconnecting = True
    send_now(closing, b"late")
    assert closing.sent == [] and closing.queued() == 4
    plain = StringTransport()
    send_now(plain, b"text")
    assert plain.value() == b"text"


def test_backpressure_pauses_only_when_bytes_are_left_queued() -> None:
    """
    A producer writing to the socket is paused when what the kernel refused passes
    the socket's buffer size, as with a plain write, and not when the kernel took it
    all; once the queue drains it is resumed.
    """
    sock = FakeSocket()
    producer = Producer()
    sock.registerProducer(producer, True)
    send_now(sock, b"x" * (sock.bufferSize * 2))
    assert producer.paused == 0
    sock.room = 10
    send_now(sock, b"y" * (sock.bufferSize * 2))
    assert producer.paused == 1 and sock.queued() == sock.bufferSize * 2 - 10
    sock.room = None
    sock.doWrite()
    assert producer.resumed == 1 and sock.queued() == 0


class _Answer(Resource):
    isLeaf = True

    def __init__(self, body: bytes, later: bool = False) -> None:
        super().__init__()
        self.body = body
        self.later = later
        self.requests: list[Any] = []

    def render(self, request: Any) -> Any:
        self.requests.append(request)
        if self.later:
            return NOT_DONE_YET
        request.setHeader(b"Content-Type", b"audio/pcm")
        return self.body


def _serve(resource: Resource, sock: FakeSocket) -> Any:
    from twisted.internet.address import IPv4Address

    channel = DirectSite(resource).buildProtocol(IPv4Address("TCP", "127.0.0.1", 50000))
    channel.makeConnection(sock)
    sock.protocol = channel
    return channel


def test_headers_and_first_bytes_leave_in_one_send() -> None:
    """
    A response's status line, headers and first body bytes, which twisted.web writes
    one after the other, reach the kernel in a single send.
    """
    sock = FakeSocket()
    _serve(_Answer(b"PCM!" * 100), sock)
    sock.sent.clear()
    sock.memory_reactor.writers.clear()
    sock.protocol.dataReceived(b"GET /a HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert len(sock.sent) == 1, sock.sent
    head, _, body = sock.sent[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and b"Content-Type: audio/pcm" in head
    assert body == b"PCM!" * 100 and not sock.polled_for_writing


def test_a_response_with_no_body_still_sends_its_headers() -> None:
    """
    Headers gathered for the first body bytes still leave when there are none (an
    empty write, a finish with nothing written), so no response is ever held back.
    """
    answer = _Answer(b"", later=True)
    sock = FakeSocket()
    _serve(answer, sock)
    sock.protocol.dataReceived(b"GET /a HTTP/1.1\r\nHost: localhost\r\n\r\n")
    (request,) = answer.requests
    request.setResponseCode(204)
    request.write(b"")
    request.finish()
    assert b"".join(sock.sent).startswith(b"HTTP/1.1 204 No Content\r\n")
    assert sock.queued() == 0


def test_a_chunked_stream_sends_each_piece_as_written() -> None:
    """
    A streamed (chunked) response sends each written piece, framed, as it is written,
    and its end likewise; with a slow kernel the pieces queue in order behind the
    first.
    """
    answer = _Answer(b"", later=True)
    sock = FakeSocket()
    _serve(answer, sock)
    sock.protocol.dataReceived(b"GET /a HTTP/1.1\r\nHost: localhost\r\n\r\n")
    (request,) = answer.requests
    request.write(b"one")
    assert len(sock.sent) == 1 and sock.sent[0].endswith(b"\r\n\r\n3\r\none\r\n")
    request.write(b"two")
    assert sock.sent[1] == b"3\r\ntwo\r\n"
    sock.room = 2
    request.write(b"three")
    request.finish()
    assert sock.sent[2] == b"5\r" and sock.polled_for_writing
    sock.room = None
    sock.doWrite()
    assert b"".join(sock.sent[2:]) == b"5\r\nthree\r\n0\r\n\r\n"


def test_a_stream_s_last_piece_and_its_end_leave_together_when_gathered() -> None:
    """
    Inside L{gathered}, a stream's last piece and its trailer leave in one send, at the
    latest when the request finishes, so whoever hears of the finish finds every byte in
    the transport; a nested hold (a first write's) does not send early; outside it every
    piece is sent as written again.
    """
    answer = _Answer(b"", later=True)
    sock = FakeSocket()
    _serve(answer, sock)
    sock.protocol.dataReceived(b"GET /a HTTP/1.1\r\nHost: localhost\r\n\r\n")
    (request,) = answer.requests
    heard: list[int] = []
    request.notifyFinish().addCallback(lambda _: heard.append(len(sock.sent)))
    with gathered(request):
        request.write(b"first")  # the first write's own hold nests inside this one
        request.write(b"last")
        write_trailer(request, 40)
        assert sock.sent == []
        request.finish()
        assert heard == [1]
    assert len(sock.sent) == 1
    head, _, body = sock.sent[0].partition(b"\r\n\r\n")
    assert body == b"5\r\nfirst\r\n4\r\nlast\r\n0\r\nX-Rhapsode-Duration-Ms: 40\r\n\r\n"

    plain = StringTransport()
    with gathered(type("Request", (), {"channel": None})()):
        send_now(plain, b"no channel, nothing held")
    assert plain.value() == b"no channel, nothing held"


def test_an_aborted_socket_sends_nothing_more() -> None:
    """
    Once a connection is aborted (a failure after its headers), what is written after
    is never handed to the kernel, not even through send_now's direct path: the client
    sees the stream cut where the failure came.
    """
    sock = FakeSocket()
    sock._aborting = True  # as tcp.Connection.abortConnection sets it
    send_now(sock, b"after the abort")
    assert sock.sent == []


def test_a_connection_asks_its_address_once() -> None:
    """
    twisted.web asks a request's channel for the local address on every request; the
    channel asks the socket once per connection.
    """
    sock = FakeSocket()
    _serve(_Answer(b"ok"), sock)
    for _ in range(3):
        sock.protocol.dataReceived(b"GET /a HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert sock.sent[-1].endswith(b"ok") and len(sock.sent) == 3
    assert sock.host_asked == 1


def test_a_site_is_told_of_each_connection_and_a_drain_closes_them_all() -> None:
    """
    A site's connections (front doors) report themselves as they open and close, so the worker's drain
    can close every open connection gracefully and learn when the last has gone, with
    no protocol wrapper under every write to track them.
    """
    from twisted.internet.address import IPv4Address
    from twisted.internet.error import ConnectionDone
    from twisted.python.failure import Failure

    from rhapsode_worker._runtime import _Connections

    site = DirectSite(Resource())
    tracker = _Connections()
    site.connections = tracker
    socks = [FakeSocket(), FakeSocket()]
    channels = []
    for sock in socks:
        channel = site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 50000))
        channel.makeConnection(sock)
        channels.append(channel)
    assert tracker.open == set(channels)
    assert channels[0].transport is socks[0]  # the channel writes to the socket itself
    done = tracker.close_all()
    assert not done.called and all(sock.disconnecting for sock in socks)
    channels[0].connectionLost(Failure(ConnectionDone()))
    assert not done.called and tracker.open == {channels[1]}
    channels[1].connectionLost(Failure(ConnectionDone()))
    assert done.called and tracker.open == set()
    assert tracker.close_all().called
