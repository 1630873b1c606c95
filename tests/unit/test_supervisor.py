"""
The worker supervisor on a fake process reactor: what a worker is spawned with, the
handshake, stderr forwarding, crash restarts with backoff, and the stop sequence.  Time
moves only by C{reactor.advance()}; signals are recorded by an injected C{kill}.
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass, field
from typing import Any, Sequence

import pytest
from twisted.internet.defer import Deferred, succeed
from twisted.internet.error import ProcessDone, ProcessExitedAlready, ProcessTerminated
from twisted.internet.interfaces import IProcessProtocol, IProcessTransport, IReactorProcess
from twisted.logger import LogLevel, capturedLogs
from twisted.python.failure import Failure
from zope.interface import implementer
from zope.interface.verify import verifyObject

from rhapsode._fleet.supervisor import (
    KILL_WAIT_SECONDS,
    LEADER,
    PIPE_GRACE_SECONDS,
    TAIL_CHARACTERS,
    TAIL_LINES,
    WorkerSupervisor,
)
from rhapsode_protocol.errors import Internal, ModelUnavailable

from _deferreds import failure_of, result_of
from _worker_fakes import FakeProcessReactor

SOCKET = "unix:/run/rhapsode/tone.sock"
TERM, KILL = signal.SIGTERM, signal.SIGKILL


@implementer(IProcessTransport)
class FakeWorker:
    """
    A spawned worker: the test writes its output and decides when it exits.
    """

    def __init__(self, pid: int, proto: IProcessProtocol) -> None:
        self.pid: int | None = pid
        self.proto = proto
        self.signals: list[int | str] = []
        self.lost = False
        self.closed: list[int] = []
        #: The readers of the child's stdout and stderr, as a process transport has them.
        self.pipes: dict[int, Any] = {}

    # IProcessTransport
    def closeStdin(self) -> None:
        pass

    def closeStdout(self) -> None:
        pass

    def closeStderr(self) -> None:
        pass

    def closeChildFD(self, descriptor: int) -> None:
        self.closed.append(descriptor)

    def writeToChild(self, childFD: int, data: bytes) -> None:
        pass

    def loseConnection(self) -> None:
        self.lost = True

    def signalProcess(self, signalID: str | int) -> None:
        if self.pid is None:
            raise ProcessExitedAlready()
        self.signals.append(signalID)

    def write(self, data: bytes) -> None:
        pass

    def writeSequence(self, data: Sequence[bytes]) -> None:
        pass

    def getPeer(self) -> Any:
        return None

    def getHost(self) -> Any:
        return None

    # driving it
    def out(self, data: bytes) -> None:
        self.proto.childDataReceived(1, data)

    def err(self, data: bytes) -> None:
        self.proto.childDataReceived(2, data)

    def handshake(self, contract: int = 1, listen: str = SOCKET) -> None:
        line = {"ready": True, "contract": contract, "engine": "tone", "listen": listen}
        self.out(json.dumps(line).encode() + b"\n")

    def exit(self, code: int | None = 0, sig: int | None = None) -> None:
        self.reap(code, sig)
        self.proto.processEnded(self._reason)

    def reap(self, code: int | None = 0, sig: int | None = None) -> None:
        """
        The process is reaped, its pipes left open (something else holds them).
        """
        self.pid = None
        self._reason = Failure(ProcessDone(0) if code == 0 and sig is None else ProcessTerminated(code, sig))
        self.proto.processExited(self._reason)


def process_reactor() -> FakeProcessReactor:
    """
    The suite's fake process reactor, spawning L{FakeWorker}s.
    """
    return FakeProcessReactor(make_process=FakeWorker)


def last_worker(reactor: FakeProcessReactor) -> "FakeWorker":
    worker: FakeWorker = reactor.spawned[-1].process
    return worker


@dataclass
class Harness:
    """
    A supervisor on a fake reactor, with the signals it sent and the verbs it asked.
    """

    reactor: FakeProcessReactor = field(default_factory=process_reactor)
    kills: list[tuple[int, int]] = field(default_factory=list)
    verbs: list[tuple[str, Deferred[bool]]] = field(default_factory=list)
    group_missing: bool = False
    supervisor: WorkerSupervisor = field(init=False)

    def kill(self, pid: int, number: int) -> None:
        if self.group_missing:
            raise ProcessLookupError(number)
        self.kills.append((pid, number))

    def terminate(self, listen: str) -> Deferred[bool]:
        answer: Deferred[bool] = Deferred()
        self.verbs.append((listen, answer))
        return answer


def harness(**overrides: Any) -> Harness:
    h = Harness()
    settings: dict[str, Any] = dict(
        reactor=h.reactor,
        python="/venvs/tone/bin/python",
        module="rhapsode_engine_tone",
        listen=SOCKET,
        voice_dir="/config/voices",
        env={"HF_HOME": "/models"},
        contract=1,
        startup_timeout=60.0,
        drain_grace=10.0,
        max_restarts=5,
        restart_decay=300.0,
        terminate=h.terminate,
        kill=h.kill,
    )
    settings.update(overrides)
    h.supervisor = WorkerSupervisor("tone", **settings)
    return h


def up(h: Harness) -> FakeWorker:
    """
    Start the worker and hand-shake.
    """
    started = h.supervisor.start()
    last_worker(h.reactor).handshake()
    assert result_of(started) == SOCKET
    return last_worker(h.reactor)




def test_fakes_provide_their_interfaces() -> None:
    """The fake process reactor and the fake worker process provide the interfaces they stand in for."""
    h = harness()
    h.supervisor.start()
    assert verifyObject(IReactorProcess, h.reactor)
    assert verifyObject(IProcessTransport, last_worker(h.reactor))


def test_spawn_inherits_environment_and_adds_the_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker gets the core's own environment, the engine's env, and the spawn contract's variables, which win."""
    monkeypatch.setenv("RHAPSODE_TEST_INHERITED", "yes")
    h = harness(env={"HF_HOME": "/models", "RHAPSODE_WORKER_ENGINE": "not-this"})
    h.supervisor.start()
    [spawned] = h.reactor.spawned
    executable, argv, env = spawned.executable, spawned.argv, spawned.env
    python = "/venvs/tone/bin/python"
    assert executable == python
    assert argv == [python, "-c", LEADER, python, "-m", "rhapsode_engine_tone"]
    assert env["RHAPSODE_TEST_INHERITED"] == "yes"
    assert env["PATH"] == os.environ["PATH"]
    assert env["HF_HOME"] == "/models"
    assert env["RHAPSODE_WORKER_LISTEN"] == SOCKET
    assert env["RHAPSODE_WORKER_ENGINE"] == "tone"
    assert env["RHAPSODE_WORKER_CONTRACT"] == "1"
    assert env["RHAPSODE_WORKER_VOICE_DIR"] == "/config/voices/tone"
    assert env["PYTHONUNBUFFERED"] == "1"


