"""
A worker's body read whole, within a limit: an error envelope, a small JSON answer, or
a buffered (C{stream: false}) response; and L{Stall}, which notices a worker that has
stopped sending.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol as TypingProtocol

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone

from rhapsode_worker.errors import ModelUnavailable, SpeechError

__all__ = ["BodyTooLarge", "BufferRelay", "Stall", "collect"]


class BodyTooLarge(ValueError):
    """
    A body ran past the limit it was read with; what came was dropped.
    """


class Budget(TypingProtocol):
    """
    Room shared by every buffered body (rhapsode._admission.BufferBudget).
    """

    def take(self, size: int) -> None: ...

    def give_back(self, size: int) -> None: ...


class Stall:
    """
    Calls C{on_stall} once a worker has sent nothing for C{seconds} while its reader was
    ready for more.  A reader that pauses (a slow client) stops the count until it
    resumes: only the worker's silence counts.

    Each piece of progress costs one clock reading; the one timer is re-armed for what
    remains only when it comes due.
    """

    def __init__(self, clock: IReactorTime, seconds: float, on_stall: Callable[[], None]) -> None:
        self._clock = clock
        self._seconds = seconds
        self._on_stall = on_stall
        self._last = clock.seconds()
        self._paused = False
        self._timer: IDelayedCall | None = clock.callLater(seconds, self._due)

    def progress(self) -> None:
        self._last = self._clock.seconds()

    def pause(self) -> None:
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self._last = self._clock.seconds()

    def stop(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None and timer.active():
            timer.cancel()

    def _due(self) -> None:
        left = self._seconds if self._paused else self._last + self._seconds - self._clock.seconds()
        if left > 0:
            self._timer = self._clock.callLater(left, self._due)
            return
        self._timer = None
        self._on_stall()


def stalled(seconds: float) -> ModelUnavailable:
    """
    What a request is told when its worker stopped sending.
    """
    return ModelUnavailable(f"the worker sent nothing for {seconds:g} s; try again")


class BufferRelay(Protocol):
    """
    Collects a bounded body: for C{stream: false}, error envelopes and small answers.

    With a C{budget} each piece is taken from it as it arrives (and everything taken is
    given back if the body fails); with a C{stall} clock the body fails as
    L{ModelUnavailable} when the worker stops sending.
    """

    def __init__(
        self,
        limit: int,
        budget: Budget | None = None,
        stall: tuple[IReactorTime, float] | None = None,
    ) -> None:
        self._chunks: list[bytes] = []
        self._size = 0
        self._limit = limit
        self._budget = budget
        self._failed: SpeechError | None = None
        self._stall_spec = stall
        self._stall: Stall | None = None
        self.done: Deferred[bytes] = Deferred()

    def connectionMade(self) -> None:
        if self._stall_spec is not None:
            clock, seconds = self._stall_spec
            self._stall = Stall(clock, seconds, lambda: self._give_up(stalled(seconds)))

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
        if failed and self._budget is not None:
            self._budget.give_back(sum(map(len, self._chunks)))
        if self._failed is not None:
            self.done.errback(self._failed)
        elif self._size > self._limit:
            self.done.errback(BodyTooLarge(f"body over {self._limit} bytes"))
        elif isinstance(reason.value, ResponseDone):
            self.done.callback(b"".join(self._chunks))
        else:
            self.done.errback(reason)


def collect(
    response: Any,
    limit: int,
    budget: Budget | None = None,
    stall: tuple[IReactorTime, float] | None = None,
) -> "Deferred[bytes]":
    """
    The whole body of C{response}, within C{limit} bytes.  With a C{budget}, the caller
    gives back the body's length once it is done with it.
    """
    relay = BufferRelay(limit, budget, stall)
    response.deliverBody(relay)
    return relay.done
