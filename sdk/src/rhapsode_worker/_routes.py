"""
The worker's HTTP face (protocol.md sections 1, 3, 4, 6, 7): the engine-scoped routes,
validation before an adapter sees anything, and audio that streams with backpressure.

Everything here runs on the reactor thread and never blocks: adapter calls go to the
scheduler's synthesis pool (model work) or the reactor's thread pool (voice files).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import replace
from functools import partial
from pathlib import PurePath
from typing import Any, AsyncIterator, Callable, Iterator, Mapping, NamedTuple, Sequence, cast

from klein import Klein
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest
from werkzeug.exceptions import MethodNotAllowed, NotFound

from rhapsode_protocol import contract
from rhapsode_protocol.errors import (
    BadRequest,
    SpeechError,
    UnknownVoice,
    Unsupported,
)
from rhapsode_protocol.http.answers import (
    DURATION_HEADER,
    abort_connection,
    answer,
    json_response,
    no_route,
    read_json,
    write_trailer,
)
from rhapsode_protocol.http.form import read_form
from rhapsode_protocol.http.site import DirectSite, HandlerResource, Routes, gathered
from rhapsode_protocol.text import Piece, split_pieces
from rhapsode_protocol.validation import check_instructions, check_sample_rate, choose_language
from rhapsode_protocol.vocab import clean_text, clean_text_mapped, is_speakable

from . import _memory
from ._blend import parse_blend
from ._encode import Blocking, content_type, make_encoder, pcm16_from_f32le
from ._engine import (
    Dial,
    DialogueRequest,
    IEngine,
    Reference,
    SpeakRequest,
    Speed,
    Timing,
    Turn,
    Variant,
    Voice,
    overrides,
)
from ._lifecycle import WorkerLifecycle
from ._model import ModelState
from ._schedule import SEND_BUFFER_BYTES, Job, ReactorStep, Scheduler, Step
from ._timing import Framing, LazyMap, Source, Timeline, framing_for

#: A voice upload's cap (protocol.md section 7), refused at the head when declared and
#: as it arrives when chunked (rhapsode_protocol.http.site).
MAX_UPLOAD_BYTES = 25 * 1000 * 1000
#: A JSON body: a speak request is at most a few kilobytes.
MAX_JSON_BYTES = 1024 * 1024

PREVIEW_TEXT = "This is how I sound when I read a sentence aloud."
# Text with no letter or digit left (only tags, control characters, marks, symbols or
# emoji) is the client's mistake, refused before an engine fails on it.
_UNSPEAKABLE = "{what} has nothing to speak: no letter or digit once unclaimed tags are removed"


def _dials(variant: Variant) -> Mapping[str, Dial]:
    """
    A variant's dials, each a L{Dial}: C{Variant.__post_init__} made the tuples an
    engine may declare into Dials, which the field's declared type cannot say.
    """
    return cast("Mapping[str, Dial]", variant.dials)


def variant_capabilities(engine: IEngine, variant: Variant) -> dict[str, Any]:
    """
    One entry of C{variants}: what the build performs, with clone, blend and dialogue
    derived from what the adapter overrides.
    """
    clones = overrides(engine, "create_voice") and variant.clones and bool(engine.reference_formats)
    cloning: dict[str, Any] = {"supported": clones}
    if clones:
        cloning["formats"] = list(engine.reference_formats)
        if variant.reference_seconds is not None:
            cloning["referenceSeconds"] = list(variant.reference_seconds)
    segmentation: dict[str, Any] = {"supported": engine.segment_characters is not None}
    if engine.segment_characters is not None:
        segmentation["segmentCharacters"] = engine.segment_characters
        if engine.first_segment_characters:
            segmentation["firstSegmentCharacters"] = engine.first_segment_characters
            if engine.segment_growth:
                segmentation["segmentGrowth"] = engine.segment_growth
        segmentation["jointSilenceMs"] = engine.joint_silence_ms
    doc: dict[str, Any] = {
        "cues": list(variant.cues),
        "deliveries": list(variant.deliveries),
        "dials": {
            name: {"min": d.min, "max": d.max, "default": d.default}
            for name, d in _dials(variant).items()
        },
        "languages": list(variant.languages),
        "maxCharacters": variant.max_characters or engine.max_characters,
        "segmentation": segmentation,
        "cloning": cloning,
        "blending": {"supported": overrides(engine, "blend_voice") and variant.blends},
        "streaming": {"supported": True, "granularity": "chunk"},
        "seeding": {"reproducible": variant.seed_reproducible},
    }
    if overrides(engine, "dialogue") and variant.max_speakers >= 1:
        doc["dialogue"] = {"maxSpeakers": variant.max_speakers}
    speed = variant.speed
    if isinstance(speed, Speed):
        doc["speed"] = {"dial": speed.dial, "scale": speed.scale}
    if variant.timestamps is not None:
        doc["timestamps"] = {
            "units": list(variant.timestamps.units),
            "source": variant.timestamps.source,
            "textOffsets": variant.timestamps.text_offsets,
        }
    if variant.instructions is not None:
        doc["instructions"] = {
            "kind": variant.instructions.kind,
            "maxCharacters": variant.instructions.max_characters,
            "required": variant.instructions.required,
        }
    if variant.remote is not None:
        doc["remote"] = {"server": variant.remote.server}
        if variant.remote.model:
            doc["remote"]["model"] = variant.remote.model
    return doc


#: The header naming the audio's own type where the body is events, frames or a document.
AUDIO_TYPE_HEADER = b"X-Rhapsode-Audio-Type"


def check_unit(variant: Variant, name: str, unit: str) -> None:
    """
    @raise Unsupported: C{unit} is not one the variant times, naming C{timestamps}.
    """
    declared = variant.timestamps.units if variant.timestamps is not None else ()
    if unit not in declared:
        claimed = ", ".join(declared) or "none"
        raise Unsupported(
            f'variant "{name}" does not time "{unit}" (timestamps: {claimed})', field="timestamps"
        )


class _Segments(NamedTuple):
    """
    A request's segments as steps, the milliseconds of silence before each step after
    the first, and each step's characters (what the scheduler weighs a request's work
    left by).
    """

    steps: "list[Step | ReactorStep]"
    joints: list[int]
    sizes: list[int]


class _ListSink:
    """
    The consumer of a buffered (C{stream: false}) response: it keeps what it is given.
    """

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.chunks.append(data)

    def registerProducer(self, producer: Any, streaming: bool) -> None:
        pass

    def unregisterProducer(self) -> None:
        pass


class _AudioResponse:
    """
    PCM in, encoded audio out to one HTTP response.

    Headers wait for the first audio: until then every failure is still an ordinary
    error envelope.  Streamed responses are chunked and end with the duration as a
    trailer; buffered ones carry Content-Length and the duration header.
    """

    def __init__(
        self,
        worker: "WorkerApp",
        request: IRequest,
        fmt: str,
        stream: bool,
        job_producer: Job,
        rate: int | None = None,
        timeline: Timeline | None = None,
        framing: Framing | None = None,
    ) -> None:
        self._worker = worker
        self._request = request
        self._fmt = fmt
        #: The rate asked for, where it is not the engine's own: the encoder resamples.
        self._rate = rate if rate != worker.pcm16.sample_rate else None
        self._stream = stream
        self._job = job_producer
        self._timeline = timeline
        self._framing = framing if timeline is not None else None
        self._held: list[dict[str, Any]] = []
        if not stream:
            self._sink: Any = _ListSink()
        elif self._framing is not None:
            self._sink = _FramedSink(request, self._framing)
        else:
            self._sink = request
        self._encoder: Any = None
        self.pcm_bytes = 0

    @property
    def frames(self) -> int:
        """PCM frames written so far, joints included."""
        return self.pcm_bytes // self._worker.pcm16.bytes_per_frame

    def timings(self, marks: Sequence[Timing]) -> None:
        """
        The timings of one hand-over, which precede the PCM it brings: offset, mapped and
        merged, and for a stream sent now, before that PCM (held until the head is out).
        """
        if self._timeline is None or self._framing is None:
            return
        entries = self._timeline.take(marks)
        if not entries or not self._stream:
            return
        if self._encoder is None:
            self._held.extend(entries)
            return
        self._sink.precede(self._framing.timings(entries))

    @property
    def headers_sent(self) -> bool:
        return bool(getattr(self._request, "startedWriting", False))

    def pcm(self, data: bytes) -> None:
        if self._stream and getattr(self._request, "_disconnected", False):
            # The client went while this piece was on its way (the core cancels a
            # request it no longer needs): its job is being stopped, and a gone
            # request has no connection to take a producer.
            return
        if self._encoder is None:
            self._start()
        self.pcm_bytes += len(data)
        self._encoder.write(data)

    def silence(self, milliseconds: int) -> None:
        native = self._worker.pcm16
        frames = native.sample_rate * milliseconds // 1000
        if frames and self._encoder is not None:
            self.pcm(bytes(frames * native.bytes_per_frame))

    def _start(self) -> None:
        native = self._worker.pcm16
        request = self._request
        request.setResponseCode(200)
        sent = native if self._rate is None else replace(native, sample_rate=self._rate)
        audio_type = content_type(self._fmt, sent).encode("ascii")
        framing = self._framing
        if framing is None:
            request.setHeader(b"Content-Type", audio_type)
        else:
            kind = framing.stream_type if self._stream else framing.document_type
            request.setHeader(b"Content-Type", kind.encode("ascii"))
            request.setHeader(AUDIO_TYPE_HEADER, audio_type)
            if self._stream:
                request.setHeader(b"Cache-Control", b"no-cache")
        if self._stream:
            request.setHeader(b"Trailer", DURATION_HEADER)
        if self._held and framing is not None:
            held, self._held = self._held, []
            request.write(framing.timings(held))
        self._encoder = make_encoder(
            self._fmt,
            native,
            self._sink,
            reactor=self._worker.reactor,
            ffmpeg=self._worker.ffmpeg,
            streaming=self._stream,
            blocking=self._worker.blocking,
            rate=self._rate,
        )
        self._encoder.registerProducer(self._job, True)

    def abort(self) -> None:
        if self._encoder is not None:
            self._encoder.abort()

    async def finish(self) -> bytes | None:
        """
        Flush the encoder and complete the response; returns the buffered body to write.
        """
        if self._encoder is None:
            raise SpeechError("the engine produced no audio")
        self._encoder.unregisterProducer()
        await self._encoder.finish()
        native = self._worker.pcm16
        duration = native.duration_ms(self.pcm_bytes)
        request = self._request
        if getattr(request, "producer", None) is not None:
            request.unregisterProducer()  # type: ignore[attr-defined]
        framing = self._framing
        if self._stream:
            if framing is not None:
                self._sink.end(framing.done(duration))
            if not self.headers_sent:
                request.write(b"")
            write_trailer(request, duration)
            return None
        body = b"".join(self._encoder.finalize(self._sink.chunks))
        if framing is not None and self._timeline is not None:
            sent = native if self._rate is None else replace(native, sample_rate=self._rate)
            head = {
                "format": self._fmt,
                "contentType": content_type(self._fmt, sent),
                "sampleRate": sent.sample_rate,
                "channels": native.channels,
                "durationMs": duration,
            }
            body = framing.document(body, head, self._timeline.entries)
        request.setHeader(b"Content-Length", b"%d" % len(body))
        request.setHeader(DURATION_HEADER, b"%d" % duration)
        return body


class _FramedSink:
    """
    The encoder's sink for a stream with timings: each piece of encoded audio goes out
    in the framing asked for (an audio event, or an audio frame), and the response's
    producer is the encoder's, so backpressure reaches the synthesis as for raw audio.

    Timings wait for the audio after them (L{precede}) and go out in the same write:
    one send for a hand-over's timings and its audio, not one for each frame (the
    response sends each write at once).  They leave before that audio, as the
    contract orders them, and never later than the stream's end (L{end}).
    """

    def __init__(self, request: IRequest, framing: Framing) -> None:
        self._request = request
        self._framing = framing
        self._before: list[bytes] = []

    def precede(self, data: bytes) -> None:
        """C{data} goes out ahead of the next audio."""
        self._before.append(data)

    def end(self, data: bytes) -> None:
        """The stream's last frame, after any timings still waiting."""
        before, self._before = self._before, []
        self._request.write(b"".join((*before, data)))

    def write(self, data: bytes) -> None:
        if data:
            before, self._before = self._before, []
            self._request.write(b"".join((*before, *self._framing.audio(data))))

    def registerProducer(self, producer: Any, streaming: bool) -> None:
        self._request.registerProducer(producer, streaming)  # type: ignore[attr-defined]

    def unregisterProducer(self) -> None:
        self._request.unregisterProducer()  # type: ignore[attr-defined]


