"""
Residency.quiet on a L{Clock}: the lock an uninstall and a reinstall's register take, so
that nothing starts speaking on an engine while it is removed or swapped (protocol.md
section 10, "Uninstalling" and "Reinstalling").
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from zope.interface import implementer

from rhapsode._fleet.residency import Lease, Residency
from rhapsode._interfaces import IResidencySettings
from rhapsode_protocol.errors import Conflict


@implementer(IResidencySettings)
class Settings:
    def max_resident_models(self) -> int:
        return 2

    def eviction_wait_seconds(self) -> float:
        return 30.0

    def keep_alive_seconds(self) -> int:
        return 300

    def engine_keep_alive_seconds(self, engine: str) -> int | None:
        return None


class Harness:
    def __init__(self) -> None:
        self.clock = Clock()
        self.actions: list[tuple[str, str]] = []
        self.residency = Residency(
            clock=self.clock, settings=Settings(),
            terminate=lambda engine: self._act("terminate", engine),
            unload=lambda engine: self._act("unload", engine),
        )
        self.ran: list[str] = []

    def _act(self, verb: str, engine: str) -> Deferred[None]:
        self.actions.append((verb, engine))
        return succeed(None)

    def lease(self, engine: str) -> Lease:
        results: list[Any] = []
        Deferred.fromCoroutine(self.residency.acquire(engine, "base")).addBoth(results.append)
        assert results and isinstance(results[0], Lease), results
        lease: Lease = results[0]
        return lease

    def quiet(self, engine: str, wait: float | None, answer: str = "done") -> Deferred[str]:
        async def work() -> str:
            self.ran.append(engine)
            return answer

        return Deferred.fromCoroutine(self.residency.quiet(engine, work, wait))

    def resident(self) -> list[str]:
        return [m["engine"] for m in self.residency.snapshot()["models"]]


def outcome(deferred: Deferred[Any]) -> Any:
    results: list[Any] = []
    deferred.addBoth(results.append)
    assert results, "has not fired"
    return results[0]


def test_quiet_runs_at_once_on_an_idle_engine_and_drops_its_model() -> None:
    """
    No lease: the work runs now and its answer is quiet's; the engine's resident model
    is forgotten first (the work stops the worker itself), another engine's stays.
    """
    h = Harness()
    h.lease("kokoro").release()
    h.lease("piper").release()
    assert h.resident() == ["kokoro", "piper"]
    assert outcome(h.quiet("kokoro", None, "swapped")) == "swapped"
    assert h.ran == ["kokoro"]
    assert h.resident() == ["piper"]
    assert h.actions == []


def test_quiet_runs_for_an_engine_with_nothing_resident() -> None:
    """
    An engine that never loaded is quiet.
    """
    h = Harness()
    assert outcome(h.quiet("kokoro", 600.0)) == "done"


def test_quiet_without_a_wait_refuses_a_speaking_engine_at_once() -> None:
    """
    wait None (an uninstall): a lease held is conflict now, and the work never runs.
    """
    h = Harness()
    h.lease("kokoro")
    failure = outcome(h.quiet("kokoro", None))
    assert isinstance(failure, Failure) and failure.check(Conflict)
    assert "speaking" in failure.value.message
    assert h.ran == [] and h.resident() == ["kokoro"]


def test_quiet_with_a_wait_runs_once_the_lease_is_released() -> None:
    """
    wait given (a reinstall's register): it waits while the lease is held, then runs as
    soon as it ends, and leaves no timer behind.
    """
    h = Harness()
    lease = h.lease("kokoro")
    done = h.quiet("kokoro", 600.0)
    h.clock.advance(599)
    assert not done.called and h.ran == []
    lease.release()
    assert outcome(done) == "done"
    assert h.ran == ["kokoro"] and h.resident() == []
    assert [call for call in h.clock.getDelayedCalls() if call.active() and call.getTime() < 900] == []


def test_quiet_past_its_wait_is_conflict_and_runs_nothing() -> None:
    """
    Still speaking when the wait is over: conflict naming the wait, the work not run.
    """
    h = Harness()
    h.lease("kokoro")
    done = h.quiet("kokoro", 600.0)
    h.clock.advance(599.9)
    assert not done.called
    h.clock.advance(0.1)
    failure = outcome(done)
    assert isinstance(failure, Failure) and failure.check(Conflict)
    assert "600" in failure.value.message
    assert h.ran == []


def test_another_engines_lease_does_not_hold_quiet_up() -> None:
    """
    Only the engine's own leases count.
    """
    h = Harness()
    h.lease("piper")
    assert outcome(h.quiet("kokoro", None)) == "done"


def test_a_load_asked_for_during_the_work_waits_for_it() -> None:
    """
    The work holds the lock a load takes: an acquire for the engine made while it runs
    is admitted only after it, so nothing speaks on a half-removed engine.
    """
    h = Harness()
    gate: Deferred[None] = Deferred()
    order: list[str] = []

    async def work() -> None:
        order.append("work started")
        await gate
        order.append("work ended")

    quiet = Deferred.fromCoroutine(h.residency.quiet("kokoro", work, None))
    acquiring = Deferred.fromCoroutine(h.residency.acquire("kokoro", "base"))
    acquiring.addCallback(lambda lease: order.append("leased"))
    assert order == ["work started"]
    gate.callback(None)
    assert order == ["work started", "work ended", "leased"]
    assert outcome(quiet) is None
