"""
The registry: every configured engine, how to reach its worker, and what the core
remembers about it (protocol.md sections 1 and 4).

A local engine has a supervisor that spawns its worker on first need; a remote one is a
URL.  Both are reached through the same L{WorkerClient}.  The registry remembers each
worker's variants (they do not change while it runs) so that routing never depends on
C{current}, and never spawns anything to answer C{/engines} or C{/health}.
"""

from __future__ import annotations

from typing import Any, Mapping

from twisted.internet.defer import Deferred, succeed

from rhapsode_protocol.errors import ModelUnavailable, UnknownEngine

from .._interfaces import ISupervisor, IWorkerClient


class EngineHandle:
    """
    One configured engine.
    """

    def __init__(
        self,
        engine_id: str,
        client: IWorkerClient,
        supervisor: ISupervisor | None,
        catalog: Mapping[str, Any] | None = None,
        *,
        elsewhere: bool = False,
    ) -> None:
        self.id = engine_id
        #: Its models are another core's to keep (a cluster's nodes): this core takes
        #: no turn and no lease for them, and never unloads or terminates them.
        self.elsewhere = elsewhere
        self.client = client
        self.supervisor = supervisor
        #: Facts from the engine's catalog.json, known before its worker ever runs.
        self.catalog = dict(catalog) if catalog else None
        self._capabilities: dict[str, Any] | None = None
        #: The process the capabilities were read from: another process may be another
        #: build (a reinstall), so it is asked again.
        self._capabilities_from: int | None = None
        self._stale = False
        #: Why the worker is taken to be hung, while it is (the watchdog's finding).
        self.unresponsive: str | None = None
        #: For a remote worker: whether its last health check was answered (None: never asked).
        self.answering: bool | None = None
        #: The variants whose model, served elsewhere, the worker's last health check
        #: said it cannot reach, with why: refused (503, retryable) until it can.
        self.unreachable: dict[str, str] = {}
        #: Set once an uninstall or a reinstall has taken this handle out of the
        #: registry: a request that found it before then starts no process with it.
        self.retired = False

    @property
    def remote(self) -> bool:
        return self.supervisor is None

    async def ready(self) -> IWorkerClient:
        """
        The worker's client, once its process is up (spawning it if it is down).

        @raise ModelUnavailable: a remote worker is not answering.
        """
        if self.retired:
            raise ModelUnavailable(f'engine "{self.id}" has just been reinstalled or removed; try again')
        if self.supervisor is not None:
            await self.supervisor.start()
        elif self.unresponsive is not None:
            raise ModelUnavailable(f'engine "{self.id}" {self.unresponsive}; try again shortly')
        return self.client

    async def capabilities(self) -> dict[str, Any]:
        """
        The worker's capability document, fetched once per worker process.
        """
        running = self.supervisor.pid if self.supervisor is not None else None
        if self._capabilities is not None and not self._stale and running in (None, self._capabilities_from):
            # The process they came from, or none running: nothing is started to ask
            # (a request refused on them costs no process).
            return self._capabilities
        client = await self.ready()
        code, document = await client.json(b"GET", "/capabilities")
        if code != 200 or not isinstance(document, dict):
            raise ModelUnavailable(f'engine "{self.id}" answered /capabilities with {code}')
        self._capabilities = {k: v for k, v in document.items() if k != "current"}
        self._capabilities_from = self.supervisor.pid if self.supervisor is not None else None
        self._stale = False
        return self._capabilities

    def forget_capabilities(self) -> None:
        """
        The worker may have changed (a remote worker that came back, a reinstall): ask
        it again next time.
        """
        self._stale = True

    def health(self) -> dict[str, Any]:
        """
        The process half of this engine's state, from the core's own knowledge.
        """
        if self.supervisor is not None:
            state = dict(self.supervisor.health())
        else:
            # A remote worker's process is somebody else's: up or down as last seen.
            state = {"process": "down" if self.answering is False else "up", "restarts": 0, "remote": True}
        if self.unresponsive is not None:
            state["lastError"] = self.unresponsive
        elif self.unreachable:
            state["lastError"] = "; ".join(f"{variant}: {why}" for variant, why in sorted(self.unreachable.items()))
        if self.unreachable:
            state["unreachable"] = dict(self.unreachable)
        return state

    def check_reachable(self, variant: str) -> None:
        """
        Refuse a request for C{variant} while the server its model is served by is not
        answering the worker (the watchdog's finding), so nothing waits on a server
        that is down and no lease is taken for it.

        @raise ModelUnavailable: naming the variant and why.
        """
        why = self.unreachable.get(variant)
        if why is not None:
            raise ModelUnavailable(
                f'engine "{self.id}" variant "{variant}" is unavailable: {why}; try again once it answers'
            )

    def cached_capabilities(self) -> dict[str, Any] | None:
        return self._capabilities

    def effective_variant(self, requested: str | None, resident: str | None) -> str:
        """
        Section 4's total rule: the request's variant, else the resident one, else the
        default.  Never reads C{current}.
        """
        assert self._capabilities is not None
        if requested is not None:
            return requested
        return resident or self._capabilities["defaultVariant"]

    def terminate(self) -> Any:
        """
        End this engine's worker process: a local one through its supervisor (the verb,
        then a signal, then SIGKILL), a remote one by the verb alone.
        """
        if self.supervisor is not None:
            return self.supervisor.stop(ask=True)
        return Deferred.fromCoroutine(self._ask(b"POST", "/terminate"))

    def unload(self) -> Any:
        """
        Unload this engine's model but keep its process; a local worker that is not up
        has nothing loaded and is not started just to be told so.
        """
        if self.supervisor is not None and self.supervisor.state != "up":
            return succeed(None)
        return Deferred.fromCoroutine(self._ask(b"POST", "/unload"))

    async def _ask(self, method: bytes, path: str) -> None:
        code, answer = await self.client.json(method, path)
        if code >= 300:
            raise ModelUnavailable(f'engine "{self.id}" answered {path} with {code}: {answer}')


class Registry:
    """
    Every configured engine, by id, in configuration order.
    """

    def __init__(self, handles: Mapping[str, EngineHandle]) -> None:
        self._handles = dict(handles)

    def __iter__(self) -> Any:
        return iter(self._handles.values())

    def ids(self) -> list[str]:
        return list(self._handles)

    def __contains__(self, engine_id: object) -> bool:
        return engine_id in self._handles

    def add(self, handle: EngineHandle) -> None:
        """
        An engine installed while the core runs: the next request for it spawns its worker.
        """
        if handle.id in self._handles:
            raise ValueError(f"engine {handle.id} is registered already")
        self._handles[handle.id] = handle

    def replace(self, handle: EngineHandle) -> EngineHandle:
        """
        Put a new handle in place of the engine's old one (a reinstall); answers the old.
        """
        old = self._handles[handle.id]
        self._handles[handle.id] = handle
        return old

    def remove(self, engine_id: str) -> EngineHandle:
        """
        Take an engine out (its worker already stopped); answers its handle.
        """
        return self._handles.pop(engine_id)

    def get(self, engine_id: str) -> EngineHandle:
        try:
            return self._handles[engine_id]
        except KeyError:
            known = ", ".join(self._handles) or "none"
            raise UnknownEngine(
                f'no engine "{engine_id}" (engines: {known})', field="engine"
            ) from None
