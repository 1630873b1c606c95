"""
L{serve}: the spawn contract of protocol.md sections 2 and 9.

Reads C{RHAPSODE_WORKER_LISTEN}, C{RHAPSODE_WORKER_ENGINE} and
C{RHAPSODE_WORKER_CONTRACT}, negotiates the contract, makes the engine with the
L{WorkerContext} the rest of the environment describes, binds, prints the one handshake
line on stdout and from then on sends anything written to C{sys.stdout} to the log.
Logs are JSON lines on stderr.  SIGTERM and C{POST /terminate} drain and exit 0
(L{rhapsode_worker._lifecycle}).  A worker whose parent dies exits, and a worker that
leads its process group takes the group with it whenever it exits, so nothing orphaned
holds memory: not the worker, and not a process its adapter started.
"""

from __future__ import annotations

import ctypes
import io
import json
import logging
import os
import signal
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import IO, Any, Callable, Mapping, NoReturn, Protocol, Sequence

from twisted.internet.defer import Deferred
from twisted.internet.task import LoopingCall, react
from twisted.internet.threads import deferToThreadPool
from twisted.logger import (
    FilteringLogObserver,
    ILogObserver,
    Logger,
    LogLevel,
    LogLevelFilterPredicate,
    formatEvent,
    globalLogBeginner,
)
from twisted.python.threadpool import ThreadPool
from zope.interface import provider

from rhapsode_protocol.http.logs import twisted_routine
from rhapsode_protocol.schemas import CONTRACT_VERSIONS
from rhapsode_protocol.spawn import (
    CONTRACT_VARIABLE,
    ENGINE_VARIABLE,
    LISTEN_VARIABLE,
    LOG_LEVEL_VARIABLE,
)

from . import _memory
from ._context import WorkerContext
from ._encode import probe_cache_dir, probe_ffmpeg
from ._engine import IEngine
from ._heap import IdleTrim, rest_then_trim
from ._lifecycle import WorkerLifecycle
from ._model import ModelState
from ._routes import WorkerApp
from ._schedule import Scheduler

BACKLOG = 2048
_EXIT_REFUSED = 3
_EXIT_MISCONFIGURED = 2
_PARENT_POLL_SECONDS = 1.0
_FILE_THREADS = 4
_SWEEPS = 5

log = Logger(namespace="rhapsode_worker")


class SpawnError(Exception):
    """
    The environment does not describe a worker this SDK can be.
    """


@dataclass(frozen=True)
class Spawn:
    """
    What the core said at spawn, parsed.
    """

    listen: str
    engine: str
    contract: int
    context: WorkerContext

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], engine_id: str) -> "Spawn":
        """
        @param engine_id: the engine's own id, which names the worker when the core did
            not (a worker run by hand) and its cache folder.
        """
        listen = environ.get(LISTEN_VARIABLE, "tcp:127.0.0.1:0")
        if not (listen.startswith("unix:") or listen.startswith("tcp:")):
            raise SpawnError(f"RHAPSODE_WORKER_LISTEN must be unix:PATH or tcp:HOST:PORT, not {listen!r}")
        name = environ.get(ENGINE_VARIABLE) or engine_id
        raw = environ.get(CONTRACT_VARIABLE, str(max(CONTRACT_VERSIONS)))
        try:
            offer = int(raw)
        except ValueError:
            raise SpawnError(f"RHAPSODE_WORKER_CONTRACT must be an integer, not {raw!r}") from None
        chosen = negotiate(offer)
        context = WorkerContext.from_environ(environ, engine_id)
        return cls(listen=listen, engine=name, contract=chosen, context=context)


class ContractRefused(SpawnError):
    pass


def negotiate(offer: int) -> int:
    """
    The highest contract this SDK speaks that is not above the core's offer.

    @raise ContractRefused: naming both numbers, when the offer is below all of them.
    """
    usable = [c for c in CONTRACT_VERSIONS if c <= offer]
    if not usable:
        raise ContractRefused(
            f"the core offers contract {offer}; this worker speaks contract "
            f"{min(CONTRACT_VERSIONS)} at the lowest"
        )
    return max(usable)


def _json_observer(stream: IO[str], engine: str) -> ILogObserver:
    @provider(ILogObserver)
    def observe(event: Mapping[str, Any]) -> None:
        level = event.get("log_level", LogLevel.info)
        record: dict[str, Any] = {
            "time": datetime.fromtimestamp(event.get("log_time", 0), timezone.utc).isoformat(),
            "level": level.name,
            "engine": engine,
            "namespace": event.get("log_namespace", ""),
            "message": formatEvent(dict(event)),
        }
        failure = event.get("log_failure")
        if failure is not None:
            record["traceback"] = failure.getTraceback()
        try:
            stream.write(json.dumps(record, default=str) + "\n")
            stream.flush()
        except (OSError, ValueError):
            pass

    return observe