def test_handshake_fires_start_with_the_listen_address() -> None:
    """start() fires with the handshake's listen address; the worker is up and the startup timer is gone."""
    h = harness()
    started = h.supervisor.start()
    assert h.supervisor.state == "starting"
    assert h.reactor.getDelayedCalls()
    last_worker(h.reactor).out(b'{"ready":true,"contract":1,"engine":"tone",')
    assert not started.called
    last_worker(h.reactor).out(b'"listen":"tcp:127.0.0.1:41234"}\n')
    assert result_of(started) == "tcp:127.0.0.1:41234"
    assert h.supervisor.state == "up"
    assert h.supervisor.listen == "tcp:127.0.0.1:41234"
    assert h.supervisor.health() == {"process": "up", "pid": 1000, "restarts": 0}
    assert h.reactor.getDelayedCalls() == []


def test_starts_are_shared_and_answered_at_once_while_up() -> None:
    """Two start()s while starting share one process; a start() while up answers at once."""
    h = harness()
    first, second = h.supervisor.start(), h.supervisor.start()
    assert len(h.reactor.spawned) == 1
    last_worker(h.reactor).handshake()
    assert result_of(first) == result_of(second) == SOCKET
    assert result_of(h.supervisor.start()) == SOCKET
    assert len(h.reactor.spawned) == 1


def test_waiters_see_the_new_state() -> None:
    """A start() callback runs once the supervisor is up, so what it reads is current."""
    h = harness()
    seen: list[tuple[str, str | None]] = []
    h.supervisor.start().addCallback(lambda _: seen.append((h.supervisor.state, h.supervisor.listen)))
    last_worker(h.reactor).handshake()
    assert seen == [("up", SOCKET)]


def failure_logged(events: list[Any]) -> str:
    """
    The text of the error the supervisor logged for a failure, with the worker's tail.
    """
    [event] = [e for e in events if e.get("log_level") == LogLevel.error and "tail" in e]
    return f"{event['error']}\n{event['tail']}"


