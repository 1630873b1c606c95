"""
Admission: who gets in, and when.  At a request's head, before any handler runs and
before its body is read (protocol.md sections 7 and 10); and for speech, a turn on its
engine (L{Turnstile}) and room for a buffered answer (L{BufferBudget}) (section 6).

The site (L{rhapsode_protocol.http.site}) resolves the route exactly as the router will and
holds the body to the route's limit.  On top of that, here: the management guard runs
for the management routes, C{Authorization} is removed so no handler or log ever sees
it, and a voice upload starts streaming to its worker as it arrives, so a clip costs
the core neither memory nor disk.  A refusal here is written straight to the
connection, which is then closed: the body it refuses is never read.
"""

from __future__ import annotations

import json
from collections import deque
from typing import Any, Collection, Protocol

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IConsumer, IReactorTime
from twisted.web import resource
from twisted.web.iweb import UNKNOWN_LENGTH, IBodyProducer
from zope.interface import implementer

from rhapsode_protocol.errors import Forbidden, ModelUnavailable, Overloaded, SpeechError, as_speech_error
from rhapsode_protocol.http.site import HEAD_SECONDS, IDLE_SECONDS, DirectSite, EagerRequest, Route, Routes

from ._guard import check_management, check_origin, origin_key

#: A voice upload above this is refused (protocol.md section 7): generous for any clip.
MAX_UPLOAD_BYTES = 25 * 1000 * 1000
#: Bytes an upload may hold while its worker starts, before the client is paused.
_EARLY_BUFFER = 256 * 1024


@implementer(IBodyProducer)
class Upload:
    """
    A client's request body, produced into the worker's request as it arrives.

    The client's connection is this producer's source: when the worker's socket is full
    the client is paused, so the core never holds more than a socket's worth.
    """

    def __init__(self, request: "CoreRequest", length: int | None) -> None:
        self._request = request
        self.length: Any = UNKNOWN_LENGTH if length is None else length
        self.received = 0
        self._early: list[bytes] = []
        self._early_size = 0
        self._consumer: IConsumer | None = None
        self._complete = False
        self._done: Deferred[None] | None = None
        self.failed: SpeechError | None = None

    def chunk(self, data: bytes) -> None:
        self.received += len(data)
        if self._consumer is not None:
            self._consumer.write(data)
            return
        self._early.append(data)
        self._early_size += len(data)
        if self._early_size > _EARLY_BUFFER:
            self._request.channel.pauseProducing()

    def input_complete(self) -> None:
        self._complete = True
        if self._done is not None and not self._done.called:
            self._done.callback(None)

    def fail(self, error: SpeechError) -> None:
        if self.failed is None:
            self.failed = error
            if self._done is not None and not self._done.called:
                self._done.errback(error)

    # IBodyProducer, driven by the worker's connection

    def startProducing(self, consumer: IConsumer) -> "Deferred[None]":
        self._consumer = consumer
        self._done = Deferred()
        early, self._early = self._early, []
        for data in early:
            consumer.write(data)
        if self._early_size > _EARLY_BUFFER:
            self._request.channel.resumeProducing()
        self._early_size = 0
        if self.failed is not None:
            self._done.errback(self.failed)
        elif self._complete:
            self._done.callback(None)
        return self._done

    def pauseProducing(self) -> None:
        channel = getattr(self._request, "channel", None)
        if channel is not None:
            channel.pauseProducing()

    def resumeProducing(self) -> None:
        channel = getattr(self._request, "channel", None)
        if channel is not None:
            channel.resumeProducing()

    def stopProducing(self) -> None:
        # The worker's connection went (an eviction, an unload, a crash): not the
        # client's fault, and the same upload may succeed on a new worker.
        self.fail(ModelUnavailable("the worker went away during the upload; try again"))


