"""
What `rhapsode serve` does with Ctrl-C and SIGTERM while it stops
(L{rhapsode._cli.commands.SecondInterrupt}), on a memory reactor with the process's signal table,
stderr and exit faked: no signal is sent here.  tests/integration/test_core_service.py
sends real ones to a real server.
"""

from __future__ import annotations

import signal
from typing import Any

import pytest
from twisted.internet.testing import MemoryReactor
from twisted.logger import capturedLogs, formatEvent

from rhapsode._cli.commands import FORCED_EXIT, SecondInterrupt


class Process:
    """
    The signal table as signal.getsignal and signal.signal see it, the reactor's own
    handlers in it, and what reached stderr and exit.
    """

    def __init__(self, sigint: Any = None) -> None:
        self.reactor_got: list[int] = []
        self.table: dict[int, Any] = {
            signal.SIGINT: self.reactors_handler if sigint is None else sigint,
            signal.SIGTERM: self.reactors_handler,
        }
        self.written: list[str] = []
        self.exits: list[int] = []
        self.reactor = MemoryReactor()
        self.interrupts = SecondInterrupt(
            self.reactor,
            getsignal=self.table.__getitem__,
            setsignal=self.table.__setitem__,
            write=self.written.append,
            exit=self.exits.append,
        )
        self.interrupts.arm()

    def reactors_handler(self, number: int, frame: Any) -> None:
        self.reactor_got.append(number)

    def send(self, number: int) -> None:
        self.table[number](number, None)

    def shutting_down(self) -> None:
        """The reactor begins its shutdown: its before-shutdown triggers run."""
        for f, args, kwargs in self.reactor.triggers["before"]["shutdown"]:
            f(*args, **kwargs)


@pytest.mark.parametrize(
    ("first", "second"),
    [(signal.SIGINT, signal.SIGINT), (signal.SIGTERM, signal.SIGTERM), (signal.SIGINT, signal.SIGTERM)],
)
def test_the_first_signal_stops_cleanly_and_the_second_quits(first: int, second: int) -> None:
    """
    The first SIGINT or SIGTERM goes to the reactor's own handler (a clean stop), and
    the log then says a second quits at once; the second, of either kind, quits with
    status 1 and a line on stderr, and never reaches the reactor's handler (which would
    stop a stopping reactor and log a traceback).
    """
    process = Process()
    process.send(first)
    assert process.reactor_got == [first] and process.exits == []
    with capturedLogs() as events:
        process.shutting_down()
    (hint,) = [formatEvent(event) for event in events]
    assert hint.startswith(f"{signal.Signals(first).name} received; press Ctrl-C again (or send SIGTERM) to quit at once")
    process.send(second)
    assert process.reactor_got == [first]
    assert process.exits == [FORCED_EXIT] and FORCED_EXIT != 0
    (line,) = process.written
    assert line.startswith(f"rhapsode: {signal.Signals(second).name} while stopping: quitting at once")
    assert line.endswith("\n")


def test_a_stop_begun_otherwise_is_cut_short_by_one_signal() -> None:
    """
    A stop no signal began (a port that cannot be bound stops the reactor) says nothing
    about Ctrl-C, and one Ctrl-C during it quits at once.
    """
    process = Process()
    with capturedLogs() as events:
        process.shutting_down()
    assert list(events) == []
    process.send(signal.SIGINT)
    assert process.reactor_got == [] and process.exits == [FORCED_EXIT]


def test_an_ignored_ctrl_c_stays_ignored() -> None:
    """
    A server started with SIGINT ignored (in the background of a script) keeps
    ignoring it; SIGTERM is still handled.
    """
    process = Process(sigint=signal.SIG_IGN)
    assert process.table[signal.SIGINT] is signal.SIG_IGN
    assert process.table[signal.SIGTERM] == process.interrupts.received
