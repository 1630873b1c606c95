"""
The HTTP habits the worker and the core share (protocol.md section 6): JSON answers and
error envelopes, JSON bodies read within a limit, failures mapped onto the taxonomy
before headers and turned into an abort after them, and the duration trailer that
twisted.web has no API for; and the hot route that skips the router.
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from twisted.internet.defer import CancelledError, Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import http, resource, server
from twisted.web.http_headers import Headers
from twisted.web.iweb import IRequest

from . import contract
from ._errors import BadRequest, SpeechError, as_speech_error

DURATION_HEADER = b"X-Rhapsode-Duration-Ms"


def json_response(request: IRequest, status: int, body: Any) -> bytes:
    request.setResponseCode(status)
    request.setHeader(b"Content-Type", b"application/json")
    return json.dumps(body).encode("utf-8")


def error_response(request: IRequest, error: SpeechError) -> bytes:
    return json_response(request, error.status, error.envelope())


def read_json(request: IRequest, schema: dict[str, Any], limit: int) -> dict[str, Any]:
    """
    The request's JSON body checked against C{schema}; no body is an empty object (so
    POST /load with nothing loads the default).
    """
    request.content.seek(0)
    raw = request.content.read(limit + 1)
    if len(raw) > limit:
        raise BadRequest(f"body is over {limit} bytes", field="body")
    return contract.parse_json_body(raw if raw.strip() else b"{}", schema)


def abort_connection(request: IRequest) -> None:
    """
    End a response whose headers have gone without finishing it: the client sees a
    truncated body, never a clean short one.
    """
    transport = transport_of(request)
    if transport is None:
        return
    abort = getattr(transport, "abortConnection", None)
    (abort or transport.loseConnection)()


def answer_failure(request: IRequest, exc: Exception, log: Logger) -> bytes | None:
    """
    What to do with a failure: an error envelope while no header has gone, an aborted
    connection after.  Only an adapter's or the core's own bug is logged as one.
    """
    error = as_speech_error(exc)
    if error.code == "internal":
        log.failure("request failed", Failure(exc))
    if getattr(request, "startedWriting", False):
        abort_connection(request)
        return None
    return error_response(request, error)


def no_route(request: IRequest) -> bytes:
    method = request.method.decode("ascii", "replace")
    path = request.path.decode("utf-8", "replace")
    return error_response(request, BadRequest(f"no route {method} {path}", field="path"))


def write_trailer(request: IRequest, duration_ms: int | None) -> None:
    """
    End a chunked body with the duration trailer (nothing to do for a body that is not
    chunked, e.g. to an HTTP/1.0 client).  The caller then finishes the request, which
    writes no terminator of its own once C{chunked} is off.
    """
    if not getattr(request, "chunked", False):
        return
    request.chunked = 0  # type: ignore[attr-defined]
    trailer = b"" if duration_ms is None else b"%s: %d\r\n" % (DURATION_HEADER, duration_ms)
    request.channel.write(b"0\r\n" + trailer + b"\r\n")  # type: ignore[attr-defined]


class InFlight:
    """
    How many requests are being answered, and who is waiting for that to reach zero
    (a drain, a graceful shutdown).
    """

    def __init__(self) -> None:
        self.count = 0
        self._waiters: list[Deferred[None]] = []

    def enter(self) -> None:
        self.count += 1

    def leave(self) -> None:
        self.count -= 1
        if not self.count:
            waiters, self._waiters = self._waiters, []
            for d in waiters:
                d.callback(None)

    def when_idle(self) -> "Deferred[None]":
        """
        Fires once no request is being answered (at once if none is).
        """
        d: Deferred[None] = Deferred()
        if self.count:
            self._waiters.append(d)
        else:
            d.callback(None)
        return d


def transport_of(request: Any) -> Any:
    """
    The connection a twisted.web request came on, or None (a test double may have none).
    """
    return getattr(getattr(request, "channel", None), "transport", None)


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
        )
    except AttributeError:
        return False


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
    An HTTP/1.1 channel whose response bytes go to the socket as they are written
    (L{send_now}) instead of on the reactor's next turn, so each relayed piece of audio
    costs a send and not also two changes to the poll set and a turn of the loop.

    Between L{hold} and L{release} writes are gathered and then leave in one send: a
    response's headers and its first bytes, which twisted.web writes separately, reach
    the client together (see L{EagerRequest}).  Every channel is made for a front
    door (L{rhapsode_worker._front.Front}), which tells its site's C{connections} of
    the connection as it opens and closes.
    """

    _held: list[bytes] | None = None
    _host: Any = None
    #: The front door that lent this channel its connection for one request, told
    #: when that request is done (L{rhapsode_worker._front.Front.returned}).
    lender: Any = None

    def requestDone(self, request: Any) -> None:
        super().requestDone(request)
        if self.lender is not None:
            self.lender.returned(self)

    def hold(self) -> None:
        if self._held is None:
            self._held = []

    def release(self) -> None:
        held, self._held = self._held, None
        if held:
            send_now(self.transport, b"".join(held))

    def writeHeaders(self, version: bytes, code: bytes, reason: bytes, headers: Any) -> None:
        if self._held is None or not isinstance(headers, Headers):
            self.release()
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

    def getHost(self) -> Any:
        # Asked once per request by twisted.web; a connection's own address never
        # changes, so it costs one getsockname per connection, not one per request.
        if self._host is None:
            self._host = super().getHost()
        return self._host


