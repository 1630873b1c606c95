"""
The model half of a worker's state (protocol.md section 3): unloaded, loading, loaded,
unloading, and what the resident model cost.

Transitions run the adapter's blocking calls on the synthesis thread pool; the state is
only ever changed on the reactor thread, so C{/health} reads it without a lock and
answers at once whatever the model is doing.  Callers serialise these operations through
the scheduler, which runs them exclusively of any synthesis.
"""

from __future__ import annotations

from typing import Any, Callable

from twisted.internet.defer import Deferred
from twisted.logger import Logger

from rhapsode_protocol.errors import SpeechError, as_speech_error

from . import _memory
from ._engine import IEngine
from ._pool import WorkerPool, in_pool

UNLOADED = "unloaded"
LOADING = "loading"
LOADED = "loaded"
UNLOADING = "unloading"

#: The legal moves of protocol.md section 3's per-worker machine, model half.  A failed
#: load falls back to unloaded; its retry unloads first, from there.
_TRANSITIONS: dict[str, frozenset[str]] = {
    UNLOADED: frozenset({LOADING, UNLOADING}),
    LOADING: frozenset({LOADED, UNLOADED}),
    LOADED: frozenset({UNLOADING}),
    UNLOADING: frozenset({UNLOADED}),
}


class ModelState:
    """
    The resident model, if any, and the one transition in progress.
    """

    log = Logger()

    def __init__(self, engine: IEngine, reactor: Any, pool: WorkerPool) -> None:
        self._engine = engine
        self._reactor = reactor
        self._pool = pool
        self.state = UNLOADED
        self.variant: str | None = None
        self.model_bytes: int | None = None
        #: The variants served elsewhere (read once, when first asked).
        self._remote: set[str] | None = None
        #: Those of them loaded (probed) since the last unload: each sits beside the
        #: others and beside a local model, since none holds anything here.
        self.remote_loaded: set[str] = set()

    def _become(self, state: str, variant: str | None, model_bytes: int | None = None) -> None:
        if state not in _TRANSITIONS[self.state]:
            raise RuntimeError(f"model cannot go from {self.state} to {state}")
        self.state, self.variant, self.model_bytes = state, variant, model_bytes

    def _in_pool(self, fn: Callable[..., Any], *args: Any) -> "Deferred[Any]":
        return in_pool(self._reactor, self._pool, fn, *args)

    def resident(self, variant: str) -> bool:
        return (self.state == LOADED and self.variant == variant) or variant in self.remote_loaded

    def served_elsewhere(self, variant: str) -> bool:
        """
        Whether C{variant}'s model is served by a server the adapter calls (its
        L{rhapsode_worker.Remote}).
        """
        if self._remote is None:
            self._remote = {name for name, v in self._engine.variants().items() if v.remote is not None}
        return variant in self._remote

    async def ensure(self, variant: str) -> None:
        """
        Make C{variant} the resident model: unload another, then load, and if the load
        fails, unload and load exactly once more (a failed load strands memory).

        A variant served elsewhere is loaded beside what is resident, once, and not
        retried: its load holds nothing here (the adapter asks its server whether it is
        there), so there is nothing to unload first and nothing stranded to free.
        """
        if self.resident(variant):
            return
        if self.served_elsewhere(variant):
            await self._load_remote(variant)
            return
        if self.state == LOADED:
            await self.unload()
        try:
            await self._load(variant)
        except SpeechError as first:
            self.log.warn(
                "load of {variant} failed ({error}); unloading and retrying once",
                variant=variant,
                error=first.message,
            )
            await self._unload_quietly()
            await self._load(variant)

    async def _load(self, variant: str) -> None:
        self._become(LOADING, variant)
        self.log.info("loading {variant}", variant=variant)
        try:
            measured = await self._in_pool(self._load_measured, variant)
        except BaseException as exc:
            self._become(UNLOADED, None)
            raise as_speech_error(exc) from exc
        self._become(LOADED, variant, measured)
        self.log.info("loaded {variant} ({bytes} bytes)", variant=variant, bytes=measured)

    def _load_measured(self, variant: str) -> int | None:
        before = _memory.device_bytes()
        self._engine.load(variant)
        told = self._engine.memory_bytes()
        if isinstance(told, int) and told > 0:
            return told
        return _memory.load_delta(before, _memory.device_bytes())

    async def _load_remote(self, variant: str) -> None:
        self.log.info("asking the server of {variant} whether it is there", variant=variant)
        try:
            await self._in_pool(self._engine.load, variant)
        except BaseException as exc:
            raise as_speech_error(exc) from exc
        self.remote_loaded.add(variant)
        if self.state == UNLOADED:
            # Nothing measured: whatever this process grew by is not the model.
            self._become(LOADING, variant)
            self._become(LOADED, variant, None)
        elif self.state == LOADED and self.variant in self.remote_loaded:
            self.variant = variant  # /health names the one loaded last

    async def unload(self) -> None:
        self.remote_loaded.clear()
        if self.state == UNLOADED:
            return
        previous = self.variant
        self._become(UNLOADING, previous)
        try:
            await self._in_pool(self._engine.unload)
        finally:
            self._become(UNLOADED, None)
        self.log.info("unloaded {variant}", variant=previous)

    async def _unload_quietly(self) -> None:
        self._become(UNLOADING, None)
        try:
            await self._in_pool(self._engine.unload)
        except BaseException as exc:
            self.log.warn("unload after a failed load raised {error!r}", error=exc)
        finally:
            self._become(UNLOADED, None)
