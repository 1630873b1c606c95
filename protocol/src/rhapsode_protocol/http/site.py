"""
The HTTP server both processes listen with.  twisted.web parses every request; these
subclasses bound what a client may send, answer every refusal in the error envelope,
and make responses fast where twisted.web allows.

At the head: a request line over L{MAX_REQUEST_LINE} is 414, a head over
L{MAX_HEADER_LINES} lines or L{MAX_HEAD_BYTES} bytes is 431, and a head that is not
complete L{HEAD_SECONDS} after its first byte is 408, however slowly it trickles.  As
soon as the head is in, and before any body is read, the route is resolved exactly as
the router will resolve it (method in any case, path percent-decoded, through the same
URL map): an unknown path is 404, a wrong method 405 with C{Allow}, a path the router
would redirect gets a relative C{Location} (never one built from the client's C{Host}),
and a body over the route's limit is 413, whether its length is declared or it arrives
chunked.  A body that stalls for the site's idle timeout is 408.  Each refusal writes
one envelope and closes the connection; nothing the client sends after it is read.

Responses go to the socket as they are written (L{send_now}), a response's headers and
first bytes leave in one send (L{EagerRequest}), the route on the path of every
utterance skips the router (L{HandlerResource}), a site is told of each connection as it
opens and closes so a drain can close them all, and each request is logged once, with
its status, its duration and, for an error, its reason.

Every answer, a refusal at the head included, carries C{x-request-id}: the one the client
sent, when it is one (L{REQUEST_ID}: at most 128 characters a log line can hold whole),
else one made here; the access line names it, so a client's report of a request finds
its line (LiveKit warns of every answer that lacks one).
"""

from __future__ import annotations

import json
import re
import secrets
import socket
from contextlib import contextmanager
from http import HTTPStatus
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable, Iterator, Mapping
from urllib.parse import unquote_to_bytes, urlsplit

from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import connectionDone
from twisted.logger import Logger, LogLevel
from twisted.python.failure import Failure
from twisted.web import http, resource, server
from twisted.web.http_headers import Headers
from twisted.web.iweb import IRequest
from werkzeug.exceptions import MethodNotAllowed, NotFound
from werkzeug.routing import Map, RequestRedirect

from ..errors import BadRequest, SpeechError

__all__ = [
    "DEFAULT_BODY_LIMIT",
    "HEAD_SECONDS",
    "IDLE_SECONDS",
    "MAX_HEAD_BYTES",
    "MAX_HEADER_LINES",
    "MAX_REQUEST_LINE",
    "REQUEST_ID",
    "DirectSite",
    "EagerChannel",
    "EagerRequest",
    "HandlerResource",
    "Route",
    "Routes",
    "gathered",
    "no_such_path",
    "reason_phrase",
    "request_id_of",
    "send_now",
    "wrong_method",
]

#: The longest request line (method, target, version): 414 past it.
MAX_REQUEST_LINE = 8 * 1024
#: The most header lines, and the most bytes of request line and headers together: 431.
MAX_HEADER_LINES = 100
MAX_HEAD_BYTES = 16 * 1024
#: How long a request's head may take from its first byte: 408 past it.
HEAD_SECONDS = 10.0
#: How long a connection may send nothing, mid-body or between requests.
IDLE_SECONDS = 60.0
#: The body a route takes when its table says nothing: small JSON, or none.
DEFAULT_BODY_LIMIT = 64 * 1024
#: A path is echoed in messages and log lines; this much of it.
_SHOWN = 200
#: The header a request's id travels in, both ways.
REQUEST_ID_HEADER = b"x-request-id"
#: A client's request id that is taken as it is: printable, with no space, quote or
#: separator a log line or a header could be split by, and short.  Anything else is
#: replaced by one made here (so a client cannot write into the log through it).
REQUEST_ID = re.compile(rb"[A-Za-z0-9._:/+=@-]{1,128}")

_log = Logger(namespace="rhapsode.access")

# Where a connection's current request is (EagerChannel._state).
_BETWEEN, _HEAD, _BODY, _HANDLING = "between", "head", "body", "handling"


