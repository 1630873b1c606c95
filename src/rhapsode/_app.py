"""
The public API (protocol.md sections 4, 6 and 7): a Klein app that routes to workers and
streams their audio through.

It holds no engine knowledge.  It validates the public shapes, resolves the effective
variant from the variants it remembers (never from C{current}), strips cues the variant
does not claim and drops deliveries it does not perform, forwards without
C{keepAliveSeconds}, and relays the body with backpressure wired producer to consumer.
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable, Sequence

from klein import Klein
from twisted.internet.defer import CancelledError, Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import server
from twisted.web.iweb import IRequest
from werkzeug.exceptions import MethodNotAllowed, NotFound

from rhapsode_worker import contract
from rhapsode_worker._errors import (
    BadRequest,
    Forbidden,
    Internal,
    SpeechError,
)
from rhapsode_worker._http import (
    DURATION_HEADER,
    HandlerResource,
    InFlight,
    abort_connection,
    answer_failure,
    json_response,
    no_route,
    read_json,
    write_trailer,
)
from rhapsode_worker._vocab import clean_text

from . import __version__
from ._config import Config
from ._gate import CoreRequest, CoreSite
from ._proxy import FLOOR_BYTES, collect, relay
from ._registry import EngineHandle, Registry
from ._residency import ConfigSettings, IResidencySettings, Residency
from ._workers import BytesProducer

#: A buffered body is at most a request's ceiling of audio; this bounds a runaway one.
_BUFFERED_LIMIT = 512 * 1024 * 1024
_ERROR_LIMIT = 64 * 1024
_JSON_LIMIT = 1024 * 1024


def _body(request: IRequest, schema: dict[str, Any]) -> dict[str, Any]:
    return read_json(request, schema, _JSON_LIMIT)


def _duration_ms(fmt: str, native: dict[str, Any], byte_count: int) -> int | None:
    """
    What a streamed body's bytes say about its length, where the format lets the core
    count (pcm, and wav past its 44-byte header); None for compressed formats.
    """
    frame = 2 * int(native.get("channels", 1))
    rate = int(native.get("sampleRate", 0))
    if not rate:
        return None
    if fmt == "pcm":
        return (byte_count // frame) * 1000 // rate
    if fmt == "wav":
        return (max(byte_count - 44, 0) // frame) * 1000 // rate
    return None


#: Without settings of its own, an app reads the defaults (built once: a Config works
#: out its default paths when made).
_DEFAULT_CONFIG = Config()
_DEFAULT_SETTINGS = ConfigSettings(lambda: _DEFAULT_CONFIG)


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
    ) -> None:
        self.registry = registry
        self.residency = Residency(
            clock=reactor,
            settings=settings or _DEFAULT_SETTINGS,
            terminate=lambda engine: registry.get(engine).terminate(),
            unload=lambda engine: registry.get(engine).unload(),
        )
        self.reactor = reactor
        self.contract_version = contract_version
        self.management_token = management_token
        self.management_origins = tuple(management_origins)
        self.requests = InFlight()
        self._background: set[Deferred[None]] = set()
        self._measuring: set[str] = set()

    def close(self) -> None:
        """
        Shutting down: stop keep-alive timers and any measurement still in flight.
        """
        for task in list(self._background):
            task.cancel()
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
                return await self._buffered(request, response, None)
            finally:
                lease.release()

        return await self._answer(request, handle)

    # -- managing voices (guarded at the headers, see _gate) ------------------------------

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
        # The guard runs at the headers (_gate); a management route reached any other
        # way refuses rather than runs unguarded.
        if not getattr(request, "guarded", False):
            raise Forbidden("management route reached without passing the management guard")

    @app.route("/engines/<string:engine_id>/voices", methods=["POST"])
    async def _create_voice(self, request: IRequest, engine_id: str) -> Any:
        async def handle() -> bytes:
            self._require_guard(request)
            upstream = getattr(request, "upstream", None)
            if upstream is None:
                raise Internal("voice uploads need the core's own site (rhapsode._gate.CoreSite)")
            response = await upstream
            raw = await collect(response, _ERROR_LIMIT)
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
            return await self._dispatch(
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
            return await self._dispatch(
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

    async def _dispatch(
        self,
        request: IRequest,
        finished: Any,
        engine: EngineHandle,
        path: str,
        forward: dict[str, Any],
        caps: dict[str, Any],
        keep_alive: int | None,
    ) -> Any:
        """
        Take a lease on the model for as long as the answer streams, then speak.
        """
        variant = forward["variant"]
        lease = await self.residency.acquire(engine.id, variant, keep_alive)
        try:
            client = await engine.ready()
            pending = client.request(
                b"POST", path, BytesProducer(json.dumps(forward).encode()),
                {b"Content-Type": [b"application/json"]},
            )
            # A client that hangs up before the worker answers cancels the upstream request.
            finished.addErrback(lambda _: pending.cancel())
            response = await pending
            if response.code != 200:
                return await self._relay_error(request, response)
            if not self.residency.state(engine.id).get("measured", True) and engine.id not in self._measuring:
                # Once per load: a worker that could not measure it is not asked again.
                self._measuring.add(engine.id)
                task = Deferred.fromCoroutine(self._measure(engine, variant))
                self._background.add(task)

                def measured(_: object) -> None:
                    self._background.discard(task)
                    self._measuring.discard(engine.id)

                task.addBoth(measured)
            fmt = forward.get("format", "wav")
            if not forward.get("stream", True):
                return await self._buffered(request, response, fmt)
            return await self._streamed(request, finished, response, fmt, caps)
        finally:
            lease.release()

    async def _measure(self, engine: EngineHandle, variant: str) -> None:
        """
        Record what the load cost, from the worker's own measurement; best effort, off
        the request's path.
        """
        try:
            code, health = await engine.client.json(b"GET", "/health")
        except (Exception, CancelledError):
            return
        if code == 200 and isinstance(health, dict) and health.get("variant") == variant:
            # Recorded even when absent: the worker had nothing to say about this load.
            self.residency.record_size(engine.id, variant, health.get("modelBytes"))

    async def _relay_error(self, request: IRequest, response: Any) -> bytes:
        raw = await collect(response, _ERROR_LIMIT)
        try:
            envelope = json.loads(raw)
            contract.validate(contract.ERROR, envelope)
        except (ValueError, SpeechError):
            raise Internal(f"worker answered {response.code} without an error envelope") from None
        request.setResponseCode(response.code)
        request.setHeader(b"Content-Type", b"application/json")
        return raw

    async def _buffered(self, request: IRequest, response: Any, fmt: str | None) -> bytes:
        if response.code != 200:
            return await self._relay_error(request, response)
        body = await collect(response, _BUFFERED_LIMIT)
        if len(body) < FLOOR_BYTES:
            # Not audio, whatever the status said; the headers have not gone, so say so.
            raise Internal(f"the worker answered 200 with {len(body)} bytes, which is not audio")
        headers = response.headers
        request.setResponseCode(200)
        for name in (b"Content-Type", DURATION_HEADER):
            value = headers.getRawHeaders(name)
            if value:
                request.setHeader(name, value[0])
        request.setHeader(b"Content-Length", b"%d" % len(body))
        return body

    async def _streamed(
        self, request: IRequest, finished: Any, response: Any, fmt: str, caps: dict[str, Any]
    ) -> Any:
        request.setResponseCode(200)
        content_type = response.headers.getRawHeaders(b"Content-Type")
        if content_type:
            request.setHeader(b"Content-Type", content_type[0])
        request.setHeader(b"Trailer", DURATION_HEADER)
        try:
            stream = await relay(response, request)
        except Exception:
            abort_connection(request)
            await _settled(finished)
            return None
        received = stream.received
        if received < FLOOR_BYTES:
            # Too late for an envelope: the status is on the wire.  An abort is the only
            # way left to say this was not audio.
            self.log.warn("aborting a {n}-byte stream: under the floor", n=received)
            abort_connection(request)
            await _settled(finished)
            return None
        # The worker's own trailer is authoritative (it counted the PCM); where it cannot
        # be read, pcm and wav can still be counted from the bytes.
        told = stream.trailers.get(DURATION_HEADER.lower(), b"")
        duration = int(told) if told.isdigit() else _duration_ms(fmt, caps.get("nativeFormat", {}), received)
        write_trailer(request, duration)
        return None


async def _settled(finished: Any) -> None:
    """
    Wait for the client connection's end to land before Klein looks at the request.
    """
    try:
        await finished
    except Exception:
        pass