def worker_observer(stream: IO[str], engine: str, level: LogLevel) -> ILogObserver:
    """
    The worker's log: JSON lines on C{stream} at C{level} and above; above debug,
    without Twisted's routine lines (a port or a factory starting, the main loop ending).
    """
    predicates: list[Any] = [LogLevelFilterPredicate(defaultLogLevel=level)]
    if level > LogLevel.debug:
        predicates.append(twisted_routine)
    return FilteringLogObserver(_json_observer(stream, engine), predicates)


class _StdoutToLog(io.TextIOBase):
    """
    What C{sys.stdout} becomes after the handshake: each line an info log event.
    """

    def __init__(self) -> None:
        self._pending = ""
        self._log = Logger(namespace="stdout")

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._pending += text
        *lines, self._pending = self._pending.split("\n")
        for line in lines:
            self._log.info("{line}", line=line)
        return len(text)

    def flush(self) -> None:
        if self._pending:
            line, self._pending = self._pending, ""
            self._log.info("{line}", line=line)


class _LoggingBridge(logging.Handler):
    """
    Route the standard library's logging (which engine libraries use) into ours.
    """

    _levels = {
        logging.DEBUG: LogLevel.debug,
        logging.INFO: LogLevel.info,
        logging.WARNING: LogLevel.warn,
        logging.ERROR: LogLevel.error,
        logging.CRITICAL: LogLevel.critical,
    }

    def emit(self, record: logging.LogRecord) -> None:
        level = self._levels.get(record.levelno, LogLevel.info)
        Logger(namespace=record.name).emit(level, "{message}", message=record.getMessage())


class _Connections:
    """
    The worker site's open connections, so a drain can close every one gracefully: a
    response written but still in a send buffer is flushed, not cut off by the process
    exiting.  The site's connections report themselves (L{rhapsode_protocol.http.site.EagerChannel});
    wrapping each connection in a protocol wrapper to learn the same put a layer of
    attribute look-ups under every write.
    """

    def __init__(self) -> None:
        self.open: set[Any] = set()
        self._empty: list[Deferred[None]] = []

    def opened(self, connection: Any) -> None:
        self.open.add(connection)

    def closed(self, connection: Any) -> None:
        self.open.discard(connection)
        if not self.open:
            waiters, self._empty = self._empty, []
            for d in waiters:
                d.callback(None)

    def close_all(self) -> "Deferred[None]":
        d: Deferred[None] = Deferred()
        if not self.open:
            d.callback(None)
            return d
        self._empty.append(d)
        for connection in list(self.open):
            if connection.transport is not None:
                # The connection's own close: a socket with a producer registered
                # would otherwise wait on that producer.
                connection.loseConnection()
        return d


def _die_with_parent() -> None:
    # Linux only: the kernel sends SIGTERM (a drain) when the spawning process dies.
    # The parent poll in _run covers other systems and a parent that died first.
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _group_members(group: int, proc: str = "/proc") -> list[int] | None:
    """
    The live processes of process group C{group}, read from C{proc}; None without one.
    """
    members = []
    try:
        entries = os.listdir(proc)
    except OSError:
        return None
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(os.path.join(proc, entry, "stat"), "rb") as f:
                # The command name may hold spaces and parentheses; the fields after
                # its last ")" are state, ppid, pgrp.
                fields = f.read().rpartition(b")")[2].split()
        except OSError:
            continue
        # A zombie is dead already: it waits only to be reaped.
        if len(fields) > 2 and fields[0] != b"Z" and fields[2] == b"%d" % group:
            members.append(int(entry))
    return members


def _sweep_group() -> None:
    """
    SIGKILL every other process in this worker's process group: an adapter's helper,
    or a grandchild it forked, would otherwise outlive the worker, and the core too
    when the core was killed and cannot sweep the group itself.

    Only a group leader sweeps.  The core makes each worker one (LEADER in
    L{rhapsode._supervisor}); a worker run by hand or by a test shares its parent's
    group, which is not its to empty.
    """
    me = os.getpid()
    if os.getpgrp() != me:
        return
    # Again while something is found: a member may fork while the last one is killed.
    for _ in range(_SWEEPS):
        members = _group_members(me)
        if members is None:
            # No /proc (not Linux): the group is told instead, and this process, on
            # its way out, ignores the telling.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            os.killpg(me, signal.SIGTERM)
            return
        others = [pid for pid in members if pid != me]
        if not others:
            return
        for pid in others:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


