"""
The Wyoming door (docs/wyoming.md): Home Assistant's local voice pipeline speaking to the
core directly, over Wyoming's TCP protocol, on a port of its own (C{wyoming.port}, off by
default).

A Wyoming event is one JSON header line (C{type}, and the lengths of what follows),
then C{data_length} bytes of JSON merged into the header's C{data}, then C{payload_length}
bytes of binary payload.  This door answers:

  - C{describe}: C{info}, one TTS program per engine, each voice of it with its languages
    (the default variant's), and the engine's licences and attribution;
  - C{synthesize}: C{audio-start}, C{audio-chunk}s as the worker's audio arrives, and
    C{audio-stop}; the first sentence is spoken on its own, so its first audio comes
    as soon as the SDK's short first segment is ready, then the rest in as few
    utterances as the variant's ceiling allows;
  - the streaming form, C{synthesize-start}, C{synthesize-chunk}s and C{synthesize-stop}:
    the text is cut as it arrives (L{TextCutter}, as the WebSocket stream does), each
    sentence spoken as soon as it is whole, in its own C{audio-start}..C{audio-stop}
    (as wyoming-piper answers it), then C{synthesize-stopped}; a C{synthesize} sent
    inside the stream, which clients send for older servers, is not spoken twice;
  - C{select-program}: the engine the connection's requests go to by default;
  - C{ping}: C{pong}.

Every utterance is spoken through the speech service (L{ISpeech}) exactly as C{/speak}
is (admission, the engine's turnstile, the residency lease, the stall watch, the
metrics under the route C{wyoming}), as pcm; the relay is the connection's producer, so
a peer that reads slowly pauses the worker's socket.  A refusal or a failure is an
C{error} event (the taxonomy's code), and the connection goes on.

Everything a peer sends is bounded before it costs anything: a header line (L{MAX_LINE}),
its data (L{MAX_DATA}) and payload (L{MAX_PAYLOAD}), the events of one connection, the
events and text waiting to be spoken, the connections open at once, and the time a
connection may send nothing while nothing is spoken.  Past a bound the peer is sent an
C{error} event and the connection is closed.

Voice names in C{info} are C{engine:voice}, so that Home Assistant, which gathers the
voices of every program into one list, sends a name that says its engine; a bare voice
id (or an operator's alias) goes to the selected program's engine, else the first
engine that has it.
"""

from __future__ import annotations

import json
import re
from collections import deque
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IAddress, IDelayedCall, IPushProducer, IReactorTime
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from rhapsode_protocol import contract
from rhapsode_protocol.errors import BadRequest, Internal, SpeechError, UnknownEngine, UnknownVoice, Unsupported
from rhapsode_protocol.text import TextCutter
from rhapsode_protocol.vocab import is_speakable

from .._fleet.registry import Registry
from .._interfaces import IAudioSink, IClientSettings, IPublicRoutes, ISpeech, Utterance

__all__ = ["MAX_DATA", "MAX_LINE", "MAX_PAYLOAD", "WyomingDoor", "WyomingLimits", "WyomingConnection"]

#: The Wyoming protocol version this door speaks (the wyoming library's it is tested with).
VERSION = "1.10.2"
#: The longest header line, in bytes, newline excluded.
MAX_LINE = 64 * 1024
#: The most JSON data one event may carry: a synthesize's text at the contract's most
#: characters, escaped.
MAX_DATA = 1024 * 1024
#: The most payload one event may carry: a TTS peer sends none, so this is only room.
MAX_PAYLOAD = 256 * 1024
#: Events read and not yet acted on: past this, the peer is not waiting for answers.
MAX_INBOX = 256
#: Text held to be spoken (cut and waiting, or not yet cut), in characters.
MAX_PENDING_CHARACTERS = contract.MAX_TEXT_CHARACTERS
#: The PCM one audio-chunk carries at most: 4096 samples of 16-bit mono, as a
#: streaming peer wants them (wyoming-piper sends 1024).
CHUNK_BYTES = 8192
#: The width of a sample: the core speaks pcm, 16-bit.
WIDTH = 2

_RATE = re.compile(rb"(?:^|;)\s*rate=(\d+)", re.IGNORECASE)
_CHANNELS = re.compile(rb"(?:^|;)\s*channels=(\d+)", re.IGNORECASE)


