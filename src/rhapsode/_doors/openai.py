"""
The OpenAI shim (protocol.md section 11) and the discovery routes OpenAI's clients read.

C{POST /v1/audio/speech} is a translation into C{/speak} and nothing more: it builds the
native request (L{rhapsode._speech.translate}) and hands it to the speech service
(L{ISpeech}) with an HTTP sink, so the ceiling, the cue stripping, the dial check, the
residency lease and the rules for failing after the headers are the ones C{/speak}
applies.  What differs is the envelope: OpenAI's clients
parse only OpenAI's, so every refusal here is that shape, with the taxonomy's status
and code, and an C{x-should-retry} header that makes the official SDKs retry exactly
what the taxonomy calls retryable.

Additions to section 11, because the clients people run send them: C{voice} may be
C{{"id": ...}} (the current SDK types it so), and C{stream_format: "sse"} is served in
every format as OpenAI's is, each delta the base64 of the encoded bytes as they come
(LiveKit asks for it on every model but tts-1, in mp3 by default); C{sample_rate}, as
vLLM-Omni has it, asks the worker's encoder to resample.

The discovery routes (C{/v1/models}, C{/v1/models/{id}}, C{/v1/audio/models},
C{/v1/audio/voices}) go beyond section 11, which waited for a client that needs them:
Open WebUI and Home Assistant's integration do.  They are open, like C{/engines}.

C{POST /v1/audio/speech/batch} is the peer API's batch: up to 32 items, each a buffered
utterance spoken into memory (L{MemorySink}), answered together.  The whole answer counts
against the core's buffer budget until it has left the process: each item's audio while it
is spoken, then its base64 (a third larger) in the JSON that carries it, which is written in
pieces rather than built as one string.  A batch whose next piece the budget has no room
for is refused whole, as overloaded with a C{Retry-After}, never answered in part.

C{POST /dev/captioned_speech} is Kokoro-FastAPI's captioned speech, for the clients
written for it: its request (OpenAI's, with C{stream} and C{return_timestamps}, both
true by default) and its answer (L{CaptionedSink}), with word timings from whichever
engine the model names, where its variant times words (protocol.md section 4).
OpenAI's own route has no such field, and keeps OpenAI's shape.
"""

from __future__ import annotations

import json
import secrets
from collections import deque
from typing import Any, Awaitable, Callable, Iterator

from twisted.internet.defer import CancelledError
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.web.iweb import IRequest

from rhapsode_protocol.errors import BadRequest, SpeechError, UnknownEngine, Unsupported, as_speech_error, refusal
from rhapsode_protocol.http.answers import InFlight, answer, json_response
from rhapsode_protocol.schemas import OPENAI_BATCH_REQUEST, OPENAI_SPEECH_REQUEST
from rhapsode_protocol.validation import parse_json_body

from .._fleet.registry import Registry
from .._http.envelopes import openai_envelope, render_error
from .._http.sinks import CaptionedSink, HttpSink, SseSink, when_delivered, write_pieces
from .._interfaces import IAudioSink, IClientSettings, IPublicRoutes, ISpeech, Utterance
from .._speech.inprocess import MemorySink, base64_pieces, base64_size
from .._speech.limits import BufferBudget, BufferFull, Hold
from .._speech.service import aliases_of
from .._speech.translate import OpenAITranslation

__all__ = ["CAPTIONED_SPEECH_REQUEST", "OpenAIShim"]


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode("utf-8")


def _draining(pieces: "deque[bytes]") -> Iterator[bytes]:
    # Each piece is let go of as it is written: the socket then holds the only copy.
    while pieces:
        yield pieces.popleft()