def test_exit_before_handshake_fails_start_as_internal_with_stderr_in_the_log() -> None:
    """
    A worker that exits with a status before its handshake cannot run (an import error
    says the same next time): start() fails as internal, not retryable, with a message
    that names the exit and no path of the box; its stderr goes to the log.
    """
    h = harness()
    started = h.supervisor.start()
    worker = last_worker(h.reactor)
    with capturedLogs() as events:
        worker.err(b"Traceback (most recent call last):\n  File \"/srv/venv/x.py\"\nModuleNotFoundError: No module named 'kok")
        worker.err(b"oro'\n")
        worker.exit(1)
    error = failure_of(started).value
    assert isinstance(error, Internal) and not error.retryable
    assert "exited before its handshake (exit code 1)" in error.message
    assert "/srv" not in error.message and "Traceback" not in error.message
    assert "ModuleNotFoundError: No module named 'kokoro'" in failure_logged(events)
    assert h.supervisor.last_error == error.message
    assert h.supervisor.restarts == 1


def test_the_configuration_reference_says_what_a_failed_start_answers() -> None:
    """
    docs/configuration.md says what the code answers a worker that exits before its
    handshake (500 internal, not retryable, for an exit status; 503 model_unavailable
    for a signal) and one that times out (503, retryable), and promises no stderr in
    the answer: it is in the log.
    """
    from pathlib import Path

    reference = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
    [row] = [line for line in reference.read_text().splitlines() if line.startswith("| `workers.startupTimeoutSeconds`")]
    answers = []
    for how in ("status", "signal", "timeout"):
        h = harness(max_restarts=0)
        started = h.supervisor.start()
        if how == "status":
            last_worker(h.reactor).exit(1)
        elif how == "signal":
            last_worker(h.reactor).exit(None, 9)
        else:
            h.reactor.advance(60.0)
        error = failure_of(started).value
        answers.append((error.status, error.code, error.retryable))
        assert f"{error.status} `{error.code}`" in row, (how, row)
    assert answers == [(500, "internal", False), (503, "model_unavailable", True), (503, "model_unavailable", True)]
    assert "not retryable" in row and "(retryable)" in row
    assert "with the end of the worker's stderr" not in row and "stderr is in the server's log" in row


def test_a_signal_before_the_handshake_stays_retryable() -> None:
    """
    A worker killed by a signal before its handshake may start next time: retryable.
    """
    h = harness()
    started = h.supervisor.start()
    last_worker(h.reactor).exit(None, 9)
    error = failure_of(started).value
    assert isinstance(error, ModelUnavailable) and error.retryable and "SIGKILL" in error.message


def test_an_interpreter_that_cannot_be_run_is_internal_without_its_path() -> None:
    """
    spawnProcess failing (no such interpreter) fails start() as internal, naming the
    cause and not the interpreter's path, which goes to the log.
    """
    h = harness()

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise FileNotFoundError(2, "No such file or directory", "/opt/venvs/tone/bin/python")

    h.reactor.spawnProcess = refuse  # type: ignore[method-assign]
    with capturedLogs() as events:
        started = h.supervisor.start()
    error = failure_of(started).value
    assert isinstance(error, Internal) and "No such file or directory" in error.message
    assert "/opt" not in error.message and "/opt" not in (h.supervisor.last_error or "")
    assert any("/opt/venvs/tone/bin/python" in str(e.get("error")) for e in events)


def test_stderr_tail_is_bounded() -> None:
    """The logged failure keeps the last few lines of stderr, at most about two kilobytes, not all of it."""
    h = harness()
    started = h.supervisor.start()
    with capturedLogs() as events:
        for i in range(500):
            last_worker(h.reactor).err(f"line {i:04d} of noise\n".encode())
        last_worker(h.reactor).exit(1)
    failure_of(started)
    message = failure_logged(events)
    assert f"line {500 - TAIL_LINES:04d}" in message and f"line {499 - TAIL_LINES:04d}" not in message
    h.reactor.advance(1)
    restarted = h.supervisor.start()
    with capturedLogs() as events:
        last_worker(h.reactor).err(b"x" * 5000 + b" the end\n")
        last_worker(h.reactor).exit(1)
    failure_of(restarted)
    tail = failure_logged(events).split("\n", 1)[1]
    assert tail.endswith("x the end") and len(tail) <= TAIL_CHARACTERS


def test_startup_timeout_kills_the_group_and_fails() -> None:
    """A worker silent past the startup timeout is SIGKILLed as a group and start() fails naming the timeout."""
    h = harness(startup_timeout=60.0)
    started = h.supervisor.start()
    last_worker(h.reactor).err(b'{"level":"info","namespace":"x","message":"importing torch"}\n')
    h.reactor.advance(59.9)
    assert not started.called and h.kills == []
    h.reactor.advance(0.1)
    assert h.kills == [(1000, KILL)]
    message = failure_of(started).value.message
    assert "did not hand-shake within 60 s" in message and "importing torch" not in message
    assert h.supervisor.state == "draining"
    last_worker(h.reactor).exit(None, 9)
    assert h.supervisor.state == "starting"  # counted as a crash: a restart is scheduled
    assert h.supervisor.restarts == 1