#: What L{send_now} reads of a Twisted socket transport to know nothing is queued.
#: Twisted has no public way to ask (twisted/twisted#5303, "Default transport
#: implementation doesn't write out bytes immediately", open since 2011); a unit test
#: checks that a real socket transport still has every one of them, so an upgrade that
#: renames one fails the suite rather than quietly costing a turn of the loop per write.
QUEUE_ATTRIBUTES = ("connected", "disconnecting", "_writeDisconnected", "producerPaused",
                    "dataBuffer", "offset", "_tempDataBuffer", "_aborting")


#: The phrases RFC 9110 renamed, which this Python's http.HTTPStatus still spells the old way.
_RFC9110 = {
    413: b"Content Too Large",
    414: b"URI Too Long",
    416: b"Range Not Satisfiable",
    422: b"Unprocessable Content",
}


def reason_phrase(status: int) -> bytes:
    """
    The standard reason phrase of C{status} (RFC 9110's, through http.HTTPStatus):
    twisted.web has none for 422, 429 or 431, where it sends "Unknown Status", and
    older spellings for others ("Request Time-out").  C{Unknown Status} for a code no
    standard names.
    """
    renamed = _RFC9110.get(status)
    if renamed is not None:
        return renamed
    try:
        return HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        return b"Unknown Status"


def request_id_of(headers: Headers) -> bytes:
    """
    The request id to answer with: the client's C{x-request-id} when it sent exactly one
    that L{REQUEST_ID} matches, else a new one (32 hex digits).
    """
    sent = headers.getRawHeaders(REQUEST_ID_HEADER) or []
    if len(sent) == 1 and REQUEST_ID.fullmatch(sent[0]):
        return bytes(sent[0])
    return secrets.token_hex(16).encode("ascii")


def _nothing_queued(transport: Any) -> bool:
    """
    Whether C{transport} is a socket that is open for writing with nothing queued in
    front of a new write (False for anything that is not a Twisted socket transport).
    """
    try:
        return bool(
            transport.connected
            and not transport.disconnecting
            and not transport._writeDisconnected
            and not transport.producerPaused
            and len(transport.dataBuffer) == transport.offset
            and not transport._tempDataBuffer
            # Aborted (tcp.Connection's own flag): its bytes must never leave.
            and not getattr(transport, "_aborting", False)
        )
    except AttributeError:
        return False


@contextmanager
def gathered(request: Any) -> Iterator[None]:
    """
    While inside, what is written to C{request}'s connection is gathered, and it leaves
    in one send at the end, or when the request finishes, whichever is first
    (L{EagerChannel.hold}, L{EagerChannel.flush}): a stream's last audio and its end, which
    are written one after the other in one turn of the loop.  Nothing for a request on any
    other channel.  Hold it only within one turn: nothing leaves until it ends.
    """
    channel = getattr(request, "channel", None)
    if not isinstance(channel, EagerChannel):
        yield
        return
    channel.hold()
    try:
        yield
    finally:
        channel.release()


def send_now(transport: Any, data: bytes) -> None:
    """
    Write C{data} to C{transport}, handing it to the kernel at once when nothing is
    queued ahead of it; what the socket does not take is queued as any write is.

    A plain C{write} queues the bytes and asks the reactor to poll the socket for
    writability: two changes to the poll set and a turn of the loop per write, on a
    socket that nearly always has room.  Sent at once, a write that the kernel takes
    whole costs one send and nothing else, and backpressure is unchanged (the socket's
    producer is paused only when bytes are left queued).  A transport that is not a
    socket, or a socket that is closing, is written to as usual; so is one whose send
    fails, and the reactor then finds the failure as it would have.
    """
    if data and _nothing_queued(transport):
        # A socket sends at most 128 KiB at a time: the rest goes on from a view.
        view = memoryview(data)
        done = 0
        while done < len(data):
            sent = transport.writeSomeData(view[done:] if done else data)
            if not isinstance(sent, int) or sent <= 0:
                break
            done += sent
        if done == len(data):
            return
        data = data[done:]
    transport.write(data)


