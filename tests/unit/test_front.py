"""
The front door of both processes' ports (rhapsode_worker._front): a speech request read and answered
without twisted.web, one at a time per connection, with the client's socket as the
producer's consumer; every request it does not read strictly handed, with the rest of
its connection, to twisted.web, which answers it as before.
"""

from __future__ import annotations

from typing import Any

import pytest
from _sockets import FakeSocket, Producer
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionLost
from twisted.internet.interfaces import ITCPTransport
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from zope.interface import implementer

from rhapsode_worker._front import MAX_BODY, MAX_HEAD, Front, FrontRequest
from rhapsode._gate import CoreRequest, CoreSite
from rhapsode_worker._http import HandlerResource


class FakeCore:
    management_token = "s3cret-token-of-length"
    management_origins: tuple[str, ...] = ()

    async def start_upload(self, engine_id: str, request: Any) -> None:
        return None


class Routed(Resource):
    """
    The routed side (Klein's, in the core): says what reached it.
    """

    isLeaf = True

    def render(self, request: Any) -> bytes:
        return b"routed %s %s" % (request.method, request.path)


class Handler:
    """
    A direct route's handler: echoes the body, or waits on a Deferred when told to.
    """

    def __init__(self) -> None:
        self.seen: list[Any] = []
        self.bodies: list[bytes] = []
        self.waiting: list[Deferred[bytes]] = []
        self.wait = False
        self.cancelled = 0

    async def __call__(self, request: Any) -> bytes:
        self.seen.append(request)
        self.bodies.append(request.content.read())
        request.setHeader(b"Content-Type", b"text/plain")
        if self.wait:
            waiting: Deferred[bytes] = Deferred(lambda _: self._cancelled())
            self.waiting.append(waiting)
            return await waiting
        return b"echo " + self.bodies[-1]

    def _cancelled(self) -> None:
        self.cancelled += 1


def serve(handler: Handler, transport: Any = None, timeout: float | None = None, log: bool = False) -> tuple[Front, Any, CoreSite, MemoryReactorClock]:
    reactor = MemoryReactorClock()
    site = CoreSite(
        Routed(), FakeCore(), {(b"POST", b"/speak"): HandlerResource(handler, Logger())},
        access_log=log, reactor=reactor,
    )
    site.timeOut = timeout
    front = site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 50000))
    transport = transport or StringTransport(peerAddress=IPv4Address("TCP", "127.0.0.1", 50000))
    front.makeConnection(transport)
    return front, transport, site, reactor


def speak(body: bytes = b'{"text":"hi"}', extra: bytes = b"") -> bytes:
    return (
        b"POST /speak HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n%s"
        b"Content-Length: %d\r\n\r\n%s" % (extra, len(body), body)
    )


def test_a_speech_request_is_read_and_answered_by_the_front() -> None:
    """
    A whole POST /speak reaches its handler as a front request (body, fields, no
    Authorization), and the answer is a chunked HTTP/1.1 response with a Date field,
    on a connection that stays open for the next request.
    """
    handler = Handler()
    front, transport, _, _ = serve(handler)
    front.dataReceived(speak(extra=b"Authorization: Bearer s3cret-token-of-length\r\nUser-Agent: t\r\n"))
    [request] = handler.seen
    assert isinstance(request, FrontRequest)
    assert (request.method, request.path, handler.bodies) == (b"POST", b"/speak", [b'{"text":"hi"}'])
    assert request.getHeader(b"User-Agent") == b"t" and request.getHeader(b"authorization") is None
    head, _, body = transport.value().partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 200 OK"
    assert b"Transfer-Encoding: chunked" in lines and b"Content-Type: text/plain" in lines
    assert any(line.startswith(b"Date: ") for line in lines) and b"Connection: close" not in lines
    assert body == b"12\r\necho {\"text\":\"hi\"}\r\n0\r\n\r\n"
    assert not transport.disconnecting
    transport.clear()
    front.dataReceived(speak(b"{}"))
    assert len(handler.seen) == 2 and transport.value().endswith(b"7\r\necho {}\r\n0\r\n\r\n")


