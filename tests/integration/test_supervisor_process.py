"""
The worker supervisor against real worker processes on Unix sockets (protocol.md
sections 2 and 3): the tone worker started, crashed and restarted, stopped by the
terminate verb and by SIGTERM, an adapter's own child process taken down with it, and
workers that never hand-shake or die on import.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import pytest
import pytest_twisted
from treq.client import HTTPClient
from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater
from twisted.logger import capturedLogs
from twisted.web.client import Agent, HTTPConnectionPool

from rhapsode._fleet.supervisor import WorkerSupervisor
from rhapsode_worker import Internal, ModelUnavailable

from _worker import UnixEndpoints, process_alive

HERE = Path(__file__).parent
TEST_MODULES = {"PYTHONPATH": str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")}
BOUND = 20.0


def http(reactor: Any, listen: str) -> HTTPClient:
    """
    A client for the worker at a C{unix:} listen address, keeping no connections.
    """
    endpoints = UnixEndpoints(reactor, listen[len("unix:"):])
    return HTTPClient(Agent.usingEndpointFactory(reactor, endpoints, pool=HTTPConnectionPool(reactor, persistent=False)))


def terminate_verb(reactor: Any) -> Callable[[str], "Deferred[bool]"]:
    """
    POST /terminate, as the router will do it: whether the worker took the verb.
    """

    def terminate(listen: str) -> "Deferred[bool]":
        async def ask() -> bool:
            response = await http(reactor, listen).post("http://worker/terminate")
            await response.content()
            return bool(response.code == 202)

        return Deferred.fromCoroutine(ask()).addTimeout(5, reactor)

    return terminate


async def health(reactor: Any, listen: str) -> dict[str, Any]:
    response = await http(reactor, listen).get("http://worker/health").addTimeout(5, reactor)
    assert response.code == 200
    return dict(json.loads(await response.content()))


async def within(reactor: Any, deferred: "Deferred[Any]", seconds: float = BOUND) -> Any:
    return await deferred.addTimeout(seconds, reactor)


async def eventually(reactor: Any, check: Callable[[], bool], seconds: float = BOUND) -> None:
    deadline = reactor.seconds() + seconds
    while not check():
        assert reactor.seconds() < deadline, "gave up waiting"
        await deferLater(reactor, 0.05, lambda: None)


class Supervisors:
    """
    Builds supervisors for one test and stops whatever they left running.
    """

    def __init__(self, reactor: Any, tmp: Path) -> None:
        self.reactor = reactor
        self.tmp = tmp
        self.made: list[WorkerSupervisor] = []
        self.signals: list[tuple[int, int]] = []

    def kill(self, pid: int, number: int) -> None:
        self.signals.append((pid, number))
        os.killpg(pid, number)

    def __call__(self, module: str = "rhapsode_engine_tone", engine: str = "tone", **overrides: Any) -> WorkerSupervisor:
        settings: dict[str, Any] = dict(
            reactor=self.reactor,
            python=sys.executable,
            module=module,
            listen=f"unix:{self.tmp}/{engine}.sock",
            voice_dir=str(self.tmp / "voices"),
            env=TEST_MODULES,
            contract=1,
            startup_timeout=BOUND,
            drain_grace=5.0,
            max_restarts=3,
            restart_decay=60.0,
            terminate=terminate_verb(self.reactor),
            kill=self.kill,
        )
        settings.update(overrides)
        supervisor = WorkerSupervisor(engine, **settings)
        self.made.append(supervisor)
        return supervisor


@pytest_twisted.async_yield_fixture()
async def supervisors(reactor: Any, tmp_path: Path) -> AsyncIterator[Supervisors]:
    made = Supervisors(reactor, tmp_path)
    yield made
    for supervisor in made.made:
        await within(reactor, supervisor.stop(ask=False))


@pytest_twisted.ensureDeferred
async def test_tone_worker_is_restarted_after_a_crash_and_stopped(reactor: Any, supervisors: Supervisors) -> None:
    """The supervised tone worker answers, leads its own process group, comes back after kill -9, and stays gone after stop(ask=False)."""
    supervisor = supervisors()
    listen = await within(reactor, supervisor.start())
    assert listen == f"unix:{supervisors.tmp}/tone.sock"
    assert (await health(reactor, listen))["process"] == "up"
    first = supervisor.pid
    assert first is not None and os.getpgid(first) == first

    os.kill(first, signal.SIGKILL)
    await eventually(reactor, lambda: supervisor.state == "up" and supervisor.pid != first)
    assert not process_alive(first)
    assert (await health(reactor, supervisor.listen or ""))["process"] == "up"
    assert supervisor.restarts == 1
    assert "killed by SIGKILL" in (supervisor.last_error or "")

    second = supervisor.pid
    assert second is not None
    await within(reactor, supervisor.stop(ask=False))
    assert (second, signal.SIGTERM) in supervisors.signals
    assert not process_alive(second)
    await deferLater(reactor, 1.5, lambda: None)  # longer than the first backoff
    assert supervisor.state == "down" and supervisor.pid is None
    assert supervisor.restarts == 1


@pytest_twisted.ensureDeferred
async def test_stop_asks_with_the_terminate_verb(reactor: Any, supervisors: Supervisors) -> None:
    """stop() sends POST /terminate; the worker drains and exits without a SIGTERM, and is not restarted."""
    supervisor = supervisors()
    await within(reactor, supervisor.start())
    pid = supervisor.pid
    assert pid is not None
    await within(reactor, supervisor.stop())
    assert (pid, signal.SIGTERM) not in supervisors.signals
    assert not process_alive(pid)
    assert supervisor.state == "down" and supervisor.restarts == 0
    assert await within(reactor, supervisor.start()) == f"unix:{supervisors.tmp}/tone.sock"


@pytest_twisted.ensureDeferred
async def test_stop_takes_the_adapters_own_children(reactor: Any, supervisors: Supervisors) -> None:
    """A child process an adapter started goes with the worker when it is stopped, promptly, though it holds the worker's pipes."""
    pid_file = supervisors.tmp / "helper.pid"
    supervisor = supervisors(
        module="forking_engine",
        engine="forking",
        env={**TEST_MODULES, "FORKING_PID_FILE": str(pid_file)},
        drain_grace=60.0,
    )
    listen = await within(reactor, supervisor.start())
    response = await http(reactor, listen).post("http://worker/load", json={}).addTimeout(BOUND, reactor)
    assert response.code == 200, await response.content()
    await response.content()
    helper = int(pid_file.read_text())
    assert process_alive(helper) and os.getpgid(helper) == supervisor.pid

    await within(reactor, supervisor.stop(), 10.0)
    await eventually(reactor, lambda: not process_alive(helper), 5.0)
    assert supervisor.state == "down"


