"""
What C{twistd rhapsode-web} and C{rhapsode web} run: options, validated in
C{postOptions}, and a service that serves the page and proxies C{/api/...} to the core.
"""

from __future__ import annotations

import os
from typing import Any

from twisted.application import service
from twisted.internet.defer import Deferred, DeferredList
from twisted.logger import ILogObserver, Logger
from twisted.python import usage

from .._guard import origin_key
from rhapsode_protocol.http.site import HEAD_SECONDS, IDLE_SECONDS

from ._site import DEFAULT_BODY_LIMIT, DEFAULT_MAX_CONNECTIONS, WebConfig

#: Where the page listens unless told: beside the core's 8080, on loopback only.
DEFAULT_PORT = 8090
DEFAULT_HOST = "127.0.0.1"
DEFAULT_CORE = "http://127.0.0.1:8080"
#: The most a token file may hold: a token is a line, not a document.
_TOKEN_FILE_LIMIT = 4096


def read_token(path: str | None, environ: dict[str, str] | os._Environ[str]) -> str | None:
    """
    The management token: the first line of C{path}, else C{RHAPSODE_MANAGEMENT_TOKEN},
    else none.
    """
    if path:
        with open(path, "rb") as handle:
            raw = handle.read(_TOKEN_FILE_LIMIT + 1)
        if len(raw) > _TOKEN_FILE_LIMIT:
            raise usage.UsageError(f"--token-file {path} is over {_TOKEN_FILE_LIMIT} bytes")
        lines = raw.decode("utf-8").strip().splitlines()
        token = lines[0].strip() if lines else ""
        if not token:
            raise usage.UsageError(f"--token-file {path} is empty")
        return token
    return environ.get("RHAPSODE_MANAGEMENT_TOKEN") or None


class Options(usage.Options):
    """
    C{twistd rhapsode-web [--core URL] [--port N] [--host H] [--token-file FILE]
    [--allow-origin ORIGIN ...] [--max-body N] [--head-timeout S] [--idle-timeout S]
    [--max-connections N]}.
    """

    optParameters = [
        ["core", None, DEFAULT_CORE, "The core's base URL."],
        ["port", "p", DEFAULT_PORT, "The port the page listens on.", int],
        ["host", None, DEFAULT_HOST, "The address the page listens on."],
        ["token-file", None, None,
         "A file whose first line is the management token (default: $RHAPSODE_MANAGEMENT_TOKEN)."],
        ["max-body", None, DEFAULT_BODY_LIMIT, "The most bytes one request's body may carry.", int],
        ["head-timeout", None, HEAD_SECONDS,
         "Seconds a request's head may take from its first byte (408 past it), as the core's.", float],
        ["idle-timeout", None, IDLE_SECONDS,
         "Seconds a connection may send nothing, mid-body (408) or between requests, as the core's.", float],
        ["max-connections", None, DEFAULT_MAX_CONNECTIONS,
         "The most connections open at once; one more is refused as overloaded.", int],
    ]

    def __init__(self) -> None:
        super().__init__()
        self["allow-origin"] = []

    def opt_allow_origin(self, origin: str) -> None:
        """
        An origin beyond this machine's whose browsers may use the page, e.g.
        http://box.lan:8090 (repeatable).
        """
        if origin_key(origin) is None:
            raise usage.UsageError(f"--allow-origin {origin} is not an absolute http or https origin")
        self["allow-origin"].append(origin)

    def postOptions(self) -> None:
        core = str(self["core"]).rstrip("/")
        key = origin_key(core)
        if key is None or key[0] != "http":
            raise usage.UsageError(f"--core {core} is not an http URL with nothing after the host and port")
        if not 0 < self["port"] < 65536:
            raise usage.UsageError(f"--port {self['port']} is not between 1 and 65535")
        if self["max-body"] < 1:
            raise usage.UsageError("--max-body must be at least 1")
        for name in ("head-timeout", "idle-timeout"):
            if not 0 < self[name] <= 3600:
                raise usage.UsageError(f"--{name} {self[name]:g} is not more than 0 and at most 3600 seconds")
        if self["max-connections"] < 1:
            raise usage.UsageError("--max-connections must be at least 1")
        try:
            token = read_token(self["token-file"], os.environ)
        except OSError as error:
            raise usage.UsageError(f"--token-file: {error}") from None
        self["config"] = WebConfig(
            core=core, token=token, origins=tuple(self["allow-origin"]), body_limit=self["max-body"],
            head_timeout=self["head-timeout"], idle_timeout=self["idle-timeout"],
            max_connections=self["max-connections"],
        )


