"""
A worker hands the C library's free memory back to the kernel once it has been idle a
while (rhapsode_worker._heap): when it trims, on which pool, what cancels it, and that
the trim really shrinks a process's resident set.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from _worker_fakes import FakePool
from twisted.internet.task import Clock

from rhapsode_worker import Engine
from rhapsode_worker._heap import IDLE_SECONDS, IdleTrim, malloc_trim, rest_then_trim


class ThreadedClock(Clock):
    """A clock whose threads hand their results back at once."""

    def callFromThread(self, f: Any, *args: Any, **kwargs: Any) -> None:
        f(*args, **kwargs)


def test_an_idle_spell_trims_once_on_the_pool_after_the_wait() -> None:
    """
    Idle for L{IDLE_SECONDS}, the trim is handed to the pool (never run on the reactor),
    once however long the spell lasts; a new spell trims again.
    """
    clock, pool, trims = ThreadedClock(), FakePool(), []
    heap = IdleTrim(clock, pool, lambda: trims.append(clock.seconds()))
    heap.idle(True)
    clock.advance(IDLE_SECONDS - 0.1)
    assert pool.calls == []
    clock.advance(0.1)
    assert len(pool.calls) == 1 and trims == []
    pool.run_all()
    assert trims == [IDLE_SECONDS]
    heap.idle(True)  # still the same spell
    clock.advance(60)
    assert pool.calls == []
    heap.idle(False)
    heap.idle(True)
    clock.advance(IDLE_SECONDS)
    pool.run_all()
    assert len(trims) == 2


def test_work_that_comes_before_the_wait_ends_cancels_the_trim() -> None:
    """
    A request that arrives within L{IDLE_SECONDS} of the last one's end takes the trim
    back: pages the next request would fault in again are not given away.
    """
    clock, pool = ThreadedClock(), FakePool()
    heap = IdleTrim(clock, pool, lambda: None)
    heap.idle(True)
    clock.advance(IDLE_SECONDS / 2)
    heap.idle(False)
    clock.advance(60)
    assert pool.calls == [] and clock.getDelayedCalls() == []


def test_without_malloc_trim_nothing_is_scheduled() -> None:
    """
    Where the C library has no malloc_trim (musl, macOS), idling schedules nothing.
    """
    clock = ThreadedClock()
    IdleTrim(clock, FakePool(), None).idle(True)
    assert clock.getDelayedCalls() == []


def test_a_trim_that_fails_is_logged_not_raised() -> None:
    """
    A trim that raises is logged by the worker and goes no further.
    """
    clock, pool = ThreadedClock(), FakePool()

    def broken() -> None:
        raise OSError("no")

    IdleTrim(clock, pool, broken).idle(True)
    clock.advance(IDLE_SECONDS)
    pool.run_all()  # the errback logs it; nothing is left unhandled


@pytest.mark.skipif(malloc_trim is None, reason="the C library has no malloc_trim")
class Resting(Engine):
    """An adapter that records its rests, failing the ones it is told to."""

    def __init__(self, done: list[str], fail: bool = False) -> None:
        self.done = done
        self.fail = fail

    def rest(self) -> None:
        self.done.append("rest")
        if self.fail:
            raise RuntimeError("the arena would not shrink")


def test_an_idle_worker_rests_its_engine_before_it_trims() -> None:
    """
    What an idle worker runs on its pool: the adapter's rest() and then the trim, which
    runs even when rest() fails (the failure logged); an adapter with no rest of its own
    (the Engine base's does nothing) costs nothing, and with no trim the rest still runs.
    """
    done: list[str] = []
    rest_then_trim(Resting(done), lambda: done.append("trim"))()
    assert done == ["rest", "trim"]
    done.clear()
    rest_then_trim(Resting(done, fail=True), lambda: done.append("trim"))()
    assert done == ["rest", "trim"]
    done.clear()
    rest_then_trim(object(), lambda: done.append("trim"))()
    rest_then_trim(Engine.__new__(Engine), lambda: done.append("trim"))()
    assert done == ["trim", "trim"]
    done.clear()
    rest_then_trim(Resting(done), None)()
    assert done == ["rest"]


def test_the_trim_gives_a_fragmented_heap_back_to_the_kernel() -> None:
    """
    glibc keeps 80 MB of freed blocks, a few of which are still held, in the process's
    resident set; malloc_trim(0) hands the free pages between them back.
    """
    program = (
        "from rhapsode_worker._heap import malloc_trim\n"
        "def rss():\n"
        "    for line in open('/proc/self/status'):\n"
        "        if line.startswith('VmRSS:'):\n"
        "            return int(line.split()[1]) // 1024\n"
        "blocks = [bytearray(2000) for _ in range(40000)]\n"
        "kept = blocks[::64]\n"
        "del blocks\n"
        "before = rss()\n"
        "malloc_trim()\n"
        "print(before, rss())\n"
    )
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120, check=True)
    before, after = (int(n) for n in out.stdout.split())
    assert after < before - 40, (before, after)
