"""
The web page's own small site (issue 15, protocol.md section 13): static files, and
C{/api/...} handed to the core as it arrives.

Every request is judged at its head, before a byte of its body is read: the caller by
the core's own Host and Origin rules (L{rhapsode._guard}), so a page served here is no
way around them, and the body by its declared length.  The proxy streams both ways it
matters: a browser's body goes up once it is in (it is bounded), and the core's answer
comes down chunk by chunk with the core's connection registered as the producer of the
browser's response, so a slow browser pauses the core's socket instead of filling this
process.  A core that does not answer is an error envelope; one that fails after the
headers have gone aborts the browser's connection, so a truncated answer never looks
like a whole one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.protocol import Protocol
from twisted.internet.task import Cooperator
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import pages, resource, server, static
from twisted.web.client import Agent, FileBodyProducer, HTTPConnectionPool, ResponseDone
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent, IRequest, IResponse

from rhapsode_protocol.errors import BadRequest, Forbidden, ModelUnavailable, Overloaded, SpeechError
from rhapsode_protocol.http.site import HEAD_SECONDS, IDLE_SECONDS, DirectSite, EagerRequest, Route, reason_phrase

from .._guard import check_management, check_origin, is_loopback, origin_key

__all__ = ["DEFAULT_MAX_CONNECTIONS", "STATIC", "WebConfig", "WebSite", "admit", "make_site"]

#: The page's files: found beside this module, so an editable install sees new ones.
STATIC = Path(__file__).resolve().parent / "static"
#: The prefix under which the page reaches the core.
API = b"/api"
#: The most body a browser may send through (a voice's reference clip is the largest).
DEFAULT_BODY_LIMIT = 32 * 1024 * 1024
#: The most connections open at once: a browser keeps six or so per origin, so this
#: is room for dozens of tabs, and far below what would exhaust descriptors.
DEFAULT_MAX_CONNECTIONS = 256
#: The most a request's path and query may be.
URI_LIMIT = 8192

#: Headers a browser's request carries on to the core; the rest (cookies, its own
#: Authorization, Host) are this site's business, not the core's.
_FORWARDED = (
    b"accept",
    b"accept-language",
    b"content-type",
    b"last-event-id",
    b"origin",
    b"user-agent",
)
#: Headers of the core's answer that belong to that one connection (RFC 9110 7.6.1),
#: plus the two twisted.web writes for itself.
_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"date",
        b"server",
    }
)


_PAGE_HEADERS = (
    (b"Content-Security-Policy",
     b"default-src 'self'; media-src 'self' blob:; img-src 'self' data:; frame-ancestors 'none'"),
    (b"X-Content-Type-Options", b"nosniff"),
    (b"Referrer-Policy", b"no-referrer"),
    (b"Cache-Control", b"no-cache"),
)


@dataclass(frozen=True)
class WebConfig:
    """
    How the page's site behaves.

    @ivar core: the core's base URL, C{http://127.0.0.1:8080} by default.
    @ivar token: the management token to present to the core, or C{None}.
    @ivar origins: origins beyond this machine's whose browsers may use the page
        (C{--allow-origin}); each is an absolute http or https origin.
    @ivar body_limit: the most body one request may carry.
    @ivar head_timeout: how long a request's head may take from its first byte (408).
    @ivar idle_timeout: how long a connection may send nothing, mid-body (408) or
        between requests (closed).
    @ivar max_connections: the most connections open at once; one more is answered 429.
    """

    core: str = "http://127.0.0.1:8080"
    token: str | None = None
    origins: Sequence[str] = field(default_factory=tuple)
    body_limit: int = DEFAULT_BODY_LIMIT
    head_timeout: float = HEAD_SECONDS
    idle_timeout: float = IDLE_SECONDS
    max_connections: int = DEFAULT_MAX_CONNECTIONS


def _header_map(request: server.Request) -> dict[str, list[str]]:
    return {
        name.decode("latin-1").lower(): [v.decode("latin-1") for v in values]
        for name, values in request.requestHeaders.getAllRawHeaders()
    }


def admit(peer: str | None, headers: Mapping[str, Sequence[str]], origins: Sequence[str]) -> None:
    """
    Raise L{Forbidden} unless this browser may use the page.

    A loopback caller is judged exactly as the core judges a management caller with no
    token: its Origin must be this machine's or one of C{origins}, its Host a loopback
    name, an IP literal or a configured origin's host, and any X-Forwarded-For local.  A
    caller from elsewhere is admitted only when it reached this site by the host and
    port of one of C{origins} and its Origin, if any, is allowed.  The core judges the
    forwarded request again, with the browser's address in X-Forwarded-For.
    """
    if peer is None or is_loopback(peer):
        check_management(peer=peer, headers=headers, token=None, origins=origins)
        return
    configured = check_origin(headers, origins)
    hosts = headers.get("host", ())
    if len(hosts) != 1:
        raise Forbidden("a remote caller must send exactly one Host header")
    for scheme in ("http", "https"):
        key = origin_key(f"{scheme}://{hosts[0].strip()}")
        if key is not None and key in configured:
            return
    raise Forbidden(f"remote caller {peer} did not come by an allowed origin (see --allow-origin)")


def _envelope(error: SpeechError) -> tuple[int, bytes]:
    return error.status, json.dumps(error.envelope()).encode("utf-8")


_log = Logger()


class _WebRequest(EagerRequest):
    """
    A request judged when its head is in, before its body is read (L{WebSite.admit}),
    its body then held to the limit as it arrives, with the page's own headers on every
    answer.
    """

    def process(self) -> None:
        # The page loads only its own files and calls only this site; nobody frames it.
        for name, value in _PAGE_HEADERS:
            self.responseHeaders.setRawHeaders(name, [value])
        super().process()


class _Full(Protocol):
    """
    A connection past the cap: told the page is overloaded, in the envelope, and closed
    before anything of it is read.
    """

    def connectionMade(self) -> None:
        error = Overloaded("the page has too many connections open; try again shortly (--max-connections)")
        status, body = _envelope(error)
        assert self.transport is not None
        self.transport.write(
            b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
            b"Retry-After: 1\r\nConnection: close\r\n\r\n%s" % (status, reason_phrase(status), len(body), body)
        )
        self.transport.loseConnection()


class _Open:
    """
    How many connections the page's site has open: told by each channel as it opens
    and closes (L{EagerChannel}'s C{connections}).
    """

    def __init__(self) -> None:
        self.count = 0

    def opened(self, channel: Any) -> None:
        self.count += 1

    def closed(self, channel: Any) -> None:
        self.count -= 1


class _Relay(Protocol):
    """
    Carries the core's answer to the browser as it arrives, the core's connection
    registered as the producer of the browser's response.
    """

    log = Logger()

    def __init__(self, request: server.Request, done: "Deferred[None]") -> None:
        self._request = request
        self._done = done
        self.gone = False

    def connectionMade(self) -> None:
        if self.gone:
            self.transport.stopProducing()  # type: ignore[union-attr]
            return
        self._request.registerProducer(self.transport, True)

    def dataReceived(self, data: bytes) -> None:
        if not self.gone:
            self._request.write(data)

    def connectionLost(self, reason: Failure = Failure(ResponseDone())) -> None:
        done, self._done = self._done, Deferred()
        if self.gone:
            done.callback(None)
            return
        self._request.unregisterProducer()
        if reason.check(ResponseDone):
            self._request.finish()
        else:
            # After the headers: the browser must see a broken answer, not a short one.
            self.log.warn("the core's answer broke off: {why}", why=reason.getErrorMessage())
            transport = self._request.channel.transport
            if transport is not None:
                getattr(transport, "abortConnection", transport.loseConnection)()
        done.callback(None)


class _Proxy(resource.Resource):
    """
    C{/api/<path>} is the core's C{/<path>}, with the query, the method and the body.
    """

    isLeaf = True
    log = Logger()

    def __init__(self, config: WebConfig, agent: IAgent, reactor: Any) -> None:
        super().__init__()
        self._config = config
        self._agent = agent
        # The body goes up in slices scheduled on this site's reactor, never the global one.
        self._cooperator = Cooperator(scheduler=lambda work: reactor.callLater(0, work))

    def render(self, request: server.Request) -> Any:
        uri = request.uri
        if len(uri) > URI_LIMIT:
            return self._error(request, BadRequest(f"the path is over {URI_LIMIT} bytes", field="path", status=414))
        target = uri[len(API) :] or b"/"
        if not target.startswith(b"/"):
            return self._error(request, BadRequest("no such path", field="path", status=404))
        url = self._config.core.rstrip("/").encode("utf-8") + target
        headers = Headers()
        for name in _FORWARDED:
            for value in request.requestHeaders.getRawHeaders(name, []):
                headers.addRawHeader(name, value)
        peer = getattr(request.getClientAddress(), "host", None)
        forwarded = request.requestHeaders.getRawHeaders(b"x-forwarded-for", [])
        chain = [*forwarded, peer.encode("latin-1")] if peer else forwarded
        if chain:
            headers.setRawHeaders(b"x-forwarded-for", [b", ".join(chain)])
        if self._config.token:
            headers.setRawHeaders(b"authorization", [b"Bearer " + self._config.token.encode("utf-8")])
        body = None
        content = request.content
        if content is not None:
            content.seek(0, 2)
            if content.tell():
                content.seek(0)
                body = FileBodyProducer(content, cooperator=self._cooperator)
        state: dict[str, Any] = {"relay": None}
        asked = self._agent.request(request.method, url, headers, body)

        def answered(response: IResponse) -> None:
            if request._disconnected:
                response.deliverBody(_Discard())
                return
            request.setResponseCode(response.code, response.phrase)
            for name, values in response.headers.getAllRawHeaders():
                if name.lower() not in _HOP_BY_HOP:
                    request.responseHeaders.setRawHeaders(name, values)
            done: Deferred[None] = Deferred()
            relay = state["relay"] = _Relay(request, done)
            response.deliverBody(relay)

        def failed(failure: Failure) -> None:
            if failure.check(CancelledError) or request._disconnected:
                return
            self.log.warn("the core at {core} did not answer: {why}", core=self._config.core,
                          why=failure.getErrorMessage())
            error = ModelUnavailable(
                f"the core at {self._config.core} did not answer ({type(failure.value).__name__}); "
                "start it with `rhapsode serve`, or give `rhapsode web --core URL`",
                status=502,
            )
            if request.startedWriting:
                transport = request.channel.transport
                if transport is not None:
                    getattr(transport, "abortConnection", transport.loseConnection)()
                return
            request.write(self._error(request, error))
            request.finish()

        def browser_gone(_: object) -> None:
            relay = state["relay"]
            if relay is None:
                asked.cancel()
            else:
                relay.gone = True
                if relay.transport is not None:
                    relay.transport.stopProducing()

        request.notifyFinish().addErrback(browser_gone)
        asked.addCallbacks(answered, failed)
        asked.addErrback(lambda f: self.log.failure("relaying {uri}", f, uri=uri))
        return server.NOT_DONE_YET

    @staticmethod
    def _error(request: server.Request, error: SpeechError) -> bytes:
        status, body = _envelope(error)
        request.setResponseCode(status)
        request.setHeader(b"Content-Type", b"application/json")
        return body


class _Discard(Protocol):
    """Reads and drops an answer nobody is waiting for any more."""

    def connectionMade(self) -> None:
        self.transport.stopProducing()  # type: ignore[union-attr]


class _Files(static.File):
    """
    The page's files, with the types modules need and no directory listings.
    """

    contentTypes = {
        **static.File.contentTypes,
        ".js": "text/javascript",
        ".css": "text/css",
        ".svg": "image/svg+xml",
        ".png": "image/png",
    }

    def directoryListing(self) -> resource.IResource:
        return pages.notFound("No such page", "There is no page here.")


class _Root(resource.Resource):
    """
    C{/api/...} to the core; every other path a file of the page, C{/} its shell.
    """

    def __init__(self, proxy: resource.Resource, files: _Files) -> None:
        super().__init__()
        self._proxy = proxy
        self._files = files

    def getChild(self, path: bytes, request: IRequest) -> resource.Resource:
        if path == API[1:]:
            return self._proxy
        if path == b"":
            return self._files.getChild(b"index.html", request)
        return self._files.getChild(path, request)


class WebSite(DirectSite):
    """
    The page's site, with the core's limits at the head (L{DirectSite}: a request line
    over 8 KiB, a head over 100 lines or 16 KiB, a head not in C{head_timeout} after its
    first byte, a connection idle for C{idle_timeout}, mid-body or between requests),
    each request judged at its head by L{admit} and its body held to C{body_limit}, and
    at most C{max_connections} connections open at once.
    """

    requestFactory = _WebRequest

    def __init__(self, root: resource.Resource, config: WebConfig, reactor: Any = None) -> None:
        super().__init__(
            root, reactor=reactor, timeout=config.idle_timeout, head_timeout=config.head_timeout
        )
        self.config = config
        self.connections = _Open()

    def buildProtocol(self, addr: Any) -> Any:
        if self.connections.count >= self.config.max_connections:
            _log.warn(
                "refused a connection from {peer}: {count} open, the most --max-connections allows",
                peer=getattr(addr, "host", addr), count=self.connections.count,
            )
            full = _Full()
            full.factory = self
            return full
        return super().buildProtocol(addr)

    def getResourceFor(self, request: Any) -> Any:
        # No route is answered without the tree: the page's files and the proxy.
        return server.Site.getResourceFor(self, request)

    def admit(self, request: EagerRequest, method: bytes, target: bytes, length: int | None) -> None:
        transport = request.channel.transport
        peer = getattr(transport.getPeer(), "host", None) if transport is not None else None
        admit(peer, _header_map(request), self.config.origins)
        limit = self.config.body_limit
        if length is not None and length > limit:
            raise BadRequest(f"the body is over {limit} bytes", field="body", status=413)
        request.route = Route(method.decode("latin-1").upper(), "", {}, limit)


def make_site(
    config: WebConfig, reactor: Any, agent: IAgent | None = None, static_dir: Path = STATIC
) -> tuple[WebSite, HTTPConnectionPool | None]:
    """
    The site for C{config}, proxying through C{agent} (by default a pooled Agent on
    C{reactor}, returned so its owner closes its cached connections at stop).
    """
    pool = None
    if agent is None:
        pool = HTTPConnectionPool(reactor, persistent=True)
        agent = Agent(reactor, connectTimeout=10, pool=pool)
    files = _Files(str(static_dir))
    files.childNotFound = pages.notFound("No such page", "There is no page here.")  # type: ignore[assignment]
    files.indexNames = ["index.html"]
    root = _Root(_Proxy(config, agent, reactor), files)
    site = WebSite(root, config, reactor=reactor)
    site.displayTracebacks = False
    return site, pool
