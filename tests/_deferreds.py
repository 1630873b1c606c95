"""
What a Deferred has already fired with, for tests on fake reactors and clocks.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from twisted.internet.defer import Deferred
from twisted.python.failure import Failure


def result_of(deferred: Deferred[Any]) -> Any:
    """
    The result a Deferred has already fired with.
    """
    results: list[Any] = []
    deferred.addBoth(results.append)
    assert results, f"{deferred!r} has not fired"
    assert not isinstance(results[0], Failure), results[0]
    return results[0]


def failure_of(deferred: Deferred[Any]) -> Failure:
    """
    The failure a Deferred has already fired with, consumed so it is not logged.
    """
    results: list[Any] = []
    deferred.addBoth(results.append)
    assert results, f"{deferred!r} has not fired"
    assert isinstance(results[0], Failure), results[0]
    failure: Failure = results[0]
    return failure


def process_alive(pid: int) -> bool:
    """
    Whether a process is running (a zombie nobody has reaped yet is not).
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); read its state.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"
