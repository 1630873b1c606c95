"""
The scheduler: turns a segment at a time to the listener who needs one most (first audio,
then a lead running low, then the fewest characters left), exclusive model operations,
parking behind slow readers, and waiting for abandoned synthesis.

The thread pool is a fake that runs a queued call only when the test says so, and the
reactor runs C{callFromThread} at once (both in tests/unit/_worker_fakes.py), so every
interleaving here is deterministic.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable, Iterator

import pytest
from _sockets import recorded
from _deferreds import failure_of
from _worker_fakes import FakePool, ImmediateReactor
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IPushProducer
from twisted.python.failure import Failure
from zope.interface.verify import verifyObject

from rhapsode_protocol.errors import OutOfMemory
from rhapsode_worker import Engine, Timing, Variant
from rhapsode_worker._model import ModelState
from rhapsode_worker._schedule import Job, ReactorStep, Scheduler


def _ignore_pcm(pcm: bytes) -> None:
    pass


class RecordingEngine(Engine):
    id = "rec"
    default_variant = "a"

    def __init__(self, events: list[str], fail_loads: int = 0) -> None:
        self.events = events
        self.fail_loads = fail_loads

    def variants(self) -> dict[str, Variant]:
        return {"a": Variant(), "b": Variant()}

    def load(self, variant: str) -> None:
        self.events.append(f"load {variant}")
        if self.fail_loads:
            self.fail_loads -= 1
            raise RuntimeError("CUDA out of memory")

    def unload(self) -> None:
        self.events.append("unload")


def make(events: list[str], fail_loads: int = 0) -> tuple[Scheduler, FakePool, ModelState]:
    pool = FakePool()
    reactor = ImmediateReactor()
    model = ModelState(RecordingEngine(events, fail_loads), reactor, pool)
    return Scheduler(reactor, pool, model), pool, model


def step(events: list[str], name: str) -> Callable[[], Iterator[bytes]]:
    def run() -> Iterator[bytes]:
        events.append(f"speak {name}")
        yield name.encode()

    return run


def test_answers_sent_whole_go_fewest_characters_first_then_one_after_another() -> None:
    """
    Answers sent whole (no listener plays along) are spoken as from a queue: the one
    with the fewest characters left first, the oldest among equals, each to its end
    rather than taking turns; a short one that arrives while a long one speaks goes
    next, not after it.
    """
    events: list[str] = []
    scheduler, pool, _ = make(events)
    reactor = scheduler._reactor
    got: list[bytes] = []
    a = Job("a", [step(events, f"a{i}") for i in range(3)], got.append, sizes=[10, 10, 10])
    b = Job("a", [step(events, f"b{i}") for i in range(2)], got.append, sizes=[10, 10])
    c = Job("a", [step(events, f"c{i}") for i in range(3)], got.append, sizes=[10, 10, 10])
    for job in (a, b, c):
        scheduler.submit(job)
        reactor.now += 1
    pool.run_next()  # the load
    pool.run_next()
    pool.run_next()  # b's two steps; a0 is handed to the pool
    short = Job("a", [step(events, "s0")], got.append, sizes=[5])
    scheduler.submit(short)
    pool.run_all()
    assert events == [
        "load a", "speak b0", "speak b1", "speak a0", "speak s0", "speak a1", "speak a2",
        "speak c0", "speak c1", "speak c2",
    ]
    assert got == [b"b0", b"b1", b"a0", b"s0", b"a1", b"a2", b"c0", b"c1", b"c2"]
    assert all(job.done.called for job in (a, b, c, short))
    assert not scheduler.busy


def test_a_long_answer_is_not_held_back_for_ever_by_short_ones_that_keep_coming() -> None:
    """
    An answer sent whole with many characters left, while shorter ones keep arriving,
    is given its next step once it has waited four steps' time: the short ones go first
    until then, and it is never left waiting longer.
    """
    events: list[str] = []
    scheduler, pool, _ = make(events)
    reactor = scheduler._reactor

    def work(name: str) -> Callable[[], Iterator[bytes]]:
        def run() -> Iterator[bytes]:
            events.append(name)
            reactor.now += 1.0
            yield b"x"

        return run

    long = Job("a", [work(f"long{i}") for i in range(3)], _ignore_pcm, sizes=[100] * 3)
    scheduler.submit(long)
    pool.run_next()  # the load; long0 is handed over
    for i in range(12):
        # A short answer arrives during every step.
        scheduler.submit(Job("a", [work(f"short{i}")], _ignore_pcm, sizes=[10]))
        pool.run_next()
    pool.run_all()
    assert long.done.called and not scheduler.busy
    begins = [i for i, event in enumerate(events) if event.startswith("long")]
    # Each of long's steps after the first waits while the short ones go, five steps
    # (over four steps' time), then goes.
    assert [b - a for a, b in zip(begins, begins[1:])] == [6, 6], events


def timed_step(reactor: ImmediateReactor, events: list[str], name: str, seconds: float, pcm: bytes) -> Callable[[], Iterator[bytes]]:
    """
    A step that takes C{seconds} on the reactor's clock, then yields C{pcm}.
    """

    def run() -> Iterator[bytes]:
        events.append(name)
        reactor.now += seconds
        yield pcm

    return run


def test_a_streamed_answer_with_no_audio_yet_goes_before_the_others_next_steps() -> None:
    """
    A streamed request that has sent nothing gets the next step, though another has
    fewer characters left: a second caller's first audio waits one step, not a whole
    text.  Sent whole, the same request waits its turn by what it has left.
    """
    for streamed, expected in ((True, ["a0", "b0", "a1", "a2"]), (False, ["a0", "a1", "a2", "b0"])):
        events: list[str] = []
        scheduler, pool, _ = make(events)
        reactor = scheduler._reactor
        a = Job("a", [timed_step(reactor, events, f"a{i}", 0.1, b"xx") for i in range(3)], _ignore_pcm,
                sizes=[10, 10, 10], stream_bytes_per_second=1)
        scheduler.submit(a)
        pool.run_next()  # the load; a0 (two seconds of audio in a tenth of one) is handed over
        b = Job("a", [timed_step(reactor, events, "b0", 0.1, b"xx")], _ignore_pcm, sizes=[100],
                stream_bytes_per_second=1 if streamed else None)
        scheduler.submit(b)
        pool.run_all()
        assert events == ["load a", *expected], streamed
        assert a.done.called and b.done.called


def test_a_listener_whose_lead_runs_low_is_given_a_step_before_it_runs_out() -> None:
    """
    Two streamed answers at once, synthesised four times faster than they play: the
    older speaks on to its end as from a queue, except that the other is given a step
    whenever what its listener still has to hear falls below two steps' time, so
    neither listener, once they hear something, waits in silence.
    """
    events: list[str] = []
    scheduler, pool, _ = make(events)
    reactor = scheduler._reactor
    jobs = {
        name: Job("a", [timed_step(reactor, events, f"{name}{i}", 0.25, b"xx") for i in range(10)], _ignore_pcm,
                  sizes=[10] * 10, stream_bytes_per_second=2)
        for name in "ab"
    }
    for job in jobs.values():
        scheduler.submit(job)
    pool.run_next()  # the load
    leads: list[float] = []
    while pool.calls:
        for job in jobs.values():
            lead = job.lead(reactor.now)
            if lead is not None and job._steps:
                leads.append(lead)
        pool.run_next()
    assert all(job.done.called for job in jobs.values())
    assert min(leads) >= 0, leads
    order = "".join(event[0] for event in events[1:])
    # The first audio of both; then a speaks on, b given a step each time its lead
    # falls below two steps' time (half a second), and the rest of b once a is done.
    assert order == "ab" + "aaab" * 3 + "b" * 6, order


def test_one_generation_at_a_time_by_default() -> None:
    """
    With concurrency 1, a second step is not handed to the pool while one runs.
    """
    events: list[str] = []
    scheduler, pool, _ = make(events)
    scheduler.submit(Job("a", [step(events, "x")], lambda _: None))
    scheduler.submit(Job("a", [step(events, "y")], lambda _: None))
    pool.run_next()  # the load
    assert len(pool.calls) == 1
    pool.run_next()
    assert len(pool.calls) == 1
    pool.run_next()
    assert events == ["load a", "speak x", "speak y"]


def test_paused_job_is_parked_until_resumed() -> None:
    """
    A job whose reader is slow gets no turn while paused, and others go on.
    """
    events: list[str] = []
    scheduler, pool, _ = make(events)
    slow = Job("a", [step(events, "s0"), step(events, "s1")], lambda _: None)
    other = Job("a", [step(events, "o0"), step(events, "o1")], lambda _: None, sizes=[5, 5])
    scheduler.submit(slow)
    scheduler.submit(other)
    pool.run_next()  # load; s0 is handed to the pool
    slow.pauseProducing()
    pool.run_all()
    assert events == ["load a", "speak s0", "speak o0", "speak o1"]
    assert not slow.done.called and scheduler.busy
    slow.resumeProducing()
    pool.run_all()
    assert events[-1] == "speak s1"
    assert slow.done.called and not scheduler.busy


def test_switching_variant_unloads_then_loads() -> None:
    """
    A job for another variant waits for the running step, then swaps the model.
    """
    events: list[str] = []
    scheduler, pool, model = make(events)
    scheduler.submit(Job("a", [step(events, "a0")], lambda _: None))
    pool.run_next()
    scheduler.submit(Job("b", [step(events, "b0")], lambda _: None))
    pool.run_all()
    assert events == ["load a", "speak a0", "unload", "load b", "speak b0"]
    assert model.resident("b")


def test_failed_load_unloads_and_retries_once() -> None:
    """
    A load that fails is followed by an unload and exactly one more load.
    """
    events: list[str] = []
    scheduler, pool, model = make(events, fail_loads=1)
    job = Job("a", [step(events, "x")], lambda _: None)
    scheduler.submit(job)
    pool.run_all()
    assert events == ["load a", "unload", "load a", "speak x"]
    assert job.done.called and model.resident("a")


def test_load_failing_twice_fails_the_job_with_oom() -> None:
    """
    Two failed loads fail the request, an out-of-memory mapped to C{oom}.
    """
    events: list[str] = []
    scheduler, pool, model = make(events, fail_loads=2)
    job = Job("a", [step(events, "x")], lambda _: None)
    failures: list[Failure] = []
    scheduler.submit(job).addErrback(failures.append)
    pool.run_all()
    assert events == ["load a", "unload", "load a"]
    assert failures and failures[0].check(OutOfMemory)
    assert model.state == "unloaded"


def test_cancelled_job_stops_and_load_waits_for_abandoned_step() -> None:
    """
    A cancelled job stops at its next chunk, and an exclusive operation queued meanwhile
    runs only after the abandoned step has returned.
    """
    events: list[str] = []
    scheduler, pool, _ = make(events)
    chunks: list[bytes] = []

    def long_step() -> Iterator[bytes]:
        for i in range(5):
            events.append(f"chunk {i}")
            if i == 1:
                job.cancel()
            yield b"x" * 10

    job = Job("a", [long_step, step(events, "never")], chunks.append)
    failures: list[Failure] = []
    scheduler.submit(job).addErrback(failures.append)
    pool.run_next()  # load
    unloaded: list[object] = []
    scheduler.exclusive(lambda: _unload(scheduler)).addCallback(unloaded.append)
    assert not unloaded
    pool.run_next()  # the step, abandoned after its second chunk
    assert events[-1] == "chunk 1" and "speak never" not in events
    assert failures and failures[0].check(CancelledError)
    pool.run_all()
    assert unloaded and events[-1] == "unload"


def _unload(scheduler: Scheduler) -> Any:
    from twisted.internet.defer import Deferred

    return Deferred.fromCoroutine(scheduler._model.unload())


def test_failing_step_fails_only_its_job() -> None:
    """
    An adapter exception fails its own request; the next request still speaks.
    """
    events: list[str] = []
    scheduler, pool, _ = make(events)

    def broken() -> Iterator[bytes]:
        raise ValueError("boom")
        yield b""

    bad = Job("a", [broken], lambda _: None)
    good = Job("a", [step(events, "ok")], lambda _: None)
    failures: list[Failure] = []
    scheduler.submit(bad).addErrback(failures.append)
    scheduler.submit(good)
    pool.run_all()
    assert failures[0].check(ValueError)
    assert good.done.called and events[-1] == "speak ok"


@pytest.mark.parametrize("concurrency", [2, 3])
def test_declared_concurrency_runs_that_many(concurrency: int) -> None:
    """
    An adapter that declares concurrency N gets N generations in flight at once.
    """
    events: list[str] = []
    pool = FakePool()
    reactor = ImmediateReactor()
    model = ModelState(RecordingEngine(events), reactor, pool)
    scheduler = Scheduler(reactor, pool, model, concurrency)
    for i in range(4):
        scheduler.submit(Job("a", [step(events, str(i))], lambda _: None))
    pool.run_next()  # load
    assert len(pool.calls) == concurrency


def test_the_scheduler_tells_the_sessions_how_many_generations_are_about_to_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """
    The scheduler tells the process's budgeted sessions how many generations run or are
    queued to run, at most its concurrency: two requests arriving together make two, so
    neither run takes every core; one makes one; none left makes none.
    """
    from rhapsode_worker import _schedule

    told: list[int] = []
    monkeypatch.setattr(_schedule, "set_demand", told.append)
    events: list[str] = []
    pool = FakePool()
    reactor = ImmediateReactor()
    model = ModelState(RecordingEngine(events), reactor, pool)
    scheduler = Scheduler(reactor, pool, model, 2)
    for i in range(3):
        scheduler.submit(Job("a", [step(events, str(i))], lambda _: None))
    pool.run_next()  # load
    assert told[-1] == 2  # three waiting, two at a time
    pool.run_all()
    assert told[-1] == 0
    scheduler.submit(Job("a", [step(events, "alone")], lambda _: None))
    assert told[-1] == 1
    pool.run_all()
    assert told[-1] == 0


def test_model_state_refuses_illegal_transitions() -> None:
    """
    The model half of the worker lifecycle moves only along the section 3 machine.
    """
    events: list[str] = []
    _, _, model = make(events)
    with pytest.raises(RuntimeError):
        model._become("loaded", "a")
    model._become("loading", "a")
    with pytest.raises(RuntimeError):
        model._become("unloading", "a")


def test_first_audio_is_written_before_synthesis_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """
    In a job's first step the synthesis thread hands its first audio over and waits for
    the reactor to have taken it before making more, so an engine that holds the GIL
    cannot keep first audio back until the whole segment is made.  Later steps do not
    wait.
    """
    import threading

    from rhapsode_worker import _schedule

    monkeypatch.setattr(_schedule, "_FIRST_AUDIO_WAIT", 30.0)  # no timing in the outcome

    class ThreadedReactor:
        """
        Runs calls from the synthesis thread on a thread of its own, as the reactor does.
        """

        def callFromThread(self, f: Callable[..., Any], *args: Any) -> None:
            threading.Thread(target=f, args=args).start()

    taken: list[bytes] = []
    seen_before_second: list[list[bytes]] = []

    def speak() -> Iterator[bytes]:
        yield b"first"
        seen_before_second.append(list(taken))
        yield b"second"

    pool = FakePool()
    model = ModelState(RecordingEngine([]), ImmediateReactor(), pool)
    scheduler = Scheduler(ThreadedReactor(), pool, model)
    job = Job("a", [speak], taken.append)
    scheduler._drain_step(job, speak, True)
    assert seen_before_second == [[b"first"]]

    handed: list[Callable[..., Any]] = []

    class RecordingReactor:
        def callFromThread(self, f: Callable[..., Any], *args: Any) -> None:
            handed.append(f)
            f(*args)

    scheduler = Scheduler(RecordingReactor(), pool, model)
    assert scheduler._drain_step(Job("a", [speak], lambda pcm: None), speak, True) == b"second"
    assert scheduler._drain_step(Job("a", [speak], lambda pcm: None), speak, False) == b"second"
    # Each step hands over its first chunk at once; the rest is returned with its end.
    waited = [f is _schedule._hand_over for f in handed]
    assert waited == [True, False], "only a job's first step waits for its first hand-over"


def test_the_scheduler_says_when_it_falls_idle_and_when_work_comes() -> None:
    """
    C{on_idle} is told False when a job comes to an idle scheduler and True once the last
    job has ended (a load included), and nothing while it stays busy: what the worker's
    idle heap trim waits on (rhapsode_worker._heap).
    """
    said: list[bool] = []
    pool = FakePool()
    model = ModelState(RecordingEngine([]), ImmediateReactor(), pool)
    scheduler = Scheduler(ImmediateReactor(), pool, model, on_idle=said.append)
    scheduler.submit(Job("a", [step([], "one")], lambda pcm: None))
    scheduler.submit(Job("a", [step([], "two")], lambda pcm: None))
    assert said == [False]
    pool.run_all()
    assert said == [False, True] and not scheduler.busy
    scheduler.submit(Job("a", [step([], "three")], lambda pcm: None))
    pool.run_all()
    assert said == [False, True, False, True]


def test_a_batch_s_timings_and_its_audio_are_gathered() -> None:
    """
    A batch that carries timings is written inside one gathering, its timings and then
    its audio, so that the first timing and the first audio reach the core in one send
    (and the core in one read); a batch without timings is written as it is.
    """
    events: list[Any] = []

    def speak() -> Iterator[bytes | Timing]:
        yield Timing(unit="word", start=0.0, end=0.1, text="hi")
        yield b"first"
        yield b"second"

    pool = FakePool()
    model = ModelState(RecordingEngine([]), ImmediateReactor(), pool)
    scheduler = Scheduler(ImmediateReactor(), pool, model)
    job = Job("a", [speak], events.append, on_timing=lambda marks: events.append([m.text for m in marks]),
              gather=lambda: recorded(events))
    job.done.addCallback(lambda _: events.append("done"))
    scheduler.submit(job)
    pool.run_all()
    assert events == ["gather", ["hi"], b"first", "sent", "gather", b"second", "done", "sent"]


def test_a_steps_last_audio_arrives_with_its_end() -> None:
    """
    A step's last batch is not handed over on its own: it reaches the job in the same
    reactor call that ends the step, just before the job is done, so the audio's end and
    the response's end can leave in one write.  Two calls into the reactor in all: the
    first chunk, and the step's end carrying the rest.
    """
    events: list[Any] = []

    class CountingReactor(ImmediateReactor):
        def callFromThread(self, f: Callable[..., Any], *args: Any) -> None:
            events.append("hand-over")
            f(*args)

    def speak() -> Iterator[bytes]:
        yield b"first"
        yield b"second"
        yield b"third"

    pool = FakePool()
    model = ModelState(RecordingEngine([]), ImmediateReactor(), pool)
    scheduler = Scheduler(CountingReactor(), pool, model)
    job = Job("a", [speak], events.append)
    job.done.addCallback(lambda _: events.append("done"))
    scheduler.submit(job)
    pool.run_all()
    assert events == ["hand-over", b"first", "hand-over", b"secondthird", "done"]


def test_a_steps_last_audio_and_what_its_end_leads_to_are_gathered() -> None:
    """
    The job's C{gather} is entered around a step's last batch and what follows it: the
    next step's joint for a step before the last, the job's end for the last; the first
    audio's hand-over is not gathered (it goes at once).
    """
    events: list[Any] = []

    def speak() -> Iterator[bytes]:
        yield b"first"
        yield b"second"

    pool = FakePool()
    model = ModelState(RecordingEngine([]), ImmediateReactor(), pool)
    scheduler = Scheduler(ImmediateReactor(), pool, model)
    job = Job("a", [speak, speak], events.append, on_step=lambda index: events.append(f"joint {index}"),
              gather=lambda: recorded(events))
    job.done.addCallback(lambda _: events.append("done"))
    scheduler.submit(job)
    pool.run_all()
    assert events == [b"first", "gather", b"second", "joint 1", "sent",
                      b"first", "gather", b"second", "done", "sent"]


def test_a_failure_writing_the_last_audio_fails_the_job() -> None:
    """
    If the job's writer refuses the step's last batch, the job fails with that error
    instead of hanging or finishing cleanly.
    """

    def writer(pcm: bytes) -> None:
        if pcm == b"secondthird":
            raise OSError("the encoder is gone")

    def speak() -> Iterator[bytes]:
        yield b"first"
        yield b"second"
        yield b"third"

    scheduler, pool, _ = make([])
    job = Job("a", [speak], writer)
    failures: list[Failure] = []
    job.done.addErrback(failures.append)
    scheduler.submit(job)
    pool.run_all()
    assert len(failures) == 1 and failures[0].check(OSError)
    assert not scheduler.busy


def test_a_finished_job_lets_go_of_what_it_delivered_to() -> None:
    """
    A job (a push producer) sends its audio to a callback that usually belongs to the
    response holding the job.  Once the job has finished, well or cancelled, it drops
    its callbacks, so the pair (and the request behind them) is freed when dropped
    instead of waiting in a reference cycle for the garbage collector; and nothing more
    is delivered.
    """
    import gc
    import weakref

    class Response:
        def __init__(self, job_steps: list[Callable[[], Iterator[bytes]]]) -> None:
            self.got: list[bytes] = []
            self.job = Job("a", job_steps, lambda pcm: self.got.append(pcm), lambda index: self.got.append(b"|"))

    events: list[str] = []
    scheduler, pool, _ = make(events)
    assert verifyObject(IPushProducer, Job("a", [], _ignore_pcm))
    gc.disable()
    try:
        finished = Response([step(events, "x"), step(events, "y")])
        scheduler.submit(finished.job)
        pool.run_all()
        assert finished.got == [b"x", b"|", b"y"] and finished.job.done.called
        finished.job.on_pcm(b"late")
        assert finished.got == [b"x", b"|", b"y"]
        cancelled = Response([step(events, "z")])
        scheduler.submit(cancelled.job)
        cancelled.job.done.addErrback(lambda f: f.trap(CancelledError))
        cancelled.job.cancel()
        pool.run_all()
        gone = [weakref.ref(finished), weakref.ref(cancelled)]
        del finished, cancelled
        assert [ref() for ref in gone] == [None, None]
    finally:
        gc.enable()


class Witness(Engine):
    """
    An engine that checks, at each step and each model call, the promise the SDK makes:
    a generation runs only while its own variant is the one loaded, and a load or an
    unload never overlaps a generation.
    """

    id = "witness"
    default_variant = "a"

    def __init__(self) -> None:
        super().__init__()
        self.loaded: str | None = None
        self.generating = 0
        self.fail_loads = 0
        self.broken: list[str] = []
        self.spoken = 0

    def variants(self) -> dict[str, Variant]:
        return {v: Variant() for v in "abc"}

    def load(self, variant: str) -> None:
        if self.generating:
            self.broken.append(f"load {variant} during {self.generating} generation(s)")
        if self.fail_loads:
            self.fail_loads -= 1
            raise RuntimeError("CUDA out of memory")
        self.loaded = variant

    def unload(self) -> None:
        if self.generating:
            self.broken.append(f"unload during {self.generating} generation(s)")
        self.loaded = None

    def step(self, variant: str) -> Callable[[], Iterator[bytes]]:
        def run() -> Iterator[bytes]:
            self.generating += 1
            try:
                for piece in range(2):
                    if self.loaded != variant:
                        self.broken.append(f"spoke {variant} with {self.loaded} loaded")
                    yield b"%d" % piece
                self.spoken += 1
            finally:
                self.generating -= 1

        return run


@pytest.mark.parametrize("concurrency", [1, 2, 3])
@pytest.mark.parametrize("seed", range(60))
def test_a_generation_runs_only_once_its_variant_is_loaded(concurrency: int, seed: int) -> None:
    """
    Whatever arrives and whatever order the threads finish in (requests for three
    variants, unloads, loads that fail, readers that pause and resume, clients that hang
    up), every generation runs with its own variant loaded, and no load or unload runs
    beside one: what lets an adapter's speak() use its model without asking whether it
    is loaded.
    """
    import random

    rng = random.Random(seed * 7 + concurrency)
    engine = Witness()
    pool = FakePool()
    reactor = ImmediateReactor()
    model = ModelState(engine, reactor, pool)
    scheduler = Scheduler(reactor, pool, model, concurrency)
    jobs: list[Job] = []
    for _ in range(120):
        roll = rng.random()
        if roll < 0.3:
            variant = rng.choice("abc")
            job = Job(variant, [engine.step(variant) for _ in range(rng.randint(1, 3))], _ignore_pcm)
            job.done.addErrback(lambda failure: None)
            jobs.append(job)
            scheduler.submit(job)
        elif roll < 0.36:
            scheduler.exclusive(lambda: Deferred.fromCoroutine(model.unload())).addErrback(lambda f: None)
        elif roll < 0.4:
            engine.fail_loads += 1
        elif roll < 0.5 and jobs:
            rng.choice(jobs).pauseProducing()
        elif roll < 0.6 and jobs:
            rng.choice(jobs).resumeProducing()
        elif roll < 0.63 and jobs:
            rng.choice(jobs).cancel()
        elif pool.calls:
            pool.run_any(rng.randrange)
    for job in jobs:
        job.resumeProducing()
    while pool.calls:
        pool.run_any(rng.randrange)
    assert engine.broken == []
    assert all(job.done.called for job in jobs) and not scheduler.busy
    assert engine.spoken > 0


class Relay:
    """
    An asynchronous step's source, as a relaying engine's speak() is: each chunk comes
    when the test fires the Deferred the step waits on; it records every pull, whether
    the wait was cancelled, and whether it was closed.
    """

    def __init__(self, chunks: int) -> None:
        self.chunks = chunks
        self.pulls = 0
        self.waiting: Deferred[bytes] | None = None
        self.cancelled = False
        self.closed = False

    def _cancelled(self, _: Deferred[bytes]) -> None:
        self.cancelled = True

    async def speak(self) -> AsyncIterator[bytes]:
        try:
            for _ in range(self.chunks):
                self.pulls += 1
                self.waiting = Deferred(self._cancelled)
                yield await self.waiting
        finally:
            self.closed = True

    def send(self, chunk: bytes) -> None:
        waiting, self.waiting = self.waiting, None
        assert waiting is not None, "the step is not waiting for a chunk"
        waiting.callback(chunk)


def test_a_reactor_step_is_drawn_on_the_reactor_as_its_chunks_come() -> None:
    """
    A ReactorStep (an engine's asynchronous speak()) runs on no thread: only the load
    goes to the pool; each chunk reaches the job as it comes, the first before the
    second exists; the job is done when the step's iterator ends, which is closed.
    """
    events: list[str] = []
    scheduler, pool, _ = make(events)
    relay = Relay(2)
    got: list[bytes] = []
    job = Job("a", [ReactorStep(relay.speak)], got.append)
    scheduler.submit(job)
    pool.run_next()  # the load
    assert pool.calls == [] and relay.pulls == 1
    relay.send(b"one")
    assert got == [b"one"] and relay.pulls == 2
    relay.send(b"two")
    assert got == [b"one", b"two"] and relay.closed
    assert job.done.called and not scheduler.busy


def test_a_paused_job_draws_nothing_more_from_its_reactor_step() -> None:
    """
    While its reader is paused a job pulls nothing more from its asynchronous step, so
    a relaying engine holds back (and pauses its own source); resumed, it pulls again.
    """
    events: list[str] = []
    scheduler, pool, _ = make(events)
    relay = Relay(3)
    got: list[bytes] = []
    job = Job("a", [ReactorStep(relay.speak)], got.append)
    scheduler.submit(job)
    pool.run_next()
    job.pauseProducing()
    relay.send(b"one")  # the pull already asked for completes
    assert got == [b"one"] and relay.pulls == 1 and relay.waiting is None
    job.pauseProducing()
    job.resumeProducing()
    assert relay.pulls == 2
    relay.send(b"two")
    relay.send(b"three")
    assert got == [b"one", b"two", b"three"] and job.done.called


def test_cancelling_a_job_cancels_its_reactor_steps_pull_and_closes_it() -> None:
    """
    A client gone: the pull the step waits on is cancelled at once (a relaying engine
    drops its upstream then, not when the next chunk would have come), the iterator is
    closed, the job fails with CancelledError and the scheduler is free; a paused job
    cancelled likewise closes its step.
    """
    for paused in (False, True):
        events: list[str] = []
        scheduler, pool, _ = make(events)
        relay = Relay(3)
        job = Job("a", [ReactorStep(relay.speak)], _ignore_pcm)
        scheduler.submit(job)
        pool.run_next()
        if paused:
            job.pauseProducing()
            relay.send(b"one")
        job.cancel()
        assert relay.cancelled is not paused and relay.closed
        assert isinstance(failure_of(job.done).value, CancelledError)
        assert not scheduler.busy


def test_a_reactor_step_that_fails_fails_its_job_and_the_next_step_never_runs() -> None:
    """
    An asynchronous step raising fails its job with that error (the response aborts
    if its head went), its iterator closed; the job's later steps never begin, and
    another job's steps run on.
    """
    events: list[str] = []
    scheduler, pool, _ = make(events)
    relay, later = Relay(2), Relay(1)
    job = Job("a", [ReactorStep(relay.speak), ReactorStep(later.speak)], _ignore_pcm)
    other = Job("a", [step(events, "o0")], _ignore_pcm, sizes=[5])
    scheduler.submit(job)
    scheduler.submit(other)
    pool.run_next()
    assert relay.waiting is not None
    relay.waiting.errback(OutOfMemory("the server ran out"))
    assert isinstance(failure_of(job.done).value, OutOfMemory) and relay.closed
    assert later.pulls == 0
    pool.run_all()
    assert events[-1] == "speak o0" and other.done.called


def test_reactor_steps_take_turns_within_the_declared_concurrency() -> None:
    """
    With concurrency 1 a second job's asynchronous step waits until the first's ends,
    as a thread's would; with 2 both are drawn at once.
    """
    for concurrency, both in ((1, False), (2, True)):
        pool = FakePool()
        reactor = ImmediateReactor()
        model = ModelState(RecordingEngine([]), reactor, pool)
        scheduler = Scheduler(reactor, pool, model, concurrency)
        first, second = Relay(1), Relay(1)
        scheduler.submit(Job("a", [ReactorStep(first.speak)], _ignore_pcm))
        scheduler.submit(Job("a", [ReactorStep(second.speak)], _ignore_pcm))
        pool.run_next()
        assert (first.pulls, second.pulls) == (1, 1 if both else 0)
        first.send(b"one")
        assert second.pulls == 1
        second.send(b"two")
        assert not scheduler.busy
