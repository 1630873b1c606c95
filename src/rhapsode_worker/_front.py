"""
The front door of both processes' HTTP ports (protocol.md sections 1, 6 and 7): the
direct routes (C{POST /speak}) read and answered without twisted.web's request
machinery, every other request answered by twisted.web.

Every utterance comes through here, at the core and again at its worker.  On this path
twisted.web spent more time than the route itself: it reads a request line by line,
builds a request object with two header objects and a dozen fields, and formats its
response head through them again (in the core's in-memory run, C{bench/core_path.py},
about a third of the Python per request).

The front reads requests in one narrow form: HTTP/1.1, header lines that are strictly
well formed, and a body framed by Content-Length and small enough to hold (64 KiB).  One
for a direct route it answers itself.  One for any other route (a health read, a
capabilities fetch, a query string) it lends, alone, to a twisted.web channel, which
answers it and gives the connection back: the core's pooled connections to a worker
begin with such reads, and would otherwise never reach the front again.  A request in
any other form (a chunked or expect-continue body, an HTTP/1.0 client, a folded or
malformed header line, a larger body such as a voice upload) hands the connection,
with the bytes read so far, to twisted.web for good.  Every request the front does not
answer is handled by twisted.web exactly as before.

The handler is the same L{HandlerResource} either way.  It sees a L{FrontRequest}, which
does the part of C{IRequest} the direct routes use, with twisted.web's names so the
shared helpers (L{rhapsode_worker._http}) read it as they read any request.  What the
front never keeps: C{Authorization}, so no handler or log line can see it (section 10).
"""

from __future__ import annotations

import re
import socket
from io import BytesIO
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IPushProducer, ITCPTransport
from twisted.internet.protocol import Protocol, connectionDone
from twisted.python.failure import Failure
from twisted.web.http import RESPONSES, datetimeToString
from zope.interface import implementer

from ._http import EagerChannel, HandlerResource, send_now

__all__ = ["Front", "FrontRequest", "MAX_BODY", "MAX_HEAD"]

#: A head longer than this is not a speech client's; twisted.web reads it (and refuses
#: it at its own limit, the same size).
MAX_HEAD = 16 * 1024
#: The largest body the front holds whole: a speech request at its longest text is well
#: under it; a larger one is read by twisted.web, as before.
MAX_BODY = 64 * 1024
#: A field name is an RFC 9110 token: nothing else passes, not even surrounding space.
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+\Z")
#: Bytes a field value may not carry (a tab may).  A CR or LF left in a line once the head
#: is split on CRLF is a bare one, which twisted.web's reader would split on: such a
#: request goes to twisted.web rather than be read two ways.
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
#: Fields that change how a request is framed or answered: twisted.web reads those.
_HANDED_ON = frozenset({b"transfer-encoding", b"expect", b"upgrade"})

_date: list[Any] = [None, b""]


def _http_date(seconds: float) -> bytes:
    """
    The Date field's value, formatted once a second.
    """
    whole = int(seconds)
    if _date[0] != whole:
        _date[0], _date[1] = whole, datetimeToString(whole)
    value: bytes = _date[1]
    return value


def _chunk(data: bytes, before: bytes = b"") -> bytes:
    # Joined, not %-formatted: formatting copies a large piece of audio twice, and is
    # some thirty times slower for a 128 KiB one.  C{before} (a response's head) goes
    # in the same copy.
    return b"".join((before, b"%x\r\n" % len(data), data, b"\r\n"))


def read_fields(lines: list[bytes]) -> tuple[dict[bytes, bytes], int, bool] | None:
    """
    The header lines of a request the front can take: its fields by lower-cased name
    (C{Authorization} left out), its body's length and whether the client asked for the
    connection to close.  None when any line is one the front does not read strictly.
    """
    fields: dict[bytes, bytes] = {}
    length = -1
    close = False
    for line in lines:
        name, colon, value = line.partition(b":")
        if not colon or not _TOKEN.match(name) or _CONTROL.search(value):
            return None
        name = name.lower()
        value = value.strip(b" \t")
        if name in _HANDED_ON:
            return None
        if name == b"content-length":
            if length >= 0 or not value.isdigit() or len(value) > 9:
                return None
            length = int(value)
        elif name == b"connection":
            close = close or b"close" in [token.strip() for token in value.lower().split(b",")]
        elif name == b"authorization":
            continue
        fields[name] = value
    return fields, max(length, 0), close