class EagerChannel(http.HTTPChannel):
    """
    An HTTP/1.1 channel that bounds a request's head, refuses in the error envelope, and
    sends response bytes as they are written (L{send_now}) instead of on the reactor's
    next turn, so each relayed piece of audio costs a send and not also two changes to
    the poll set and a turn of the loop.

    Between L{hold} and L{release} writes are gathered and then leave in one send: a
    response's headers and its first bytes, which twisted.web writes separately, reach
    the client together (see L{EagerRequest}).  It tells its site's C{connections} of
    itself as it opens and closes, and asks for the site's C{send_buffer} on a Unix
    socket.

    It follows twisted.web's parse without reading its private state: it notes each
    request line as twisted.web is handed it, decides the route from that at the end of
    the head, and the request checks, when twisted.web hands it the parsed line, that
    both read the same line (anything else is refused, so a difference fails closed).
    """

    _held: list[bytes] | None = None
    _holds = 0
    _host: Any = None
    #: Set by the site that built this channel (twisted.web's Site.buildProtocol).
    site: Any = None
    #: Each line is checked here first, so twisted.web's own limits never decide.
    MAX_LENGTH = MAX_HEAD_BYTES + 2

    def __init__(self) -> None:
        super().__init__()
        self._refused = False
        #: Where the current request is: _BETWEEN requests (waiting for a request line),
        #: in its _HEAD, in its _BODY, or being answered (_HANDLING, when whatever
        #: arrives is the next request's, buffered by twisted.web).
        self._state = _BETWEEN
        self._ate_blank = False
        self._line: list[bytes] | None = None
        self._head_lines = 0
        self._head_bytes = 0
        self._head_started = 0.0
        #: A head has begun and is not complete: it is on its deadline.
        self._head_pending = False
        self._head_timer: IDelayedCall | None = None
        #: Waiting for what was written to leave the process (L{when_sent}).
        self._sent_waiters: list[Deferred[None]] = []

    # -- the connection ----------------------------------------------------------------

    def connectionMade(self) -> None:
        super().connectionMade()
        site = self.site
        tracker = getattr(site, "connections", None)
        if tracker is not None:
            tracker.opened(self)
        size = getattr(site, "send_buffer", None)
        handle = getattr(self.transport, "getHandle", None)
        sock = handle() if handle is not None else None
        if size and isinstance(sock, socket.socket) and sock.family == socket.AF_UNIX:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
            except OSError:
                pass  # the system's own size, as before

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._stop_head_timer()
        super().connectionLost(reason)
        # Nothing is left to send: whoever waited for the bytes to go is told.
        self._sent()
        tracker = getattr(self.site, "connections", None)
        if tracker is not None:
            tracker.closed(self)

    # -- reading a head ------------------------------------------------------------------

    def dataReceived(self, data: bytes) -> None:
        if self._refused:
            return
        if not self._head_pending and self._state in (_BETWEEN, _HEAD):
            self._head_pending = True
            self._head_started = self.site.reactor.seconds() if self.site is not None else 0.0
        super().dataReceived(data)
        # The head's deadline needs a timer only when a head is left incomplete: the
        # usual request arrives whole in one read and costs none.
        if self._head_pending and self._head_timer is None and not self._refused:
            self._start_head_timer()

    def lineReceived(self, line: bytes) -> None:
        if self._refused:
            return
        if self._state == _BETWEEN:
            if not line and not self._ate_blank:
                # twisted.web forgives one empty line before a request line.
                self._ate_blank = True
                super().lineReceived(line)
                return
            if len(line) > MAX_REQUEST_LINE:
                self._request_line_too_long()
                return
            self._state = _HEAD
            parts = line.split()
            self._line = parts if len(parts) == 3 else None
            self._head_lines = 1
            self._head_bytes = len(line)
        elif line:
            self._head_lines += 1
            self._head_bytes += len(line)
            if self._head_lines > MAX_HEADER_LINES + 1 or self._head_bytes > MAX_HEAD_BYTES:
                self.refuse(BadRequest(
                    f"the request's head is over {MAX_HEADER_LINES} header lines or "
                    f"{MAX_HEAD_BYTES} bytes",
                    field="headers",
                    status=431,
                ))
                return
        super().lineReceived(line)

    def lineLengthExceeded(self, line: bytes) -> None:
        if self._refused:
            return
        if self._state == _BETWEEN:
            self._request_line_too_long()
        else:
            self.refuse(BadRequest(
                f"a header line is over {MAX_HEAD_BYTES} bytes", field="headers", status=431
            ))

    def _request_line_too_long(self) -> None:
        self.refuse(BadRequest(f"the request line is over {MAX_REQUEST_LINE} bytes", field="path", status=414))

    def allHeadersReceived(self) -> None:
        self._stop_head_timer()
        self._state = _BODY
        request = self.requests[-1]
        if isinstance(request, EagerRequest):
            request.head_started = self._head_started
            request.request_id = request_id_of(request.requestHeaders)
            request.responseHeaders.setRawHeaders(REQUEST_ID_HEADER, [request.request_id])
            if self._line is None:
                # Not three words: twisted.web has refused the line already, or, should it
                # read the line otherwise, the request is refused unadmitted when handed over.
                return super().allHeadersReceived()
            method, target, _ = self._line
            request.line = (method, target)
            try:
                self.site.admit(request, method, target, self.length)
            except SpeechError as error:
                request.refused = True
                self.refuse(error, request)
            if self._refused:
                # Nothing of the body is read: twisted.web is told there is none.
                self.length = 0
                return
        super().allHeadersReceived()

    def allContentReceived(self) -> None:
        self._state = _HANDLING
        self._ate_blank = False
        self._head_lines = 0
        self._head_bytes = 0
        self._line = None
        super().allContentReceived()

    def requestDone(self, request: Any) -> None:
        # Before twisted.web replays what arrived meanwhile: that is the next head.
        self._state = _BETWEEN
        super().requestDone(request)

    def timeoutConnection(self) -> None:
        if self._state in (_HEAD, _BODY) or self._head_pending:
            # Idle mid-head or mid-body: the client is told, then the connection goes.
            self.refuse(BadRequest(
                f"the request sent nothing for {self.timeOut:g} s", field="body", status=408
            ))
            return
        super().timeoutConnection()

    def _start_head_timer(self) -> None:
        site = self.site
        left = getattr(site, "head_timeout", HEAD_SECONDS)
        if site is not None:
            left -= site.reactor.seconds() - self._head_started
        self._head_timer = self.callLater(max(left, 0.0), self._head_too_slow)

    def _stop_head_timer(self) -> None:
        self._head_pending = False
        timer, self._head_timer = self._head_timer, None
        if timer is not None and timer.active():
            timer.cancel()

    def _head_too_slow(self) -> None:
        self._head_timer = None
        seconds = getattr(self.site, "head_timeout", HEAD_SECONDS)
        self.refuse(BadRequest(
            f"the request's head was not complete within {seconds:g} s", field="headers", status=408
        ))

    # -- refusing ------------------------------------------------------------------------

    def refuse(self, error: SpeechError, request: Any = None) -> None:
        """
        Answer C{error} in the envelope, close the connection once it is written, and
        read nothing more from it.  Once per connection: a second refusal is ignored.
        """
        if self._refused or self.transport is None:
            return
        self._refused = True
        self._stop_head_timer()
        shape = getattr(self.site, "shape_refusal", None)
        if shape is not None:
            body, headers = shape(request, error)
        else:
            body, headers = json.dumps(error.envelope()).encode(), error.headers
        reason = reason_phrase(error.status)
        if isinstance(request, EagerRequest):
            if request.request_id is None:
                request.request_id = request_id_of(request.requestHeaders)
            request_id = request.request_id
        else:
            # Refused before a request was read whole (a head too slow, a line too long).
            request_id = request_id_of(Headers())
        head = [
            b"HTTP/1.1 %d %s\r\n" % (error.status, reason),
            b"Content-Type: application/json\r\nConnection: close\r\n",
            b"Content-Length: %d\r\n" % len(body),
            b"x-request-id: %s\r\n" % request_id,
        ]
        for name, value in headers:
            head.append(b"%s: %s\r\n" % (name, value))
        self.transport.write(b"".join(head) + b"\r\n" + body)
        site = self.site
        if site is not None and hasattr(site, "log_refusal"):
            site.log_refusal(self, request, error)
        self.loseConnection()

    def _respondToBadRequestAndDisconnect(self) -> None:
        # twisted.web's own refusal of a malformed request (a bad header line, a bad
        # Content-Length, a broken chunk), in the envelope instead of a bare 400.
        self.refuse(BadRequest("the request is not well-formed HTTP/1.1", field="headers"))

    # -- sending --------------------------------------------------------------------------

    def hold(self) -> None:
        """
        Gather what is written from now until the matching L{release}; holds nest, and
        only the outermost release sends.
        """
        self._holds += 1
        if self._held is None:
            self._held = []

    def release(self) -> None:
        self._holds = max(self._holds - 1, 0)
        if self._holds:
            return
        held, self._held = self._held, None
        if held:
            send_now(self.transport, b"".join(held))

    def flush(self) -> None:
        """
        Send what is held now, still holding what comes after: a request finishing
        inside a hold has all it wrote in the transport before anybody hears it finished
        (and before a connection that does not persist is closed).
        """
        held = self._held
        if held:
            self._held = []
            send_now(self.transport, b"".join(held))

    def writeHeaders(self, version: bytes, code: bytes, reason: bytes, headers: Any) -> None:
        if self._held is None or not isinstance(headers, Headers):
            # What is held goes first; the holds stay as they were.
            self.flush()
            super().writeHeaders(version, code, reason, headers)
            return
        held = self._held
        held += (version, b" ", code, b" ", reason, b"\r\n")
        for name, values in headers.getAllRawHeaders():
            for value in values:
                held += (name, b": ", value, b"\r\n")
        held.append(b"\r\n")

    def write(self, data: bytes) -> None:
        if self._held is not None:
            self._held.append(data)
        else:
            send_now(self.transport, data)

    def writeSequence(self, iovec: Any) -> None:
        if self._held is not None:
            self._held.extend(iovec)
        else:
            send_now(self.transport, b"".join(iovec))

    def when_sent(self) -> "Deferred[None]":
        """
        Fires once what has been written to this connection has left the process, or
        the connection has gone.

        A socket transport that holds more than its buffer size pauses this channel (its
        producer) and resumes it only once it holds nothing at all; until then the bytes
        are still this process's memory.  One that holds less sends it without telling
        anybody, so this fires at once then, with at most the transport's buffer size
        (64 KiB) still queued; and at once on a transport that is not a socket.
        """
        transport = self.transport
        if transport is None or not getattr(transport, "producerPaused", False):
            return succeed(None)
        waiter: Deferred[None] = Deferred()
        self._sent_waiters.append(waiter)
        return waiter

    def resumeProducing(self) -> None:
        super().resumeProducing()
        # The transport resumes its producer once it has sent everything; a resume from
        # anybody else (an upload's consumer) leaves it paused, and the waiters waiting.
        if self._sent_waiters and not getattr(self.transport, "producerPaused", False):
            self._sent()

    def _sent(self) -> None:
        waiters, self._sent_waiters = self._sent_waiters, []
        for waiter in waiters:
            waiter.callback(None)

    def getHost(self) -> Any:
        # Asked once per request by twisted.web; a connection's own address never
        # changes, so it costs one getsockname per connection, not one per request.
        if self._host is None:
            self._host = super().getHost()
        return self._host


