"""
Speech capacity (protocol.md section 6): how many requests speak on each engine at once
and how many may wait for a turn (L{Turnstile}), and how much buffered audio the core holds
for answers read whole before they are sent (L{BufferBudget}, and one answer's share of it,
L{Hold}).  Past either, a request is refused as overloaded, retryable, with a
C{Retry-After}.
"""

from __future__ import annotations

from collections import deque

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IReactorTime

from rhapsode_protocol.errors import Overloaded

from .._interfaces import IAdmissionSettings

__all__ = ["RETRY_AFTER_SECONDS", "BufferBudget", "BufferFull", "Hold", "Turn", "Turnstile", "overloaded"]


class Turn:
    """
    One request's turn to speak on its engine; leave it when the answer has ended,
    however it ended.  Leaving twice is harmless.
    """

    def __init__(self, line: "_Line") -> None:
        self._line: _Line | None = line

    def leave(self) -> None:
        line, self._line = self._line, None
        if line is not None:
            line.left()


class _Line:
    """
    One engine's speakers and the queue waiting behind them.
    """

    def __init__(self) -> None:
        self.speaking = 0
        self.waiting: deque[Deferred[None]] = deque()

    def left(self) -> None:
        self.speaking -= 1
        while self.waiting:
            waiter = self.waiting.popleft()
            if not waiter.called:
                self.speaking += 1
                waiter.callback(None)
                return


class Turnstile:
    """
    How many requests speak on each engine at once, and how many may wait for a turn
    (protocol.md section 6, overloaded): past both, a request is refused at once as
    overloaded, retryable, with a Retry-After, instead of joining a queue with no end.
    A request that waits longer than C{queue_wait_seconds} is refused the same way.
    """

    def __init__(self, clock: IReactorTime, settings: IAdmissionSettings) -> None:
        self._clock = clock
        self._settings = settings
        self._lines: dict[str, _Line] = {}

    def state(self, engine: str) -> dict[str, int]:
        line = self._lines.get(engine)
        return {"speaking": line.speaking, "queued": len(line.waiting)} if line else {"speaking": 0, "queued": 0}

    async def enter(self, engine: str) -> Turn:
        """
        A turn to speak on C{engine}, at once or after those ahead of it.

        @raise Overloaded: the queue is full, or the turn did not come in time.
        """
        line = self._lines.setdefault(engine, _Line())
        if line.speaking < self._settings.concurrent_per_engine(engine) and not line.waiting:
            line.speaking += 1
            return Turn(line)
        most = self._settings.queued_per_engine(engine)
        if len(line.waiting) >= most:
            raise overloaded(
                f'engine "{engine}" has {line.speaking} request(s) speaking and {most} waiting; try again shortly'
            )
        waiter: Deferred[None] = Deferred()
        line.waiting.append(waiter)
        patience = self._settings.queue_wait_seconds()
        timer = self._clock.callLater(patience, waiter.cancel)
        try:
            await waiter
        except CancelledError:
            if waiter in line.waiting:
                line.waiting.remove(waiter)
            if timer.active():
                raise  # the caller gave up, not the wait
            raise overloaded(
                f'engine "{engine}" had no turn free within {patience:g} s; try again shortly'
            ) from None
        finally:
            if timer.active():
                timer.cancel()
        return Turn(line)


def overloaded(message: str) -> Overloaded:
    error = Overloaded(message)
    error.headers = ((b"Retry-After", b"%d" % RETRY_AFTER_SECONDS),)
    return error


#: What a refused request is told to wait before it tries again.
RETRY_AFTER_SECONDS = 1


class BufferFull(Overloaded):
    """
    The core's budget for buffered audio has no room for what an answer needs: overloaded
    and retryable like any other, but a door that answers many utterances in one (the
    batch) refuses as a whole on it rather than item by item.
    """


class BufferBudget:
    """
    How much audio the core holds at once for buffered (C{stream: false}) answers, all
    of them together, from the worker's first byte until the last has left the process:
    each is read whole before its status is written (section 6), and a reader that does
    not read keeps it in the transport, so without a bound forty long ones at once took
    the core past a gigabyte.  What an answer carries it in counts too (the batch's and
    MCP's base64 and JSON).  A piece that would take the total past the budget fails its
    request as overloaded (retryable, L{BufferFull}): the answers already held are the
    ones that finish.
    """

    def __init__(self, settings: IAdmissionSettings) -> None:
        self._settings = settings
        self.held = 0

    def take(self, size: int) -> None:
        """
        Hold C{size} more bytes.

        @raise BufferFull: the budget has no room for them.
        """
        most = self._settings.buffered_bytes()
        if self.held + size > most:
            error = BufferFull(
                f"the core is holding {self.held} bytes of buffered answers, its limit {most} "
                f"(limits.bufferedBytes), and this one needs {size} more; try again shortly, "
                "or stream the audio instead"
            )
            error.headers = ((b"Retry-After", b"%d" % RETRY_AFTER_SECONDS),)
            raise error
        self.held += size

    def give_back(self, size: int) -> None:
        self.held -= size

    def hold(self) -> "Hold":
        """
        A share of the budget for one answer, given back all at once.
        """
        return Hold(self)


class Hold:
    """
    What one answer holds of the budget: taken as its parts are made, given back once
    it has gone (L{release}); releasing twice is harmless.
    """

    def __init__(self, budget: BufferBudget) -> None:
        self._budget = budget
        self.size = 0

    def take(self, size: int) -> None:
        """
        @raise BufferFull: the budget has no room for C{size} more bytes.
        """
        self._budget.take(size)
        self.size += size

    def give_back(self, size: int) -> None:
        size = min(size, self.size)
        self._budget.give_back(size)
        self.size -= size

    def release(self) -> None:
        self.give_back(self.size)