def test_stop_while_a_timed_out_start_is_killed() -> None:
    """stop() while a timed-out worker is being killed fires at its exit and leaves it down, with no restart."""
    h = harness(startup_timeout=5.0)
    started = h.supervisor.start()
    h.reactor.advance(5)
    failure_of(started)
    assert "did not hand-shake" in failure_of(h.supervisor.start()).value.message
    stopped = h.supervisor.stop()
    assert not stopped.called
    last_worker(h.reactor).exit(None, 9)
    result_of(stopped)
    assert h.supervisor.state == "down" and h.reactor.getDelayedCalls() == []


def test_contract_above_the_core_is_refused() -> None:
    """A handshake at a contract above the core's is refused naming both numbers, killed, and not retried."""
    h = harness()
    started = h.supervisor.start()
    last_worker(h.reactor).handshake(contract=2)
    assert h.kills == [(1000, KILL)]
    error = failure_of(started).value
    assert isinstance(error, Internal) and not error.retryable
    assert "contract 2" in error.message and "contract 1" in error.message
    last_worker(h.reactor).exit(None, 9)
    assert h.supervisor.state == "failed"
    h.reactor.advance(3600)
    assert len(h.reactor.spawned) == 1
    assert failure_of(h.supervisor.start()).value.message == error.message
    assert h.reactor.getDelayedCalls() == []


def test_a_first_line_that_is_not_a_handshake_is_refused() -> None:
    """Anything but a handshake as the first stdout line is refused; what was written goes to the log."""
    h = harness()
    started = h.supervisor.start()
    with capturedLogs() as events:
        last_worker(h.reactor).out(b"loading kokoro...\n")
    error = failure_of(started).value
    assert isinstance(error, Internal) and "other than its handshake" in error.message
    assert any(e.get("line") == "loading kokoro..." for e in events)
    last_worker(h.reactor).exit(None, 9)
    assert h.supervisor.state == "failed"


def test_stderr_json_lines_are_forwarded_with_the_engine() -> None:
    """stderr JSON lines, split across reads or not, reach the log at their level and namespace with the engine attached."""
    h = harness()
    h.supervisor.start()
    worker = last_worker(h.reactor)
    warn = {"time": "t", "level": "warn", "engine": "tone", "namespace": "rhapsode_worker", "message": "slow {load}"}
    error = {
        "time": "t",
        "level": "error",
        "engine": "tone",
        "namespace": "kokoro.model",
        "message": "load failed",
        "traceback": "Traceback: boom",
    }
    with capturedLogs() as events:
        data = (json.dumps(warn) + "\n\n" + json.dumps(error) + "\nplain text from a C library\n  \n").encode()
        worker.err(data[:30])
        worker.err(data[30:100])
        worker.err(data[100:])
    forwarded = [e for e in events if e.get("engine") == "tone"]
    assert [(e["log_level"], e["log_namespace"], e["message"]) for e in forwarded[:2]] == [
        (LogLevel.warn, "rhapsode_worker", "slow {load}"),
        (LogLevel.error, "kokoro.model", "load failed"),
    ]
    assert forwarded[1]["traceback"] == "Traceback: boom"
    assert forwarded[2]["log_level"] == LogLevel.info
    assert forwarded[2]["line"] == "plain text from a C library"
    assert len(forwarded) == 3


def test_a_line_nested_too_deep_to_parse_is_plain_text_on_either_pipe() -> None:
    """
    A worker writing a line of 1,100 nested brackets (a library printing a deep
    structure) is read as text: on stdout before the handshake it is "not a handshake",
    on stderr a plain line, where json.loads' RecursionError escaped the pipe's reader;
    the lines after it are read as ever.
    """
    deep = b"[" * 1100 + b"]" * 1100
    h = harness()
    started = h.supervisor.start()
    with capturedLogs() as events:
        last_worker(h.reactor).out(deep + b"\n")
    assert "other than its handshake" in failure_of(started).value.message
    assert any(e.get("line") == deep.decode()[:200] for e in events)
    last_worker(h.reactor).exit(None, 9)

    h = harness()
    h.supervisor.start()
    worker = last_worker(h.reactor)
    record = {"time": "t", "level": "warn", "engine": "tone", "namespace": "rhapsode_worker", "message": "after"}
    with capturedLogs() as events:
        worker.err(deep + b"\n" + json.dumps(record).encode() + b"\n")
    forwarded = [e for e in events if e.get("engine") == "tone"]
    assert [e.get("line") for e in forwarded] == [deep.decode(), None]
    assert (forwarded[1]["log_level"], forwarded[1]["message"]) == (LogLevel.warn, "after")


