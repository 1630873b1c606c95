"""
The C{rhapsode} command: C{rhapsode serve [--config FILE]} is C{twistd -n rhapsode}, with
one difference: while it stops, a second Ctrl-C (or SIGTERM) quits at once.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType
from typing import Any, Callable

from twisted.logger import Logger

#: What a forced quit exits with: not the signal, which is how a clean stop ends.
FORCED_EXIT = 1

_Handler = Callable[[int, "FrameType | None"], Any]


class SecondInterrupt:
    """
    Ctrl-C and SIGTERM for a server whose stop waits (for requests in flight, for its
    workers): the first is the reactor's own, a clean stop; one arriving after the stop
    began, for that reason or any other, quits the process at once.

    The reactor's handler would otherwise take the second as another C{reactor.stop()}
    and log the C{ReactorNotRunning} it raises.  Workers need nothing from a forced
    quit: each exits when its parent does.

    @param getsignal: L{signal.getsignal}; C{setsignal}, L{signal.signal}; C{write}, a
        line to stderr; C{exit}, L{os._exit}.  Tests give fakes.
    """

    log = Logger()

    def __init__(
        self,
        reactor: Any,
        *,
        getsignal: Callable[[int], Any] = signal.getsignal,
        setsignal: Callable[[int, _Handler], Any] = signal.signal,
        write: Callable[[str], None] | None = None,
        exit: Callable[[int], Any] = os._exit,
    ) -> None:
        self._reactor = reactor
        self._getsignal = getsignal
        self._setsignal = setsignal
        self._write = write or _write_stderr
        self._exit = exit
        self._previous: dict[int, _Handler] = {}
        self._stopping = False
        self._first: str | None = None

    def arm(self) -> None:
        """
        Put this in front of the reactor's handlers; call it once the reactor runs,
        which is when it has installed them.  A signal the process ignores (a server
        started in the background with Ctrl-C ignored) stays ignored.
        """
        for number in (signal.SIGINT, signal.SIGTERM):
            previous = self._getsignal(number)
            if callable(previous):
                self._previous[number] = previous
                self._setsignal(number, self.received)
        self._reactor.addSystemEventTrigger("before", "shutdown", self._shutting_down)

    def _shutting_down(self) -> None:
        self._stopping = True
        if self._first is not None:
            self.log.info(
                "{signal} received; press Ctrl-C again (or send SIGTERM) to quit at once, "
                "cutting off what is in flight",
                signal=self._first,
            )

    def received(self, number: int, frame: FrameType | None) -> None:
        """
        The handler of both signals.  It runs between two Python instructions of the
        reactor's thread, so it neither logs nor writes through a buffer that thread
        may be holding: a forced quit writes its line straight to file descriptor 2.
        """
        name = signal.Signals(number).name
        if not self._stopping:
            self._stopping = True
            self._first = name
            self._previous[number](number, frame)
            return
        try:
            # The log goes to the real stdout, which a quit without unwinding leaves unflushed.
            if sys.__stdout__ is not None:
                sys.__stdout__.flush()
        except (OSError, ValueError, RuntimeError):
            pass
        self._write(
            f"rhapsode: {name} while stopping: quitting at once; requests in flight are "
            "cut off and the workers exit by themselves\n"
        )
        self._exit(FORCED_EXIT)


def _write_stderr(line: str) -> None:
    try:
        os.write(2, line.encode("utf-8", "replace"))
    except OSError:
        pass


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print("usage: rhapsode serve [--config FILE]")
        raise SystemExit(0 if args else 2)
    if args[0] != "serve":
        print(f"rhapsode: unknown command {args[0]!r}; try: rhapsode serve --config FILE", file=sys.stderr)
        raise SystemExit(2)
    # The reactor twistd would install by itself (this command passes it no --reactor).
    from twisted.internet import reactor
    from twisted.scripts.twistd import run

    reactor.callWhenRunning(SecondInterrupt(reactor).arm)
    sys.argv = ["twistd", "--nodaemon", "--pidfile=", "rhapsode", *args[1:]]
    run()
    from ._tap import made

    # twistd exits 0 however its reactor stopped; a server that could not start did not run.
    failed = [service.failed_to_start for service in made if service.failed_to_start is not None]
    if failed:
        print(f"rhapsode: {failed[0].getErrorMessage()}", file=sys.__stderr__)
        raise SystemExit(1)
