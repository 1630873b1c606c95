"""
A cluster node's door (docs/cluster.md): the worker routes of each of this core's
engines, under C{/worker/<engine>/}, for a cluster's front that reaches them as it would
reach a remote worker, and the node's own state for the cluster's router (C{GET /node}).

The node is an ordinary core that owns its engines, their worker processes and their
residency: a speech request the front forwards takes a turn and a lease here, as any of
this core's own requests does, and the worker's answer is relayed as the worker sent it
(its status, its Content-Type, its duration as a header or a trailer).  Every answer says
which node gave it (C{X-Rhapsode-Node}).  A keep-alive the front's caller asked for
arrives as C{X-Rhapsode-Keep-Alive}.  The front owns nothing of a node's models, so it
never asks a node to unload or terminate one: those worker verbs are refused here.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from twisted.logger import Logger
from twisted.web.iweb import IRequest

from rhapsode_protocol import contract
from rhapsode_protocol.errors import BadRequest, Internal, Unsupported
from rhapsode_protocol.http.answers import InFlight, answer, json_response, read_json

from .._fleet.registry import Registry
from .._fleet.residency import Residency
from .._http.sinks import HttpSink, framed_sink, timed_sink
from .._http.site import admitted_of, require_guard
from .._http.table import JSON_BODY
from .._interfaces import IPublicRoutes, ISpeech
from .._speech.relay import KEEP_ALIVE_HEADER, NODE_HEADER
from .._upstream import collect, worker_json

__all__ = ["NodeDoor", "memory"]

_ERROR_LIMIT = 64 * 1024


def memory(path: str = "/proc/meminfo") -> dict[str, int]:
    """
    This machine's memory as the kernel counts it: C{totalBytes} and C{freeBytes}
    (what it could give a new model without swapping); empty where it cannot be read.
    """
    found: dict[str, int] = {}
    try:
        with open(path, encoding="ascii") as lines:
            for line in lines:
                name, _, rest = line.partition(":")
                if name in ("MemTotal", "MemAvailable"):
                    found[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return {}
    if len(found) != 2:
        return {}
    return {"totalBytes": found["MemTotal"], "freeBytes": found["MemAvailable"]}


class NodeDoor:
    """
    The worker routes of this node's engines and its state, over its registry, its
    residency, its speech service and its public reads.
    """

    log = Logger()

    def __init__(
        self,
        *,
        name: str,
        registry: Registry,
        residency: Residency,
        speech: ISpeech,
        routes: IPublicRoutes,
        requests: InFlight,
        memory: Callable[[], dict[str, int]] = memory,
    ) -> None:
        self.name = name
        self.registry = registry
        self.residency = residency
        self.speech = speech
        self.routes = routes
        self.requests = requests
        self._memory = memory

    def handlers(self) -> dict[str, Callable[..., Any]]:
        """
        The handlers of the table's node routes, by name.
        """
        return {
            "node_state": self._state,
            "node_capabilities": self._capabilities,
            "node_voices": self._voices,
            "node_create_voice": self._create_voice,
            "node_delete_voice": self._delete_voice,
            "node_preview": self._preview,
            "node_speak": self._speak,
            "node_dialogue": self._dialogue,
            "node_health": self._health,
            "node_fetch": self._fetch,
            "node_refused": self._refused,
        }

    async def _answer(self, request: IRequest, handler: Callable[[], Awaitable[Any]]) -> Any:
        request.setHeader(NODE_HEADER, self.name.encode("ascii"))
        return await answer(request, handler, self.log, self.requests.enter, self.requests.leave)

    def state(self) -> dict[str, Any]:
        """
        What the cluster's router ranks this node by, from the core's own state: what
        is resident and leased, how much room is left, and the machine's memory.
        """
        snapshot = self.residency.snapshot()
        return {
            "node": self.name,
            "engines": self.registry.ids(),
            "residency": snapshot,
            "slots": max(0, snapshot["max"] - snapshot["resident"]),
            "leases": sum(model["leases"] for model in snapshot["models"]),
            "memory": self._memory(),
        }

    # -- the routes ----------------------------------------------------------------------

    def _state(self, request: IRequest) -> bytes:
        # The core's own state: spawns nothing, loads nothing, waits on no worker.
        request.setHeader(NODE_HEADER, self.name.encode("ascii"))
        return json_response(request, 200, self.state())

    async def _capabilities(self, request: IRequest, engine_id: str) -> Any:
        async def handle() -> bytes:
            code, document = await self.routes.capabilities(engine_id)
            return json_response(request, code, document)

        return await self._answer(request, handle)

    async def _voices(self, request: IRequest, engine_id: str) -> Any:
        async def handle() -> bytes:
            engine = self.registry.get(engine_id)
            client = await engine.ready()
            code, voices = await client.json(b"GET", "/voices")
            return json_response(request, code, voices)

        return await self._answer(request, handle)

    async def _create_voice(self, request: IRequest, engine_id: str) -> Any:
        async def handle() -> bytes:
            require_guard(request)
            upstream = admitted_of(request).upstream
            if upstream is None:
                raise Internal("voice uploads need the core's own site (rhapsode._http.site.CoreSite)")
            response = await upstream
            raw = await collect(response, _ERROR_LIMIT)
            return json_response(request, response.code, worker_json(raw, "the upload"))

        return await self._answer(request, handle)

    async def _delete_voice(self, request: IRequest, engine_id: str, voice_id: str) -> Any:
        async def handle() -> bytes:
            require_guard(request)
            contract.check_voice_id(voice_id, "id")
            client = await self.registry.get(engine_id).ready()
            code, body = await client.json(b"DELETE", f"/voices/{voice_id}")
            if code == 204:
                request.setResponseCode(204)
                return b""
            return json_response(request, code, body)

        return await self._answer(request, handle)

    async def _preview(self, request: IRequest, engine_id: str, voice_id: str) -> Any:
        sink = HttpSink(request)

        async def handle() -> None:
            await self.speech.preview(sink, engine_id, voice_id)

        return await self._answer(request, handle)

    def _keep_alive(self, request: IRequest) -> int | None:
        raw = request.requestHeaders.getRawHeaders(KEEP_ALIVE_HEADER)
        if not raw:
            return None
        text = raw[0].decode("ascii", "replace")
        if not (text.lstrip("-").isdigit() and -1 <= int(text) <= contract.MAX_KEEP_ALIVE_SECONDS):
            raise BadRequest(f"{KEEP_ALIVE_HEADER.decode()} must be -1 to {contract.MAX_KEEP_ALIVE_SECONDS}",
                             field="headers")
        return int(text)

    async def _speak(self, request: IRequest, engine_id: str) -> Any:
        return await self._speech(request, engine_id, dialogue=False)

    async def _dialogue(self, request: IRequest, engine_id: str) -> Any:
        return await self._speech(request, engine_id, dialogue=True)

    async def _speech(self, request: IRequest, engine_id: str, dialogue: bool) -> Any:
        sink = HttpSink(request)

        async def handle() -> None:
            schema = contract.DIALOGUE_REQUEST if dialogue else contract.SPEAK_REQUEST
            body = read_json(request, schema, JSON_BODY)
            # Timed: in a worker's frames, which a front asks for with its Accept, or as
            # the public API answers anyone else.
            timed = framed_sink(request, body, sink.finished) or timed_sink(request, body, sink.finished)
            await self.speech.forwarded(timed or sink, engine_id, body, dialogue, self._keep_alive(request))

        return await self._answer(request, handle)

    async def _health(self, request: IRequest, engine_id: str) -> Any:
        async def handle() -> bytes:
            # The node answers for its engine from its own state: a front's watchdog
            # asking must not start a worker.
            handle = self.registry.get(engine_id)
            model = self.residency.state(engine_id)
            body = {"status": "ok", "node": self.name, **handle.health(), "model": model}
            return json_response(request, 200, body)

        return await self._answer(request, handle)

    async def _fetch(self, request: IRequest, engine_id: str) -> Any:
        async def handle() -> bytes:
            require_guard(request)
            body = read_json(request, contract.FETCH_REQUEST, JSON_BODY)
            client = await self.registry.get(engine_id).ready()
            code, answered = await client.json(b"POST", "/fetch", body)
            return json_response(request, code, answered)

        return await self._answer(request, handle)

    async def _refused(self, request: IRequest, engine_id: str) -> Any:
        async def handle() -> bytes:
            raise Unsupported(
                f'node "{self.name}" owns the residency of engine "{engine_id}": a front neither unloads '
                "nor terminates a node's models"
            )

        return await self._answer(request, handle)
