"""
The installer's command runner against real short processes on the real reactor
(pytest-twisted): output lines as log events, a failure's message, the wall timeout and
the silence watchdog killing the whole process group (a grandchild included), a stop
from the job's context, and the group leader that takes its group down when the core
that started it goes away.  Every process is bounded to a few seconds and killed in
a finally.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater

from rhapsode._manage.installer import GROUP_LEADER, Commands
from rhapsode._manage.jobs import Job, JobContext, JobFailed

from _deferreds import process_alive

BOUND = 60.0  # a hang guard: a real command started and ended, returned from at once


@pytest.fixture
def reactor() -> Any:
    """
    The global reactor, which pytest-twisted runs (imported here, never at module level).
    """
    from twisted.internet import reactor as running

    return running



def kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def context_for(reactor: Any) -> JobContext:
    return Job("JOB", "kokoro", "install", reactor).context


def logged(context: JobContext) -> list[str]:
    out = []
    for _, frame in context.job.events.after(0)[1]:
        event = json.loads(frame.decode().split("\n")[2][len("data: "):])
        if event["kind"] == "log":
            out.append(event["message"])
    return out


async def run(reactor: Any, context: JobContext, argv: Sequence[str], environ: dict[str, str] | None = None,
              **limits: Any) -> None:
    commands = Commands(reactor, environ if environ is not None else dict(os.environ))
    await Deferred.fromCoroutine(commands.run(context, argv, **limits)).addTimeout(BOUND, reactor)


async def failed(reactor: Any, context: JobContext, argv: Sequence[str], **limits: Any) -> str:
    """
    Run a command that must fail; answers the job error's message.
    """
    try:
        await run(reactor, context, argv, **limits)
    except JobFailed as failure:
        return failure.error.message
    raise AssertionError(f"{argv} did not fail")


async def eventually_gone(reactor: Any, pid: int, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while process_alive(pid):
        assert time.monotonic() < deadline, f"process {pid} is still alive"
        await deferLater(reactor, 0.05, lambda: None)


@pytest_twisted.ensureDeferred
async def test_each_line_a_command_prints_is_a_log_event(reactor: Any) -> None:
    """
    The command line itself first, then each line of stdout and stderr, a line redrawn
    with \\r counting as one each time, blank lines dropped.
    """
    context = context_for(reactor)
    argv = ["sh", "-c", "echo one; echo two >&2; printf 'Progress 1 of 2\\rProgress 2 of 2\\n\\n'; printf tail"]
    await run(reactor, context, argv)
    lines = logged(context)
    assert lines[0] == "$ " + " ".join(argv)
    assert sorted(lines[1:]) == sorted(["one", "two", "Progress 1 of 2", "Progress 2 of 2", "tail"])
    assert lines.index("Progress 1 of 2") < lines.index("Progress 2 of 2")


@pytest_twisted.ensureDeferred
async def test_on_line_takes_the_output_instead_of_the_events(reactor: Any) -> None:
    """
    With on_line, what the command prints goes there (how a version is asked for).
    """
    context = context_for(reactor)
    heard: list[str] = []
    await run(reactor, context, [sys.executable, "-c", "print('3.11.7')"], on_line=heard.append)
    assert heard == ["3.11.7"]
    assert len(logged(context)) == 1  # only the command line


@pytest_twisted.ensureDeferred
async def test_a_non_zero_exit_names_the_command_its_status_and_the_reason(reactor: Any) -> None:
    """
    <command> exited N: <the line that says why>, not the line it printed last.
    """
    context = context_for(reactor)
    message = await failed(reactor, context, [
        sys.executable, "-c",
        "import sys; print('Collecting x'); print('ERROR: No matching distribution found for x'); "
        "print('[notice] A new release of pip is available'); sys.exit(3)",
    ])
    assert message.endswith(" exited 3: ERROR: No matching distribution found for x"), message
    assert message.startswith(Path(sys.executable).name)


@pytest_twisted.ensureDeferred
async def test_a_pip_command_is_named_pip_and_its_verb(reactor: Any) -> None:
    """
    python -m pip install ... is named "pip install" in the message.
    """
    context = context_for(reactor)
    message = await failed(reactor, context, [sys.executable, "-m", "pip", "install", "--no-index",
                                              "rhapsode-no-such-package-xyz"])
    assert message.startswith("pip install exited 1: ")
    assert "rhapsode-no-such-package-xyz" in message


@pytest_twisted.ensureDeferred
async def test_a_program_that_does_not_exist_exits_127_saying_so(reactor: Any) -> None:
    """
    The leader cannot exec it: 127 and the reason, as a shell would.
    """
    context = context_for(reactor)
    message = await failed(reactor, context, ["/nonexistent/uv", "venv"])
    assert "exited 127" in message and "No such file or directory" in message


@pytest_twisted.ensureDeferred
async def test_a_command_killed_by_a_signal_says_which(reactor: Any) -> None:
    """
    The command (not the leader) dies by SIGKILL: "was killed by SIGKILL".
    """
    context = context_for(reactor)
    message = await failed(reactor, context, ["sh", "-c", "echo going; kill -9 $$"])
    assert "was killed by SIGKILL" in message


@pytest_twisted.ensureDeferred
async def test_a_command_reads_no_stdin(reactor: Any) -> None:
    """
    The command's stdin is /dev/null: one that reads it (a prompt) gets end of file
    at once rather than waiting for the core.
    """
    context = context_for(reactor)
    await run(reactor, context, ["sh", "-c", "cat; echo read-eof"])
    assert "read-eof" in logged(context)


@pytest_twisted.ensureDeferred
async def test_a_command_runs_with_the_built_environment(reactor: Any) -> None:
    """
    The environment is built from the server's: VIRTUAL_ENV dropped, PIP_ kept,
    PYTHONUNBUFFERED added.
    """
    context = context_for(reactor)
    environ = {"PATH": os.environ.get("PATH", os.defpath), "VIRTUAL_ENV": "/work/main/.venv",
               "PIP_FIND_LINKS": "/opt/wheels", "PYTHONPATH": "/elsewhere"}
    await run(reactor, context, ["sh", "-c", 'echo "V=${VIRTUAL_ENV:-unset} P=${PYTHONPATH:-unset} '
                                 'F=$PIP_FIND_LINKS U=$PYTHONUNBUFFERED"'], environ=environ)
    assert "V=unset P=unset F=/opt/wheels U=1" in logged(context)


@pytest_twisted.ensureDeferred
async def test_the_timeout_kills_the_whole_process_group_grandchild_included(reactor: Any) -> None:
    """
    Past its limit the command's group gets SIGTERM: the shell and the sleep it left in
    the background (a build backend's compiler) both go, and the job says why.
    """
    context = context_for(reactor)
    pids: list[int] = []

    def line(text: str) -> None:
        if text.isdigit():
            pids.append(int(text))

    try:
        message = await failed(reactor, context, ["sh", "-c", "sleep 300 & echo $!; wait"], timeout=1.0,
                               on_line=line)
        assert message.endswith("was stopped: ran past its 1 s limit"), message
        assert len(pids) == 1
        await eventually_gone(reactor, pids[0])
    finally:
        for pid in pids:
            kill_quietly(pid)


@pytest_twisted.ensureDeferred
async def test_the_silence_watchdog_stops_a_command_that_prints_nothing(reactor: Any) -> None:
    """
    Nothing printed for `silence` seconds: stopped, though its wall limit is far off.
    """
    context = context_for(reactor)
    message = await failed(reactor, context, ["sh", "-c", "echo hi; exec sleep 300"], timeout=60.0, silence=1.0)
    # The silence watchdog's words, not the wall limit's: the one that stopped it.
    assert message.endswith("was stopped: printed nothing for 1 s"), message


@pytest_twisted.ensureDeferred
async def test_output_puts_the_silence_watchdog_off(reactor: Any) -> None:
    """
    A command that prints every 0.3 s runs past a 1 s silence limit to its end.
    """
    context = context_for(reactor)
    await run(reactor, context, ["sh", "-c", "for i in 1 2 3 4 5 6 7; do echo $i; sleep 0.3; done"],
              timeout=30.0, silence=1.0)
    assert [line for line in logged(context) if line.isdigit()] == [str(n) for n in range(1, 8)]


@pytest_twisted.ensureDeferred
async def test_stopping_the_job_stops_its_command(reactor: Any) -> None:
    """
    context.stop(why) (the server stopping) kills the running command's group; it fails
    with that reason, and a command asked for after the stop never starts.
    """
    context = context_for(reactor)
    commands = Commands(reactor, dict(os.environ))
    running = Deferred.fromCoroutine(commands.run(context, ["sh", "-c", "echo started; exec sleep 300"]))
    running.addTimeout(BOUND, reactor)
    # Once its command runs (the job can cancel it), however long spawning takes here.
    deadline = time.monotonic() + BOUND
    while context.cancel is None:
        assert time.monotonic() < deadline, "the command never started"
        await deferLater(reactor, 0.02, lambda: None)
    context.stop("install kokoro stopped by server shutdown")
    try:
        await running
    except JobFailed as failure:
        assert failure.error.message.endswith("was stopped: install kokoro stopped by server shutdown")
    else:
        raise AssertionError("the stopped command succeeded")
    assert context.cancel is None
    before = len(logged(context))
    with pytest.raises(JobFailed):
        await Deferred.fromCoroutine(commands.run(context, ["sh", "-c", "echo never"]))
    assert len(logged(context)) == before


@pytest_twisted.ensureDeferred
async def test_a_stopped_command_leaves_no_timer_behind(reactor: Any) -> None:
    """
    Once a stopped command's group has gone, nothing is still due to signal its
    process group id, which the system may hand to another process.
    """
    context = context_for(reactor)
    before = set(reactor.getDelayedCalls())
    await failed(reactor, context, ["sh", "-c", "exec sleep 300"], timeout=0.5)
    left = [call for call in reactor.getDelayedCalls() if call not in before and call.active()]
    assert [call.func for call in left if getattr(call.func, "__name__", "") == "kill_group"] == []


def test_the_group_leader_kills_its_group_when_the_core_goes() -> None:
    """
    The leader watches its stdin, a pipe from the core; closed (the core died), it
    SIGKILLs its whole group: the command and what the command left running.
    """
    leader = subprocess.Popen(
        [sys.executable, "-c", GROUP_LEADER, "sh", "-c", "sleep 300 & echo $!; exec sleep 301"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )
    grandchild = None
    try:
        assert leader.stdout is not None and leader.stdin is not None
        grandchild = int(leader.stdout.readline())
        assert os.getpgid(grandchild) == leader.pid
        assert os.getpgid(leader.pid) == leader.pid
        members = [int(p) for p in os.listdir("/proc") if p.isdigit() and _pgid(int(p)) == leader.pid]
        assert len(members) >= 3  # the leader, the command, its background sleep
        leader.stdin.close()
        leader.wait(timeout=30)
        assert leader.returncode == -signal.SIGKILL
        deadline = time.monotonic() + 30
        while any(process_alive(pid) for pid in members):
            assert time.monotonic() < deadline, [pid for pid in members if process_alive(pid)]
            time.sleep(0.05)
    finally:
        try:
            os.killpg(leader.pid, signal.SIGKILL)
        except OSError:
            pass
        if grandchild is not None:
            kill_quietly(grandchild)
        leader.wait(timeout=30)
        assert leader.stdout is not None
        leader.stdout.close()


def test_the_group_leader_exits_as_its_command_did() -> None:
    """
    0 for success, the command's status for a failure, 128 + N for signal N.
    """
    for script, expected in (("exit 0", 0), ("exit 7", 7), ("kill -TERM $$", 128 + signal.SIGTERM)):
        # Its stdin stays open while it runs, as the core's pipe does.
        leader = subprocess.Popen([sys.executable, "-c", GROUP_LEADER, "sh", "-c", script], stdin=subprocess.PIPE)
        try:
            assert leader.wait(timeout=60) == expected, script
        finally:
            assert leader.stdin is not None
            leader.stdin.close()
            if leader.poll() is None:
                leader.kill()
                leader.wait(timeout=5)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None
