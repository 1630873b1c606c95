"""
A worker's body read whole, within a limit: an error envelope, a small JSON answer, or
a buffered (C{stream: false}) response; L{worker_json}, which reads a worker's JSON as
the worker's to get right; and L{Stall}, which notices a worker that has stopped sending.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Callable
from typing import Protocol as TypingProtocol

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IPushProducer, IReactorTime
from twisted.internet.protocol import Protocol
from twisted.internet.task import LoopingCall
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from zope.interface import implementer

from rhapsode_protocol.errors import Internal, ModelUnavailable, SpeechError
from rhapsode_protocol.validation import TooDeep, loads_json

__all__ = ["BodyTooLarge", "BufferRelay", "Stalls", "Watched", "collect", "collect_pieces", "stalled", "worker_json"]


def worker_json(raw: bytes, what: str) -> Any:
    """
    A worker's JSON answer (C{what} says to which request), its depth held to what every
    body's is.  A worker may be any server at a URL, so a body it cannot have meant is
    its fault, never the caller's: not L{TooDeep}'s bad_request, which names the
    caller's body.

    @raise Internal: not JSON, or nested too deep to parse.
    """
    try:
        return loads_json(raw)
    except (TooDeep, ValueError):
        raise Internal(f"the worker answered {what} with a body that is not JSON it can send") from None


class BodyTooLarge(ValueError):
    """
    A body ran past the limit it was read with; what came was dropped.
    """


class Budget(TypingProtocol):
    """
    Room shared by every buffered body (rhapsode._http.site.BufferBudget).
    """

    def take(self, size: int) -> None: ...

    def give_back(self, size: int) -> None: ...


class Watched:
    """
    One body or answer being waited on: when it last moved, and whether its reader
    paused it (then its silence is the reader's, and does not count).
    """

    __slots__ = ("_stalls", "last", "paused", "on_stall")

    def __init__(self, stalls: "Stalls", on_stall: Callable[[], None]) -> None:
        self._stalls = stalls
        self.last = stalls.clock.seconds()
        self.paused = False
        self.on_stall = on_stall

    def progress(self) -> None:
        self.last = self._stalls.clock.seconds()

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        self.last = self._stalls.clock.seconds()

    def stop(self) -> None:
        self._stalls.unwatch(self)


class Stalls:
    """
    Notices a worker that has stopped sending: every body and answer head the core
    waits on is watched, and one that has not moved for C{seconds} while its reader
    was ready has its C{on_stall} called, once.

    One timer sweeps them all, every quarter of C{seconds}, so a request costs no timer
    of its own and a stall is found within a quarter of C{seconds} of its deadline.
    """

    def __init__(self, clock: IReactorTime, seconds: float) -> None:
        self.clock = clock
        self.seconds = seconds
        self._watched: set[Watched] = set()
        self._loop = LoopingCall(self._sweep)
        self._loop.clock = clock

    def watch(self, on_stall: Callable[[], None]) -> Watched:
        watched = Watched(self, on_stall)
        self._watched.add(watched)
        if not self._loop.running:
            self._loop.start(self.seconds / 4, now=False)
        return watched

    def unwatch(self, watched: Watched) -> None:
        self._watched.discard(watched)

    def close(self) -> None:
        if self._loop.running:
            self._loop.stop()

    def _sweep(self) -> None:
        overdue = self.clock.seconds() - self.seconds
        for watched in [w for w in self._watched if not w.paused and w.last <= overdue]:
            self._watched.discard(watched)
            watched.on_stall()


def stalled(seconds: float) -> ModelUnavailable:
    """
    What a request is told when its worker stopped sending.
    """
    return ModelUnavailable(f"the worker sent nothing for {seconds:g} s; try again")


class _Sink(TypingProtocol):
    def registerProducer(self, producer: Any) -> None: ...

    def unregisterProducer(self) -> None: ...

    def gathered(self) -> AbstractContextManager[None]: ...


@implementer(IPushProducer)
class WatchedBody(Protocol):
    """
    A worker's body relayed to a sink as it arrives: the sink's producer, passing its
    pauses on to the worker's socket and telling its L{Watched} stall when the reader,
    not the worker, is why nothing moves.  A subclass reads the bytes (calling
    L{progress} for each delivery) and ends with L{finished}, which says whether the
    stall watch gave up on the worker.
    """

    def __init__(self, sink: _Sink, stalls: Stalls | None) -> None:
        self._sink = sink
        self._stalls = stalls
        self._stall: Watched | None = None
        self._stalled = False

    def connectionMade(self) -> None:
        if self._stalls is not None:
            self._stall = self._stalls.watch(self._give_up)
        # A reader that falls behind pauses reading from the worker.
        self._sink.registerProducer(self)

    def progress(self) -> None:
        if self._stall is not None:
            self._stall.progress()

    def gathered(self) -> AbstractContextManager[None]:
        """
        The sink's gathering (IAudioSink.gathered): the worker's connection enters it
        around what one of its reads brings, so that the pieces and the end one read
        carries leave the core in one send.
        """
        return self._sink.gathered()

    def finished(self) -> ModelUnavailable | None:
        """
        Stop watching and let the sink go; the error to end with where the watch gave up.
        """
        if self._stall is not None:
            self._stall.stop()
        self._sink.unregisterProducer()
        return stalled(self._stalls.seconds if self._stalls else 0) if self._stalled else None

    def _give_up(self) -> None:
        self._stalled = True
        self.stopProducing()

    # IPushProducer, for the sink

    def pauseProducing(self) -> None:
        if self._stall is not None:
            self._stall.pause()
        self.transport.pauseProducing()  # type: ignore[union-attr]

    def resumeProducing(self) -> None:
        if self._stall is not None:
            self._stall.resume()
        self.transport.resumeProducing()  # type: ignore[union-attr]

    def stopProducing(self) -> None:
        self.transport.stopProducing()  # type: ignore[union-attr]


class BufferRelay(Protocol):
    """
    Collects a bounded body: for C{stream: false}, error envelopes and small answers.

    With a C{budget} each piece is taken from it as it arrives (and everything taken is
    given back if the body fails); watched by C{stalls}, the body fails as
    L{ModelUnavailable} when the worker stops sending.  C{done} fires with the pieces as
    they came, not joined: a buffered answer goes on in them, never copied whole.
    """

    def __init__(self, limit: int, budget: Budget | None = None, stalls: Stalls | None = None) -> None:
        self._chunks: list[bytes] = []
        self._size = 0
        self._limit = limit
        self._budget = budget
        self._failed: SpeechError | None = None
        self._stalls = stalls
        self._stall: Watched | None = None
        self.done: Deferred[list[bytes]] = Deferred()

    def connectionMade(self) -> None:
        stalls = self._stalls
        if stalls is not None:
            self._stall = stalls.watch(lambda: self._give_up(stalled(stalls.seconds)))

    def dataReceived(self, data: bytes) -> None:
        if self._failed is not None:
            return
        if self._stall is not None:
            self._stall.progress()
        self._size += len(data)
        if self._size > self._limit:
            self.transport.stopProducing()  # type: ignore[union-attr]
            return
        if self._budget is not None:
            try:
                self._budget.take(len(data))
            except SpeechError as error:
                self._size -= len(data)
                self._give_up(error)
                return
        self._chunks.append(data)

    def _give_up(self, error: SpeechError) -> None:
        self._failed = error
        self.transport.stopProducing()  # type: ignore[union-attr]

    def connectionLost(self, reason: Failure = Failure(ResponseDone())) -> None:
        if self._stall is not None:
            self._stall.stop()
        failed = self._failed is not None or self._size > self._limit or not isinstance(reason.value, ResponseDone)
        if failed:
            if self._budget is not None:
                self._budget.give_back(sum(map(len, self._chunks)))
            self._chunks = []
        if self._failed is not None:
            self.done.errback(self._failed)
        elif self._size > self._limit:
            self.done.errback(BodyTooLarge(f"body over {self._limit} bytes"))
        elif isinstance(reason.value, ResponseDone):
            # Handed over, not kept: the caller decides how long the pieces live.
            pieces, self._chunks = self._chunks, []
            self.done.callback(pieces)
            return
        else:
            self.done.errback(reason)


def collect(
    response: Any, limit: int, budget: Budget | None = None, stalls: Stalls | None = None
) -> "Deferred[bytes]":
    """
    The whole body of C{response}, within C{limit} bytes.  With a C{budget}, the caller
    gives back the body's length once it is done with it; with C{stalls}, a worker that
    stops sending fails it.
    """
    return collect_pieces(response, limit, budget, stalls).addCallback(b"".join)


def collect_pieces(
    response: Any, limit: int, budget: Budget | None = None, stalls: Stalls | None = None
) -> "Deferred[list[bytes]]":
    """
    The whole body of C{response} as L{collect} reads it, in the pieces it arrived in.
    """
    relay = BufferRelay(limit, budget, stalls)
    response.deliverBody(relay)
    return relay.done
