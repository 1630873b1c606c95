"""
What bench/core_path.py and bench/worker_path.py share: a socket that takes every send,
and the timing and profiling of one request's round in memory.
"""

from __future__ import annotations

import cProfile
import gc
import pstats
import time
from typing import Any, Callable

from twisted.internet.abstract import FileDescriptor


class MemorySocket(FileDescriptor):
    """
    A connected socket whose kernel takes every send (and forgets it, keeping a count
    and the last bytes), with the addresses it is given.
    """

    def __init__(self, reactor: Any, peer: Any, host: Any) -> None:
        super().__init__(reactor)
        self.connected = 1
        self.bytes_sent = 0
        self.last = b""
        self._peer, self._host = peer, host

    def writeSomeData(self, data: Any) -> int:
        self.bytes_sent += len(data)
        self.last = bytes(data[-64:])
        return len(data)

    def getPeer(self) -> Any:
        return self._peer

    def getHost(self) -> Any:
        return self._host


def best_of(rounds: int, one: Callable[[], None]) -> float:
    """
    The seconds C{one} takes, the best of five runs of C{rounds} / 5 calls each.
    """
    gc.collect()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(rounds // 5):
            one()
        best = min(best, (time.perf_counter() - start) / (rounds // 5))
    return best


def print_profile(one: Callable[[], None], calls: int, lines: int) -> None:
    """
    Profile C{calls} calls of C{one} and print the C{lines} functions it spends the most
    time in, by their own time.
    """
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        one()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(lines)
