"""
The native routes of the public API (protocol.md sections 3, 4, 6, 7 and 9) over the
registry of engines: engines, health, capabilities, voices, previews, speech, dialogue,
residency, unload, the catalog, the OpenAPI document and the metrics.

It holds no engine knowledge and speaks through nothing but L{ISpeech}: it validates the
public shapes and hands a checked body to the speech service with an HTTP sink.  Its
reads are also served as data (L{IPublicRoutes}) to the doors that answer in other shapes
(MCP, the OpenAI discovery routes).  What happens before a handler runs, at the headers,
is the site's (L{rhapsode._http.site}); which route is which is the table's
(L{rhapsode._http.table}).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from twisted.internet.defer import Deferred, DeferredList
from twisted.logger import Logger
from twisted.web.iweb import IRequest
from zope.interface import implementer

from rhapsode_protocol import contract
from rhapsode_protocol.errors import Conflict, Forbidden, Internal, Unsupported
from rhapsode_protocol.http.answers import InFlight, answer, error_response, json_response, read_json

from .._fleet.catalog import Catalog
from .._fleet.cluster import ClusterView
from .._fleet.registry import EngineHandle, Registry
from .._fleet.residency import Residency, served_elsewhere_refusal
from .._interfaces import IClientSettings, IPublicRoutes, ISpeech, Utterance
from .._speech.metrics import CONTENT_TYPE as METRICS_TYPE
from .._speech.metrics import Metrics
from .._speech.relay import ERROR_LIMIT, remote_server
from .._speech.service import aliases_of
from .._upstream import collect, worker_json
from .sinks import HttpSink, timed_sink
from .site import CoreRequest, admitted_of, require_guard
from .table import JSON_BODY, openapi_document

__all__ = ["CoreApp"]


@implementer(IPublicRoutes)
class CoreApp:
    """
    The native public routes, over a registry of engines and the speech service.

    @param catalog: the catalog records and each engine's C{workerVersion}, read when
        the engines were declared.
    @param requests: the requests in flight, which a shutdown waits for.
    @param metrics_public: whether C{/metrics} answers everybody; otherwise it is
        guarded as the management routes are (it names engines and sizes).
    """

    log = Logger()

    def __init__(
        self,
        *,
        registry: Registry,
        residency: Residency,
        speech: ISpeech,
        catalog: Catalog,
        metrics: Metrics,
        requests: InFlight,
        version: str,
        contract_version: int,
        metrics_public: bool = False,
        clients: IClientSettings | None = None,
        cluster: ClusterView | None = None,
    ) -> None:
        """
        @param clients: the operator's voice aliases, which an engine's capability
            document lists.
        """
        self.registry = registry
        self.clients = clients
        #: At a cluster's front, what the cluster's nodes last said of themselves.
        self.cluster = cluster
        self.residency = residency
        self.speech = speech
        self.catalog = catalog
        self.metrics = metrics
        self.requests = requests
        self.version = version
        self.contract_version = contract_version
        self.metrics_public = metrics_public
        #: Voice uploads streaming to each engine's worker now: an unload waits for none.
        self.uploads: dict[str, int] = {}

    def handlers(self) -> dict[str, Callable[..., Any]]:
        """
        The handlers of the table's native routes, by name.
        """
        return {
            "engines": self._engines,
            "health": self._health,
            "residency": self._residency,
            "openapi": self._openapi,
            "catalog": self._catalog,
            "metrics": self._metrics,
            "capabilities": self._capabilities,
            "voices": self._voices,
            "preview": self._preview,
            "speak": self.speak,
            "dialogue": self._dialogue,
            "create_voice": self._create_voice,
            "delete_voice": self._delete_voice,
            "unload": self._unload,
        }

    async def _answer(self, request: IRequest, handler: Callable[[], Awaitable[Any]]) -> Any:
        """
        Map failures before headers onto the taxonomy; abort after them.
        """
        return await answer(request, handler, self.log, self.requests.enter, self.requests.leave)

    # -- reading the registry (IPublicRoutes) ------------------------------------------

    def summary(self, handle: EngineHandle) -> dict[str, Any]:
        """
        One engine as GET /engines and GET /health show it, from the core's own state:
        its licences, what its process and its model are doing, and why it last failed.
        """
        caps = handle.cached_capabilities()
        summary: dict[str, Any] = {"id": handle.id}
        if caps is not None:
            summary["displayName"] = caps["engine"]["displayName"]
            summary["license"] = caps["license"]
            summary["defaultVariant"] = caps["defaultVariant"]
            if caps["engine"]["id"] != handle.id:
                summary["adapter"] = caps["engine"]["id"]
        elif handle.catalog is not None:
            # Never started: what its catalog says, so licences show before first use.
            for key in ("displayName", "license", "defaultVariant"):
                if key in handle.catalog:
                    summary[key] = handle.catalog[key]
        summary.update(handle.health())
        # Section 9's pair, read when the engine was declared: nothing is asked per request.
        summary.update(self.catalog.versions(handle.id))
        if handle.elsewhere and self.cluster is not None:
            # A cluster's nodes own its models: what they last said, from memory.
            holding = self.cluster.holding(handle.id)
            summary["model"] = "loaded" if holding else "unloaded"
            summary["nodes"] = holding
            return summary
        # Model state is the residency manager's, so /health, /engines and /residency agree.
        model = self.residency.state(handle.id)
        summary["model"] = "unloaded"
        if model["resident"]:
            summary["model"] = "loaded" if model["loaded"] else "loading"
            summary["variant"] = model["variant"]
            summary["leases"] = model["leases"]
        elif model.get("served"):
            # Served elsewhere and spoken with: loaded as far as this core can tell.
            summary["model"] = "loaded"
            summary["variant"] = list(model["served"])[-1]
            summary["leases"] = model["leases"]
        return summary

    def engines(self) -> list[dict[str, Any]]:
        return [self.summary(h) for h in self.registry]

    async def capabilities(self, engine_id: str) -> tuple[int, Any]:
        engine = self.registry.get(engine_id)
        await engine.capabilities()
        client = await engine.ready()
        code, document = await client.json(b"GET", "/capabilities")
        aliases = aliases_of(self.clients, engine_id)
        if code == 200 and isinstance(document, dict) and aliases:
            # The operator's, not the worker's: listed as what they are, never as voices.
            document["aliases"] = aliases
        return code, document

    async def voices(self, engine_id: str) -> tuple[int, Any]:
        engine = self.registry.get(engine_id)
        client = await engine.ready()
        code, voices = await client.json(b"GET", "/voices")
        if code == 200 and isinstance(voices, list):
            for voice in voices:
                # The worker cannot know its prefix: the one field the core edits.
                voice["previewUrl"] = f"/engines/{engine_id}/voices/{voice['id']}/preview"
        return code, voices

    # -- the routes ----------------------------------------------------------------------

    async def _catch_up(self) -> None:
        """
        Read again the capabilities of every engine whose worker was replaced since they
        were read (a restart, a new build): the process is running, so asking it starts
        nothing, and a worker taken to be hung is not asked.
        """
        behind = [h for h in self.registry if h.capabilities_behind() and h.unresponsive is None]
        if behind:
            await DeferredList([Deferred.fromCoroutine(h.capabilities()) for h in behind], consumeErrors=True)

    async def _engines(self, request: IRequest) -> bytes:
        await self._catch_up()
        return json_response(request, 200, self.engines())

    def _health(self, request: IRequest) -> bytes:
        # Never waits on a worker: a replaced one's summary holds no capabilities of the
        # process before it (cached_capabilities), until GET /engines or a request reads them.
        engines = self.engines()
        residency = self.residency.snapshot()
        degraded = any(
            e["process"] == "failed" or h.unresponsive or h.unreachable or e.get("strays")
            for e, h in zip(engines, self.registry)
        )
        return json_response(
            request,
            200,
            {
                "status": "degraded" if degraded else "ok",
                "version": self.version,
                "contract": self.contract_version,
                "engines": engines,
                "residency": {key: residency[key] for key in ("resident", "max", "waiting")},
            },
        )

    def _metrics(self, request: IRequest) -> bytes:
        # Rendered here, on the reactor thread: the collector reads the core's own state.
        if not (self.metrics_public or admitted_of(request).guarded):
            return error_response(request, Forbidden("/metrics reached without passing the management guard"))
        request.setHeader(b"Content-Type", METRICS_TYPE)
        return self.metrics.render()

    def residency_document(self) -> dict[str, Any]:
        """
        GET /residency: the core's own state and, at a cluster's front, every node's as
        it last said, each model tagged with its node.
        """
        snapshot = self.residency.snapshot()
        if self.cluster is not None and self.cluster.urls:
            nodes = self.cluster.summaries()
            snapshot["models"] = snapshot["models"] + self.cluster.models()
            for key in ("resident", "max", "waiting"):
                snapshot[key] += sum(node[key] for node in nodes)
            snapshot["nodes"] = nodes
        return snapshot

    def _residency(self, request: IRequest) -> bytes:
        # The core's own state: spawns nothing, loads nothing, waits on no worker.
        return json_response(request, 200, self.residency_document())

    def _catalog(self, request: IRequest) -> bytes:
        # Open to everybody (protocol.md section 10): it only reads.
        entries = self.catalog.entries()
        if self.cluster is not None:
            for entry in entries:
                if entry["id"] in self.registry and self.registry.get(entry["id"]).elsewhere:
                    entry["nodes"] = self.cluster.offering(entry["id"])
        return json_response(request, 200, entries)

    def _openapi(self, request: IRequest) -> bytes:
        # Generated from the contract and the route table at the running version: it
        # describes this box.
        return json_response(request, 200, openapi_document(self.version, metrics_public=self.metrics_public))

    async def _unload(self, request: IRequest, engine_id: str) -> Any:
        async def handle() -> bytes:
            require_guard(request)
            engine = self.registry.get(engine_id)
            raw = request.args.get(b"mode", [b"terminate"])[0]
            if engine.elsewhere:
                raise Unsupported(
                    f'engine "{engine.id}" runs on a cluster, whose nodes own its models: unload it on its node'
                )
            if self.uploads.get(engine.id):
                # As for a stream (section 3): cutting it off would cost its caller the
                # upload for a reason it could not have predicted.
                raise Conflict(
                    f'engine "{engine.id}" is receiving a voice upload; unload it once that has finished'
                )
            caps = engine.cached_capabilities()
            served = {v: remote_server(caps, v) for v in caps["variants"]} if caps is not None else {}
            if served and all(served.values()):
                # Every model it has lives elsewhere: nothing here to give back.
                raise served_elsewhere_refusal(engine.id, {v: s or "" for v, s in served.items()})
            await self.residency.unload(engine.id, raw.decode("utf-8", "replace")[:20])
            return json_response(request, 200, self.summary(engine))

        return await self._answer(request, handle)

    async def _capabilities(self, request: IRequest, engine_id: str) -> Any:
        async def handle() -> bytes:
            code, document = await self.capabilities(engine_id)
            return json_response(request, code, document)

        return await self._answer(request, handle)

    async def _voices(self, request: IRequest, engine_id: str) -> Any:
        async def handle() -> bytes:
            code, voices = await self.voices(engine_id)
            return json_response(request, code, voices)

        return await self._answer(request, handle)

    async def _preview(self, request: IRequest, engine_id: str, voice_id: str) -> Any:
        sink = HttpSink(request)

        async def handle() -> None:
            await self.speech.preview(sink, engine_id, voice_id)

        return await self._answer(request, handle)

    # -- managing voices (guarded at the headers, see rhapsode._http.site) -------------

    async def start_upload(self, engine_id: str, request: CoreRequest) -> Any:
        """
        Begin the worker's POST /voices with the client's body as it arrives.
        """
        engine = self.registry.get(engine_id)
        self.uploads[engine.id] = self.uploads.get(engine.id, 0) + 1

        def done(_: object) -> None:
            self.uploads[engine.id] -= 1

        request.notifyFinish().addBoth(done)
        client = await engine.ready()
        content_type = request.requestHeaders.getRawHeaders(b"content-type", [b""])[0]
        return await client.request(
            b"POST", "/voices", request.upload, {b"Content-Type": [content_type]}
        )

    def _voice_answer(self, request: IRequest, engine_id: str, code: int, voice: Any) -> bytes:
        if code in (200, 201) and isinstance(voice, dict) and "id" in voice:
            voice["previewUrl"] = f"/engines/{engine_id}/voices/{voice['id']}/preview"
        return json_response(request, code, voice)

    async def _create_voice(self, request: IRequest, engine_id: str) -> Any:
        async def handle() -> bytes:
            require_guard(request)
            upstream = admitted_of(request).upstream
            if upstream is None:
                raise Internal("voice uploads need the core's own site (rhapsode._http.site.CoreSite)")
            response = await upstream
            raw = await collect(response, ERROR_LIMIT)
            return self._voice_answer(request, engine_id, response.code, worker_json(raw, "the upload"))

        return await self._answer(request, handle)

    async def _delete_voice(self, request: IRequest, engine_id: str, voice_id: str) -> Any:
        async def handle() -> bytes:
            require_guard(request)
            contract.check_voice_id(voice_id, "id")
            engine = self.registry.get(engine_id)
            client = await engine.ready()
            code, answer = await client.json(b"DELETE", f"/voices/{voice_id}")
            if code == 204:
                request.setResponseCode(204)
                return b""
            return json_response(request, code, answer)

        return await self._answer(request, handle)

    # -- speaking ------------------------------------------------------------------------

    async def speak(self, request: IRequest) -> Any:
        """
        C{POST /speak}: validate, then the speech service speaks it into the response.
        The core's own site reaches this without Klein's routing (the table's direct).
        """
        sink = HttpSink(request)

        async def handle() -> None:
            body = read_json(request, contract.PUBLIC_SPEAK_REQUEST, JSON_BODY)
            # With timestamps, the contract's events or document (protocol.md section 4).
            timed = timed_sink(request, body, sink.finished)
            await self.speech.speak(timed or sink, Utterance(body["engine"], body))

        return await self._answer(request, handle)

    async def _dialogue(self, request: IRequest, engine_id: str) -> Any:
        sink = HttpSink(request)

        async def handle() -> None:
            body = read_json(request, contract.PUBLIC_DIALOGUE_REQUEST, JSON_BODY)
            timed = timed_sink(request, body, sink.finished)
            await self.speech.speak(timed or sink, Utterance(engine_id, body, dialogue=True, route="dialogue"))

        return await self._answer(request, handle)