class FrontRequest:
    """
    One request the front read, as its handler sees it: the body in C{content}, the
    response written with C{setResponseCode}, C{setHeader}, C{write} and C{finish}
    (chunked unless a Content-Length was set), a push producer paused and resumed with
    the client's socket (by the front, the socket's own producer), and C{notifyFinish}
    failing if the client goes first.
    """

    clientproto = b"HTTP/1.1"

    def __init__(self, channel: "Front", method: bytes, path: bytes, fields: dict[bytes, bytes], body: bytes, close: bool) -> None:
        self.channel = channel
        self.method = method
        self.uri = self.path = path
        self.content = BytesIO(body)
        self.close = close
        self.code = 200
        self.code_message = b"OK"
        self.startedWriting = False
        self.finished = False
        self.chunked = False
        self.sentLength = 0
        self.producer: Any = None
        self._fields = fields
        self._headers: dict[bytes, tuple[bytes, bytes]] = {}
        self._notifications: list[Deferred[None]] = []
        self._disconnected = False

    # -- reading ------------------------------------------------------------------------

    def getHeader(self, name: bytes) -> bytes | None:
        return self._fields.get(name.lower())

    def getClientAddress(self) -> Any:
        return self.channel.transport.getPeer()  # type: ignore[union-attr]

    def notifyFinish(self) -> "Deferred[None]":
        finished: Deferred[None] = Deferred()
        self._notifications.append(finished)
        return finished

    # -- answering ----------------------------------------------------------------------

    def setResponseCode(self, code: int, message: bytes | None = None) -> None:
        if not isinstance(code, int):
            raise TypeError("HTTP response code must be int or long")
        self.code = code
        self.code_message = message or RESPONSES.get(code, b"Unknown Status")

    def setHeader(self, name: bytes, value: bytes) -> None:
        if b"\r" in value or b"\n" in value:
            # As twisted.web does: a line break in a value would end the field.
            value = value.replace(b"\r\n", b" ").replace(b"\r", b" ").replace(b"\n", b" ")
        self._headers[name.lower()] = (name, value)

    def _head(self) -> bytes:
        lines = [b"HTTP/1.1 %d %s\r\n" % (self.code, self.code_message)]
        headers = self._headers
        if b"content-length" not in headers:
            self.chunked = True
            lines.append(b"Transfer-Encoding: chunked\r\n")
        for name, value in headers.values():
            lines.append(b"%s: %s\r\n" % (name, value))
        lines.append(b"Date: %s\r\n" % _http_date(self.channel.seconds()))
        if self.close:
            lines.append(b"Connection: close\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)

    def write(self, data: bytes) -> None:
        if self.finished:
            raise RuntimeError("Request.write called on a request after Request.finish was called.")
        if self._disconnected:
            return  # as twisted.web: nothing goes to a client that has gone
        if self.startedWriting:
            if not data:
                return
            self.sentLength += len(data)
            send_now(self.channel.transport, _chunk(data) if self.chunked else data)
            return
        # The head and the first bytes leave in one send.
        self.startedWriting = True
        head = self._head()
        if data:
            self.sentLength += len(data)
            head = _chunk(data, head) if self.chunked else head + data
        send_now(self.channel.transport, head)

    def finish(self) -> None:
        if self._disconnected:
            raise RuntimeError(
                "Request.finish called on a request after its connection was lost; "
                "use Request.notifyFinish to keep track of this."
            )
        if self.finished:
            raise RuntimeError("Request.finish called twice")
        if not self.startedWriting:
            if b"content-length" not in self._headers:
                self.setHeader(b"Content-Length", b"0")
            self.write(b"")
        if self.chunked:
            self.chunked = False
            send_now(self.channel.transport, b"0\r\n\r\n")
        self.finished = True
        notifications, self._notifications = self._notifications, []
        for finished in notifications:
            finished.callback(None)
        self.channel.request_done(self)

    def registerProducer(self, producer: Any, streaming: bool) -> None:
        if not streaming:
            raise TypeError("the front relays push producers only")
        if self.producer is not None:
            raise ValueError(f"registering producer {producer} before previous one ({self.producer}) was unregistered")
        self.producer = producer
        if self._disconnected:
            producer.stopProducing()
            return
        self.channel.producing(producer)

    def unregisterProducer(self) -> None:
        if self.producer is None:
            return
        self.producer = None
        self.channel.producing(None)

    def connection_lost(self, reason: Failure) -> None:
        self._disconnected = True
        notifications, self._notifications = self._notifications, []
        for finished in notifications:
            finished.errback(reason)


@implementer(IPushProducer)
class Front(Protocol):
    """
    One client connection: requests read here one at a time.  A direct route's is
    answered here; any other request in the same strict form is lent to a twisted.web
    channel, which answers it and gives the connection back; a request in any other form
    hands the connection to twisted.web for good.  A request sent ahead of its turn
    waits, and reading pauses once more than a request's worth is waiting.

    The front is its socket's push producer, as twisted.web's channel is: a socket whose
    send buffer is full pauses the answer's producer and stops reading further requests
    until the client has taken its bytes.

    C{site} is a L{DirectSite}: its C{direct} routes, its access log, its C{reactor} and
    C{timeOut} (an idle connection is closed after it), its C{connections} (told as the
    connection opens and closes, where the site has them), its C{send_buffer} (the send
    buffer a Unix socket asks for, where set), and C{web_channel()} for a twisted.web
    channel of its own.
    """

    def __init__(self, site: Any) -> None:
        self._site = site
        self._buffer = b""
        self._request: FrontRequest | None = None
        #: The answer's producer, paused while the socket is full.
        self._producer: Any = None
        #: A twisted.web channel answering one request, lent the connection meanwhile.
        self._lent: EagerChannel | None = None
        #: A twisted.web channel the connection was handed to for good.
        self._web: EagerChannel | None = None
        self._serving = False
        #: Why reading is paused: a request's worth waiting, or a full send buffer.
        self._ahead = False
        self._blocked = False
        self._timer: Any = None
        self._idle_since = 0.0
        self._host: Any = None
        #: Body bytes the lent channel is still to be given.
        self._owed = 0

    def seconds(self) -> float:
        now: float = self._site.reactor.seconds()
        return now

    def write(self, data: bytes) -> None:
        """
        Bytes straight to the client, for a response's own framing (the trailer that
        ends a chunked body: L{rhapsode_worker._http.write_trailer}).
        """
        send_now(self.transport, data)

    # -- the connection -------------------------------------------------------------------

    def connectionMade(self) -> None:
        tracker = self._site.connections
        if tracker is not None:
            tracker.opened(self)
        transport = self.transport
        if ITCPTransport.providedBy(transport):
            # As twisted.web does: small writes (a head, a first chunk) go at once.
            transport.setTcpNoDelay(True)
        transport.registerProducer(self, True)  # type: ignore[union-attr]
        size = self._site.send_buffer
        sock = getattr(transport, "socket", None)
        if size and sock is not None and sock.family == socket.AF_UNIX:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
            except OSError:
                pass  # the system's own size, as before
        timeout = getattr(self._site, "timeOut", None)
        if timeout:
            self._idle_since = self.seconds()
            self._timer = self._site.reactor.callLater(timeout, self._check_idle)

    def _check_idle(self) -> None:
        # Armed once per connection and moved on lazily: a request costs no timer call.
        timeout = self._site.timeOut
        busy = self._request is not None or self._lent is not None
        left = timeout if busy else self._idle_since + timeout - self.seconds()
        if left > 0:
            self._timer = self._site.reactor.callLater(left, self._check_idle)
            return
        self._timer = None
        self.loseConnection()

    def loseConnection(self) -> None:
        """
        Close the connection once what is written has gone.  The socket's producer
        steps aside first: a socket with a push producer paused by its full buffer
        resumes that producer when the buffer drains, and closes only with none.
        """
        transport: Any = self.transport
        if transport is None or transport.disconnecting:
            return
        channel = self._web or self._lent
        if channel is not None:
            channel.loseConnection()  # which steps aside in the same way
            return
        if transport.producer is self:
            transport.unregisterProducer()
        transport.loseConnection()

    def _stop_timer(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None and timer.active():
            timer.cancel()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._stop_timer()
        channel = self._web or self._lent
        if channel is not None:
            channel.connectionLost(reason)
        else:
            request, self._request = self._request, None
            self._buffer = b""
            if request is not None and not request.finished:
                request.connection_lost(reason)
        tracker = self._site.connections
        if tracker is not None:
            tracker.closed(self)

    def dataReceived(self, data: bytes) -> None:
        if self._web is not None:
            self._web.dataReceived(data)
            return
        self._buffer = self._buffer + data if self._buffer else data
        if self._request is None and self._lent is None:
            self._serve()
            return
        if self._owed:
            self._feed()
        if len(self._buffer) > MAX_HEAD + MAX_BODY and not self._ahead:
            # A client that sends ahead this much waits for its answer before more is read.
            self._ahead = True
            self._reading()

    # -- flow -------------------------------------------------------------------------------

    def _reading(self) -> None:
        transport: Any = self.transport
        if self._ahead or self._blocked:
            transport.pauseProducing()
        else:
            transport.resumeProducing()

    def producing(self, producer: Any) -> None:
        """
        The current answer's push producer (None once it is done): paused while the
        socket is full, stopped if the connection goes.
        """
        self._producer = producer
        if producer is not None and self._blocked:
            producer.pauseProducing()

    def pauseProducing(self) -> None:
        self._blocked = True
        if self._producer is not None:
            self._producer.pauseProducing()
        self._reading()

    def resumeProducing(self) -> None:
        self._blocked = False
        if self._producer is not None:
            self._producer.resumeProducing()
        self._reading()

    def stopProducing(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            producer.stopProducing()

    # -- requests -------------------------------------------------------------------------

    def _serve(self) -> None:
        if self._serving:
            return  # a request that finished at once: the loop below goes on
        self._serving = True
        try:
            while (
                self._buffer and self._request is None and self._lent is None and self._web is None
                and not self.transport.disconnecting  # type: ignore[union-attr]
            ):
                if not self._next():
                    break
        finally:
            self._serving = False

    def _next(self) -> bool:
        """
        Start the request at the head of the buffer; False when more bytes are needed
        first, or the connection has gone to twisted.web for good.
        """
        buffer = self._buffer
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            line_end = buffer.find(b"\r\n")
            if len(buffer) > MAX_HEAD or (line_end >= 0 and not buffer[:line_end].endswith(b" HTTP/1.1")):
                self._hand_on()
            return False
        lines = buffer[:end].split(b"\r\n")
        line = lines[0].split(b" ")
        read = read_fields(lines[1:]) if end <= MAX_HEAD and len(line) == 3 and line[2] == b"HTTP/1.1" else None
        if read is None:
            self._hand_on()
            return False
        fields, length, close = read
        start = end + 4
        resource = self._site.direct.get((line[0], line[1]))
        if not isinstance(resource, HandlerResource) or length > MAX_BODY:
            # Lent at its head, so that what twisted.web's requests do at the headers (the
            # management guard, an upload streamed to its worker) happens before the body.
            self._buffer = buffer[start:]
            self._lend(buffer[:start], length)
            return True
        if len(buffer) - start < length:
            return False  # the body is still coming
        self._buffer = buffer[start + length :]
        request = FrontRequest(self, line[0], line[1], fields, buffer[start : start + length], close)
        self._request = request
        resource.render(request)  # type: ignore[arg-type]
        return True

    def request_done(self, request: FrontRequest) -> None:
        """
        A request has finished: log it, then close the connection if its client asked,
        or go on to the next one.
        """
        if request is not self._request:
            return
        self._request = None
        self._producer = None
        self._site.log(request)
        if request.close:
            self._buffer = b""
            self.loseConnection()
            return
        self._next_turn()

    def _next_turn(self) -> None:
        if self._timer is not None:
            self._idle_since = self.seconds()
        if self._ahead:
            self._ahead = False
            self._reading()
        if self._buffer:
            self._serve()

    # -- twisted.web ------------------------------------------------------------------------

    def _channel(self) -> EagerChannel:
        # The channel becomes the socket's producer, as a twisted.web channel always is.
        transport: Any = self.transport
        transport.unregisterProducer()
        channel: EagerChannel = self._site.web_channel()
        # twisted.web asks each request's channel for the local address: a connection's
        # never changes, so one getsockname serves every channel it is lent to.
        if self._host is None:
            self._host = transport.getHost()
        channel._host = self._host
        channel.makeConnection(transport)
        return channel

    def _lend(self, head: bytes, length: int) -> None:
        """
        Give twisted.web the connection for one request: its C{head} now, then the
        C{length} bytes of its body as they come.
        """
        channel = self._channel()
        channel.lender = self
        self._lent = channel
        self._owed = length
        channel.dataReceived(head)
        self._feed()

    def _feed(self) -> None:
        # The lent request's body and nothing past it: the bytes after are the front's.
        while self._owed and self._buffer and self._lent is not None:
            buffer = self._buffer
            if len(buffer) <= self._owed:
                piece, self._buffer = buffer, b""
            else:
                piece, self._buffer = buffer[: self._owed], buffer[self._owed :]
            self._owed -= len(piece)
            self._lent.dataReceived(piece)

    def returned(self, channel: EagerChannel) -> None:
        """
        A lent channel has answered its request: take the connection back, unless the
        channel is closing it.
        """
        transport: Any = self.transport
        if channel is not self._lent or not channel.persistent or transport.disconnecting:
            return
        if self._owed:
            # Answered before its body was in: the body's bytes are still twisted.web's
            # to read, so the connection stays with it.
            self._web, self._lent = channel, None
            channel.lender = None
            buffer, self._buffer = self._buffer, b""
            self._owed = 0
            if buffer:
                channel.dataReceived(buffer)
            return
        self._lent = None
        channel.lender = None
        channel.setTimeout(None)
        # The channel's socket, and whether its answer filled it, become the front's again.
        transport.unregisterProducer()
        transport.registerProducer(self, True)
        self._blocked = bool(getattr(transport, "producerPaused", False))
        self._reading()
        self._next_turn()

    def _hand_on(self) -> None:
        """
        Give the connection to twisted.web for good, with what has been read of it.
        """
        self._stop_timer()
        buffer, self._buffer = self._buffer, b""
        self._web = self._channel()
        if buffer:
            self._web.dataReceived(buffer)