def test_a_request_arriving_in_pieces_is_answered_once_whole() -> None:
    """
    Byte by byte, a request is read once its head and its whole body are in, and
    answered once.
    """
    handler = Handler()
    front, transport, _, _ = serve(handler)
    raw = speak()
    for index in range(len(raw)):
        assert not handler.seen
        front.dataReceived(raw[index : index + 1])
    assert handler.bodies == [b'{"text":"hi"}'] and transport.value().count(b"HTTP/1.1 200") == 1


def test_pipelined_requests_are_answered_in_order_one_at_a_time() -> None:
    """
    A request sent before the answer to the one ahead of it waits its turn: its handler
    starts only once the first has finished, and the answers leave in order.
    """
    handler = Handler()
    handler.wait = True
    front, transport, _, _ = serve(handler)
    front.dataReceived(speak(b"one") + speak(b"two"))
    assert handler.bodies == [b"one"]
    handler.waiting[0].callback(b"first")
    assert handler.bodies == [b"one", b"two"]
    handler.waiting[1].callback(b"second")
    answer = transport.value()
    assert answer.index(b"first") < answer.index(b"second") and answer.count(b"HTTP/1.1 200 OK") == 2


def test_reading_pauses_while_a_client_sends_far_ahead() -> None:
    """
    While a request is answered, more than a request's worth sent ahead pauses reading
    from the client; the answer's end resumes it and the waiting request is served.
    """
    handler = Handler()
    handler.wait = True
    front, transport, _, _ = serve(handler)
    front.dataReceived(speak(b"one"))
    ahead = speak(b"x" * 1000)
    sent = 0
    while sent <= MAX_HEAD + MAX_BODY:
        front.dataReceived(ahead)
        sent += len(ahead)
    assert transport.producerState == "paused" and len(handler.seen) == 1
    handler.wait = False
    handler.waiting[0].callback(b"done")
    assert transport.producerState == "producing"
    assert len(handler.seen) == sent // len(ahead) + 1


def test_connection_close_is_honoured() -> None:
    """
    A client that asks for the connection to close gets its answer marked so, then the
    connection closes and nothing it sent after is served.
    """
    handler = Handler()
    front, transport, _, _ = serve(handler)
    front.dataReceived(speak(extra=b"Connection: keep-alive, close\r\n") + speak(b"after"))
    assert b"\r\nConnection: close\r\n" in transport.value()
    assert transport.disconnecting and len(handler.seen) == 1


def test_an_answer_with_a_length_is_not_chunked() -> None:
    """
    A handler that sets Content-Length gets its bytes sent as they are, and finish adds
    no terminator.
    """

    async def buffered(request: Any) -> bytes:
        request.setResponseCode(201)
        request.setHeader(b"Content-Length", b"4")
        return b"made"

    front, transport, _, _ = serve(buffered)  # type: ignore[arg-type]
    front.dataReceived(speak())
    head, _, body = transport.value().partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 201 Created\r\n") and b"Transfer-Encoding" not in head
    assert body == b"made"


LENT = {
    "another route": b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n",
    "another method": b"GET /speak HTTP/1.1\r\nHost: localhost\r\n\r\n",
    "a query string": speak().replace(b"/speak", b"/speak?x=1", 1),
    "another route with a body": b"POST /engines/tone/dialogue HTTP/1.1\r\nHost: l\r\nContent-Length: 2\r\n\r\n{}",
    "a speech body over the front's size": speak(b"x" * (MAX_BODY + 1)),
}