def test_partial_stderr_line_is_kept_at_exit() -> None:
    """A last stderr line without a newline is still logged and still part of the error."""
    h = harness()
    started = h.supervisor.start()
    with capturedLogs() as events:
        last_worker(h.reactor).err(b"Segmentation fault")
        last_worker(h.reactor).exit(None, 11)
    assert any(e.get("line") == "Segmentation fault" for e in events)
    message = failure_of(started).value.message
    assert "killed by SIGSEGV" in message and "Segmentation fault" in failure_logged(events)


def test_an_endless_stderr_line_is_cut_not_hoarded() -> None:
    """stderr without a newline (a progress bar) is logged once it passes 64 KiB rather than held forever."""
    h = harness()
    h.supervisor.start()
    with capturedLogs() as events:
        last_worker(h.reactor).err(b"\r 10%" * 10000)
        last_worker(h.reactor).err(b"\r 11%" * 5000)
    [line] = [e["line"] for e in events if e.get("stream") == "stderr"]
    assert line.endswith("11%") and len(line) == 75000


def test_stdout_after_the_handshake_is_logged_not_parsed() -> None:
    """Lines on stdout after the handshake are logged with the engine and change nothing."""
    h = harness()
    worker = up(h)
    with capturedLogs() as events:
        worker.out(b'{"ready":true,"contract":9,"engine":"tone","listen":"tcp:1.2.3.4:5"}\n')
    assert [e["line"] for e in events if e.get("stream") == "stdout"] == [
        '{"ready":true,"contract":9,"engine":"tone","listen":"tcp:1.2.3.4:5"}'
    ]
    assert h.supervisor.state == "up" and h.supervisor.listen == SOCKET
    with capturedLogs() as events:
        worker.out(b"no newline at the end")
        worker.exit(0)
    assert [e["line"] for e in events if e.get("stream") == "stdout"] == ["no newline at the end"]


def test_crash_restarts_after_a_growing_backoff() -> None:
    """An exit the core did not ask for restarts the worker after 1, 2, 4 s, capped by backoff_cap."""
    h = harness(backoff_cap=5.0)
    up(h)
    for delay in (1.0, 2.0, 4.0, 5.0):
        spawned = len(h.reactor.spawned)
        last_worker(h.reactor).exit(None, 9)
        assert h.supervisor.state == "starting"
        h.reactor.advance(delay - 0.01)
        assert len(h.reactor.spawned) == spawned
        h.reactor.advance(0.01)
        assert len(h.reactor.spawned) == spawned + 1
        last_worker(h.reactor).handshake()
        assert h.supervisor.state == "up"
    assert h.supervisor.restarts == 4
    assert "exited unexpectedly (killed by SIGKILL)" in (h.supervisor.last_error or "")


def test_a_start_during_backoff_waits_for_the_restart() -> None:
    """start() while a restart is scheduled fires when the restarted worker is up."""
    h = harness()
    up(h)
    last_worker(h.reactor).exit(1)
    started = h.supervisor.start()
    assert not started.called
    h.reactor.advance(1.0)
    last_worker(h.reactor).handshake()
    assert result_of(started) == SOCKET


def test_too_many_crashes_within_the_window_fail() -> None:
    """More than max_restarts crashes within restart_decay leave it failed, and start() says so with the count."""
    h = harness(max_restarts=2, restart_decay=60.0)
    up(h)
    last_worker(h.reactor).exit(1)
    h.reactor.advance(1)
    last_worker(h.reactor).handshake()
    last_worker(h.reactor).exit(1)
    h.reactor.advance(2)
    last_worker(h.reactor).err(b"CUDA error: device-side assert\n")
    last_worker(h.reactor).handshake()
    last_worker(h.reactor).exit(1)
    assert h.supervisor.state == "failed"
    assert h.reactor.getDelayedCalls() == []
    error = failure_of(h.supervisor.start()).value
    assert isinstance(error, ModelUnavailable)
    assert "failed 3 times within 60 s" in error.message and "exit code 1" in error.message
    assert h.supervisor.health()["process"] == "failed"
    assert h.supervisor.health()["restarts"] == 3
    assert len(h.reactor.spawned) == 3


def test_failed_starts_count_as_crashes() -> None:
    """A worker that never gets as far as its handshake ends failed instead of being retried forever."""
    h = harness(max_restarts=1)
    first = h.supervisor.start()
    last_worker(h.reactor).exit(1)
    failure_of(first)
    h.reactor.advance(1)
    last_worker(h.reactor).exit(1)
    assert h.supervisor.state == "failed"
    assert len(h.reactor.spawned) == 2


