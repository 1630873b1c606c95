"""
L{WorkerLifecycle}: a worker process's own lifecycle, serving -> draining -> stopped
(protocol.md section 2: SIGTERM and C{POST /terminate} mean drain and exit 0).

While serving, requests are admitted and counted.  A drain refuses new ones as
overloaded (429 and retryable: the core should send them elsewhere or again), waits for
those in flight, then for the scheduler (a synthesis whose client hung up still holds
the model until its generate() returns), stops the listening port and closes the open
connections gracefully.  Then the worker is stopped, and the runtime ends the process.

The machine is the table L{WorkerLifecycle._TRANSITIONS}, in the style of the core's
supervisor (L{rhapsode._supervisor}): the port and the count travel from one state into
the next, where Automat's typed machines would rebuild a state's data from the input's
arguments alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Callable, ClassVar, Union

from twisted.internet.defer import Deferred, maybeDeferred, succeed
from twisted.internet.interfaces import IListeningPort
from twisted.logger import Logger
from twisted.python.failure import Failure

from rhapsode_protocol.errors import Overloaded


@dataclass(frozen=True)
class _Serving:
    """
    Admitting requests; C{port} is None until the runtime has bound it.
    """

    name: ClassVar[str] = "serving"
    port: IListeningPort | None
    in_flight: int


@dataclass(frozen=True)
class _Draining:
    """
    Refusing new requests and waiting for the C{in_flight} ones to finish.
    """

    name: ClassVar[str] = "draining"
    port: IListeningPort | None
    in_flight: int


@dataclass(frozen=True)
class _Closing:
    """
    Nothing in flight: waiting for the scheduler, then the port, then the connections.
    """

    name: ClassVar[str] = "draining"


@dataclass(frozen=True)
class _Stopped:
    """
    Drained: the process may end.
    """

    name: ClassVar[str] = "stopped"


_State = Union[_Serving, _Draining, _Closing, _Stopped]


def _nothing() -> "Deferred[None]":
    return succeed(None)


class WorkerLifecycle:
    """
    Admits and counts a worker's requests, and drains it to a stop.

    Runs on the reactor thread; a signal handler reaches L{drain} through
    C{callFromThread}.

    @param idle: fires once the scheduler has nothing running, queued or parked.
    @param close_connections: closes every open connection gracefully, firing once they
        are all gone.
    """

    log = Logger(namespace="rhapsode_worker")

    def __init__(
        self,
        *,
        idle: Callable[[], "Deferred[None]"],
        close_connections: Callable[[], "Deferred[None]"] = _nothing,
    ) -> None:
        self._idle = idle
        self._close_connections = close_connections
        self._state: _State = _Serving(None, 0)
        self._stopped: list[Deferred[None]] = []
        self._outbox: list[Callable[[], object]] = []

    # -- what callers see ---------------------------------------------------------------

    @property
    def state(self) -> str:
        """
        serving, draining or stopped.
        """
        return self._state.name

    @property
    def draining(self) -> bool:
        """
        Whether new requests are refused: once a drain was asked for, and after.
        """
        return not isinstance(self._state, _Serving)

    @property
    def in_flight(self) -> int:
        """
        Requests admitted and not yet finished.
        """
        return self._state.in_flight if isinstance(self._state, (_Serving, _Draining)) else 0

    def listening(self, port: IListeningPort) -> None:
        """
        The runtime has bound C{port}: a drain stops it listening.
        """
        self._feed("listening", port)

    def admit(self) -> None:
        """
        Count a request in; each admitted request must L{leave}.

        @raise Overloaded: once draining.
        """
        self._feed("admit")

    def leave(self) -> None:
        """
        Count an admitted request out.
        """
        self._feed("leave")

    def drain(self) -> None:
        """
        Refuse new requests and stop once those in flight are done.  Asking again (a
        second SIGTERM, a /terminate after one) changes nothing.
        """
        self._feed("drain")

    def when_stopped(self) -> "Deferred[None]":
        """
        Fires once drained (at once if already).
        """
        if isinstance(self._state, _Stopped):
            return succeed(None)
        waiter: Deferred[None] = Deferred()
        self._stopped.append(waiter)
        return waiter

    def stop(self) -> "Deferred[None]":
        """
        Drain, firing once stopped: for a reactor shutdown trigger.
        """
        self.drain()
        return self.when_stopped()

    # -- the machine ----------------------------------------------------------------------

    def _feed(self, name: str, *args: Any) -> None:
        handler = self._TRANSITIONS.get((type(self._state), name))
        if handler is None:
            raise RuntimeError(f"worker lifecycle: no transition for {name} while {self._state}")
        self._state = handler(self, self._state, *args)
        # Effects run once the new state is in place: the close may finish at once and
        # feed its own input.
        outbox, self._outbox = self._outbox, []
        for effect in outbox:
            effect()

    def _wind_down(self, port: IListeningPort | None) -> _Closing:
        async def close() -> None:
            await self._idle()
            if port is not None:
                await maybeDeferred(port.stopListening)
            await self._close_connections()

        def closed(result: object) -> None:
            if isinstance(result, Failure):
                self.log.failure("draining failed; stopping anyway", result)
            self._feed("closed")

        self._outbox.append(lambda: Deferred.fromCoroutine(close()).addBoth(closed))
        return _Closing()

    def _listening(self, state: _Serving, port: IListeningPort) -> _Serving:
        return replace(state, port=port)

    def _admit(self, state: _Serving) -> _Serving:
        return replace(state, in_flight=state.in_flight + 1)

    def _refuse(self, state: _State) -> _State:
        raise Overloaded("the worker is draining and takes no new requests")

    def _leave_serving(self, state: _Serving) -> _Serving:
        return replace(state, in_flight=state.in_flight - 1)

    def _drain_serving(self, state: _Serving) -> _State:
        self.log.info("draining: {n} request(s) in flight", n=state.in_flight)
        if state.in_flight:
            return _Draining(state.port, state.in_flight)
        return self._wind_down(state.port)

    def _leave_draining(self, state: _Draining) -> _State:
        if state.in_flight > 1:
            return replace(state, in_flight=state.in_flight - 1)
        return self._wind_down(state.port)

    def _again(self, state: _State) -> _State:
        return state

    def _closed(self, state: _Closing) -> _Stopped:
        self.log.info("drained")
        waiters, self._stopped = self._stopped, []
        self._outbox.extend(partial(d.callback, None) for d in waiters)
        return _Stopped()

    _TRANSITIONS: ClassVar[dict[tuple[type, str], Callable[..., _State]]] = {
        (_Serving, "listening"): _listening,
        (_Serving, "admit"): _admit,
        (_Serving, "leave"): _leave_serving,
        (_Serving, "drain"): _drain_serving,
        (_Draining, "admit"): _refuse,
        (_Draining, "leave"): _leave_draining,
        (_Draining, "drain"): _again,
        (_Closing, "admit"): _refuse,
        (_Closing, "drain"): _again,
        (_Closing, "closed"): _closed,
        (_Stopped, "admit"): _refuse,
        (_Stopped, "drain"): _again,
    }