@pytest.mark.parametrize("pieces", [1, 4096], ids=["whole", "in 4 KiB pieces"])
@pytest.mark.parametrize("raw", list(LENT.values()), ids=list(LENT))
def test_other_routes_are_lent_to_twisted_web_and_the_connection_comes_back(raw: bytes, pieces: int) -> None:
    """
    A request in the front's form for a route it does not answer (or with a body over
    what the front holds) is lent, alone, to a twisted.web channel, which answers it;
    the connection then comes back, and the speech request sent with it, in the same
    bytes or in later ones, is read by the front.
    """
    handler = Handler()
    front, transport, _, _ = serve(handler)
    sent = raw + speak(b"after")
    size = len(sent) if pieces == 1 else pieces
    for index in range(0, len(sent), size):
        front.dataReceived(sent[index : index + size])
    assert front._lent is None and front._web is None
    assert isinstance(handler.seen[-1], FrontRequest) and handler.bodies[-1] == b"after"
    assert all(isinstance(request, CoreRequest) for request in handler.seen[:-1])
    answer = transport.value()
    assert answer.startswith(b"HTTP/1.1 ") and answer.count(b"HTTP/1.1 ") == 2
    assert answer.index(b"Server: TwistedWeb") < answer.index(b"echo after")
    assert transport.producer is front and transport.producerState == "producing"


def test_a_lent_request_that_closes_the_connection_keeps_it_closed() -> None:
    """
    A lent request whose client asked for the connection to close is answered and the
    connection closed by twisted.web; the front does not take it back.
    """
    handler = Handler()
    front, transport, _, _ = serve(handler)
    front.dataReceived(b"GET /health HTTP/1.1\r\nHost: l\r\nConnection: close\r\n\r\n" + speak())
    assert transport.disconnecting and front._lent is not None and not handler.seen


HANDED_ON = {
    "HTTP/1.0": speak().replace(b"HTTP/1.1", b"HTTP/1.0", 1),
    "a chunked body": b"POST /speak HTTP/1.1\r\nHost: l\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    "expect-continue": speak(extra=b"Expect: 100-continue\r\n"),
    "an upgrade": speak(extra=b"Upgrade: h2c\r\nConnection: Upgrade\r\n"),
    "a folded field": speak(extra=b"X-A: one\r\n two\r\n"),
    "a bare LF": speak(extra=b"X-A: one\nX-B: two\r\n"),
    "a NUL in a value": speak(extra=b"X-A: o\x00ne\r\n"),
    "space before the colon": speak(extra=b"X-A : one\r\n"),
    "two lengths": speak(extra=b"Content-Length: 13\r\n"),
    "a signed length": speak().replace(b"Content-Length: 13", b"Content-Length: +13"),
    "a leading empty line": b"\r\n" + speak(),
    "a head over the front's size": speak(extra=b"X-Long: " + b"a" * MAX_HEAD + b"\r\n"),
}


@pytest.mark.parametrize("raw", list(HANDED_ON.values()), ids=list(HANDED_ON))
def test_requests_the_front_does_not_read_go_to_twisted_web(raw: bytes) -> None:
    """
    A request outside the narrow form the front reads hands the connection, with every
    byte read so far, to twisted.web for good, which answers it (a direct route's handler then sees twisted.web's
    own request) or, for a line over its own limit, closes the connection.
    """
    handler = Handler()
    front, transport, _, _ = serve(handler)
    front.dataReceived(raw)
    assert front._web is not None
    assert not any(isinstance(request, FrontRequest) for request in handler.seen)
    assert all(isinstance(request, CoreRequest) for request in handler.seen)
    assert transport.value().startswith(b"HTTP/1.") or transport.disconnecting


def test_a_handed_on_connection_stays_with_twisted_web() -> None:
    """
    A kept-alive connection answered first by the front and then handed on for good
    (a chunked body) carries its later speech requests through twisted.web, in order,
    answered alike.
    """
    handler = Handler()
    front, transport, _, _ = serve(handler)
    front.dataReceived(speak(b"one"))
    front.dataReceived(b"POST /speak HTTP/1.1\r\nHost: l\r\nTransfer-Encoding: chunked\r\n\r\n3\r\ntwo\r\n0\r\n\r\n")
    front.dataReceived(speak(b"three"))
    assert [type(request) for request in handler.seen] == [FrontRequest, CoreRequest, CoreRequest]
    answer = transport.value()
    assert answer.index(b"echo one") < answer.index(b"echo two") < answer.index(b"echo three")
    front.connectionLost(Failure(ConnectionLost()))
    assert front._web is not None and front._web.requests == []