class EagerRequest(server.Request):
    """
    A request whose headers and first bytes leave in one send on an L{EagerChannel}.
    """

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
        request.notifyFinish().addErrback(lambda _: answer.cancel())  # type: ignore[attr-defined]
        answer.addCallbacks(lambda body: _finish(request, body), lambda f: f.trap(CancelledError))
        answer.addErrback(lambda f: self._log.failure("answering {path}", f, path=getattr(request, "path", b"")))
        return server.NOT_DONE_YET


def _finish(request: Any, body: bytes | None) -> None:
    if request.finished or getattr(request, "_disconnected", False):
        return
    if body:
        request.write(body)
    request.finish()


class DirectSite(server.Site):
    """
    A site that hands the requests named in C{direct} (method and exact path) straight
    to their resource, and routes the rest through its root as usual.

    Its connections begin at the front door (L{buildProtocol}); the channels it lends
    or hands them to are plain HTTP/1.1 channels that send as they write
    (L{EagerChannel}): twisted.web's default wraps each in a proxy that would switch to
    HTTP/2 after a TLS negotiation, and these sites never speak TLS, so the proxy was
    only a layer on every call (measured: 2-8 % of the core's CPU per request).  Without C{access_log} (a log level above info) no access
    line is even formatted: twisted.web formats one per request whatever the level.
    """

    protocol = EagerChannel  # type: ignore[assignment]
    requestFactory = EagerRequest
    #: Told of each connection as it opens and closes (C{opened(channel)},
    #: C{closed(channel)}), where something must close them all at the end.
    connections: Any = None
    #: The send buffer each Unix socket connection asks the kernel for (None: the
    #: system's default), set by the worker (L{rhapsode_worker._server.WorkerApp.site}).
    send_buffer: int | None = None

    def __init__(
        self,
        root: Any,
        direct: dict[tuple[bytes, bytes], resource.Resource] | None = None,
        access_log: bool = True,
        reactor: Any = None,
    ) -> None:
        super().__init__(root, parsePOSTFormSubmission=False, reactor=reactor)
        self.direct = dict(direct or {})
        self.access_log = access_log

    def log(self, request: Any) -> None:
        if self.access_log:
            super().log(request)

    def buildProtocol(self, addr: Any) -> Any:
        """
        Each connection starts at the front door (L{rhapsode_worker._front.Front}), which
        answers the direct routes itself and gives every other request to a channel from
        L{web_channel}, lent the connection for that request or handed it for good.
        """
        # Imported here: the front is built on this module's channel and helpers.
        from ._front import Front

        return Front(self)

    def web_channel(self) -> Any:
        """
        A twisted.web channel of this site (an L{EagerChannel} making this site's
        requests), for a connection the front lends or hands on.
        """
        return super().buildProtocol(None)

    def getResourceFor(self, request: Any) -> Any:
        target = self.direct.get((request.method, request.path))
        if target is None:
            return super().getResourceFor(request)
        request.site = self
        request.sitepath = []
        return target