#: Kokoro-FastAPI's normalisation defaults: what its clients send unless told otherwise.
#: Engines here normalise text their own way, so only these are taken.
_NORMALISATION = {
    "normalize": True,
    "unit_normalization": False,
    "url_normalization": True,
    "email_normalization": True,
    "optional_pluralization_normalization": True,
    "phone_normalization": True,
    "replace_remaining_symbols": True,
}
#: Kokoro's language letters, as the languages engines here list them.
_LANG_CODES = {
    "a": "en-us", "b": "en-gb", "e": "es", "f": "fr-fr", "h": "hi", "i": "it", "j": "ja", "p": "pt-br", "z": "cmn",
}
_SPEECH = OPENAI_SPEECH_REQUEST["properties"]

#: Kokoro-FastAPI's CaptionedSpeechRequest: the fields its clients send.
CAPTIONED_SPEECH_REQUEST: dict[str, Any] = {
    "type": "object",
    "properties": {
        **{k: _SPEECH[k] for k in ("model", "input", "voice", "response_format", "speed")},
        "stream": {"type": "boolean"},
        "return_timestamps": {"type": "boolean"},
        "return_download_link": {"type": "boolean"},
        "lang_code": {"type": ["string", "null"], "maxLength": 8},
        "volume_multiplier": {"type": ["number", "null"]},
        "normalization_options": {
            "type": ["object", "null"],
            "properties": {name: {"type": "boolean"} for name in _NORMALISATION},
            "additionalProperties": False,
        },
    },
    "required": ["input"],
    "additionalProperties": False,
}


