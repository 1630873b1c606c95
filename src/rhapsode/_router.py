"""
The router: the public API (protocol.md sections 3, 4, 6, 7 and 9) as a Klein app over
the registry of engines.

It holds no engine knowledge.  It validates the public shapes, resolves the effective
variant from the variants it remembers (never from C{current}), strips cues the variant
does not claim and drops deliveries it does not perform, and hands what is left, without
C{keepAliveSeconds}, to the speech relay (L{rhapsode._relay}).  What happens before a
handler runs, at the headers, is admission's (L{rhapsode._admission}).
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable, Sequence

from klein import Klein
from twisted.internet.defer import CancelledError
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import server
from twisted.web.iweb import IRequest
from werkzeug.exceptions import MethodNotAllowed, NotFound

from rhapsode_worker import contract
from rhapsode_worker.errors import BadRequest, Forbidden, Internal
from rhapsode_worker.site import HandlerResource
from rhapsode_worker.vocab import clean_text
from rhapsode_worker.web import InFlight, answer_failure, json_response, no_route, read_json

from . import __version__
from ._admission import CoreRequest, CoreSite
from ._config import Config, ConfigSettings
from ._registry import EngineHandle, Registry
from ._relay import ERROR_LIMIT, SpeechRelay
from ._residency import IResidencySettings, Residency
from ._upstream import collect

_JSON_LIMIT = 1024 * 1024


def _body(request: IRequest, schema: dict[str, Any]) -> dict[str, Any]:
    return read_json(request, schema, _JSON_LIMIT)


class CoreApp:
    """
    The public routes, over a registry of engines.
    """

    app = Klein()
    log = Logger()

    def __init__(
        self,
        registry: Registry,
        *,
        reactor: Any,
        contract_version: int = 1,
        management_token: str | None = None,
        management_origins: Sequence[str] = (),
        settings: IResidencySettings | None = None,
        residency: Residency | None = None,
    ) -> None:
        """
        @param residency: the residency manager (the service builds it); without one,
            a manager over C{registry} reading C{settings}, or the defaults.
        """
        self.registry = registry
        if residency is None:
            residency = Residency(
                clock=reactor,
                settings=settings or ConfigSettings(Config),
                terminate=lambda engine: registry.get(engine).terminate(),
                unload=lambda engine: registry.get(engine).unload(),
            )
        self.residency = residency
        self.speech = SpeechRelay(residency)
        self.reactor = reactor
        self.contract_version = contract_version
        self.management_token = management_token
        self.management_origins = tuple(management_origins)
        self.requests = InFlight()

    def close(self) -> None:
        """
        Shutting down: stop keep-alive timers and any measurement still in flight.
        """
        self.speech.close()
        self.residency.close()

    def resource(self) -> Any:
        return self.app.resource()

    def site(self, access_log: bool = True) -> server.Site:
        """
        The site to listen with: its requests are guarded and stripped at their headers.
        Without C{access_log} no access line is even formatted (a log level above info).
        """
        speak = HandlerResource(self.speak, self.log)
        return CoreSite(
            self.resource(), self, {(b"POST", b"/speak"): speak}, access_log=access_log, reactor=self.reactor
        )

    async def _answer(self, request: IRequest, handler: Callable[[], Awaitable[Any]]) -> Any:
        """
        Map failures before headers onto the taxonomy; abort after them.
        """
        self.requests.enter()
        try:
            return await handler()
        except CancelledError:
            raise
        except Exception as exc:
            return answer_failure(request, exc, self.log)
        finally:
            self.requests.leave()

    @app.handle_errors(NotFound, MethodNotAllowed)
    def _no_route(self, request: IRequest, failure: Failure) -> bytes:
        return no_route(request)

    # -- reading the registry ----------------------------------------------------------

    def _summary(self, handle: EngineHandle) -> dict[str, Any]:
        caps = handle.cached_capabilities()
        summary: dict[str, Any] = {"id": handle.id}
        if caps is not None:
            summary["displayName"] = caps["engine"]["displayName"]
            summary["license"] = caps["license"]
            summary["defaultVariant"] = caps["defaultVariant"]
        elif handle.catalog is not None:
            # Never started: what its catalog says, so licences show before first use.
            for key in ("displayName", "license", "defaultVariant"):
                if key in handle.catalog:
                    summary[key] = handle.catalog[key]
        summary.update(self._state(handle))
        return summary

    def _state(self, handle: EngineHandle) -> dict[str, Any]:
        state: dict[str, Any]
        if handle.supervisor is None:
            state = {"process": "remote"}
        else:
            state = dict(handle.supervisor.health())
        # Model state is the residency manager's, so /health, /engines and /residency agree.
        model = self.residency.state(handle.id)
        state["model"] = "loaded" if model["resident"] else "unloaded"
        if model["resident"]:
            state["variant"] = model["variant"]
            state["leases"] = model["leases"]
        return state

    def _resident(self, engine: EngineHandle) -> str | None:
        model = self.residency.state(engine.id)
        return model["variant"] if model["resident"] else None

    @app.route("/engines", methods=["GET"])
    def _engines(self, request: IRequest) -> bytes:
        return json_response(request, 200, [self._summary(h) for h in self.registry])

    @app.route("/health", methods=["GET"])
    def _health(self, request: IRequest) -> bytes:
        return json_response(
            request,
            200,
            {
                "status": "ok",
                "version": __version__,
                "contract": self.contract_version,
                "engines": {h.id: self._state(h) for h in self.registry},
            },
        )

    @app.route("/residency", methods=["GET"])
    def _residency(self, request: IRequest) -> bytes:
        # The core's own state: spawns nothing, loads nothing, waits on no worker.
        return json_response(request, 200, self.residency.snapshot())

    @app.route("/engines/<string:engine_id>/unload", methods=["POST"])
    async def _unload(self, request: IRequest, engine_id: str) -> Any:
        async def handle() -> bytes:
            self._require_guard(request)
            engine = self.registry.get(engine_id)
            raw = request.args.get(b"mode", [b"terminate"])[0]
            await self.residency.unload(engine.id, raw.decode("utf-8", "replace"))
            return json_response(request, 200, self._summary(engine))

        return await self._answer(request, handle)

    @app.route("/openapi.json", methods=["GET"])
    def _openapi(self, request: IRequest) -> bytes:
        # Generated from the contract module at the running version: it describes this box.
        return json_response(request, 200, contract.public_openapi(__version__))

    # -- engine-scoped reads -----------------------------------------------------------

    @app.route("/engines/<string:engine_id>/capabilities", methods=["GET"])
    async def _capabilities(self, request: IRequest, engine_id: str) -> Any:
        async def handle() -> bytes:
            engine = self.registry.get(engine_id)
            await engine.capabilities()
            client = await engine.ready()
            code, document = await client.json(b"GET", "/capabilities")
            return json_response(request, code, document)

        return await self._answer(request, handle)

    @app.route("/engines/<string:engine_id>/voices", methods=["GET"])
    async def _voices(self, request: IRequest, engine_id: str) -> Any:
        async def handle() -> bytes:
            engine = self.registry.get(engine_id)
            client = await engine.ready()
            code, voices = await client.json(b"GET", "/voices")
            if code == 200 and isinstance(voices, list):
                for voice in voices:
                    # The worker cannot know its prefix: the one field the core edits.
                    voice["previewUrl"] = f"/engines/{engine_id}/voices/{voice['id']}/preview"
            return json_response(request, code, voices)

        return await self._answer(request, handle)

    @app.route("/engines/<string:engine_id>/voices/<string:voice_id>/preview", methods=["GET"])
    async def _preview(self, request: IRequest, engine_id: str, voice_id: str) -> Any:
        async def handle() -> Any:
            contract.check_voice_id(voice_id, "voice")
            engine = self.registry.get(engine_id)
            await engine.capabilities()
            variant = engine.effective_variant(None, self._resident(engine))
            lease = await self.residency.acquire(engine.id, variant, None)
            try:
                client = await engine.ready()
                response = await client.request(b"GET", f"/voices/{voice_id}/preview")
                return await self.speech.buffered(request, response)
            finally:
                lease.release()

        return await self._answer(request, handle)

    # -- managing voices (guarded at the headers, see _admission) ------------------------------

    async def start_upload(self, engine_id: str, request: CoreRequest) -> Any:
        """
        Begin the worker's POST /voices with the client's body as it arrives.
        """
        engine = self.registry.get(engine_id)
        client = await engine.ready()
        content_type = request.requestHeaders.getRawHeaders(b"content-type", [b""])[0]
        return await client.request(
            b"POST", "/voices", request.upload, {b"Content-Type": [content_type]}
        )

    def _voice_answer(self, request: IRequest, engine_id: str, code: int, voice: Any) -> bytes:
        if code == 200 and isinstance(voice, dict) and "id" in voice:
            voice["previewUrl"] = f"/engines/{engine_id}/voices/{voice['id']}/preview"
        return json_response(request, code, voice)

    @staticmethod
    def _require_guard(request: IRequest) -> None:
        # The guard runs at the headers (_admission); a management route reached any other
        # way refuses rather than runs unguarded.
        if not getattr(request, "guarded", False):
            raise Forbidden("management route reached without passing the management guard")

    @app.route("/engines/<string:engine_id>/voices", methods=["POST"])
    async def _create_voice(self, request: IRequest, engine_id: str) -> Any:
        async def handle() -> bytes:
            self._require_guard(request)
            upstream = getattr(request, "upstream", None)
            if upstream is None:
                raise Internal("voice uploads need the core's own site (rhapsode._admission.CoreSite)")
            response = await upstream
            raw = await collect(response, ERROR_LIMIT)
            return self._voice_answer(request, engine_id, response.code, json.loads(raw))

        return await self._answer(request, handle)

    @app.route("/engines/<string:engine_id>/voices/<string:voice_id>", methods=["DELETE"])
    async def _delete_voice(self, request: IRequest, engine_id: str, voice_id: str) -> Any:
        async def handle() -> bytes:
            self._require_guard(request)
            contract.check_voice_id(voice_id, "id")
            engine = self.registry.get(engine_id)
            client = await engine.ready()
            code, answer = await client.json(b"DELETE", f"/voices/{voice_id}")
            return json_response(request, code, answer)

        return await self._answer(request, handle)

    # -- speaking ------------------------------------------------------------------------

    @app.route("/speak", methods=["POST"])
    async def _speak(self, request: IRequest) -> Any:
        return await self.speak(request)

    async def speak(self, request: IRequest) -> Any:
        """
        C{POST /speak}: validate, resolve the variant, take a lease and relay the audio.
        The core's own site reaches this without Klein's routing (L{HandlerResource}).
        """
        finished = request.notifyFinish()  # type: ignore[attr-defined]

        async def handle() -> Any:
            body = _body(request, contract.PUBLIC_SPEAK_REQUEST)
            engine = self.registry.get(body["engine"])
            caps = await engine.capabilities()
            variant = engine.effective_variant(body.get("variant"), self._resident(engine))
            performs = self._variant(caps, variant)
            forward = self._forwarded(body, variant)
            forward["text"] = clean_text(body["text"], performs["cues"])
            if forward.get("delivery") not in performs["deliveries"]:
                forward.pop("delivery", None)
            return await self.speech.dispatch(
                request, finished, engine, "/speak", forward, caps, body.get("keepAliveSeconds")
            )

        return await self._answer(request, handle)

    @app.route("/engines/<string:engine_id>/dialogue", methods=["POST"])
    async def _dialogue(self, request: IRequest, engine_id: str) -> Any:
        finished = request.notifyFinish()  # type: ignore[attr-defined]

        async def handle() -> Any:
            body = _body(request, contract.PUBLIC_DIALOGUE_REQUEST)
            engine = self.registry.get(engine_id)
            caps = await engine.capabilities()
            variant = engine.effective_variant(body.get("variant"), self._resident(engine))
            performs = self._variant(caps, variant)
            forward = self._forwarded(body, variant)
            forward["turns"] = [
                {"speaker": t["speaker"], "text": clean_text(t["text"], performs["cues"])}
                for t in body["turns"]
            ]
            return await self.speech.dispatch(
                request, finished, engine, "/dialogue", forward, caps, body.get("keepAliveSeconds")
            )

        return await self._answer(request, handle)

    @staticmethod
    def _variant(caps: dict[str, Any], variant: str) -> dict[str, Any]:
        variants = caps["variants"]
        if variant not in variants:
            known = ", ".join(sorted(variants))
            raise BadRequest(f'unknown variant "{variant}" (variants: {known})', field="variant")
        performs: dict[str, Any] = variants[variant]
        return performs

    @staticmethod
    def _forwarded(body: dict[str, Any], variant: str) -> dict[str, Any]:
        # The worker is never told how long to keep its model (section 3), nor which
        # engine it is; it is told the variant the core resolved, so both agree on it.
        forward = {k: v for k, v in body.items() if k not in ("engine", "keepAliveSeconds")}
        forward["variant"] = variant
        return forward