def _as_is(generate: Callable[[Any], Iterator[Any]], request: Any) -> Iterator[Any]:
    """
    One step of synthesis, on the synthesis thread: the adapter's 16-bit PCM as it is.
    """
    return generate(request)


def _as_pcm16(generate: Callable[[Any], Iterator[Any]], request: Any) -> Iterator[Any]:
    """
    One step of synthesis from an adapter that yields float PCM: converted as the
    synthesis thread draws it, so the reactor never does the arithmetic.
    """
    return pcm16_from_f32le(generate(request))


def _no_content(request: IRequest) -> bytes:
    """
    A 204: the verb was done, and there is nothing to say about it.
    """
    request.setResponseCode(204)
    return b""


class WorkerApp:
    """
    The routes of one worker, serving one engine.
    """

    app = Klein()
    log = Logger()

    def __init__(
        self,
        engine: IEngine,
        *,
        reactor: Any,
        scheduler: Scheduler,
        model: ModelState,
        formats: Sequence[str],
        ffmpeg: str | None,
        contract_version: int,
        on_terminate: Callable[[], None],
        blocking: Blocking,
        lifecycle: WorkerLifecycle | None = None,
        name: str | None = None,
    ) -> None:
        """
        @param blocking: runs a blocking call (voice files, a fetch, an upload's parsing)
            off the reactor thread; the runtime gives it a thread pool of its own.
        @param lifecycle: admits requests, and refuses them once draining; the runtime
            drains it.  By default one of the worker's own, which nothing drains.
        @param name: the registry id the worker was spawned as, which C{/health} names
            (the core may register one engine under several ids); the engine's own id
            by default.
        """
        self.name = name or engine.id
        self.engine = engine
        self.reactor = reactor
        self.blocking = blocking
        self.scheduler = scheduler
        self.model = model
        self.formats = tuple(formats)
        self.ffmpeg = ffmpeg
        self.contract_version = contract_version
        self._on_terminate = on_terminate
        #: The PCM the worker encodes and sends: the adapter's, made 16-bit.
        self.pcm16 = engine.native_format.pcm16
        self._pcm = _as_pcm16 if engine.native_format.encoding == "pcm_f32le" else _as_is
        #: Whether speak() is an asynchronous generator, drawn on the reactor thread
        #: (L{ReactorStep}) rather than run on a synthesis thread.
        self._speaks_async = inspect.isasyncgenfunction(getattr(type(engine), "speak", None))
        if self._speaks_async and engine.native_format.encoding != "pcm_s16le":
            raise TypeError(
                f"{type(engine).__name__}.speak is asynchronous and its native encoding is "
                f"{engine.native_format.encoding}: an asynchronous speak() yields 16-bit PCM"
            )
        self.variants: Mapping[str, Variant] = dict(engine.variants())
        if engine.default_variant not in self.variants:
            raise ValueError(f"default variant {engine.default_variant!r} is not in variants()")
        self.lifecycle = lifecycle or WorkerLifecycle(idle=scheduler.when_idle)

    # -- plumbing -------------------------------------------------------------------

    def site(self, access_log: bool = True) -> DirectSite:
        """
        The site to listen with; without C{access_log} (a log level above info) no
        access line is formatted.
        """
        # POST /speak, on the path of every utterance, skips Klein's routing.
        speak = HandlerResource(self.speak, self.log)
        routes = Routes(
            self.app.url_map,
            {
                ("POST", "/speak"): MAX_JSON_BYTES,
                ("POST", "/dialogue"): MAX_JSON_BYTES,
                ("POST", "/voices"): MAX_UPLOAD_BYTES,
            },
        )
        site = DirectSite(
            self.app.resource(),
            {(b"POST", b"/speak"): speak},
            access_log=access_log,
            reactor=self.reactor,
            routes=routes,
        )
        site.displayTracebacks = False
        site.send_buffer = SEND_BUFFER_BYTES
        return site

    @property
    def draining(self) -> bool:
        return self.lifecycle.draining

    def _enter(self) -> None:
        self.lifecycle.admit()

    def _leave(self) -> None:
        self.lifecycle.leave()

    async def _guarded(self, request: IRequest, handler: Callable[[], Any]) -> Any:
        """
        Count the request in flight, refuse it while draining, and map failures that
        happen before any header onto the taxonomy.
        """
        return await answer(request, handler, self.log, self._enter, self._leave)

    @app.handle_errors(NotFound, MethodNotAllowed)
    def _no_route(self, request: IRequest, failure: Failure) -> bytes:
        return no_route(request, failure)

    def _body(self, request: IRequest, schema: dict[str, Any]) -> dict[str, Any]:
        return read_json(request, schema, MAX_JSON_BYTES)

    # -- state ----------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "process": "up",
            "model": self.model.state,
            "engine": self.name,
            "contract": self.contract_version,
            "device": _memory.device_label(),
            "draining": self.draining,
        }
        if self.model.variant is not None:
            doc["variant"] = self.model.variant
        if self.model.model_bytes:
            doc["modelBytes"] = self.model.model_bytes
        vram = _memory.vram_in_use()
        if vram:
            doc["vramBytes"] = vram
        unreachable = {name: why for name, why in self.engine.unreachable().items() if name in self.variants}
        if unreachable:
            doc["unreachable"] = unreachable
        return doc

    def capabilities(self) -> dict[str, Any]:
        engine = self.engine
        license = engine.license
        native = self.pcm16
        native_doc = {
            "encoding": native.encoding,
            "sampleRate": native.sample_rate,
            "channels": native.channels,
        }
        engine_doc: dict[str, Any] = {
            "id": engine.id,
            "displayName": engine.display_name,
            "adapterVersion": engine.adapter_version,
        }
        if engine.upstream_version:
            engine_doc["upstreamVersion"] = engine.upstream_version
        variants = {name: variant_capabilities(engine, v) for name, v in self.variants.items()}
        doc: dict[str, Any] = {
            "contract": self.contract_version,
            "engine": engine_doc,
            "license": {
                "code": license.code,
                "weights": license.weights,
                "weightsCommercialUse": license.weights_commercial_use,
                "notes": license.notes,
            },
            "device": _memory.device_info(),
            "defaultVariant": engine.default_variant,
            "variants": variants,
            "formats": list(self.formats),
            "nativeFormat": native_doc,
        }
        if self.model.state == "loaded" and self.model.variant in variants:
            current = dict(variants[self.model.variant])
            current["variant"] = self.model.variant
            current["nativeFormat"] = native_doc
            doc["current"] = current
        return doc

    @app.route("/health", methods=["GET"])
    def _health(self, request: IRequest) -> bytes:
        return json_response(request, 200, self.health())

    @app.route("/capabilities", methods=["GET"])
    def _capabilities(self, request: IRequest) -> bytes:
        return json_response(request, 200, self.capabilities())

    # -- model verbs ------------------------------------------------------------------

    def _variant(self, name: str | None) -> str:
        """
        The effective variant: the request's, else the resident one, else the default.
        """
        if name is None:
            if self.model.state == "loaded" and self.model.variant is not None:
                return self.model.variant
            return self.engine.default_variant
        if name not in self.variants:
            # A build this worker cannot load, like a format it cannot make: unsupported.
            known = ", ".join(sorted(self.variants))
            raise Unsupported(f'unknown variant "{name}" (this worker has {known})', field="variant")
        return name

    @app.route("/load", methods=["POST"])
    async def _load(self, request: IRequest) -> Any:
        async def handle() -> bytes:
            body = self._body(request, contract.LOAD_REQUEST)
            variant = self._variant(body.get("variant") or self.engine.default_variant)
            await self.scheduler.exclusive(lambda: Deferred.fromCoroutine(self.model.ensure(variant)))
            return json_response(request, 200, self.health())

        return await self._guarded(request, handle)

    @app.route("/unload", methods=["POST"])
    async def _unload(self, request: IRequest) -> Any:
        async def handle() -> bytes:
            await self.scheduler.exclusive(lambda: Deferred.fromCoroutine(self.model.unload()))
            return json_response(request, 200, self.health())

        return await self._guarded(request, handle)

    @app.route("/terminate", methods=["POST"])
    def _terminate(self, request: IRequest) -> bytes:
        # Answer first, then drain: the caller learns the verb landed either way.
        self.reactor.callLater(0, self._on_terminate)
        return json_response(request, 202, {"terminating": True})

    @app.route("/fetch", methods=["POST"])
    async def _fetch(self, request: IRequest) -> Any:
        async def handle() -> bytes:
            body = self._body(request, contract.FETCH_REQUEST)
            variant = self._variant(body.get("variant") or self.engine.default_variant)
            if not overrides(self.engine, "fetch"):
                raise Unsupported("this engine has nothing to fetch", field="variant")
            await self.blocking(self.engine.fetch, variant)
            return _no_content(request)

        return await self._guarded(request, handle)

    # -- voices -------------------------------------------------------------------------

    def _voice_doc(self, voice: Voice) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "id": voice.id,
            "label": voice.label,
            "spec": voice.spec,
            "tags": list(voice.tags),
            "previewUrl": f"/voices/{voice.id}/preview",
            "builtin": voice.builtin,
        }
        if voice.description:
            doc["description"] = voice.description
        return doc

    async def _voices_by_id(self) -> dict[str, Voice]:
        voices = await self.blocking(self.engine.voices)
        return {v.id: v for v in voices}

    async def _check_voice(self, voice_id: str, field: str) -> None:
        contract.check_voice_id(voice_id, field)
        if voice_id not in await self._voices_by_id():
            raise UnknownVoice(f'no voice "{voice_id}"', field=field)

    @app.route("/voices", methods=["GET"])
    async def _voices(self, request: IRequest) -> Any:
        async def handle() -> bytes:
            voices = await self.blocking(self.engine.voices)
            return json_response(request, 200, [self._voice_doc(v) for v in voices])

        return await self._guarded(request, handle)

    @app.route("/voices", methods=["POST"])
    async def _create_voice(self, request: IRequest) -> Any:
        async def handle() -> bytes:
            ctype = request.getHeader(b"content-type") or b""
            if not ctype.lower().startswith(b"multipart/form-data"):
                raise BadRequest("a voice is created from multipart/form-data", field="body")
            request.content.seek(0)
            fields = await self.blocking(read_form, ctype, request.content)
            unknown = sorted(set(fields) - {"id", "label", "reference", "blend", "transcript"})
            if unknown:
                raise BadRequest(f'unknown field "{unknown[0]}"', field=unknown[0])
            if "id" not in fields:
                raise BadRequest('"id" is required', field="id")
            voice_id = contract.check_voice_id(fields["id"][1].decode("utf-8", "replace"), "id")
            label = fields["label"][1].decode("utf-8", "replace") if "label" in fields else voice_id
            if ("reference" in fields) == ("blend" in fields):
                raise BadRequest("give exactly one of reference or blend", field="reference")
            if "blend" in fields:
                voice = await self._blend(voice_id, label, fields["blend"][1].decode("utf-8", "replace"))
            else:
                filename, data = fields["reference"]
                transcript = fields["transcript"][1].decode("utf-8", "replace") if "transcript" in fields else None
                voice = await self._clone(voice_id, label, filename, data, transcript)
            return json_response(request, 201, self._voice_doc(voice))

        return await self._guarded(request, handle)

    async def _blend(self, voice_id: str, label: str, recipe: str) -> Voice:
        if not overrides(self.engine, "blend_voice"):
            raise Unsupported("this engine does not blend voices", field="blend")
        components = parse_blend(recipe)
        known = await self._voices_by_id()
        for name, _ in components:
            if name not in known:
                raise UnknownVoice(f'no voice "{name}" to blend', field="blend")
        return await self.blocking(self.engine.blend_voice, voice_id, label, components)

    async def _clone(
        self, voice_id: str, label: str, filename: str | None, data: bytes, transcript: str | None
    ) -> Voice:
        if not overrides(self.engine, "create_voice"):
            raise Unsupported("this engine does not make voices from a reference", field="reference")
        extension = PurePath(filename or "").suffix.lower().lstrip(".")
        formats = [f.lower() for f in self.engine.reference_formats]
        if extension not in formats:
            named = extension or "a file with no type"
            raise Unsupported(
                f"reference {named} is not one of {', '.join(formats)}", field="reference"
            )
        if not data:
            raise BadRequest("reference is empty", field="reference")
        reference = Reference(filename=filename or "", extension=extension, data=data, transcript=transcript)
        return await self.blocking(self.engine.create_voice, voice_id, label, reference)

    @app.route("/voices/<string:voice_id>", methods=["DELETE"])
    async def _delete_voice(self, request: IRequest, voice_id: str) -> Any:
        async def handle() -> bytes:
            await self._check_voice(voice_id, "id")
            await self.blocking(self.engine.delete_voice, voice_id)
            return _no_content(request)

        return await self._guarded(request, handle)

    @app.route("/voices/<string:voice_id>/preview", methods=["GET"])
    async def _preview(self, request: IRequest, voice_id: str) -> Any:
        async def handle() -> Any:
            await self._check_voice(voice_id, "id")
            variant = self._variant(None)
            v = self.variants[variant]
            speak = SpeakRequest(
                text=PREVIEW_TEXT,
                variant=variant,
                voice=voice_id,
                language=v.languages[0],
                params={n: d.default for n, d in _dials(v).items()},
            )
            segments = self._segments(speak, stream=False)
            return await self._respond(request, variant, segments, "wav", False)

        return await self._guarded(request, handle)

    # -- speaking -------------------------------------------------------------------------

    def _common(self, body: Mapping[str, Any], variant: str) -> tuple[str, str, dict[str, float]]:
        """
        Check what /speak and /dialogue share: format, sample rate, language and dials.
        """
        v = self.variants[variant]
        fmt = body.get("format", "wav")
        if fmt not in self.formats:
            raise Unsupported(
                f'format "{fmt}" is not produced here (formats: {", ".join(self.formats)})',
                field="format",
            )
        rate = body.get("sampleRate")
        if rate is not None and rate != self.pcm16.sample_rate:
            check_sample_rate(fmt, rate)
            if self.ffmpeg is None:
                raise Unsupported(
                    f"a sample rate of {rate} Hz needs ffmpeg to resample, which this machine lacks",
                    field="sampleRate",
                )
        # Shared with the core's own check, so both read a language the same way.
        language = choose_language(body.get("language"), v.languages, variant)
        params: dict[str, float] = {}
        given = body.get("params", {})
        for key in given:
            if key not in v.dials:
                dials = ", ".join(v.dials) or "none"
                raise BadRequest(
                    f'variant "{variant}" has no dial "{key}" (dials: {dials})', field=f"params.{key}"
                )
        for name, dial in _dials(v).items():
            value = given.get(name, dial.default)
            if not (math.isfinite(value) and dial.min <= value <= dial.max):
                raise BadRequest(
                    f'"params.{name}" must be within [{dial.min}, {dial.max}]',
                    field=f"params.{name}",
                )
            params[name] = float(value)
        return fmt, language, params

    def _clean(self, text: str, variant: Variant) -> str:
        return clean_text(text, variant.cues, self.engine.private_tag_patterns)

    def _text_map(self, text: str, variant: Variant) -> LazyMap:
        patterns = self.engine.private_tag_patterns
        return LazyMap(lambda: clean_text_mapped(text, variant.cues, patterns)[1])

    def _ceiling(self, variant: str) -> int:
        return self.variants[variant].max_characters or self.engine.max_characters

    def _pieces(self, text: str, stream: bool) -> list[Piece]:
        """
        C{text} split for the engine.  The shorter first segment, and the segments that
        grow from it, are for a streamed answer only: it buys first audio with one more
        generation (a 72-character Piper sentence cut in two cost 17% more CPU and 22%
        more time in all), and an answer sent whole has no first audio to buy.
        """
        engine = self.engine
        if not stream:
            return split_pieces(text, engine.segment_characters)
        return split_pieces(text, engine.segment_characters, engine.first_segment_characters, engine.segment_growth)

    def _segments(
        self, request: SpeakRequest, pieces: Sequence[Piece] | None = None, stream: bool = True
    ) -> "_Segments":
        engine = self.engine
        if pieces is None:
            pieces = self._pieces(request.text, stream)
        count = len(pieces)
        requests = [
            replace(request, text=piece.text, segment_index=i, segment_count=count) for i, piece in enumerate(pieces)
        ]
        # The adapter's joint silence is a pause between sentences: a piece cut inside
        # one (the short first segment, or a sentence longer than a segment) goes on into
        # the next with only the silence the model leaves at its edges (Kokoro's 250 ms
        # there made a 400 ms gap mid-phrase, where its reading of the whole has none).
        joints = [engine.joint_silence_ms if piece.ends_sentence else 0 for piece in pieces[:-1]]
        sizes = [len(piece.text) for piece in pieces]
        if self._speaks_async:
            # speak() is declared as a generator; this engine's is an asynchronous one.
            draw = cast(Callable[[SpeakRequest], AsyncIterator[Any]], engine.speak)
            return _Segments([ReactorStep(partial(draw, each)) for each in requests], joints, sizes)
        return _Segments([partial(self._pcm, engine.speak, each) for each in requests], joints, sizes)

    def _timed(self, request: IRequest, body: Mapping[str, Any], variant: str) -> tuple[str, Framing] | None:
        """
        The unit a request asks to have timed and the framing it reads them in, once the
        variant times it and the client's Accept names the framing; None when it asks
        for none.
        """
        unit = body.get("timestamps")
        if unit is None:
            return None
        framing = framing_for(request, bool(body.get("stream", True)))
        check_unit(self.variants[variant], variant, unit)
        return str(unit), framing

    def _timeline(self, variant: str, unit: str, steps: Sequence[Source] = (), turns: Sequence[Source] = ()) -> Timeline:
        declared = self.variants[variant].timestamps
        offsets = declared is not None and declared.text_offsets
        return Timeline(unit, self.pcm16.sample_rate, offsets, steps=steps, turns=turns)

    @app.route("/speak", methods=["POST"])
    async def _speak(self, request: IRequest) -> Any:
        return await self.speak(request)

    async def speak(self, request: IRequest) -> Any:
        """
        C{POST /speak}: validate, schedule the synthesis and write its audio.
        """

        async def handle() -> Any:
            body = self._body(request, contract.SPEAK_REQUEST)
            variant = self._variant(body.get("variant"))
            v = self.variants[variant]
            fmt, language, params = self._common(body, variant)
            delivery = body.get("delivery")
            if delivery is not None and delivery not in v.deliveries:
                claimed = ", ".join(v.deliveries) or "none"
                raise Unsupported(
                    f'variant "{variant}" does not perform delivery "{delivery}" (claims: {claimed})',
                    field="delivery",
                )
            timed = self._timed(request, body, variant)
            unit = timed[0] if timed is not None else None
            text = self._clean(body["text"], v)
            if unit is not None:
                # Timed: where each character came from, to give offsets in the caller's
                # text, mapped once the first timing needs it.
                cleaned = self._text_map(body["text"], v)
            if not is_speakable(text):
                raise BadRequest(_UNSPEAKABLE.format(what="text"), field="text")
            ceiling = self._ceiling(variant)
            if len(text) > ceiling:
                raise BadRequest(f"text is {len(text)} characters; the most is {ceiling}", field="text")
            declared = variant_capabilities(self.engine, v).get("instructions")
            instructions = check_instructions(body.get("instructions"), declared, variant)
            voice = body.get("voice")
            if voice is not None:
                await self._check_voice(voice, "voice")
            speak = SpeakRequest(
                text=text,
                variant=variant,
                voice=voice,
                language=language,
                delivery=delivery,
                params=params,
                seed=body.get("seed"),
                timestamps=unit,
                instructions=instructions,
            )
            stream = bool(body.get("stream", True))
            rate = body.get("sampleRate")
            if timed is None:
                segments = self._segments(speak, stream=stream)
                return await self._respond(request, variant, segments, fmt, stream, rate)
            pieces = self._pieces(text, stream)
            sources = [Source(body["text"], cleaned, piece) for piece in pieces]
            segments = self._segments(speak, pieces)
            timeline = self._timeline(variant, timed[0], sources)
            return await self._respond(request, variant, segments, fmt, stream, rate, timeline=timeline,
                                       framing=timed[1])

        return await self._guarded(request, handle)

    @app.route("/dialogue", methods=["POST"])
    async def _dialogue(self, request: IRequest) -> Any:
        async def handle() -> Any:
            body = self._body(request, contract.DIALOGUE_REQUEST)
            variant = self._variant(body.get("variant"))
            v = self.variants[variant]
            if not (overrides(self.engine, "dialogue") and v.max_speakers >= 1):
                raise Unsupported(f'variant "{variant}" does not perform dialogue', field="turns")
            fmt, language, params = self._common(body, variant)
            timed = self._timed(request, body, variant)
            unit = timed[0] if timed is not None else None
            turns = []
            sources: list[Source] = []
            for i, turn in enumerate(body["turns"]):
                text = self._clean(turn["text"], v)
                if unit is not None:
                    sources.append(Source(turn["text"], self._text_map(turn["text"], v), speaker=turn["speaker"]))
                if not is_speakable(text):
                    raise BadRequest(_UNSPEAKABLE.format(what=f"turn {i}"), field=f"turns[{i}].text")
                turns.append(Turn(speaker=turn["speaker"], text=text))
            speakers = {t.speaker for t in turns}
            if len(speakers) > v.max_speakers:
                raise Unsupported(
                    f"{len(speakers)} speakers; variant \"{variant}\" performs at most {v.max_speakers}",
                    field="turns",
                )
            voices: dict[str, str] = body.get("voices", {})
            for label, voice_id in voices.items():
                if label not in speakers:
                    raise BadRequest(f'no turn has speaker "{label}"', field=f"voices.{label}")
                await self._check_voice(voice_id, f"voices.{label}")
            total = sum(len(t.text) for t in turns)
            ceiling = self._ceiling(variant)
            if total > ceiling:
                raise BadRequest(f"turns total {total} characters; the most is {ceiling}", field="turns")
            dialogue = DialogueRequest(
                turns=tuple(turns),
                variant=variant,
                voices=voices,
                language=language,
                params=params,
                seed=body.get("seed"),
                timestamps=unit,
            )
            # One generation: no joint.
            segments = _Segments([partial(self._pcm, self.engine.dialogue, dialogue)], [], [total])
            if timed is None:
                return await self._respond(
                    request, variant, segments, fmt, body.get("stream", True), body.get("sampleRate")
                )
            timeline = self._timeline(variant, timed[0], turns=sources)
            return await self._respond(
                request, variant, segments, fmt, body.get("stream", True), body.get("sampleRate"), timeline=timeline,
                framing=timed[1]
            )

        return await self._guarded(request, handle)

    async def _respond(
        self,
        request: IRequest,
        variant: str,
        segments: _Segments,
        fmt: str,
        stream: bool,
        rate: int | None = None,
        timeline: Timeline | None = None,
        framing: Framing | None = None,
    ) -> Any:
        """
        Schedule the synthesis and write its audio (resampled to C{rate}, where one is
        asked for), aborting on a failure after headers.  With a C{timeline}, the
        adapter's timings are written beside it in C{framing}.
        """
        # Taken now: a Deferred asked for after the connection is lost never fires.
        finished = request.notifyFinish()  # type: ignore[attr-defined]
        output: _AudioResponse

        def next_step(index: int) -> None:
            output.silence(segments.joints[index - 1])
            if timeline is not None:
                timeline.step(index, output.frames)

        job = Job(
            variant,
            segments.steps,
            on_pcm=lambda pcm: output.pcm(pcm),
            on_step=next_step,
            on_timing=None if timeline is None else (lambda marks: output.timings(marks)),
            gather=lambda: gathered(request),
            sizes=segments.sizes,
            stream_bytes_per_second=(
                self.pcm16.sample_rate * self.pcm16.bytes_per_frame if stream else None
            ),
        )
        output = _AudioResponse(self, request, fmt, stream, job, rate, timeline, framing)

        def gone(failure: Failure) -> None:
            job.cancel()
            output.abort()

        finished.addErrback(gone)
        try:
            await self.scheduler.submit(job)
            return await output.finish()
        except BaseException:
            job.cancel()
            output.abort()
            if output.headers_sent:
                abort_connection(request)
                # Let the connection loss land before Klein looks at the request again.
                await finished
                return None
            raise
