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

from rhapsode_protocol import contract
from rhapsode_protocol.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    Internal,
    SpeechError,
    UnknownVoice,
    Unsupported,
    as_speech_error,
)
from rhapsode_protocol.http.answers import InFlight, answer, error_response, json_response, no_route, read_json
from rhapsode_protocol.http.site import HEAD_SECONDS, IDLE_SECONDS, HandlerResource, Routes

from . import __version__
from ._admission import MAX_UPLOAD_BYTES, BufferBudget, CoreRequest, CoreSite, IAdmissionSettings, Turnstile
from ._catalog import Catalog
from ._config import Config, ConfigSettings
from ._installer import Installer, install_query
from ._jobs import Jobs, last_event_id
from ._mcp import McpServer
from ._metrics import CONTENT_TYPE as METRICS_TYPE
from ._metrics import Metrics
from ._openai import OpenAIShim
from ._preflight import forward_dialogue, forward_speak, voices_to_check
from ._registry import EngineHandle, Registry
from ._relay import ERROR_LIMIT, SpeechRelay
from ._residency import IResidencySettings, Residency
from ._settings import Settings, caller_of, read_patch
from ._stream import SpeechStreams
from ._update import RELEASES_URL, UpdateChecker, checker_for
from ._upstream import collect

_JSON_LIMIT = 1024 * 1024