@dataclass(frozen=True)
class Route:
    """
    Where a request goes, as the router will send it: its method (upper case), the URL
    rule it matched (C{"/engines/<string:engine_id>/voices"}), the rule's arguments, and
    the most body it may carry.
    """

    method: str
    rule: str
    arguments: Mapping[str, Any] = field(default_factory=dict)
    limit: int = DEFAULT_BODY_LIMIT


class Routes:
    """
    Resolves a request line to its L{Route} through a Klein app's URL map, exactly as
    Klein will when it routes the request: the method in any case, the path split and
    percent-decoded segment by segment as twisted.web does, then matched by werkzeug.

    @param limits: the most body each route takes, by (method, rule); the rest take
        L{DEFAULT_BODY_LIMIT}.
    """

    def __init__(self, url_map: Map, limits: Mapping[tuple[str, str], int] = {}) -> None:
        self._map = url_map
        self._limits = dict(limits)

    def limit(self, method: str, rule: str) -> int:
        return self._limits.get((method, rule), DEFAULT_BODY_LIMIT)

    def resolve(self, method: bytes, target: bytes) -> Route:
        """
        The route of C{method} and C{target} (the request line's), or a refusal.

        @raise BadRequest: 404 for no such path, 405 (carrying C{Allow}) for a method the
            path does not take, 308 (carrying a relative C{Location}) where the router
            would redirect, 400 for a path that is not UTF-8.
        """
        verb = method.decode("latin-1").upper()
        path, _, query = target.partition(b"?")
        # As twisted.web splits a path into segments and Klein joins them again.
        segments = [unquote_to_bytes(part) for part in path[1:].split(b"/")]
        try:
            path_info = ("/" + b"/".join(segments).decode("utf-8")) if path else ""
        except UnicodeDecodeError:
            raise BadRequest("the path is not UTF-8", field="path") from None
        adapter = self._map.bind("localhost", "", path_info=path_info, default_method=verb)
        shown = _shown(path_info)
        try:
            rule, arguments = adapter.match(return_rule=True)
        except RequestRedirect as redirect:
            # Relative: werkzeug would build the URL from the client's Host header.
            location = urlsplit(redirect.new_url).path
            refusal = BadRequest(f"{shown} is at {_shown(location)}", field="path", status=308)
            refusal.headers = ((b"Location", location.encode("utf-8") + (b"?" + query if query else b"")),)
            raise refusal from None
        except MethodNotAllowed as wrong:
            raise wrong_method(verb, path_info, self._allowed(path_info, wrong.valid_methods or ())) from None
        except NotFound:
            raise no_such_path(path_info) from None
        return Route(verb, rule.rule, arguments, self.limit(verb, rule.rule))

    def _allowed(self, path_info: str, methods: Iterable[str]) -> list[str]:
        """
        The methods of the route C{path_info} is: werkzeug names every method of every
        rule matching it, so C{/installs/outdated} (POST) would also be offered GET for
        C{/installs/<job>}, whose argument matches the word.  Of the rules matching, the
        one with the fewest arguments (the most literal) is the path's own.
        """
        by_rule: dict[str, tuple[int, list[str]]] = {}
        for method in methods:
            adapter = self._map.bind("localhost", "", path_info=path_info, default_method=method)
            try:
                rule, arguments = adapter.match(return_rule=True)
            except Exception:
                continue
            by_rule.setdefault(rule.rule, (len(arguments), []))[1].append(method)
        if not by_rule:
            return list(methods)
        return min(by_rule.values(), key=lambda entry: entry[0])[1]