@dataclass(frozen=True)
class WyomingLimits:
    """
    The operator's bounds on a Wyoming peer (C{wyoming.*}).
    """

    idle_seconds: float = 60.0
    max_events: int = 10_000
    max_connections: int = 64


def encode_event(kind: str, data: Mapping[str, Any] | None = None, payload: bytes = b"") -> bytes:
    """
    One Wyoming event as it goes on the wire: the header line, the data, the payload.
    """
    header: dict[str, Any] = {"type": kind, "version": VERSION}
    body = json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode("utf-8") if data else b""
    if body:
        header["data_length"] = len(body)
    if payload:
        header["payload_length"] = len(payload)
    return json.dumps(header, separators=(",", ":")).encode("utf-8") + b"\n" + body + payload


@dataclass(frozen=True)
class _Event:
    type: str
    data: Mapping[str, Any]
    size: int


@dataclass(frozen=True)
class _Target:
    """Where an utterance goes: its engine and the native fields that pick its voice."""

    engine: str
    fields: Mapping[str, Any]


@dataclass(frozen=True)
class _Piece:
    """Text to speak, the target, and whether it opens and closes an audio cycle."""

    text: str
    target: _Target
    opens: bool
    closes: bool


@dataclass(frozen=True)
class _StreamEnd:
    """A synthesize-stop's end: synthesize-stopped once every piece before it is spoken."""