def test_crashes_spread_beyond_the_window_keep_restarting() -> None:
    """Crashes further apart than restart_decay never add up to a failure, and the backoff starts over."""
    h = harness(max_restarts=1, restart_decay=60.0)
    up(h)
    for _ in range(5):
        h.reactor.advance(61)
        last_worker(h.reactor).exit(1)
        assert h.supervisor.restarts == 1
        h.reactor.advance(1.0)
        last_worker(h.reactor).handshake()
        assert h.supervisor.state == "up"
    assert len(h.reactor.spawned) == 6
    h.reactor.advance(61)
    assert h.supervisor.restarts == 0


def test_stop_with_the_verb_landing_sends_no_signal() -> None:
    """stop() asks with the terminate verb; if it lands, no signal is sent and the exit is not a crash."""
    h = harness()
    worker = up(h)
    stopped = h.supervisor.stop()
    [(listen, answer)] = h.verbs
    assert listen == SOCKET
    answer.callback(True)
    h.reactor.advance(5)
    assert h.kills == [] and worker.signals == []
    assert h.supervisor.state == "draining" and not stopped.called
    worker.exit(0)
    assert result_of(stopped) is None
    assert h.kills == [(1000, KILL)]  # the sweep of what the worker left in its group
    assert h.supervisor.state == "down" and h.supervisor.restarts == 0
    assert h.reactor.getDelayedCalls() == []
    h.reactor.advance(3600)
    assert len(h.reactor.spawned) == 1


def test_verb_answered_at_once_works() -> None:
    """A terminate callable that answers synchronously is handled like one that answers later."""
    h = harness(terminate=lambda listen: succeed(False))
    up(h)
    h.supervisor.stop()
    assert h.kills == [(1000, TERM)]


def test_verb_not_landing_sends_sigterm() -> None:
    """When the verb does not land (or fails), the process group gets SIGTERM."""
    h = harness()
    worker = up(h)
    stopped = h.supervisor.stop(ask=True)
    h.verbs[0][1].errback(ConnectionRefusedError("no"))
    assert h.kills == [(1000, TERM)]
    worker.exit(0)
    result_of(stopped)
    assert h.supervisor.state == "down" and h.supervisor.restarts == 0


def test_no_exit_within_the_grace_gets_sigkill() -> None:
    """A worker that took the verb and hung is SIGKILLed drain_grace after stop(); that exit is no crash either."""
    h = harness(drain_grace=10.0)
    worker = up(h)
    stopped = h.supervisor.stop()
    h.verbs[0][1].callback(True)
    h.reactor.advance(9.9)
    assert h.kills == []
    h.reactor.advance(0.1)
    assert h.kills == [(1000, KILL)]
    h.reactor.advance(KILL_WAIT_SECONDS / 2)
    worker.exit(None, 9)
    result_of(stopped)
    assert h.supervisor.state == "down" and h.supervisor.restarts == 0
    assert h.reactor.getDelayedCalls() == []


def test_stop_without_asking_sends_sigterm_at_once() -> None:
    """stop(ask=False), the shutdown path, signals the group at once without the verb."""
    h = harness()
    worker = up(h)
    stopped = h.supervisor.stop(ask=False)
    assert h.kills == [(1000, TERM)] and h.verbs == []
    worker.exit(0)
    result_of(stopped)
    assert h.reactor.getDelayedCalls() == []


def test_signal_falls_back_to_the_process() -> None:
    """When the group cannot be signalled (not yet its own leader) the process itself is."""
    h = harness()
    worker = up(h)
    h.group_missing = True
    h.supervisor.stop(ask=False)
    assert worker.signals == [int(TERM)]


def test_stop_is_idempotent() -> None:
    """A second stop() joins the first: one signal, both fire at the exit; stop() while down fires at once."""
    h = harness()
    worker = up(h)
    first, second = h.supervisor.stop(ask=False), h.supervisor.stop(ask=False)
    assert h.kills == [(1000, TERM)]
    worker.exit(0)
    result_of(first)
    result_of(second)
    result_of(h.supervisor.stop())
    assert h.reactor.getDelayedCalls() == []


def test_start_during_draining_starts_again_after_the_exit() -> None:
    """start() while stopping waits for the exit, then spawns a fresh worker without a backoff."""
    h = harness()
    worker = up(h)
    stopped = h.supervisor.stop(ask=False)
    started = h.supervisor.start()
    assert not started.called
    worker.exit(0)
    result_of(stopped)
    assert len(h.reactor.spawned) == 2 and h.supervisor.state == "starting"
    last_worker(h.reactor).handshake()
    assert result_of(started) == SOCKET
    assert h.supervisor.restarts == 0


