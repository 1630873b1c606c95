"""
The public port's site: who gets in, and when, at a request's head, before any handler
runs and before its body is read (protocol.md sections 7 and 10).

The protocol's site (L{rhapsode_protocol.http.site}) resolves the route exactly as the
router will and holds the body to the route's limit.  On top of that, here, by the route
table (L{rhapsode._http.table}): the management guard runs for the management routes,
C{Authorization} is removed so no handler or log ever sees it, the CORS and Origin rules
apply, and a voice upload starts streaming to its worker as it arrives, so a clip costs
the core neither memory nor disk.  A refusal here is written straight to the connection,
which is then closed: the body it refuses is never read.  What admission decided travels
with the request as one typed record (L{Admitted}), which the handlers read through
L{admitted_of}.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Collection, Iterable, Mapping, Sequence

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IConsumer
from twisted.logger import Logger
from twisted.web import resource
from twisted.web.iweb import UNKNOWN_LENGTH, IBodyProducer
from zope.interface import implementer

from rhapsode_protocol.errors import BadRequest, Forbidden, ModelUnavailable, SpeechError, as_speech_error
from rhapsode_protocol.http.site import (
    HEAD_SECONDS,
    IDLE_SECONDS,
    DirectSite,
    EagerRequest,
    HandlerResource,
    Route,
    Routes,
)

from .._guard import check_management, check_origin, origin_key
from .._interfaces import StartUpload
from .envelopes import openai_envelope, should_retry
from .table import MANAGED, METRICS, ROUTES, RouteSpec

__all__ = ["Admitted", "CoreRequest", "CoreSite", "Upload", "admitted_of", "cors_headers", "core_site", "require_guard"]

#: Bytes an upload may hold while its worker starts, before the client is paused.
_EARLY_BUFFER = 256 * 1024


@implementer(IBodyProducer)
class Upload:
    """
    A client's request body, produced into the worker's request as it arrives.

    The client's connection is this producer's source: when the worker's socket is full
    the client is paused, so the core never holds more than a socket's worth.  The pause
    is of the connection's reading alone, and it is undone as soon as the body is in or
    the upload has failed, however the worker's connection ended: a pause that outlived
    the upload (twisted.web's "the transport is full", which it used to be) left the
    connection deaf, so the next request on it was never answered.
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
        self._paused = False
        self.failed: SpeechError | None = None

    def chunk(self, data: bytes) -> None:
        self.received += len(data)
        if self._consumer is not None:
            self._consumer.write(data)
            return
        self._early.append(data)
        self._early_size += len(data)
        if self._early_size > _EARLY_BUFFER:
            self._pause()

    def input_complete(self) -> None:
        self._complete = True
        self._resume()  # nothing more of this request to read
        if self._done is not None and not self._done.called:
            self._done.callback(None)

    def fail(self, error: SpeechError) -> None:
        if self.failed is None:
            self.failed = error
            self._resume()
            if self._done is not None and not self._done.called:
                self._done.errback(error)

    def _pause(self) -> None:
        transport = self._transport()
        if not self._paused and transport is not None and not self._complete and self.failed is None:
            self._paused = True
            transport.pauseProducing()

    def _resume(self) -> None:
        transport = self._transport()
        if self._paused:
            self._paused = False
            if transport is not None:
                transport.resumeProducing()

    def _transport(self) -> Any:
        channel = self._request.channel
        return channel.transport if channel is not None else None

    # IBodyProducer, driven by the worker's connection

    def startProducing(self, consumer: IConsumer) -> "Deferred[None]":
        self._consumer = consumer
        self._done = Deferred()
        early, self._early = self._early, []
        for data in early:
            consumer.write(data)
        self._early_size = 0
        self._resume()
        if self.failed is not None:
            self._done.errback(self.failed)
        elif self._complete:
            self._done.callback(None)
        return self._done

    def pauseProducing(self) -> None:
        self._pause()

    def resumeProducing(self) -> None:
        self._resume()

    def stopProducing(self) -> None:
        # The worker's connection went (an eviction, an unload, a crash): not the
        # client's fault, and the same upload may succeed on a new worker.
        self.fail(ModelUnavailable("the worker went away during the upload; try again"))


@dataclass
class Admitted:
    """
    What admission decided at a request's head, for the handlers to read.

    @ivar guarded: the management guard admitted the request.
    @ivar preflight: for a CORS preflight, the origin to allow and the headers asked for.
    @ivar upstream: for a voice upload, the worker's answer to the body streaming to it.
    """

    route: Route
    guarded: bool = False
    preflight: tuple[bytes, bytes] | None = None
    upstream: "Deferred[Any] | None" = None


#: A request that no core site admitted (a test's, or one built in memory): unguarded.
NOT_ADMITTED = Admitted(Route("", ""))


def admitted_of(request: Any) -> Admitted:
    """
    What admission decided of C{request}; L{NOT_ADMITTED} for one that did not come in
    through a L{CoreSite}.
    """
    admitted = request.admitted if isinstance(request, CoreRequest) else None
    return admitted if admitted is not None else NOT_ADMITTED


def require_guard(request: Any) -> None:
    """
    The guard runs at the headers (L{rhapsode._http.site}); a management route reached
    any other way refuses rather than runs unguarded.

    @raise Forbidden: C{request} did not pass the management guard.
    """
    if not admitted_of(request).guarded:
        raise Forbidden("management route reached without passing the management guard")


class CoreRequest(EagerRequest):
    """
    A request guarded, stripped and (for a voice upload) streamed at its head.
    """

    #: What admission decided, once it has.
    admitted: Admitted | None = None
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

    def connectionLost(self, reason: Any) -> None:
        super().connectionLost(reason)
        if self.upload is not None and not self._received:
            # The client went mid-body: the worker's request is given up on too, so the
            # worker lets go of what it was spooling the body into at once, not at its
            # idle timeout.
            self.upload.fail(BadRequest("the client went before its upload was in", field="body"))
            if self.upstream is not None and not self.upstream.called:
                self.upstream.cancel()

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

    @param management: the (method, rule) of every route the management guard runs for.
    @param upload: the (method, rule) of the routes whose body streams to a worker.
    @param origin_checked: the (method, rule) of the routes open to anybody but a
        browser page whose Origin is neither this machine's nor in
        C{management_origins} (C{/mcp}, section 12; the speech WebSocket).
    @param cors: the (method, rule) of the public routes a page on one of the core's
        C{cors_origins} may call from a browser, preflight included.
    @param start_upload: begins the worker's request for a voice upload admitted at
        its head, with the request whose body streams to it.
    """

    requestFactory = CoreRequest

    def __init__(
        self,
        resource: Any,
        direct: dict[tuple[bytes, bytes], Any] | None = None,
        access_log: bool = True,
        reactor: Any = None,
        *,
        routes: Routes | None = None,
        management: Collection[tuple[str, str]] = (),
        upload: Collection[tuple[str, str]] = (),
        origin_checked: Collection[tuple[str, str]] = (),
        cors: Collection[tuple[str, str]] = (),
        timeout: float = IDLE_SECONDS,
        head_timeout: float = HEAD_SECONDS,
        management_token: str | None = None,
        management_origins: Sequence[str] = (),
        cors_origins: Sequence[str] = (),
        start_upload: StartUpload | None = None,
    ) -> None:
        super().__init__(
            resource, direct, access_log, reactor=reactor, routes=routes, timeout=timeout, head_timeout=head_timeout
        )
        self.management = frozenset(management)
        self.upload = frozenset(upload)
        self.origin_checked = frozenset(origin_checked)
        self.cors = frozenset(cors)
        self.management_token = management_token
        self.management_origins = tuple(management_origins)
        self.cors_origins = tuple(cors_origins)
        self._allowed = {origin_key(o) for o in self.cors_origins} - {None}
        self._start_upload = start_upload
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
        if "*" in self.cors_origins:
            return origin.encode("latin-1")
        key = origin_key(origin)
        if key is not None and key in self._allowed:
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
            request.route = Route("OPTIONS", route.rule, route.arguments, 0)
            request.admitted = Admitted(request.route, preflight=(origin, asked[:1024]))
            return
        super().admit(request, method, target, length)

    def getResourceFor(self, request: Any) -> Any:
        if admitted_of(request).preflight is not None:
            request.site = self
            return _PREFLIGHT
        return super().getResourceFor(request)

    def shape_refusal(self, request: Any, error: SpeechError) -> tuple[bytes, Any]:
        """
        The body and headers of a refusal at the head: the OpenAI envelope on the
        OpenAI routes (their clients parse only that), the taxonomy's elsewhere; with
        the CORS headers a page on an allowed origin needs to read it.
        """
        headers = list(error.headers)
        # None where the channel refuses before a request exists (a head too slow).
        known = request if isinstance(request, EagerRequest) else None
        if known is not None and known.route is not None:
            origin = self._cors_origin(known, known.route)
            if origin is not None:
                headers.extend(cors_headers(origin))
        if known is not None and known.line is not None and known.line[1].startswith(b"/v1/"):
            return json.dumps(openai_envelope(error)).encode(), headers + [should_retry(error)]
        return json.dumps(error.envelope()).encode(), headers

    def guard(self, request: EagerRequest, route: Route) -> None:
        assert isinstance(request, CoreRequest)
        # Set first, so a refusal below can carry the CORS headers a page needs to read it.
        request.route = route
        admitted = request.admitted = Admitted(route)
        if (route.method, route.rule) in self.origin_checked and self._cors_origin(request, route) is None:
            check_origin(_headers(request), self.management_origins)
        if (route.method, route.rule) in self.management:
            check_management(
                peer=_peer(request),
                headers=_headers(request),
                token=self.management_token,
                origins=self.management_origins,
            )
            admitted.guarded = True
        # Gone before any handler runs, and so never logged.
        request.requestHeaders.removeHeader(b"authorization")

    def admitted(self, request: EagerRequest, route: Route, length: int | None) -> None:
        assert isinstance(request, CoreRequest)
        origin = self._cors_origin(request, route)
        if origin is not None:
            for name, value in cors_headers(origin):
                request.responseHeaders.setRawHeaders(name, [value])
        if (route.method, route.rule) in self.upload and self._start_upload is not None:
            request.upload = Upload(request, length)
            engine_id = str(route.arguments["engine_id"])
            request.upstream = Deferred.fromCoroutine(self._start_upload(engine_id, request))
            request.upstream.addErrback(request.upstream_failed)
            if request.admitted is not None:
                request.admitted.upstream = request.upstream


def core_site(
    resource: Any,
    routes: Routes,
    direct: Mapping[str, Any],
    *,
    specs: Iterable[RouteSpec] = ROUTES,
    metrics_public: bool = False,
    log: Logger | None = None,
    **options: Any,
) -> CoreSite:
    """
    The core's site for the route table C{specs}: its guard, CORS, Origin and upload
    rules taken from each route's entry; the routes marked direct answered by the
    handlers in C{direct} (by name) without Klein's routing.  C{options} are
    L{CoreSite}'s own (timeouts, the management token and origins, the CORS origins,
    the upload starter, the reactor, the access log).
    """
    specs = tuple(specs)
    guarded = [
        spec.key for spec in specs
        if spec.guard == MANAGED or (spec.guard == METRICS and not metrics_public)
    ]
    return CoreSite(
        resource,
        {
            (spec.method.encode(), spec.rule.encode()): HandlerResource(direct[spec.name], log or Logger())
            for spec in specs
            if spec.direct
        },
        routes=routes,
        management=guarded,
        upload=[spec.key for spec in specs if spec.upload],
        origin_checked=[spec.key for spec in specs if spec.origin_checked],
        cors=[spec.key for spec in specs if spec.cors],
        **options,
    )


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
        preflight = admitted_of(request).preflight
        assert preflight is not None  # getResourceFor sends only preflights here
        origin, asked = preflight
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
