"""
The front door of both processes' HTTP ports (protocol.md sections 1, 6 and 7): the
direct routes (C{POST /speak}) read and answered without twisted.web's request
machinery, every other request handed to twisted.web for the rest of its connection.

Every utterance comes through here, at the core and again at its worker.  On this path
twisted.web spent more time than the route itself: it reads a request line by line,
builds a request object with two header objects and a dozen fields, and formats its
response head through them again (in the core's in-memory run, C{bench/core_path.py},
about a third of the Python per request).  The front reads only the narrow form a speech client
sends: HTTP/1.1, a method and exact path the site answers directly, header lines that
are strictly well formed, and a body framed by Content-Length and small enough to hold.
Anything else (another route, a query string, a chunked or expect-continue body, an
HTTP/1.0 client, a folded or malformed header line, a body over 64 KiB) goes to
twisted.web with the bytes the front had read, and twisted.web serves that connection
to its end: every request the front does not take is handled exactly as before.

The handler is the same L{HandlerResource} either way.  It sees a L{FrontRequest}, which
does the part of C{IRequest} the direct routes use, with twisted.web's names so the
shared helpers (L{rhapsode_worker._http}) read it as they read any request.  What the
front never keeps: C{Authorization}, so no handler or log line can see it (section 10).
"""

from __future__ import annotations

import re
from io import BytesIO
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import ITCPTransport
from twisted.internet.protocol import Protocol, connectionDone
from twisted.python.failure import Failure
from twisted.web.http import RESPONSES, datetimeToString

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


def _chunk(data: bytes) -> bytes:
    # Joined, not %-formatted: formatting copies a large piece of audio twice, and is
    # some thirty times slower for a 128 KiB one.
    return b"".join((b"%x\r\n" % len(data), data, b"\r\n"))


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
            if length > MAX_BODY:
                return None
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
    (chunked unless a Content-Length was set), a push producer registered straight on
    the client's socket, and C{notifyFinish} failing if the client goes first.
    """

    clientproto = b"HTTP/1.1"

    def __init__(self, channel: "Front", method: bytes, path: bytes, fields: dict[bytes, bytes], body: bytes, close: bool) -> None:
        self.channel = channel
        self.method = method
        self.uri = self.path = path
        self.args: dict[bytes, list[bytes]] = {}
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
            head = b"".join((head, b"%x\r\n" % len(data), data, b"\r\n") if self.chunked else (head, data))
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
        if self.producer is not None:
            raise ValueError(f"registering producer {producer} before previous one ({self.producer}) was unregistered")
        self.producer = producer
        if self._disconnected:
            producer.stopProducing()
            return
        # A streaming producer on the client's socket: a full socket pauses it.
        self.channel.transport.registerProducer(producer, streaming)  # type: ignore[union-attr]

    def unregisterProducer(self) -> None:
        if self.producer is None:
            return
        self.producer = None
        transport = self.channel.transport
        if transport is not None and not self._disconnected:
            transport.unregisterProducer()  # type: ignore[attr-defined]

    def connection_lost(self, reason: Failure) -> None:
        self._disconnected = True
        notifications, self._notifications = self._notifications, []
        for finished in notifications:
            finished.errback(reason)


class Front(Protocol):
    """
    One client connection to the public port: direct routes read and answered here, one
    request at a time (a pipelined one waits its turn, and reading pauses once more than
    a request's worth is waiting); anything else hands the connection to twisted.web.

    C{site} is a L{DirectSite}: its C{direct} routes, its access log, its C{reactor} and
    C{timeOut} (an idle connection is closed after it), its C{connections} (told as the
    connection opens and closes, where the site has them), and C{web_channel()} for the
    twisted.web channel that takes over a connection.
    """

    def __init__(self, site: Any) -> None:
        self._site = site
        self._buffer = b""
        self._request: FrontRequest | None = None
        self._web: EagerChannel | None = None
        self._serving = False
        self._paused = False
        self._timer: Any = None
        self._idle_since = 0.0

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
        if ITCPTransport.providedBy(self.transport):
            # As twisted.web does: small writes (a head, a first chunk) go at once.
            self.transport.setTcpNoDelay(True)
        timeout = getattr(self._site, "timeOut", None)
        if timeout:
            self._idle_since = self.seconds()
            self._timer = self._site.reactor.callLater(timeout, self._check_idle)

    def _check_idle(self) -> None:
        # Armed once per connection and moved on lazily: a request costs no timer call.
        timeout = self._site.timeOut
        left = timeout if self._request is not None else self._idle_since + timeout - self.seconds()
        if left > 0:
            self._timer = self._site.reactor.callLater(left, self._check_idle)
            return
        self._timer = None
        if self.transport is not None:
            self.transport.loseConnection()

    def _stop_timer(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None and timer.active():
            timer.cancel()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._stop_timer()
        if self._web is not None:
            self._web.connectionLost(reason)
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
        if self._request is None:
            self._serve()
        elif len(self._buffer) > MAX_HEAD + MAX_BODY and not self._paused:
            # A client that sends ahead this much waits for its answer before more is read.
            self._paused = True
            self.transport.pauseProducing()  # type: ignore[union-attr]

    # -- requests -------------------------------------------------------------------------

    def _serve(self) -> None:
        if self._serving:
            return  # a request that finished at once: the loop below goes on
        self._serving = True
        try:
            while self._buffer and self._request is None and self._web is None and self.connected:
                if not self._next():
                    break
        finally:
            self._serving = False

    def _route(self, line: bytes) -> HandlerResource | None:
        parts = line.split(b" ")
        if len(parts) != 3 or parts[2] != b"HTTP/1.1":
            return None
        target = self._site.direct.get((parts[0], parts[1]))
        return target if isinstance(target, HandlerResource) else None

    def _next(self) -> bool:
        """
        Start the request at the head of the buffer; False when more bytes are needed
        first, or the connection has gone to twisted.web.
        """
        buffer = self._buffer
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            line_end = buffer.find(b"\r\n")
            if len(buffer) > MAX_HEAD or (line_end >= 0 and self._route(buffer[:line_end]) is None):
                self._hand_on()
            return False
        lines = buffer[:end].split(b"\r\n")
        resource = self._route(lines[0]) if end <= MAX_HEAD else None
        read = read_fields(lines[1:]) if resource is not None else None
        if resource is None or read is None:
            self._hand_on()
            return False
        fields, length, close = read
        start = end + 4
        if len(buffer) - start < length:
            return False  # the body is still coming
        method, path, _ = lines[0].split(b" ")
        request = FrontRequest(self, method, path, fields, buffer[start : start + length], close)
        self._buffer = buffer[start + length :]
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
        self._site.log(request)
        if request.close:
            self._buffer = b""
            self.transport.loseConnection()  # type: ignore[union-attr]
            return
        if self._timer is not None:
            self._idle_since = self.seconds()
        if self._paused:
            self._paused = False
            self.transport.resumeProducing()  # type: ignore[union-attr]
        if self._buffer:
            self._serve()

    def _hand_on(self) -> None:
        """
        Give the connection to twisted.web with what has been read of it.
        """
        self._stop_timer()
        channel = self._site.web_channel()
        self._web = channel
        buffer, self._buffer = self._buffer, b""
        channel.makeConnection(self.transport)
        if buffer:
            channel.dataReceived(buffer)