class CoreRequest(EagerRequest):
    """
    A request guarded, stripped and (for a voice upload) streamed at its head.
    """

    #: Set once the management guard has admitted this request.
    guarded = False
    #: For a CORS preflight admitted at its head: the methods and headers to allow.
    preflight: tuple[bytes, bytes] | None = None
    upload: Upload | None = None
    upstream: "Deferred[Any] | None" = None
    _received = False

    def gotLength(self, length: int | None) -> None:
        # An upload goes to its worker as it arrives: nothing is spooled here.
        super().gotLength(0 if self.upload is not None else length)

    def body_received(self, data: bytes) -> None:
        if self.upload is None:
            super().body_received(data)
            return
        self.upload.chunk(data)
        if self.upload.failed is not None:
            # Refused first: the cancelled upstream then has nobody left to answer.
            self.refuse(self.upload.failed)
            if self.upstream is not None and not self.upstream.called:
                self.upstream.cancel()

    def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:
        if self.refused:
            return
        if self.upload is not None:
            self._received = True
            self.upload.input_complete()
        super().requestReceived(command, path, version)

    def upstream_failed(self, failure: Any) -> Any:
        # Before the body is in, nobody else can answer: refuse now (the route would
        # never run behind a paused upload).  After it, the route reports the failure.
        if self.refused or self._received:
            return None if self.refused else failure
        error = as_speech_error(failure.value)
        if self.upload is not None:
            self.upload.fail(error)
        self.refuse(error)
        return None


def _peer(request: EagerRequest) -> str | None:
    transport = request.channel.transport
    assert transport is not None  # the request is being received on it
    address = transport.getPeer()
    return getattr(address, "host", None)


def _headers(request: EagerRequest) -> dict[str, list[str]]:
    return {
        name.decode("latin-1").lower(): [v.decode("latin-1") for v in values]
        for name, values in request.requestHeaders.getAllRawHeaders()
    }


