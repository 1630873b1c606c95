"""
L{WorkerSupervisor}: one engine's local worker process, spawned, watched and stopped
(protocol.md sections 2 and 3).

The core's half of the spawn contract: the environment a worker starts with, the one
handshake line it answers with on stdout, its stderr JSON log lines forwarded into the
core's log, restarts with a growing backoff after a crash, and the stop sequence (the
terminate verb or SIGTERM, then SIGKILL after a grace period), sent to the worker's
process group so that an adapter's own child processes go with it.

The lifecycle is the transition table L{WorkerSupervisor._TRANSITIONS}.  Each state is a
small class holding its own process, timers and waiting Deferreds.  Automat's typed
machines build a state's data from the input's arguments alone, and here nearly every
transition carries the process and the waiting Deferreds from one state into the next,
so a table of C{(state, input) -> handler} functions is the more explicit way to write it.
"""

from __future__ import annotations

import json
import os
import signal
from collections import deque
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, ClassVar, Coroutine, Iterable, Mapping, Protocol, Union

from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.error import ProcessExitedAlready
from twisted.internet.interfaces import IDelayedCall, IReactorProcess, IReactorTime
from twisted.internet.protocol import ProcessProtocol
from twisted.logger import InvalidLogLevelError, Logger, LogLevel
from twisted.python.failure import Failure
from zope.interface import implementer

from rhapsode_protocol.errors import Internal, ModelUnavailable, SpeechError
from rhapsode_protocol.spawn import (
    CONTRACT_VARIABLE,
    CORE_DIR_VARIABLE,
    CORES_VARIABLE,
    DEVICE_VARIABLE,
    ENGINE_VARIABLE,
    LISTEN_VARIABLE,
    VOICE_DIR_VARIABLE,
    machine_cores,
)

from .._interfaces import ISupervisor

# The child makes itself a process-group leader and then becomes the worker (same pid),
# because spawnProcess has no pre-exec hook.
LEADER = "import os, sys; os.setpgrp(); os.execvp(sys.argv[1], sys.argv[1:])"

BACKOFF_BASE_SECONDS = 1.0
# An error message carries the last of the worker's stderr: these many lines, at most
# these many characters.
TAIL_LINES = 40
TAIL_CHARACTERS = 2048
# A stderr "line" that never ends (a progress bar redrawn with \r) is cut at this length.
MAX_LINE_BYTES = 65536
#: How long after a worker is reaped its stdout and stderr may stay open: they close as
#: soon as its process group has been swept, unless something outside the group holds
#: them (a helper that started a session of its own).  Until then the worker's last
#: words are still being read; after it, the worker is gone all the same.
PIPE_GRACE_SECONDS = 2.0
#: How long a worker sent SIGKILL may take to be reaped before it is given up on (a
#: process stuck in the kernel): no stop, unload or eviction waits on it longer.
KILL_WAIT_SECONDS = 10.0


def core_budget_env(cores: int | None, socket_dir: Path) -> dict[str, str]:
    """
    What tells a worker the cores it shares (L{rhapsode_worker.onnx.BudgetedSession}): the
    budget (C{None}: the cores this process may run on), and the folder of lock files
    every worker of this core takes cores from, so that two engines synthesising at
    once run no more threads than the budget.
    """
    budget = machine_cores() if cores is None else cores
    return {CORES_VARIABLE: str(budget), CORE_DIR_VARIABLE: str(socket_dir / "cores")}


def device_env(device: str | None) -> dict[str, str]:
    """
    What gives a worker the device the operator chose (C{engines.<id>.device}): the
    spawn contract's C{RHAPSODE_WORKER_DEVICE}; none, and the worker picks its own.
    """
    return {} if device is None else {DEVICE_VARIABLE: device}


class _Prestartable(Protocol):
    id: str

    @property
    def remote(self) -> bool: ...

    def capabilities(self) -> Coroutine[Any, Any, dict[str, Any]]: ...


_prestart_log = Logger(namespace="rhapsode.prestart")


def prestart(handles: Iterable[_Prestartable]) -> list[Deferred[None]]:
    """
    Start each local engine's worker process and read its capabilities, loading no
    model (protocol.md section 3: a process up is not a model resident), so that a first
    request pays for the model's load alone.  A worker that cannot start is logged and
    left down: the first request for it tries again and says why.
    """
    started: list[Deferred[None]] = []
    for handle in handles:
        if handle.remote:
            continue

        def up(_: object, engine: str = handle.id) -> None:
            _prestart_log.info("prestarted {engine}'s worker", engine=engine)

        def failed(reason: Failure, engine: str = handle.id) -> None:
            _prestart_log.warn(
                "could not prestart {engine}'s worker: {why}",
                engine=engine, why=reason.getErrorMessage(),
            )

        started.append(Deferred.fromCoroutine(handle.capabilities()).addCallbacks(up, failed))
    return started