def test_a_client_that_hangs_up_cancels_its_handler() -> None:
    """
    The connection's loss fails the request's notifyFinish, which cancels the handler
    where it waits; nothing more is written.
    """
    handler = Handler()
    handler.wait = True
    front, transport, _, _ = serve(handler)
    front.dataReceived(speak())
    finished = handler.seen[0].notifyFinish()
    lost: list[Failure] = []
    finished.addErrback(lost.append)
    front.connectionLost(Failure(ConnectionLost()))
    assert handler.cancelled == 1 and lost and lost[0].check(ConnectionLost)
    assert transport.value() == b""
    with pytest.raises(RuntimeError):
        handler.seen[0].finish()




def test_a_full_socket_pauses_the_producer_and_reading() -> None:
    """
    The front is its socket's producer: bytes the kernel will not take queue in
    Twisted's buffer, and past its size pause the answer's producer and stop reading
    from the client; once the client has taken them both go on.
    """
    socket = FakeSocket(room=0)
    front, _, _, _ = serve(Handler(), transport=socket)
    socket.startReading()
    assert socket.producer is front
    request = FrontRequest(front, b"POST", b"/speak", {}, b"", False)
    producer = Producer()
    request.registerProducer(producer, True)
    request.write(b"a" * (socket.bufferSize + 1))
    assert producer.paused == 1 and socket.queued() > socket.bufferSize
    assert socket not in socket.memory_reactor.getReaders()
    socket.room = None
    socket.doWrite()
    assert producer.resumed == 1 and socket in socket.memory_reactor.getReaders()
    request.unregisterProducer()
    assert socket.producer is front and request.producer is None
    with pytest.raises(TypeError):
        request.registerProducer(producer, False)


