"""
Installing, reinstalling, uninstalling and pulling engines through the API (protocol.md
section 10, "Installing" to "Pulling weights").

An install is a job of four steps (five with C{?pull=}): a virtualenv under
C{install.venvDir}, the adapter and the SDK pip-installed into it in one resolve, an
import of the engine's module with the new interpreter, and the engine recorded in the
state database and added to the running registry.  Every refusal comes before a job
exists.  Each command runs in a process group of its own whose leader kills the whole
group if the core goes away (L{GROUP_LEADER}), so a cancelled, timed-out or orphaned
install leaves no process behind; the remains of one that did not finish are removed
by the next.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import sys
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol, TypeVar

from twisted.internet.defer import Deferred
from twisted.internet.error import ProcessDone, ProcessTerminated
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.failure import Failure

from rhapsode_protocol.contract import VARIANT_NAME_PATTERN, VOICE_ID_PATTERN
from rhapsode_protocol.errors import BadRequest, Conflict, Internal, UnknownEngine, Unsupported

from .._config import CORE_DISTRIBUTION, source_of
from .._fleet.catalog import SDK_DISTRIBUTION, Catalog
from .jobs import Job, JobContext, JobFailed, Jobs
from .state import InstalledEngine, StateDatabase

_T = TypeVar("_T")

#: The leader of a command's process group.  It makes the group, forks the command
#: (whose stdin is /dev/null), and watches its own stdin, a pipe from the core: when
#: that closes (the core died, or stopped the job) it SIGKILLs the whole group, pip's
#: build backends included.  It exits as the command did, 128 + N for signal N.
GROUP_LEADER = (
    "import os, signal, sys, threading\n"
    "os.setpgrp()\n"
    "pid = os.fork()\n"
    "if pid == 0:\n"
    "    null = os.open(os.devnull, os.O_RDONLY)\n"
    "    os.dup2(null, 0)\n"
    "    try:\n"
    "        os.execvp(sys.argv[1], sys.argv[1:])\n"
    "    except OSError as e:\n"
    "        sys.stderr.write(sys.argv[1] + ': ' + (e.strerror or str(e)) + '\\n')\n"
    "        os._exit(127)\n"
    "def watch():\n"
    "    while os.read(0, 4096):\n"
    "        pass\n"
    "    os.killpg(0, signal.SIGKILL)\n"
    "threading.Thread(target=watch, daemon=True).start()\n"
    "code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])\n"
    "os._exit(code if code >= 0 else 128 - code)\n"
)

#: How long each command may run, and how long it may print nothing.  pip with
#: C{--progress-bar raw} prints while it downloads, so a long silence is a hang.
PACKAGES_SECONDS = 30 * 60
SILENCE_SECONDS = 10 * 60
QUICK_SECONDS = 120
#: After SIGTERM, how long a command's group has before SIGKILL.
KILL_GRACE_SECONDS = 5.0
#: Lines of a command's output kept for the reason it failed.
TAIL_LINES = 500
#: How long a reinstall's register waits for the engine to stop speaking.
REGISTER_WAIT_SECONDS = 600.0

_ENGINE_ID = re.compile(VOICE_ID_PATTERN)
_VARIANT = re.compile(VARIANT_NAME_PATTERN, re.ASCII)

#: What a command inherits of the server's environment: the path, the locale, proxies
#: and certificates, and everything pip and uv read (this machine's local index is a
#: PIP_ variable).  The rest is left out: a virtualenv of the core's, a PYTHONPATH.
_PASSED = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "TMPDIR", "SHELL",
    "http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
})
_PASSED_PREFIXES = ("PIP_", "UV_", "XDG_", "PYENV")


def command_env(environ: Mapping[str, str]) -> dict[str, str]:
    """
    The environment a command runs with, built from the server's (never inherited
    whole: C{VIRTUAL_ENV} or C{PYTHONPATH} would point pip at the core's packages).
    """
    env = {
        key: value
        for key, value in environ.items()
        if key in _PASSED or key.startswith(_PASSED_PREFIXES)
    }
    env.setdefault("PATH", os.defpath)
    env.update({
        "PYTHONUNBUFFERED": "1",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PIP_NO_INPUT": "1",
        "LANG": env.get("LANG") or "C.UTF-8",
    })
    return env


def trusted_hosts(environ: Mapping[str, str]) -> list[str]:
    """
    C{RHAPSODE_PIP_TRUSTED_HOSTS}, from the server's own environment only: weakening
    certificate checks is decided on the box, never through the API.
    """
    raw = environ.get("RHAPSODE_PIP_TRUSTED_HOSTS", "")
    return [host for host in re.split(r"[\s,]+", raw) if host]


# -- why a command failed ---------------------------------------------------------------

_FRAMING = re.compile(
    r"^\s*(?:[×│╰╭─>]|note:|hint:|\[end of output\]|error: subprocess-exited-with-error|"
    r"ERROR: Failed (?:to build|building wheel)|Progress \d+ of \d+)",
)
_CAUSE = re.compile(r"not found|could not|couldn't|cannot|can't|no such|unable to|missing|permission denied",
                    re.I)
_OUTPUT_BEGINS = re.compile(r"^\s*╰─>\s*\[\d+ lines? of output\]")
_OUTPUT_ENDS = re.compile(r"^\s*\[end of output\]")
_BUILDING = re.compile(r"(?:Failed to build|Failed building wheel for)\s+'?([^'\s]+)'?", re.I)
_ARROW = re.compile(r"^\s*╰─>\s*([A-Za-z0-9_.-]+)\s*$")


def _package(name: str) -> str:
    # pip names a local folder by its URL; the folder's name is the package's.
    return name.rstrip("/").rsplit("/", 1)[-1]


def failure_reason(lines: Sequence[str]) -> str:
    """
    The line of a failed command's output that says why, not the one it printed last:
    pip ends with a footer naming the package, and the reason is above it, in the
    output of the build it ran (between C{╰─> [N lines of output]} and C{[end of
    output]}).

    uv's own failures are an C{error:} line and a chain of causes: the error and the
    last cause.  Otherwise, from the build's output when there is one and every line
    but pip's framing when not: a line about a certificate, else the last mentioning
    an error, else the last line; with C{(building X)} when pip names the package
    whose build failed.
    """
    text = [line.strip() for line in lines if line.strip()]
    building = None
    for index, line in enumerate(text):
        found = _BUILDING.search(line)
        if found:
            building = _package(found.group(1))
        arrow = _ARROW.match(line)
        if arrow and index and "failed" in text[index - 1].lower():
            building = arrow.group(1)
    causes = [line for line in text if line.startswith(("Caused by:", "cause:"))]
    errors = [line for line in text if line.startswith("error:") and "subprocess-exited-with-error" not in line]
    if errors and causes:
        return f"{errors[-1]} ({causes[-1]})"
    candidates: list[str] = []
    inside: list[str] | None = None
    for line in lines:
        if _OUTPUT_BEGINS.match(line):
            inside = []
        elif inside is not None and _OUTPUT_ENDS.match(line):
            if any(part.strip() for part in inside):
                candidates = [part.strip() for part in inside if part.strip()]
            inside = None
        elif inside is not None:
            inside.append(line)
    if not candidates:
        candidates = [line for line in text if not _FRAMING.match(line)]
    if not candidates:
        return "it printed nothing"
    reason = None
    for line in reversed(candidates):
        if "certificate" in line.lower():
            reason = line
            break
    if reason is None:
        # A line that names a cause (a compiler CMake could not find) over the one that
        # only says something failed ("Configuring incomplete, errors occurred!").
        for line in reversed(candidates):
            if _CAUSE.search(line):
                reason = line
                break
    if reason is None:
        for line in reversed(candidates):
            if "error" in line.lower():
                reason = line
                break
    if reason is None:
        reason = candidates[-1]
    if building and building not in reason:
        reason += f" (building {building})"
    return reason


# -- running one command ----------------------------------------------------------------


class _Lines:
    """
    Lines of one stream, split at \\n and \\r (a progress bar redraws with \\r).
    """

    def __init__(self, deliver: Callable[[str], None]) -> None:
        self._deliver = deliver
        self._pending = b""

    def feed(self, data: bytes) -> None:
        data = self._pending + data
        parts = re.split(rb"\r\n|\r|\n", data)
        self._pending = parts.pop()
        if len(self._pending) > 65536:
            parts.append(self._pending)
            self._pending = b""
        for part in parts:
            self._deliver(part.decode("utf-8", "replace"))

    def flush(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, b""
            self._deliver(pending.decode("utf-8", "replace"))


class _Command(ProcessProtocol):
    def __init__(self, on_line: Callable[[str], None]) -> None:
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._on_line = on_line
        self._streams = {1: _Lines(self._line), 2: _Lines(self._line)}
        self.ended: Deferred[None] = Deferred()
        self.reason: Failure | None = None
        self.pid: int | None = None
        self.heard: Callable[[], None] = lambda: None

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.pid = self.transport.pid

    def _line(self, line: str) -> None:
        if line.strip():
            self.tail.append(line)
            self._on_line(line)

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        self.heard()
        stream = self._streams.get(childFD)
        if stream is not None:
            stream.feed(data)

    def processExited(self, reason: Failure) -> None:
        # The leader has gone; whatever is left of its group (a build backend that
        # ignored SIGTERM) would hold the pipes open.
        if self.pid is not None:
            kill_group(self.pid, signal.SIGKILL)

    def processEnded(self, reason: Failure) -> None:
        for stream in self._streams.values():
            stream.flush()
        # Kept aside: a Deferred fired with a Failure would raise it where awaited.
        self.reason = reason
        self.ended.callback(None)


def kill_group(pgid: int, number: int) -> None:
    try:
        os.killpg(pgid, number)
    except OSError as error:
        if error.errno not in (errno.ESRCH, errno.EPERM):
            raise


def _describe(argv: Sequence[str]) -> str:
    """
    A command as a failure message names it: the program and what it was asked to do.
    """
    program = Path(argv[0]).name
    rest = list(argv[1:])
    if rest[:2] == ["-m", "pip"]:
        return "pip " + (rest[2] if len(rest) > 2 else "")
    if rest[:2] == ["-m", "venv"]:
        return f"{program} -m venv"
    if rest[:1] == ["-c"]:
        code = rest[1] if len(rest) > 1 else ""
        return f"{program} -c '{code}'" if len(code) <= 60 else f"{program} -c"
    return " ".join([program] + rest[:1])


class Commands:
    """
    Runs a job's commands as child processes, one process group each, their output
    lines into the job's events.

    @param reactor: provides C{spawnProcess} and C{callLater}.
    @param environ: the server's environment, which each command's is built from.
    """

    def __init__(self, reactor: Any, environ: Mapping[str, str]) -> None:
        self._reactor = reactor
        self._env = command_env(environ)

    async def run(
        self,
        context: JobContext,
        argv: Sequence[str],
        *,
        timeout: float = QUICK_SECONDS,
        silence: float = SILENCE_SECONDS,
        env: Mapping[str, str] | None = None,
        on_line: Callable[[str], None] | None = None,
    ) -> None:
        """
        Run C{argv} to its end, each line it prints into the job's events (or to
        C{on_line}).

        @raise JobFailed: it exited non-zero, was killed, ran past C{timeout}, printed
            nothing for C{silence}, or the job was stopped; the message names the
            command and the line of its output that says why.
        """
        if context.cancelled is not None:
            raise JobFailed(Internal(context.cancelled))
        context.log("$ " + " ".join(argv))
        command = _Command(on_line or context.log)
        why: list[str] = []
        grace: list[Any] = []

        def stop(reason: str) -> None:
            if why or command.pid is None:
                return
            why.append(reason)
            kill_group(command.pid, signal.SIGTERM)
            grace.append(self._reactor.callLater(KILL_GRACE_SECONDS, kill_group, command.pid, signal.SIGKILL))

        wall = self._reactor.callLater(timeout, lambda: stop(f"ran past its {timeout:g} s limit"))
        quiet = self._reactor.callLater(silence, lambda: stop(f"printed nothing for {silence:g} s"))
        command.heard = lambda: quiet.reset(silence) if quiet.active() else None
        context.cancel = stop
        try:
            self._reactor.spawnProcess(
                command,
                sys.executable,
                [sys.executable, "-c", GROUP_LEADER, *argv],
                env=dict(env if env is not None else self._env),
                childFDs={0: "w", 1: "r", 2: "r"},
            )
            await command.ended
        finally:
            context.cancel = None
            # The group is gone by now (processExited SIGKILLs what is left of it): a
            # SIGKILL still due would go to whichever group is given its id next.
            for timer in (wall, quiet, *grace):
                if timer.active():
                    timer.cancel()
        name = _describe(argv)
        reason = command.reason
        assert reason is not None
        if why:
            raise JobFailed(Internal(f"{name} was stopped: {why[0]}"))
        if reason.check(ProcessDone):
            return
        value = reason.value
        code = getattr(value, "exitCode", None)
        if isinstance(value, ProcessTerminated) and value.signal is not None:
            how = f"was killed by signal {value.signal}"
        elif code is not None and code > 128:
            how = f"was killed by {_signal_name(code - 128)}"
        else:
            how = f"exited {code}"
        raise JobFailed(Internal(f"{name} {how}: {failure_reason(list(command.tail))}"))


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# -- what to run ------------------------------------------------------------------------


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def in_range(version: Sequence[int], spec: str) -> bool:
    """
    Whether a Python version satisfies a catalog's C{python} range: comma-separated
    clauses of C{>=}, C{>}, C{<=}, C{<}, C{==} or C{!=} and a version.  The catalog is
    shipped with the core, so an unreadable clause is a defect and fails the check.
    """
    have = tuple(version[:3])
    for clause in (part.strip() for part in spec.split(",")):
        if not clause:
            continue
        found = re.fullmatch(r"(>=|<=|==|!=|>|<)\s*(\d+(?:\.\d+){0,2})", clause)
        if found is None:
            return False
        op, wanted_text = found.groups()
        wanted = _version_tuple(wanted_text)
        mine = have[: len(wanted)]
        ok = {
            ">=": mine >= wanted, ">": mine > wanted, "<=": mine <= wanted,
            "<": mine < wanted, "==": mine == wanted, "!=": mine != wanted,
        }[op]
        if not ok:
            return False
    return True


def find_uv() -> str | None:
    """
    uv beside the core's interpreter (a C{rhapsode[uv]} install, run without its
    virtualenv activated), else on the path.
    """
    beside = Path(sys.executable).parent / "uv"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("uv")


def sdk_source(core_version: str) -> tuple[str, ...]:
    """
    Where an engine's virtualenv gets the SDK from: the protocol's and the SDK's folders
    of the checkout this core was installed from when it was, else the SDK from the
    index pinned to this core's version (it pins the protocol to the same).
    """
    try:
        source = source_of(metadata.distribution(CORE_DISTRIBUTION))
    except metadata.PackageNotFoundError:
        source = None
    if source is not None:
        folders = [source / name for name in ("protocol", "sdk")]
        if all((folder / "setup.cfg").is_file() or (folder / "pyproject.toml").is_file() for folder in folders):
            return tuple(str(folder) for folder in folders)
    return (f"{SDK_DISTRIBUTION}=={core_version}",)


@dataclass(frozen=True)
class Plan:
    """
    The commands of an install's venv, packages and verify steps (register and weights
    run in process), worked out before anything runs.
    """

    venv: tuple[tuple[str, ...], ...]
    packages: tuple[tuple[str, ...], ...]
    verify: tuple[str, ...]
    python: str


def plan(
    *,
    record: Mapping[str, Any],
    slot: Path,
    source_dir: Path | None,
    sdk: Sequence[str],
    uv: str | None,
    interpreter: str,
    interpreter_fits: bool,
    core_version: str,
    trusted: Sequence[str] = (),
    box: str = "cpu",
) -> Plan:
    """
    The commands for installing the engine of C{record} into C{slot}.

    A record with an C{install} recipe for C{box} is installed step by step as it says
    (L{recipe}); one without, in one step, the SDK and the adapter together.

    @param interpreter: the interpreter new virtualenvs are made from (C{install.python},
        else the core's own); C{interpreter_fits}, whether it is inside the record's
        Python range (uv is handed the range when it is not).
    """
    python = str(slot / "bin" / "python")
    wanted = str(record.get("python") or "")
    venv: tuple[tuple[str, ...], ...]
    if uv is not None:
        venv = ((uv, "venv", "--seed", "--python", interpreter if interpreter_fits or not wanted else wanted,
                 str(slot)),)
        upgrade: tuple[tuple[str, ...], ...] = ()
    else:
        venv = ((interpreter, "-m", "venv", str(slot)),)
        # The pip a venv seeds (23.2 with Python 3.11) has no --progress-bar raw.
        upgrade = ((python, "-m", "pip", "install", "--upgrade", "pip"),)
    adapter_dir = source_dir / str(record["id"]) if source_dir is not None else None
    if adapter_dir is not None and adapter_dir.is_dir():
        adapter = str(adapter_dir)
    else:
        adapter = f"{record.get('distribution') or record['id']}=={core_version}"
    hosts: list[str] = []
    for host in trusted:
        hosts += ["--trusted-host", host]
    pip = (python, "-m", "pip", "install", "--progress-bar", "raw", "--no-input", *hosts)
    installs = tuple((*pip, *step) for step in recipe(record, box, sdk, adapter))
    verify = (python, "-c", f"import {record['module']}")
    return Plan(venv=venv, packages=upgrade + installs, verify=verify, python=python)


#: The folder inside a slot where the source folders an install builds from are copied.
STAGED = ".sources"
#: What a build leaves in a source folder, never copied.
_BUILD_LEFTOVERS = shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".pytest_cache")


def stage_sources(packages: Sequence[Sequence[str]], staged: Path) -> tuple[tuple[str, ...], ...]:
    """
    C{packages} with every argument that names a local folder (the SDK's and the
    adapter's in a checkout) replaced by a copy of it under C{staged}.

    pip builds a folder in place: setuptools writes its build/ and egg-info beside the
    sources, so an install straight from a checkout writes into it, and fails where it is
    read-only (a container's).  The copies go inside the slot, which a failed install
    removes whole; a finished one removes them.  Blocking: run off the reactor thread.
    """
    copies: dict[str, str] = {}
    out = []
    for argv in packages:
        changed = []
        for arg in argv:
            if arg not in copies and not arg.startswith("-") and os.path.isdir(arg):
                target = staged / f"{len(copies)}-{Path(arg).name}"
                shutil.copytree(arg, target, symlinks=True, ignore=_BUILD_LEFTOVERS)
                copies[arg] = str(target)
            changed.append(copies.get(arg, arg))
        out.append(tuple(changed))
    return tuple(out)


#: Where the kernel lists the NVIDIA cards it drives, one folder each.
NVIDIA_CARDS = Path("/proc/driver/nvidia/gpus")


def detect_box(cards: Path = NVIDIA_CARDS) -> str:
    """
    C{cuda} where the kernel lists an NVIDIA card, else C{cpu}: which of a catalog
    record's install recipes fits this box (C{install.box} "auto").
    """
    try:
        return "cuda" if cards.is_dir() and any(cards.iterdir()) else "cpu"
    except OSError:
        return "cpu"


def recipe(record: Mapping[str, Any], box: str, sdk: Sequence[str], adapter: str) -> list[list[str]]:
    """
    The pip arguments of each step that installs C{record}'s engine on a C{box} box.

    A torch engine's record says, per box, what goes in first (on a CPU box the local
    CPU build of torch, so that no dependency drags in a CUDA one) and where the SDK
    (C{{sdk}}) and the adapter (C{{adapter}}) go; a record with no C{install} is one step,
    the SDK and the adapter together.

    @raise Unsupported: naming C{install.box}, when the record has recipes but none for
        this box, before anything is made.
    """
    recipes = record.get("install")
    if not isinstance(recipes, Mapping):
        return [[*sdk, adapter]]
    steps = recipes.get(box)
    if not isinstance(steps, list) or not steps:
        raise Unsupported(
            f'{record["id"]} installs on a {" or a ".join(sorted(recipes))} box, and this one is a {box} box '
            "(install.box; auto looks for an NVIDIA card)",
            field="install.box",
        )
    expanded: list[list[str]] = []
    for step in steps:
        args: list[str] = []
        for arg in step:
            args.extend(sdk if arg == "{sdk}" else [adapter] if arg == "{adapter}" else [str(arg)])
        expanded.append(args)
    return expanded


# -- the installer ----------------------------------------------------------------------


class EngineHost(Protocol):
    """
    What the installer needs of the running core: its registry, and the lock a load
    takes.
    """

    def registered(self, engine_id: str) -> bool: ...

    def operator_engines(self) -> set[str]: ...

    def cluster_of(self, engine_id: str) -> str | None: ...

    def declare(self, engine_id: str, entry: Mapping[str, Any]) -> None: ...

    def retire(self, engine_id: str) -> "Deferred[None]": ...

    def replace(self, engine_id: str, entry: Mapping[str, Any]) -> "Deferred[None]": ...

    async def quiet(self, engine_id: str, work: Callable[[], Awaitable[_T]], wait: float | None) -> _T: ...

    async def fetch(self, engine_id: str, variant: str, context: JobContext, required: bool = True) -> None: ...


class Runner(Protocol):
    async def run(
        self, context: JobContext, argv: Sequence[str], *, timeout: float = ..., silence: float = ...,
        env: Mapping[str, str] | None = ..., on_line: Callable[[str], None] | None = ...,
    ) -> None: ...


def _one(args: Mapping[bytes, Sequence[bytes]], name: str) -> str | None:
    values = args.get(name.encode())
    if values is None:
        return None
    if len(values) != 1:
        raise BadRequest(f"{name} is given more than once", field=name)
    value = values[0].decode("utf-8", "replace")
    if not value:
        raise BadRequest(f"{name} is empty: leave it out, or name a value", field=name)
    return value


def install_query(args: Mapping[bytes, Sequence[bytes]], allowed: Iterable[str]) -> dict[str, str | None]:
    """
    The query of an install or reinstall: each allowed parameter at most once and never
    empty; any other parameter is bad_request (a misspelt accept must not be ignored).
    """
    allowed = tuple(allowed)
    for key in args:
        name = key.decode("utf-8", "replace")
        if name not in allowed:
            raise BadRequest(f"{name}: not a parameter of this route (it takes {', '.join(allowed)})",
                             field=name)
    return {name: _one(args, name) for name in allowed}


def check_engine_id(engine_id: str) -> None:
    """
    An engine id in a path is 1 to 64 ASCII letters, digits, _ or -: nothing with a
    dot, a slash or a character that only looks like one of those.
    """
    if not engine_id.isascii() or not _ENGINE_ID.fullmatch(engine_id) or ".." in engine_id:
        raise BadRequest(
            f"{engine_id!r} is not an engine id (1 to 64 ASCII letters, digits, _ or -)", field="engine"
        )


class Installer:
    """
    The management routes' work: refusals first, then a job.

    @param config: answers the config in use (C{install.*} is read as each job starts).
    @param state: the state database; C{None} makes every route C{unsupported}.
    """

    log = Logger()

    def __init__(
        self,
        *,
        reactor: Any,
        jobs: Jobs,
        catalog: Catalog,
        state: StateDatabase | None,
        host: EngineHost,
        venv_dir: Callable[[], Path],
        source_dir: Callable[[], Path | None],
        interpreter: Callable[[], str | None],
        runner: Runner,
        environ: Mapping[str, str],
        core_version: str,
        uv: str | None = None,
        sdk: Sequence[str] | None = None,
        box: Callable[[], str] = lambda: "auto",
    ) -> None:
        self._reactor = reactor
        self._box = box
        self.jobs = jobs
        self.catalog = catalog
        self.state = state
        self.host = host
        self._venv_dir = venv_dir
        self._source_dir = source_dir
        self._interpreter = interpreter
        self.runner = runner
        self._environ = environ
        self.core_version = core_version
        self.uv = uv
        self._sdk = sdk

    def box(self) -> str:
        """
        The kind of box this core installs for: C{install.box}, or what L{detect_box} finds.
        """
        chosen = self._box()
        return detect_box() if chosen == "auto" else chosen

    # -- refusals ---------------------------------------------------------------------

    def _fits_box(self, record: Mapping[str, Any]) -> None:
        # Refused before a job starts: a record with no recipe for this box.
        recipe(record, self.box(), ("sdk",), "adapter")

    def _database(self) -> StateDatabase:
        if self.state is None:
            raise Unsupported(
                "this server has no state database to record an install in (it was started without a config file)"
            )
        return self.state

    def _record(self, engine_id: str) -> Mapping[str, Any]:
        check_engine_id(engine_id)
        for record in self.catalog.records:
            if record["id"] == engine_id:
                return record
        known = ", ".join(str(record["id"]) for record in self.catalog.records) or "none"
        raise UnknownEngine(f'no engine "{engine_id}" in the catalog (it has: {known})', field="engine")

    def _accepted(self, record: Mapping[str, Any], accept: str | None, recorded: str | None = None) -> str | None:
        """
        Section 10's licence rule: weights not for commercial use need C{accept} naming
        the catalog's weights licence exactly (a reinstall needs none if the recorded
        acceptance is that licence); an accept that is sent must name it either way.
        """
        licence = record.get("license") or {}
        weights = str(licence.get("weights") or "")
        commercial = licence.get("weightsCommercialUse") is not False
        if accept is not None and accept != weights:
            raise BadRequest(
                f'accept names "{accept}", but the weights of {record["id"]} are under "{weights}": '
                f"accept must name that licence exactly",
                field="accept",
            )
        if commercial:
            return accept
        if accept is None:
            if recorded is not None and recorded == weights:
                return recorded
            raise BadRequest(
                f'the weights of {record["id"]} are under "{weights}", which does not allow commercial use; '
                f"read it, and install with ?accept={weights} to accept it",
                field="accept",
            )
        return accept

    def _not_busy(self, engine_id: str) -> None:
        active = self.jobs.active(engine_id)
        if active is not None:
            raise Conflict(f'engine "{engine_id}" has a {active.kind} job {active.state} ({active.id})',
                           field="engine")

    # -- install ------------------------------------------------------------------------

    def install(self, engine_id: str, pull: str | None, accept: str | None) -> Job:
        """
        Start installing C{engine_id}; C{pull}, a variant to fetch once registered.
        """
        record = self._record(engine_id)
        self._database()
        cluster = self.host.cluster_of(engine_id)
        if cluster is not None:
            raise Conflict(f'engine "{engine_id}" runs on the cluster at {cluster}: install it on every node '
                           "(rhapsode install --url http://NODE:PORT on each), not on its front", field="engine")
        if engine_id in self.host.operator_engines():
            raise Conflict(f'engine "{engine_id}" is configured in the operator\'s config file; '
                           "it is theirs to change there", field="engine")
        self._not_busy(engine_id)
        if self.host.registered(engine_id):
            raise Conflict(f'engine "{engine_id}" is installed already (reinstall rebuilds it)', field="engine")
        if pull is not None and not _VARIANT.fullmatch(pull):
            raise BadRequest(f"pull must name a variant, not {pull!r}", field="pull")
        accepted = self._accepted(record, accept)
        self._fits_box(record)
        # Before the submit: a job that fails at once (install.venvDir cannot be made)
        # has ended, and taken the engine out of installing, inside it.
        self.catalog.installing.add(engine_id)
        try:
            return self.jobs.submit(engine_id, "install", lambda context: self._install(context, record, accepted),
                                    variant=pull)
        except BaseException:
            self.catalog.installing.discard(engine_id)
            raise

    def _slots(self, engine_id: str) -> tuple[Path, Path]:
        base = self._venv_dir()
        return base / engine_id, base / f"{engine_id}.alt"

    async def _remove(self, path: Path) -> None:
        """
        Delete a virtualenv off the reactor thread; only one inside install.venvDir.
        """
        base = self._venv_dir().resolve()
        if path.resolve().parent != base or path.is_symlink():
            raise Internal(f"{path} is not a virtualenv slot inside install.venvDir; left alone")
        if path.exists():
            await deferToThreadPool(self._reactor, self._reactor.getThreadPool(), shutil.rmtree, path)

    async def _build(self, context: JobContext, record: Mapping[str, Any], slot: Path) -> Plan:
        """
        Steps 1 to 3 into C{slot}: venv, packages, verify.
        """
        context.step("venv")
        base = self._venv_dir()
        try:
            base.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise Internal(f"install.venvDir {base} cannot be made: {error.strerror}") from None
        if slot.exists():
            context.log(f"removing {slot}: the remains of an install that did not finish")
            await self._remove(slot)
        interpreter, fits = await self._choose_interpreter(context, record)
        steps = plan(
            record=record, slot=slot, source_dir=self._source_dir(), sdk=self._sdk or sdk_source(self.core_version),
            uv=self.uv, interpreter=interpreter, interpreter_fits=fits, core_version=self.core_version,
            trusted=trusted_hosts(self._environ), box=self.box(),
        )
        for argv in steps.venv:
            await self.runner.run(context, argv, timeout=QUICK_SECONDS)
        context.step("packages")
        staged = slot / STAGED
        packages = await deferToThreadPool(
            self._reactor, self._reactor.getThreadPool(), stage_sources, steps.packages, staged
        )
        for argv in packages:
            await self.runner.run(context, argv, timeout=PACKAGES_SECONDS, silence=SILENCE_SECONDS)
        if staged.exists():
            await deferToThreadPool(self._reactor, self._reactor.getThreadPool(), shutil.rmtree, staged)
        context.step("verify")
        await self.runner.run(context, steps.verify, timeout=QUICK_SECONDS)
        return steps

    async def _built(self, context: JobContext, record: Mapping[str, Any], slot: Path) -> Plan:
        """
        L{_build}, and on failure the slot removed again: nothing half-built is left.
        """
        try:
            return await self._build(context, record, slot)
        except BaseException:
            try:
                await self._remove(slot)
            except Exception:
                self.log.failure("removing the half-built {slot} failed", slot=slot)
            raise

    async def _choose_interpreter(self, context: JobContext, record: Mapping[str, Any]) -> tuple[str, bool]:
        wanted = str(record.get("python") or "")
        configured = self._interpreter()
        if configured is None:
            # The core's own interpreter, through any virtualenv it runs in.
            own = os.path.realpath(sys.executable)
            fits = in_range(tuple(sys.version_info[:3]), wanted)
            if not fits and self.uv is None:
                raise Internal(
                    f"{record['id']} installs on Python {wanted}, and the core's own interpreter ({own}) is "
                    f"{'.'.join(map(str, sys.version_info[:3]))}; set install.python to an interpreter inside "
                    "that range, or install uv"
                )
            return own, fits
        if self.uv is not None and os.sep not in configured:
            # A version ("3.12"): uv finds it.
            return configured, in_range(_version_tuple(configured), wanted)
        path = configured if os.sep in configured else shutil.which(f"python{configured}") or configured
        version = await self._version_of(context, path)
        fits = in_range(version, wanted)
        if not fits and self.uv is None:
            raise Internal(
                f"{record['id']} installs on Python {wanted}, and install.python ({configured}) is "
                f"{'.'.join(map(str, version))}; set install.python to an interpreter inside that range, or install uv"
            )
        return path, fits

    async def _version_of(self, context: JobContext, python: str) -> tuple[int, ...]:
        lines: list[str] = []
        await self.runner.run(context, [python, "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"],
                              on_line=lines.append)
        found = [line for line in lines if re.fullmatch(r"\d+\.\d+\.\d+", line.strip())]
        if not found:
            raise Internal(f"install.python {python} did not say its version")
        return _version_tuple(found[-1])

    async def _install(self, context: JobContext, record: Mapping[str, Any], accepted: str | None) -> None:
        engine_id = str(record["id"])
        try:
            first, alt = self._slots(engine_id)
            if alt.exists():
                context.log(f"removing {alt}: the remains of a reinstall that did not finish")
                await self._remove(alt)
            steps = await self._built(context, record, first)
            context.step("register")
            entry = {"module": str(record["module"]), "python": steps.python}
            await self._database().put_engine(InstalledEngine(engine_id, entry, accepted))
            self.host.declare(engine_id, entry)
            self.catalog.managed.add(engine_id)
            context.log(f"{engine_id} registered: the next /speak for it starts its worker")
        finally:
            self.catalog.installing.discard(engine_id)
        variant = context.job.variant
        if variant is not None:
            context.step("weights")
            await self.host.fetch(engine_id, variant, context, required=False)

    # -- reinstall ----------------------------------------------------------------------

    def _no_database(self, engine_id: str) -> None:
        """
        A server without a state database has installed nothing: every engine it has is
        the operator's (protocol.md section 10, "Reinstalling").
        """
        if self.state is None:
            if self.host.registered(engine_id):
                raise Conflict(f'engine "{engine_id}" is the operator\'s: this server has no state database '
                               "and installed nothing", field="engine")
            raise UnknownEngine(f'engine "{engine_id}" is not installed', field="engine")

    def _managed(self, engine_id: str) -> InstalledEngine:
        self._no_database(engine_id)
        installed = self._database().engines().get(engine_id)
        if engine_id in self.host.operator_engines():
            raise Conflict(f'engine "{engine_id}" is configured in the operator\'s config file; '
                           "it is theirs to change there", field="engine")
        if installed is None or not self.host.registered(engine_id):
            raise UnknownEngine(f'engine "{engine_id}" is not installed', field="engine")
        return installed

    def reinstall(self, engine_id: str, accept: str | None) -> Job:
        """
        Start rebuilding an engine this API installed, beside itself.
        """
        record = self._record(engine_id)
        installed = self._managed(engine_id)
        self._not_busy(engine_id)
        accepted = self._accepted(record, accept, installed.accepted)
        self._fits_box(record)
        return self.jobs.submit(engine_id, "reinstall", partial(self._reinstall, record=record, accepted=accepted))

    async def _reinstall(self, context: JobContext, *, record: Mapping[str, Any], accepted: str | None) -> None:
        engine_id = str(record["id"])
        current = self._database().engines().get(engine_id)
        if current is None:
            raise UnknownEngine(f'engine "{engine_id}" was uninstalled before its reinstall began', field="engine")
        first, alt = self._slots(engine_id)
        running_from = Path(str(current.entry.get("python", ""))).parent.parent
        other = alt if running_from == first else first
        steps = await self._built(context, record, other)
        context.step("register")
        entry = {"module": str(record["module"]), "python": steps.python}

        async def swap() -> None:
            # The database first: a core that dies after this boots on the new slot.
            await self._database().put_engine(InstalledEngine(engine_id, entry, accepted))
            await self.host.replace(engine_id, entry)

        context.log(f"waiting for {engine_id} to stop speaking (at most {REGISTER_WAIT_SECONDS:g} s)")
        await self.host.quiet(engine_id, swap, REGISTER_WAIT_SECONDS)
        context.log(f"{engine_id} now runs from {other}")
        if running_from != other and running_from in (first, alt):
            await self._remove(running_from)

    def outdated(self) -> dict[str, Any]:
        """
        C{POST /installs/outdated}: a reinstall for every engine this API installed whose
        C{outdated} is true, in id order; what cannot go without asking is skipped.
        """
        database = self._database()
        operator = self.host.operator_engines()
        jobs: list[dict[str, Any]] = []
        skipped: list[dict[str, str]] = []
        records = {str(record["id"]): record for record in self.catalog.records}
        for engine_id, installed in sorted(database.engines().items()):
            if engine_id in operator or not self.host.registered(engine_id):
                continue
            if not self.catalog.versions(engine_id).get("outdated"):
                continue
            record = records.get(engine_id)
            if record is None:
                skipped.append({"engine": engine_id, "reason": "uncatalogued"})
                continue
            if self.jobs.active(engine_id) is not None:
                skipped.append({"engine": engine_id, "reason": "busy"})
                continue
            try:
                accepted = self._accepted(record, None, installed.accepted)
            except BadRequest:
                skipped.append({"engine": engine_id, "reason": "licence"})
                continue
            job = self.jobs.submit(engine_id, "reinstall", partial(self._reinstall, record=record, accepted=accepted))
            jobs.append(job.document())
        return {"jobs": jobs, "skipped": skipped}

    # -- uninstall ----------------------------------------------------------------------

    async def uninstall(self, engine_id: str) -> None:
        """
        Stop and remove an engine this API installed: its worker, its registry entry,
        its database entry and settings, and its virtualenvs (never its weights).
        """
        check_engine_id(engine_id)
        self._no_database(engine_id)
        database = self._database()
        if engine_id in self.host.operator_engines():
            raise Conflict(f'engine "{engine_id}" is configured in the operator\'s config file; '
                           "remove it there", field="engine")
        if engine_id not in database.engines() or not self.host.registered(engine_id):
            raise UnknownEngine(f'engine "{engine_id}" is not installed', field="engine")
        self._not_busy(engine_id)

        async def remove() -> None:
            # The database first: a core that dies after this boots without the engine.
            await database.delete_engine(engine_id)
            await self.host.retire(engine_id)

        # Under the lock a load takes: nothing starts speaking in between.
        await self.host.quiet(engine_id, remove, None)
        self.catalog.managed.discard(engine_id)
        for slot in self._slots(engine_id):
            await self._remove(slot)

    # -- pull ---------------------------------------------------------------------------

    def pull(self, engine_id: str, body: Any) -> Job:
        """
        Start fetching a variant's weights for an installed engine.
        """
        check_engine_id(engine_id)
        if not isinstance(body, dict) or set(body) - {"variant"}:
            raise BadRequest('a pull takes {"variant": "..."}', field="body")
        variant = body.get("variant")
        if not isinstance(variant, str) or not _VARIANT.fullmatch(variant):
            raise BadRequest("variant must name a variant", field="variant")
        if not self.host.registered(engine_id):
            raise UnknownEngine(f'engine "{engine_id}" is not installed', field="engine")
        self._not_busy(engine_id)

        async def fetch(context: JobContext) -> None:
            context.step("weights")
            await self.host.fetch(engine_id, variant, context)

        return self.jobs.submit(engine_id, "pull", fetch, variant=variant)

