"""
The watchdog: a worker that stops answering is found out in bounded time (protocol.md
sections 2 and 3).

Every C{interval} seconds each worker that should be answering (a local one that is up,
and every remote one) is asked C{GET /health}, one question at a time.  A worker serves
/health from its event loop while it synthesises on its thread pool, so a busy worker
answers; one that leaves it unanswered for C{patience} seconds is stopped (SIGSTOP),
deadlocked or gone.  A local one is then killed through its supervisor, which ends its
streams, forgets its model and starts a new one on the next request; a remote one has
its connections aborted and is refused (503, retryable) until it answers again.

A worker that answers may still say, in its health's C{unreachable}, that the server one
of its variants is served by (vLLM-Omni on another box) does not answer it: that variant
is fenced the same way, refused (503, retryable) without a lease, until a later check
finds it reachable again.  The worker is not killed for it, since it is not what is down.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import CancelledError, Deferred, ensureDeferred
from twisted.internet.defer import TimeoutError as DeferredTimeout
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from .registry import EngineHandle, Registry

__all__ = ["Watchdog"]


class Watchdog:
    """
    Health checks of every running worker, and what follows when one goes unanswered.
    """

    log = Logger()

    def __init__(self, registry: Registry, clock: IReactorTime, interval: float, patience: float) -> None:
        self._registry = registry
        self._clock = clock
        self._interval = interval
        self._patience = patience
        self._asking: dict[str, Deferred[None]] = {}
        self._loop = LoopingCall(self._round)
        self._loop.clock = clock

    def start(self) -> None:
        self._loop.start(self._interval, now=False)

    def stop(self) -> None:
        if self._loop.running:
            self._loop.stop()
        for asking in list(self._asking.values()):
            asking.cancel()

    def _round(self) -> None:
        for handle in self._registry:
            if handle.id in self._asking:
                continue  # still waiting on the last question: its own timeout decides
            supervisor = handle.supervisor
            if supervisor is not None and supervisor.state != "up":
                continue
            asking = Deferred.fromCoroutine(self._ask(handle))
            self._asking[handle.id] = asking
            asking.addBoth(self._asked, handle.id)

    def _asked(self, result: object, engine: str) -> None:
        self._asking.pop(engine, None)

    async def _ask(self, handle: EngineHandle) -> None:
        question = ensureDeferred(handle.client.json(b"GET", "/health"))
        question.addTimeout(self._patience, self._clock)
        try:
            code, health = await question
        except (DeferredTimeout, CancelledError):
            # Timed out, or cancelled by a stop (then there is nobody left to tell).
            if self._loop.running:
                self._unanswered(handle, f"did not answer GET /health within {self._patience:g} s")
            return
        except Exception as error:
            # Refused or dropped: a local worker's own exit is its supervisor's to see.
            if handle.supervisor is None:
                self._unanswered(handle, f"could not be reached ({type(error).__name__})")
            return
        if handle.supervisor is None:
            if handle.answering is False or handle.unresponsive is not None:
                self.log.info("engine {engine} answers again", engine=handle.id)
                handle.forget_capabilities()
            handle.answering = True
            handle.unresponsive = None
        if code == 200 and isinstance(health, dict):
            self._fence(handle, health.get("unreachable"))

    def _fence(self, handle: EngineHandle, told: object) -> None:
        """
        Fence the variants whose server the worker cannot reach, and lift the fence from
        those it reaches again.
        """
        unreachable = {
            str(variant): str(why) for variant, why in (told.items() if isinstance(told, dict) else ())
        }
        for variant in sorted(unreachable.keys() - handle.unreachable.keys()):
            self.log.error("engine {engine} cannot reach the server of {variant}: {why}",
                           engine=handle.id, variant=variant, why=unreachable[variant])
        for variant in sorted(handle.unreachable.keys() - unreachable.keys()):
            self.log.info("engine {engine} reaches the server of {variant} again", engine=handle.id, variant=variant)
        handle.unreachable = unreachable

    def _unanswered(self, handle: EngineHandle, why: str) -> None:
        supervisor: Any = handle.supervisor
        if supervisor is not None:
            self.log.error("worker {engine} {why}: killing it", engine=handle.id, why=why)
            supervisor.hung(why)
            return
        if handle.unresponsive is None:
            self.log.error("engine {engine} {why}", engine=handle.id, why=why)
        handle.answering = False
        handle.unresponsive = why
        handle.client.abort_all()