class WebService(service.Service):
    """
    Listens with the page's site on C{host}:C{port}; at stop, stops listening and closes
    the pooled connections to the core.

    @ivar listening: fires with the port once it listens (or with the failure).
    """

    log = Logger()

    def __init__(self, config: WebConfig, host: str, port: int, reactor: Any = None) -> None:
        self._config = config
        self._host = host
        self._port_number = port
        self._reactor = reactor
        self._port: Any = None
        self._pool: Any = None
        self.listening: Deferred[Any] = Deferred()
        #: Why it could not listen, for C{rhapsode web} to exit non-zero with.
        self.failed_to_start: Any = None

    def setServiceParent(self, parent: Any) -> None:
        """
        Under twistd, offer the application the core's log observer at info (Twisted's
        routine lines left out, as the core leaves them); twistd asks the application
        for one before it falls back to its own.
        """
        super().setServiceParent(parent)
        get = getattr(parent, "getComponent", None)
        if get is not None and get(ILogObserver, None) is None:
            from .._service import level_filtered

            parent.setComponent(ILogObserver, level_filtered("info"))

    def startService(self) -> None:
        super().startService()
        from twisted.internet.endpoints import TCP4ServerEndpoint, TCP6ServerEndpoint

        from ._site import make_site

        reactor = self._reactor
        if reactor is None:
            from twisted.internet import reactor as global_reactor

            reactor = global_reactor
        site, self._pool = make_site(self._config, reactor)
        kind = TCP6ServerEndpoint if ":" in self._host else TCP4ServerEndpoint
        endpoint = kind(reactor, self._port_number, backlog=2048, interface=self._host)

        def listening(port: Any) -> Any:
            self._port = port
            address = port.getHost()
            shown = f"[{address.host}]" if ":" in address.host else address.host
            self.log.info(
                "rhapsode web: open http://{host}:{port}/ (core {core}{token})",
                host=shown, port=address.port, core=self._config.core,
                token=", presenting the management token" if self._config.token else "",
            )
            return port

        def failed(failure: Any) -> Any:
            self.log.error("rhapsode web could not listen: {why}", why=failure.getErrorMessage())
            self.failed_to_start = failure
            # Under twistd this runs before the reactor does: stop it once it runs.
            if reactor.running:
                reactor.stop()
            else:
                reactor.callWhenRunning(reactor.stop)
            return failure

        d = endpoint.listen(site)
        d.addCallbacks(listening, failed)
        d.chainDeferred(self.listening)
        self.listening.addErrback(lambda f: None)

    def stopService(self) -> "Deferred[Any]":
        super().stopService()
        waits = []
        if self._port is not None:
            waits.append(Deferred.fromCoroutine(_maybe(self._port.stopListening())))
        if self._pool is not None:
            waits.append(self._pool.closeCachedConnections())
        return DeferredList(waits)


async def _maybe(value: Any) -> None:
    if isinstance(value, Deferred):
        await value


#: The services made here, so that C{rhapsode web} can tell how its run ended.
made: list[WebService] = []


def makeService(options: Options) -> WebService:
    service = WebService(options["config"], options["host"], options["port"])
    made.append(service)
    return service


__all__ = ["DEFAULT_CORE", "DEFAULT_HOST", "DEFAULT_PORT", "Options", "WebService", "makeService", "read_token"]