class ProcessControl(Protocol):
    """
    What L{_run} does to the process it runs in (L{_Process}), so that a unit test can
    run it on a memory reactor and record these instead.
    """

    parent: int

    def parent_alive(self) -> bool: ...
    def on_sigterm(self, handler: Callable[[], None]) -> None: ...
    def announce(self, handshake: Mapping[str, Any]) -> None: ...
    def sweep(self) -> None: ...
    def exit(self, code: int) -> None: ...


class _Process:
    """
    What the runtime does to the process it runs in (L{ProcessControl}).

    @ivar parent: the process that spawned this one, read first thing at start-up.
    """

    def __init__(self, parent: int) -> None:
        self.parent = parent

    def parent_alive(self) -> bool:
        # An orphan is adopted by init or a subreaper: its parent's id changes.
        return os.getppid() == self.parent

    def on_sigterm(self, handler: Callable[[], None]) -> None:
        signal.signal(signal.SIGTERM, lambda number, frame: handler())

    def announce(self, handshake: Mapping[str, Any]) -> None:
        """
        Print the handshake line, then make stdout the log.
        """
        real_stdout = sys.__stdout__
        assert real_stdout is not None
        real_stdout.write(json.dumps(handshake) + "\n")
        real_stdout.flush()
        # From here stdout is the log: a print in an adapter, or a C library writing to
        # fd 1, can no longer corrupt the handshake channel.
        os.dup2(2, 1)
        sys.stdout = _StdoutToLog()

    def sweep(self) -> None:
        _sweep_group()

    def exit(self, code: int) -> NoReturn:
        """
        End the process now, taking its process group along; does not return.
        """
        _sweep_group()
        os._exit(code)


def _running(reactor: Any) -> "Deferred[None]":
    running: Deferred[None] = Deferred()
    reactor.callWhenRunning(running.callback, None)
    return running


def _listen(reactor: Any, listen: str, site: Any) -> "Deferred[Any]":
    from twisted.internet.endpoints import (
        TCP4ServerEndpoint,
        TCP6ServerEndpoint,
        UNIXServerEndpoint,
    )

    if listen.startswith("unix:"):
        path = Path(listen[len("unix:"):])
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_socket():
            path.unlink()  # a stale socket from a worker that died; binding would fail
        return UNIXServerEndpoint(reactor, str(path), backlog=BACKLOG, mode=0o600).listen(site)
    host, _, port = listen[len("tcp:"):].rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        number = int(port)
    except ValueError:
        raise SpawnError(f"RHAPSODE_WORKER_LISTEN has no port: {listen!r}") from None
    endpoint_type = TCP6ServerEndpoint if ":" in host else TCP4ServerEndpoint
    return endpoint_type(reactor, number, backlog=BACKLOG, interface=host).listen(site)


def _bound(listen: str, port: Any) -> str:
    if listen.startswith("unix:"):
        return listen
    address = port.getHost()
    host = f"[{address.host}]" if ":" in address.host else address.host
    return f"tcp:{host}:{address.port}"