# -- the worker process, as the core sees it --------------------------------------------------


class _Lines:
    """
    Bytes in, whole lines out, however the reads split them.
    """

    def __init__(self, deliver: Callable[[str], None]) -> None:
        self.deliver = deliver
        self._pending = b""

    def feed(self, data: bytes) -> None:
        *lines, self._pending = (self._pending + data).split(b"\n")
        for line in lines:
            self.deliver(line.rstrip(b"\r").decode("utf-8", "replace"))
        if len(self._pending) > MAX_LINE_BYTES:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            line, self._pending = self._pending, b""
            self.deliver(line.rstrip(b"\r").decode("utf-8", "replace"))


def _record(line: str) -> dict[str, Any] | None:
    """
    The SDK's JSON log record on this line, or None for anything else.
    """
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        # Past the parser's recursion (a library printing a deep structure) is text too:
        # an exception here would escape to the reactor, which drops the pipe it read.
        return None
    if isinstance(record, dict) and "message" in record:
        return record
    return None


def _level(name: object) -> LogLevel:
    try:
        return LogLevel.levelWithName(str(name))
    except InvalidLogLevelError:
        return LogLevel.info


def _describe(reason: Failure) -> str:
    number = getattr(reason.value, "signal", None)
    if number is not None:
        try:
            return f"killed by {signal.Signals(number).name}"
        except ValueError:
            return f"killed by signal {number}"
    return f"exit code {getattr(reason.value, 'exitCode', None)}"


class _Child(ProcessProtocol):
    """
    One spawned worker process: its first stdout line is the handshake, its stderr lines
    are forwarded into the log and the last of them kept for error messages.

    It is gone once it has been reaped, whatever holds its pipes: its exit is told when
    the pipes close, which is at once for a worker whose process group has been swept,
    or L{PIPE_GRACE_SECONDS} after the reaping where something outside the group holds
    them; that something is then told (C{on_stray}, with the pids holding them) and the
    pipes are closed on this side.

    @ivar pid: the process id, which is also its process group's id; kept after the
        process is reaped so the group can still be swept.
    """

    pid: int

    def __init__(
        self,
        engine: str,
        log: Logger,
        on_handshake: Callable[[str], None],
        on_exit: Callable[[str], None],
        sweep: Callable[[int], None],
        relay: Callable[[str], None] = lambda line: None,
        *,
        call_later: Callable[..., IDelayedCall] | None = None,
        on_stray: Callable[[list[int]], None] = lambda pids: None,
        holders: Callable[[list[int]], list[int]] | None = None,
    ) -> None:
        self.engine = engine
        self._relay = relay
        self._log = log
        self._on_handshake = on_handshake
        self._on_exit = on_exit
        self._sweep = sweep
        self._call_later = call_later
        self._on_stray = on_stray
        self._holders = holders or pipe_holders
        self._stdout = _Lines(self._handshake_line)
        self._stderr = _Lines(self._stderr_line)
        self._tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._exited: Failure | None = None
        self._told = False
        self._grace: IDelayedCall | None = None
        #: The SIGKILL's deadline (L{KILL_WAIT_SECONDS}), while one is pending.
        self.kill_wait: IDelayedCall | None = None

    def connectionMade(self) -> None:
        assert self.transport is not None  # spawnProcess connects it
        self.pid = self.transport.pid

    def outReceived(self, data: bytes) -> None:
        self._stdout.feed(data)

    def errReceived(self, data: bytes) -> None:
        self._stderr.feed(data)

    def processExited(self, reason: Failure) -> None:
        # Reaped.  Anything left in the group (an adapter's child) would hold the stdout
        # and stderr pipes open, and processEnded waits for those to close.
        self._exited = reason
        if self.kill_wait is not None and self.kill_wait.active():
            self.kill_wait.cancel()
        self._sweep(self.pid)
        if self._call_later is not None and not self._told:
            self._grace = self._call_later(PIPE_GRACE_SECONDS, self._pipes_held)

    def processEnded(self, reason: Failure) -> None:
        if self._grace is not None and self._grace.active():
            self._grace.cancel()
        self._tell(self._exited or reason)

    def abandon(self) -> None:
        """
        The supervisor has given up waiting for this process: nothing it does from now
        on is told.
        """
        self._told = True
        if self._grace is not None and self._grace.active():
            self._grace.cancel()

    def _tell(self, reason: Failure) -> None:
        if self._told:
            return
        self._told = True
        self._stdout.flush()
        self._stderr.flush()
        self._on_exit(_describe(reason))

    def _pipes_held(self) -> None:
        """
        Reaped, its group swept, and its pipes still open: a process outside the group
        holds them.  It is named, the pipes are closed on this side, and the worker is
        gone.
        """
        self._grace = None
        transport = self.transport
        inodes = _pipe_inodes(transport)
        try:
            strays = self._holders(inodes) if inodes else []
        except Exception:
            strays = []
        self._on_stray(strays)
        if self._exited is not None:
            self._tell(self._exited)
        for fd in (1, 2):
            try:
                transport.closeChildFD(fd)  # type: ignore[union-attr]
            except Exception:
                pass  # closed already

    def tail(self) -> str:
        """
        The last of what the worker wrote on stderr, as readable text.
        """
        text = "\n".join(self._tail)[-TAIL_CHARACTERS:]
        return text or "(nothing on stderr)"

    def _handshake_line(self, line: str) -> None:
        self._stdout.deliver = self._stdout_line
        self._on_handshake(line)

    def _stdout_line(self, line: str) -> None:
        self._log.info("[{engine}] {line}", engine=self.engine, line=line, stream="stdout")

    def _stderr_line(self, line: str) -> None:
        if not line.strip():
            return
        record = _record(line)
        if record is None:
            self._log.info("[{engine}] {line}", engine=self.engine, line=line, stream="stderr")
            self._tail.append(line)
            self._relay(line)
            return
        message = str(record["message"])
        traceback = record.get("traceback")
        namespace = str(record.get("namespace") or self._log.namespace)
        fields: dict[str, Any] = {"engine": self.engine, "message": message}
        text = "[{engine}] {message}"
        if traceback:
            fields["traceback"] = str(traceback)
            text += "\n{traceback}"
            message += "\n" + str(traceback)
        Logger(namespace=namespace).emit(_level(record.get("level")), text, **fields)
        self._tail.append(message)
        self._relay(message)