class CoreSite(DirectSite):
    """
    The core's site: its requests (L{CoreRequest}s) are admitted at their heads by the
    route table, then guarded, stripped and, for a voice upload, streamed as above.

    @param management: the (method, rule) of every management route.
    @param upload: the (method, rule) of the route whose body streams to a worker.
    @param origin_checked: the (method, rule) of the routes open to anybody but a
        browser page whose Origin is neither this machine's nor in
        C{management.origins} (C{/mcp}, section 12; the speech WebSocket).
    @param cors: the (method, rule) of the public routes a page on one of the core's
        C{cors_origins} may call from a browser, preflight included.
    """

    requestFactory = CoreRequest

    def __init__(
        self,
        resource: Any,
        core: Any,
        direct: dict[tuple[bytes, bytes], Any] | None = None,
        access_log: bool = True,
        reactor: Any = None,
        *,
        routes: Routes | None = None,
        management: Collection[tuple[str, str]] = (),
        upload: tuple[str, str] | None = None,
        origin_checked: Collection[tuple[str, str]] = (),
        cors: Collection[tuple[str, str]] = (),
        timeout: float = IDLE_SECONDS,
        head_timeout: float = HEAD_SECONDS,
    ) -> None:
        super().__init__(
            resource, direct, access_log, reactor=reactor, routes=routes, timeout=timeout, head_timeout=head_timeout
        )
        self.core = core
        self.management = frozenset(management)
        self.upload = upload
        self.origin_checked = frozenset(origin_checked)
        self.cors = frozenset(cors)
        self.displayTracebacks = False

    # -- CORS (the cors.origins setting) ---------------------------------------------

    def _cors_origin(self, request: EagerRequest, route: Route) -> bytes | None:
        """
        The Origin to allow on C{request}'s answer: its own, when it names one of the
        core's C{cors_origins} and C{route} is one a page may call; else None.
        """
        if (route.method, route.rule) not in self.cors:
            return None
        values = request.requestHeaders.getRawHeaders(b"origin") or []
        if len(values) != 1:
            return None
        origin = values[0].decode("latin-1").strip()
        allowed = getattr(self.core, "cors_origins", ())
        if "*" in allowed:
            return origin.encode("latin-1")
        key = origin_key(origin)
        if key is not None and key in {origin_key(o) for o in allowed}:
            return origin.encode("latin-1")
        return None

    def admit(self, request: EagerRequest, method: bytes, target: bytes, length: int | None) -> None:
        assert isinstance(request, CoreRequest)
        wanted = request.requestHeaders.getRawHeaders(b"access-control-request-method")
        if method.upper() == b"OPTIONS" and wanted and self.routes is not None:
            # A browser's preflight: allowed for the route it asks about, or refused.
            route = self.routes.resolve(wanted[0][:16], target)
            origin = self._cors_origin(request, route)
            if origin is None:
                path = target.partition(b"?")[0].decode("utf-8", "replace")[:200]
                raise Forbidden(
                    f"no cross-origin call of {route.method} {path} from this page's origin is allowed"
                    " (cors.origins)"
                )
            asked = b", ".join(request.requestHeaders.getRawHeaders(b"access-control-request-headers") or [])
            request.preflight = (origin, asked[:1024])
            request.route = Route("OPTIONS", route.rule, route.arguments, 0)
            return
        super().admit(request, method, target, length)

    def getResourceFor(self, request: Any) -> Any:
        if getattr(request, "preflight", None) is not None:
            request.site = self
            return _PREFLIGHT
        return super().getResourceFor(request)

    def shape_refusal(self, request: Any, error: SpeechError) -> tuple[bytes, Any]:
        """
        The body and headers of a refusal at the head: the OpenAI envelope on the
        OpenAI routes (their clients parse only that), the taxonomy's elsewhere; with
        the CORS headers a page on an allowed origin needs to read it.
        """
        line = getattr(request, "line", None)
        headers = list(error.headers)
        route = getattr(request, "route", None)
        if route is not None:
            origin = self._cors_origin(request, route)
            if origin is not None:
                headers.extend(cors_headers(origin))
        if line is not None and line[1].startswith(b"/v1/"):
            from ._openai import openai_envelope, should_retry

            return json.dumps(openai_envelope(error)).encode(), headers + [should_retry(error)]
        return json.dumps(error.envelope()).encode(), headers

    def guard(self, request: EagerRequest, route: Route) -> None:
        assert isinstance(request, CoreRequest)
        # Set first, so a refusal below can carry the CORS headers a page needs to read it.
        request.route = route
        if (route.method, route.rule) in self.origin_checked and self._cors_origin(request, route) is None:
            check_origin(_headers(request), self.core.management_origins)
        if (route.method, route.rule) in self.management:
            core = self.core
            check_management(
                peer=_peer(request),
                headers=_headers(request),
                token=core.management_token,
                origins=core.management_origins,
            )
            request.guarded = True
        # Gone before any handler runs, and so never logged.
        request.requestHeaders.removeHeader(b"authorization")

    def admitted(self, request: EagerRequest, route: Route, length: int | None) -> None:
        assert isinstance(request, CoreRequest)
        core = self.core
        origin = self._cors_origin(request, route)
        if origin is not None:
            for name, value in cors_headers(origin):
                request.responseHeaders.setRawHeaders(name, [value])
        if (route.method, route.rule) == self.upload:
            request.upload = Upload(request, length)
            engine_id = str(route.arguments["engine_id"])
            request.upstream = Deferred.fromCoroutine(core.start_upload(engine_id, request))
            request.upstream.addErrback(request.upstream_failed)


#: What a page's script may read of an answer beyond the CORS-safelisted headers.
_EXPOSED = b"Content-Length, X-Rhapsode-Duration-Ms, Retry-After, x-should-retry"


def cors_headers(origin: bytes) -> list[tuple[bytes, bytes]]:
    """
    The headers that let a page on C{origin} read an answer.
    """
    return [
        (b"Access-Control-Allow-Origin", origin),
        (b"Vary", b"Origin"),
        (b"Access-Control-Expose-Headers", _EXPOSED),
    ]


class _Preflight(resource.Resource):
    """
    The answer to a preflight admitted at its head: 204, allowing the method the route
    takes and the headers the page asked to send, for ten minutes.
    """

    isLeaf = True

    def render(self, request: Any) -> bytes:
        origin, asked = request.preflight
        request.setResponseCode(204)
        for name, value in cors_headers(origin):
            request.setHeader(name, value)
        wanted = request.requestHeaders.getRawHeaders(b"access-control-request-method")[0]
        request.setHeader(b"Access-Control-Allow-Methods", wanted.upper())
        if asked:
            request.setHeader(b"Access-Control-Allow-Headers", asked)
        request.setHeader(b"Access-Control-Max-Age", b"600")
        return b""


_PREFLIGHT = _Preflight()