def no_such_path(path: str) -> BadRequest:
    """
    The refusal of a path no route has: 404, bad_request on the path.
    """
    return BadRequest(f"no route {_shown(path)}", field="path", status=404)


def wrong_method(method: str, path: str, allowed: Iterable[str]) -> BadRequest:
    """
    The refusal of a method C{path} does not take: 405, naming what it takes in the
    message and in C{Allow}.
    """
    methods = ", ".join(sorted(allowed))
    refusal = BadRequest(
        f"{_shown(method)} is not a method of {_shown(path)} (allowed: {methods})", field="method", status=405
    )
    refusal.headers = ((b"Allow", methods.encode("ascii")),)
    return refusal


def _shown(text: str) -> str:
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


class EagerRequest(server.Request):
    """
    A request admitted at its head (L{DirectSite.admit}) whose body is held to its
    route's limit as it arrives, and whose headers and first bytes leave in one send on
    an L{EagerChannel}.

    @ivar route: where it goes, set when its head was admitted.
    @ivar refused: it was answered at its head or mid-body and is never processed.
    """

    route: Route | None = None
    #: The method and target the route was decided from, as the channel read them.
    line: tuple[bytes, bytes] | None = None
    refused = False
    head_started = 0.0
    #: For the access line: the error an envelope answered with, as "code: message".
    error_reason: str | None = None
    #: The id this request is answered and logged with (L{request_id_of}), once its
    #: head is in.
    request_id: bytes | None = None
    _body_bytes = 0
    _logged = False

    def setResponseCode(self, code: int, message: bytes | None = None) -> None:
        # Every status with its standard phrase, those twisted.web does not know included.
        super().setResponseCode(code, reason_phrase(code) if message is None else message)

    def handleContentChunk(self, data: bytes) -> None:
        if self.refused:
            return
        self._body_bytes += len(data)
        route = self.route
        if route is not None and self._body_bytes > route.limit:
            self.refuse(BadRequest(f"the body is over {route.limit} bytes", field="body", status=413))
            return
        self.body_received(data)

    def body_received(self, data: bytes) -> None:
        """
        A piece of the body, within its route's limit: kept for the handler (a subclass
        may send it on instead, as the core does with a voice upload).
        """
        server.Request.handleContentChunk(self, data)

    def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:
        if self.refused:
            return
        if self.route is None or self.line != (command, path):
            # The route was decided from a line twisted.web did not parse the same way:
            # refused rather than run on a decision made about another request.
            self.refuse(BadRequest("the request line could not be read", field="path"))
            return
        super().requestReceived(command, path, version)

    def refuse(self, error: SpeechError) -> None:
        """
        Answer C{error} now, at the head or mid-body, and read nothing more.
        """
        self.refused = True
        channel = self.channel
        if isinstance(channel, EagerChannel):
            channel.refuse(error, self)

    def write(self, data: bytes) -> None:
        channel = self.channel
        if self.startedWriting or not isinstance(channel, EagerChannel):
            super().write(data)
            return
        channel.hold()
        try:
            super().write(data)
        finally:
            channel.release()

    def finish(self) -> None:
        channel = self.channel
        if isinstance(channel, EagerChannel):
            channel.flush()
        super().finish()

    def connectionLost(self, reason: Failure) -> None:
        site = getattr(self.channel, "site", None)
        super().connectionLost(reason)
        if not self.finished and not self.refused and self.route is not None and site is not None:
            # A stream cut short, by the client or by an abort: logged all the same.
            site.log(self, aborted=True)