class OpenAIShim:
    """
    The OpenAI routes over the speech service, the public reads and the registry of
    engines the models name.
    """

    log = Logger()

    def __init__(
        self,
        *,
        registry: Registry,
        speech: ISpeech,
        routes: IPublicRoutes,
        translation: OpenAITranslation,
        requests: InFlight,
        clock: IReactorTime,
        budget: BufferBudget,
        clients: IClientSettings | None = None,
    ) -> None:
        """
        @param clients: the operator's voice aliases, which the voice list shows as
            aliases beside each engine's voices.
        """
        self.registry = registry
        self.clients = clients
        self.speech = speech
        self.routes = routes
        self.translation = translation
        self.requests = requests
        self.budget = budget
        #: When the models were first offered: OpenAI's C{created}, the core's start.
        self.created = int(clock.seconds())

    def handlers(self) -> dict[str, Callable[..., Any]]:
        """
        The handlers of the table's OpenAI routes, by name.
        """
        return {
            "openai_speech": self.speech_route,
            "openai_batch": self.batch,
            "captioned_speech": self.captioned_speech,
            "openai_models": self.models,
            "openai_model": self.model,
            "openai_audio_models": self.audio_models,
            "openai_voices": self.voices,
        }

    async def _answer(self, request: IRequest, handler: Callable[[], Awaitable[Any]]) -> Any:
        return await answer(request, handler, self.log, self.requests.enter, self.requests.leave, render_error)

    # -- POST /v1/audio/speech -------------------------------------------------------------

    async def speech_route(self, request: IRequest) -> Any:
        # Both made now: a sink takes the request's notifyFinish at the route's start.
        raw, events = HttpSink(request), SseSink(request)

        async def handle() -> None:
            body = self._read(request, OPENAI_SPEECH_REQUEST)
            native = await self.translation.native(body, stream=True)
            # Any format: a delta is the base64 of whatever encoded bytes came, as
            # OpenAI's own are (an mp3 or aac stream is cut between frames or inside one).
            sink: IAudioSink = events if body.get("stream_format") == "sse" else raw
            await self.speech.speak(sink, Utterance(native["engine"], native, route="openai"))

        return await self._answer(request, handle)

    # -- POST /dev/captioned_speech (Kokoro-FastAPI's) ----------------------------------

    async def captioned_speech(self, request: IRequest) -> Any:
        finished = HttpSink(request).finished  # the route's own, taken at its start

        async def handle() -> None:
            body = self._read(request, CAPTIONED_SPEECH_REQUEST)
            stream = body.get("stream", True)
            timed = body.get("return_timestamps", True)
            if body.get("return_download_link"):
                raise Unsupported("no download links: the answer holds the audio", field="return_download_link")
            if body.get("volume_multiplier") not in (None, 1, 1.0):
                raise Unsupported("volume_multiplier other than 1 is not applied here", field="volume_multiplier")
            options = body.get("normalization_options") or {}
            for name, value in options.items():
                if value != _NORMALISATION[name]:
                    raise Unsupported(
                        f"{name} cannot be changed: engines here normalise text their own way",
                        field=f"normalization_options.{name}",
                    )
            fields: dict[str, Any] = {k: body[k] for k in ("model", "input", "voice", "response_format", "speed") if k in body}
            fields.setdefault("model", "kokoro")  # Kokoro-FastAPI's default
            native = await self.translation.native(fields, stream=stream)
            code = body.get("lang_code")
            if code is not None:
                if code not in _LANG_CODES:
                    raise BadRequest(f'lang_code "{code}" is none of {", ".join(_LANG_CODES)}', field="lang_code")
                native["language"] = _LANG_CODES[code]
            if timed:
                native["timestamps"] = "word"
            sink = CaptionedSink(request, stream, timed, finished)
            await self.speech.speak(sink, Utterance(native["engine"], native, route="openai"))

        return await self._answer(request, handle)

    @staticmethod
    def _read(request: IRequest, schema: dict[str, Any]) -> dict[str, Any]:
        request.content.seek(0)
        raw = request.content.read()  # the site held it to the route's limit
        return parse_json_body(raw if raw.strip() else b"{}", schema)

    # -- POST /v1/audio/speech/batch -------------------------------------------------------

    async def batch(self, request: IRequest) -> Any:
        # Asked for now: what the answer holds is given back once it has left the process.
        hold = self.budget.hold()
        when_delivered(request).addBoth(lambda _: hold.release())

        async def handle() -> None:
            try:
                await self._batch(request, hold)
            except BaseException:
                hold.release()  # a refusal carries no audio
                raise

        return await self._answer(request, handle)

    async def _batch(self, request: IRequest, hold: Hold) -> None:
        body = self._read(request, OPENAI_BATCH_REQUEST)
        self.translation.resolve_model(body["model"])  # an unknown model refuses the whole batch
        # The peer's default for a batch is wav (OpenAI's single request is mp3's).
        shared = {"response_format": "wav", **{k: v for k, v in body.items() if k != "items"}}
        results: list[list[bytes]] = []
        succeeded = 0
        for index, item in enumerate(body["items"]):
            pieces, ok = await self._item(index, {**shared, **item}, hold)
            results.append(pieces)
            succeeded += ok
        head = b'{"id":"speech-batch-%s","results":[' % secrets.token_hex(8).encode("ascii")
        tail = _dumps({"total": len(results), "succeeded": succeeded, "failed": len(results) - succeeded})
        answer = [head]
        for index, pieces in enumerate(results):
            if index:
                answer.append(b",")
            answer.extend(pieces)
        answer += [b"],", tail[1:]]
        results.clear()
        size = sum(map(len, answer))
        # The items' pieces are held already; the JSON around them is the rest.
        hold.take(size - hold.size)
        request.setResponseCode(200)
        request.setHeader(b"Content-Type", b"application/json")
        request.setHeader(b"Content-Length", b"%d" % size)
        queue = deque(answer)
        del answer
        await write_pieces(request, _draining(queue))

    async def _item(self, index: int, item: dict[str, Any], hold: Hold) -> tuple[list[bytes], bool]:
        """
        One item's result as pieces of JSON, and whether it succeeded: its audio in
        base64, taken from the budget before it is encoded and held by C{hold}; its raw
        audio is given back once it is encoded.

        @raise BufferFull: the budget has no room for the item's audio or its base64.
        """
        sink = MemorySink()
        try:
            try:
                native = await self.translation.native(item, stream=False)
                await self.speech.speak(sink, Utterance(native["engine"], native, route="batch"))
            except (CancelledError, BufferFull):
                raise
            except Exception as exc:
                refused = as_speech_error(exc)
                if refused.code == "internal":
                    self.log.failure("batch item {index} failed", index=index)
                error = _dumps({"index": index, "status": "error", "error": openai_envelope(refused)["error"]})
                hold.take(len(error))
                return [error], False
            answered = sink.answer
            opening = b'{"index":%d,"status":"success","audio_data":"' % index
            closing = b'","media_type":' + _dumps(answered.content_type) + b"}"
            # Base64's alphabet needs no escaping in a JSON string.
            hold.take(len(opening) + base64_size(answered.size) + len(closing))
            return [opening, *base64_pieces(answered.pieces), closing], True
        finally:
            sink.release()

    # -- discovery -------------------------------------------------------------------------

    async def _entries(self) -> list[dict[str, Any]]:
        """
        One model per configured engine, and one per C{engine:variant}.  Reading the
        variants may start an engine's worker (a process, never a model, section 3); an
        engine that cannot start is listed alone.
        """
        entries = []
        for handle in self.registry:
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
            engine_id, variant = self.translation.resolve_model(model_id)
            if variant is not None:
                caps = await self.registry.get(engine_id).capabilities()
                if variant not in caps.get("variants", {}):
                    known = ", ".join(f"{engine_id}:{v}" for v in caps.get("variants", {}))
                    raise UnknownEngine(f'no model "{model_id}" (models of {engine_id}: {known})', field="model")
            return json_response(request, 200, self._entry(model_id))

        return await self._answer(request, handle)

    async def voices(self, request: IRequest) -> Any:
        """
        C{GET /v1/audio/voices}: every engine's voices, or those of the engine
        C{?model=} names, and the operator's aliases, each marked as one.

        Open WebUI (0.12.4) asks with no model and puts C{voices} in one list, so where
        more than one engine is listed each name says its engine: a voice picked for
        the wrong model is then a refusal that names the model's voices, and the list
        said so first.
        """

        async def handle() -> bytes:
            wanted = request.args.get(b"model")
            if wanted:
                engines = [self.translation.resolve_model(wanted[0].decode("utf-8", "replace"))[0]]
            else:
                engines = [handle.id for handle in self.registry]
            flat: list[dict[str, Any]] = []
            grouped: list[dict[str, Any]] = []
            seen: set[str] = set()
            for engine_id in engines:
                try:
                    code, voices = await self.routes.voices(engine_id)
                except SpeechError as error:
                    if wanted:
                        raise
                    code, voices = error.status, None
                if code != 200 or not isinstance(voices, list):
                    if wanted:
                        raise refusal(voices.get("error", {}) if isinstance(voices, dict) else {}, code)
                    # One engine that cannot list its voices does not hide the others'.
                    self.log.warn("listing {engine}'s voices: HTTP {code}", engine=engine_id, code=code)
                    continue
                named = len(engines) > 1
                listed = []
                for voice in voices:
                    label = voice.get("label", voice["id"])
                    entry = {"id": voice["id"], "name": f"{label} ({engine_id})" if named else label}
                    listed.append(entry)
                    if voice["id"] not in seen:
                        seen.add(voice["id"])
                        flat.append({**entry, "engine": engine_id, "tags": voice.get("tags", [])})
                for alias, voice_id in sorted(aliases_of(self.clients, engine_id).items()):
                    entry = {"id": alias, "name": f"{alias}: alias of {engine_id}:{voice_id}", "alias_of": voice_id}
                    listed.append(entry)
                    if alias not in seen:
                        seen.add(alias)
                        flat.append({**entry, "engine": engine_id, "tags": ["alias"]})
                grouped.append({"model": engine_id, "voices": listed})
            return json_response(request, 200, {"object": "list", "voices": flat, "data": grouped})

        return await self._answer(request, handle)
