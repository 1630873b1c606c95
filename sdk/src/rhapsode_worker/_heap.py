"""
Handing the C library's free memory back to the kernel once a worker has nothing to do.

glibc keeps what a process frees in its arenas for the next allocation, so a worker at
rest holds, besides its model, the freed buffers of every request it has served: a
Kokoro worker measured 338-342 MiB after rounds of sentences and a ~2000-character text,
and 291 MiB once C{malloc_trim(0)} had handed the free pages back (a Piper worker 250
against 243 MiB).  How much stays depends on which threads freed what, so the same
requests left the same worker at 331 MiB in one run and over 400 in another.

L{IdleTrim} trims once the worker's scheduler has been idle for L{IDLE_SECONDS}: never
between two requests that follow each other closely (the next would only fault the same
pages back in), and never on the reactor thread (the trim walks every arena).  Where the
C library has no C{malloc_trim} (musl, macOS), it does nothing.  Before the trim the
adapter's C{rest()} runs (L{rest_then_trim}), for memory only the adapter can let go of.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable

from twisted.internet.interfaces import IDelayedCall
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger

__all__ = ["IDLE_SECONDS", "IdleTrim", "malloc_trim", "rest_then_trim"]

#: How long a worker stays idle before its free memory is handed back.
IDLE_SECONDS = 2.0

log = Logger()


def _find_trim() -> Callable[[], None] | None:
    try:
        call = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_size_t]
    call.restype = ctypes.c_int

    def trim() -> None:
        call(0)

    return trim


#: glibc's C{malloc_trim(0)}, or None where the C library has none.
malloc_trim = _find_trim()


def rest_then_trim(engine: Any, trim: Callable[[], None] | None = malloc_trim) -> Callable[[], None]:
    """
    What an idle worker does on its files pool: the adapter's C{rest()} first (it may
    free memory of its own, an arena, say), then C{trim}, which hands the C library's
    free memory back whatever the adapter did.  A failing C{rest} is logged and the trim
    still runs.
    """

    def rested() -> None:
        rest = getattr(engine, "rest", None)
        if rest is not None:
            try:
                rest()
            except Exception:
                log.failure("the engine's rest() failed")
        if trim is not None:
            trim()

    return rested


class IdleTrim:
    """
    Calls C{trim} on C{pool} once C{idle(True)} has been said and not taken back by
    C{idle(False)} for C{seconds}; once per idle spell.
    """

    def __init__(
        self,
        reactor: Any,
        pool: Any,
        trim: Callable[[], None] | None = malloc_trim,
        seconds: float = IDLE_SECONDS,
    ) -> None:
        self._reactor = reactor
        self._pool = pool
        self._trim = trim
        self._seconds = seconds
        self._call: IDelayedCall | None = None

    def idle(self, idle: bool) -> None:
        if self._trim is None:
            return
        if not idle:
            if self._call is not None:
                if self._call.active():
                    self._call.cancel()
                self._call = None
            return
        if self._call is None:
            self._call = self._reactor.callLater(self._seconds, self._run)

    def _run(self) -> None:
        trim = self._trim
        assert trim is not None
        d = deferToThreadPool(self._reactor, self._pool, trim)
        d.addErrback(lambda failure: log.failure("handing free memory back failed", failure))
