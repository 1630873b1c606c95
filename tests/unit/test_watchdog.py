"""
The watchdog (rhapsode._fleet.watchdog) on a Clock: a worker that leaves GET /health
unanswered is found out in bounded time and killed (local) or fenced off (remote), and
a worker that answers, however busy, is left alone.
"""

from __future__ import annotations

import pytest
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from rhapsode._fleet.registry import EngineHandle, Registry
from rhapsode._fleet.watchdog import Watchdog
from rhapsode_protocol.errors import ModelUnavailable

from _fakes import FakeClient, FakeSupervisor


def held_client() -> FakeClient:
    """
    A worker's client whose health answers the test holds or gives.
    """
    return FakeClient(hold=True)


def up_supervisor(state: str = "up") -> FakeSupervisor:
    return FakeSupervisor(state, 7)


def watch(handle: EngineHandle) -> tuple[Watchdog, Clock]:
    clock = Clock()
    dog = Watchdog(Registry({handle.id: handle}), clock, interval=5, patience=15)
    dog.start()
    return dog, clock


def test_a_local_worker_that_never_answers_is_killed_within_interval_and_patience() -> None:
    """
    Asked at the first interval and silent for the patience after, a stopped worker is
    reported hung to its supervisor, at 20 s and not before.
    """
    client, supervisor = held_client(), up_supervisor()
    dog, clock = watch(EngineHandle("tone", client, supervisor))
    clock.advance(5)
    assert len(client.asked) == 1 and client.calls == [(b"GET", "/health")]
    clock.advance(14.9)
    assert supervisor.hangs == [] and len(client.asked) == 1  # one question at a time
    clock.advance(0.1)
    assert supervisor.hangs == ["did not answer GET /health within 15 s"]
    dog.stop()


def test_a_busy_worker_that_answers_is_left_alone() -> None:
    """
    A worker that answers each health check (from its event loop, while it synthesises)
    is never reported, however long it runs.
    """
    client, supervisor = held_client(), up_supervisor()
    dog, clock = watch(EngineHandle("tone", client, supervisor))
    for _ in range(20):
        clock.advance(5)
        clock.advance(3)
        client.asked[-1].callback((200, {"process": "up"}))
    assert supervisor.hangs == [] and len(client.asked) >= 10
    dog.stop()


def test_a_worker_that_is_not_up_is_not_asked() -> None:
    """
    A local worker that is down or starting is its supervisor's business: not asked.
    """
    client, supervisor = held_client(), up_supervisor(state="down")
    dog, clock = watch(EngineHandle("tone", client, supervisor))
    clock.advance(60)
    assert client.asked == []
    dog.stop()


def test_a_remote_worker_that_stops_answering_is_fenced_off_until_it_answers() -> None:
    """
    A remote worker cannot be killed: its connections are aborted (its streams end), it
    shows as down, and requests for it are refused as retryable model_unavailable at
    once, until a health check is answered again.
    """
    client = held_client()
    handle = EngineHandle("far", client, None)
    dog, clock = watch(handle)
    clock.advance(5)
    clock.advance(15)
    assert client.aborted == 1 and handle.health()["process"] == "down"
    assert "did not answer" in handle.health()["lastError"]
    case = SynchronousTestCase()
    refused = case.failureResultOf(Deferred.fromCoroutine(handle.ready()), ModelUnavailable)
    assert refused.value.retryable
    clock.advance(5)
    client.asked[-1].callback((200, {"process": "up"}))
    assert handle.unresponsive is None and handle.health()["process"] == "up"
    assert case.successResultOf(Deferred.fromCoroutine(handle.ready())) is client
    dog.stop()


def test_stopping_the_watchdog_cancels_its_questions() -> None:
    """
    A shutdown leaves no timer behind and reports nothing.
    """
    client, supervisor = held_client(), up_supervisor()
    dog, clock = watch(EngineHandle("tone", client, supervisor))
    clock.advance(5)
    dog.stop()
    assert clock.getDelayedCalls() == [] and supervisor.hangs == []


@pytest.mark.parametrize("seconds", [1.0, 4.9])
def test_nothing_is_asked_before_the_first_interval(seconds: float) -> None:
    """
    The first round is one interval after the start.
    """
    client, supervisor = held_client(), up_supervisor()
    dog, clock = watch(EngineHandle("tone", client, supervisor))
    clock.advance(seconds)
    assert client.asked == []
    dog.stop()
