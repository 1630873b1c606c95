"""
How many cores an onnxruntime run may use, shared by every generation of every worker.

The core gives each worker a budget of cores (C{RHAPSODE_WORKER_CORES}, by default the
cores this process may run on) and a folder of lock files (C{RHAPSODE_WORKER_CORE_DIR})
that every worker of one core shares.  A core is a token: lock file C{core-I} held with
C{flock}.  Each onnxruntime run takes tokens before it starts and gives them back when it
ends, so that the threads running at once, across all workers, never outnumber the
cores: a run alone takes them all, and a run that finds some taken takes one (and waits
for one when none is free, then takes one).  The one exception: a run that finds every
core held by a wide run of its own worker is lent a thread beside it rather than wait
for that whole run (L{CoreGate.acquire}).  A lock held by a process that dies is let go by the kernel,
so a crashed worker never keeps a core.

Requests that arrive together.  The worker's scheduler says how many generations it has
running or queued to run (L{set_demand}); with more than one, even the first run takes
one core, so two requests arriving at once run a thread each from the start.  When the
first has already taken every core (they reach the worker milliseconds apart), the
second stops it if it is younger than L{CUT_SECONDS} (onnxruntime's C{terminate} run
option) and it runs again on one core beside the second, rather than the second being
lent a third thread.  Four ~400-character Kokoro requests at once on 2 cores: first
bytes 1.78, 1.89, 3.24, 3.41 s with the lent thread, 1.34-1.46, 1.36-1.48, 2.75-2.93,
2.77-2.96 s this way.

onnxruntime cannot change a session's thread count per run, and its global thread pool
is shared by every run of a process, so L{BudgetedSession} builds the same graph twice:
one session with as many intra-op threads as the budget, one with a single thread, and
each run goes to the one its tokens pay for.  Measured on 2 cores with Kokoro (an
87-character segment, 5.3 s of audio; three rounds each, the box shared with other
work): alone, 2 threads 2.3-2.6 s against 1 thread 4.0-4.2 s; two at once, two
one-thread sessions 4.0-4.9 s for both, one two-thread session 5.4-5.7 s (its runs meet
at every operator), a two-thread and a one-thread run 5.7-7.9 s (three threads on two
cores).  The price is the second session's memory (about 150 MiB for Kokoro), stated
in docs/configuration.md.  Threads spin only inside a run of the whole budget, and stop
when it ends (L{session_options}): an idle spinning thread of one worker would take the
core another worker's run was given, but inside a run that holds every core it only
saves the wake-up between operators (Piper's ~2000-character text, best of six
interleaved rounds in one process: 5.77 s with spinning against 6.05 s without;
Kokoro's 200 characters 4.58 against 4.76 s).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Mapping, Sequence

from rhapsode_protocol.spawn import CORE_DIR_VARIABLE, CORES_VARIABLE, machine_cores

from ._folders import cache_home

ONNX_CACHE_VARIABLE = "RHAPSODE_WORKER_ONNX_CACHE"

#: How often a run that found every core taken by another worker looks again; a run
#: lasts tenths of a second to seconds, so the wait adds at most a few percent.
_POLL_SECONDS = 0.01
#: How young a wide run of this process may be for a newcomer to stop it (L{CoreGate.acquire}):
#: requests that arrive together reach the gate milliseconds apart, and the work thrown
#: away is at most this long on every core.
CUT_SECONDS = 0.1


def core_budget(environ: Mapping[str, str]) -> int:
    """
    The cores this worker's runs may use at once: C{RHAPSODE_WORKER_CORES}, else the
    machine's (L{machine_cores}).

    @raise ValueError: if the variable is set to anything but a positive integer.
    """
    raw = environ.get(CORES_VARIABLE, "").strip()
    if not raw:
        return machine_cores()
    if not (raw.isascii() and raw.isdigit() and int(raw) >= 1):
        raise ValueError(f"{CORES_VARIABLE} must be a positive integer, not {raw!r}")
    return int(raw)


@dataclass
class Lease:
    """
    Cores a run holds; L{CoreGate.release} gives them back.

    @ivar tokens: the indices of the cores held.
    """

    tokens: list[int]
    _files: dict[int, IO[bytes]] = field(default_factory=dict, repr=False)
    #: A thread lent beside a wide run of this process (L{CoreGate.acquire}), no token.
    borrowed: bool = False
    #: The run options of the run this lease pays for, whose C{terminate} a newcomer may
    #: set while the run is young (L{CoreGate.acquire}); None where it may not.
    options: Any = field(default=None, repr=False)
    #: When the lease was taken (C{time.monotonic}).
    started: float = 0.0
    #: Whether a newcomer stopped this lease's run to share its cores.
    cut: bool = False

    @property
    def count(self) -> int:
        return len(self.tokens) or int(self.borrowed)


class CoreGate:
    """
    C{cores} tokens shared by this process's threads and, given a C{folder}, by every
    process that uses the same folder with the same number of cores.

    Thread-safe; L{acquire} blocks, so it is called on a synthesis thread, never on the
    reactor.

    @ivar peak: the most tokens this process has held at once.
    @ivar held: the tokens this process holds now.
    """

    def __init__(self, cores: int, folder: Path | None = None) -> None:
        if cores < 1:
            raise ValueError(f"a gate needs at least one core, not {cores}")
        self.cores = cores
        self.folder = folder
        self.peak = 0
        self._mine: set[int] = set()
        self._wide: list[Lease] = []  # leases holding more than one token
        self._borrowed = 0  # leases lent a thread beside a wide one
        self._changed = threading.Condition()
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)

    @property
    def held(self) -> int:
        with self._changed:
            return len(self._mine)

    def acquire(self, want: int, options: Any = None) -> Lease:
        """
        Take at least one token and up to C{want} (capped at the budget), waiting while
        none is free; one only, after a wait.

        C{options} are the onnxruntime run options of the run the lease will pay for:
        given, a newcomer that finds this lease holding every core less than
        L{CUT_SECONDS} after it was taken sets their C{terminate}, and waits for the
        cores rather than run beside it; the stopped run (L{Lease.cut}) is run again
        on one core, beside the newcomer.  Two requests that arrive together so share
        the cores from the start, rather than one holding both and the other lent a
        third thread (measured with Kokoro, two 33-token segments: 1.92 and 2.26 s that
        way, 1.55 and 1.58 s on a core each).
        """
        want = max(1, min(want, self.cores))
        lease = Lease([], options=options)
        with self._changed:
            while True:
                if any(wide.cut for wide in self._wide):
                    # A run stopped for sharing gives its cores back in a moment.
                    want = 1
                    self._changed.wait(_POLL_SECONDS)
                    continue
                # While a thread is lent, a run takes one core, so the loan ends with
                # the wide run it was lent beside.
                self._take(lease, 1 if self._borrowed else want)
                if lease.tokens:
                    break
                young = [
                    wide for wide in self._wide
                    if wide.options is not None and time.monotonic() - wide.started < CUT_SECONDS
                ]
                if young:
                    for wide in young:
                        wide.cut = True
                        wide.options.terminate = True
                    want = 1
                    continue
                if self._wide:
                    # Every core is held, and by a run of this process that holds more
                    # than one: waiting would make a newcomer's first audio wait for
                    # that whole run, so it runs beside it on one thread, lent.  The
                    # box runs one thread more than its cores until the wide run ends
                    # (measured: two runs at once 4.9-5.4 s against 4.0-5.1 s for two
                    # one-thread runs).  Another worker's wide run is not known here,
                    # so across workers the wait stands.
                    lease.borrowed = True
                    self._borrowed += 1
                    break
                # A run that had to wait has company: it takes one core, so that the
                # run it waited for, back for its next turn, finds the other one free
                # and the two go on side by side, a thread each, rather than taking
                # turns with every core.
                want = 1
                # Another thread of this process notifies; another process cannot, so
                # with a shared folder look again soon.
                self._changed.wait(_POLL_SECONDS if self.folder is not None else None)
            lease.started = time.monotonic()
            if lease.count > 1:
                self._wide.append(lease)
            self.peak = max(self.peak, len(self._mine))
        return lease

    def shrink(self, lease: Lease, keep: int) -> None:
        """
        Give back all but C{keep} of a lease's tokens.
        """
        with self._changed:
            was_wide = len(lease.tokens) > 1
            while len(lease.tokens) > keep:
                self._give(lease, lease.tokens.pop())
            if was_wide and len(lease.tokens) <= 1:
                self._wide.remove(lease)
            if lease.borrowed and keep == 0:
                lease.borrowed = False
                self._borrowed -= 1
            self._changed.notify_all()

    def release(self, lease: Lease) -> None:
        """
        Give back every token of C{lease}.
        """
        self.shrink(lease, 0)

    def _take(self, lease: Lease, want: int) -> None:
        for index in range(self.cores):
            if lease.count >= want:
                return
            if index in self._mine:
                continue
            if self.folder is not None:
                handle = self._lock(index)
                if handle is None:
                    continue
                lease._files[index] = handle
            self._mine.add(index)
            lease.tokens.append(index)

    def _give(self, lease: Lease, index: int) -> None:
        self._mine.discard(index)
        handle = lease._files.pop(index, None)
        if handle is not None:
            # Closing the only descriptor of the open file lets the lock go.
            handle.close()

    def _lock(self, index: int) -> IO[bytes] | None:
        assert self.folder is not None
        handle = open(self.folder / f"core-{index}", "ab")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            return None
        except BaseException:
            handle.close()
            raise
        return handle


#: How many generations this process's scheduler has running or about to run, at most
#: its concurrency (L{set_demand}); read by L{BudgetedSession.run}.
_demand = 0


def set_demand(generations: int) -> None:
    """
    Tell this process's sessions how many generations are running or queued to run at
    once: with more than one, a run takes one core rather than the whole budget, even
    if it is the first to ask, because the others are about to.
    """
    global _demand
    _demand = generations


_gate_lock = threading.Lock()
_gates: dict[tuple[int, str], CoreGate] = {}


def process_gate(environ: Mapping[str, str] | None = None) -> CoreGate:
    """
    This process's gate for the budget and folder C{environ} names: one per pair, so
    every session of a worker shares it.
    """
    environ = os.environ if environ is None else environ
    cores = core_budget(environ)
    folder = environ.get(CORE_DIR_VARIABLE, "")
    with _gate_lock:
        gate = _gates.get((cores, folder))
        if gate is None:
            gate = _gates[(cores, folder)] = CoreGate(cores, Path(folder) if folder else None)
        return gate


def thread_counts(cores: int) -> tuple[int, ...]:
    """
    The intra-op thread counts a L{BudgetedSession} builds a session for: the whole
    budget, and one for a run that shares the cores.
    """
    return tuple(sorted({1, max(1, cores)}))


def session_threads(counts: Sequence[int], tokens: int) -> int:
    """
    The session a run holding C{tokens} cores runs on: the most threads it pays for.
    """
    return max(n for n in counts if n <= max(1, tokens))


def session_options(threads: int) -> Any:
    """
    onnxruntime options for a session of C{threads} intra-op threads: one inter-op
    thread, sequential execution.

    A session of more than one thread spins its threads between operators while a run
    lasts and stops them when it ends (C{session.force_spinning_stop}): such a run holds
    every core of the budget, so a spinning thread takes a core from no one, and an
    idle session's threads sleep rather than take the cores the next run, perhaps
    another worker's, was given.  A one-thread session has no threads to spin.
    """
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if threads > 1 else "0")
    options.add_session_config_entry("session.force_spinning_stop", "1")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return options


def _cpu_flags() -> str:
    # An optimised graph may be laid out for this CPU's vector units (onnxruntime warns
    # as much when it saves one): a cached graph is only for a CPU with the same flags.
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                if line.startswith(("flags", "Features")):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor()


def optimised_cache_dir(environ: Mapping[str, str]) -> Path | None:
    """
    Where optimised graphs are kept (C{RHAPSODE_WORKER_ONNX_CACHE}, C{off} for nowhere),
    by default C{$XDG_CACHE_HOME/rhapsode/onnx}, else C{~/.cache/rhapsode/onnx}.
    """
    raw = environ.get(ONNX_CACHE_VARIABLE, "").strip()
    if raw == "off":
        return None
    if raw:
        return Path(raw)
    return cache_home(environ) / "onnx"


def optimised_name(model: Path, onnxruntime_version: str, configured: str = "") -> str:
    """
    The cache's file name for C{model} optimised by that onnxruntime on this machine:
    a digest of everything the optimised graph depends on, so a new model file, a new
    onnxruntime, other session settings or another CPU never reuse an old one.
    """
    stat = model.stat()
    key = "\0".join([
        str(model.resolve()), str(stat.st_size), str(stat.st_mtime_ns), onnxruntime_version,
        platform.machine(), _cpu_flags(), configured,
    ])
    return f"{model.stem}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.onnx"


#: Optimised graphs kept of one model: every variant the model file, onnxruntime or the
#: settings have had, the most recently used first.  Two engines of one box may share a
#: model under different settings; older ones are what upgrades leave behind.
KEEP_OPTIMISED = 3
#: A half-written graph this old is a crashed writer's, not one being written.
_PARTIAL_SECONDS = 3600


def prune_optimised(cache: Path, stem: str, keep: int = KEEP_OPTIMISED) -> list[Path]:
    """
    Delete all but the C{keep} most recently used optimised graphs of the model named
    C{stem} in C{cache}, and its half-written graphs older than an hour; what was deleted.

    Every optimised graph of a model is as large as the model, and each new onnxruntime
    or model file makes a new one, so without this the cache grows with every upgrade.
    """
    graph = re.compile(re.escape(stem) + r"-[0-9a-f]{24}\.onnx")
    partial = re.compile(r"\." + re.escape(stem) + r"-[0-9a-f]{24}\.onnx\.\d+\.\d+")
    graphs: list[tuple[float, Path]] = []
    deleted: list[Path] = []
    now = time.time()
    try:
        entries = list(cache.iterdir())
    except OSError:
        return deleted
    for path in entries:
        try:
            mtime = path.stat().st_mtime
        except OSError:
            continue
        if graph.fullmatch(path.name):
            graphs.append((mtime, path))
        elif partial.fullmatch(path.name) and now - mtime > _PARTIAL_SECONDS:
            deleted.append(path)
    graphs.sort(reverse=True)
    deleted.extend(path for _, path in graphs[keep:])
    for path in list(deleted):
        try:
            path.unlink()
        except OSError:
            deleted.remove(path)
    return deleted


class BudgetedSession:
    """
    An onnxruntime CPU session that runs on as many threads as the core budget has free.

    It answers what a library asks of an C{onnxruntime.InferenceSession} (C{run},
    C{get_inputs}, C{get_outputs} and the rest), so an adapter hands it to a library in
    place of one.  C{configure(options, whole)} adjusts each session's options (an arena
    setting, say); C{whole} is true for the session that runs a run holding the whole
    budget (the only session when the budget is one core), false for the one-thread
    session of runs that share the cores.  C{run_config} are run configuration entries
    (C{RunOptions.add_run_config_entry}) for every C{run} given no options of its own, or
    a callable that gives them for the run about to start, on the thread that runs it
    (an adapter's say of which runs end its request); each such run gets options of its
    own, so that a run holding every core can be stopped and run again on one when
    another arrives (L{CoreGate.acquire}).  C{run} blocks until a core is free.

    The load.  onnxruntime spends most of a session's making on optimising the graph
    (Piper's voice: 0.45 s of a 0.55 s session, 0.10 s from a graph optimised before),
    so the first load saves the optimised graph in a cache (L{optimised_cache_dir}) and
    every session after reads that with optimisation off.  A cached graph that will not
    load is deleted and the model optimised afresh.

    Memory.  Each session holds the graph's weights and plans of its own: the one-thread
    session cost a Piper voice 91 MiB more and Kokoro 139 MiB.  So only the widest is
    made with the load; the one-thread session is made (from the optimised graph) when a
    run first needs it, which a worker alone on its cores, one request at a time, never
    does.  That run waits for the making, about a tenth of a second for Piper's voice.

    @ivar runs: how many runs each thread count has served.
    @ivar cut: how many runs were stopped for a newcomer and run again on one core.
    @ivar optimised: the optimised graph the sessions were made from, or None.
    @ivar counts: the thread counts a run may get, a session each (made when first run).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        gate: CoreGate | None = None,
        configure: Callable[[Any, bool], None] | None = None,
        run_config: Mapping[str, str] | Callable[[], Mapping[str, str]] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        environ = os.environ if environ is None else environ
        self.gate = process_gate(environ) if gate is None else gate
        self.run_config = run_config if callable(run_config) else dict(run_config or {})
        self.cut = 0
        self._configure = configure
        self._sessions: dict[int, Any] = {}
        self.optimised: Path | None = None
        counts = thread_counts(self.gate.cores)
        self._widest = max(counts)
        cache = optimised_cache_dir(environ)
        self._model = Path(path)
        if cache is not None:
            self.optimised = self._cached(self._model, cache, self._widest)
        if self._widest not in self._sessions:
            self._sessions[self._widest] = self._make(self._model, self._widest)
        self.runs: dict[int, int] = {threads: 0 for threads in counts}
        self.counts = tuple(sorted(counts))
        self._counting = threading.Lock()
        self._making = threading.Lock()

    def _options(self, threads: int) -> Any:
        options = session_options(threads)
        if self._configure is not None:
            self._configure(options, threads == self._widest)
        return options

    def _make(self, model: Path, threads: int) -> Any:
        import onnxruntime

        options = self._options(threads)
        if self.optimised is not None:
            model = self.optimised
            options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
        return onnxruntime.InferenceSession(
            os.fspath(model), sess_options=options, providers=["CPUExecutionProvider"]
        )

    def _cached(self, model: Path, cache: Path, threads: int) -> Path | None:
        """
        The optimised graph of C{model}, made (with the session of C{threads} threads)
        if the cache has none; None if it can be neither read nor written.
        """
        import onnxruntime

        probe = self._options(threads)
        configured = repr(sorted(
            (name, str(getattr(probe, name))) for name in ("enable_cpu_mem_arena", "enable_mem_pattern")
        ))
        target = cache / optimised_name(model, onnxruntime.__version__, configured)
        if target.is_file():
            self.optimised = target
            try:
                self._sessions[threads] = self._make(model, threads)
                # Used now: the cache keeps the graphs used last (L{prune_optimised}).
                with contextlib.suppress(OSError):
                    os.utime(target)
                return target
            except Exception:
                # Truncated, or from a build that lied about itself: make it again.
                self.optimised = None
                target.unlink(missing_ok=True)
        try:
            cache.mkdir(parents=True, exist_ok=True)
            partial = cache / f".{target.name}.{os.getpid()}.{threading.get_ident()}"
        except OSError:
            return None
        options = self._options(threads)
        options.optimized_model_filepath = os.fspath(partial)
        try:
            session = onnxruntime.InferenceSession(
                os.fspath(model), sess_options=options, providers=["CPUExecutionProvider"]
            )
            # Whole or not at all: another worker may be reading the same name.
            os.replace(partial, target)
            prune_optimised(cache, model.stem)
        except Exception:
            # A cache that cannot be written, or a model that will not load: without
            # the cache, where a bad model fails with onnxruntime's own words.
            partial.unlink(missing_ok=True)
            return None
        self._sessions[threads] = session
        return target

    @property
    def sessions(self) -> Mapping[int, Any]:
        """
        The sessions made so far, by intra-op thread count.
        """
        return self._sessions

    def _session(self, threads: int) -> Any:
        """
        The session of C{threads} threads, made now if no run has needed it before.
        """
        session = self._sessions.get(threads)
        if session is None:
            with self._making:
                session = self._sessions.get(threads)
                if session is None:
                    session = self._sessions[threads] = self._make(self._model, threads)
        return session

    def run(
        self,
        output_names: Sequence[str] | None,
        input_feed: Mapping[str, Any],
        run_options: Any = None,
    ) -> Any:
        # Runs about to start beside this one would otherwise find it holding every core.
        want = max(self.counts) if _demand <= 1 else 1
        while True:
            options = run_options if run_options is not None else self._run_options()
            lease = self.gate.acquire(want, None if run_options is not None else options)
            try:
                threads = session_threads(self.counts, lease.count)
                self.gate.shrink(lease, threads)
                with self._counting:
                    self.runs[threads] += 1
                return self._session(threads).run(output_names, input_feed, options)
            except Exception:
                if not lease.cut:
                    raise
                # Stopped by a newcomer (its terminate flag): again, on one core.
                with self._counting:
                    self.cut += 1
                want = 1
            finally:
                self.gate.release(lease)

    def _run_options(self) -> Any:
        import onnxruntime

        options = onnxruntime.RunOptions()
        entries = self.run_config() if callable(self.run_config) else self.run_config
        for key, value in entries.items():
            options.add_run_config_entry(key, value)
        return options

    def __getattr__(self, name: str) -> Any:
        # get_inputs, get_outputs, get_modelmeta, even _model_path (kokoro-onnx reads
        # it): the same graph in every session.  Not this object's own state, which a
        # lookup during __init__ would otherwise chase forever.
        if name.startswith("__") or name in ("_sessions", "counts", "_widest"):
            raise AttributeError(name)
        return getattr(self._sessions[self._widest], name)