async def _run(
    reactor: Any,
    engine: IEngine,
    spawn: Spawn,
    process: ProcessControl,
    *,
    ffmpeg: str | None,
    formats: Sequence[str],
    access_log: bool = True,
) -> None:
    """
    Serve until drained, inside the reactor: C{ffmpeg} and C{formats} were probed
    before it ran, because a probe runs a program and the reactor waits on nothing.
    """
    pool = ThreadPool(minthreads=0, maxthreads=max(1, engine.concurrency), name="synthesis")
    pool.start()
    reactor.addSystemEventTrigger("during", "shutdown", pool.stop)
    # Voice files, fetches and uploads' parsing: never on the reactor thread, and never
    # queued behind a synthesis.
    files = ThreadPool(minthreads=0, maxthreads=_FILE_THREADS, name="files")
    files.start()
    reactor.addSystemEventTrigger("during", "shutdown", files.stop)
    model = ModelState(engine, reactor, pool)
    # Free memory goes back to the kernel once the worker has been idle a while, on the
    # files pool (never on the reactor, never behind a synthesis).
    trim = IdleTrim(reactor, files, rest_then_trim(engine))
    scheduler = Scheduler(
        reactor, pool, model, engine.concurrency, relays=bool(getattr(engine, "relays", False)), on_idle=trim.idle
    )
    connections = _Connections()
    lifecycle = WorkerLifecycle(idle=scheduler.when_idle, close_connections=connections.close_all)
    worker = WorkerApp(
        engine,
        reactor=reactor,
        scheduler=scheduler,
        model=model,
        formats=formats,
        ffmpeg=ffmpeg,
        contract_version=spawn.contract,
        on_terminate=lifecycle.drain,
        blocking=partial(deferToThreadPool, reactor, files),
        lifecycle=lifecycle,
        name=spawn.engine,
    )
    site = worker.site(access_log=access_log)
    site.connections = connections
    port = await _listen(reactor, spawn.listen, site)
    lifecycle.listening(port)
    # Any other stop of the reactor drains too: SIGINT, or Twisted's own SIGTERM
    # handler in the moment before the one below replaces it.
    reactor.addSystemEventTrigger("before", "shutdown", lifecycle.stop)
    # Twisted installs its SIGTERM handler (stop at once) as the reactor starts, so the
    # draining one goes in after that, and before the core can read the handshake and
    # signal: printed earlier, a SIGTERM right after "ready" killed the worker.
    await _running(reactor)
    process.on_sigterm(lambda: reactor.callFromThread(lifecycle.drain))
    handshake = {
        "ready": True,
        "contract": spawn.contract,
        "engine": spawn.engine,
        "listen": _bound(spawn.listen, port),
    }
    process.announce(handshake)

    def watch_parent() -> None:
        if not process.parent_alive():
            log.warn("parent process {pid} is gone; exiting", pid=process.parent)
            process.exit(1)

    watcher = LoopingCall(watch_parent)
    watcher.clock = reactor
    watcher.start(_PARENT_POLL_SECONDS, now=False)
    log.info(
        "serving {engine} on {listen} (contract {contract}, formats {formats})",
        engine=spawn.engine,
        listen=handshake["listen"],
        contract=spawn.contract,
        formats=",".join(worker.formats),
    )
    await lifecycle.when_stopped()
    watcher.stop()
    process.sweep()


#: What L{serve} makes the engine with: an L{IEngine} class, usually, or any callable
#: that takes the worker's L{WorkerContext}.
EngineFactory = Callable[[WorkerContext], IEngine]


def serve(factory: EngineFactory, environ: Mapping[str, str] | None = None) -> NoReturn:
    """
    Make the engine with this worker's L{WorkerContext} and serve it under the spawn
    contract until drained; never returns.

    @param factory: the engine's class (or a callable taking the context); its C{id},
        read before the engine is made, names the worker run by hand and its cache.
    """
    process = _Process(os.getppid())
    environ = os.environ if environ is None else environ
    engine_id = str(getattr(factory, "id", "") or "") or "engine"
    name = environ.get(ENGINE_VARIABLE) or engine_id
    level = LogLevel.levelWithName(environ.get(LOG_LEVEL_VARIABLE, "info"))
    observer = worker_observer(sys.stderr, name, level)
    globalLogBeginner.beginLoggingTo([observer], redirectStandardIO=False)
    logging.basicConfig(level=logging.INFO, handlers=[_LoggingBridge()], force=True)
    try:
        spawn = Spawn.from_environ(environ, engine_id)
    except SpawnError as error:
        log.critical("{error}", error=str(error))
        sys.exit(_EXIT_REFUSED if isinstance(error, ContractRefused) else _EXIT_MISCONFIGURED)
    # Until the reactor runs there is nothing to drain: SIGTERM just ends the process
    # (and its group) with the status a drain would have.
    process.on_sigterm(lambda: process.exit(0))
    _die_with_parent()
    if not process.parent_alive():
        # It died before the kernel was asked to say so.
        log.warn("parent process {pid} is gone; exiting", pid=process.parent)
        process.exit(1)
    # Made once logging goes to the log, so that an engine that cannot start says why
    # there, as a worker says everything.
    try:
        engine = factory(spawn.context)
    except Exception:
        log.failure("the engine could not be made")
        process.exit(1)
    # Each probe runs a program: done here, before the reactor runs, no request waits;
    # and only when the last start's answers no longer hold.
    ffmpeg, formats = probe_ffmpeg(probe_cache_dir(environ))
    _memory.probe_cpu()
    # Access lines are logged at info; at a stricter level none is even formatted.
    access_log = level in (LogLevel.debug, LogLevel.info)
    react(
        lambda reactor: Deferred.fromCoroutine(
            _run(reactor, engine, spawn, process, ffmpeg=ffmpeg, formats=formats, access_log=access_log)
        )
    )
