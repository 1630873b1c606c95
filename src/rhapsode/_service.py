"""
The core as a Twisted service: build the registry from a config, listen, and stop every
worker when the service stops.

It is what C{twistd rhapsode} runs and what a Twisted program adds to its application
to embed the core as a library.
"""

from __future__ import annotations

import sys
from typing import Any

from twisted.application import service
from twisted.internet.defer import Deferred, DeferredList
from twisted.logger import Logger

from rhapsode_worker.contract import CONTRACT_VERSIONS

from ._app import CoreApp
from ._config import Config
from ._registry import EngineHandle, Registry
from ._supervisor import WorkerSupervisor
from ._workers import WorkerClient

#: Bursts of clients must not be refused at the door: the default of 50 refused most of
#: 500 simultaneous connections on these machines.
BACKLOG = 2048
CONTRACT = max(CONTRACT_VERSIONS)


def _reactor(reactor: Any) -> Any:
    if reactor is None:
        from twisted.internet import reactor as default

        return default
    return reactor


class RhapsodeService(service.Service):
    """
    One core: its engines' workers and the public API on C{server.host:server.port}.
    """

    log = Logger()

    def __init__(self, config: Config, reactor: Any = None) -> None:
        self.config = config
        self._reactor_given = reactor
        self.registry: Registry | None = None
        self.app: CoreApp | None = None
        self.port: Any = None
        self._clients: list[WorkerClient] = []

    @property
    def reactor(self) -> Any:
        return _reactor(self._reactor_given)

    def build(self) -> CoreApp:
        """
        The registry and the app, without listening (for tests and embedding).
        """
        reactor = self.reactor
        workers = self.config.workers
        handles: dict[str, EngineHandle] = {}
        for engine_id, engine in self.config.engines.items():
            if engine.url is not None:
                client = WorkerClient(reactor, engine.url)
                handles[engine_id] = EngineHandle(engine_id, client, None)
            else:
                listen = f"unix:{workers.socket_dir / (engine_id + '.sock')}"
                client = WorkerClient(reactor, listen)
                assert engine.module is not None
                supervisor = WorkerSupervisor(
                    engine_id,
                    reactor=reactor,
                    python=engine.python or sys.executable,
                    module=engine.module,
                    listen=listen,
                    voice_dir=str(workers.voice_dir),
                    env=dict(engine.env),
                    contract=CONTRACT,
                    startup_timeout=workers.startup_timeout_seconds,
                    drain_grace=workers.drain_grace_ms / 1000,
                    max_restarts=workers.max_restarts,
                    restart_decay=workers.restart_decay_seconds,
                    terminate=_terminate_verb(client),
                )
                handles[engine_id] = EngineHandle(engine_id, client, supervisor)
            self._clients.append(client)
        self.registry = Registry(handles)
        self.app = CoreApp(self.registry, reactor=reactor, contract_version=CONTRACT)
        return self.app

    def startService(self) -> None:
        super().startService()
        from twisted.internet.endpoints import TCP4ServerEndpoint, TCP6ServerEndpoint

        app = self.build()
        server = self.config.server
        endpoint_type = TCP6ServerEndpoint if ":" in server.host else TCP4ServerEndpoint
        endpoint = endpoint_type(self.reactor, server.port, backlog=BACKLOG, interface=server.host)
        self.config.workers.socket_dir.mkdir(parents=True, exist_ok=True)
        self.config.workers.voice_dir.mkdir(parents=True, exist_ok=True)

        def listening(port: Any) -> None:
            self.port = port
            address = port.getHost()
            self.log.info(
                "rhapsode listening on {host}:{port} with engines {engines}",
                host=address.host,
                port=address.port,
                engines=", ".join(self.config.engines) or "none",
            )

        def failed(failure: Any) -> None:
            self.log.failure("cannot listen", failure)
            self.reactor.stop()

        endpoint.listen(app.site()).addCallbacks(listening, failed)

    def stopService(self) -> "Deferred[Any]":
        """
        Stop listening, then signal every worker without asking (a shutdown), then close
        the connection pools.
        """
        super().stopService()
        stopping: list[Deferred[Any]] = []
        if self.port is not None:
            stopping.append(self.port.stopListening())
        if self.registry is not None:
            for handle in self.registry:
                if handle.supervisor is not None:
                    stopping.append(handle.supervisor.stop(ask=False))
        done = DeferredList(stopping, consumeErrors=True)

        def close(_: Any) -> Any:
            return DeferredList([c.close() for c in self._clients], consumeErrors=True)

        return done.addCallback(close)


def _terminate_verb(client: WorkerClient) -> Any:
    """
    The verb a supervisor reaches for before a signal: C{POST /terminate}, and whether
    the worker took it.
    """

    def terminate(listen: str) -> "Deferred[bool]":
        async def ask() -> bool:
            try:
                code, _ = await client.json(b"POST", "/terminate")
            except Exception:
                return False
            return code == 202

        return Deferred.fromCoroutine(ask())

    return terminate
