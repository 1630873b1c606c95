"""
Install jobs and their events (protocol.md section 10, "Jobs") on a L{Clock}: the replay
buffer and its server-sent frames, a stream's cursor under backpressure, its heartbeat
and its end, the queue that runs one job at a time, and where a reconnecting client
left off.  A job's work is a coroutine awaiting Deferreds the test fires; a stream's
request is a small fake that records what it is told and finishes when the test says.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.logger import capturedLogs
from twisted.python.failure import Failure
from twisted.web.test.requesthelper import DummyRequest

from rhapsode._manage.jobs import (
    HEARTBEAT_SECONDS,
    MAX_MESSAGE_CHARACTERS,
    MAX_QUEUED,
    STREAMS_IN_ALL,
    STREAMS_PER_JOB,
    EventLog,
    EventStream,
    Job,
    JobContext,
    JobFailed,
    last_event_id,
    new_job_id,
)
from rhapsode._manage.jobs import Jobs as _Jobs
from rhapsode_protocol.errors import BadRequest, Conflict, Internal, Overloaded

from _deferreds import result_of

#: 2026-09-18T14:02:11.000Z, protocol.md section 10's example job's createdAt.
EXAMPLE_MOMENT = 1789740131.0



class FakeRequest:
    """
    What an event stream needs of a request: a code, headers, a producer registered
    streaming, writes, and notifyFinish answering a Deferred the test fires (the client
    went) or fails (the connection was lost).  With C{full_after}, the transport is full
    after that many writes, and pauses its producer as a real one would.
    """

    def __init__(self, full_after: int | None = None) -> None:
        self.code: int | None = None
        self.headers: dict[bytes, bytes] = {}
        self.producer: Any = None
        self.streaming: bool | None = None
        self.unregistered = 0
        self.written: list[bytes] = []
        self.finished: Deferred[None] = Deferred()
        self.full_after = full_after

    def setResponseCode(self, code: int) -> None:
        self.code = code

    def setHeader(self, name: bytes, value: bytes) -> None:
        self.headers[name] = value

    def registerProducer(self, producer: Any, streaming: bool) -> None:
        self.producer = producer
        self.streaming = streaming

    def unregisterProducer(self) -> None:
        self.producer = None
        self.unregistered += 1

    def write(self, data: bytes) -> None:
        self.written.append(data)
        if self.full_after is not None and len(self.written) >= self.full_after and self.producer is not None:
            self.full_after = None
            self.producer.pauseProducing()

    def notifyFinish(self) -> Deferred[None]:
        return self.finished

    def text(self) -> str:
        return b"".join(self.written).decode()

    def ids(self) -> list[int]:
        """
        The event ids written, in order.
        """
        return [int(line[4:]) for line in self.text().split("\n") if line.startswith("id: ")]

    def take(self) -> str:
        """
        What was written since the last take.
        """
        text = self.text()
        self.written.clear()
        return text


def parse(frame: str) -> tuple[int, str, dict[str, Any]]:
    """
    One server-sent frame's id, event name and data.
    """
    assert frame.endswith("\n\n"), frame
    lines = frame[:-2].split("\n")
    assert lines[0].startswith("id: ") and lines[1].startswith("event: ") and lines[2].startswith("data: "), frame
    assert len(lines) == 3, frame
    return int(lines[0][4:]), lines[1][7:], json.loads(lines[2][6:])


def frames(text: str) -> list[str]:
    return [part + "\n\n" for part in text.split("\n\n") if part]


# -- the replay buffer ------------------------------------------------------------------


def test_events_are_numbered_from_one_and_framed_as_server_sent_events() -> None:
    """
    Each event gets the next id from 1 and one frame: id, an event named after its kind,
    and its JSON (the FeedEvent shape) as data, ended by a blank line.
    """
    clock = Clock()
    clock.advance(EXAMPLE_MOMENT)
    events = EventLog("01J8Z6Q4B7", clock)
    first = events.append("status", "install kokoro queued")
    second = events.append(
        "progress", "install kokoro: venv",
        progress={"phase": "venv", "index": 1, "total": 4, "status": "running"},
    )
    third = events.append("log", "Collecting x", level="debug", data={"fd": 1})
    assert [first["id"], second["id"], third["id"]] == [1, 2, 3]
    assert events.last_id == 3
    lost, replay = events.after(0)
    assert not lost
    assert [number for number, _ in replay] == [1, 2, 3]
    number, name, data = parse(replay[1][1].decode())
    assert (number, name) == (2, "progress")
    assert data == {
        "id": 2, "ts": "2026-09-18T14:02:11.000Z", "source": "install", "level": "info", "kind": "progress",
        "message": "install kokoro: venv", "correlationId": "01J8Z6Q4B7",
        "progress": {"phase": "venv", "index": 1, "total": 4, "status": "running"},
    }
    assert replay[0][1] == (
        b'id: 1\nevent: status\ndata: {"id": 1, "ts": "2026-09-18T14:02:11.000Z", "source": "install", '
        b'"level": "info", "kind": "status", "message": "install kokoro queued", "correlationId": "01J8Z6Q4B7"}\n\n'
    )
    assert parse(replay[2][1].decode())[2]["level"] == "debug"
    assert parse(replay[2][1].decode())[2]["data"] == {"fd": 1}


def test_a_line_with_a_newline_stays_inside_one_frame() -> None:
    """
    A message holding a newline or a blank line cannot end its frame early: the data is
    JSON, so it travels escaped.
    """
    events = EventLog("job", Clock())
    events.append("log", "one\n\nid: 99\nevent: error")
    [(_, frame)] = events.after(0)[1]
    assert frame.count(b"\n\n") == 1 and frame.endswith(b"\n\n")
    assert parse(frame.decode())[2]["message"] == "one\n\nid: 99\nevent: error"


def test_replay_after_a_cursor_is_what_came_after_it() -> None:
    """
    after(n) answers the frames numbered above n; at or past the newest it answers none.
    """
    events = EventLog("job", Clock())
    for n in range(5):
        events.append("log", f"line {n}")
    assert [number for number, _ in events.after(3)[1]] == [4, 5]
    assert events.after(5) == (False, [])
    assert events.after(50) == (False, [])
    assert EventLog("empty", Clock()).after(0) == (False, [])


def test_a_cursor_that_fell_out_of_the_buffer_is_lost() -> None:
    """
    With a buffer of three, a reader at 1 after six events has missed 2 and 3: lost, and
    answered what is left (4 to 6).  A reader at 3 has missed nothing.
    """
    events = EventLog("job", Clock(), size=3)
    for n in range(6):
        events.append("log", f"line {n}")
    lost, replay = events.after(1)
    assert lost and [number for number, _ in replay] == [4, 5, 6]
    assert events.after(3)[0] is False
    assert [number for number, _ in events.after(3)[1]] == [4, 5, 6]
    assert events.after(0)[0] is True


def test_a_long_message_is_cut() -> None:
    """
    A line longer than MAX_MESSAGE_CHARACTERS (a progress bar redrawn forever) is cut to
    that many characters and an ellipsis; a line of exactly that length is kept whole.
    """
    events = EventLog("job", Clock())
    cut = events.append("log", "x" * (MAX_MESSAGE_CHARACTERS * 3))
    whole = events.append("log", "y" * MAX_MESSAGE_CHARACTERS)
    assert cut["message"] == "x" * MAX_MESSAGE_CHARACTERS + "…"
    assert whole["message"] == "y" * MAX_MESSAGE_CHARACTERS


def test_job_ids_sort_in_the_order_jobs_were_made() -> None:
    """
    An id is sixteen characters of Crockford's base32, and a later job's sorts after an
    earlier one's, even a millisecond later.
    """
    ids = [new_job_id(EXAMPLE_MOMENT + step / 1000) for step in range(0, 50, 7)]
    assert ids == sorted(ids)
    assert all(len(i) == 16 and set(i) <= set("0123456789ABCDEFGHJKMNPQRSTVWXYZ") for i in ids)
    assert len(set(new_job_id(EXAMPLE_MOMENT) for _ in range(20))) == 20


# -- one stream ---------------------------------------------------------------------------


def stream_on(events: EventLog, clock: Clock, cursor: int = 0, full_after: int | None = None) -> tuple[
        EventStream, FakeRequest, Deferred[None]]:
    request = FakeRequest(full_after)
    stream = EventStream(request, events, cursor, clock)
    return stream, request, stream.start()


def test_a_stream_sends_its_headers_and_registers_as_a_streaming_producer() -> None:
    """
    200, text/event-stream, no-cache (and no-transform, and no proxy buffering), the
    stream registered as a push producer, and a comment at once so the client knows.
    """
    clock = Clock()
    events = EventLog("JOB1", clock)
    stream, request, done = stream_on(events, clock)
    assert request.code == 200
    assert request.headers[b"Content-Type"].startswith(b"text/event-stream")
    assert b"no-cache" in request.headers[b"Cache-Control"]
    assert b"no-transform" in request.headers[b"Cache-Control"]
    assert request.headers[b"X-Accel-Buffering"] == b"no"
    assert request.producer is stream and request.streaming is True
    assert request.text().startswith(": following JOB1\n\n")
    assert events.subscribers == 1
    assert not done.called


def test_a_stream_catches_up_from_its_cursor_then_follows() -> None:
    """
    A client resuming at 2 (its Last-Event-ID) gets 3 and on from the buffer, then each
    new event as it is appended.
    """
    clock = Clock()
    events = EventLog("job", clock)
    for n in range(4):
        events.append("log", f"line {n}")
    stream, request, _ = stream_on(events, clock, cursor=2)
    assert request.ids() == [3, 4]
    events.append("status", "done")
    assert request.ids() == [3, 4, 5]
    assert stream.cursor == 5
    assert "event: status" in request.text()


def test_a_resume_point_the_job_never_reached_is_resync_and_everything() -> None:
    """
    A Last-Event-ID past the job's newest event (another server's, before a restart) is
    sent resync and then every event there is, not silence until ids catch up.
    """
    clock = Clock()
    events = EventLog("job", clock)
    for n in range(3):
        events.append("log", f"line {n}")
    stream, request, _ = stream_on(events, clock, cursor=40)
    assert "event: resync" in request.text()
    assert request.ids() == [1, 2, 3]
    assert stream.cursor == 3


def test_a_paused_stream_writes_nothing_and_keeps_its_cursor_then_catches_up() -> None:
    """
    While its transport is full the stream writes nothing and its cursor stays where the
    client is; resumed, it writes what it missed, from the buffer, in order.
    """
    clock = Clock()
    events = EventLog("job", clock)
    stream, request, _ = stream_on(events, clock)
    events.append("log", "one")
    request.take()
    stream.pauseProducing()
    for n in range(3):
        events.append("log", f"more {n}")
    assert request.written == []
    assert stream.cursor == 1
    stream.resumeProducing()
    assert request.ids() == [2, 3, 4]
    assert stream.cursor == 4


def test_a_stream_paused_mid_catch_up_stops_where_its_transport_filled() -> None:
    """
    The transport fills during the catch-up: the stream stops there, the rest stays in
    the buffer (not in the stream), and resuming goes on from the frame after.
    """
    clock = Clock()
    events = EventLog("job", clock)
    for n in range(6):
        events.append("log", f"line {n}")
    # The comment, then two frames fill it.
    stream, request, _ = stream_on(events, clock, full_after=3)
    assert request.ids() == [1, 2]
    assert stream.paused and stream.cursor == 2
    request.take()
    stream.resumeProducing()
    assert request.ids() == [3, 4, 5, 6]


def test_a_paused_reader_that_fell_out_of_the_buffer_is_sent_resync_then_the_newest() -> None:
    """
    A reader paused while more events came than the buffer holds is sent resync when it
    resumes, then what the buffer has, and nothing from before the gap.
    """
    clock = Clock()
    events = EventLog("job", clock, size=4)
    stream, request, _ = stream_on(events, clock)
    events.append("log", "first")
    request.take()
    stream.pauseProducing()
    for n in range(10):
        events.append("log", f"line {n}")
    assert request.written == []
    stream.resumeProducing()
    text = request.take()
    assert text.startswith("event: resync\ndata: {}\n\n")
    assert [parse(f)[0] for f in frames(text)[1:]] == [8, 9, 10, 11]
    assert stream.cursor == 11


def test_a_client_resuming_from_before_the_buffer_is_sent_resync_first() -> None:
    """
    A Last-Event-ID that has fallen out of the buffer gets resync before the catch-up.
    """
    clock = Clock()
    events = EventLog("job", clock, size=2)
    for n in range(5):
        events.append("log", f"line {n}")
    _, request, _ = stream_on(events, clock, cursor=1)
    text = request.text()
    assert text.index("event: resync") < text.index("id: 4")
    assert request.ids() == [4, 5]


def test_an_idle_stream_is_sent_a_heartbeat_every_fifteen_seconds() -> None:
    """
    Nothing for 15 s: a ": ping" comment, so a proxy does not take the stream for dead;
    an event puts the next ping off by another 15 s.
    """
    clock = Clock()
    events = EventLog("job", clock)
    _, request, _ = stream_on(events, clock)
    assert HEARTBEAT_SECONDS == 15.0
    request.take()
    clock.advance(14.9)
    assert request.written == []
    clock.advance(0.1)
    assert request.take() == ": ping\n\n"
    clock.advance(10)
    events.append("log", "something")
    request.take()
    clock.advance(14.9)
    assert request.written == []
    clock.advance(0.1)
    assert request.take() == ": ping\n\n"
    assert len(clock.getDelayedCalls()) == 1


def test_no_heartbeat_is_written_while_paused() -> None:
    """
    A paused stream's transport is full: a heartbeat would be one more write into it.
    The heartbeat goes on once it is resumed.
    """
    clock = Clock()
    events = EventLog("job", clock)
    stream, request, _ = stream_on(events, clock)
    request.take()
    stream.pauseProducing()
    clock.advance(HEARTBEAT_SECONDS * 3)
    assert request.written == []
    stream.resumeProducing()
    clock.advance(HEARTBEAT_SECONDS)
    assert request.take() == ": ping\n\n"


@pytest.mark.parametrize("how", ["callback", "errback"])
def test_a_client_that_goes_is_unsubscribed_and_its_heartbeat_cancelled(how: str) -> None:
    """
    notifyFinish fires (the client finished) or fails (the connection was lost): the
    stream leaves the log, cancels its heartbeat, its Deferred fires, and later events
    are written nowhere.
    """
    clock = Clock()
    events = EventLog("job", clock)
    _, request, done = stream_on(events, clock)
    if how == "callback":
        request.finished.callback(None)
    else:
        request.finished.errback(Failure(ConnectionError("lost")))
    assert events.subscribers == 0
    assert clock.getDelayedCalls() == []
    assert result_of(done) is None
    request.take()
    events.append("log", "after")
    clock.advance(HEARTBEAT_SECONDS * 2)
    assert request.written == []


def test_cancelling_a_stream_unsubscribes_it() -> None:
    """
    Klein cancels the route's Deferred when the client goes: the stream unsubscribes
    and its heartbeat stops.
    """
    clock = Clock()
    events = EventLog("job", clock)
    _, _, done = stream_on(events, clock)
    done.cancel()
    assert events.subscribers == 0
    assert clock.getDelayedCalls() == []
    done.addErrback(lambda _: None)


def test_a_closed_log_ends_its_streams_and_a_late_one_at_once() -> None:
    """
    Closing the log (the server stopping) ends every stream: unregistered, Deferred
    fired, heartbeat cancelled.  A stream opened on a closed log replays and ends.
    """
    clock = Clock()
    events = EventLog("job", clock)
    events.append("log", "one")
    _, request, done = stream_on(events, clock)
    events.close()
    assert result_of(done) is None
    assert request.unregistered == 1
    assert events.subscribers == 0 and clock.getDelayedCalls() == []
    _, late, late_done = stream_on(events, clock)
    assert late.ids() == [1]
    assert result_of(late_done) is None
    assert clock.getDelayedCalls() == []


# -- jobs -------------------------------------------------------------------------------


_MADE: list[_Jobs] = []


def Jobs(clock: Clock, **options: Any) -> _Jobs:
    """
    A job queue that is closed when the test ends, so that no job's work is left
    waiting on a Deferred nobody will fire.
    """
    jobs = _Jobs(clock, **options)
    _MADE.append(jobs)
    return jobs


@pytest.fixture(autouse=True)
def _close_jobs() -> Any:
    yield
    while _MADE:
        Deferred.fromCoroutine(_MADE.pop().close())


class Gates:
    """
    Work for jobs that records what it did and waits, at each step, for the test.
    """

    def __init__(self) -> None:
        self.record: list[str] = []
        self.gates: dict[str, Deferred[None]] = {}

    def work(self, name: str, steps: tuple[str, ...] = ("venv",)) -> Callable[[JobContext], Any]:
        async def work(context: JobContext) -> None:
            self.record.append(f"{name} started")
            context.cancel = lambda why: self.fail(name, JobFailed(Internal(why))) if name in self.gates else None
            for step in steps:
                context.step(step)
                gate: Deferred[None] = Deferred()
                self.gates[name] = gate
                await gate
            self.record.append(f"{name} ended")

        return work

    def open(self, name: str) -> None:
        self.gates.pop(name).callback(None)

    def fail(self, name: str, error: BaseException) -> None:
        self.gates.pop(name).errback(Failure(error))


def kinds(job: Job) -> list[str]:
    return [parse(frame.decode())[1] for _, frame in job.events.after(0)[1]]


def data(job: Job) -> list[dict[str, Any]]:
    return [parse(frame.decode())[2] for _, frame in job.events.after(0)[1]]


def test_jobs_run_one_at_a_time_in_the_order_they_were_submitted() -> None:
    """
    The first starts at once; the others wait queued, and each starts when the one
    before it has ended.
    """
    clock = Clock()
    jobs = Jobs(clock)
    gates = Gates()
    a = jobs.submit("kokoro", "install", gates.work("a"))
    b = jobs.submit("piper", "install", gates.work("b"))
    c = jobs.submit("tone", "pull", gates.work("c", ("weights",)), variant="base")
    assert gates.record == ["a started"]
    assert (a.state, b.state, c.state) == ("running", "queued", "queued")
    assert jobs.running is a
    gates.open("a")
    assert gates.record == ["a started", "a ended", "b started"]
    assert (a.state, b.state, c.state) == ("succeeded", "running", "queued")
    gates.fail("b", JobFailed(Internal("pip install exited 1: no")))
    assert gates.record[-1] == "c started"
    gates.open("c")
    assert (a.state, b.state, c.state) == ("succeeded", "failed", "succeeded")
    assert jobs.running is None


def test_a_job_document_has_its_state_step_and_times() -> None:
    """
    Queued: id, engine, kind, variant, state, createdAt.  Running: step and startedAt.
    Finished: finishedAt, and no error on success.
    """
    clock = Clock()
    clock.advance(EXAMPLE_MOMENT)
    jobs = Jobs(clock)
    gates = Gates()
    jobs.submit("kokoro", "install", gates.work("first"))
    job = jobs.submit("chatterbox", "install", gates.work("second", ("venv", "packages")), variant="turbo")
    assert job.document() == {
        "id": job.id, "engine": "chatterbox", "kind": "install", "variant": "turbo",
        "state": "queued", "createdAt": "2026-09-18T14:02:11.000Z",
    }
    assert job.steps == ("venv", "packages", "verify", "register", "weights")
    clock.advance(0.004)
    gates.open("first")
    clock.advance(1)
    gates.open("second")
    doc = job.document()
    assert doc["state"] == "running" and doc["step"] == "packages"
    assert doc["startedAt"] == "2026-09-18T14:02:11.004Z"
    assert "finishedAt" not in doc
    clock.advance(2)
    gates.open("second")
    doc = job.document()
    assert doc["state"] == "succeeded" and doc["finishedAt"] == "2026-09-18T14:02:14.004Z"
    assert "error" not in doc


def test_a_job_without_a_variant_has_none_in_its_document() -> None:
    """
    An install without ?pull= has the four steps and no variant field.
    """
    jobs = Jobs(Clock())
    job = jobs.submit("kokoro", "install", Gates().work("a"))
    assert "variant" not in job.document()
    assert job.steps == ("venv", "packages", "verify", "register")
    assert Job("x", "e", "pull", Clock(), "base").steps == ("weights",)
    assert Job("x", "e", "reinstall", Clock()).steps == ("venv", "packages", "verify", "register")


def test_a_succeeded_job_ends_with_its_status_then_progress_done() -> None:
    """
    queued, started, each step's progress{running}, log lines, then status "succeeded"
    and last a progress done whose index is the total.
    """
    jobs = Jobs(Clock())

    async def work(context: JobContext) -> None:
        for step in ("venv", "packages", "verify", "register"):
            context.step(step)
            context.log(f"{step} line")

    job = jobs.submit("kokoro", "install", work)
    assert job.state == "succeeded"
    assert kinds(job) == ["status", "status"] + ["progress", "log"] * 4 + ["status", "progress"]
    every = data(job)
    assert every[0]["message"] == "install kokoro queued"
    assert every[2]["progress"] == {"phase": "venv", "index": 1, "total": 4, "status": "running"}
    assert every[8]["progress"]["index"] == 4
    assert every[-2]["message"] == "install kokoro succeeded"
    assert every[-1]["progress"] == {"phase": "register", "index": 4, "total": 4, "status": "done"}
    assert all(event["correlationId"] == job.id for event in every)


def test_a_failed_job_sends_its_error_then_progress_failed_last() -> None:
    """
    A step fails: the job's error is the envelope's body, an error event carries it, and
    the last event is a progress failed at that step (a client stops reading there).
    """
    jobs = Jobs(Clock())
    gates = Gates()
    job = jobs.submit("kokoro", "install", gates.work("a", ("venv", "packages")))
    gates.open("a")
    gates.fail("a", JobFailed(Internal("pip install exited 1: No matching distribution found for x")))
    assert job.state == "failed"
    assert job.error == {
        "code": "internal", "message": "pip install exited 1: No matching distribution found for x",
        "retryable": False,
    }
    assert job.document()["error"] == job.error
    assert kinds(job)[-2:] == ["error", "progress"]
    error, progress = data(job)[-2:]
    assert error["level"] == "error" and error["data"] == {"error": job.error}
    assert progress["progress"] == {"phase": "packages", "index": 2, "total": 4, "status": "failed"}


def test_a_refusal_raised_by_the_work_is_the_jobs_error() -> None:
    """
    A SpeechError raised by the work (a conflict at register) keeps its code.
    """
    jobs = Jobs(Clock())

    async def work(context: JobContext) -> None:
        context.step("venv")
        raise Conflict('engine "kokoro" is speaking after 600 s', field="engine")

    job = jobs.submit("kokoro", "reinstall", work)
    assert job.error is not None and job.error["code"] == "conflict" and job.error["field"] == "engine"


def test_an_unexpected_exception_fails_the_job_as_internal_and_is_logged() -> None:
    """
    A bug in the work is an internal error naming the exception, logged with its
    traceback; the next job still runs.
    """
    jobs = Jobs(Clock())

    async def broken(context: JobContext) -> None:
        raise KeyError("python")

    gates = Gates()
    with capturedLogs() as logs:
        job = jobs.submit("kokoro", "install", broken)
        after = jobs.submit("piper", "install", gates.work("after"))
    assert job.state == "failed" and job.error is not None
    assert job.error["code"] == "internal"
    assert "KeyError" in job.error["message"]
    assert any(event.get("log_failure") is not None for event in logs)
    assert kinds(job)[-1] == "progress"
    assert after.state == "running"


def test_a_job_not_known_is_bad_request_with_a_404() -> None:
    """
    GET /installs/{job} for an id nobody made: bad_request, status 404, field job.
    """
    jobs = Jobs(Clock())
    with pytest.raises(BadRequest) as caught:
        jobs.get("01J8Z6Q4B7000000")
    assert caught.value.status == 404 and caught.value.field == "job"
    job = jobs.submit("kokoro", "install", Gates().work("a"))
    assert jobs.get(job.id) is job


def test_finished_jobs_are_kept_only_up_to_keep_finished() -> None:
    """
    With keep_finished 2, a finished job is forgotten once two newer ones have finished
    after it; a running or queued one is never forgotten, nor one a client follows.
    """
    clock = Clock()
    jobs = Jobs(clock, keep_finished=2)

    async def quick(context: JobContext) -> None:
        pass

    made = []
    for n in range(3):
        clock.advance(1)
        made.append(jobs.submit(f"e{n}", "pull", quick, variant="base"))
    known = {job.id for job in jobs.all()}
    assert known == {made[1].id, made[2].id}
    with pytest.raises(BadRequest):
        jobs.get(made[0].id)
    # A job somebody follows is kept past its time.
    _, request, _ = stream_on(made[1].events, clock)
    gates = Gates()
    clock.advance(1)
    jobs.submit("e3", "pull", quick, variant="base")
    clock.advance(1)
    jobs.submit("e4", "pull", quick, variant="base")
    running = jobs.submit("e5", "install", gates.work("long"))
    ids = [job.id for job in jobs.all()]
    assert made[1].id in ids and running.id in ids and made[2].id not in ids
    assert ids == sorted(ids, reverse=True)  # newest first


def test_close_fails_queued_jobs_and_stops_the_running_ones_command() -> None:
    """
    Shutdown: queued jobs fail without starting; the running job's command is stopped
    through its context, and the job fails once its work has ended; every stream ends.
    """
    clock = Clock()
    jobs = Jobs(clock)
    stopped: list[str] = []
    ended: Deferred[None] = Deferred()

    async def running_work(context: JobContext) -> None:
        context.step("venv")

        def cancel(why: str) -> None:
            stopped.append(why)
            # The process group takes a moment to go.
            clock.callLater(1, ended.errback, Failure(JobFailed(Internal(f"pip install was stopped: {why}"))))

        context.cancel = cancel
        await ended

    gates = Gates()
    running = jobs.submit("kokoro", "install", running_work)
    queued = jobs.submit("piper", "install", gates.work("queued"))
    _, request, stream_done = stream_on(running.events, clock)
    closing = Deferred.fromCoroutine(jobs.close())
    assert stopped == ["install kokoro stopped by server shutdown"]
    assert queued.state == "failed" and queued.error is not None
    assert "before it started" in queued.error["message"]
    assert gates.record == []
    assert not closing.called and running.state == "running"
    clock.advance(1)
    assert result_of(closing) is None
    assert running.state == "failed" and running.error is not None
    assert "stopped by server shutdown" in running.error["message"]
    assert result_of(stream_done) is None and request.unregistered == 1
    with pytest.raises(Overloaded):
        jobs.submit("tone", "install", gates.work("late"))


def test_work_that_ends_normally_after_a_stop_still_fails() -> None:
    """
    A work that swallowed the stop and returned is not a success: the job fails with
    the reason it was stopped.
    """
    clock = Clock()
    jobs = Jobs(clock)
    gate: Deferred[None] = Deferred()

    async def work(context: JobContext) -> None:
        context.cancel = lambda why: clock.callLater(0, gate.callback, None)
        await gate

    job = jobs.submit("kokoro", "install", work)
    closing = Deferred.fromCoroutine(jobs.close())
    clock.advance(0)
    result_of(closing)
    assert job.state == "failed" and job.error is not None
    assert job.error["message"] == "install kokoro stopped by server shutdown"


def test_close_waits_for_the_running_job_even_after_one_that_ended_at_once() -> None:
    """
    A queued job whose work ends without waiting (a pull refused at once) hands the turn
    on inside its own start; close() must still wait for the job running after it.
    """
    clock = Clock()
    jobs = Jobs(clock)
    gates = Gates()
    third_ended: Deferred[None] = Deferred()

    async def at_once(context: JobContext) -> None:
        raise Conflict("refused at once")

    async def third(context: JobContext) -> None:
        context.step("venv")
        context.cancel = lambda why: clock.callLater(1, third_ended.errback, Failure(JobFailed(Internal(why))))
        await third_ended

    jobs.submit("a", "install", gates.work("a"))
    second = jobs.submit("b", "pull", at_once, variant="base")
    last = jobs.submit("c", "install", third)
    gates.open("a")
    assert second.state == "failed" and last.state == "running" and jobs.running is last
    closing = Deferred.fromCoroutine(jobs.close())
    assert not closing.called, "close() returned before the running job had stopped"
    clock.advance(1)
    result_of(closing)
    assert last.state == "failed"


def test_more_than_max_queued_is_overloaded() -> None:
    """
    One running and MAX_QUEUED waiting: the next submit is overloaded and makes no job.
    """
    jobs = Jobs(Clock())
    gates = Gates()
    jobs.submit("e", "install", gates.work("running"))
    for n in range(MAX_QUEUED):
        jobs.submit(f"e{n}", "install", gates.work(f"q{n}"))
    before = len(jobs.all())
    with pytest.raises(Overloaded):
        jobs.submit("one-more", "install", gates.work("x"))
    assert len(jobs.all()) == before


def test_active_is_the_engines_queued_or_running_job() -> None:
    """
    active(engine) answers its queued or running job, and nothing once it has finished.
    """
    jobs = Jobs(Clock())
    gates = Gates()
    a = jobs.submit("kokoro", "install", gates.work("a"))
    b = jobs.submit("piper", "install", gates.work("b"))
    assert jobs.active("kokoro") is a and jobs.active("piper") is b
    assert jobs.active("tone") is None
    gates.open("a")
    assert jobs.active("kokoro") is None


def test_on_finished_is_told_of_each_job_that_ends() -> None:
    """
    The metrics hook hears each finished job once, with its final state.
    """
    jobs = Jobs(Clock())
    heard: list[tuple[str, str]] = []
    jobs.on_finished = lambda job: heard.append((job.engine, job.state))
    gates = Gates()
    jobs.submit("a", "install", gates.work("a"))
    jobs.submit("b", "install", gates.work("b"))
    gates.open("a")
    gates.fail("b", JobFailed(Internal("no")))
    assert heard == [("a", "succeeded"), ("b", "failed")]


def test_open_stream_follows_a_job_and_counts_streams() -> None:
    """
    Jobs.open_stream follows the job from the cursor; the count goes down when the
    client goes.
    """
    clock = Clock()
    jobs = Jobs(clock)
    job = jobs.submit("kokoro", "install", Gates().work("a"))
    request = FakeRequest()
    done = jobs.open_stream(request, job, 1)
    assert request.ids() == [2, 3]
    request.finished.callback(None)
    result_of(done)
    assert job.events.subscribers == 0


def test_too_many_streams_on_one_job_or_in_all_are_overloaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """
    STREAMS_PER_JOB on one job, then STREAMS_IN_ALL across jobs: the next is overloaded;
    one that ends makes room again.
    """
    clock = Clock()
    jobs = Jobs(clock)
    gates = Gates()
    job = jobs.submit("kokoro", "install", gates.work("a"))
    requests = [FakeRequest() for _ in range(STREAMS_PER_JOB)]
    for request in requests:
        jobs.open_stream(request, job, 0)
    with pytest.raises(Overloaded):
        jobs.open_stream(FakeRequest(), job, 0)
    requests[0].finished.callback(None)
    jobs.open_stream(FakeRequest(), job, 0)

    monkeypatch.setattr("rhapsode._manage.jobs.STREAMS_IN_ALL", STREAMS_PER_JOB + 2)
    other = jobs.submit("piper", "install", gates.work("b"))
    jobs.open_stream(FakeRequest(), other, 0)
    jobs.open_stream(FakeRequest(), other, 0)
    with pytest.raises(Overloaded):
        jobs.open_stream(FakeRequest(), other, 0)
    assert STREAMS_IN_ALL >= STREAMS_PER_JOB


# -- where a client left off -----------------------------------------------------------


def request_with(header: bytes | None = None, query: list[bytes] | None = None) -> DummyRequest:
    request = DummyRequest([b"installs", b"JOB", b"events"])
    if header is not None:
        request.requestHeaders.addRawHeader(b"Last-Event-ID", header)
    if query is not None:
        request.args = {b"lastEventId": query}
    return request


def test_last_event_id_from_the_header_then_the_query_else_zero() -> None:
    """
    The Last-Event-ID header, else ?lastEventId= (an EventSource cannot set the header
    on a new connection), else 0; the header wins when both are sent.
    """
    assert last_event_id(request_with()) == 0
    assert last_event_id(request_with(header=b"42")) == 42
    assert last_event_id(request_with(query=[b"7"])) == 7
    assert last_event_id(request_with(header=b"42", query=[b"7"])) == 42
    assert last_event_id(request_with(header=b" 3 ")) == 3


@pytest.mark.parametrize(
    "header, query, field",
    [
        (None, [b"1", b"2"], "lastEventId"),
        (None, [b"x"], "lastEventId"),
        (None, [b""], "lastEventId"),
        (None, [b"-1"], "lastEventId"),
        (None, ["١٢".encode()], "lastEventId"),
        (None, ["１２".encode()], "lastEventId"),
        (None, [b"1" * 16], "lastEventId"),
        (b"abc", None, "Last-Event-ID"),
        (b"1.5", None, "Last-Event-ID"),
        ("²".encode("latin-1"), None, "Last-Event-ID"),
        ("١٢".encode(), None, "Last-Event-ID"),
        (b"9" * 16, None, "Last-Event-ID"),
    ],
)
def test_a_bad_last_event_id_is_bad_request_naming_where_it_came_from(
    header: bytes | None, query: list[bytes] | None, field: str
) -> None:
    """
    Repeated, not a whole number in ASCII digits (Arabic-Indic, fullwidth, superscript),
    or longer than 15 digits: bad_request naming the header or the query parameter.
    """
    with pytest.raises(BadRequest) as caught:
        last_event_id(request_with(header=header, query=query))
    assert caught.value.field == field
    assert field in caught.value.message


def test_a_bad_header_is_quoted_as_text_not_bytes() -> None:
    """
    The refusal quotes what the client sent as it sent it, not a Python bytes literal.
    """
    with pytest.raises(BadRequest) as caught:
        last_event_id(request_with(header=b"abc"))
    assert "'abc'" in caught.value.message and "b'abc'" not in caught.value.message