async def loaded_forking(reactor: Any, supervisors: Supervisors, **overrides: Any) -> tuple[WorkerSupervisor, int]:
    """
    The forking engine with its helper in a session of its own, loaded: the supervisor
    and the helper's pid.
    """
    pid_file = supervisors.tmp / "helper.pid"
    env = {**TEST_MODULES, "FORKING_PID_FILE": str(pid_file), "FORKING_NEW_SESSION": "1"}
    supervisor = supervisors(module="forking_engine", engine="forking", env=env, **overrides)
    listen = await within(reactor, supervisor.start())
    response = await http(reactor, listen).post("http://worker/load", json={}).addTimeout(BOUND, reactor)
    assert response.code == 200, await response.content()
    await response.content()
    helper = int(pid_file.read_text())
    assert process_alive(helper) and os.getsid(helper) == helper != supervisor.pid
    return supervisor, helper


def named(events: list[dict[str, Any]], pid: int) -> bool:
    from twisted.logger import formatEvent

    return any(str(pid) in formatEvent(event) and "process group" in formatEvent(event) for event in events)


@pytest_twisted.ensureDeferred
async def test_a_helper_in_its_own_session_holding_the_pipes_does_not_keep_a_stop_waiting(
    reactor: Any, supervisors: Supervisors
) -> None:
    """
    A helper that started a session of its own and keeps the worker's stdout and stderr
    open survives the worker's process group: stop() still answers once the worker has
    been reaped, not when the helper dies, and the helper is named in the log and in
    health() as a stray; the engine starts again.
    """
    supervisor, helper = await loaded_forking(reactor, supervisors)
    try:
        with capturedLogs() as events:
            await within(reactor, supervisor.stop(), 15.0)
        assert supervisor.state == "down" and process_alive(helper)
        assert named(events, helper)
        assert [stray["pid"] for stray in supervisor.health()["strays"]] == [helper]
        await within(reactor, supervisor.start())
        assert supervisor.state == "up"
    finally:
        os.kill(helper, signal.SIGKILL)
    await eventually(reactor, lambda: "strays" not in supervisor.health(), 5.0)


