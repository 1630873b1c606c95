"""
The speech relay's parts on fakes and a Clock: the core's own trailer, a turn on an
engine and the queue behind it, the budget for buffered audio and the bound on one
answer, and a worker found silent mid-stream.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import ResponseDone
from twisted.web.test.requesthelper import DummyRequest

from rhapsode._speech.limits import BufferBudget, Turn, Turnstile
from rhapsode._speech.relay import BUFFERED_LIMIT, SECONDS_PER_CHARACTER, StreamRelay, buffered_limit
from rhapsode._upstream.body import BufferRelay, Stalls
from rhapsode_protocol.errors import ModelUnavailable, Overloaded
from rhapsode_protocol.http.answers import write_trailer

from _fakes import RecordingSink


def test_core_trailer_ends_a_chunked_body() -> None:
    """
    The core ends a chunked body itself with the duration field, and a duration it does
    not know leaves the trailer empty but the body still properly ended.
    """
    written: list[bytes] = []
    request = DummyRequest([b""])
    request.chunked = 1
    request.channel = SimpleNamespace(write=written.append)
    write_trailer(request, 1234)
    assert written == [b"0\r\nX-Rhapsode-Duration-Ms: 1234\r\n\r\n"] and request.chunked == 0
    written.clear()
    request.chunked = 1
    write_trailer(request, None)
    assert written == [b"0\r\n\r\n"]


# -- a turn on an engine, and room for buffered audio ------------------------------------


class Limits:
    """
    Admission settings a test sets.
    """

    def __init__(self, concurrent: int = 2, queued: int = 1, wait: float = 30.0, buffered: int = 1000) -> None:
        self.concurrent, self.queued, self.wait, self.buffered = concurrent, queued, wait, buffered

    def concurrent_per_engine(self, engine: str) -> int:
        return self.concurrent

    def queued_per_engine(self, engine: str) -> int:
        return self.queued

    def queue_wait_seconds(self) -> float:
        return self.wait

    def buffered_bytes(self) -> int:
        return self.buffered


def enter(turnstile: Turnstile, engine: str = "tone") -> "Deferred[Turn]":
    return Deferred.fromCoroutine(turnstile.enter(engine))


def test_past_the_speakers_and_the_queue_a_request_is_overloaded_with_retry_after() -> None:
    """
    Two speak at once, one waits, and the next is refused at once as overloaded,
    retryable, with a Retry-After; when a speaker leaves, the one waiting goes in.
    """
    case = SynchronousTestCase()
    turnstile = Turnstile(Clock(), Limits(concurrent=2, queued=1))
    first, second = case.successResultOf(enter(turnstile)), case.successResultOf(enter(turnstile))
    third = enter(turnstile)
    assert case.successResultOf(third) if third.called else True
    assert not third.called
    refused = case.failureResultOf(enter(turnstile), Overloaded).value
    assert refused.status == 429 and refused.retryable
    assert (b"Retry-After", b"1") in refused.headers
    assert turnstile.state("tone") == {"speaking": 2, "queued": 1}
    first.leave()
    case.successResultOf(third).leave()
    second.leave()
    assert turnstile.state("tone") == {"speaking": 0, "queued": 0}
    assert case.successResultOf(enter(turnstile, "other"))


def test_a_request_that_waits_too_long_for_a_turn_is_overloaded() -> None:
    """
    A queued request whose turn does not come within queueWaitSeconds is refused as
    overloaded and leaves the queue.
    """
    case = SynchronousTestCase()
    clock = Clock()
    turnstile = Turnstile(clock, Limits(concurrent=1, queued=5, wait=30))
    speaking = case.successResultOf(enter(turnstile))
    waiting = enter(turnstile)
    clock.advance(30)
    assert "within 30 s" in case.failureResultOf(waiting, Overloaded).value.message
    assert turnstile.state("tone") == {"speaking": 1, "queued": 0}
    speaking.leave()


def test_a_caller_that_gives_up_leaves_the_queue_without_a_turn() -> None:
    """
    A waiting request whose client hangs up is cancelled out of the queue: the next
    turn goes to whoever is still waiting.
    """
    case = SynchronousTestCase()
    turnstile = Turnstile(Clock(), Limits(concurrent=1, queued=5))
    speaking = case.successResultOf(enter(turnstile))
    gone, staying = enter(turnstile), enter(turnstile)
    gone.cancel()
    case.failureResultOf(gone, CancelledError)
    speaking.leave()
    assert case.successResultOf(staying) and turnstile.state("tone") == {"speaking": 1, "queued": 0}


def test_buffered_audio_past_the_budget_fails_its_request_and_gives_back_what_it_held() -> None:
    """
    A buffered body that would take the core past its budget fails as overloaded and
    returns the room it held; bodies already held are unaffected.
    """
    budget = BufferBudget(Limits(buffered=1000))
    budget.take(600)
    relay = BufferRelay(10_000, budget)
    relay.makeConnection(StringTransport())
    relay.dataReceived(b"x" * 300)
    relay.dataReceived(b"x" * 300)
    relay.connectionLost(Failure(ConnectionDone()))
    case = SynchronousTestCase()
    assert case.failureResultOf(relay.done, Overloaded).value.retryable
    assert budget.held == 600


def test_a_buffered_answer_is_bounded_by_its_variants_ceiling() -> None:
    """
    The most a buffered answer may be follows from the variant's maxCharacters and the
    engine's PCM, never more than the absolute bound.
    """
    caps = {
        "variants": {"v": {"maxCharacters": 100}, "big": {"maxCharacters": 10**9}},
        "nativeFormat": {"sampleRate": 24000, "channels": 1},
    }
    assert buffered_limit(caps, "v") == int(100 * SECONDS_PER_CHARACTER * 48000) + 64 * 1024
    assert buffered_limit(caps, "big") == BUFFERED_LIMIT


# -- a worker that stops sending ---------------------------------------------------------


def stream(clock: Clock) -> tuple[Any, StringTransport, list[bytes]]:
    client = RecordingSink()
    relay_ = StreamRelay(client, None, Stalls(clock, 120.0))
    written = client.written
    worker = StringTransport()
    relay_.makeConnection(worker)
    return relay_, worker, written


def test_a_stream_whose_worker_goes_silent_fails_at_the_stall_time() -> None:
    """
    Audio that stops coming while the client is reading fails the stream (to be aborted)
    as model_unavailable once stallSeconds have passed since the last piece, found by
    the sweep within a quarter of that again.
    """
    clock = Clock()
    relay_, worker, written = stream(clock)
    relay_.dataReceived(b"a" * 100)
    for _ in range(4):
        clock.advance(29)
    relay_.dataReceived(b"b" * 100)
    for _ in range(4):
        clock.advance(29)
    assert not relay_.done.called and worker.producerState == "producing"
    clock.advance(30)
    assert worker.producerState == "stopped"
    relay_.connectionLost(Failure(ConnectionDone()))
    assert "sent nothing for 120 s" in SynchronousTestCase().failureResultOf(relay_.done, ModelUnavailable).value.message


def test_a_client_that_pauses_the_stream_is_not_a_stalled_worker() -> None:
    """
    While the client's connection holds the stream paused (a slow listener), the
    worker's silence is expected and never counts against it.
    """
    clock = Clock()
    relay_, worker, _ = stream(clock)
    relay_.pauseProducing()
    assert worker.producerState == "paused"
    for _ in range(40):
        clock.advance(30)
    assert worker.producerState == "paused"
    relay_.resumeProducing()
    clock.advance(119)
    assert worker.producerState == "producing"
    relay_.dataReceived(b"x")
    relay_.connectionLost(Failure(ResponseDone()))
    assert SynchronousTestCase().successResultOf(relay_.done) == 1


def test_durations_round_to_the_nearest_millisecond() -> None:
    """
    X-Rhapsode-Duration-Ms rounds rather than floors, in the worker's count of its PCM
    and in the core's count of a stream's bytes: 1499 frames at 1 kHz are 1499 ms, 2999
    frames at 2 kHz are 1500 ms (1499.5, rounded), and 23 frames at 24 kHz are 1 ms.
    """
    from rhapsode._speech.relay import _duration_ms
    from rhapsode_worker import NativeFormat

    assert NativeFormat(sample_rate=24000).duration_ms(23 * 2) == 1
    assert NativeFormat(sample_rate=2000).duration_ms(2999 * 2) == 1500
    assert _duration_ms("pcm", {"sampleRate": 24000, "channels": 1}, 23 * 2) == 1
    assert _duration_ms("wav", {"sampleRate": 2000, "channels": 1}, 44 + 2999 * 2) == 1500


def test_one_sweep_watches_every_wait_and_costs_no_timer_per_request() -> None:
    """
    The stall sweep is one timer, whatever is being waited on; a watch that ended is
    never reported, and closing the sweep leaves no timer behind.
    """
    clock = Clock()
    stalls = Stalls(clock, 8.0)
    stalled_: list[str] = []
    done = stalls.watch(lambda: stalled_.append("done"))
    silent = stalls.watch(lambda: stalled_.append("silent"))
    for _ in range(100):
        stalls.watch(lambda: None).stop()
    assert len(clock.getDelayedCalls()) == 1
    done.stop()
    clock.advance(8)
    assert stalled_ == ["silent"]
    clock.advance(8)
    assert stalled_ == ["silent"]
    stalls.close()
    assert clock.getDelayedCalls() == []
