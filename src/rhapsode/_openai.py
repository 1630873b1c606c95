"""
The OpenAI shim (protocol.md section 11) and the discovery routes OpenAI's clients read.

C{POST /v1/audio/speech} is a translation into C{/speak} and nothing more: it builds the
native request and hands it to the router's own speech path, so the ceiling, the cue
stripping, the dial check, the residency lease and the rules for failing after the
headers are the ones C{/speak} applies.  What differs is the envelope: OpenAI's clients
parse only OpenAI's, so every refusal here is that shape, with the taxonomy's status
and code, and an C{x-should-retry} header that makes the official SDKs retry exactly
what the taxonomy calls retryable.

Two additions to section 11, because the clients people run send them: C{voice} may be
C{{"id": ...}} (the current SDK types it so), and C{stream_format: "sse"} is served for
pcm and wav as OpenAI defines it (LiveKit asks for it on every model but tts-1).

The discovery routes (C{/v1/models}, C{/v1/models/{id}}, C{/v1/audio/models},
C{/v1/audio/voices}) go beyond section 11, which waited for a client that needs them:
Open WebUI and Home Assistant's integration do.  They are open, like C{/engines}.

C{POST /v1/audio/speech/batch} is the peer API's batch: up to 32 items, each a buffered
C{/speak} run through the route in process, answered together.
"""

from __future__ import annotations

import base64
import json
import secrets
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from twisted.logger import Logger
from twisted.web.iweb import IRequest

from rhapsode_protocol import contract
from rhapsode_protocol.errors import Internal, SpeechError, UnknownEngine, Unsupported
from rhapsode_protocol.http.answers import answer, json_response
from rhapsode_protocol.schemas import MAX_NAME_CHARACTERS, MAX_TEXT_CHARACTERS
from rhapsode_protocol.validation import parse_json_body

from ._inprocess import InProcessRequest, run
from ._preflight import forward_speak
from ._relay import refusal

if TYPE_CHECKING:
    from ._registry import EngineHandle
    from ._router import CoreApp

__all__ = ["OpenAIShim", "openai_envelope", "should_retry"]

#: The formats an SSE stream carries: base64 of raw PCM or of a WAV, as OpenAI's does.
SSE_FORMATS = ("pcm", "wav")
#: The most items one batch carries.
BATCH_ITEMS = 32

_VOICE_OBJECT = {"type": "object", "properties": {"id": {"type": "string", "minLength": 1, "maxLength": MAX_NAME_CHARACTERS}}, "required": ["id"], "additionalProperties": False}

#: The fields of OpenAI's speech request that the shim knows; any other is bad_request.
_FIELDS: dict[str, Any] = {
    "input": {"type": "string", "maxLength": MAX_TEXT_CHARACTERS},
    "voice": {"type": ["string", "object"]},
    "response_format": {"type": "string", "minLength": 1, "maxLength": 16},
    "speed": {"type": "number", "minimum": 0, "maximum": 100},
    "instructions": {"type": "string", "maxLength": MAX_TEXT_CHARACTERS},
    "stream_format": {"type": "string", "enum": ["audio", "sse"]},
}
_MODEL = {"type": "string", "minLength": 1, "maxLength": 2 * MAX_NAME_CHARACTERS + 1}

SPEECH_REQUEST: dict[str, Any] = {
    "type": "object",
    "properties": {"model": _MODEL, **_FIELDS},
    "required": ["model", "input"],
    "additionalProperties": False,
}

_ITEM = {
    "type": "object",
    "properties": {k: v for k, v in _FIELDS.items() if k != "stream_format"},
    "required": ["input"],
    "additionalProperties": False,
}
BATCH_REQUEST: dict[str, Any] = {
    "type": "object",
    "properties": {
        "model": _MODEL,
        "items": {"type": "array", "items": _ITEM, "minItems": 1, "maxItems": BATCH_ITEMS},
        **{k: v for k, v in _FIELDS.items() if k not in ("input", "stream_format")},
    },
    "required": ["model", "items"],
    "additionalProperties": False,
}

#: The native field a refusal names, as the OpenAI request calls it.
_PARAM = {
    "engine": "model",
    "variant": "model",
    "text": "input",
    "format": "response_format",
    "params.speed": "speed",
    "voice": "voice",
}


def _param(field: str | None) -> str | None:
    if field is None or field in ("body", "path", "headers", "method"):
        return None
    return _PARAM.get(field, field)


def openai_envelope(error: SpeechError) -> dict[str, Any]:
    """
    C{error} in OpenAI's envelope: the taxonomy's code and retryable flag kept, the
    field it is about named as the OpenAI request names it (C{param}).
    """
    native = error.envelope()["error"]
    wrong = error.status < 500 and not error.retryable
    param = _param(error.field)
    message = native["message"]
    if param is not None and error.field != param:
        # The native request's name for the field, in a message to a client that sent
        # the OpenAI one.
        message = message.replace(f'"{error.field}"', f'"{param}"')
    return {
        "error": {
            "message": message,
            "type": "invalid_request_error" if wrong else "server_error",
            "param": param,
            "code": error.code,
            "retryable": error.retryable,
        }
    }