class HandlerResource(resource.Resource):
    """
    One route answered by one coroutine handler, with no router in front: for the
    route on the path of every utterance, where binding and matching a URL map cost
    more than the handler.  The handler maps its own failures (as every route here
    does); a client that hangs up cancels it.
    """

    isLeaf = True

    def __init__(self, handler: Callable[[IRequest], Awaitable[bytes | None]], log: Logger) -> None:
        super().__init__()
        self._handler = handler
        self._log = log

    def render(self, request: IRequest) -> Any:
        answer: Deferred[bytes | None] = Deferred.fromCoroutine(self._handler(request))  # type: ignore[arg-type]
        gone: list[bool] = []

        def hung_up(_: object) -> None:
            gone.append(True)
            answer.cancel()

        request.notifyFinish().addErrback(hung_up)  # type: ignore[attr-defined]
        answer.addCallbacks(lambda body: _finish(request, body, gone), lambda f: f.trap(CancelledError))
        answer.addErrback(lambda f: self._log.failure("answering {path}", f, path=getattr(request, "path", b"")))
        return server.NOT_DONE_YET


def _finish(request: Any, body: bytes | None, gone: list[bool]) -> None:
    # A request whose connection has gone is never written to or finished: the route's
    # own notifyFinish may have resumed its handler before the hang-up below was told.
    if request.finished or gone or getattr(request, "_disconnected", False):
        return
    if body:
        request.write(body)
    request.finish()