def test_a_lent_answer_that_fills_the_socket_leaves_reading_paused_until_it_drains() -> None:
    """
    When a lent request's answer fills the socket, the connection comes back with
    reading still paused, and reading resumes once the client has taken the bytes.
    """
    socket = FakeSocket(room=0)
    handler = Handler()
    front, _, site, _ = serve(handler, transport=socket)
    socket.startReading()
    site.resource.render = lambda request: b"x" * (socket.bufferSize + 10)  # type: ignore[method-assign]
    front.dataReceived(b"GET /big HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert front._lent is None and socket.producer is front
    assert front._blocked and socket not in socket.memory_reactor.getReaders()
    socket.room = None
    socket.doWrite()
    assert not front._blocked and socket in socket.memory_reactor.getReaders()
    front.dataReceived(speak(b"next"))
    assert handler.bodies == [b"next"]


def test_idle_connections_close_after_the_sites_timeout() -> None:
    """
    A connection idle for the site's timeout is closed; one answering a request is not,
    and its idle time counts from its last answer's end.
    """
    front, transport, _, reactor = serve(Handler(), timeout=10)
    reactor.advance(9)
    assert not transport.disconnecting
    reactor.advance(2)
    assert transport.disconnecting
    handler = Handler()
    handler.wait = True
    front, transport, _, reactor = serve(handler, timeout=10)
    reactor.advance(5)
    front.dataReceived(speak())
    reactor.advance(6)
    assert not transport.disconnecting
    reactor.advance(6)
    handler.waiting[0].callback(b"done")  # at 17 s: idle from here
    reactor.advance(9)
    assert not transport.disconnecting
    reactor.advance(2)
    assert transport.disconnecting


def test_access_lines_for_front_requests_never_show_the_token() -> None:
    """
    Each request the front answers is written to the access log once, in the site's
    format, with its method, path, status and length, and without Authorization.
    """
    lines: list[str] = []
    front, _, site, _ = serve(Handler(), log=True)
    site._logFile = type("Sink", (), {"write": lambda self, line: lines.append(line)})()  # type: ignore[assignment]
    site._logDateTime = "[29/Nov/2026:00:00:00 +0000]"
    front.dataReceived(speak(extra=b"Authorization: Bearer s3cret-token-of-length\r\nUser-Agent: curl\r\n"))
    [line] = lines
    assert '"POST /speak HTTP/1.1" 200 18 "-" "curl"' in line and "s3cret" not in line


def test_tcp_connections_send_small_writes_at_once() -> None:
    """
    On TCP the front turns Nagle's delay off, as twisted.web does, so a head and a
    first chunk are not held back waiting for an acknowledgement.
    """

    @implementer(ITCPTransport)
    class TCP(StringTransport):
        nodelay = False

        def setTcpNoDelay(self, enabled: bool) -> None:
            self.nodelay = enabled

    front, transport, _, _ = serve(Handler(), transport=TCP())
    assert transport.nodelay is True


def test_front_requests_keep_twisted_webs_rules_at_their_edges() -> None:
    """
    Writing after finish and finishing twice are errors, as in twisted.web; a status
    without a known phrase still has one, and a line break in a header value cannot
    end the field.
    """
    front, transport, _, _ = serve(Handler())
    request = FrontRequest(front, b"POST", b"/speak", {}, b"", False)
    front._request = request
    request.setResponseCode(599)
    request.setHeader(b"X-A", b"one\r\nX-Injected: two")
    request.finish()
    assert transport.value().startswith(b"HTTP/1.1 599 Unknown Status\r\n")
    assert b"X-A: one X-Injected: two\r\n" in transport.value() and b"Content-Length: 0\r\n" in transport.value()
    with pytest.raises(RuntimeError):
        request.write(b"more")
    with pytest.raises(RuntimeError):
        request.finish()
    with pytest.raises(TypeError):
        request.setResponseCode("200")  # type: ignore[arg-type]


def decoded(answer: bytes) -> tuple[bytes, dict[bytes, bytes], bytes]:
    """
    A response's status line, its fields (lower-cased; Date and Server left out, as
    they differ by design) and its body with any chunking undone.
    """
    head, _, rest = answer.partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    fields = {}
    for line in lines:
        name, _, value = line.partition(b":")
        if name.lower() not in (b"date", b"server"):
            fields[name.lower()] = value.strip()
    if fields.get(b"transfer-encoding") != b"chunked":
        return status, fields, rest
    body = b""
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if not size:
            return status, fields, body
        body, rest = body + rest[:size], rest[size + 2 :]


SAME_EITHER_WAY = {
    "plain": speak(),
    "field names in any case": speak().replace(b"Content-Length", b"CONTENT-length").replace(b"Host", b"hOST"),
    "space and tabs around values": speak().replace(b"Content-Length: 13", b"Content-Length:\t 13 \t"),
    "no space after the colon": speak().replace(b"Content-Type: ", b"Content-Type:"),
    "fields in another order": b"POST /speak HTTP/1.1\r\nContent-Length: 13\r\nX-Z: 1\r\nHost: h\r\n\r\n" + b'{"text":"hi"}',
    "no body": b"POST /speak HTTP/1.1\r\nHost: localhost\r\n\r\n",
    "an empty value": speak(extra=b"X-Empty:\r\n"),
    "a binary body": speak(bytes(range(256))),
}


@pytest.mark.parametrize("raw", list(SAME_EITHER_WAY.values()), ids=list(SAME_EITHER_WAY))
def test_the_front_answers_as_twisted_web_would(raw: bytes) -> None:
    """
    The same request read by the front and by twisted.web reaches the handler with the
    same body and gets the same status, fields (Date and Server aside) and body back.
    """
    answers = []
    for through_web in (False, True):
        handler = Handler()
        front, transport, site, _ = serve(handler)
        if through_web:
            front._hand_on()
        front.dataReceived(raw)
        assert isinstance(handler.seen[0], CoreRequest if through_web else FrontRequest)
        answers.append((handler.bodies, decoded(transport.value())))
    assert answers[0] == answers[1]


def test_a_sites_connection_tracker_sees_front_connections_open_and_close() -> None:
    """
    Where a site keeps its open connections (the worker's, for a drain), a front
    connection is told to it as it opens and as it closes, handed on or not, so a drain
    can close every one and know when they have gone.
    """
    from rhapsode_worker._runtime import _Connections

    for hand_on in (False, True):
        handler = Handler()
        reactor = MemoryReactorClock()
        site = CoreSite(Routed(), FakeCore(), {(b"POST", b"/speak"): HandlerResource(handler, Logger())}, reactor=reactor)
        site.connections = _Connections()
        front = site.buildProtocol(None)
        transport = StringTransport()
        front.makeConnection(transport)
        assert site.connections.open == {front}
        if hand_on:
            front.dataReceived(b"GET /health HTTP/1.0\r\nHost: localhost\r\n\r\n")
        closed = site.connections.close_all()
        assert transport.disconnecting and not closed.called
        front.connectionLost(Failure(ConnectionLost()))
        assert site.connections.open == set() and closed.called


def test_a_lent_management_request_still_passes_the_guard() -> None:
    """
    A management request in the front's form is lent to twisted.web at its head, with
    its headers untouched, so the guard refuses a remote caller without the token
    exactly as before, before any of the body has come: a 403 naming the rule, and the
    connection closed.
    """
    handler = Handler()
    remote = StringTransport(peerAddress=IPv4Address("TCP", "203.0.113.9", 40000))
    front, transport, _, _ = serve(handler, transport=remote)
    front.dataReceived(b"POST /engines/tone/unload HTTP/1.1\r\nHost: box\r\nContent-Length: 5000\r\n\r\n")
    answer = transport.value()
    assert answer.startswith(b"HTTP/1.1 403 Forbidden") and b"management token" in answer
    assert transport.disconnecting and not handler.seen


@pytest.mark.parametrize("why", ["client asked", "idle", "drain"])
def test_a_connection_closed_with_its_socket_full_closes_once_drained(why: str) -> None:
    """
    A connection closed while its socket's buffer is full (the answer's end still
    queued, the front paused as its producer) closes once the client has taken the
    bytes, however the close came: the client's Connection: close, the idle timeout, or
    a drain closing every connection.  (With the front still registered, the drained
    socket would resume it and never close.)
    """
    from rhapsode_worker._runtime import _Connections

    socket = FakeSocket(room=0)
    handler = Handler()
    handler.wait = True
    front, _, site, reactor = serve(handler, transport=socket, timeout=10)
    site.connections = _Connections()
    site.connections.opened(front)
    front.dataReceived(speak(extra=b"Connection: close\r\n" if why == "client asked" else b""))
    handler.waiting[0].callback(b"a" * (socket.bufferSize + 1))
    assert socket.producerPaused and socket.disconnecting == (why == "client asked")
    if why == "idle":
        reactor.advance(11)
    elif why == "drain":
        site.connections.close_all()
    assert socket.disconnecting
    socket.room = None
    assert socket.doWrite() is not None  # the connection's end, not a resumed producer


def test_a_unix_connection_asks_for_the_sites_send_buffer() -> None:
    """
    A site with a send buffer set (the worker's: a batch of audio and half another)
    has each Unix socket connection ask the kernel for it; a site without one leaves the
    system's size alone.
    """
    import socket

    from rhapsode_worker._schedule import SEND_BUFFER_BYTES

    for size in (SEND_BUFFER_BYTES, None):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        default = ours.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        transport = StringTransport()
        transport.socket = ours  # type: ignore[attr-defined]
        reactor = MemoryReactorClock()
        site = CoreSite(Routed(), FakeCore(), {}, reactor=reactor)
        site.send_buffer = size
        site.buildProtocol(None).makeConnection(transport)
        granted = ours.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        assert granted >= SEND_BUFFER_BYTES if size else granted == default
        ours.close()
        theirs.close()
