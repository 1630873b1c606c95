"""
The residency manager on a L{Clock}: leases, LRU eviction, keep-alive deadlines and their
precedence, waits for room, unloads, variant swaps, live settings and the GET /residency
snapshot.  The terminate and unload actions are fakes that record each call into a list
and answer at once, or hold their answer until the test fires it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.task import Clock
from twisted.logger import capturedLogs
from zope.interface import implementer
from zope.interface.verify import verifyObject

from rhapsode._config import ConfigSettings, parse_config
from rhapsode._fleet.residency import (
    IResidencySettings,
    Lease,
    Residency,
    iso_utc,
)
from rhapsode_protocol.errors import BadRequest, Conflict, ModelUnavailable

from _deferreds import failure_of, result_of

#: 2026-09-20T11:04:02.118Z, the moment protocol.md section 3's example was taken.
EXAMPLE_MOMENT = 1789902242.118


@implementer(IResidencySettings)
@dataclass
class Settings:
    """
    Settings a test changes between calls, as a settings API would.
    """

    max: int = 1
    wait: float = 30.0
    keep_alive: int = 300
    engines: dict[str, int] = field(default_factory=dict)

    def max_resident_models(self) -> int:
        return self.max

    def eviction_wait_seconds(self) -> float:
        return self.wait

    def keep_alive_seconds(self) -> int:
        return self.keep_alive

    def engine_keep_alive_seconds(self, engine: str) -> int | None:
        return self.engines.get(engine)


@dataclass
class Harness:
    """
    A residency manager with the calls its actions received.  With C{hold}, each action
    answers a Deferred the test fires from C{pending}.
    """

    clock: Clock = field(default_factory=Clock)
    settings: Settings = field(default_factory=Settings)
    calls: list[tuple[str, str]] = field(default_factory=list)
    pending: list[Deferred[None]] = field(default_factory=list)
    hold: bool = False
    residency: Residency = field(init=False)

    def __post_init__(self) -> None:
        self.residency = Residency(
            clock=self.clock,
            settings=self.settings,
            terminate=lambda engine: self._act("terminate", engine),
            unload=lambda engine: self._act("unload", engine),
        )

    def _act(self, verb: str, engine: str) -> Deferred[None]:
        self.calls.append((verb, engine))
        if not self.hold:
            return succeed(None)
        answer: Deferred[None] = Deferred()
        self.pending.append(answer)
        return answer

    def acquire(
        self, engine: str, variant: str = "base", keep_alive: int | None = None
    ) -> Deferred[Lease]:
        return Deferred.fromCoroutine(self.residency.acquire(engine, variant, keep_alive))

    def lease(self, engine: str, variant: str = "base", keep_alive: int | None = None) -> Lease:
        lease: Lease = result_of(self.acquire(engine, variant, keep_alive))
        return lease

    def unload(self, engine: str, mode: str = "terminate") -> Deferred[None]:
        return Deferred.fromCoroutine(self.residency.unload(engine, mode))

    def use(self, engine: str, variant: str = "base", keep_alive: int | None = None) -> None:
        """
        One whole request: take a lease and let it go.
        """
        self.lease(engine, variant, keep_alive).release()

    def resident(self) -> list[str]:
        return [m["engine"] for m in self.residency.snapshot()["models"]]

    def model(self, engine: str) -> dict[str, Any]:
        models = {m["engine"]: m for m in self.residency.snapshot()["models"]}
        return models[engine]




def pending(deferred: Deferred[Any]) -> None:
    """
    The Deferred has not fired yet.
    """
    assert not deferred.called


# -- settings ----------------------------------------------------------------------------


def test_settings_provide_the_interface() -> None:
    """
    The test's fake and the config-backed settings both provide IResidencySettings.
    """
    assert verifyObject(IResidencySettings, Settings())
    assert verifyObject(IResidencySettings, ConfigSettings(lambda: parse_config({}, Path("/"))))


def test_config_settings_read_the_config_in_force_each_time() -> None:
    """
    ConfigSettings asks for the config on every read, so a replaced config is seen at
    once; an engine without its own keep-alive, or not configured, has none.
    """
    first = parse_config(
        {
            "residency": {"maxResidentModels": 2, "evictionWaitSeconds": 5, "keepAliveSeconds": 60},
            "engines": {"dia": {"module": "dia_worker", "keepAliveSeconds": 900},
                        "tone": {"module": "tone_worker"}},
        },
        Path("/"),
    )
    second = parse_config(
        {"residency": {"maxResidentModels": 3, "keepAliveSeconds": -1}}, Path("/")
    )
    current = [first]
    settings = ConfigSettings(lambda: current[0])

    def read() -> list[Any]:
        return [
            settings.max_resident_models(),
            settings.eviction_wait_seconds(),
            settings.keep_alive_seconds(),
            *(settings.engine_keep_alive_seconds(e) for e in ("dia", "tone", "kokoro")),
        ]

    assert read() == [2, 5.0, 60, 900, None, None]
    current[0] = second
    assert read() == [3, 30.0, -1, None, None, None]


def test_iso_utc_has_milliseconds_and_z() -> None:
    """
    Timestamps are ISO 8601 in UTC with exactly three decimals and a Z.
    """
    assert iso_utc(EXAMPLE_MOMENT) == "2026-09-20T11:04:02.118Z"
    assert iso_utc(0) == "1970-01-01T00:00:00.000Z"
    assert iso_utc(59.9996) == "1970-01-01T00:01:00.000Z"


# -- leases and LRU ----------------------------------------------------------------------


def test_a_first_acquire_makes_the_model_resident_under_a_lease() -> None:
    """
    A model that is not resident is admitted with one lease, and nothing is terminated.
    """
    h = Harness()
    lease = h.lease("kokoro", "v1")
    assert (lease.engine, lease.variant) == ("kokoro", "v1")
    assert h.residency.state("kokoro") == {"resident": True, "variant": "v1", "leases": 1, "measured": False, "loaded": False}
    assert h.residency.state("dia") == {"resident": False, "leases": 0}
    assert h.calls == []


def test_full_budget_of_one_evicts_the_idle_model_by_terminate() -> None:
    """
    With maxResidentModels 1, a second engine's request terminates the first engine's
    idle worker and takes its place.
    """
    h = Harness()
    h.use("kokoro")
    h.lease("dia")
    assert h.calls == [("terminate", "kokoro")]
    assert h.resident() == ["dia"]


def test_lru_with_two_resident_models() -> None:
    """
    With room for two, the model used longest ago goes first: using kokoro again after
    dia makes dia the one a third engine evicts.
    """
    h = Harness(settings=Settings(max=2))
    h.use("kokoro")
    h.clock.advance(1)
    h.use("dia")
    h.clock.advance(1)
    h.use("kokoro")
    h.clock.advance(1)
    h.use("tone")
    assert h.calls == [("terminate", "dia")]
    assert h.resident() == ["kokoro", "tone"]


def test_lru_with_three_resident_models() -> None:
    """
    With room for three, successive newcomers evict in least-recently-used order, and a
    model's use refreshes its place even when no time has passed.
    """
    h = Harness(settings=Settings(max=3))
    for engine in ("a", "b", "c", "a"):
        h.use(engine)
    h.use("d")
    h.use("e")
    h.use("c")
    h.use("f")
    assert h.calls == [("terminate", e) for e in ("b", "c", "a", "d")]
    assert h.resident() == ["e", "c", "f"]


def test_lru_passes_over_a_leased_model() -> None:
    """
    The least recently used model is not evicted while it has a lease: the next idle one
    in LRU order is.
    """
    h = Harness(settings=Settings(max=2))
    streaming = h.lease("kokoro")
    h.clock.advance(1)
    h.use("dia")
    h.lease("tone")
    assert h.calls == [("terminate", "dia")]
    assert h.residency.state("kokoro")["leases"] == 1
    streaming.release()


def test_leases_count_concurrent_streams() -> None:
    """
    Two streams on one model hold two leases; one ending leaves it leased, with no
    deadline; releasing the same lease twice counts once.
    """
    h = Harness(settings=Settings(keep_alive=0))
    first = h.lease("kokoro")
    second = h.lease("kokoro")
    assert h.residency.state("kokoro")["leases"] == 2
    first.release()
    first.release()
    assert h.residency.state("kokoro") == {"resident": True, "variant": "base", "leases": 1, "measured": False, "loaded": False}
    assert "expiresAt" not in h.model("kokoro")
    assert h.calls == []
    second.release()
    assert h.calls == [("terminate", "kokoro")]


# -- keep-alive --------------------------------------------------------------------------


def test_keep_alive_precedence_is_request_then_engine_then_server() -> None:
    """
    The keep-alive in force is the request's, else the engine's own, else the server's.
    """
    h = Harness(settings=Settings(max=3, keep_alive=300, engines={"dia": 900}))
    h.use("kokoro")
    h.use("dia")
    h.use("tone", keep_alive=60)
    assert [h.model(e)["keepAliveSeconds"] for e in ("kokoro", "dia", "tone")] == [300, 900, 60]


def test_the_last_request_to_take_a_lease_sets_the_keep_alive() -> None:
    """
    Of two requests speaking one model, the later one's keep-alive is in force, and a
    request that gives none puts the engine's own value back rather than keeping the
    previous request's.
    """
    h = Harness(settings=Settings(engines={"dia": 900}))
    batch = h.lease("dia", keep_alive=-1)
    page = h.lease("dia", keep_alive=10)
    assert h.model("dia")["keepAliveSeconds"] == 10
    plain = h.lease("dia")
    assert h.model("dia")["keepAliveSeconds"] == 900
    for lease in (batch, page, plain):
        lease.release()
    h.clock.advance(899)
    assert h.calls == []
    h.clock.advance(1)
    assert h.calls == [("terminate", "dia")]


def test_keep_alive_zero_frees_the_model_as_the_last_lease_ends() -> None:
    """
    keepAliveSeconds 0 terminates the worker when the last lease ends, not before, and
    leaves no timer behind.
    """
    h = Harness()
    one = h.lease("kokoro", keep_alive=0)
    two = h.lease("kokoro", keep_alive=0)
    one.release()
    assert h.calls == []
    two.release()
    assert h.calls == [("terminate", "kokoro")]
    assert h.resident() == []
    assert h.clock.getDelayedCalls() == []


def test_keep_alive_minus_one_never_expires_but_is_evicted_by_lru() -> None:
    """
    -1 keeps an idle model with no deadline and no timer, but a request for another
    engine with the budget full still evicts it.
    """
    h = Harness()
    h.use("kokoro", keep_alive=-1)
    assert h.clock.getDelayedCalls() == []
    assert "expiresAt" not in h.model("kokoro")
    h.clock.advance(10 * 365 * 86400)
    assert h.calls == []
    h.lease("dia")
    assert h.calls == [("terminate", "kokoro")]


def test_expiry_terminates_exactly_at_the_deadline() -> None:
    """
    An idle model's worker is terminated (never only unloaded) at its deadline and not
    a moment before, and it is then no longer resident.
    """
    h = Harness()
    h.clock.advance(100)
    h.use("kokoro")
    h.clock.advance(299.999)
    assert h.calls == []
    h.clock.advance(0.001)
    assert h.calls == [("terminate", "kokoro")]
    assert h.residency.snapshot()["resident"] == 0
    assert h.clock.getDelayedCalls() == []


def test_the_deadline_starts_when_the_last_lease_ends() -> None:
    """
    A model streaming for longer than its keep-alive does not expire under its caller;
    its deadline counts from the release of its last lease.
    """
    h = Harness()
    long_stream = h.lease("kokoro")
    h.clock.advance(200)
    short_stream = h.lease("kokoro")
    short_stream.release()
    h.clock.advance(800)
    assert h.calls == []
    long_stream.release()
    h.clock.advance(299)
    assert h.calls == []
    h.clock.advance(1)
    assert h.calls == [("terminate", "kokoro")]


def test_a_new_lease_puts_the_deadline_off() -> None:
    """
    A request arriving while the model is idle takes it back before it expires: the
    old deadline passing while it speaks does nothing, and the model stays its full
    keep-alive after the lease ends.
    """
    h = Harness()
    h.use("kokoro")
    h.clock.advance(250)
    lease = h.lease("kokoro")
    h.clock.advance(100)
    assert h.calls == []
    lease.release()
    h.clock.advance(299)
    assert h.calls == []
    h.clock.advance(1)
    assert h.calls == [("terminate", "kokoro")]


def test_a_steady_stream_of_requests_keeps_one_timer() -> None:
    """
    Leases taken and released one after another keep a single keep-alive timer rather
    than cancelling and setting one per request; when it comes due early it sets
    itself for the rest, so the model still goes exactly its keep-alive after the
    last lease ended.
    """
    h = Harness()
    h.use("kokoro")
    for _ in range(50):
        h.clock.advance(1)
        h.lease("kokoro").release()
        assert len(h.clock.getDelayedCalls()) == 1
    last_release = h.clock.seconds()
    h.clock.advance(last_release + 300 - h.clock.seconds() - 1)
    assert h.calls == [] and len(h.clock.getDelayedCalls()) == 1
    h.clock.advance(1)
    assert h.calls == [("terminate", "kokoro")]


def test_a_shorter_keep_alive_asked_for_brings_the_deadline_forward() -> None:
    """
    A request asking for a shorter keep-alive than the timer already set moves the
    deadline forward: the kept timer is not left to fire late.
    """
    h = Harness()
    h.use("kokoro")
    h.clock.advance(10)
    h.lease("kokoro", keep_alive=30).release()
    h.clock.advance(29)
    assert h.calls == []
    h.clock.advance(1)
    assert h.calls == [("terminate", "kokoro")]


# -- waiting for room --------------------------------------------------------------------


def test_eviction_waits_then_fails_with_model_unavailable() -> None:
    """
    When every resident model is leased, a request for another engine waits up to
    evictionWaitSeconds and then fails with a retryable 503 saying why; it is counted as
    waiting meanwhile and leaves no timer behind.
    """
    h = Harness()
    streaming = h.lease("kokoro")
    waiting = h.acquire("dia")
    pending(waiting)
    assert h.residency.snapshot()["waiting"] == 1
    h.clock.advance(29.999)
    pending(waiting)
    h.clock.advance(0.001)
    error = failure_of(waiting).value
    assert isinstance(error, ModelUnavailable)
    assert (error.status, error.retryable) == (503, True)
    assert "every resident model is speaking (kokoro)" in error.message
    assert "30 s" in error.message
    assert h.residency.snapshot()["waiting"] == 0
    assert h.calls == []
    assert h.clock.getDelayedCalls() == []
    streaming.release()


def test_a_zero_wait_fails_at_once() -> None:
    """
    evictionWaitSeconds 0 fails a request that would have to wait, without a timer.
    """
    h = Harness(settings=Settings(wait=0))
    h.lease("kokoro")
    error = failure_of(h.acquire("dia")).value
    assert isinstance(error, ModelUnavailable)
    assert h.clock.getDelayedCalls() == []


def test_a_waiting_acquire_proceeds_when_a_lease_ends() -> None:
    """
    A request waiting for room is admitted as soon as the leased model lets go, by
    evicting it, before its wait runs out; the evicted model's deadline is gone too.
    """
    h = Harness()
    streaming = h.lease("kokoro")
    waiting = h.acquire("dia")
    h.clock.advance(20)
    pending(waiting)
    streaming.release()
    lease = result_of(waiting)
    assert lease.engine == "dia"
    assert h.calls == [("terminate", "kokoro")]
    assert h.clock.getDelayedCalls() == []
    assert h.residency.snapshot()["waiting"] == 0


def test_the_wait_is_bounded_in_total_across_wake_ups() -> None:
    """
    Waking to find the room taken again does not restart the wait: it still ends
    evictionWaitSeconds after it began.
    """
    h = Harness()
    h.lease("kokoro")
    waiting = h.acquire("dia")
    h.clock.advance(20)
    h.residency.settings_changed()
    h.clock.advance(9.999)
    pending(waiting)
    h.clock.advance(0.001)
    assert isinstance(failure_of(waiting).value, ModelUnavailable)
    assert h.clock.getDelayedCalls() == []


def test_admission_waits_for_the_evicted_worker_to_go() -> None:
    """
    An eviction holds admissions until the terminate has finished, because the card is
    not free before; a second request queues behind it rather than deciding on a card
    in flux.
    """
    h = Harness(hold=True)
    h.use("kokoro")
    first = h.acquire("dia")
    second = h.acquire("tone")
    assert h.calls == [("terminate", "kokoro")]
    pending(first)
    pending(second)
    assert h.residency.snapshot()["waiting"] == 2
    h.pending.pop(0).callback(None)
    assert result_of(first).engine == "dia"
    pending(second)
    h.clock.advance(30)
    assert isinstance(failure_of(second).value, ModelUnavailable)


def test_a_failed_terminate_is_logged_and_the_request_proceeds() -> None:
    """
    An eviction whose terminate fails is logged as a failure; the model stays
    forgotten and the request that needed the room is admitted.
    """
    h = Harness(hold=True)
    h.use("kokoro")
    with capturedLogs() as events:
        admitted = h.acquire("dia")
        h.pending.pop(0).errback(RuntimeError("worker unreachable"))
    assert result_of(admitted).engine == "dia"
    assert h.resident() == ["dia"]
    failures = [e for e in events if "log_failure" in e]
    assert len(failures) == 1
    assert failures[0]["log_failure"].check(RuntimeError)


# -- cancellation ------------------------------------------------------------------------


def test_a_cancelled_waiting_acquire_takes_nothing() -> None:
    """
    A caller that gives up while waiting for room stops waiting at once, leaves no
    timer, is no longer counted, and takes nothing when the room comes.
    """
    h = Harness()
    streaming = h.lease("kokoro")
    waiting = h.acquire("dia")
    waiting.cancel()
    assert failure_of(waiting).check(CancelledError)
    assert h.residency.snapshot()["waiting"] == 0
    assert h.clock.getDelayedCalls() == []
    streaming.release()
    assert h.calls == []
    assert h.resident() == ["kokoro"]


def test_a_cancelled_acquire_lets_its_eviction_finish_and_takes_nothing() -> None:
    """
    A caller that gives up while its eviction is terminating a worker is answered at
    once, but the terminate is not cancelled and the lock is held until it ends; then
    nothing is admitted for the caller and the next request goes ahead.
    """
    h = Harness(hold=True)
    h.use("kokoro")
    evicting = h.acquire("dia")
    evicting.cancel()
    assert failure_of(evicting).check(CancelledError)
    terminate = h.pending.pop(0)
    assert not terminate.called
    after = h.acquire("tone")
    pending(after)
    terminate.callback(None)
    assert result_of(after).engine == "tone"
    assert h.resident() == ["tone"]
    assert h.calls == [("terminate", "kokoro")]


def test_a_cancelled_acquire_leaves_the_queue() -> None:
    """
    A caller that gives up while queued behind an eviction leaves the queue and is
    never admitted.
    """
    h = Harness(hold=True)
    h.use("kokoro")
    first = h.acquire("dia")
    queued = h.acquire("dia")
    queued.cancel()
    assert failure_of(queued).check(CancelledError)
    assert h.residency.snapshot()["waiting"] == 1
    h.pending.pop(0).callback(None)
    result_of(first)
    assert h.residency.state("dia") == {"resident": True, "variant": "base", "leases": 1, "measured": False, "loaded": False}


# -- variants ----------------------------------------------------------------------------


def test_another_variant_of_an_idle_engine_replaces_it_in_place() -> None:
    """
    A request for another variant of a resident, idle engine counts as the same model:
    nothing is evicted or terminated, the recorded variant changes and its measured
    size is dropped with it.
    """
    h = Harness(settings=Settings(max=2))
    h.use("kokoro", "v1")
    h.residency.record_size("kokoro", "v1", 300_000_000)
    h.use("dia")
    lease = h.lease("kokoro", "v2")
    assert lease.variant == "v2"
    assert h.calls == []
    assert h.resident() == ["dia", "kokoro"]
    assert h.model("kokoro")["variant"] == "v2"
    assert "sizeBytes" not in h.model("kokoro")


def test_another_variant_waits_while_the_old_one_is_leased() -> None:
    """
    A different variant of a leased engine waits for its leases to end, like an
    eviction, then replaces it without a terminate.
    """
    h = Harness(settings=Settings(max=2))
    streaming = h.lease("kokoro", "v1")
    swap = h.acquire("kokoro", "v2")
    pending(swap)
    same = h.lease("kokoro", "v1")
    assert h.residency.state("kokoro")["leases"] == 2
    streaming.release()
    pending(swap)
    same.release()
    assert result_of(swap).variant == "v2"
    assert h.residency.state("kokoro") == {"resident": True, "variant": "v2", "leases": 1, "measured": False, "loaded": False}
    assert h.calls == []


def test_a_variant_wait_times_out_naming_the_variants() -> None:
    """
    A variant swap that waits too long fails with model_unavailable naming the variant
    speaking and the one asked for.
    """
    h = Harness()
    h.lease("kokoro", "v1")
    swap = h.acquire("kokoro", "v2")
    h.clock.advance(30)
    error = failure_of(swap).value
    assert isinstance(error, ModelUnavailable)
    assert 'speaking variant "v1"' in error.message and '"v2"' in error.message


# -- unload on request -------------------------------------------------------------------


def test_unload_is_refused_while_speaking_and_allowed_after() -> None:
    """
    POST /engines/{engine}/unload is a 409 conflict while the engine has a lease, and
    once the stream ends it terminates the worker and forgets the model.
    """
    h = Harness()
    lease = h.lease("kokoro")
    error = failure_of(h.unload("kokoro")).value
    assert isinstance(error, Conflict) and error.status == 409
    assert h.calls == []
    lease.release()
    result_of(h.unload("kokoro"))
    assert h.calls == [("terminate", "kokoro")]
    assert h.resident() == []
    assert h.clock.getDelayedCalls() == []


def test_unload_is_idempotent_and_takes_its_mode() -> None:
    """
    mode=unload calls the unload action and keeps nothing resident; repeating either
    mode with nothing resident succeeds and still takes the action (a terminate still
    ends the process); another mode is a bad request.
    """
    h = Harness()
    h.use("kokoro")
    result_of(h.unload("kokoro", "unload"))
    result_of(h.unload("kokoro", "unload"))
    result_of(h.unload("kokoro", "terminate"))
    assert h.calls == [("unload", "kokoro"), ("unload", "kokoro"), ("terminate", "kokoro")]
    assert h.resident() == []
    error = failure_of(h.unload("kokoro", "drain")).value
    assert isinstance(error, BadRequest) and error.field == "mode"


def test_an_unload_cannot_slip_between_admission_and_its_lease() -> None:
    """
    An unload asked for while a request's eviction is still running waits for the
    admission, then finds the lease it granted and refuses.
    """
    h = Harness(hold=True)
    h.use("kokoro")
    admitting = h.acquire("dia")
    unloading = h.unload("dia")
    pending(unloading)
    h.pending.pop(0).callback(None)
    result_of(admitting)
    assert isinstance(failure_of(unloading).value, Conflict)
    assert h.calls == [("terminate", "kokoro")]


def test_an_unload_failure_reaches_the_operator() -> None:
    """
    An unload whose action fails answers that failure; the model is forgotten.
    """
    h = Harness(hold=True)
    h.use("kokoro", keep_alive=-1)
    unloading = h.unload("kokoro", "unload")
    h.pending.pop(0).errback(ModelUnavailable("worker not answering"))
    assert isinstance(failure_of(unloading).value, ModelUnavailable)
    assert h.resident() == []


# -- forgetting, sizes -------------------------------------------------------------------


def test_forget_drops_a_model_whose_worker_died() -> None:
    """
    A worker's exit forgets its model; a request waiting for its room is let in; a
    lease still held on it ends quietly later, even once the engine is resident again
    under a new lease.
    """
    h = Harness(settings=Settings(max=2))
    streaming = h.lease("kokoro")
    other = h.lease("tone")
    waiting = h.acquire("dia")
    h.residency.forget("kokoro")
    assert result_of(waiting).engine == "dia"
    assert h.residency.state("kokoro") == {"resident": False, "leases": 0}
    other.release()
    again = h.lease("kokoro")
    streaming.release()
    assert h.residency.state("kokoro") == {"resident": True, "variant": "base", "leases": 1, "measured": False, "loaded": False}
    assert h.clock.getDelayedCalls() == []
    assert h.calls == [("terminate", "tone")]
    h.residency.forget("kokoro")
    h.residency.forget("kokoro")
    again.release()
    assert h.residency.state("kokoro") == {"resident": False, "leases": 0}


def test_forget_cancels_the_deadline() -> None:
    """
    A model forgotten while idle leaves no timer to fire later.
    """
    h = Harness()
    h.use("kokoro")
    h.residency.forget("kokoro")
    assert h.clock.getDelayedCalls() == []


def test_record_size_applies_only_to_the_resident_variant() -> None:
    """
    A measured size is kept for the variant resident now; a size for another variant,
    for an engine not resident, or zero or less (a failed measurement) leaves it absent.
    """
    h = Harness()
    h.use("kokoro", "v1")
    h.residency.record_size("kokoro", "v2", 10)
    h.residency.record_size("dia", "v1", 10)
    assert "sizeBytes" not in h.model("kokoro")
    h.residency.record_size("kokoro", "v1", 0)
    assert "sizeBytes" not in h.model("kokoro")
    h.residency.record_size("kokoro", "v1", 82_000_000)
    assert h.model("kokoro")["sizeBytes"] == 82_000_000
    h.residency.record_size("kokoro", "v1", None)
    assert "sizeBytes" not in h.model("kokoro")


# -- live settings -----------------------------------------------------------------------


def test_settings_are_read_when_used() -> None:
    """
    A budget raised between requests is used by the next admission, and a keep-alive
    changed while a model streams applies when its lease ends.
    """
    h = Harness()
    h.use("kokoro")
    h.settings.max = 2
    h.settings.engines["dia"] = 50
    streaming = h.lease("dia")
    assert h.calls == []
    h.settings.engines["dia"] = 20
    streaming.release()
    h.clock.advance(20)
    assert h.calls == [("terminate", "dia")]


def test_the_eviction_wait_is_read_when_the_wait_begins() -> None:
    """
    evictionWaitSeconds is read when a request first has to wait.
    """
    h = Harness()
    h.lease("kokoro")
    h.settings.wait = 5
    waiting = h.acquire("dia")
    h.clock.advance(5)
    assert isinstance(failure_of(waiting).value, ModelUnavailable)


def test_settings_changed_moves_every_idle_deadline() -> None:
    """
    A change to the server's or an engine's keep-alive moves the deadline of every model
    idle now, counted from its last use: to the new time, to now when that has passed,
    and to never for -1; a leased model gets none.
    """
    h = Harness(settings=Settings(max=5, engines={"dia": 600}))
    h.use("kokoro")
    h.use("tone")
    h.use("dia")
    h.use("piper", keep_alive=-1)
    streaming = h.lease("bark")
    h.clock.advance(100)
    h.settings.keep_alive = 150
    h.settings.engines["dia"] = 50
    h.residency.settings_changed()
    assert h.calls == [("terminate", "dia")]
    assert h.model("kokoro")["expiresAt"] == iso_utc(150)
    h.settings.keep_alive = -1
    h.settings.engines["tone"] = 120
    h.residency.settings_changed()
    assert "expiresAt" not in h.model("kokoro")
    h.clock.advance(19)
    assert h.calls == [("terminate", "dia")]
    h.clock.advance(1)
    assert h.calls == [("terminate", "dia"), ("terminate", "tone")]
    assert "expiresAt" not in h.model("bark")
    assert h.clock.getDelayedCalls() == []
    streaming.release()


def test_a_lower_budget_evicts_nothing_until_a_load_needs_the_room() -> None:
    """
    Lowering maxResidentModels evicts nothing by itself; the next request for a model
    not resident evicts as many idle models as it takes, in LRU order.
    """
    h = Harness(settings=Settings(max=3))
    h.use("a")
    h.use("b")
    h.use("c")
    h.settings.max = 1
    h.residency.settings_changed()
    assert h.calls == []
    h.use("b")
    assert h.calls == []
    h.lease("d")
    assert h.calls == [("terminate", "a"), ("terminate", "c"), ("terminate", "b")]
    assert h.residency.snapshot()["max"] == 1


def test_a_raised_budget_lets_a_waiting_request_in() -> None:
    """
    Raising maxResidentModels and saying so admits a request waiting for room without
    evicting anything.
    """
    h = Harness()
    h.lease("kokoro")
    waiting = h.acquire("dia")
    h.settings.max = 2
    h.residency.settings_changed()
    assert result_of(waiting).engine == "dia"
    assert h.calls == []


# -- the snapshot ------------------------------------------------------------------------


def test_snapshot_matches_the_section_3_example() -> None:
    """
    GET /residency's document: an idle model has lastUsedAt from when its lease ended,
    expiresAt its keep-alive later, the keep-alive in force and its measured size.
    """
    h = Harness(settings=Settings(engines={"dia": 300}))
    h.clock.advance(EXAMPLE_MOMENT - 2)
    lease = h.lease("dia", "full")
    h.residency.record_size("dia", "full", 3355443200)
    h.clock.advance(2)
    lease.release()
    assert h.residency.snapshot() == {
        "resident": 1, "max": 1, "waiting": 0,
        "models": [{
            "engine": "dia", "variant": "full", "leases": 0,
            "lastUsedAt": "2026-09-20T11:04:02.118Z", "expiresAt": "2026-09-20T11:09:02.118Z",
            "keepAliveSeconds": 300, "sizeBytes": 3355443200,
        }],
    }


def test_snapshot_leaves_out_what_does_not_apply() -> None:
    """
    expiresAt is absent while a model is leased and when it never expires; sizeBytes is
    absent when unmeasured; lastUsedAt is when the lease was taken while it streams;
    models are listed next to go first.
    """
    h = Harness(settings=Settings(max=2))
    h.clock.advance(1.5)
    h.use("kokoro", keep_alive=-1)
    h.clock.advance(1)
    h.lease("dia", "full", keep_alive=60)
    assert h.residency.snapshot() == {
        "resident": 2, "max": 2, "waiting": 0,
        "models": [
            {"engine": "kokoro", "variant": "base", "leases": 0,
             "lastUsedAt": "1970-01-01T00:00:01.500Z", "keepAliveSeconds": -1},
            {"engine": "dia", "variant": "full", "leases": 1,
             "lastUsedAt": "1970-01-01T00:00:02.500Z", "keepAliveSeconds": 60},
        ],
    }


def test_nothing_resident_leaves_no_delayed_calls() -> None:
    """
    After models have come, waited, expired, been evicted and unloaded, a manager with
    nothing resident holds no timers.
    """
    h = Harness(settings=Settings(max=2))
    h.use("a")
    b = h.lease("b")
    c = h.acquire("c")
    d = h.acquire("d")
    h.clock.advance(10)
    d.cancel()
    assert failure_of(d).check(CancelledError)
    b.release()
    result_of(c).release()
    h.clock.advance(300)
    h.use("e", keep_alive=-1)
    result_of(h.unload("e"))
    assert h.residency.snapshot()["resident"] == 0
    assert h.clock.getDelayedCalls() == []
    assert sorted(h.calls) == [("terminate", "a"), ("terminate", "b"), ("terminate", "c"),
                               ("terminate", "e")]



def test_close_leaves_no_timer_behind() -> None:
    """
    Closing the manager at shutdown cancels every keep-alive deadline.
    """
    harness = Harness()
    harness.use("tone")
    assert harness.clock.getDelayedCalls()
    harness.residency.close()
    assert not harness.clock.getDelayedCalls()


def test_a_load_is_measured_once_even_when_the_worker_cannot_say() -> None:
    """
    A size recorded as absent still counts as asked, so the core does not ask the worker
    again on every request; another variant's load is a new question.
    """
    harness = Harness()
    lease = harness.lease("tone", "a")
    assert harness.residency.state("tone")["measured"] is False
    harness.residency.record_size("tone", "a", None)
    state = harness.residency.state("tone")
    assert state["measured"] is True and "sizeBytes" not in state
    lease.release()
    harness.use("tone", "b")
    assert harness.residency.state("tone")["measured"] is False


@pytest.mark.parametrize("burst", [61, 100, 400])
def test_every_request_in_a_burst_that_must_evict_gets_its_lease(burst: int) -> None:
    """
    A burst for an engine whose first request must evict another engine's model queues
    on the residency lock while the eviction runs; when it ends, every one of them is
    granted a lease (none is left unanswered by a stack that ran too deep).
    """
    harness = Harness(hold=True)
    harness.residency.record_size("a", "base", None)
    first = harness.acquire("a")
    harness.pending.clear()
    result_of(first).release()
    waiting = [harness.acquire("b") for _ in range(burst)]
    assert harness.calls == [("terminate", "a")]
    harness.pending[0].callback(None)
    leases = [result_of(d) for d in waiting]
    assert len(leases) == burst and all(lease.engine == "b" for lease in leases)