class DirectSite(server.Site):
    """
    A site that admits each request at its head against its L{Routes}, hands the
    requests named in C{direct} (method and exact path) straight to their resource, and
    routes the rest through its root as usual.

    Its connections are plain HTTP/1.1 channels that send as they write
    (L{EagerChannel}).  twisted.web's default wraps each in a proxy that would switch
    to HTTP/2 after a TLS negotiation; these sites never speak TLS, so the proxy was
    only a layer on every call.

    Each request is logged once, at info, with its status, its duration and, for an
    error, its reason (L{log}); without C{access_log} (a log level above info) no
    access line is even formatted.

    @param routes: the route table requests are admitted against; without one every
        request is admitted with L{DEFAULT_BODY_LIMIT} (for tests of the channel).
    @param timeout: how long a connection may send nothing, mid-body or between
        requests.
    @param head_timeout: how long a request's head may take from its first byte.
    """

    protocol = EagerChannel  # type: ignore[assignment]
    requestFactory = EagerRequest
    #: Told of each connection as it opens and closes (C{opened(channel)},
    #: C{closed(channel)}), where something must close them all at the end.
    connections: Any = None
    #: The send buffer each Unix socket connection asks the kernel for (None: the
    #: system's default), set by the worker.
    send_buffer: int | None = None

    def __init__(
        self,
        root: Any,
        direct: dict[tuple[bytes, bytes], resource.Resource] | None = None,
        access_log: bool = True,
        reactor: Any = None,
        *,
        routes: Routes | None = None,
        timeout: float = IDLE_SECONDS,
        head_timeout: float = HEAD_SECONDS,
    ) -> None:
        super().__init__(root, parsePOSTFormSubmission=False, reactor=reactor, timeout=timeout)
        self.head_timeout = head_timeout
        self.direct = dict(direct or {})
        self.access_log = access_log
        self.routes = routes
        # The direct routes, resolved once: they are matched on every utterance.
        self._direct_routes = {
            key: Route(key[0].decode("ascii"), key[1].decode("ascii"), {}, self._limit(*key))
            for key in self.direct
        }

    def _limit(self, method: bytes, path: bytes) -> int:
        if self.routes is None:
            return DEFAULT_BODY_LIMIT
        return self.routes.limit(method.decode("ascii"), path.decode("ascii"))

    def admit(self, request: EagerRequest, method: bytes, target: bytes, length: int | None) -> None:
        """
        Decide at a request's head, before its body is read, whether it goes on: its
        route, who may call it (L{guard}), and its declared length against the route's
        limit; then L{admitted}.

        @raise SpeechError: the refusal to answer with.
        """
        route = self._direct_routes.get((method, target))
        if route is None:
            if self.routes is None:
                route = Route(method.decode("latin-1").upper(), "", {}, DEFAULT_BODY_LIMIT)
            else:
                route = self.routes.resolve(method, target)
        self.guard(request, route)
        if length is not None and length > route.limit:
            raise BadRequest(f"the body is over {route.limit} bytes", field="body", status=413)
        request.route = route
        self.admitted(request, route, length)

    def guard(self, request: EagerRequest, route: Route) -> None:
        """
        Refuse a caller that may not call C{route} (raise); a subclass's rule.  A caller
        refused here learns nothing about its request, not even that its body is too big.
        """

    def admitted(self, request: EagerRequest, route: Route, length: int | None) -> None:
        """
        C{request} goes on to C{route}; a subclass may start on it before its body.
        """

    def log(self, request: Any, aborted: bool = False) -> None:
        """
        One access line for C{request}: method, path, status, bytes sent, duration
        since its first byte arrived, and the error's reason when it answered with one.
        """
        if not self.access_log or getattr(request, "_logged", False):
            return
        request._logged = True
        started = getattr(request, "head_started", 0.0)
        duration = (self.reactor.seconds() - started) * 1000 if started else 0.0
        reason = getattr(request, "error_reason", None)
        # A health check that is answered is routine (the core's watchdog asks every few
        # seconds, and so does a monitor): at debug, so info shows what happened.
        routine = request.code == 200 and request.method == b"GET" and getattr(request, "path", b"") == b"/health"
        _log.emit(
            LogLevel.debug if routine else LogLevel.info,
            "{method} {path} {status}{aborted} {sent} B {duration:.1f} ms{reason} id={request_id}",
            method=_text(request.method),
            path=_shown(_text(request.uri)),
            status=request.code,
            aborted=" (aborted)" if aborted else "",
            sent=getattr(request, "sentLength", 0),
            duration=duration,
            reason=f" {reason}" if reason else "",
            request_id=_text(getattr(request, "request_id", None) or b"-"),
            peer=_peer(request),
        )

    def log_refusal(self, channel: EagerChannel, request: Any, error: SpeechError) -> None:
        """
        The access line of a request refused before any handler saw it.
        """
        if not self.access_log:
            return
        line = getattr(request, "line", None)
        method, target = line if line is not None else (b"-", b"-")
        started = getattr(request, "head_started", 0.0)
        request_id = getattr(request, "request_id", None) if request is not None else None
        _log.info(
            "{method} {path} {status} refused: {reason} {duration:.1f} ms id={request_id}",
            method=_text(method),
            path=_shown(_text(target)),
            status=error.status,
            reason=f"{error.code}: {error.message}",
            duration=(self.reactor.seconds() - started) * 1000 if started else 0.0,
            request_id=_text(request_id or b"-"),
            peer=_peer(request) if request is not None else None,
        )

    def getResourceFor(self, request: Any) -> Any:
        target = self.direct.get((request.method, request.path))
        if target is None:
            return super().getResourceFor(request)
        request.site = self
        request.sitepath = []
        return target


def _text(value: bytes) -> str:
    return value.decode("utf-8", "replace")


def _peer(request: Any) -> str | None:
    try:
        return getattr(request.getClientAddress(), "host", None)
    except Exception:
        return None