def should_retry(error: SpeechError) -> tuple[bytes, bytes]:
    """
    The header OpenAI's SDKs read before the status: without it they retry every 5xx
    (an internal error three times) and no 4xx but 408, 409 and 429.
    """
    return (b"x-should-retry", b"true" if error.retryable else b"false")


def render_error(request: IRequest, error: SpeechError) -> bytes:
    """
    Answer C{error} in OpenAI's envelope, with its status and headers and C{x-should-retry}.
    """
    for name, value in (*error.headers, should_retry(error)):
        request.setHeader(name, value)
    try:
        request.error_reason = f"{error.code}: {error.message}"  # type: ignore[attr-defined]
    except AttributeError:
        pass
    return json_response(request, error.status, openai_envelope(error))


def _voice(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, dict):
        contract.validate(_VOICE_OBJECT, value, path="voice")
        return str(value["id"])
    return str(value)


class OpenAIShim:
    """
    The OpenAI routes over a core's router (L{rhapsode._router.CoreApp}).
    """

    log = Logger()

    def __init__(self, core: "CoreApp") -> None:
        self.core = core
        #: When the models were first offered: OpenAI's C{created}, the core's start.
        self.created = int(core.reactor.seconds())

    async def _answer(self, request: IRequest, handler: Callable[[], Awaitable[Any]]) -> Any:
        requests = self.core.requests
        return await answer(request, handler, self.log, requests.enter, requests.leave, render_error)

    # -- translating ---------------------------------------------------------------------

    def resolve_model(self, model: str) -> tuple[str, str | None]:
        """
        The engine and variant C{model} names: an exact engine id first, so an id with a
        colon in it is still reachable, then C{engine:variant}, the longest engine id
        that leaves a variant first.

        @raise UnknownEngine: naming the engines there are (C{param} is C{model}).
        """
        registry = self.core.registry
        if model in registry:
            return model, None
        at = model.rfind(":")
        while at > 0:
            # The longest engine id first, as the exact id is tried first.
            if model[:at] in registry:
                return model[:at], model[at + 1 :]
            at = model.rfind(":", 0, at)
        known = ", ".join(handle.id for handle in registry) or "none"
        raise UnknownEngine(f'no engine "{model}" (engines: {known})', field="model")

    async def native(self, body: dict[str, Any], *, stream: bool) -> dict[str, Any]:
        """
        The C{/speak} body a checked OpenAI request becomes (section 11's table).

        @raise Unsupported: non-empty instructions, aac, or a speed other than 1 on a
            variant with no speed dial.
        """
        engine_id, variant = self.resolve_model(body["model"])
        fmt = body.get("response_format", "mp3")
        if fmt == "aac":
            raise Unsupported('response_format "aac" is not produced by any engine here', field="response_format")
        if body.get("instructions"):
            raise Unsupported("instructions are not supported: no engine here takes a spoken direction in prose",
                              field="instructions")
        native: dict[str, Any] = {"engine": engine_id, "text": body["input"], "format": fmt, "stream": stream}
        if variant is not None:
            native["variant"] = variant
        voice = _voice(body.get("voice"))
        if voice is not None:
            native["voice"] = voice
        speed = body.get("speed")
        if speed is not None and speed != 1:
            await self._check_speed(self.core.registry.get(engine_id), variant)
            native["params"] = {"speed": speed}
        contract.validate(contract.PUBLIC_SPEAK_REQUEST, native)
        return native

    async def _check_speed(self, engine: "EngineHandle", variant: str | None) -> None:
        caps = await engine.capabilities()
        effective = engine.effective_variant(variant, self.core._resident(engine))
        performs = caps.get("variants", {}).get(effective)
        if performs is not None and "speed" not in performs.get("dials", {}):
            raise Unsupported(f'variant "{effective}" of "{engine.id}" has no speed dial', field="speed")

    # -- POST /v1/audio/speech -------------------------------------------------------------

    async def speech(self, request: IRequest) -> Any:
        finished = request.notifyFinish()  # type: ignore[attr-defined]

        async def handle() -> Any:
            body = self._read(request, SPEECH_REQUEST)
            sse = body.get("stream_format") == "sse"
            native = await self.native(body, stream=True)
            if sse and native["format"] not in SSE_FORMATS:
                raise Unsupported(
                    f'stream_format "sse" carries pcm or wav, not "{native["format"]}"', field="stream_format"
                )
            return await self.core._speech(
                request, finished, native["engine"], native, "/speak", forward_speak, sse=sse, route="openai"
            )

        return await self._answer(request, handle)

    @staticmethod
    def _read(request: IRequest, schema: dict[str, Any]) -> dict[str, Any]:
        request.content.seek(0)
        raw = request.content.read()  # the site held it to the route's limit
        return parse_json_body(raw if raw.strip() else b"{}", schema)

    # -- POST /v1/audio/speech/batch -------------------------------------------------------

    async def batch(self, request: IRequest) -> Any:
        async def handle() -> bytes:
            body = self._read(request, BATCH_REQUEST)
            self.resolve_model(body["model"])  # an unknown model refuses the whole batch
            # The peer's default for a batch is wav (OpenAI's single request is mp3's).
            shared = {"response_format": "wav", **{k: v for k, v in body.items() if k != "items"}}
            results: list[dict[str, Any]] = []
            held: list[InProcessRequest] = []
            try:
                for index, item in enumerate(body["items"]):
                    results.append(await self._item(index, {**shared, **item}, held))
            finally:
                # Every item's audio stayed counted against the core's buffer budget
                # until the batch's answer was built: together they are bounded by it.
                for inner in held:
                    inner.finish()
            succeeded = sum(1 for result in results if result["status"] == "success")
            return json_response(request, 200, {
                "id": "speech-batch-" + secrets.token_hex(8),
                "results": results,
                "total": len(results),
                "succeeded": succeeded,
                "failed": len(results) - succeeded,
            })

        return await self._answer(request, handle)

    async def _item(self, index: int, item: dict[str, Any], held: list[InProcessRequest]) -> dict[str, Any]:
        try:
            native = await self.native(item, stream=False)
        except SpeechError as refused:
            return {"index": index, "status": "error", "error": openai_envelope(refused)["error"]}
        inner = InProcessRequest(b"POST", "/speak", native)
        inner.metrics_route = "batch"
        held.append(inner)
        answered = await run(self.core.speak, inner)
        if answered.code != 200:
            try:
                failed = refusal(answered.json()["error"], answered.code)
            except (ValueError, KeyError, TypeError):
                failed = Internal(f"/speak answered HTTP {answered.code} without an envelope")
            return {"index": index, "status": "error", "error": openai_envelope(failed)["error"]}
        return {
            "index": index,
            "status": "success",
            "audio_data": base64.b64encode(answered.body).decode("ascii"),
            "media_type": answered.content_type,
        }

    # -- discovery -------------------------------------------------------------------------

    async def _entries(self) -> list[dict[str, Any]]:
        """
        One model per configured engine, and one per C{engine:variant}.  Reading the
        variants may start an engine's worker (a process, never a model, section 3); an
        engine that cannot start is listed alone.
        """
        entries = []
        for handle in self.core.registry:
            entries.append(self._entry(handle.id))
            try:
                caps = await handle.capabilities()
            except SpeechError as error:
                self.log.warn("reading {engine}'s variants: {why}", engine=handle.id, why=error.message)
                continue
            for variant in caps.get("variants", {}):
                entries.append(self._entry(f"{handle.id}:{variant}"))
        return entries

    def _entry(self, model: str) -> dict[str, Any]:
        return {"id": model, "object": "model", "created": self.created, "owned_by": "rhapsode"}

    async def models(self, request: IRequest) -> Any:
        async def handle() -> bytes:
            return json_response(request, 200, {"object": "list", "data": await self._entries()})

        return await self._answer(request, handle)

    async def audio_models(self, request: IRequest) -> Any:
        async def handle() -> bytes:
            # Open WebUI reads "models" here, and "data" from /v1/models.
            entries = await self._entries()
            return json_response(request, 200, {"object": "list", "models": entries, "data": entries})

        return await self._answer(request, handle)

    async def model(self, request: IRequest, model_id: str) -> Any:
        async def handle() -> bytes:
            engine_id, variant = self.resolve_model(model_id)
            if variant is not None:
                caps = await self.core.registry.get(engine_id).capabilities()
                if variant not in caps.get("variants", {}):
                    known = ", ".join(f"{engine_id}:{v}" for v in caps.get("variants", {}))
                    raise UnknownEngine(f'no model "{model_id}" (models of {engine_id}: {known})', field="model")
            return json_response(request, 200, self._entry(model_id))

        return await self._answer(request, handle)

    async def voices(self, request: IRequest) -> Any:
        async def handle() -> bytes:
            wanted = request.args.get(b"model")
            if wanted:
                engines = [self.resolve_model(wanted[0].decode("utf-8", "replace"))[0]]
            else:
                engines = [handle.id for handle in self.core.registry]
            flat: list[dict[str, Any]] = []
            grouped: list[dict[str, Any]] = []
            seen: set[str] = set()
            for engine_id in engines:
                answered = await run(self.core._voices, InProcessRequest(b"GET", f"/engines/{engine_id}/voices"), engine_id)
                if answered.code != 200:
                    if wanted:
                        raise refusal(answered.json().get("error", {}), answered.code)
                    # One engine that cannot list its voices does not hide the others'.
                    self.log.warn("listing {engine}'s voices: HTTP {code}", engine=engine_id, code=answered.code)
                    continue
                listed = []
                for voice in answered.json():
                    entry = {"id": voice["id"], "name": voice.get("label", voice["id"])}
                    listed.append(entry)
                    if voice["id"] not in seen:
                        seen.add(voice["id"])
                        flat.append({**entry, "engine": engine_id, "tags": voice.get("tags", [])})
                grouped.append({"model": engine_id, "voices": listed})
            return json_response(request, 200, {"object": "list", "voices": flat, "data": grouped})

        return await self._answer(request, handle)
