"""
L{rhapsode.service.RhapsodeService} starting on a memory reactor: what it reports when
it cannot start, and whether it stops the reactor for that.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from twisted.internet.error import CannotListenError
from twisted.internet.testing import MemoryReactorClock

from rhapsode.service import RhapsodeService, parse_config


class PortTaken(MemoryReactorClock):
    """
    A memory reactor on which every port is already taken.
    """

    stops = 0

    def listenTCP(self, port: int, factory: Any, backlog: int = 50, interface: str = "") -> Any:
        raise CannotListenError(interface, port, OSError(98, "Address already in use"))

    def stop(self) -> None:
        self.stops += 1
        super().stop()

    def start_running(self) -> None:
        """
        What running the reactor does first: the calls waiting for it to run.
        """
        self.running = True
        for f, args, kwargs in self.whenRunningHooks:
            f(*args, **kwargs)


def _failure_of(d: Any) -> Any:
    failures: list[Any] = []
    d.addErrback(failures.append)
    assert len(failures) == 1
    return failures[0]


@pytest.mark.parametrize("under_twistd", [False, True])
def test_a_port_taken_is_reported_and_stops_only_twistds_reactor(tmp_path: Path, under_twistd: bool) -> None:
    """
    A port that cannot be bound fails when_listening with why, before and after the
    fact, and is kept as failed_to_start; only a service made for twistd stops its
    reactor, and only once the reactor runs (twistd starts services before that).
    """
    reactor = PortTaken()
    config = parse_config({"workers": {"socketDir": "sock", "voiceDir": "voices"}}, tmp_path)
    core = RhapsodeService(config, reactor, stop_reactor_if_unable=under_twistd)
    waiting = core.when_listening()
    core.startService()
    assert _failure_of(waiting).check(CannotListenError)
    assert _failure_of(core.when_listening()).check(CannotListenError)
    assert core.failed_to_start is not None and core.port is None
    assert reactor.stops == 0
    reactor.start_running()
    assert reactor.stops == (1 if under_twistd else 0)


def test_a_folder_that_cannot_be_made_is_reported_before_listening(tmp_path: Path) -> None:
    """
    A workers folder that cannot be made fails the start naming the key and folder,
    and nothing is listened on.
    """
    (tmp_path / "a-file").write_text("")
    reactor = MemoryReactorClock()
    config = parse_config({"workers": {"socketDir": "a-file/sock", "voiceDir": "voices"}}, tmp_path)
    core = RhapsodeService(config, reactor)
    core.startService()
    failure = _failure_of(core.when_listening())
    assert f"workers.socketDir {tmp_path / 'a-file' / 'sock'} cannot be made" in failure.getErrorMessage()
    assert reactor.tcpServers == [] and not reactor.hasStopped