def test_a_stop_after_a_start_during_draining_wins() -> None:
    """stop(), start(), stop(): the worker stays down and the start is told why."""
    h = harness()
    worker = up(h)
    h.supervisor.stop(ask=False)
    started = h.supervisor.start()
    h.supervisor.stop(ask=False)
    assert "stopped before it was up" in failure_of(started).value.message
    worker.exit(0)
    assert h.supervisor.state == "down" and len(h.reactor.spawned) == 1


def test_stop_while_starting_signals_and_fails_the_start() -> None:
    """stop() before the handshake has no address to ask, so it sends SIGTERM, and the pending start() fails."""
    h = harness()
    started = h.supervisor.start()
    stopped = h.supervisor.stop(ask=True)
    assert h.verbs == [] and h.kills == [(1000, TERM)]
    assert "stopped before it was up" in failure_of(started).value.message
    last_worker(h.reactor).handshake()
    assert h.supervisor.state == "draining"
    last_worker(h.reactor).exit(0)
    result_of(stopped)
    assert h.supervisor.state == "down"
    assert h.reactor.getDelayedCalls() == []


def test_stop_during_backoff_cancels_the_restart() -> None:
    """stop() while a restart is scheduled cancels it and fires at once."""
    h = harness()
    up(h)
    last_worker(h.reactor).exit(1)
    waiting = h.supervisor.start()
    result_of(h.supervisor.stop())
    failure_of(waiting)
    assert h.supervisor.state == "down" and h.reactor.getDelayedCalls() == []
    h.reactor.advance(60)
    assert len(h.reactor.spawned) == 1


def test_stop_resets_failed_and_a_fresh_start_keeps_the_count() -> None:
    """stop() takes a failed worker down; the next start() spawns, and crashes still count within the window."""
    h = harness(max_restarts=0)
    up(h)
    last_worker(h.reactor).exit(1)
    assert h.supervisor.state == "failed"
    result_of(h.supervisor.stop())
    assert h.supervisor.state == "down"
    up(h)
    last_worker(h.reactor).exit(1)
    assert h.supervisor.state == "failed"
    assert h.supervisor.restarts == 2


def test_late_verb_answer_is_ignored() -> None:
    """A verb that answers after its worker has exited signals nobody, not even the next worker being stopped."""
    h = harness()
    worker = up(h)
    h.supervisor.stop()
    worker.exit(0)
    up(h)
    h.supervisor.stop()
    h.verbs[0][1].callback(False)
    assert h.kills == [(1000, KILL)]  # only the sweep after the first exit
    h.verbs[1][1].callback(False)
    assert h.kills == [(1000, KILL), (1001, TERM)]


def test_verb_answering_once_down_is_dropped() -> None:
    """A verb answering after its worker exited and the supervisor went down changes nothing and raises nothing."""
    h = harness()
    worker = up(h)
    h.supervisor.stop()
    worker.exit(0)
    [(_, answer)] = h.verbs
    answer.callback(False)
    assert result_of(answer) is None
    assert h.supervisor.state == "down" and h.kills == [(1000, KILL)]


def test_spawn_error_fails_the_start() -> None:
    """A spawn that raises fails start() and counts like a crash."""
    h = harness()
    h.reactor.spawn_error = OSError(11, "Resource temporarily unavailable")
    error = failure_of(h.supervisor.start()).value
    assert "could not spawn worker tone" in error.message
    assert h.supervisor.state == "starting" and h.supervisor.restarts == 1
    h.reactor.spawn_error = None
    h.reactor.advance(1)
    assert len(h.reactor.spawned) == 1


def test_cancelled_start_leaves_the_supervisor_working() -> None:
    """A caller that cancels its start() (a client hung up) does not break the others."""
    h = harness()
    cancelled, kept = h.supervisor.start(), h.supervisor.start()
    cancelled.cancel()
    failure_of(cancelled)
    last_worker(h.reactor).handshake()
    assert result_of(kept) == SOCKET


def test_health_reports_pid_restarts_and_last_error() -> None:
    """health() names the process state, its pid while there is one, the restart count and the last error."""
    h = harness()
    assert h.supervisor.health() == {"process": "down", "restarts": 0}
    up(h)
    last_worker(h.reactor).err(b"oops\n")
    last_worker(h.reactor).exit(3)
    health = h.supervisor.health()
    assert health["process"] == "starting" and health["restarts"] == 1 and "pid" not in health
    assert "exit code 3" in health["lastError"] and "oops" not in health["lastError"]


def test_a_hung_worker_is_killed_and_counted_as_a_crash() -> None:
    """
    A worker found not answering (the watchdog's word) is SIGKILLed as a group; its
    exit is a crash: its model is forgotten, health names why, and a new one is started
    after the backoff.
    """
    crashed: list[bool] = []
    h = harness(on_crash=lambda: crashed.append(True))
    up(h)
    h.supervisor.hung("did not answer GET /health within 15 s")
    assert h.kills == [(1000, KILL)]
    assert h.supervisor.state == "draining"
    last_worker(h.reactor).exit(None, 9)
    assert crashed == [True]
    health = h.supervisor.health()
    assert health["process"] == "starting" and health["restarts"] == 1
    assert "did not answer GET /health within 15 s" in health["lastError"]
    h.reactor.advance(1)
    assert len(h.reactor.spawned) == 2