# The rules of the routes admission treats specially, as the decorators below name them.
_VOICES = "/engines/<string:engine_id>/voices"
_VOICE = "/engines/<string:engine_id>/voices/<string:voice_id>"
_UNLOAD = "/engines/<string:engine_id>/unload"
_DIALOGUE = "/engines/<string:engine_id>/dialogue"
# The translations on top of the public API (protocol.md sections 11 and 12).
OPENAI_SPEECH = "/v1/audio/speech"
OPENAI_BATCH = "/v1/audio/speech/batch"
OPENAI_STREAM = "/v1/audio/speech/stream"
MCP = "/mcp"
METRICS = "/metrics"
#: The update check (protocol.md section 9): open routes, like /health and /catalog.
UPDATE = "/update"
UPDATE_CHECK = "/update/check"
#: At most this many items in one batch, and this much JSON in its body.
BATCH_ITEMS = 32
_BATCH_LIMIT = 4 * 1024 * 1024
# Installing (protocol.md section 10).
_INSTALL = "/engines/<string:engine_id>/install"
_REINSTALL = "/engines/<string:engine_id>/reinstall"
_PULL = "/engines/<string:engine_id>/pull"
_ENGINE = "/engines/<string:engine_id>"
_JOBS = "/installs"
_JOB = "/installs/<string:job_id>"
_JOB_EVENTS = "/installs/<string:job_id>/events"
_OUTDATED = "/installs/outdated"
#: The management routes (protocol.md section 10): guarded at their heads.
MANAGEMENT = frozenset({
    ("POST", _VOICES), ("DELETE", _VOICE), ("POST", _UNLOAD), ("GET", "/settings"), ("PATCH", "/settings"),
    ("POST", _INSTALL), ("POST", _REINSTALL), ("POST", _PULL), ("DELETE", _ENGINE),
    ("GET", _JOBS), ("GET", _JOB), ("GET", _JOB_EVENTS), ("POST", _OUTDATED),
})
#: The most body each route takes; the rest take the site's default (64 KiB).
BODY_LIMITS = {
    ("POST", "/speak"): _JSON_LIMIT,
    ("POST", _DIALOGUE): _JSON_LIMIT,
    ("POST", _VOICES): MAX_UPLOAD_BYTES,
    ("POST", OPENAI_SPEECH): _JSON_LIMIT,
    ("POST", OPENAI_BATCH): _BATCH_LIMIT,
    ("POST", MCP): _JSON_LIMIT,
}
#: Routes that answer anybody but a browser page from an origin not allowed
#: (protocol.md section 12's rule for /mcp; a WebSocket is never preflighted).
ORIGIN_CHECKED = frozenset({("POST", MCP), ("GET", OPENAI_STREAM)})
#: The public routes a browser page on an allowed origin may call (cors.origins).
CORS_ROUTES = frozenset({
    ("POST", "/speak"),
    ("POST", _DIALOGUE),
    ("GET", "/engines"),
    ("GET", "/engines/<string:engine_id>/capabilities"),
    ("GET", _VOICES),
    ("GET", "/engines/<string:engine_id>/voices/<string:voice_id>/preview"),
    ("GET", "/health"),
    ("GET", "/catalog"),
    ("POST", OPENAI_SPEECH),
    ("POST", OPENAI_BATCH),
    ("GET", OPENAI_STREAM),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/<string:model_id>"),
    ("GET", "/v1/audio/models"),
    ("GET", "/v1/audio/voices"),
    ("GET", UPDATE),
    ("POST", UPDATE_CHECK),
})


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
        cors_origins: Sequence[str] = (),
        metrics_public: bool = False,
        settings: IResidencySettings | None = None,
        residency: Residency | None = None,
        admission: IAdmissionSettings | None = None,
        stall_seconds: float = 120.0,
        head_timeout: float = HEAD_SECONDS,
        idle_timeout: float = IDLE_SECONDS,
        catalog: Catalog | None = None,
        settings_api: Settings | None = None,
    ) -> None:
        """
        @param residency: the residency manager (the service builds it); without one,
            a manager over C{registry} reading C{settings}, or the defaults.
        @param admission: the limits on speech at once and buffered audio held.
        @param stall_seconds: how long a worker may send nothing while answering.
        @param head_timeout: how long a request's head may take from its first byte.
        @param idle_timeout: how long a connection may send nothing.
        @param metrics_public: whether C{/metrics} answers everybody; otherwise it is
            guarded as the management routes are (it names engines and sizes).
        @param catalog: the catalog records and each engine's C{workerVersion}, read
            when the engines were declared; without one, C{GET /catalog} lists nothing
            and no summary carries a version.
        @param cors_origins: the browser origins, beside this machine's, whose pages
            may call the public speech and discovery routes (C{cors.origins}).
        """
        self.registry = registry
        self.catalog = catalog if catalog is not None else Catalog((), __version__)
        # The defaults, built once: a Config works out its default paths when made.
        default = Config()
        defaults = ConfigSettings(lambda: default)
        if residency is None:
            residency = Residency(
                clock=reactor,
                settings=settings or defaults,
                terminate=lambda engine: registry.get(engine).terminate(),
                unload=lambda engine: registry.get(engine).unload(),
            )
        self.residency = residency
        if admission is None:
            # Settings that are the config's answer for admission too.
            admission = settings if isinstance(settings, ConfigSettings) else defaults
        self.speech = SpeechRelay(
            residency, Turnstile(reactor, admission), BufferBudget(admission), reactor, stall_seconds
        )
        self.head_timeout = head_timeout
        self.idle_timeout = idle_timeout
        #: Voice uploads streaming to each engine's worker now: an unload waits for none.
        self.uploads: dict[str, int] = {}
        self.reactor = reactor
        self.contract_version = contract_version
        self.management_token = management_token
        self.management_origins = tuple(management_origins)
        self.cors_origins = tuple(cors_origins)
        self.requests = InFlight()
        self.openai = OpenAIShim(self)
        self.mcp = McpServer(self, __version__)
        self.streams = SpeechStreams(self)
        self.metrics = Metrics(self, reactor)
        self.residency.observer = self.metrics
        self.metrics_public = metrics_public
        #: The settings and the state database they live in; without one, /settings
        #: answers unsupported (a core embedded without a config file has nowhere to keep one).
        self.settings_api = settings_api
        #: Install, reinstall and pull jobs; the installer that makes them is the
        #: service's (it changes the registry), and without one every install route
        #: answers unsupported.
        self.jobs = Jobs(reactor)
        self.jobs.on_finished = self.metrics.job_finished
        self.installer: Installer | None = None

    def close(self) -> None:
        """
        Shutting down: stop keep-alive timers and any measurement still in flight.
        """
        self.streams.close()
        self.speech.close()
        self.residency.close()

    def resource(self) -> Any:
        return self.app.resource()

    def site(self, access_log: bool = True) -> server.Site:
        """
        The site to listen with: its requests are guarded and stripped at their headers.
        Without C{access_log} no access line is even formatted (a log level above info).
        """
        # The speech routes skip Klein's routing: they are matched on every utterance.
        direct = {
            (b"POST", b"/speak"): HandlerResource(self.speak, self.log),
            (b"POST", OPENAI_SPEECH.encode()): HandlerResource(self.openai.speech, self.log),
        }
        return CoreSite(
            self.resource(),
            self,
            direct,
            access_log=access_log,
            reactor=self.reactor,
            routes=Routes(self.app.url_map, BODY_LIMITS),
            management=MANAGEMENT if self.metrics_public else MANAGEMENT | {("GET", METRICS)},
            origin_checked=ORIGIN_CHECKED,
            cors=CORS_ROUTES,
            upload=("POST", _VOICES),
            timeout=self.idle_timeout,
            head_timeout=self.head_timeout,
        )

    async def _answer(self, request: IRequest, handler: Callable[[], Awaitable[Any]]) -> Any:
        """
        Map failures before headers onto the taxonomy; abort after them.
        """
        return await answer(request, handler, self.log, self.requests.enter, self.requests.leave)

    @app.handle_errors(NotFound, MethodNotAllowed)
    def _no_route(self, request: IRequest, failure: Failure) -> bytes:
        return no_route(request, failure)

    # -- reading the registry ----------------------------------------------------------

    def _summary(self, handle: EngineHandle) -> dict[str, Any]:
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
        # Model state is the residency manager's, so /health, /engines and /residency agree.
        model = self.residency.state(handle.id)
        summary["model"] = "unloaded"
        if model["resident"]:
            summary["model"] = "loaded" if model["loaded"] else "loading"
            summary["variant"] = model["variant"]
            summary["leases"] = model["leases"]
        return summary

    def _resident(self, engine: EngineHandle) -> str | None:
        model = self.residency.state(engine.id)
        return model["variant"] if model["resident"] else None

    @app.route("/engines", methods=["GET"])
    def _engines(self, request: IRequest) -> bytes:
        return json_response(request, 200, [self._summary(h) for h in self.registry])

    @app.route("/health", methods=["GET"])
    def _health(self, request: IRequest) -> bytes:
        engines = [self._summary(h) for h in self.registry]
        residency = self.residency.snapshot()
        degraded = any(e["process"] == "failed" or h.unresponsive for e, h in zip(engines, self.registry))
        return json_response(
            request,
            200,
            {
                "status": "degraded" if degraded else "ok",
                "version": __version__,
                "contract": self.contract_version,
                "engines": engines,
                "residency": {key: residency[key] for key in ("resident", "max", "waiting")},
            },
        )

    @app.route(METRICS, methods=["GET"])
    def _metrics(self, request: IRequest) -> bytes:
        # Rendered here, on the reactor thread: the collector reads the core's own state.
        if not (self.metrics_public or getattr(request, "guarded", False)):
            return error_response(request, Forbidden("/metrics reached without passing the management guard"))
        request.setHeader(b"Content-Type", METRICS_TYPE)
        return self.metrics.render()

    @app.route("/residency", methods=["GET"])
    def _residency(self, request: IRequest) -> bytes:
        # The core's own state: spawns nothing, loads nothing, waits on no worker.
        return json_response(request, 200, self.residency.snapshot())

    @app.route(_UNLOAD, methods=["POST"])
    async def _unload(self, request: IRequest, engine_id: str) -> Any:
        async def handle() -> bytes:
            self._require_guard(request)
            engine = self.registry.get(engine_id)
            raw = request.args.get(b"mode", [b"terminate"])[0]
            if self.uploads.get(engine.id):
                # As for a stream (section 3): cutting it off would cost its caller the
                # upload for a reason it could not have predicted.
                raise Conflict(
                    f'engine "{engine.id}" is receiving a voice upload; unload it once that has finished'
                )
            await self.residency.unload(engine.id, raw.decode("utf-8", "replace")[:20])
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

    @app.route(_VOICES, methods=["GET"])
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
        finished = request.notifyFinish()  # type: ignore[attr-defined]

        async def handle() -> Any:
            contract.check_voice_id(voice_id, "voice")
            engine = self.registry.get(engine_id)
            caps = await engine.capabilities()
            variant = engine.effective_variant(None, self._resident(engine))
            # A preview speaks: an unknown voice is refused before it costs a load.
            await self._check_voices(engine, {"voice": voice_id, "variant": variant})
            return await self.speech.preview(request, finished, engine, voice_id, caps, variant)

        return await self._answer(request, handle)

    # -- managing voices (guarded at the headers, see _admission) ------------------------------

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

    @staticmethod
    def _require_guard(request: IRequest) -> None:
        # The guard runs at the headers (_admission); a management route reached any other
        # way refuses rather than runs unguarded.
        if not getattr(request, "guarded", False):
            raise Forbidden("management route reached without passing the management guard")

    @app.route(_VOICES, methods=["POST"])
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

    @app.route(_VOICE, methods=["DELETE"])
    async def _delete_voice(self, request: IRequest, engine_id: str, voice_id: str) -> Any:
        async def handle() -> bytes:
            self._require_guard(request)
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
            return await self._speech(request, finished, body["engine"], body, "/speak", forward_speak)

        return await self._answer(request, handle)

    @app.route(_DIALOGUE, methods=["POST"])
    async def _dialogue(self, request: IRequest, engine_id: str) -> Any:
        finished = request.notifyFinish()  # type: ignore[attr-defined]

        async def handle() -> Any:
            body = _body(request, contract.PUBLIC_DIALOGUE_REQUEST)
            return await self._speech(request, finished, engine_id, body, "/dialogue", forward_dialogue)

        return await self._answer(request, handle)

    async def _speech(
        self,
        request: IRequest,
        finished: Any,
        engine_id: str,
        body: dict[str, Any],
        path: str,
        forward: Callable[[dict[str, Any], dict[str, Any], str], dict[str, Any]],
        *,
        sse: bool = False,
        route: str | None = None,
    ) -> Any:
        """
        What /speak and dialogue share (and every translation into them): the effective
        variant (section 4's rule), every check that can refuse before a lease
        (preflight), then the speech relay; with C{sse}, a stream goes out as OpenAI's
        server-sent audio events.  Measured as one request on C{route} (by default
        the request's own C{metrics_route}, else the path's).
        """
        route = route or getattr(request, "metrics_route", None) or path.strip("/")
        measured = self.metrics.begin(route, engine_id)
        try:
            engine = self.registry.get(engine_id)
            caps = await engine.capabilities()
            variant = engine.effective_variant(body.get("variant"), self._resident(engine))
            forwarded = forward(body, caps, variant)
            await self._check_voices(engine, forwarded)
            answer = await self.speech.dispatch(
                request, finished, engine, path, forwarded, caps, body.get("keepAliveSeconds"),
                sse=sse, measured=measured,
            )
        except CancelledError:
            measured.end("cancelled")
            raise
        except Exception as exc:
            measured.end(as_speech_error(exc).code)
            raise
        measured.end("ok")
        return answer

    async def _check_voices(self, engine: EngineHandle, forward: dict[str, Any]) -> None:
        """
        Ask the worker whether the voices a request names exist, when finding out at
        the worker would first cost a load: a model that is already resident in the
        variant asked for loses nothing, and its worker refuses an unknown voice itself.
        """
        wanted = voices_to_check(forward)
        model = self.residency.state(engine.id)
        if not wanted or (model["resident"] and model["variant"] == forward["variant"]):
            return
        client = await engine.ready()
        code, voices = await client.json(b"GET", "/voices")
        if code != 200 or not isinstance(voices, list):
            return  # the worker will say, once it has its model
        known = {voice.get("id") for voice in voices if isinstance(voice, dict)}
        for field, voice_id in wanted.items():
            if voice_id not in known:
                raise UnknownVoice(f'no voice "{voice_id}"', field=field)

    # -- the translations on top (protocol.md sections 11 and 12, and the peer's modes) ---

    @app.route(OPENAI_SPEECH, methods=["POST"])
    async def _openai_speech(self, request: IRequest) -> Any:
        return await self.openai.speech(request)

    @app.route(OPENAI_BATCH, methods=["POST"])
    async def _openai_batch(self, request: IRequest) -> Any:
        return await self.openai.batch(request)

    @app.route(OPENAI_STREAM, methods=["GET"])
    def _openai_stream(self, request: IRequest) -> Any:
        return self.streams.resource()

    @app.route("/v1/models", methods=["GET"])
    async def _openai_models(self, request: IRequest) -> Any:
        return await self.openai.models(request)

    @app.route("/v1/models/<string:model_id>", methods=["GET"])
    async def _openai_model(self, request: IRequest, model_id: str) -> Any:
        return await self.openai.model(request, model_id)

    @app.route("/v1/audio/models", methods=["GET"])
    async def _openai_audio_models(self, request: IRequest) -> Any:
        return await self.openai.audio_models(request)

    @app.route("/v1/audio/voices", methods=["GET"])
    async def _openai_voices(self, request: IRequest) -> Any:
        return await self.openai.voices(request)

    @app.route(MCP, methods=["POST"])
    async def _mcp(self, request: IRequest) -> Any:
        return await self.mcp.post(request)

    # -- the catalog (protocol.md section 10): open to everybody, it only reads --------

    @app.route("/catalog", methods=["GET"])
    def _catalog(self, request: IRequest) -> bytes:
        return json_response(request, 200, self.catalog.entries())

    # -- settings (protocol.md section 10): guarded at their heads, reading included ----

    def _settings_or_refuse(self, request: IRequest) -> Settings:
        self._require_guard(request)
        if self.settings_api is None:
            raise Unsupported("this server has no state database to keep settings in (it was started without a config file)")
        return self.settings_api

    @app.route("/settings", methods=["GET"])
    async def _get_settings(self, request: IRequest) -> Any:
        async def handle() -> bytes:
            return json_response(request, 200, self._settings_or_refuse(request).document())

        return await self._answer(request, handle)

    @app.route("/settings", methods=["PATCH"])
    async def _patch_settings(self, request: IRequest) -> Any:
        async def handle() -> bytes:
            settings = self._settings_or_refuse(request)
            request.content.seek(0)
            document = await settings.patch(read_patch(request.content.read()), caller_of(request))
            return json_response(request, 200, document)

        return await self._answer(request, handle)

    # -- installing (protocol.md section 10): guarded at their heads --------------------

    def _installer_or_refuse(self, request: IRequest) -> Installer:
        self._require_guard(request)
        if self.installer is None:
            raise Unsupported("this server cannot install engines (it was started without a state database)")
        return self.installer

    def _job_answer(self, request: IRequest, document: dict[str, Any]) -> bytes:
        request.setHeader(b"Location", f"/installs/{document['id']}".encode())
        return json_response(request, 202, document)

    @app.route(_INSTALL, methods=["POST"])
    async def _install(self, request: IRequest, engine_id: str) -> Any:
        async def handle() -> bytes:
            installer = self._installer_or_refuse(request)
            query = install_query(request.args or {}, ("pull", "accept"))
            job = installer.install(engine_id, query["pull"], query["accept"])
            return self._job_answer(request, job.document())

        return await self._answer(request, handle)

    @app.route(_REINSTALL, methods=["POST"])
    async def _reinstall(self, request: IRequest, engine_id: str) -> Any:
        async def handle() -> bytes:
            installer = self._installer_or_refuse(request)
            query = install_query(request.args or {}, ("accept",))
            return self._job_answer(request, installer.reinstall(engine_id, query["accept"]).document())

        return await self._answer(request, handle)

    @app.route(_OUTDATED, methods=["POST"])
    async def _outdated(self, request: IRequest) -> Any:
        async def handle() -> bytes:
            installer = self._installer_or_refuse(request)
            install_query(request.args or {}, ())
            return json_response(request, 202, installer.outdated())

        return await self._answer(request, handle)

    @app.route(_PULL, methods=["POST"])
    async def _pull(self, request: IRequest, engine_id: str) -> Any:
        async def handle() -> bytes:
            installer = self._installer_or_refuse(request)
            request.content.seek(0)
            try:
                body = json.loads(request.content.read() or b"null")
            except ValueError as error:
                raise BadRequest(f"the body is not JSON: {error}", field="body") from None
            return self._job_answer(request, installer.pull(engine_id, body).document())

        return await self._answer(request, handle)

    @app.route(_ENGINE, methods=["DELETE"])
    async def _uninstall(self, request: IRequest, engine_id: str) -> Any:
        async def handle() -> bytes:
            installer = self._installer_or_refuse(request)
            await installer.uninstall(engine_id)
            request.setResponseCode(204)
            return b""

        return await self._answer(request, handle)

    @app.route(_JOBS, methods=["GET"])
    async def _jobs(self, request: IRequest) -> Any:
        async def handle() -> bytes:
            self._require_guard(request)
            return json_response(request, 200, self.jobs.documents(self.jobs.all()))

        return await self._answer(request, handle)

    @app.route(_JOB, methods=["GET"])
    async def _job(self, request: IRequest, job_id: str) -> Any:
        async def handle() -> bytes:
            self._require_guard(request)
            return json_response(request, 200, self.jobs.get(job_id).document())

        return await self._answer(request, handle)

    @app.route(_JOB_EVENTS, methods=["GET"])
    def _job_events(self, request: IRequest, job_id: str) -> Any:
        # Not through _answer: a stream that follows a job is not a request in flight
        # for a shutdown to wait on (the shutdown ends it).
        try:
            self._require_guard(request)
            job = self.jobs.get(job_id)
            cursor = last_event_id(request)
            return self.jobs.open_stream(request, job, cursor)
        except SpeechError as error:
            return error_response(request, error)

    # -- the update check (protocol.md section 9): open to every caller ----------------

    _updates: UpdateChecker | None = None

    @property
    def updates(self) -> UpdateChecker:
        """
        The update check: the service's, which reads C{update.check} live; by default
        (a core embedded without one) GitHub's on this reactor, on unless the
        environment turned it off.
        """
        if self._updates is None:
            self._updates = checker_for(self.reactor, __version__, RELEASES_URL, lambda: True)
        return self._updates

    @updates.setter
    def updates(self, checker: UpdateChecker) -> None:
        self._updates = checker

    @app.route(UPDATE, methods=["GET"])
    def _update(self, request: IRequest) -> bytes:
        # Never waits: at most it starts one check in the background.
        return json_response(request, 200, self.updates.status())

    @app.route(UPDATE_CHECK, methods=["POST"])
    async def _update_check(self, request: IRequest) -> Any:
        async def handle() -> bytes:
            request.content.seek(0)
            body = request.content.read().strip()
            if body and body != b"{}":
                raise BadRequest("POST /update/check takes no body", field="body")
            return json_response(request, 200, await self.updates.check_now())

        return await self._answer(request, handle)