class WyomingDoor(Factory):
    """
    The Wyoming port's factory: one L{WyomingConnection} per peer, over the speech
    service, the public reads and the registry of engines the programs name.
    """

    log = Logger()

    def __init__(
        self,
        *,
        speech: ISpeech,
        routes: IPublicRoutes,
        registry: Registry,
        clock: IReactorTime,
        limits: WyomingLimits,
        clients: IClientSettings | None = None,
        version: str = "",
    ) -> None:
        self.speech = speech
        self.routes = routes
        self.registry = registry
        self.clock = clock
        self.limits = limits
        self.clients = clients
        self.version = version
        self.connections: set[WyomingConnection] = set()

    def buildProtocol(self, addr: IAddress | None) -> "WyomingConnection":
        return WyomingConnection(self, addr)

    def close(self) -> None:
        """
        Shutting down: every connection is closed, its speech stopped.
        """
        for connection in list(self.connections):
            connection.shut("the server is shutting down")

    # -- what describe answers ----------------------------------------------------------

    async def info(self) -> dict[str, Any]:
        """
        C{info}'s data: one TTS program per engine that can say what it has (an engine
        whose worker cannot start is left out and logged), in the registry's order.
        """
        programs = []
        for handle in self.registry:
            try:
                caps = await handle.capabilities()
                code, voices = await self.routes.voices(handle.id)
            except SpeechError as error:
                self.log.warn("describing {engine} to a Wyoming peer: {why}", engine=handle.id, why=error.message)
                continue
            if code != 200 or not isinstance(voices, list):
                self.log.warn("describing {engine} to a Wyoming peer: HTTP {code}", engine=handle.id, code=code)
                continue
            programs.append(self._program(handle.id, caps, voices, handle.catalog))
        return {"asr": [], "tts": programs, "handle": [], "intent": [], "wake": [], "mic": [], "snd": []}

    def _program(
        self, engine_id: str, caps: Mapping[str, Any], voices: Sequence[Mapping[str, Any]],
        catalog: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        engine = caps.get("engine", {})
        licence = caps.get("license", {})
        name = engine.get("displayName", engine_id)
        variant = caps.get("variants", {}).get(caps.get("defaultVariant"), {})
        languages = list(variant.get("languages") or ["en"])
        distribution = (catalog or {}).get("distribution")
        url = f"https://pypi.org/project/{distribution}/" if distribution else ""
        weights = licence.get("weights", "unknown")
        restricted = "" if licence.get("weightsCommercialUse", False) else ", not for commercial use"
        # The licence travels with the attribution: what Home Assistant shows of who made it.
        attribution = {"name": f"{name} (code {licence.get('code', 'unknown')}; weights {weights}{restricted})",
                       "url": url}
        listed = [
            {
                "name": f"{engine_id}:{voice['id']}",
                "attribution": attribution,
                "installed": True,
                "description": f"{voice.get('label', voice['id'])} ({name})",
                "version": voice.get("spec"),
                "languages": languages,
                "speakers": None,
            }
            for voice in voices
            if isinstance(voice, Mapping) and isinstance(voice.get("id"), str)
        ]
        return {
            "name": engine_id,
            "attribution": attribution,
            "installed": True,
            "description": f"{name} through Rhapsode {self.version}".strip(),
            "version": engine.get("adapterVersion"),
            "voices": listed,
            "supports_synthesize_streaming": True,
        }

    async def target(self, voice: Mapping[str, Any] | None, selected: str | None) -> _Target:
        """
        The engine and voice fields a Wyoming request's C{voice} names.

        @raise UnknownEngine, UnknownVoice, Unsupported: naming C{voice}.
        """
        voice = voice or {}
        ids = self.registry.ids()
        if not ids:
            raise UnknownEngine("this server has no engine", field="voice")
        if voice.get("speaker") is not None:
            raise Unsupported("no voice here has speakers: name the voice alone", field="voice.speaker")
        name = voice.get("name")
        if isinstance(name, str) and name:
            engine, _, voice_id = name.rpartition(":")
            if engine:
                if engine not in self.registry:
                    raise UnknownEngine(f'no engine "{engine[:64]}" (engines: {", ".join(ids)})', field="voice.name")
                return _Target(engine, {"voice": voice_id})
            return _Target(await self._engine_with(name, selected, ids), {"voice": name})
        language = voice.get("language")
        if isinstance(language, str) and language:
            return await self._engine_speaking(language, selected, ids)
        return _Target(selected or ids[0], {})

    async def _engine_with(self, name: str, selected: str | None, ids: Sequence[str]) -> str:
        if selected is not None:
            return selected
        aliases = self.clients.voice_aliases() if self.clients is not None else {}
        if name in aliases and aliases[name][0] in self.registry:
            return aliases[name][0]
        for engine_id in ids:
            try:
                code, voices = await self.routes.voices(engine_id)
            except SpeechError:
                continue
            if code == 200 and isinstance(voices, list) and any(v.get("id") == name for v in voices):
                return engine_id
        raise UnknownVoice(f'no engine has a voice "{name[:64]}"', field="voice.name")

    async def _engine_speaking(self, language: str, selected: str | None, ids: Sequence[str]) -> _Target:
        wanted = language.replace("_", "-").lower()
        for engine_id in [selected] if selected is not None else ids:
            try:
                caps = await self.registry.get(engine_id).capabilities()
            except SpeechError:
                continue
            variant = caps.get("variants", {}).get(caps.get("defaultVariant"), {})
            for spoken in variant.get("languages") or ():
                tag = str(spoken).lower()
                if tag == wanted or tag.startswith(wanted + "-") or wanted.startswith(tag + "-"):
                    return _Target(engine_id, {"language": spoken})
        raise Unsupported(f'no engine here speaks "{language[:35]}"', field="voice.language")

    async def ceiling(self, engine_id: str) -> int:
        """
        The most text one utterance of C{engine_id}'s default variant may carry.
        """
        caps = await self.registry.get(engine_id).capabilities()
        variant = caps.get("variants", {}).get(caps.get("defaultVariant"), {})
        most = variant.get("maxCharacters")
        return min(most, MAX_PENDING_CHARACTERS) if isinstance(most, int) else MAX_PENDING_CHARACTERS


class WyomingConnection(Protocol):
    """
    One Wyoming peer: its events read in order and bounded, its text spoken one piece at
    a time through the speech service, its audio written as events.

    @ivar events: how many events it has sent.
    @ivar spoken: how many pieces it has had spoken, well or not.
    """

    log = Logger()

    def __init__(self, door: WyomingDoor, addr: IAddress | None) -> None:
        self._door = door
        self._peer = str(getattr(addr, "host", "-"))
        self._buffer = bytearray()
        self._header: dict[str, Any] | None = None
        self._inbox: deque[_Event] = deque()
        self._reader: Deferred[None] | None = None
        self._queue: deque[_Piece | _StreamEnd] = deque()
        self._queued_characters = 0
        self._speaker: Deferred[None] | None = None
        self._sink: _PieceSink | None = None
        self._timer: IDelayedCall | None = None
        self._closing = False
        self._selected: str | None = None
        #: The stream in progress (synthesize-start until synthesize-stop): its target,
        #: cutter and ceiling.
        self._stream: tuple[_Target, TextCutter, int] | None = None
        #: The audio cycle that failed: its remaining pieces are not spoken.
        self._failed_cycle = False
        self.events = 0
        self.spoken = 0

    # -- the connection ------------------------------------------------------------------

    def connectionMade(self) -> None:
        door = self._door
        if len(door.connections) >= door.limits.max_connections:
            self._refuse(f"over {door.limits.max_connections} Wyoming connections are open")
            return
        door.connections.add(self)
        self._rearm()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._closing = True
        self._cancel_timer()
        self._door.connections.discard(self)
        self._inbox.clear()
        self._queue.clear()
        sink = self._sink
        if sink is not None:
            sink.lose(reason)
        for task in (self._reader, self._speaker):
            if task is not None:
                task.cancel()

    def shut(self, why: str) -> None:
        """
        Say why in an C{error} event and close once it is written.
        """
        self._refuse(why)

    def _refuse(self, why: str, code: str = "bad_request") -> None:
        if self._closing or self.transport is None:
            return
        self._send("error", {"text": why, "code": code})
        self._closing = True
        self._cancel_timer()
        self._inbox.clear()
        self._queue.clear()
        sink = self._sink
        if sink is not None:
            sink.lose(Failure(ConnectionDone(why)))
        self.transport.loseConnection()

    # -- reading events, every part bounded ------------------------------------------------

    def dataReceived(self, data: bytes) -> None:
        if self._closing:
            return
        self._buffer += data
        self._rearm()
        while not self._closing:
            if self._header is None:
                end = self._buffer.find(b"\n", 0, MAX_LINE + 1)
                if end < 0:
                    if len(self._buffer) > MAX_LINE:
                        self._refuse(f"a header line is over {MAX_LINE} bytes")
                    return
                line = bytes(self._buffer[:end])
                del self._buffer[: end + 1]
                if not line.strip():
                    continue
                header = self._parse_header(line)
                if header is None:
                    return
                header["size"] = len(line)
                self._header = header
            header = self._header
            data_length, payload_length = header["data_length"], header["payload_length"]
            if len(self._buffer) < data_length + payload_length:
                return
            raw = bytes(self._buffer[:data_length])
            del self._buffer[: data_length + payload_length]  # a payload is never read here
            self._header = None
            merged = dict(header["data"])
            if raw:
                try:
                    extra = json.loads(raw)
                except ValueError:
                    self._refuse("an event's data is not JSON")
                    return
                if not isinstance(extra, dict):
                    self._refuse("an event's data is not a JSON object")
                    return
                merged.update(extra)
            self._take(_Event(header["type"], merged, header["size"] + data_length))

    def _parse_header(self, line: bytes) -> dict[str, Any] | None:
        try:
            header = json.loads(line)
        except ValueError:
            self._refuse("a header line is not JSON")
            return None
        if not isinstance(header, dict) or not isinstance(header.get("type"), str):
            self._refuse('a header is not a JSON object with a string "type"')
            return None
        data = header.get("data") or {}
        data_length = header.get("data_length") or 0
        payload_length = header.get("payload_length") or 0
        if not isinstance(data, dict):
            self._refuse('an event\'s "data" is not a JSON object')
            return None
        for name, value, most in (("data_length", data_length, MAX_DATA), ("payload_length", payload_length, MAX_PAYLOAD)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                self._refuse(f'"{name}" is not a length')
                return None
            if value > most:
                self._refuse(f"{name} {value} is over {most} bytes")
                return None
        return {"type": header["type"][:64], "data": data, "data_length": data_length, "payload_length": payload_length}

    def _take(self, event: _Event) -> None:
        self.events += 1
        if self.events > self._door.limits.max_events:
            self._refuse(f"over {self._door.limits.max_events} events on one connection")
            return
        if len(self._inbox) >= MAX_INBOX:
            self._refuse(f"over {MAX_INBOX} events waiting to be read")
            return
        self._inbox.append(event)
        self._read()

    def _read(self) -> None:
        if self._reader is not None or not self._inbox or self._closing:
            return
        reading = Deferred.fromCoroutine(self._read_all())
        reading.addErrback(self._failed, "reading")
        if not reading.called:
            self._reader = reading

    async def _read_all(self) -> None:
        try:
            while self._inbox and not self._closing:
                await self._act(self._inbox.popleft())
        finally:
            self._reader = None

    async def _act(self, event: _Event) -> None:
        kind, data = event.type, event.data
        try:
            if kind == "describe":
                self._send("info", await self._door.info())
            elif kind == "ping":
                self._send("pong", {"text": data.get("text")})
            elif kind == "select-program":
                self._select(data)
            elif kind == "synthesize":
                if self._stream is None:
                    await self._synthesize(data)
            elif kind == "synthesize-start":
                await self._start(data)
            elif kind == "synthesize-chunk":
                self._chunk(data)
            elif kind == "synthesize-stop":
                self._stop()
            # Anything else is another domain's (a satellite's audio, a wake word's):
            # dropped, as the protocol asks of a server that does not handle it.
        except CancelledError:
            raise
        except SpeechError as refused:
            self._error(refused)
        except Exception:
            self.log.failure("answering a Wyoming {kind}", kind=kind)
            self._error(Internal(f"the server failed answering {kind}"))

    # -- the requests -----------------------------------------------------------------------

    def _select(self, data: Mapping[str, Any]) -> None:
        name = data.get("name")
        if not isinstance(name, str) or name not in self._door.registry:
            known = ", ".join(self._door.registry.ids())
            raise UnknownEngine(f'no TTS program "{str(name)[:64]}" (programs: {known})', field="name")
        self._selected = name

    def _text(self, data: Mapping[str, Any], field: str = "text") -> str:
        text = data.get(field)
        if not isinstance(text, str):
            raise BadRequest(f'"{field}" must be a string', field=field)
        fmt = data.get("text_format")
        if fmt not in (None, "text"):
            raise Unsupported(f'text_format "{str(fmt)[:16]}" is not read here: send text', field="text_format")
        return text

    def _voice(self, data: Mapping[str, Any]) -> Mapping[str, Any] | None:
        voice = data.get("voice")
        if voice is not None and not isinstance(voice, Mapping):
            raise BadRequest('"voice" must be an object', field="voice")
        return voice

    async def _synthesize(self, data: Mapping[str, Any]) -> None:
        text = self._text(data)
        target = await self._door.target(self._voice(data), self._selected)
        ceiling = await self._door.ceiling(target.engine)
        # The first sentence alone (within it the SDK cuts its short first segment), so
        # the first audio comes as soon as a sentence-by-sentence server's would, or
        # sooner; then the rest in as few requests as the ceiling allows, each spoken
        # by the SDK segment after segment without a request's gap between sentences.
        cutter = TextCutter("sentence")
        sentences = [sentence for sentence in cutter.feed(text) + cutter.flush() if sentence]
        pieces = _grouped_sentences(sentences[:1], ceiling) + _grouped_sentences(sentences[1:], ceiling)
        pieces = [piece for piece in pieces if is_speakable(piece)]
        if not pieces:
            raise BadRequest("text has nothing to speak", field="text")
        if not self._room(sum(map(len, pieces))):
            return
        for i, piece in enumerate(pieces):
            self._enqueue(_Piece(piece, target, opens=i == 0, closes=i == len(pieces) - 1))
        self._speak()

    async def _start(self, data: Mapping[str, Any]) -> None:
        if self._stream is not None:
            raise BadRequest("synthesize-start inside a stream: send synthesize-stop first", field="type")
        target = await self._door.target(self._voice(data), self._selected)
        fmt = data.get("text_format")
        if fmt not in (None, "text"):
            raise Unsupported(f'text_format "{str(fmt)[:16]}" is not read here: send text', field="text_format")
        self._stream = (target, TextCutter("sentence"), await self._door.ceiling(target.engine))

    def _chunk(self, data: Mapping[str, Any]) -> None:
        if self._stream is None:
            raise BadRequest("synthesize-chunk outside a stream: send synthesize-start first", field="type")
        target, cutter, ceiling = self._stream
        self._queue_sentences(cutter.feed(self._text(data)), target)
        if cutter.held > ceiling:
            self._refuse(f"over {ceiling} characters held before the end of a sentence, the most one may be")
            return
        if self._room(cutter.held):
            self._speak()

    def _stop(self) -> None:
        if self._stream is None:
            raise BadRequest("synthesize-stop outside a stream", field="type")
        target, cutter, _ = self._stream
        self._stream = None
        self._queue_sentences(cutter.flush(), target)
        self._queue.append(_StreamEnd())
        self._speak()

    def _queue_sentences(self, sentences: list[str], target: _Target) -> None:
        for sentence in sentences:
            if is_speakable(sentence):
                self._enqueue(_Piece(sentence, target, opens=True, closes=True))

    def _enqueue(self, piece: _Piece) -> None:
        self._queue.append(piece)
        self._queued_characters += len(piece.text)

    def _room(self, more: int) -> bool:
        if self._queued_characters + more > MAX_PENDING_CHARACTERS:
            self._refuse(f"over {MAX_PENDING_CHARACTERS} characters waiting to be spoken")
            return False
        return True

    # -- speaking, one piece at a time -------------------------------------------------

    def _speak(self) -> None:
        if self._speaker is not None or not self._queue or self._closing:
            return
        speaking = Deferred.fromCoroutine(self._speak_all())
        speaking.addErrback(self._failed, "speaking")
        if not speaking.called:
            self._speaker = speaking
            self._rearm()

    async def _speak_all(self) -> None:
        try:
            while self._queue and not self._closing:
                item = self._queue.popleft()
                if isinstance(item, _StreamEnd):
                    self._send("synthesize-stopped", None)
                    continue
                self._queued_characters -= len(item.text)
                if item.opens:
                    self._failed_cycle = False
                if not self._failed_cycle:
                    await self._say(item)
        finally:
            self._speaker = None
            self._rearm()

    async def _say(self, piece: _Piece) -> None:
        sink = _PieceSink(self, piece.opens)
        self._sink = sink
        failure: SpeechError | None = None
        body = {"engine": piece.target.engine, "text": piece.text, "format": "pcm", "stream": True,
                **piece.target.fields}
        try:
            await self._door.speech.speak(sink, Utterance(piece.target.engine, body, route="wyoming"))
        except CancelledError:
            raise
        except SpeechError as refused:
            failure = refused
        except Exception:
            self.log.failure("speaking to a Wyoming peer")
            failure = Internal("the piece could not be spoken: the server failed")
        finally:
            self._sink = None
            sink.done()
        self.spoken += 1
        if failure is None and sink.broken:
            failure = Internal(f"the audio broke off after {sink.sent} bytes")
        if failure is not None:
            self._failed_cycle = True
            self._error(failure)
            if sink.opened or not piece.opens:
                # A reader waiting for the end of this audio is not left waiting.
                self._send("audio-stop", None)
            return
        if piece.closes:
            self._send("audio-stop", None)

    def _failed(self, failure: Failure, doing: str) -> None:
        if failure.check(CancelledError):
            return
        self.log.failure("the Wyoming connection failed {doing}", failure, doing=doing)
        self._refuse("the server failed", "internal")

    # -- what goes out --------------------------------------------------------------------

    def _send(self, kind: str, data: Mapping[str, Any] | None, payload: bytes = b"") -> None:
        transport = self.transport
        if transport is None or self._closing:
            return
        transport.write(encode_event(kind, data, payload))

    def _error(self, error: SpeechError) -> None:
        text = error.message if error.field is None else f"{error.message} ({error.field})"
        self._send("error", {"text": text, "code": error.code})

    def audio_start(self, rate: int, channels: int) -> None:
        self._send("audio-start", {"rate": rate, "width": WIDTH, "channels": channels})

    def audio_chunk(self, rate: int, channels: int, pcm: bytes) -> None:
        for at in range(0, len(pcm), CHUNK_BYTES):
            self._send("audio-chunk", {"rate": rate, "width": WIDTH, "channels": channels}, pcm[at : at + CHUNK_BYTES])

    def attach(self, producer: IPushProducer) -> None:
        transport = self.transport
        if self._closing or transport is None:
            producer.stopProducing()
            return
        transport.registerProducer(producer, True)  # type: ignore[attr-defined]

    def detach(self) -> None:
        transport = self.transport
        if transport is not None and not self._closing:
            transport.unregisterProducer()  # type: ignore[attr-defined]

    # -- the idle timer --------------------------------------------------------------------

    def _rearm(self) -> None:
        """
        The idle timer runs only while nothing is being spoken or waiting to be.
        """
        self._cancel_timer()
        if self._closing or self._speaker is not None or self._queue or self._reader is not None:
            return
        seconds = self._door.limits.idle_seconds
        self._timer = self._door.clock.callLater(seconds, self._idle)

    def _idle(self) -> None:
        self._timer = None
        self._refuse(f"nothing arrived and nothing was spoken for {self._door.limits.idle_seconds:g} s")

    def _cancel_timer(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None and timer.active():
            timer.cancel()


def _grouped_sentences(sentences: list[str], ceiling: int) -> list[str]:
    """
    Sentences as pieces at most the ceiling long: whole sentences together while they
    fit (one longer than the ceiling is cut at its clauses, then its words).
    """
    pieces: list[str] = []
    current = ""
    for sentence in sentences:
        for part in _fitting(sentence, ceiling):
            if current and len(current) + 1 + len(part) > ceiling:
                pieces.append(current)
                current = part
            else:
                current = f"{current} {part}" if current else part
    if current:
        pieces.append(current)
    return pieces


def _fitting(sentence: str, ceiling: int) -> list[str]:
    if len(sentence) <= ceiling:
        return [sentence]
    parts: list[str] = []
    clauses = TextCutter("clause")
    for clause in clauses.feed(sentence) + clauses.flush() or [sentence]:
        while len(clause) > ceiling:
            cut = clause.rfind(" ", 0, ceiling)
            cut = cut if cut > 0 else ceiling
            parts.append(clause[:cut].strip())
            clause = clause[cut:].strip()
        if clause:
            parts.append(clause)
    return parts


@implementer(IAudioSink)
class _PieceSink:
    """
    What the speech relay writes one piece's answer to: the rate and channels from the
    worker's Content-Type; the first audio announced with C{audio-start} where the piece
    opens a cycle; every write as C{audio-chunk}s of whole samples.
    """

    def __init__(self, connection: WyomingConnection, opens: bool) -> None:
        self._connection = connection
        self._opens = opens
        self.finished: Deferred[None] = Deferred()
        self.started = False
        self.opened = False
        self.broken = False
        self.sent = 0
        self._rate = 0
        self._channels = 1
        self._odd = b""
        self._producer: IPushProducer | None = None

    def gathered(self) -> AbstractContextManager[None]:
        return nullcontext()

    def begin(self, code: int, headers: Sequence[tuple[bytes, bytes]]) -> None:
        self.started = True
        for name, value in headers:
            if name.lower() == b"content-type":
                rate, channels = _RATE.search(value), _CHANNELS.search(value)
                self._rate = int(rate.group(1)) if rate else 0
                self._channels = int(channels.group(1)) if channels else 1

    def write(self, data: bytes) -> None:
        if not data:
            return
        if not self.opened:
            self.opened = True
            if self._opens:
                self._connection.audio_start(self._rate, self._channels)
        data = self._odd + data
        whole = len(data) - len(data) % (WIDTH * self._channels)
        self._odd = data[whole:]
        if whole:
            self.sent += whole
            self._connection.audio_chunk(self._rate, self._channels, data[:whole])

    def room(self) -> "Deferred[None]":
        return succeed(None)  # always streamed ("stream": true), paused by the peer's socket

    def registerProducer(self, producer: IPushProducer) -> None:
        self._producer = producer
        self._connection.attach(producer)

    def unregisterProducer(self) -> None:
        if self._producer is not None:
            self._producer = None
            self._connection.detach()

    def end(self, duration_ms: int | None) -> None:
        pass  # audio-stop is the connection's to send, once the cycle ends

    def abort(self, error: SpeechError | None) -> "Deferred[None]":
        self.broken = True
        if not self.finished.called:
            self.finished.errback(Failure(ConnectionDone("the piece's audio broke off")))
        return succeed(None)

    def lose(self, why: Failure) -> None:
        producer = self._producer
        if producer is not None:
            producer.stopProducing()
        if not self.finished.called:
            self.finished.errback(why)

    def done(self) -> None:
        if not self.finished.called:
            self.finished.callback(None)
        self.finished.addErrback(lambda _: None)



#: The service type Home Assistant browses for.
SERVICE_TYPE = "_wyoming._tcp.local."
#: A multicast DNS group, used only to ask the kernel which address reaches the local
#: network: connecting a UDP socket sends nothing.
_MDNS_GROUP = "224.0.0.251"


class Advertisement:
    """
    The door on the local network as C{_wyoming._tcp} (zeroconf's multicast DNS), so Home
    Assistant offers to add it, as C{wyoming-piper --zeroconf} does.  python-zeroconf
    runs its own thread; registering probes the network for a second or so, so it is
    done off the reactor (C{blocking}), as is the goodbye when the door closes.

    @param zeroconf: makes the zeroconf instance (python-zeroconf's C{Zeroconf} by
        default, imported only when the operator turned this on); C{service_info}
        likewise its C{ServiceInfo}.
    """

    log = Logger()

    def __init__(
        self,
        *,
        port: int,
        name: str,
        host: str | None,
        blocking: Any,
        zeroconf: Any = None,
        service_info: Any = None,
    ) -> None:
        self.port = port
        self.name = name
        self.host = host
        self._blocking = blocking
        self._zeroconf_factory = zeroconf
        self._info_factory = service_info
        self._zeroconf: Any = None
        self.info: Any = None
        #: While the registration runs (off the reactor): the stop waits for it, so a
        #: door that stops at once does not leave a registration running unwithdrawn.
        self._registering: Deferred[None] | None = None

    def _factories(self) -> tuple[Any, Any]:
        if self._zeroconf_factory is not None and self._info_factory is not None:
            return self._zeroconf_factory, self._info_factory
        try:
            from zeroconf import ServiceInfo, Zeroconf
        except ImportError:
            raise RuntimeError(
                "wyoming.zeroconf needs the zeroconf package: pip install 'rhapsode[wyoming]'"
            ) from None
        return Zeroconf, ServiceInfo

    def address(self) -> str:
        """
        The IPv4 address to advertise: the door's own where it listens on one, else the
        one this machine reaches the local network from.
        """
        if self.host and self.host not in ("0.0.0.0", "::", ""):
            return self.host
        import socket

        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            probe.connect((_MDNS_GROUP, 1))
            return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"
        finally:
            probe.close()

    def start(self) -> "Deferred[None]":
        """
        Register the service; fires once it is announced.
        """
        import socket

        zeroconf, service_info = self._factories()
        address = self.address()
        self.info = service_info(
            SERVICE_TYPE,
            f"{self.name}.{SERVICE_TYPE}",
            addresses=[socket.inet_aton(address)],
            port=self.port,
        )

        def register() -> None:
            self._zeroconf = zeroconf()
            self._zeroconf.register_service(self.info)

        def announced(_: object) -> None:
            self.log.info("the Wyoming door is advertised as {name} on {address}:{port}",
                          name=f"{self.name}.{SERVICE_TYPE}", address=address, port=self.port)

        started: Deferred[None] = self._blocking(register)
        registering: Deferred[None] = Deferred()
        self._registering = registering

        def settled(result: object) -> object:
            self._registering = None
            registering.callback(None)
            return result

        started.addBoth(settled)
        started.addCallback(announced)
        return started

    def stop(self) -> "Deferred[None]":
        """
        Withdraw the service and close zeroconf's thread, once a registration still
        running has finished.
        """
        if self._registering is not None:
            after: Deferred[None] = Deferred()
            self._registering.addCallback(lambda _: self.stop().chainDeferred(after))
            return after
        running, self._zeroconf = self._zeroconf, None
        if running is None:
            return succeed(None)

        def withdraw() -> None:
            try:
                running.unregister_service(self.info)
            finally:
                running.close()

        stopped: Deferred[None] = self._blocking(withdraw)
        return stopped
