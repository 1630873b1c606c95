"""
Who synthesises next (protocol.md section 8, "Serialises requests").

One model runs C{concurrency} generations at a time (1 by default), a segment (a step)
at a time.  When a thread is free, the next step goes to the request whose listener
needs it most:

  1. a streamed request that has sent no audio yet, oldest first: a second caller's
     first audio waits for one segment of the first caller's text, not all of it;
  2. a streamed request whose lead (the audio it has sent, less the time since its first
     audio: what its player still holds if it began playing then) is below the margin,
     about two steps' time: the least lead first, so a listener who has begun hearing
     is not left in silence;
  3. an answer sent whole that has waited for its next step longer than four steps'
     time, the longest waiting first: a long one is not held back for ever by short
     ones that keep arriving (a stream's lead already sees to that);
  4. otherwise, the request with the fewest characters left to speak, oldest first among
     equals: requests that arrive together finish one after another, as in a queue,
     rather than all near the end as round robin leaves them, and a short request is
     not held behind a long one.

Model operations (load, unload) are exclusive: they wait for every running generation,
abandoned ones included, to end, and nothing queued after them starts while they run.

A job is an C{IPushProducer}: its consumer pauses it when the client reads slowly, and a
paused job is simply not given its next turn, so at most one segment of audio per
request waits in memory and a slow reader never holds the model from the others.

A step is run on a synthesis thread, except a L{ReactorStep}: the asynchronous speech
of an engine that waits on the network rather than computes (a remote server's
stream), drawn on the reactor thread as its reader takes it, a chunk at a time.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import AbstractContextManager, nullcontext
from typing import Any, AsyncIterator, Callable, Iterator, Sequence

from twisted.internet.defer import CancelledError, Deferred, fail
from twisted.internet.interfaces import IPushProducer
from twisted.python.failure import Failure
from zope.interface import implementer

from ._engine import Timing
from ._model import ModelState
from ._pool import WorkerPool, in_pool
from ._threads import set_demand

Step = Callable[[], Iterator[Any]]


class ReactorStep:
    """
    A step whose audio comes from an asynchronous iterator, drawn on the reactor thread:
    C{make()} begins it.  Nothing of it may block; it waits on Deferreds.

    While its job is paused nothing more is drawn (the iterator is left waiting for its
    next pull, and so must hold back what it is sent: a relaying engine pauses its own
    source); when its job is cancelled the pull it waits on is cancelled, and the
    iterator is closed whatever way the step ends.
    """

    __slots__ = ("make",)

    def __init__(self, make: Callable[[], AsyncIterator[Any]]) -> None:
        self.make = make

# PCM crosses from the synthesis thread to the reactor in batches: one hop per small
# chunk costs more than the audio is worth.  The first chunk of a step goes at once,
# so batching never delays first audio.
_BATCH_BYTES = 256 * 1024
_BATCH_SECONDS = 0.1
#: The send buffer a worker's Unix socket asks for: a batch and half another, so a whole
#: batch can be written while the reader still has the last one's tail.  Linux's default
#: (208 KiB) holds less than one: each batch went as a partial send, a pause, a wait
#: for the core to wake and read, and a resume.  Measured with bench/proxy.py's
#: throughput request (4000 characters of pcm, best of 7, interleaved): through the core
#: 147-174 -> 194-211 MB/s, straight to the worker 185-205 -> 193-208, so the ratio
#: 0.79-0.85 -> 1.00-1.01 (256 KiB gave 0.88-0.95, 512 KiB 0.97-0.98).  The cost: a
#: connection whose reader lags holds up to this much more audio in the kernel (Linux
#: doubles the figure for its own bookkeeping), synthesised ahead of its listener.
SEND_BUFFER_BYTES = _BATCH_BYTES * 3 // 2
# How long a job's first step waits for the reactor to have written its first audio
# before synthesising on.  An engine that holds the GIL while it computes (pure Python,
# or Python around its native calls) would otherwise keep the reactor from writing that
# audio until the whole segment is made: first audio would wait for the segment.
_FIRST_AUDIO_WAIT = 0.005
#: A streamed request whose lead is below this many steps' time goes before the rest.
#: One step is what may run before it gets its turn, another what its own step takes
#: to make its first audio.
_MARGIN_STEPS = 2
#: How many of the latest steps' times the margin is measured from (their longest).
_STEPS_REMEMBERED = 8
#: An answer sent whole that has waited this many steps' time for its next step goes
#: before those with fewer characters left.
_PATIENCE_STEPS = 4


def _ignore(_: object) -> None:
    pass


@implementer(IPushProducer)
class Job:
    """
    One request's synthesis: a variant and the steps (segments) that make its audio.

    C{on_pcm} is called on the reactor thread with each batch of PCM, in order, with
    C{on_step} called before every step after the first (where the joint goes).  With
    C{on_timing}, the L{Timing}s a step yields reach it in their place, each batch's
    before that batch's PCM (so never after the audio they time); without it they are
    dropped.  C{gather}, where given, is entered around a step's last batch and what its
    end leads to (the next step's joint, or C{done} and so the response's end), all in
    one turn, and around a batch's timings and its PCM: a connection that gathers its
    writes sends them as one.
    C{done} fires when every step has run, or fails with the step's exception, or with
    L{CancelledError} once a stopped job's running step has returned.

    C{sizes} are the steps' characters (1 each when not given): what is left to speak,
    which orders the requests whose listeners are not waiting.  C{stream_bytes_per_second}
    is given for a streamed answer, the PCM bytes of a second of its audio: with it the
    scheduler keeps the listener's lead.  An answer sent whole has no listener playing
    along, so none.
    """

    def __init__(
        self,
        variant: str,
        steps: "list[Step | ReactorStep]",
        on_pcm: Callable[[bytes], None],
        on_step: Callable[[int], None] = lambda index: None,
        on_timing: Callable[[Sequence[Timing]], None] | None = None,
        gather: Callable[[], AbstractContextManager[None]] = nullcontext,
        sizes: Sequence[int] | None = None,
        stream_bytes_per_second: int | None = None,
    ) -> None:
        if sizes is not None and len(sizes) != len(steps):
            raise ValueError(f"{len(sizes)} sizes for {len(steps)} steps")
        self.variant = variant
        self.gather = gather
        self._steps: "deque[Step | ReactorStep]" = deque(steps)
        self._sizes: deque[int] = deque(sizes if sizes is not None else [1] * len(steps))
        #: Characters (or steps) left to speak, the running step's included until it ends.
        self.left = sum(self._sizes)
        self._rate = stream_bytes_per_second
        #: When it was submitted, and when its first audio went out, on the reactor's clock.
        self.since = 0.0
        self.first_audio: float | None = None
        self.sent_bytes = 0
        #: Since when it has waited in the queue for its next step.
        self.waiting = 0.0
        self._index = 0
        self.on_pcm = on_pcm
        self.on_step = on_step
        self.on_timing = on_timing
        self.paused = False
        self.cancelled = False
        self.done: Deferred[None] = Deferred()
        self._scheduler: Scheduler | None = None
        #: Set while the reader takes audio (and once the job is cancelled): what a
        #: relaying engine's synthesis thread waits on before it draws another chunk.
        self._flowing = threading.Event()
        self._flowing.set()
        #: A reactor step's wait for the reader to take audio again, while it is paused.
        self._resumed: Deferred[None] | None = None
        #: A reactor step's pull on its iterator, while one is outstanding.
        self._pull: Deferred[Any] | None = None

    def pauseProducing(self) -> None:
        self.paused = True
        self._flowing.clear()

    def resumeProducing(self) -> None:
        self.paused = False
        self._flowing.set()
        self._release()
        if self._scheduler is not None:
            self._scheduler._wake(self)

    def _release(self) -> None:
        resumed, self._resumed = self._resumed, None
        if resumed is not None:
            resumed.callback(None)

    def stopProducing(self) -> None:
        self.cancel()

    def cancel(self) -> None:
        """
        Stop at the next chunk.  A running step is abandoned but still waited for.
        """
        if self.cancelled or self.done.called:
            return
        self.cancelled = True
        self._flowing.set()
        self._release()
        pull, self._pull = self._pull, None
        if pull is not None:
            pull.cancel()
        if self._scheduler is not None:
            self._scheduler._wake(self)

    def _heard(self, pcm: bytes) -> None:
        """
        C{pcm} goes to the reader now.
        """
        if self.first_audio is None and self._scheduler is not None:
            self.first_audio = self._scheduler._reactor.seconds()
        self.sent_bytes += len(pcm)
        self.on_pcm(pcm)

    def lead(self, now: float) -> float | None:
        """
        Seconds of audio the listener of a streamed answer still has to hear, if they
        began playing at its first audio; None for an answer sent whole, or one that has
        sent nothing yet.
        """
        if self._rate is None or self.first_audio is None:
            return None
        return self.sent_bytes / self._rate - (now - self.first_audio)

    def _rank(self, now: float, margin: float, patience: float) -> tuple[float, ...]:
        """
        Lower goes first: see the module's docstring.
        """
        if self._rate is not None:
            lead = self.lead(now)
            if lead is None:
                return (0, self.since)
            if lead < margin:
                return (1, lead, self.since)
        else:
            # A listener's lead already keeps a stream from waiting for ever.
            waited = now - self.waiting
            if patience and waited > patience:
                return (2, -waited, self.since)
        return (3, self.left, self.since)

    def _finish(self, result: None | Failure) -> None:
        # A finished job delivers nothing more, and lets go of what it delivered to:
        # that is usually the response holding this job, a reference cycle that would
        # otherwise keep the request and its buffers for the garbage collector.
        self.on_pcm = _ignore
        self.on_step = _ignore
        self.gather = nullcontext
        if self.on_timing is not None:
            self.on_timing = _ignore
        if not self.done.called:
            self.done.callback(None) if result is None else self.done.errback(result)


class _Exclusive:
    def __init__(self, operation: Callable[[], "Deferred[Any]"]) -> None:
        self.operation = operation
        self.done: Deferred[Any] = Deferred()


class Scheduler:
    """
    Turns over a thread pool of C{concurrency} threads, to the request whose listener
    needs the next step most (the module's docstring says how that is judged).

    @param relays: the engine relays audio made elsewhere (L{rhapsode_worker.Engine.relays}):
        a paused job's running step waits on its thread before drawing the next chunk,
        so the reader's pause reaches the server that makes the audio.  Otherwise a
        step runs on and only the job's next turn waits.
    """

    def __init__(
        self,
        reactor: Any,
        pool: WorkerPool,
        model: ModelState,
        concurrency: int = 1,
        relays: bool = False,
        on_idle: Callable[[bool], None] | None = None,
    ) -> None:
        self._relays = relays
        #: Told True when nothing runs, waits or is parked any more, False when something
        #: does again (L{rhapsode_worker._heap.IdleTrim}).
        self._on_idle = on_idle
        self._idle = True
        self._reactor = reactor
        self._pool = pool
        self._model = model
        self._concurrency = max(1, concurrency)
        self._queue: deque[Job | _Exclusive] = deque()
        self._parked: set[Job] = set()
        self._running = 0
        self._exclusive = False
        self._idle_waiters: list[Deferred[None]] = []
        #: The latest steps' times, in seconds: the margin a streamed lead is kept above.
        self._step_seconds: deque[float] = deque(maxlen=_STEPS_REMEMBERED)

    @property
    def busy(self) -> bool:
        """
        Whether anything runs, waits, or is parked behind a slow reader.
        """
        return bool(self._running or self._exclusive or self._queue or self._parked)

    @property
    def synthesising(self) -> int:
        return self._running

    def submit(self, job: Job) -> "Deferred[None]":
        job._scheduler = self
        job.since = self._reactor.seconds()
        self._enqueue(job)
        self._pump()
        return job.done

    def exclusive(self, operation: Callable[[], "Deferred[Any]"]) -> "Deferred[Any]":
        """
        Run C{operation} once nothing else runs, and before anything queued after it.
        """
        item = _Exclusive(operation)
        self._queue.append(item)
        self._pump()
        return item.done

    def when_idle(self) -> "Deferred[None]":
        d: Deferred[None] = Deferred()
        if self.busy:
            self._idle_waiters.append(d)
        else:
            d.callback(None)
        return d

    def _wake(self, job: Job) -> None:
        if job in self._parked:
            self._parked.discard(job)
            self._enqueue(job)
        self._pump()

    def _pump(self) -> None:
        while self._queue and not self._exclusive:
            job = self._choose()
            if job is None:
                if not self._queue:
                    break
                item = self._queue[0]
                assert isinstance(item, _Exclusive)
                if self._running:
                    break
                self._queue.popleft()
                self._run_exclusive(item.operation, item)
                continue
            if not self._model.resident(job.variant):
                # The load is this job's turn; it runs alone, then the job is queued again.
                if self._running:
                    break
                self._queue.remove(job)
                self._run_exclusive(lambda: _deferred(self._model.ensure(job.variant)), job)
                break
            if self._running >= self._concurrency:
                break
            self._queue.remove(job)
            self._run_step(job)
        self._tell_demand()
        self._notify_idle()
        if self._on_idle is not None and self._idle == self.busy:
            self._idle = not self._idle
            self._on_idle(self._idle)

    def _enqueue(self, job: Job) -> None:
        job.waiting = self._reactor.seconds()
        self._queue.append(job)

    def _choose(self) -> Job | None:
        """
        The job to be given the next step, among those queued before the first model
        operation; None when that operation is first.  Cancelled jobs met on the way are
        finished and paused ones parked.
        """
        now = self._reactor.seconds()
        step = max(self._step_seconds, default=0.0)
        margin, patience = _MARGIN_STEPS * step, _PATIENCE_STEPS * step
        best: Job | None = None
        best_rank: tuple[float, ...] = ()
        for item in list(self._queue):
            if not isinstance(item, Job):
                break
            if item.cancelled:
                self._queue.remove(item)
                item._finish(Failure(CancelledError()))
                continue
            if item.paused:
                self._queue.remove(item)
                self._parked.add(item)
                continue
            rank = item._rank(now, margin, patience)
            if best is None or rank < best_rank:
                best, best_rank = item, rank
        return best

    def _run_exclusive(
        self, operation: Callable[[], "Deferred[Any]"], item: Job | _Exclusive
    ) -> None:
        self._exclusive = True

        def finished(result: Any) -> None:
            self._exclusive = False
            if isinstance(item, Job):
                if isinstance(result, Failure):
                    item._finish(result)
                else:
                    item.waiting = self._reactor.seconds()
                    self._queue.appendleft(item)
            elif isinstance(result, Failure):
                item.done.errback(result)
            else:
                item.done.callback(result)
            self._pump()

        d = _deferred_call(operation)
        d.addBoth(finished)

    def _run_step(self, job: Job) -> None:
        step = job._steps.popleft()
        size = job._sizes.popleft()
        began = self._reactor.seconds()
        index = job._index
        job._index += 1
        if index:
            job.on_step(index)
        self._running += 1
        d: Deferred[Any]
        if isinstance(step, ReactorStep):
            d = Deferred.fromCoroutine(_draw(job, step))
        else:
            d = in_pool(self._reactor, self._pool, self._drain_step, job, step, index == 0)

        def finished(result: Any) -> None:
            self._running -= 1
            job.left -= size
            self._step_seconds.append(self._reactor.seconds() - began)
            with job.gather():
                if isinstance(result, (bytes, _Batch)) and not job.cancelled:
                    # The step's last audio, written in the same turn as whatever its
                    # end leads to (the next step's joint, or the response's end).
                    try:
                        _deliver(job, result)
                    except Exception:
                        result = Failure()
                if isinstance(result, Failure):
                    job._finish(result)
                elif job.cancelled:
                    job._finish(Failure(CancelledError()))
                elif not job._steps:
                    job._finish(None)
                elif job.paused:
                    self._parked.add(job)
                else:
                    self._enqueue(job)
                self._pump()

        d.addBoth(finished)

    def _drain_step(self, job: Job, step: Step, first_step: bool = False) -> "bytes | _Batch | None":
        """
        On a synthesis thread: run one step, handing PCM to the reactor in batches.  In a
        job's first step, the first batch is handed over and written before synthesis
        goes on (for at most L{_FIRST_AUDIO_WAIT}).

        @return: the step's last batch, which goes to the reactor with the step's end
            rather than on its own: one hand-over, one write, and for a job's last step
            one send that carries the audio's end and the response's together.
        """
        deliver = self._reactor.callFromThread
        generator = step()
        batch: list[bytes] = []
        # Timings since the last hand-over: they go with the next batch, ahead of its PCM.
        marks: list[Timing] = []
        timed = job.on_timing is not None
        size = 0
        last = 0.0
        waiting_first = first_step
        try:
            for chunk in generator:
                if job.cancelled:
                    return None
                if isinstance(chunk, Timing):
                    if timed:
                        marks.append(chunk)
                    continue
                if not chunk:
                    continue
                batch.append(chunk)
                size += len(chunk)
                now = time.monotonic()
                if size >= _BATCH_BYTES or now - last >= _BATCH_SECONDS:
                    joined = b"".join(batch)
                    pcm: bytes | _Batch = joined
                    if marks:
                        pcm, marks = _Batch(marks, joined), []
                    if waiting_first:
                        waiting_first = False
                        written = threading.Event()
                        deliver(_hand_over, job, pcm, written)
                        # Blocking here lets the reactor take the GIL and write it now.
                        written.wait(_FIRST_AUDIO_WAIT)
                    else:
                        deliver(_deliver, job, pcm)
                    batch, size, last = [], 0, now
                if self._relays and job.paused:
                    # Nothing more is drawn, so nothing more is read from the server
                    # that makes it, until the reader catches up or goes.
                    job._flowing.wait()
                    if job.cancelled:
                        return None
            if job.cancelled:
                return None
            if marks:
                return _Batch(marks, b"".join(batch))
            if batch:
                return b"".join(batch)
            return None
        finally:
            close = getattr(generator, "close", None)
            if close is not None:
                close()

    def _tell_demand(self) -> None:
        queued = sum(1 for item in self._queue if isinstance(item, Job) and not item.cancelled)
        set_demand(min(self._concurrency, self._running + queued))

    def _notify_idle(self) -> None:
        if self._idle_waiters and not self.busy:
            waiters, self._idle_waiters = self._idle_waiters, []
            for d in waiters:
                d.callback(None)


async def _draw(job: Job, step: ReactorStep) -> None:
    """
    On the reactor: a reactor step's audio to its job as each chunk comes, its timings
    first; nothing is drawn while the job is paused, and a cancelled job's pull is
    cancelled (L{Job.cancel}), which ends the step with L{CancelledError}.
    """
    chunks = step.make()
    try:
        while not job.cancelled:
            if job.paused:
                job._resumed = Deferred()
                await job._resumed
                continue
            job._pull = pull = Deferred.fromCoroutine(_next(chunks))
            try:
                chunk = await pull
            except StopAsyncIteration:
                return
            finally:
                job._pull = None
            if isinstance(chunk, Timing):
                if job.on_timing is not None:
                    job.on_timing([chunk])
            elif chunk:
                job._heard(chunk)
    finally:
        close = getattr(chunks, "aclose", None)
        if close is not None:
            await close()


async def _next(chunks: AsyncIterator[Any]) -> Any:
    return await chunks.__anext__()


class _Batch:
    """
    A batch of PCM with the timings that came before it, handed over together.
    """

    __slots__ = ("marks", "pcm")

    def __init__(self, marks: list[Timing], pcm: bytes) -> None:
        self.marks = marks
        self.pcm = pcm


def _deliver(job: Job, batch: "bytes | _Batch") -> None:
    """
    On the reactor: a batch to its job, the timings first.
    """
    if isinstance(batch, bytes):
        job._heard(batch)
        return
    # The timings' frame or event and the audio after them leave in one send.
    with job.gather():
        if job.on_timing is not None:
            job.on_timing(batch.marks)
        if batch.pcm:
            job._heard(batch.pcm)


def _hand_over(job: Job, pcm: "bytes | _Batch", written: threading.Event) -> None:
    try:
        _deliver(job, pcm)
    finally:
        written.set()


def _deferred(coroutine: Any) -> "Deferred[Any]":
    return Deferred.fromCoroutine(coroutine)


def _deferred_call(operation: Callable[[], "Deferred[Any]"]) -> "Deferred[Any]":
    try:
        return operation()
    except BaseException:
        return fail()