@pytest_twisted.ensureDeferred
async def test_a_worker_killed_under_a_helper_holding_its_pipes_is_found_gone_and_restarted(
    reactor: Any, supervisors: Supervisors
) -> None:
    """
    A worker that dies while a helper in its own session holds its pipes is a crash as
    soon as it is reaped: it is restarted, rather than taken to be up until the helper
    dies.
    """
    supervisor, helper = await loaded_forking(reactor, supervisors)
    first = supervisor.pid
    assert first is not None
    try:
        os.kill(first, signal.SIGKILL)
        await eventually(reactor, lambda: supervisor.state == "up" and supervisor.pid != first, 15.0)
        assert "killed by SIGKILL" in (supervisor.last_error or "")
        assert [stray["pid"] for stray in supervisor.health()["strays"]] == [helper]
    finally:
        os.kill(helper, signal.SIGKILL)


@pytest_twisted.ensureDeferred
async def test_a_worker_that_never_hand_shakes_fails_after_the_timeout(reactor: Any, supervisors: Supervisors) -> None:
    """
    A worker silent past the startup timeout fails start() as retryable, its stderr in
    the log and not the message, and no process remains.
    """
    supervisor = supervisors(module="mute_worker", engine="mute", startup_timeout=1.5, max_restarts=0)
    with capturedLogs() as events:
        started = supervisor.start()
        pid = supervisor.pid
        assert pid is not None
        with pytest.raises(ModelUnavailable) as caught:
            await within(reactor, started)
    assert "did not hand-shake within 1.5 s" in caught.value.message
    assert "warming up forever" not in caught.value.message
    assert any("mute worker: warming up forever" in str(e.get("tail", "")) for e in events)
    await eventually(reactor, lambda: supervisor.state == "failed", 5.0)
    assert not process_alive(pid)
    with pytest.raises(ModelUnavailable):
        await within(reactor, supervisor.start())


@pytest_twisted.ensureDeferred
async def test_a_worker_that_dies_on_import_fails_with_its_stderr(reactor: Any, supervisors: Supervisors) -> None:
    """
    A worker that exits before its handshake (an import error) fails start() as
    internal, not retryable, naming the exit and no path; the traceback it wrote on
    stderr is in the log.
    """
    supervisor = supervisors(module="rhapsode_engine_nonexistent", engine="ghost", max_restarts=0)
    with capturedLogs() as events:
        with pytest.raises(Internal) as caught:
            await within(reactor, supervisor.start())
    assert "exited before its handshake (exit code 1)" in caught.value.message
    assert not caught.value.retryable and "/" not in caught.value.message
    assert any("No module named rhapsode_engine_nonexistent" in str(e.get("tail", "")) for e in events)
    assert supervisor.state == "failed"