def test_a_hung_report_about_a_worker_already_gone_is_ignored() -> None:
    """
    The watchdog may report a worker that has since exited: nothing happens.
    """
    h = harness()
    h.supervisor.hung("late")
    assert h.supervisor.state == "down" and h.kills == []


# -- gone once reaped, however long its pipes stay open -----------------------------------


class Reader:
    """
    What a process transport reads a child's output from: a real pipe, so it has an inode.
    """

    def __init__(self) -> None:
        self.read, self.write = os.pipe()

    def fileno(self) -> int:
        return self.read

    def close(self) -> None:
        os.close(self.read)
        os.close(self.write)


def test_a_worker_reaped_with_its_pipes_held_is_gone_after_the_grace_and_the_holder_reported() -> None:
    """
    A worker reaped while something outside its group holds its stdout and stderr is
    gone PIPE_GRACE_SECONDS later, not when its pipes close: the stop answers, the pipes
    are closed on this side, and what holds them is named in the log and in health()
    until it exits.
    """
    asked: list[list[int]] = []
    alive = {4321}

    def holders(inodes: list[int]) -> list[int]:
        asked.append(inodes)
        return sorted(alive)

    h = harness(holders=holders)
    worker = up(h)
    readers = {1: Reader(), 2: Reader()}
    worker.pipes = readers
    try:
        stopped = h.supervisor.stop()
        h.verbs[0][1].callback(True)
        with capturedLogs() as events:
            worker.reap(0)
            assert not stopped.called and h.kills == [(1000, KILL)]  # the group swept
            h.reactor.advance(PIPE_GRACE_SECONDS)
        result_of(stopped)
        assert h.supervisor.state == "down" and worker.closed == [1, 2]
        assert asked == [[os.fstat(readers[fd].read).st_ino for fd in (1, 2)]]
        warned = [e for e in events if e.get("log_level") == LogLevel.warn]
        assert len(warned) == 1 and warned[0]["strays"] == [4321]
        assert "outside its process group" in warned[0]["log_format"]
        monkey_alive = pytest.MonkeyPatch()
        monkey_alive.setattr("rhapsode._fleet.supervisor._alive", lambda pid: pid in alive)
        try:
            assert [stray["pid"] for stray in h.supervisor.health()["strays"]] == [4321]
            alive.clear()
            assert "strays" not in h.supervisor.health()
        finally:
            monkey_alive.undo()
        worker.proto.processEnded(Failure(ProcessDone(0)))  # the pipes close at last: told once only
        assert h.supervisor.state == "down" and h.supervisor.restarts == 0
    finally:
        for reader in readers.values():
            reader.close()


def test_a_worker_whose_pipes_close_at_its_exit_is_gone_at_once_with_its_last_words() -> None:
    """
    The usual exit: the pipes close as the group goes, and the exit is told then, with
    the stderr that came before it, and no grace timer is left behind.
    """
    h = harness(max_restarts=0)
    up(h)
    worker = last_worker(h.reactor)
    worker.err(b"Traceback: the last words\n")
    with capturedLogs() as events:
        worker.exit(1)
    assert h.supervisor.state == "failed"
    assert any("the last words" in str(e.get("tail", "")) for e in events)
    assert h.reactor.getDelayedCalls() == []


def test_a_worker_sigkill_does_not_end_is_given_up_on_and_its_late_exit_ignored() -> None:
    """
    A worker that SIGKILL does not end (stuck in the kernel) stops being waited for
    KILL_WAIT_SECONDS after the signal: the stop answers, the engine can start again,
    and the old process's exit when it comes changes nothing.
    """
    h = harness(drain_grace=10.0)
    old = up(h)
    stopped = h.supervisor.stop()
    h.verbs[0][1].callback(True)
    h.reactor.advance(10.0)
    assert h.kills == [(1000, KILL)] and not stopped.called
    with capturedLogs() as events:
        h.reactor.advance(KILL_WAIT_SECONDS)
    result_of(stopped)
    assert h.supervisor.state == "down"
    assert any("given up on" in e.get("log_format", "") for e in events)
    started = h.supervisor.start()
    last_worker(h.reactor).handshake()
    assert result_of(started) == SOCKET
    old.exit(None, 9)
    assert h.supervisor.state == "up" and h.supervisor.restarts == 0