class IAdmissionSettings(Protocol):
    """
    The admission limits, asked for each time one is used (a settings API may change
    them live).  Every method answers at once.
    """

    def concurrent_per_engine(self, engine: str) -> int: ...

    def queued_per_engine(self, engine: str) -> int: ...

    def queue_wait_seconds(self) -> float: ...

    def buffered_bytes(self) -> int: ...


class Turn:
    """
    One request's turn to speak on its engine; leave it when the answer has ended,
    however it ended.  Leaving twice is harmless.
    """

    def __init__(self, line: "_Line") -> None:
        self._line: _Line | None = line

    def leave(self) -> None:
        line, self._line = self._line, None
        if line is not None:
            line.left()


class _Line:
    """
    One engine's speakers and the queue waiting behind them.
    """

    def __init__(self) -> None:
        self.speaking = 0
        self.waiting: deque[Deferred[None]] = deque()

    def left(self) -> None:
        self.speaking -= 1
        while self.waiting:
            waiter = self.waiting.popleft()
            if not waiter.called:
                self.speaking += 1
                waiter.callback(None)
                return


class Turnstile:
    """
    How many requests speak on each engine at once, and how many may wait for a turn
    (protocol.md section 6, overloaded): past both, a request is refused at once as
    overloaded, retryable, with a Retry-After, instead of joining a queue with no end.
    A request that waits longer than C{queue_wait_seconds} is refused the same way.
    """

    def __init__(self, clock: IReactorTime, settings: IAdmissionSettings) -> None:
        self._clock = clock
        self._settings = settings
        self._lines: dict[str, _Line] = {}

    def state(self, engine: str) -> dict[str, int]:
        line = self._lines.get(engine)
        return {"speaking": line.speaking, "queued": len(line.waiting)} if line else {"speaking": 0, "queued": 0}

    async def enter(self, engine: str) -> Turn:
        """
        A turn to speak on C{engine}, at once or after those ahead of it.

        @raise Overloaded: the queue is full, or the turn did not come in time.
        """
        line = self._lines.setdefault(engine, _Line())
        if line.speaking < self._settings.concurrent_per_engine(engine) and not line.waiting:
            line.speaking += 1
            return Turn(line)
        most = self._settings.queued_per_engine(engine)
        if len(line.waiting) >= most:
            raise _overloaded(
                f'engine "{engine}" has {line.speaking} request(s) speaking and {most} waiting; try again shortly'
            )
        waiter: Deferred[None] = Deferred()
        line.waiting.append(waiter)
        patience = self._settings.queue_wait_seconds()
        timer = self._clock.callLater(patience, waiter.cancel)
        try:
            await waiter
        except CancelledError:
            if waiter in line.waiting:
                line.waiting.remove(waiter)
            if timer.active():
                raise  # the caller gave up, not the wait
            raise _overloaded(
                f'engine "{engine}" had no turn free within {patience:g} s; try again shortly'
            ) from None
        finally:
            if timer.active():
                timer.cancel()
        return Turn(line)


def _overloaded(message: str) -> Overloaded:
    error = Overloaded(message)
    error.headers = ((b"Retry-After", b"%d" % RETRY_AFTER_SECONDS),)
    return error


#: What a refused request is told to wait before it tries again.
RETRY_AFTER_SECONDS = 1


class BufferBudget:
    """
    How much audio the core holds at once for buffered (C{stream: false}) answers, all
    of them together: each is read whole before its status is written (section 6), so
    without a bound forty long ones at once took the core from 109 to 653 MB.  A body
    that would take the total past the budget fails its request as overloaded
    (retryable): the answers already held are the ones that finish.
    """

    def __init__(self, settings: IAdmissionSettings) -> None:
        self._settings = settings
        self.held = 0

    def take(self, size: int) -> None:
        """
        Hold C{size} more bytes.

        @raise Overloaded: the budget has no room for them.
        """
        most = self._settings.buffered_bytes()
        if self.held + size > most:
            raise _overloaded(
                f"the core is holding {self.held} bytes of buffered audio, its limit {most}; "
                "try again shortly, or ask for stream: true"
            )
        self.held += size

    def give_back(self, size: int) -> None:
        self.held -= size
