"""
L{RemoteEngine}: speech servers somebody else runs (vLLM-Omni, or anything that answers
OpenAI's C{POST /v1/audio/speech}), one model per variant, behind the worker protocol.

Every variant's model lives on its server: loading one asks the server whether it is
there, nothing is measured or freed here, and the capability document says so (each
variant's C{remote}).  Speech is relayed as the server streams it: vLLM-Omni's SSE of
PCM deltas (whose explicit C{speech.audio.done} is what tells a whole answer from one cut
short; its C{speech.audio.error}, or no done event, fails it), or an OpenAI server's PCM
body.  C{speak()} is an asynchronous generator that the SDK pulls on the reactor thread
(L{rhapsode_engine_remote._relay}): no thread stands between the server's first byte and
the worker's.  The SDK encodes whatever format the request asked for, and since this
engine relays (C{relays}), a reader that pauses stops the pulls, this engine then stops
reading the server's socket, and the pause reaches the server: nothing piles up here.

The server's refusals are the taxonomy's (L{_refusal}); a server that cannot be reached
is C{model_unavailable}, retryable, and the variant is reported unreachable on /health
(so the core fences it) until a probe or a request reaches it again.  A prober thread
asks each server every C{probeSeconds}, on a connection of its own.

Voices: each variant's presets from its server's voices list (the catalog's speakers
where the server cannot be asked, with their native languages as tags), and the voices
made here.  A voice made from a reference is kept here (L{VoiceStore}), and uploaded to
each cloning variant's voices API where the server has one and the operator gave the
consent id it requires; anywhere else it is sent with each request as C{ref_audio} and
C{ref_text}.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time
from dataclasses import replace
from typing import Any, AsyncIterator, Callable, Mapping, Sequence, TypeVar

from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger

from rhapsode_worker import (
    BadRequest,
    Engine,
    Instructions,
    License,
    ModelUnavailable,
    NativeFormat,
    Reference,
    Remote,
    SpeakRequest,
    UnknownVoice,
    Unsupported,
    Variant,
    Voice,
    VoiceStore,
    WorkerContext,
)

from ._client import NotJSON, ServerError, Unreachable
from ._config import RemoteConfigError, read_config
from ._describe import Described, catalog, describe
from ._relay import Relay
from ._stream import refusal

log = Logger(namespace="rhapsode_engine_remote")

_T = TypeVar("_T")

#: How long a server's voices list is believed before it is asked again: every request
#: naming a voice is checked against it.
VOICES_SECONDS = 10.0
#: The reference types vLLM-Omni's voices API takes (and so what a reference kept here
#: may be, to be sent as ref_audio).
REFERENCE_TYPES = {"wav": "audio/wav", "mp3": "audio/mpeg", "flac": "audio/flac", "ogg": "audio/ogg",
                   "aac": "audio/aac", "webm": "audio/webm", "mp4": "audio/mp4"}


class RemoteEngine(Engine):
    """
    The variants the configuration names, each a model on a server elsewhere.
    """

    relays = True
    #: The server takes the whole text: one request per utterance, its own streaming.
    segment_characters = None
    reference_formats = tuple(REFERENCE_TYPES)

    def __init__(self, context: WorkerContext, reactor: Any = None) -> None:
        super().__init__(context)
        self._reactor = reactor if reactor is not None else _global_reactor()
        # A configuration that cannot be used ends the worker before its handshake, the
        # error (RemoteConfigError, naming where) its log line.
        config = read_config(context.environ)
        record = catalog()
        self._described: dict[str, Described] = {
            name: describe(name, server, record) for name, server in config.variants.items()
        }
        rates = {d.sample_rate for d in self._described.values()}
        if len(rates) > 1:
            named = ", ".join(f"{d.name} at {d.sample_rate} Hz" for d in self._described.values())
            raise RemoteConfigError(
                f"one engine speaks one native rate, and these differ ({named}): "
                "configure the models of each rate as an engine of its own"
            )
        self.native_format = NativeFormat(sample_rate=rates.pop())
        self.default_variant = config.default_variant
        self.concurrency = config.concurrency
        self.max_characters = max(d.config.max_characters for d in self._described.values())
        self.license = self._license()
        #: Each variant's server, as speak() asks it on the reactor thread.
        self._relays = {name: Relay(d.server.config, self._reactor) for name, d in self._described.items()}
        self._store = VoiceStore(context.voice_dir, blob=".ref")
        #: The voices made here, so that speak() tells one from a preset without reading
        #: the folder on the reactor thread; kept by create_voice and delete_voice.
        self._made = set(self._store.ids())
        self._presets: dict[str, tuple[float, list[str]]] = {}
        self._presets_lock = threading.Lock()
        #: Variants whose server does not answer now, with why (read by /health): from
        #: the start, those that could not be asked then.
        self._down: dict[str, str] = {
            d.name: d.unreachable for d in self._described.values() if d.unreachable is not None
        }
        self._stop = threading.Event()
        self._prober = threading.Thread(target=self._probe_forever, name="remote-prober", daemon=True)
        self._prober.start()
        for d in self._described.values():
            log.info("variant {name}: {model} on {server} ({api}, {rate} Hz)", name=d.name,
                     model=d.model or "the server's model", server=d.server.origin, api=d.api, rate=d.sample_rate)

    # -- what it declares ---------------------------------------------------------------

    def _license(self) -> License:
        """
        The catalog record's licence (its code: this adapter's), with the weights of the
        models configured, each from the record's table or the configuration: all their
        licences, commercial use only where every one allows it, and which is which in
        the notes.
        """
        told = [(d, d.license()) for d in self._described.values()]
        weights = sorted({lic["weights"] for _, lic in told})
        notes = "; ".join(
            f"variant {d.name}: {d.model or 'the server’s model'}, {lic['weights']}"
            f"{'' if lic['weightsCommercialUse'] else ' (not for commercial use)'}"
            f"{' — ' + lic['notes'] if lic['notes'] else ''}"
            for d, lic in told
        )
        return replace(
            type(self).license,
            weights=" AND ".join(weights),
            weights_commercial_use=all(lic["weightsCommercialUse"] for _, lic in told),
            notes="This worker runs this adapter; each model runs on its own server, under that "
            f"server's licence (vLLM-Omni is Apache-2.0). {notes}",
        )

    def variants(self) -> dict[str, Variant]:
        variants = {}
        for name, d in self._described.items():
            instructions = None
            if d.instructions is not None:
                # A designed voice with no preset to fall back on must be described.
                instructions = Instructions(d.instructions, required=d.instructions == "design" and not d.presets)
            variants[name] = Variant(
                cues=tuple(d.cues),
                dials={"speed": (0.25, 4.0, 1.0)} if d.speed else {},
                languages=tuple(d.languages),
                max_characters=d.config.max_characters,
                clones=d.cloning != "none",
                blends=False,
                instructions=instructions,
                remote=Remote(d.server.origin, d.model),
            )
        return variants

    # -- the model, which is elsewhere ----------------------------------------------------

    def load(self, variant: str) -> None:
        d = self._described[variant]
        try:
            listed = d.server.json("GET", "/v1/models")
        except Unreachable as error:
            self._mark_down(variant, str(error))
            raise ModelUnavailable(f"variant {variant}: {error}") from None
        except ServerError as error:
            if error.status not in (404, 405):
                raise refusal(error, d.server.origin, None) from None
            listed = None
        self._mark_up(variant)
        data = listed.get("data") if isinstance(listed, dict) else None
        ids = [entry.get("id") for entry in data if isinstance(entry, dict)] if isinstance(data, list) else []
        if d.model and ids and d.model not in ids:
            raise ModelUnavailable(f"{d.server.origin} serves {', '.join(map(str, ids[:8]))}, not {d.model}")

    def unload(self) -> None:
        """Nothing here to free: the models stay on their servers."""

    def unreachable(self) -> Mapping[str, str]:
        return dict(self._down)

    def _mark_down(self, variant: str, why: str) -> None:
        if self._down.get(variant) != why:
            log.warn("variant {variant} cannot reach its server: {why}", variant=variant, why=why)
        self._down[variant] = why

    def _mark_up(self, variant: str) -> None:
        if self._down.pop(variant, None) is not None:
            log.info("variant {variant} reaches its server again", variant=variant)

    def _probe_forever(self) -> None:
        interval = min(d.config.probe_seconds for d in self._described.values())
        while not self._stop.wait(interval):
            for name, d in self._described.items():
                timeout = min(d.config.head_seconds, max(1.0, 2 * d.config.probe_seconds))
                try:
                    d.server.json("GET", "/v1/models", head_seconds=timeout, fresh=True)
                except Unreachable as error:
                    self._mark_down(name, str(error))
                except ServerError:
                    self._mark_up(name)  # it answered: up, whatever it thinks of the route
                except Exception as error:  # a thread that dies would leave a variant fenced forever
                    log.warn("probing {name} failed: {error!r}", name=name, error=error)
                else:
                    self._mark_up(name)

    def close(self) -> None:
        """On the reactor thread: stop probing, close every idle connection."""
        self._stop.set()
        for d in self._described.values():
            d.server.close()
        for relay in self._relays.values():
            relay.close()

    # -- voices ---------------------------------------------------------------------------

    def _preset_names(self, d: Described) -> list[str]:
        """
        The server's own voices for variant C{d}, asked at most every VOICES_SECONDS; the
        catalog's speakers, or the configuration's voices, where it cannot be asked.
        """
        known = self._known_presets(d)
        if known is not None:
            return known
        now = time.monotonic()
        with self._presets_lock:
            cached = self._presets.get(d.name)
        try:
            listed = d.server.json("GET", "/v1/audio/voices")
        except (Unreachable, ServerError) as error:
            if cached is not None:
                return cached[1]
            known = d.facts.get("speakers")
            if isinstance(known, dict):
                return list(known)
            if isinstance(error, NotJSON) or (isinstance(error, ServerError) and error.status in (404, 405)):
                return []
            raise ModelUnavailable(f"variant {d.name}: its voices cannot be read: {error}") from None
        names: list[str] = []
        if isinstance(listed, dict):
            uploaded = {str(v.get("name")) for v in listed.get("uploaded_voices", []) if isinstance(v, dict)}
            for entry in listed.get("voices", []):
                name = entry if isinstance(entry, str) else entry.get("id") if isinstance(entry, dict) else None
                if isinstance(name, str) and name not in uploaded:
                    names.append(name)
        with self._presets_lock:
            self._presets[d.name] = (now, names)
        return names

    def _known_presets(self, d: Described) -> list[str] | None:
        """
        Variant C{d}'s presets where they are known without asking its server (the
        configuration's, none, or a list asked within VOICES_SECONDS); None where the
        server must be asked.
        """
        if d.config.voices is not None:
            return list(d.config.voices)
        if not d.presets:
            return []
        with self._presets_lock:
            cached = self._presets.get(d.name)
        if cached is not None and time.monotonic() - cached[0] < VOICES_SECONDS:
            return cached[1]
        return None

    def _presets_by_variant(self) -> dict[str, list[str]]:
        # The default variant's first, so a preview of the first voice listed speaks.
        order = sorted(self._described.values(), key=lambda d: d.name != self.default_variant)
        return {d.name: self._preset_names(d) for d in order}

    def voices(self) -> Sequence[Voice]:
        listed: dict[str, Voice] = {}
        for variant, names in self._presets_by_variant().items():
            d = self._described[variant]
            speakers = d.facts.get("speakers") if isinstance(d.facts.get("speakers"), dict) else {}
            for name in names:
                if name in listed or not _usable_id(name):
                    continue
                language = speakers.get(name.lower()) if speakers else None
                tags = tuple(t for t in (language, "preset") if t)
                listed[name] = Voice(
                    id=name,
                    label=name.replace("_", " ").title(),
                    spec=f"{name}@{d.model or d.server.origin}",
                    description=f"A voice of {d.model or 'the model'} on {d.server.origin} (variant {variant})"
                    + (f", native language {language}" if language else ""),
                    tags=tags,
                )
        for voice_id, record in self._store.records():
            listed.setdefault(voice_id, Voice(
                id=voice_id,
                label=str(record.get("label", voice_id)),
                spec=f"{voice_id}@{record.get('sha256', '')[:16]}",
                description="Made here from a reference"
                + (" with its transcript" if record.get("transcript") else ""),
                tags=("cloned",),
                builtin=False,
            ))
        return list(listed.values())

    def create_voice(self, voice_id: str, label: str, reference: Reference) -> Voice:
        cloning = [d.name for d in self._described.values() if d.cloning != "none"]
        if not cloning:
            raise Unsupported("no variant of this engine makes voices from a reference", field="reference")
        digest = hashlib.sha256(reference.data).hexdigest()
        record: dict[str, Any] = {
            "label": label, "extension": reference.extension, "sha256": digest,
            "transcript": reference.transcript, "uploaded": {},
        }
        for d in self._described.values():
            if d.cloning == "upload" and d.config.consent:
                try:
                    record["uploaded"][d.name] = self._upload(d, voice_id, label, reference)
                except Unreachable as error:
                    # Kept here all the same: it goes with each request until uploaded.
                    log.warn("uploading {voice} to {variant} failed ({error}); it is sent per request",
                             voice=voice_id, variant=d.name, error=str(error))
        self._store.save(voice_id, record, reference.data)
        self._made.add(voice_id)
        return Voice(id=voice_id, label=label, spec=f"{voice_id}@{digest[:16]}",
                     description="Made here from a reference", tags=("cloned",), builtin=False)

    def _upload(self, d: Described, voice_id: str, label: str, reference: Reference) -> str:
        fields: list[tuple[str, str | None, bytes, str | None]] = [
            ("audio_sample", f"{voice_id}.{reference.extension}", reference.data, REFERENCE_TYPES[reference.extension]),
            ("consent", None, (d.config.consent or "").encode(), None),
            ("name", None, voice_id.encode(), None),
            ("speaker_description", None, label.encode(), None),
        ]
        if reference.transcript:
            fields.append(("ref_text", None, reference.transcript.encode(), None))
        try:
            d.server.upload("/v1/audio/voices", fields)
        except ServerError as error:
            raise BadRequest(f"{d.server.origin} refused the voice: {error.message}", field="id") from None
        log.info("uploaded voice {voice} to {server}", voice=voice_id, server=d.server.origin)
        return voice_id

    def delete_voice(self, voice_id: str) -> None:
        record = self._store.record(voice_id)
        for variant, name in dict(record.get("uploaded", {})).items():
            d = self._described.get(variant)
            if d is None:
                continue
            try:
                d.server.json("DELETE", f"/v1/audio/voices/{name}")
            except (Unreachable, ServerError) as error:
                log.warn("deleting {voice} from {server} failed: {error}", voice=name, server=d.server.origin,
                         error=str(error))
        self._store.delete(voice_id)
        self._made.discard(voice_id)

    # -- speaking -------------------------------------------------------------------------

    def _voice_fields(self, d: Described, voice: str | None) -> dict[str, Any]:
        """
        How variant C{d} is told which voice to speak in, or the refusal when it cannot.
        Blocking: a voice made here is read from its folder, and a preset list older than
        VOICES_SECONDS is asked of the server.
        """
        if voice is None:
            return {"voice": d.default_voice} if d.default_voice else {}
        record = self._store.record(voice) if voice in self._store else None
        if record is not None:
            if d.cloning == "none":
                raise UnknownVoice(
                    f'voice "{voice}" was made from a reference, and variant "{d.name}" speaks only its own voices',
                    field="voice",
                )
            uploaded = record.get("uploaded", {}).get(d.name)
            if uploaded:
                return {"voice": uploaded}
            data = self._store.blob_path(voice).read_bytes()
            fields: dict[str, Any] = {
                "ref_audio": f"data:{REFERENCE_TYPES[record['extension']]};base64,{base64.b64encode(data).decode()}",
            }
            if record.get("transcript"):
                fields["ref_text"] = record["transcript"]
            if d.default_voice:
                fields["voice"] = d.default_voice
            return fields
        return self._preset_fields(d, voice, self._preset_names(d))

    def _known_voice_fields(self, d: Described, voice: str | None) -> dict[str, Any] | None:
        """
        L{_voice_fields} where it needs neither the folder nor the server (no voice, or a
        preset whose list is known): what the reactor thread may compute; None otherwise.
        """
        if voice is None:
            return {"voice": d.default_voice} if d.default_voice else {}
        if voice in self._made:
            return None
        names = self._known_presets(d)
        return None if names is None else self._preset_fields(d, voice, names)

    @staticmethod
    def _preset_fields(d: Described, voice: str, names: list[str]) -> dict[str, Any]:
        if voice not in names:
            raise UnknownVoice(f'variant "{d.name}" has no voice "{voice}"', field="voice")
        return {"voice": voice}

    def _body(self, d: Described, request: SpeakRequest, streamed: bool, voice: Mapping[str, Any]) -> dict[str, Any]:
        text = request.text
        for cue, spoken in d.cues.items():
            text = text.replace(f"[{cue}]", spoken)
        body: dict[str, Any] = {"input": text, "response_format": "pcm"}
        if d.model:
            body["model"] = d.model
        body.update(voice)
        speed = request.params.get("speed", 1.0)
        if speed != 1.0:
            body["speed"] = speed
        if request.instructions is not None:
            body["instructions"] = request.instructions
        if d.api == "vllm-omni":
            if d.task is not None:
                body["task_type"] = "Base" if "ref_audio" in body and d.task == "Base" else d.task
            name = d.languages.get(request.language)
            if name is not None and not d.facts.get("noLanguage"):
                body["language"] = name
            if streamed:
                body["stream"] = True
                body["stream_format"] = "sse"
        return body

    async def _blocking(self, call: Callable[..., _T], *args: Any) -> _T:
        """C{call(*args)} on the reactor's thread pool, for what reads a file or a server."""
        done: _T = await deferToThreadPool(self._reactor, self._reactor.getThreadPool(), call, *args)
        return done

    # An asynchronous generator, which the SDK draws on the reactor thread (Engine.speak
    # is declared as the blocking kind).
    async def speak(self, request: SpeakRequest) -> AsyncIterator[bytes]:  # type: ignore[override]
        d = self._described[request.variant]
        # vLLM-Omni streams only at speed 1; otherwise the answer comes whole.
        streamed = d.api == "vllm-omni" and request.params.get("speed", 1.0) == 1.0
        voice = self._known_voice_fields(d, request.voice)
        if voice is None:
            voice = await self._blocking(self._voice_fields, d, request.voice)
        body = json.dumps(self._body(d, request, streamed, voice)).encode()
        relay = self._relays[request.variant]
        try:
            response = await relay.request(b"POST", "/v1/audio/speech", body)
        except Unreachable as error:
            self._mark_down(request.variant, str(error))
            raise ModelUnavailable(f"variant {request.variant}: {error}") from None
        self._mark_up(request.variant)
        if response.code != 200:
            raise refusal(await relay.error_of(response), relay.origin, request.voice)
        reader = relay.read(response, sse=streamed, where=relay.origin)
        try:
            while (pcm := await reader.next()) is not None:
                yield pcm
        finally:
            # Let go, however this ends: a body read to its end has gone back to the
            # pool; a pulled one's client went away, or it failed: its connection closes.
            reader.release()


def _global_reactor() -> Any:
    from twisted.internet import reactor

    return reactor


#: The protocol's voice id rule: a server's voice named otherwise cannot be listed.
_VOICE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


def _usable_id(name: str) -> bool:
    return bool(_VOICE_ID.match(name))
