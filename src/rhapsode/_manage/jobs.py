"""
Jobs and their events (protocol.md section 10, "Jobs"): installs, reinstalls and pulls
run one at a time, in the order they were asked for, each reporting its steps and every
line its commands print as events that a client follows over server-sent events.

A job's events live in a replay buffer of its own (L{EventLog}); a subscriber reads
from a cursor into it (L{EventStream}), never from a queue of its own, so a reader that
stops reading costs the core what the transport holds and nothing that grows: when it
falls out of the buffer it is sent C{resync} and goes on from what is there.
"""

from __future__ import annotations

import json
import secrets
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest
from zope.interface import implementer

from rhapsode_protocol.errors import BadRequest, Internal, Overloaded, SpeechError

from .._fleet.residency import iso_utc

#: The steps of each kind of job, in order (an install adds "weights" when it pulls).
STEPS: dict[str, tuple[str, ...]] = {
    "install": ("venv", "packages", "verify", "register"),
    "reinstall": ("venv", "packages", "verify", "register"),
    "pull": ("weights",),
}
#: Events a job keeps for replay: a resume point older than these gets C{resync}.
REPLAY_EVENTS = 1000
#: A line of a command's output longer than this is cut (a progress bar redrawn forever).
MAX_MESSAGE_CHARACTERS = 2000
#: Finished jobs kept for GET /installs: a finished job goes once this many newer ones
#: have finished after it.
KEEP_FINISHED = 50
#: Jobs waiting their turn at most; one more is refused as overloaded.
MAX_QUEUED = 64
#: Event streams open at once, per job and in all.
STREAMS_PER_JOB = 32
STREAMS_IN_ALL = 256
#: A comment sent on an idle stream, so a proxy does not take it for dead.
HEARTBEAT_SECONDS = 15.0
#: Crockford's base32: a job id sorts by time and reads aloud without ambiguity.
_BASE32 = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def new_job_id(now: float) -> str:
    """
    Ten characters of milliseconds since the epoch and six random ones, so ids sort in
    the order jobs were made (protocol.md's example id is of this form).
    """
    millis = int(now * 1000)
    stamp = "".join(_BASE32[(millis >> shift) & 31] for shift in range(45, -1, -5))
    return stamp + "".join(secrets.choice(_BASE32) for _ in range(6))


