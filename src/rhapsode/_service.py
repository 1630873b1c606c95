"""
The core as a Twisted service: build the registry from a config, listen, and stop every
worker when the service stops.

It is what C{twistd rhapsode} runs and what a Twisted program adds to its application
to embed the core as a library.  It is also the composition root: L{build_core} is the
one place that constructs the parts of the wings (fleet, speech, the public port, the
doors, management) and wires each to its collaborators, as interfaces where a seam
stands (L{rhapsode._interfaces}); no other constructor builds a collaborator.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
from functools import partial
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, Sequence, TypeVar

from twisted.application import service
from twisted.internet.defer import CancelledError, Deferred, DeferredList, fail, maybeDeferred, succeed
from twisted.internet.error import CannotListenError
from twisted.logger import (
    FilteringLogObserver,
    ILogObserver,
    Logger,
    LogLevel,
    LogLevelFilterPredicate,
    textFileLogObserver,
)
from twisted.python.failure import Failure

from rhapsode_protocol.contract import CONTRACT_VERSIONS
from rhapsode_protocol.errors import refusal
from rhapsode_protocol.http.answers import InFlight
from rhapsode_protocol.http.site import HEAD_SECONDS, IDLE_SECONDS, Routes
from rhapsode_protocol.http.logs import twisted_routine

from . import __version__
from ._config import RELEASES_URL, Config, ConfigError, ConfigSettings, EngineConfig, config_source, engine_entry
from ._doors.mcp import McpServer
from ._doors.node import NodeDoor
from ._doors.openai import OpenAIShim
from ._doors.stream import SpeechStreams
from ._doors.wyoming import Advertisement, WyomingDoor, WyomingLimits
from ._fleet.catalog import Catalog, read_catalog, read_source
from ._fleet.cluster import ClusterView
from ._fleet.registry import EngineHandle, Registry
from ._fleet.residency import Residency
from ._fleet.supervisor import WorkerSupervisor, core_budget_env, device_env, prestart
from ._fleet.watchdog import Watchdog
from ._http.router import CoreApp
from ._http.site import CoreSite, core_site
from ._http.table import klein_app, routes_for
from ._interfaces import IAdmissionSettings, IClientSettings, IResidencySettings, IWorkerClient
from ._manage.installer import Commands, Installer, find_uv
from ._manage.jobs import JobContext, Jobs
from ._manage.routes import ManagementRoutes
from ._manage.settings import Settings, saved_fault, unset_hint
from ._manage.state import FILE_NAME, StateDatabase, StateError, StateStore
from ._manage.update import UpdateChecker, checker_for
from ._ports import listener_of
from ._speech.limits import BufferBudget, Turnstile
from ._speech.metrics import Metrics
from ._speech.relay import MODEL_HEADER, SpeechRelay
from ._speech.service import SpeechService
from ._speech.translate import OpenAITranslation
from ._upstream import ClusterClient, Stalls, WorkerClient

_T = TypeVar("_T")

#: Bursts of clients must not be refused at the door: the default of 50 refused most of
#: 500 simultaneous connections on these machines.
BACKLOG = 2048
CONTRACT = max(CONTRACT_VERSIONS)


class ServiceStartError(Exception):
    """
    The core cannot start: a folder it needs cannot be made.
    """


def _reactor(reactor: Any) -> Any:
    if reactor is None:
        from twisted.internet import reactor as default

        return default
    return reactor


class Core:
    """
    The core's parts, wired by L{build_core}: what the service listens with and closes,
    and what a test or an embedding program reaches into.

    @ivar router: the native public routes (L{CoreApp}), which also serve the public
        reads (L{rhapsode._interfaces.IPublicRoutes}).
    @ivar speech: the speech service (L{rhapsode._interfaces.ISpeech}).
    @ivar relay: the speech relay under it; C{budget} is its buffer budget.
    @ivar manage: the management routes, with the installer, the settings and the
        update check they serve.
    """

    def __init__(
        self,
        *,
        reactor: Any,
        registry: Registry,
        residency: Residency,
        relay: SpeechRelay,
        speech: SpeechService,
        metrics: Metrics,
        requests: InFlight,
        router: CoreApp,
        openai: OpenAIShim,
        mcp: McpServer,
        streams: SpeechStreams,
        manage: ManagementRoutes,
        jobs: Jobs,
        catalog: Catalog,
        site_options: Mapping[str, Any],
        metrics_public: bool,
        node: NodeDoor | None = None,
        wyoming: WyomingDoor | None = None,
    ) -> None:
        self.reactor = reactor
        self.registry = registry
        self.residency = residency
        self.relay = relay
        self.budget: BufferBudget = relay.budget
        self.speech = speech
        self.metrics = metrics
        self.requests = requests
        self.router = router
        self.openai = openai
        self.mcp = mcp
        self.streams = streams
        self.manage = manage
        self.jobs = jobs
        self.catalog = catalog
        self.node = node
        #: The Wyoming door's factory, where the operator turned it on (wyoming.port).
        self.wyoming = wyoming
        self._site_options = dict(site_options)
        self._metrics_public = metrics_public
        handlers = {
            **router.handlers(),
            **openai.handlers(),
            **mcp.handlers(),
            **streams.handlers(),
            **manage.handlers(),
            **(node.handlers() if node is not None else {}),
        }
        self._handlers = handlers
        self.routes = routes_for("node" if node is not None else "core")
        self.klein = klein_app(handlers, self.routes)

    @property
    def installer(self) -> Installer | None:
        return self.manage.installer

    @property
    def updates(self) -> UpdateChecker:
        return self.manage.updates

    @updates.setter
    def updates(self, checker: UpdateChecker) -> None:
        self.manage.updates = checker

    def resource(self) -> Any:
        return self.klein.resource()

    def site(self, access_log: bool = True) -> CoreSite:
        """
        The site to listen with: its requests are guarded and stripped at their headers.
        Without C{access_log} no access line is even formatted (a log level above info).
        """
        routes = Routes(self.klein.url_map, {spec.key: spec.body for spec in self.routes})
        return core_site(
            self.resource(),
            routes,
            self._handlers,
            specs=self.routes,
            metrics_public=self._metrics_public,
            log=CoreApp.log,
            access_log=access_log,
            reactor=self.reactor,
            start_upload=self.router.start_upload,
            **self._site_options,
        )

    def close(self) -> None:
        """
        Shutting down: stop keep-alive timers and any measurement still in flight.
        """
        self.streams.close()
        if self.wyoming is not None:
            self.wyoming.close()
        self.relay.close()
        self.residency.close()


def build_core(
    registry: Registry,
    *,
    reactor: Any,
    contract_version: int = 1,
    management_token: str | None = None,
    management_origins: Sequence[str] = (),
    cors_origins: Sequence[str] = (),
    metrics_public: bool = False,
    settings: IResidencySettings | None = None,
    residency: Residency | None = None,
    admission: IAdmissionSettings | None = None,
    clients: IClientSettings | None = None,
    stall_seconds: float = 120.0,
    head_timeout: float = HEAD_SECONDS,
    idle_timeout: float = IDLE_SECONDS,
    catalog: Catalog | None = None,
    settings_api: Settings | None = None,
    installer: Callable[[Jobs], Installer] | None = None,
    updates: UpdateChecker | None = None,
    version: str = __version__,
    node: str | None = None,
    wyoming: WyomingLimits | None = None,
    cluster: ClusterView | None = None,
) -> Core:
    """
    Build and wire every part of one core over C{registry}.

    @param residency: the residency manager; without one, a manager over C{registry}
        reading C{settings}, or the defaults.
    @param admission: the limits on speech at once and buffered audio held; without
        them, C{settings} where it answers for admission too, else the defaults.
    @param clients: the operator's settings for other people's clients (voice aliases,
        the OpenAI shim's sample rates); without them, C{settings} where it answers for
        them too, else the defaults.
    @param stall_seconds: how long a worker may send nothing while answering.
    @param head_timeout: how long a request's head may take from its first byte.
    @param idle_timeout: how long a connection may send nothing.
    @param metrics_public: whether C{/metrics} answers everybody; otherwise it is
        guarded as the management routes are (it names engines and sizes).
    @param catalog: the catalog records and each engine's C{workerVersion}, read when
        the engines were declared; without one, C{GET /catalog} lists nothing and no
        summary carries a version.
    @param cors_origins: the browser origins, beside this machine's, whose pages may
        call the public speech and discovery routes (C{cors.origins}).
    @param installer: makes the installer over the core's jobs; without one every
        install route answers unsupported.
    @param updates: the update check; by default GitHub's on this reactor, on unless
        the environment turned it off.
    @param node: this core's name as a cluster's node (server.role "node"): it then
        serves its engines' worker routes and its state to the cluster (docs/cluster.md).
    @param wyoming: the bounds of the Wyoming door, which is built only with them
        (wyoming.port set); the service listens with it.
    @param cluster: at a cluster's front, what its nodes last said of themselves.
    """
    catalog = catalog if catalog is not None else Catalog((), version)
    # The defaults, built once: a Config works out its default paths when made.
    default = Config()
    defaults = ConfigSettings(lambda: default)
    if residency is None:
        residency = Residency(
            clock=reactor,
            settings=settings or defaults,
            terminate=lambda engine: registry.get(engine).terminate(),
            unload=lambda engine: registry.get(engine).unload(),
        )
    if admission is None:
        admission = settings if IAdmissionSettings.providedBy(settings) else defaults
    assert admission is not None
    if clients is None:
        clients = settings if IClientSettings.providedBy(settings) else defaults
    assert clients is not None
    requests = InFlight()
    turnstile = Turnstile(reactor, admission)
    relay = SpeechRelay(residency, turnstile, BufferBudget(admission), Stalls(reactor, stall_seconds))
    metrics = Metrics(reactor, registry, residency, turnstile, requests, cluster)
    residency.observer = metrics
    speech = SpeechService(registry, residency, relay, metrics, clients)
    translation = OpenAITranslation(registry, speech, clients.openai_sample_rate)
    router = CoreApp(
        registry=registry, residency=residency, speech=speech, catalog=catalog, metrics=metrics,
        requests=requests, version=version, contract_version=contract_version, metrics_public=metrics_public,
        clients=clients,
        cluster=cluster,
    )
    jobs = Jobs(reactor)
    jobs.on_finished = metrics.job_finished
    if updates is None:
        updates = checker_for(reactor, version, RELEASES_URL, lambda: True)
    manage = ManagementRoutes(
        jobs=jobs, updates=updates, requests=requests, settings=settings_api,
        installer=installer(jobs) if installer is not None else None,
    )
    return Core(
        reactor=reactor,
        registry=registry,
        residency=residency,
        relay=relay,
        speech=speech,
        metrics=metrics,
        requests=requests,
        router=router,
        openai=OpenAIShim(
            registry=registry, speech=speech, routes=router, translation=translation, requests=requests,
            clock=reactor, budget=relay.budget, clients=clients,
        ),
        mcp=McpServer(routes=router, speech=speech, version=version, budget=relay.budget),
        streams=SpeechStreams(speech=speech, translation=translation, registry=registry, clock=reactor),
        manage=manage,
        jobs=jobs,
        catalog=catalog,
        site_options={
            "timeout": idle_timeout,
            "head_timeout": head_timeout,
            "management_token": management_token,
            "management_origins": tuple(management_origins),
            "cors_origins": tuple(cors_origins),
        },
        metrics_public=metrics_public,
        node=NodeDoor(
            name=node, registry=registry, residency=residency, speech=speech, routes=router, requests=requests
        ) if node is not None else None,
        wyoming=WyomingDoor(
            speech=speech, routes=router, registry=registry, clock=reactor, limits=wyoming, clients=clients,
            version=version,
        ) if wyoming is not None else None,
    )


class RhapsodeService(service.Service):
    """
    One core: its engines' workers and the public API on C{server.host:server.port}.
    """

    log = Logger()

    def __init__(
        self,
        config: Config,
        reactor: Any = None,
        *,
        stop_reactor_if_unable: bool = False,
        config_path: str | os.PathLike[str] | None = None,
        unset: Sequence[str] = (),
    ) -> None:
        """
        @param config_path: the config file C{config} was read from; the state database
            (settings written through the API, engines it installed) is C{rhapsode.db}
            beside it.  By default, the file L{load_config} read C{config} from, if it
            did; a service with neither keeps no state and answers C{/settings} with
            C{unsupported}.
        @param stop_reactor_if_unable: stop the reactor when the service cannot start
            (a folder it needs cannot be made, its port cannot be bound), which is what
            C{twistd rhapsode} wants; a program embedding the core leaves it off and
            learns of the failure from L{when_listening}.
        @param unset: settings saved in the state database to drop before the start
            reads them (C{rhapsode serve --unset KEY}): the way out of a saved value a
            start cannot apply, with no server running to PATCH.
        """
        self.config = config
        self._reactor_given = reactor
        self._stop_reactor_if_unable = stop_reactor_if_unable
        self._unset = tuple(unset)
        self.registry: Registry | None = None
        self.catalog: Catalog | None = None
        self.app: Core | None = None
        self.watchdog: Watchdog | None = None
        #: At a cluster's front, what the cluster's nodes last said (docs/cluster.md).
        self.cluster: ClusterView | None = None
        #: With workers.prestart, each local engine's worker process starting at boot.
        self.prestarted: list[Deferred[None]] = []
        self.port: Any = None
        #: The Wyoming door's port, once it listens (wyoming.port), and its zeroconf
        #: advertisement (wyoming.zeroconf).
        self.wyoming_port: Any = None
        self.advertisement: Advertisement | None = None
        self._clients: list[IWorkerClient] = []
        self._connections = _Connections()
        #: Why the service could not start (a folder, its port), once that has happened.
        self.failed_to_start: Any = None
        self._listen_waiters: list[Deferred[Any]] = []
        source = config_source(config)
        self._config_path = Path(os.path.abspath(config_path)) if config_path is not None else (
            source.path if source is not None else None
        )
        self._raw: Mapping[str, Any] = source.raw if source is not None else {}
        if self._config_path is not None and (source is None or source.path != self._config_path):
            self._raw = _read_raw(self._config_path)
        self.state: StateDatabase | None = None
        self.settings: Settings | None = None
        self._state_error: Failure | None = None

    @property
    def reactor(self) -> Any:
        return _reactor(self._reactor_given)

    def setServiceParent(self, parent: Any) -> None:
        """
        Under twistd, offer the application a log observer at the config's level; twistd
        asks the application for one before it falls back to its own.
        """
        super().setServiceParent(parent)
        # Read now, before twistd asks for its log observer, so a log.level saved in
        # the database is the one it gets; a failure is reported as the service starts.
        self._open_state()
        if self.state is not None:
            # twistd may fork to daemonize before it starts the service: no open file
            # crosses that.  The service opens the database again as it starts.
            self.state.close()
            self.state = self.settings = None
        get = getattr(parent, "getComponent", None)
        if get is not None and get(ILogObserver, None) is None:
            parent.setComponent(ILogObserver, level_filtered(self.config.log.level))

    def _open_state(self) -> None:
        """
        Open the state database beside the config file, once, and take the config in
        use from the three layers (defaults, the file, the database).
        """
        if self._config_path is None or self.state is not None or self._state_error is not None:
            return
        path = self._config_path.parent / FILE_NAME
        try:
            store = StateStore.open(path, __version__)
        except StateError as error:
            self._state_error = Failure(ServiceStartError(str(error)))
            return
        installed = {engine.id: engine.entry for engine in store.engines().values()}
        dropped = [key for key in self._unset if key in store.settings()]
        if dropped:
            store.write_settings({key: None for key in dropped})
            for key in dropped:
                self.log.warn("dropped the setting {key} saved in {path} (--unset)", key=key, path=str(path))
        for key in set(self._unset) - set(dropped):
            self.log.info("--unset {key}: no such setting is saved in {path}", key=key, path=str(path))
        self._unset = ()
        state = StateDatabase(store, self.reactor)
        try:
            settings = Settings(
                raw=self._raw,
                base=self._config_path.parent,
                database=state,
                engine_ids=lambda: self.registry.ids() if self.registry is not None else (),
                on_change=self._settings_changed,
                installed=installed,
            )
        except ConfigError as error:
            fault = saved_fault(self._raw, self._config_path.parent, state.settings(), installed)
            state.close()
            if fault is None:
                why = f"state database {path}: {error}"
            else:
                why = f"the setting {fault} saved in {path} cannot apply: {error}; {unset_hint(fault)}"
            self._state_error = Failure(ServiceStartError(why))
            return
        self.state, self.settings = state, settings
        self.config = settings.config

    def _settings_changed(self, config: Config) -> None:
        # ConfigSettings reads self.config when a setting is used: the swap is the change.
        self.config = config
        if self.app is not None:
            self.app.residency.settings_changed()

    def build(self) -> Core:
        """
        The registry and the core, without listening (for tests and embedding).
        """
        reactor = self.reactor
        workers = self.config.workers
        handles: dict[str, EngineHandle] = {}
        # Each engine's workerVersion is read here, as it is declared, never per request.
        catalog = self.catalog = Catalog(read_source(self.config.install.source_dir), __version__)
        for engine_id, engine in self.config.engines.items():
            handles[engine_id] = self._handle(engine_id, engine)
        if self.state is not None:
            operator = _operator_engines(self._raw)
            catalog.managed.update(e for e in self.state.engines() if e in handles and e not in operator)
        registry = self.registry = Registry(handles)
        # Read when used, so a settings API can change them live.
        settings = ConfigSettings(lambda: self.config)
        residency = Residency(
            clock=reactor,
            settings=settings,
            terminate=lambda engine: registry.get(engine).terminate(),
            unload=lambda engine: registry.get(engine).unload(),
        )
        install = self.config.install

        def installer(jobs: Jobs) -> Installer:
            return Installer(
                reactor=reactor,
                jobs=jobs,
                catalog=catalog,
                state=self.state,
                host=_ServiceHost(self),
                # install.* waits for a restart (section 10): the start's values.
                venv_dir=lambda: install.venv_dir,
                source_dir=lambda: install.source_dir,
                interpreter=lambda: install.python,
                box=lambda: install.box,
                runner=Commands(reactor, os.environ),
                environ=os.environ,
                core_version=__version__,
                uv=find_uv(),
            )

        clusters = {engine.cluster for engine in self.config.engines.values() if engine.cluster is not None}
        self.cluster = ClusterView(
            reactor, clusters, lambda url: WorkerClient(reactor, url), workers.health_check_seconds
        ) if clusters else None
        self.app = build_core(
            registry,
            reactor=reactor,
            contract_version=CONTRACT,
            management_token=self.config.management.token,
            management_origins=self.config.management.origins,
            cors_origins=self.config.cors.origins,
            metrics_public=self.config.metrics.public,
            residency=residency,
            admission=settings,
            clients=settings,
            stall_seconds=workers.stall_seconds,
            head_timeout=self.config.server.head_timeout_seconds,
            idle_timeout=self.config.server.idle_timeout_seconds,
            catalog=catalog,
            settings_api=self.settings,
            installer=installer,
            # update.check is read on every request, so a PATCH applies at once; the URL
            # and the environment are the start's.
            updates=checker_for(reactor, __version__, self.config.update.url, lambda: self.config.update.check),
            node=(self.config.server.node or socket.gethostname()) if self.config.server.role == "node" else None,
            wyoming=WyomingLimits(
                idle_seconds=self.config.wyoming.idle_seconds,
                max_events=self.config.wyoming.max_events,
                max_connections=self.config.wyoming.max_connections,
            ) if self.config.wyoming.port is not None else None,
            cluster=self.cluster,
        )
        self.watchdog = Watchdog(registry, reactor, workers.health_check_seconds, workers.unresponsive_seconds)
        return self.app

    def _handle(self, engine_id: str, engine: EngineConfig) -> EngineHandle:
        """
        One engine's handle: a supervisor and a client for a local worker, a client for
        a remote one; its catalog facts and workerVersion read as it is declared.
        """
        reactor = self.reactor
        workers = self.config.workers
        catalog = self.catalog
        assert catalog is not None
        if engine.cluster is not None:
            # The cluster's router says which node each request's model goes to, and that
            # node's core answers it as the engine's worker would (_upstream.cluster).
            catalog.declare(engine_id, None, None)
            cluster = ClusterClient(
                WorkerClient(reactor, engine.cluster), engine_id, MODEL_HEADER, lambda url: WorkerClient(reactor, url),
                reactor,
            )
            self._clients.append(cluster)
            return EngineHandle(engine_id, cluster, None, elsewhere=True)
        if engine.url is not None:
            catalog.declare(engine_id, None, None)
            client = WorkerClient(reactor, engine.url)
            self._clients.append(client)
            return EngineHandle(engine_id, client, None)
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
            env={**core_budget_env(workers.cores, workers.socket_dir), **engine.env, **device_env(engine.device)},
            contract=CONTRACT,
            startup_timeout=workers.startup_timeout_seconds,
            drain_grace=workers.drain_grace_ms / 1000,
            max_restarts=workers.max_restarts,
            restart_decay=workers.restart_decay_seconds,
            terminate=_terminate_verb(client),
            on_crash=partial(self._crashed, engine_id),
        )
        python = engine.python or sys.executable
        catalog.declare(engine_id, engine.module, python)
        self._clients.append(client)
        return EngineHandle(engine_id, client, supervisor, read_catalog(engine.module, python))

    def _crashed(self, engine_id: str) -> None:
        if self.app is not None:
            self.app.residency.forget(engine_id)

    def startService(self) -> None:
        super().startService()
        from twisted.internet.endpoints import TCP4ServerEndpoint, TCP6ServerEndpoint

        self._open_state()
        if self._state_error is not None:
            self._cannot_start(self._state_error)
            return
        app = self.build()
        server = self.config.server
        endpoint_type = TCP6ServerEndpoint if ":" in server.host else TCP4ServerEndpoint
        endpoint = endpoint_type(self.reactor, server.port, backlog=BACKLOG, interface=server.host)

        def listening(port: Any) -> None:
            self.port = port
            if self.watchdog is not None:
                self.watchdog.start()
            if self.cluster is not None:
                self.cluster.start()
            address = port.getHost()
            self.log.info(
                "rhapsode listening on {host}:{port} with engines {engines}",
                host=address.host,
                port=address.port,
                engines=", ".join(self.config.engines) or "none",
            )
            if self.config.workers.prestart and self.registry is not None:
                self.prestarted = prestart(self.registry)
            waiters, self._listen_waiters = self._listen_waiters, []
            for waiter in waiters:
                waiter.callback(address)

        failed = self._cannot_start

        workers = self.config.workers
        for key, folder in (("workers.socketDir", workers.socket_dir), ("workers.voiceDir", workers.voice_dir)):
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                # Checked before listening: a core whose workers cannot start is not up.
                failed(Failure(ServiceStartError(f"{key} {folder} cannot be made: {error.strerror}")))
                return
        # Access lines are logged at info; at a stricter level none is even formatted.
        access_log = self.config.log.level in ("debug", "info")
        site = app.site(access_log=access_log)
        # Every connection of the public port, so that a stop can cut off what outlasts its grace.
        site.connections = self._connections
        listened = endpoint.listen(site).addErrback(self._refused_listen)
        if app.wyoming is not None:
            # Both ports or neither: a core whose Wyoming port is taken has not started.
            listened.addCallback(lambda port: self._listen_wyoming(app, port))
        listened.addCallbacks(listening, failed)

    def _refused_listen(self, failure: Failure) -> Failure:
        """
        Why the public port could not listen: a port in use as L{PortTaken} (by whom,
        and where it is set); else, where the state database holds the address, as
        that saved setting's fault with how to drop it.
        """
        taken = self._port_taken(failure)
        return taken if taken.check(PortTaken) else self._saved_address(taken)

    def _listen_wyoming(self, app: Core, http_port: Any) -> "Deferred[Any]":
        from twisted.internet.endpoints import TCP4ServerEndpoint, TCP6ServerEndpoint

        wyoming = self.config.wyoming
        assert app.wyoming is not None and wyoming.port is not None
        endpoint_type = TCP6ServerEndpoint if ":" in wyoming.host else TCP4ServerEndpoint
        endpoint = endpoint_type(self.reactor, wyoming.port, backlog=BACKLOG, interface=wyoming.host)

        def listening(port: Any) -> Any:
            self.wyoming_port = port
            address = port.getHost()
            self.log.info("the Wyoming door listens on {host}:{port}", host=address.host, port=address.port)
            if wyoming.zeroconf:
                from twisted.internet.threads import deferToThreadPool

                reactor = self.reactor
                self.advertisement = Advertisement(
                    port=address.port,
                    name=wyoming.zeroconf_name or f"rhapsode-{socket.gethostname()}",
                    host=wyoming.host,
                    blocking=lambda f: deferToThreadPool(reactor, reactor.getThreadPool(), f),
                )
                # A network that cannot be advertised on does not stop the door.
                self.advertisement.start().addErrback(
                    lambda failure: self.log.failure("advertising the Wyoming door", failure)
                )
            return http_port

        def unbound(failure: Failure) -> "Deferred[Any]":
            # The public port is open already: closed again, and the start fails.
            # IListeningPort.stopListening may answer None, when it stopped at once.
            closing = maybeDeferred(http_port.stopListening)
            closing.addBoth(lambda _: failure)
            return closing

        return endpoint.listen(app.wyoming).addCallbacks(listening, unbound)

    def _saved_address(self, failure: Failure) -> Failure:
        """
        A port that cannot be bound at an address or port the state database holds:
        said as that saved setting's fault, with how to drop it.
        """
        saved = self.state.settings() if self.state is not None else {}
        keys = [key for key in ("server.host", "server.port") if key in saved]
        if not keys or failure.check(ServiceStartError):
            return failure
        server = self.config.server
        why = failure.getErrorMessage()
        return Failure(ServiceStartError(
            f"cannot listen on {server.host}:{server.port} ({why}), which the state database holds "
            f"as {' and '.join(keys)}: {unset_hint(keys[0])}"
        ))

    def _port_taken(self, failure: Failure) -> Failure:
        """
        A port in use, said as a start refused (which process holds it, and where the
        port is set) rather than a traceback; any other failure as it is.
        """
        error = failure.value
        if not isinstance(error, CannotListenError):
            return failure
        cause = error.socketError
        if getattr(cause, "errno", None) != errno.EADDRINUSE:
            return failure
        server = self.config.server
        holder = listener_of(server.port)
        by = f" by {holder}" if holder else ""
        saved = self.state.settings() if self.state is not None else {}
        if "server.port" in saved:
            # The database wins over the file: editing the file would change nothing.
            why = getattr(cause, "strerror", None) or os.strerror(errno.EADDRINUSE)
            message = (
                f"cannot listen on {server.host}:{server.port} ({why}): the port is taken{by}, and the state "
                f"database holds it as server.port: stop that process, or {unset_hint('server.port')}"
            )
        else:
            where = f"server.port in {self._config_path}" if self._config_path is not None else "server.port in the config file"
            message = f"port {server.port} on {server.host} is taken{by}: stop it, or set {where}"
        return Failure(PortTaken(error.interface, error.port, cause, message))

    def _cannot_start(self, failure: Any) -> None:
        """
        The service cannot start: say why, fail whoever waits to hear it listens, and
        under twistd stop the reactor.
        """
        if failure.check(ServiceStartError):
            self.log.critical("{why}", why=failure.getErrorMessage())
        else:
            self.log.failure("cannot listen", failure)
        self.failed_to_start = failure
        waiters, self._listen_waiters = self._listen_waiters, []
        for waiter in waiters:
            waiter.errback(failure)
        if self._stop_reactor_if_unable:
            # twistd starts services before it runs the reactor, and a TCP port
            # fails to bind at once: stopping then would be refused and the
            # process would run on, listening nowhere.
            self.reactor.callWhenRunning(self.reactor.stop)

    def when_listening(self) -> "Deferred[Any]":
        """
        Fires with the address the public API listens on (an C{IPv4Address} or
        C{IPv6Address}) once the service has started and bound its port, at once if it
        has; fails with why it could not start.
        """
        if self.port is not None:
            return succeed(self.port.getHost())
        if self.failed_to_start is not None:
            return fail(self.failed_to_start)
        waiter: Deferred[Any] = Deferred()
        self._listen_waiters.append(waiter)
        return waiter

    def stopService(self) -> "Deferred[Any]":
        """
        Stop listening, give requests in flight up to shutdownGraceMs to finish, then
        signal every worker without asking (a shutdown) and close the connection pools.
        """
        super().stopService()
        # Said first, so that whoever pressed Ctrl-C learns what the wait is for.
        grace = self.config.server.shutdown_grace_ms / 1000
        in_flight = self.app.requests.count if self.app is not None else 0
        running = [
            f"{h.id} (pid {h.supervisor.pid})"
            for h in self.registry or ()
            if h.supervisor is not None and h.supervisor.pid is not None
        ]
        if running:
            drain = self.config.workers.drain_grace_ms / 1000
            workers = (
                f"stopping {'worker' if len(running) == 1 else 'workers'} {', '.join(running)}, "
                f"killed if still running {drain:g} s later"
            )
        else:
            workers = "no worker running"
        if in_flight:
            waiting = f"waiting up to {grace:g} s for {_count(in_flight, 'request')} in flight to finish"
        else:
            waiting = "no request in flight"
        plan = waiting + (", then " if in_flight and running else "; ") + workers
        self.log.info("shutting down: {plan}", plan=plan)

        async def stop() -> None:
            if self.watchdog is not None:
                self.watchdog.stop()
            if self.cluster is not None:
                await self.cluster.stop()
            # IListeningPort.stopListening answers a Deferred, or None when it stopped at once.
            if self.port is not None:
                await maybeDeferred(self.port.stopListening)
            if self.wyoming_port is not None:
                await maybeDeferred(self.wyoming_port.stopListening)
            if self.advertisement is not None:
                try:
                    await self.advertisement.stop()
                except Exception:
                    self.log.failure("withdrawing the Wyoming door's advertisement")
            if self.app is not None:
                self.app.close()
                # A job running now is stopped (its process group killed) and marked
                # failed, and every stream following a job ends.
                await self.app.jobs.close()
            if self.app is not None and self.app.requests.count:
                idle = self.app.requests.when_idle()
                timer = self.reactor.callLater(grace, idle.cancel)
                try:
                    await idle
                except CancelledError:
                    self.log.warn(
                        "{requests} still in flight after {grace} s: cut off",
                        requests=_count(self.app.requests.count, "request"),
                        grace=f"{grace:g}",
                    )
                    # Cut off now, as said: each connection is aborted, which cancels its
                    # relay and so the worker's stream, before the workers are stopped.
                    self._connections.abort_all()
                finally:
                    if timer.active():
                        timer.cancel()
            stopping = [
                h.supervisor.stop(ask=False) for h in self.registry or () if h.supervisor is not None
            ]
            await DeferredList(stopping, consumeErrors=True)
            await DeferredList([c.close() for c in self._clients], consumeErrors=True)
            if self.state is not None:
                # After everything else: a PATCH in flight finishes its transaction first.
                self.state.close()
            self.log.info("rhapsode stopped")

        return Deferred.fromCoroutine(stop())


class _Connections:
    """
    The public port's open connections, told by each channel as it opens and closes.
    """

    def __init__(self) -> None:
        self._open: set[Any] = set()

    def opened(self, channel: Any) -> None:
        self._open.add(channel)

    def closed(self, channel: Any) -> None:
        self._open.discard(channel)

    def abort_all(self) -> None:
        for channel in list(self._open):
            transport = channel.transport
            if transport is not None:
                getattr(transport, "abortConnection", transport.loseConnection)()


class PortTaken(ServiceStartError, CannotListenError):
    """
    The public port is in use: a start refused (said without a traceback), and still
    the CannotListenError a program embedding the core may be waiting for.
    """

    def __init__(self, interface: str, port: int, socket_error: BaseException, message: str) -> None:
        CannotListenError.__init__(self, interface, port, socket_error)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _operator_engines(raw: Mapping[str, Any]) -> set[str]:
    """
    The engines the operator's config file names, disabled ones (null) included.
    """
    engines = raw.get("engines")
    return set(engines) if isinstance(engines, Mapping) else set()


class _ServiceHost:
    """
    What the installer changes in the running core: the registry, the catalog's
    versions, the settings' view of the engines, and the worker processes.
    """

    def __init__(self, service: RhapsodeService) -> None:
        self._service = service

    def _registry(self) -> Registry:
        assert self._service.registry is not None
        return self._service.registry

    def registered(self, engine_id: str) -> bool:
        return engine_id in self._registry()

    def operator_engines(self) -> set[str]:
        return _operator_engines(self._service._raw)

    def cluster_of(self, engine_id: str) -> str | None:
        engine = self._service.config.engines.get(engine_id)
        return engine.cluster if engine is not None else None

    def _installed(self) -> dict[str, Mapping[str, Any]]:
        state = self._service.state
        return {} if state is None else {e.id: e.entry for e in state.engines().values()}

    def declare(self, engine_id: str, entry: Mapping[str, Any]) -> None:
        service = self._service
        if service.settings is not None:
            service.settings.installed_changed(self._installed())
        engine = service.config.engines.get(engine_id)
        if engine is None:
            engine = engine_entry(engine_id, entry)
        self._registry().add(service._handle(engine_id, engine))

    def replace(self, engine_id: str, entry: Mapping[str, Any]) -> "Deferred[None]":
        """
        A reinstall's swap: the new handle goes in first, so no request finds the engine
        missing; the old one's worker is stopped after.
        """
        service = self._service
        if service.settings is not None:
            service.settings.installed_changed(self._installed())
        engine = service.config.engines.get(engine_id) or engine_entry(engine_id, entry)
        old = self._registry().replace(service._handle(engine_id, engine))
        return Deferred.fromCoroutine(self._stop(old))

    def retire(self, engine_id: str) -> "Deferred[None]":
        """
        An uninstall: the engine leaves the registry, then its worker is stopped.
        """
        handle = self._registry().remove(engine_id)
        if self._service.catalog is not None:
            self._service.catalog.forget(engine_id)
        if self._service.settings is not None:
            self._service.settings.installed_changed(self._installed())
        return Deferred.fromCoroutine(self._stop(handle))

    async def _stop(self, handle: EngineHandle) -> None:
        # Retired first: a request that found the handle before it left starts nothing.
        handle.retired = True
        if handle.supervisor is not None:
            await handle.supervisor.stop(ask=True)
        if handle.client in self._service._clients:
            self._service._clients.remove(handle.client)
        await handle.client.close()

    async def quiet(self, engine_id: str, work: Callable[[], Awaitable[_T]], wait: float | None) -> _T:
        assert self._service.app is not None

        async def run() -> _T:
            return await work()

        return await self._service.app.residency.quiet(engine_id, run, wait)

    async def fetch(self, engine_id: str, variant: str, context: JobContext, required: bool = True) -> None:
        """
        The worker's fetch (section 8): its process started if it is down, no model
        loaded; what it logs meanwhile goes into the job's events.
        """
        handle = self._registry().get(engine_id)
        client = await handle.ready()
        supervisor = handle.supervisor
        if supervisor is not None:
            supervisor.listeners.append(context.log)
        try:
            code, answer = await client.json(b"POST", "/fetch", {"variant": variant})
        finally:
            if supervisor is not None and context.log in supervisor.listeners:
                supervisor.listeners.remove(context.log)
        if code < 300:
            context.log(f"{engine_id} {variant}: weights fetched")
            return
        error = refusal(answer.get("error") if isinstance(answer, dict) else None, code)
        if error.code == "unsupported" and not required:
            # An install's weights step: nothing to do, and the install still succeeded.
            context.log(f"{engine_id} has nothing to fetch: its weights arrive with its first load")
            return
        raise error


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def level_filtered(level: str, stream: Any = None) -> Any:
    """
    A text observer on C{stream} (stdout) that drops events below the config's level;
    "trace" is Twisted's debug, its lowest.

    At C{info} and stricter levels, Twisted's own routine lines (a factory or port
    starting and stopping, twistd starting up, the main loop ending, an idle client
    timed out) are dropped as well: they say nothing the core's own lines do not.
    Its warnings and errors always pass; C{debug} and C{trace} show everything.
    """
    name = {"trace": "debug"}.get(level, level)
    threshold = LogLevel.levelWithName(name)
    predicates: list[Any] = [LogLevelFilterPredicate(defaultLogLevel=threshold)]
    if threshold > LogLevel.debug:
        predicates.append(twisted_routine)
    return FilteringLogObserver(textFileLogObserver(stream or sys.stdout), predicates)


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


def _read_raw(path: Path) -> Mapping[str, Any]:
    """
    The config file's document, which the state database's settings layer over.
    """
    import json

    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        # load_config has read it already, or the caller built its Config another way.
        return {}
    return raw if isinstance(raw, dict) else {}