def _pipe_inodes(transport: Any) -> list[int]:
    """
    The inodes of the pipes a process transport reads the child's stdout and stderr
    from, while they are open.
    """
    inodes = []
    for fd in (1, 2):
        reader = getattr(transport, "pipes", {}).get(fd)
        if reader is None:
            continue
        try:
            inodes.append(os.fstat(reader.fileno()).st_ino)
        except (AttributeError, OSError, ValueError):
            continue
    return inodes


def pipe_holders(inodes: list[int]) -> list[int]:
    """
    The processes, other than this one, holding a pipe of C{inodes} open (from
    /proc, on Linux; none where there is no /proc).
    """
    wanted = {f"pipe:[{inode}]" for inode in inodes}
    found = []
    own = os.getpid()
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []
    for pid in pids:
        if pid == own:
            continue
        folder = f"/proc/{pid}/fd"
        try:
            links = [os.readlink(f"{folder}/{fd}") for fd in os.listdir(folder)]
        except OSError:
            continue  # gone, or not ours to read
        if wanted.intersection(links):
            found.append(pid)
    return sorted(found)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _iso(seconds: float) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_handshake(line: str) -> tuple[int, str] | None:
    """
    The contract and listen address of a handshake line, or None if it is not one.
    """
    try:
        doc = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or doc.get("ready") is not True:
        return None
    contract, listen = doc.get("contract"), doc.get("listen")
    if isinstance(contract, bool) or not isinstance(contract, int):
        return None
    if not isinstance(listen, str) or not listen.startswith(("unix:", "tcp:")):
        return None
    return contract, listen


# -- the states ---------------------------------------------------------------------------


@dataclass
class _Down:
    """
    No process, nothing scheduled.
    """

    name: ClassVar[str] = "down"


@dataclass
class _Starting:
    """
    Spawned, waiting for the handshake line until C{timeout} fires.
    """

    name: ClassVar[str] = "starting"
    child: _Child
    timeout: IDelayedCall
    waiters: list[Deferred[str]]


@dataclass
class _Up:
    """
    Hand-shaken and serving on C{listen}.
    """

    name: ClassVar[str] = "up"
    child: _Child
    listen: str


@dataclass
class _Backoff:
    """
    Crashed; C{timer} spawns it again.  Reported as starting: a start() waits for it.
    """

    name: ClassVar[str] = "starting"
    timer: IDelayedCall
    waiters: list[Deferred[str]]