class EventLog:
    """
    One job's events: numbered from 1, the last L{REPLAY_EVENTS} kept, each rendered
    once as its server-sent frame.  Subscribers are told that something was appended
    and read it themselves, from where they are.
    """

    def __init__(self, correlation: str, clock: IReactorTime, size: int = REPLAY_EVENTS) -> None:
        self.correlation = correlation
        self._clock = clock
        self._frames: deque[tuple[int, bytes]] = deque(maxlen=size)
        self.last_id = 0
        self.closed = False
        self._subscribers: list[EventStream] = []

    def append(
        self,
        kind: str,
        message: str,
        *,
        level: str = "info",
        progress: dict[str, Any] | None = None,
        data: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """
        Record one event and tell every subscriber; answers the event.
        """
        self.last_id += 1
        if len(message) > MAX_MESSAGE_CHARACTERS:
            message = message[:MAX_MESSAGE_CHARACTERS] + "…"
        event: dict[str, Any] = {
            "id": self.last_id,
            "ts": iso_utc(self._clock.seconds()),
            "source": "install",
            "level": level,
            "kind": kind,
            "message": message,
            "correlationId": self.correlation,
        }
        if progress is not None:
            event["progress"] = progress
        if data is not None:
            event["data"] = data
        frame = f"id: {self.last_id}\nevent: {kind}\ndata: {json.dumps(event)}\n\n".encode()
        self._frames.append((self.last_id, frame))
        for subscriber in list(self._subscribers):
            subscriber.appended()
        return event

    def after(self, last_id: int) -> tuple[bool, list[tuple[int, bytes]]]:
        """
        The frames after event C{last_id}, and whether some of those are gone from the
        buffer (the reader must re-read the job: C{resync}).
        """
        if not self._frames or last_id >= self.last_id:
            return False, []
        first = self._frames[0][0]
        lost = last_id + 1 < first
        return lost, [(n, frame) for n, frame in self._frames if n > last_id]

    def subscribe(self, stream: "EventStream") -> None:
        self._subscribers.append(stream)

    def unsubscribe(self, stream: "EventStream") -> None:
        if stream in self._subscribers:
            self._subscribers.remove(stream)

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    def close(self) -> None:
        """
        The server is stopping: end every stream.
        """
        self.closed = True
        for subscriber in list(self._subscribers):
            subscriber.finish()


_RESYNC = b"event: resync\ndata: {}\n\n"
_HEARTBEAT = b": ping\n\n"


@implementer(IPushProducer)
class EventStream:
    """
    One client following a job: the frames after its cursor, written while its
    transport takes them.  Paused, it writes nothing and keeps its cursor; resumed, it
    catches up from the buffer, with C{resync} first if it fell out of it.
    """

    def __init__(self, request: Any, events: EventLog, cursor: int, clock: IReactorTime,
                 heartbeat: float = HEARTBEAT_SECONDS) -> None:
        self._request = request
        self._events = events
        self.cursor = cursor
        self._clock = clock
        self._heartbeat_every = heartbeat
        self._heartbeat: IDelayedCall | None = None
        self.paused = False
        self.done: Deferred[None] = Deferred(lambda _: self._stop())
        self._stopped = False

    def start(self) -> "Deferred[None]":
        """
        Send the headers and what is already there; fires when the stream has ended
        (the client went, or the server is stopping).
        """
        request = self._request
        request.setResponseCode(200)
        request.setHeader(b"Content-Type", b"text/event-stream; charset=utf-8")
        request.setHeader(b"Cache-Control", b"no-cache, no-transform")
        request.setHeader(b"X-Accel-Buffering", b"no")
        request.registerProducer(self, True)
        self._events.subscribe(self)
        if self.cursor > self._events.last_id:
            # A resume point this job never reached (another server's, before a restart):
            # the client must re-read the job, and is sent everything there is.
            request.write(_RESYNC)
            self.cursor = 0
        request.notifyFinish().addBoth(self._gone)
        # The headers go now, before any event: a client learns at once that it follows.
        request.write(b": following " + self._events.correlation.encode() + b"\n\n")
        self._pump()
        self._arm()
        if self._events.closed:
            self.finish()
        return self.done

    def appended(self) -> None:
        if not self.paused:
            self._pump()

    def _pump(self) -> None:
        if self._stopped:
            return
        lost, frames = self._events.after(self.cursor)
        if lost:
            self._request.write(_RESYNC)
        for number, frame in frames:
            self._request.write(frame)
            self.cursor = number
            if self.paused or self._stopped:
                # The transport is full: the rest waits in the buffer, not here.
                return
        self._arm()

    def _arm(self) -> None:
        if self._heartbeat is not None and self._heartbeat.active():
            self._heartbeat.reset(self._heartbeat_every)
        elif not self._stopped:
            self._heartbeat = self._clock.callLater(self._heartbeat_every, self._beat)

    def _beat(self) -> None:
        self._heartbeat = None
        if self._stopped:
            return
        if not self.paused:
            self._request.write(_HEARTBEAT)
        self._arm()

    # IPushProducer
    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False
        self._pump()

    def stopProducing(self) -> None:
        self._stop()

    def _gone(self, _: object) -> None:
        self._stop()
        if not self.done.called:
            self.done.callback(None)

    def _stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._events.unsubscribe(self)
        if self._heartbeat is not None and self._heartbeat.active():
            self._heartbeat.cancel()
        self._heartbeat = None

    def finish(self) -> None:
        """
        End the stream from the server's side (it is stopping).
        """
        self._stop()
        try:
            self._request.unregisterProducer()
        except Exception:
            pass
        if not self.done.called:
            self.done.callback(None)


def last_event_id(request: IRequest) -> int:
    """
    Where a reconnecting client left off: its C{Last-Event-ID} header, else a
    C{lastEventId} query parameter (a page cannot set the header on a new EventSource),
    else 0.
    """
    header = request.getHeader(b"last-event-id")
    raw = header.decode("latin-1") if isinstance(header, bytes) else header
    where = "Last-Event-ID"
    if raw is None:
        values = (request.args or {}).get(b"lastEventId")
        if not values:
            return 0
        if len(values) > 1:
            raise BadRequest("lastEventId is given more than once", field="lastEventId")
        raw, where = values[0].decode("latin-1"), "lastEventId"
    text = raw.strip()
    if not text.isascii() or not text.isdigit() or len(text) > 15:
        raise BadRequest(f"{where} must be an event id (a whole number), not {raw!r}", field=where)
    return int(text)


class JobFailed(Exception):
    """
    A step failed; C{error} is what the job reports.
    """

    def __init__(self, error: SpeechError) -> None:
        super().__init__(error.message)
        self.error = error


class JobContext:
    """
    What a job's work is given: its steps, its log, and the command it has running (so
    that a shutdown can stop it).
    """

    def __init__(self, job: "Job") -> None:
        self.job = job
        #: Stops what the job is running now; set by whoever runs a command for it.
        self.cancel: Callable[[str], None] | None = None
        self.cancelled: str | None = None

    def step(self, name: str) -> None:
        job = self.job
        job.step = name
        steps = job.steps
        job.events.append(
            "progress",
            f"{job.kind} {job.engine}: {name}",
            progress={"phase": name, "index": steps.index(name) + 1, "total": len(steps), "status": "running"},
        )

    def log(self, line: str, level: str = "info") -> None:
        self.job.events.append("log", line, level=level)

    def stop(self, why: str) -> None:
        self.cancelled = why
        if self.cancel is not None:
            self.cancel(why)


class Job:
    """
    One install, reinstall or pull: what GET /installs/{job} shows, and its events.
    """

    def __init__(self, job_id: str, engine: str, kind: str, clock: IReactorTime,
                 variant: str | None = None) -> None:
        self.id = job_id
        self.engine = engine
        self.kind = kind
        self.variant = variant
        self.state = "queued"
        self.step: str | None = None
        self.created_at = clock.seconds()
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self.error: dict[str, Any] | None = None
        self.steps: tuple[str, ...] = STEPS[kind] + (("weights",) if kind == "install" and variant else ())
        self.events = EventLog(job_id, clock)
        self.context = JobContext(self)

    @property
    def active(self) -> bool:
        return self.state in ("queued", "running")

    def document(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"id": self.id, "engine": self.engine, "kind": self.kind}
        if self.variant is not None:
            doc["variant"] = self.variant
        doc["state"] = self.state
        if self.step is not None:
            doc["step"] = self.step
        doc["createdAt"] = iso_utc(self.created_at)
        if self.started_at is not None:
            doc["startedAt"] = iso_utc(self.started_at)
        if self.finished_at is not None:
            doc["finishedAt"] = iso_utc(self.finished_at)
        if self.error is not None:
            doc["error"] = self.error
        return doc


Work = Callable[[JobContext], Awaitable[None]]


class Jobs:
    """
    Every job this process knows of, and the one running: one at a time, the rest
    queued in the order they came, because two pip installs racing for one disk and one
    network connection finish later than the same two in a line.
    """

    log = Logger()

    def __init__(self, clock: IReactorTime, keep_finished: int = KEEP_FINISHED) -> None:
        self._clock = clock
        self._keep_finished = keep_finished
        self._jobs: dict[str, Job] = {}
        self._queue: deque[tuple[Job, Work]] = deque()
        self.running: Job | None = None
        self._running_work: Deferred[None] | None = None
        self._closing = False
        self._streams = 0
        #: Told of each job that ends, with its state (the core's metrics).
        self.on_finished: Callable[[Job], None] = lambda job: None

    def submit(self, engine: str, kind: str, work: Work, variant: str | None = None) -> Job:
        """
        Queue a job; it starts at once if nothing is running.

        @raise Overloaded: the server is stopping, or too many jobs wait already.
        """
        if self._closing:
            raise Overloaded("the server is stopping; it takes no new job")
        if len(self._queue) >= MAX_QUEUED:
            raise Overloaded(f"{MAX_QUEUED} jobs are waiting already; try again once some have run")
        job = Job(new_job_id(self._clock.seconds()), engine, kind, self._clock, variant)
        self._jobs[job.id] = job
        job.events.append("status", f"{kind} {engine} queued")
        self._queue.append((job, work))
        self._next()
        return job

    def get(self, job_id: str) -> Job:
        """
        @raise BadRequest: with a 404, as an unknown route is (protocol.md section 10).
        """
        job = self._jobs.get(job_id)
        if job is None:
            raise BadRequest(f'no job "{job_id}" (a finished job is kept until {self._keep_finished} '
                             "newer ones have finished)", field="job", status=404)
        return job

    def all(self) -> list[Job]:
        """
        Every job known, newest first.
        """
        return sorted(self._jobs.values(), key=lambda job: (job.created_at, job.id), reverse=True)

    def active(self, engine: str) -> Job | None:
        """
        The job queued or running for C{engine}, if there is one.
        """
        for job in self._jobs.values():
            if job.engine == engine and job.active:
                return job
        return None

    def open_stream(self, request: Any, job: Job, cursor: int) -> "Deferred[None]":
        """
        Follow C{job}'s events on C{request} from after event C{cursor}.

        @raise Overloaded: too many streams are open, on this job or in all.
        """
        if job.events.subscribers >= STREAMS_PER_JOB or self._streams >= STREAMS_IN_ALL:
            raise Overloaded("too many event streams are open; close one and try again")
        stream = EventStream(request, job.events, cursor, self._clock)
        self._streams += 1

        def ended(result: object) -> object:
            self._streams -= 1
            if isinstance(result, Failure) and result.check(CancelledError):
                return None
            return result

        return stream.start().addBoth(ended)

    def _next(self) -> None:
        if self.running is not None or not self._queue or self._closing:
            return
        job, work = self._queue.popleft()
        self.running = job
        job.state = "running"
        job.started_at = self._clock.seconds()
        job.events.append("status", f"{job.kind} {job.engine} started")
        running = Deferred.fromCoroutine(self._run(job, work))
        # Work that ended at once has started the next job already, inside the line
        # above: that job's work is the one running now, not this.
        if self.running is job:
            self._running_work = running

    async def _run(self, job: Job, work: Work) -> None:
        try:
            await work(job.context)
        except JobFailed as failed:
            self._failed(job, failed.error)
        except SpeechError as error:
            self._failed(job, error)
        except Exception as error:
            self.log.failure("{kind} {engine} failed", kind=job.kind, engine=job.engine)
            self._failed(job, Internal(f"{job.kind} {job.engine} failed: {type(error).__name__}: {error}"))
        else:
            if job.context.cancelled is not None:
                self._failed(job, Internal(job.context.cancelled))
            else:
                self._succeeded(job)
        finally:
            self.running = None
            self._running_work = None
            self._forget_old()
            self._next()

    def _succeeded(self, job: Job) -> None:
        job.state = "succeeded"
        job.finished_at = self._clock.seconds()
        last = job.steps[-1]
        job.events.append("status", f"{job.kind} {job.engine} succeeded")
        job.events.append(
            "progress",
            f"{job.kind} {job.engine}: done",
            progress={"phase": last, "index": len(job.steps), "total": len(job.steps), "status": "done"},
        )
        self.on_finished(job)

    def _failed(self, job: Job, error: SpeechError) -> None:
        job.state = "failed"
        job.finished_at = self._clock.seconds()
        job.error = error.envelope()["error"]
        phase = job.step or job.steps[0]
        # The error first: a client stops reading at the progress that ends the job.
        job.events.append("error", error.message, level="error", data={"error": job.error})
        job.events.append(
            "progress",
            f"{job.kind} {job.engine} failed at {phase}",
            level="error",
            progress={"phase": phase, "index": job.steps.index(phase) + 1 if phase in job.steps else 1,
                      "total": len(job.steps), "status": "failed"},
        )
        self.on_finished(job)

    def _forget_old(self) -> None:
        finished = sorted((job for job in self._jobs.values() if not job.active),
                          key=lambda job: job.finished_at or 0.0)
        for job in finished[: max(0, len(finished) - self._keep_finished)]:
            if job.events.subscribers == 0:
                del self._jobs[job.id]

    async def close(self, why: str = "stopped by server shutdown") -> None:
        """
        The server is stopping: queued jobs fail without starting, the running one's
        command is stopped and the job fails, and every event stream ends.
        """
        self._closing = True
        while self._queue:
            job, _ = self._queue.popleft()
            self._failed(job, Internal(f"{job.kind} {job.engine} {why} before it started"))
        running, work = self.running, self._running_work
        if running is not None and work is not None:
            running.context.stop(f"{running.kind} {running.engine} {why}")
            try:
                await work
            except Exception:
                pass
        for job in self._jobs.values():
            job.events.close()

    def documents(self, jobs: Sequence[Job]) -> list[dict[str, Any]]:
        return [job.document() for job in jobs]
