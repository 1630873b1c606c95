"""
The HTTP server both processes listen with: twisted.web parses every request, and these
small subclasses make it fast where twisted.web allows.

Responses go to the socket as they are written (L{send_now}), a response's headers and
first bytes leave in one send (L{EagerRequest}), the route on the path of every
utterance skips the router (L{HandlerResource}, L{DirectSite}), and a site is told of
each connection as it opens and closes so that a drain can close them all.
"""

from __future__ import annotations

import socket
from typing import Any, Awaitable, Callable

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.protocol import connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import http, resource, server
from twisted.web.http_headers import Headers
from twisted.web.iweb import IRequest

__all__ = ["DirectSite", "EagerChannel", "EagerRequest", "HandlerResource", "send_now"]


#: What L{send_now} reads of a Twisted socket transport to know nothing is queued.
#: Twisted has no public way to ask (twisted/twisted#5303, "Default transport
#: implementation doesn't write out bytes immediately", open since 2011); a unit test
#: checks that a real socket transport still has every one of them, so an upgrade that
#: renames one fails the suite rather than quietly costing a turn of the loop per write.
QUEUE_ATTRIBUTES = ("connected", "disconnecting", "_writeDisconnected", "producerPaused",
                    "dataBuffer", "offset", "_tempDataBuffer")


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
    the client together (see L{EagerRequest}).  It tells its site's C{connections} of
    itself as it opens and closes, and asks for the site's C{send_buffer} on a Unix
    socket.
    """

    _held: list[bytes] | None = None
    _host: Any = None
    #: Set by the site that built this channel (twisted.web's Site.buildProtocol).
    site: Any = None

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
        super().connectionLost(reason)
        tracker = getattr(self.site, "connections", None)
        if tracker is not None:
            tracker.closed(self)

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
        gone: list[bool] = []

        def hung_up(_: object) -> None:
            gone.append(True)
            answer.cancel()

        request.notifyFinish().addErrback(hung_up)  # type: ignore[attr-defined]
        answer.addCallbacks(lambda body: _finish(request, body, gone), lambda f: f.trap(CancelledError))
        answer.addErrback(lambda f: self._log.failure("answering {path}", f, path=getattr(request, "path", b"")))
        return server.NOT_DONE_YET


def _finish(request: Any, body: bytes | None, gone: list[bool]) -> None:
    # A request whose connection has gone is never written to or finished.
    if request.finished or gone:
        return
    if body:
        request.write(body)
    request.finish()


class DirectSite(server.Site):
    """
    A site that hands the requests named in C{direct} (method and exact path) straight
    to their resource, and routes the rest through its root as usual.

    Its connections are plain HTTP/1.1 channels that send as they write
    (L{EagerChannel}).  twisted.web's default wraps each in a proxy that would switch
    to HTTP/2 after a TLS negotiation; these sites never speak TLS, so the proxy was
    only a layer on every call.

    Without C{access_log} (a log level above info) no access line is even formatted:
    twisted.web formats one per request whatever the level.
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
    ) -> None:
        super().__init__(root, parsePOSTFormSubmission=False, reactor=reactor)
        self.direct = dict(direct or {})
        self.access_log = access_log

    def log(self, request: Any) -> None:
        if self.access_log:
            super().log(request)

    def getResourceFor(self, request: Any) -> Any:
        target = self.direct.get((request.method, request.path))
        if target is None:
            return super().getResourceFor(request)
        request.site = self
        request.sitepath = []
        return target