@dataclass
class _Draining:
    """
    Asked to stop, by the terminate verb or SIGTERM; C{grace} ends in SIGKILL.
    C{starters} were asked for while stopping, and start it afresh once it has exited.
    """

    name: ClassVar[str] = "draining"
    child: _Child
    grace: IDelayedCall
    stoppers: list[Deferred[None]]
    starters: list[Deferred[str]]


@dataclass
class _Aborting:
    """
    Killed because its start ran out of time; the exit counts as a crash.
    """

    name: ClassVar[str] = "draining"
    child: _Child
    error: str
    stoppers: list[Deferred[None]]


@dataclass
class _Hung(_Aborting):
    """
    Killed for not answering while up; the exit is a crash (restarted) and takes its
    model with it.
    """


@dataclass
class _Refusing(_Aborting):
    """
    Killed for a handshake the core cannot accept; the exit leaves it failed, not
    restarted, because a worker answers the same way every time.
    """


@dataclass
class _Failed:
    """
    Given up on: C{error} is what every start() is told until a stop(), as C{kind}.
    """

    name: ClassVar[str] = "failed"
    error: str
    kind: type[SpeechError] = ModelUnavailable


_State = Union[_Down, _Starting, _Up, _Backoff, _Draining, _Aborting, _Hung, _Failed]
_WITH_PROCESS = (_Starting, _Up, _Draining, _Aborting)
# The terminate verb may answer after its worker has exited and the state has moved on,
# and a watchdog may find a worker hung that has since gone.
_LATE_INPUTS = frozenset({"verb", "hung", "kill_timeout"})


@implementer(ISupervisor)
class WorkerSupervisor:
    """
    Spawns one engine's worker, restarts it when it crashes, and stops it.

    Times are in seconds.  C{listen} is offered to the worker as
    C{RHAPSODE_WORKER_LISTEN}; the worker's voices live in C{voice_dir/engine_id}.
    C{env} (the engine's configured environment) goes over the inherited one and
    under the contract's variables.  C{terminate} asks a worker at a listen address to
    drain and exit, answering whether the verb landed; C{kill} signals a process group.

    @ivar last_error: the latest failure to start or crash, with the worker's stderr.
    """

    log = Logger()

    def __init__(
        self,
        engine_id: str,
        *,
        reactor: IReactorProcess,
        python: str,
        module: str,
        listen: str,
        voice_dir: str,
        env: Mapping[str, str],
        contract: int,
        startup_timeout: float,
        drain_grace: float,
        max_restarts: int,
        restart_decay: float,
        terminate: Callable[[str], Deferred[bool]],
        backoff_cap: float = 30.0,
        kill: Callable[[int, int], None] = os.killpg,
        on_crash: Callable[[], object] = lambda: None,
        holders: Callable[[list[int]], list[int]] = pipe_holders,
    ) -> None:
        self.engine_id = engine_id
        self._holders = holders
        #: Processes that outlived a worker's process group holding its pipes, and when
        #: they were found: reported until they exit.
        self._strays: dict[int, float] = {}
        self._on_crash = on_crash
        self.last_error: str | None = None
        self._reactor = reactor
        self._clock = IReactorTime(reactor)
        self._python = python
        self._module = module
        self._argv = [python, "-c", LEADER, python, "-m", module]
        self._env = {
            **os.environ,
            **env,
            LISTEN_VARIABLE: listen,
            ENGINE_VARIABLE: engine_id,
            CONTRACT_VARIABLE: str(contract),
            VOICE_DIR_VARIABLE: os.path.join(voice_dir, engine_id),
            "PYTHONUNBUFFERED": "1",
        }
        self._contract = contract
        self._startup_timeout = startup_timeout
        self._drain_grace = drain_grace
        self._max_restarts = max_restarts
        self._restart_decay = restart_decay
        self._backoff_cap = backoff_cap
        self._terminate = terminate
        self._kill = kill
        self._crashes: deque[float] = deque()
        self._state: _State = _Down()
        self._inbox: deque[tuple[str, tuple[Any, ...]]] = deque()
        self._outbox: list[Callable[[], object]] = []
        self._dispatching = False
        #: Told each line the worker writes on stderr (an install job following a fetch).
        self.listeners: list[Callable[[str], None]] = []

    # -- what callers see ---------------------------------------------------------------

    @property
    def state(self) -> str:
        """
        down, starting, up, draining or failed.
        """
        return self._state.name

    @property
    def listen(self) -> str | None:
        """
        The address from the handshake, while up.
        """
        return self._state.listen if isinstance(self._state, _Up) else None

    @property
    def pid(self) -> int | None:
        return self._state.child.pid if isinstance(self._state, _WITH_PROCESS) else None

    @property
    def restarts(self) -> int:
        """
        Crashes (restarts) within the last C{restart_decay} seconds.
        """
        since = self._clock.seconds() - self._restart_decay
        return sum(1 for when in self._crashes if when > since)

    def start(self) -> Deferred[str]:
        """
        The worker's listen address once it is up.

        Fails with L{ModelUnavailable} (retryable) when this start does: the worker
        exited before its handshake, ran out of time, was refused, was stopped first, or
        the supervisor has given up on it.
        """
        waiter: Deferred[str] = Deferred()
        self._feed("start", waiter)
        return waiter

    def stop(self, ask: bool = True) -> Deferred[None]:
        """
        Stop the worker; fires once its process has exited.

        With C{ask}, a worker that is up is sent the terminate verb and signalled only
        if the verb did not land; without it (shutdown), it is sent SIGTERM at once.
        Either way SIGKILL follows C{drain_grace} later if it has not exited.
        """
        waiter: Deferred[None] = Deferred()
        self._feed("stop", ask, waiter)
        return waiter

    def hung(self, why: str) -> None:
        """
        The worker has stopped answering (a watchdog's finding): kill it, so its
        streams end, its model is forgotten and the next start runs a new one.
        """
        self._feed("hung", why)

    def health(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"process": self.state, "restarts": self.restarts}
        if self.pid is not None:
            doc["pid"] = self.pid
        if self.last_error is not None:
            doc["lastError"] = self.last_error
        for pid in [pid for pid in self._strays if not _alive(pid)]:
            del self._strays[pid]
        if self._strays:
            doc["strays"] = [
                {"pid": pid, "since": _iso(since)} for pid, since in sorted(self._strays.items())
            ]
        return doc

    # -- the machine ----------------------------------------------------------------------

    def _feed(self, name: str, *args: Any) -> None:
        """
        Run one input through the table.  An input arriving while another is being
        handled (a waiter's callback calling start(), a verb answered at once) waits
        its turn, so every handler sees the state it was written for.
        """
        self._inbox.append((name, args))
        if self._dispatching:
            return
        self._dispatching = True
        try:
            while self._inbox:
                name, args = self._inbox.popleft()
                handler = self._TRANSITIONS.get((type(self._state), name))
                if handler is None:
                    if name in _LATE_INPUTS:
                        continue
                    raise RuntimeError(f"worker {self.engine_id}: no transition for {name} in {self._state}")
                self._state = handler(self, self._state, *args)
                # Waiters hear the outcome once the new state is in place.
                outbox, self._outbox = self._outbox, []
                for notify in outbox:
                    notify()
        finally:
            self._dispatching = False

    def _resolve(self, waiters: list[Deferred[Any]], value: object) -> None:
        self._outbox.extend(partial(d.callback, value) for d in waiters)

    def _reject(
        self, waiters: list[Deferred[Any]], message: str, kind: type[SpeechError] = ModelUnavailable
    ) -> None:
        self._outbox.extend(partial(d.errback, kind(message)) for d in waiters)

    def _report(self, error: str, child: "_Child | None" = None) -> None:
        """
        Log a failure with the worker's last stderr lines, which stay in the log: a
        message a caller reads names no path on this box.
        """
        if child is None:
            self.log.error("{error}", engine=self.engine_id, error=error)
        else:
            self.log.error("{error}; the worker's last words:\n{tail}", engine=self.engine_id, error=error,
                           tail=child.tail())

    # -- doing things -----------------------------------------------------------------------

    def _spawn(self, waiters: list[Deferred[str]]) -> _State:
        child = _Child(
            self.engine_id,
            self.log,
            on_handshake=lambda line: self._feed("handshake", line),
            on_exit=lambda how: self._feed("exited", how),
            sweep=self._sweep,
            relay=self._relay,
            call_later=self._clock.callLater,
            on_stray=self._stray,
            holders=self._holders,
        )
        self.log.info("starting worker {engine}: {module}", engine=self.engine_id, module=self._module)
        try:
            self._reactor.spawnProcess(child, self._python, self._argv, env=self._env)
        except OSError as error:
            # The interpreter is named in the log, never in the message a caller reads.
            self.log.error("could not spawn worker {engine} with {python}: {error}", engine=self.engine_id,
                           python=self._python, error=error)
            why = error.strerror or type(error).__name__
            return self._failed_start(waiters, f"could not spawn worker {self.engine_id}: {why}", Internal)
        timeout = self._clock.callLater(self._startup_timeout, self._feed, "startup_timeout")
        return _Starting(child, timeout, waiters)

    def _relay(self, line: str) -> None:
        for listener in list(self.listeners):
            listener(line)

    def _stray(self, pids: list[int]) -> None:
        """
        The worker has been reaped and its group swept, yet its stdout and stderr stay
        open: processes outside the group (started in a session of their own) hold
        them.  They are left running, for an operator to look at, and reported.
        """
        now = self._clock.seconds()
        for pid in pids:
            self._strays.setdefault(pid, now)
        named = ", ".join(str(pid) for pid in pids) or "a process this server cannot name"
        self.log.warn(
            "worker {engine} has exited, but {named} outside its process group still holds its "
            "stdout or stderr (a process the adapter started in a session of its own); it is left "
            "running and reported in /health",
            engine=self.engine_id, named=named, strays=pids,
        )

    def _failed_start(
        self, waiters: list[Deferred[str]], error: str, kind: type[SpeechError] = ModelUnavailable
    ) -> _State:
        """
        A start that failed: its waiters are told (C{kind}: internal for a worker that
        cannot run, retryable where another try may do better), and it counts as a crash.
        """
        self._reject(waiters, error, kind)
        return self._crashed(error, kind)

    def _crashed(self, error: str, kind: type[SpeechError] = ModelUnavailable) -> _State:
        """
        Count a crash against the window and restart after a backoff, or give up.
        """
        now = self._clock.seconds()
        while self._crashes and self._crashes[0] <= now - self._restart_decay:
            self._crashes.popleft()
        self._crashes.append(now)
        self.last_error = error
        count = len(self._crashes)
        if count > self._max_restarts:
            message = (
                f"worker {self.engine_id} failed {count} times within "
                f"{self._restart_decay:g} s and is not restarted; the last: {error}"
            )
            self.log.error("{message}", engine=self.engine_id, message=message)
            return _Failed(message, kind)
        delay = min(self._backoff_cap, BACKOFF_BASE_SECONDS * 2 ** (count - 1))
        self.log.warn(
            "{error}; restart {count} in {delay:g} s",
            engine=self.engine_id,
            error=error,
            count=count,
            delay=delay,
        )
        return _Backoff(self._clock.callLater(delay, self._feed, "respawn"), [])

    def _drain(self, child: _Child, ask_at: str | None, stoppers: list[Deferred[None]]) -> _Draining:
        """
        Begin stopping: the verb to C{ask_at}, or SIGTERM when there is no address to ask.
        """
        grace = self._clock.callLater(self._drain_grace, self._feed, "grace_over")
        state = _Draining(child, grace, stoppers, [])
        if ask_at is None:
            self._signal(child, signal.SIGTERM)
            return state
        self.log.info("asking worker {engine} to terminate", engine=self.engine_id)

        def failed(reason: Failure) -> bool:
            self.log.info(
                "terminate verb to worker {engine} failed: {error}",
                engine=self.engine_id,
                error=reason.getErrorMessage(),
            )
            return False

        # The answer names the stop it belongs to: it may come after this process has
        # exited and another has been started and is being stopped in turn.
        maybeDeferred(self._terminate, ask_at).addErrback(failed).addCallback(
            lambda landed: self._feed("verb", state, bool(landed))
        )
        return state

    def _signal(self, child: _Child, number: signal.Signals) -> None:
        level = LogLevel.warn if number == signal.SIGKILL else LogLevel.info
        self.log.emit(level, "sending {signal} to worker {engine}", signal=number.name, engine=self.engine_id)
        if number == signal.SIGKILL and child.kill_wait is None:
            # No wait on a process is without end, not even on one SIGKILL has not ended.
            child.kill_wait = self._clock.callLater(KILL_WAIT_SECONDS, self._feed, "kill_timeout", child)
        try:
            self._kill(child.pid, number)
        except OSError:
            # Not its own group leader yet (the wrapper does that first thing), or the
            # group is gone: signal the process itself, which Twisted knows has exited.
            try:
                if child.transport is not None:
                    child.transport.signalProcess(int(number))
            except ProcessExitedAlready:
                pass

    def _sweep(self, pid: int) -> None:
        try:
            self._kill(pid, signal.SIGKILL)
        except OSError:
            pass

    def _ignore(self, state: _State, *args: Any) -> _State:
        return state

    def _kill_timeout(self, state: _Starting | _Up | _Draining | _Aborting, child: _Child) -> _State:
        """
        A worker sent SIGKILL has not been reaped in L{KILL_WAIT_SECONDS}: it is taken
        to have exited, so nothing waits on it any longer, and its late end is not told.
        """
        if state.child is not child:
            return state
        child.abandon()
        how = f"not reaped {KILL_WAIT_SECONDS:g} s after SIGKILL"
        self.log.error("worker {engine} (pid {pid}) was {how}; given up on", engine=self.engine_id,
                       pid=child.pid, how=how)
        return self._TRANSITIONS[(type(state), "exited")](self, state, how)

    # -- down and failed ----------------------------------------------------------------

    def _start_down(self, state: _Down, waiter: Deferred[str]) -> _State:
        return self._spawn([waiter])

    def _stop_idle(self, state: _Down | _Failed, ask: bool, waiter: Deferred[None]) -> _Down:
        self._resolve([waiter], None)
        return _Down()

    def _start_failed(self, state: _Failed, waiter: Deferred[str]) -> _Failed:
        self._reject([waiter], state.error, state.kind)
        return state

    # -- starting -----------------------------------------------------------------------

    def _join_start(self, state: _Starting | _Backoff, waiter: Deferred[str]) -> _State:
        state.waiters.append(waiter)
        return state

    def _handshake(self, state: _Starting, line: str) -> _State:
        state.timeout.cancel()
        parsed = _parse_handshake(line)
        if parsed is None:
            self.log.error("worker {engine} wrote {line!r} on stdout", engine=self.engine_id, line=line[:200])
            return self._refuse(
                state, f"worker {self.engine_id} wrote something other than its handshake on stdout"
            )
        contract, listen = parsed
        if contract > self._contract:
            return self._refuse(
                state,
                f"worker {self.engine_id} answered contract {contract}, "
                f"above this core's contract {self._contract}",
            )
        self.log.info(
            "worker {engine} up on {listen} (pid {pid}, contract {contract})",
            engine=self.engine_id,
            listen=listen,
            pid=state.child.pid,
            contract=contract,
        )
        self._resolve(state.waiters, listen)
        return _Up(state.child, listen)

    def _refuse(self, state: _Starting, error: str) -> _Refusing:
        self._report(error, state.child)
        self.last_error = error
        self._signal(state.child, signal.SIGKILL)
        self._reject(state.waiters, error, Internal)
        return _Refusing(state.child, error, [])

    def _exit_starting(self, state: _Starting, how: str) -> _State:
        state.timeout.cancel()
        error = f"worker {self.engine_id} exited before its handshake ({how}); its stderr is in the server's log"
        self._report(error, state.child)
        # An exit status is the worker's own verdict (an import error, a bad config):
        # it will say the same next time.  A signal came from outside, and may not.
        kind = ModelUnavailable if how.startswith("killed") else Internal
        return self._failed_start(state.waiters, error, kind)

    def _timeout_starting(self, state: _Starting) -> _Aborting:
        error = f"worker {self.engine_id} did not hand-shake within {self._startup_timeout:g} s"
        self._report(error, state.child)
        self._signal(state.child, signal.SIGKILL)
        self._reject(state.waiters, error)
        return _Aborting(state.child, error, [])

    def _stop_starting(self, state: _Starting, ask: bool, waiter: Deferred[None]) -> _Draining:
        state.timeout.cancel()
        self._reject(state.waiters, f"worker {self.engine_id} was stopped before it was up")
        # No handshake means no address to send the verb to.
        return self._drain(state.child, None, [waiter])

    # -- up -------------------------------------------------------------------------------

    def _start_up(self, state: _Up, waiter: Deferred[str]) -> _Up:
        self._resolve([waiter], state.listen)
        return state

    def _stop_up(self, state: _Up, ask: bool, waiter: Deferred[None]) -> _Draining:
        return self._drain(state.child, state.listen if ask else None, [waiter])

    def _exit_up(self, state: _Up, how: str) -> _State:
        # Whatever the worker had loaded went with it: tell whoever counts models.
        self._outbox.append(self._on_crash)
        error = f"worker {self.engine_id} exited unexpectedly ({how}); its stderr is in the server's log"
        self._report(error, state.child)
        return self._crashed(error)

    def _hung_up(self, state: _Up, why: str) -> _State:
        error = f"worker {self.engine_id} {why}, and was killed"
        self._report(error, state.child)
        self.last_error = error
        self._signal(state.child, signal.SIGKILL)
        return _Hung(state.child, error, [])

    # -- backoff ----------------------------------------------------------------------------

    def _respawn(self, state: _Backoff) -> _State:
        return self._spawn(state.waiters)

    def _stop_backoff(self, state: _Backoff, ask: bool, waiter: Deferred[None]) -> _Down:
        state.timer.cancel()
        self._reject(state.waiters, f"worker {self.engine_id} was stopped before it was up")
        self._resolve([waiter], None)
        return _Down()

    # -- draining ---------------------------------------------------------------------------

    def _start_draining(self, state: _Draining, waiter: Deferred[str]) -> _Draining:
        state.starters.append(waiter)
        return state

    def _stop_draining(self, state: _Draining, ask: bool, waiter: Deferred[None]) -> _Draining:
        # The latest word wins: a start asked for before this stop is called off.
        self._reject(state.starters, f"worker {self.engine_id} was stopped before it was up")
        state.starters.clear()
        state.stoppers.append(waiter)
        return state

    def _verb(self, state: _Draining, asked: _Draining, landed: bool) -> _Draining:
        if asked is state and not landed:
            self._signal(state.child, signal.SIGTERM)
        return state

    def _grace_over(self, state: _Draining) -> _Draining:
        self._signal(state.child, signal.SIGKILL)
        return state

    def _exit_draining(self, state: _Draining, how: str) -> _State:
        if state.grace.active():
            state.grace.cancel()
        self.log.info("worker {engine} stopped ({how})", engine=self.engine_id, how=how)
        self._resolve(state.stoppers, None)
        if state.starters:
            return self._spawn(state.starters)
        return _Down()

    # -- aborting and refusing ----------------------------------------------------------------

    def _start_aborting(self, state: _Aborting, waiter: Deferred[str]) -> _Aborting:
        self._reject([waiter], state.error)
        return state

    def _stop_aborting(self, state: _Aborting, ask: bool, waiter: Deferred[None]) -> _Aborting:
        state.stoppers.append(waiter)
        return state

    def _exit_aborting(self, state: _Aborting, how: str) -> _State:
        self._resolve(state.stoppers, None)
        return _Down() if state.stoppers else self._crashed(state.error)

    def _exit_refusing(self, state: _Refusing, how: str) -> _State:
        self._resolve(state.stoppers, None)
        return _Down() if state.stoppers else _Failed(state.error, Internal)

    def _exit_hung(self, state: _Hung, how: str) -> _State:
        self._outbox.append(self._on_crash)
        self._resolve(state.stoppers, None)
        return _Down() if state.stoppers else self._crashed(state.error)

    _TRANSITIONS: ClassVar[dict[tuple[type, str], Callable[..., _State]]] = {
        (_Down, "start"): _start_down,
        (_Down, "stop"): _stop_idle,
        (_Starting, "start"): _join_start,
        (_Starting, "stop"): _stop_starting,
        (_Starting, "handshake"): _handshake,
        (_Starting, "exited"): _exit_starting,
        (_Starting, "startup_timeout"): _timeout_starting,
        (_Up, "start"): _start_up,
        (_Up, "stop"): _stop_up,
        (_Up, "exited"): _exit_up,
        (_Up, "hung"): _hung_up,
        (_Backoff, "start"): _join_start,
        (_Backoff, "stop"): _stop_backoff,
        (_Backoff, "respawn"): _respawn,
        (_Draining, "start"): _start_draining,
        (_Draining, "stop"): _stop_draining,
        (_Draining, "handshake"): _ignore,
        (_Draining, "verb"): _verb,
        (_Draining, "grace_over"): _grace_over,
        (_Draining, "exited"): _exit_draining,
        (_Draining, "kill_timeout"): _kill_timeout,
        (_Starting, "kill_timeout"): _kill_timeout,
        (_Up, "kill_timeout"): _kill_timeout,
        (_Aborting, "kill_timeout"): _kill_timeout,
        (_Hung, "kill_timeout"): _kill_timeout,
        (_Refusing, "kill_timeout"): _kill_timeout,
        (_Aborting, "start"): _start_aborting,
        (_Aborting, "stop"): _stop_aborting,
        (_Aborting, "handshake"): _ignore,
        (_Aborting, "exited"): _exit_aborting,
        (_Hung, "start"): _start_aborting,
        (_Hung, "stop"): _stop_aborting,
        (_Hung, "exited"): _exit_hung,
        (_Hung, "hung"): _ignore,
        (_Refusing, "start"): _start_aborting,
        (_Refusing, "stop"): _stop_aborting,
        (_Refusing, "handshake"): _ignore,
        (_Refusing, "exited"): _exit_refusing,
        (_Failed, "start"): _start_failed,
        (_Failed, "stop"): _stop_idle,
    }
