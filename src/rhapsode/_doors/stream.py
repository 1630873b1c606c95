"""
The speech stream, C{GET /v1/audio/speech/stream}: a WebSocket on which a client sends
text as it arrives (a language model's tokens) and hears each sentence, or clause, as
soon as it is complete, with vLLM-Omni's message names ("Streaming Text Input", in the
peer's speech API; docs/streaming.md is this server's account of it).

Text is cut as it arrives (L{rhapsode_protocol.text.TextCutter}, the SDK splitter's
boundary rules), and each piece is spoken through the speech service (L{ISpeech}) exactly
as C{POST /speak} is: preflight, the engine's turnstile, the residency lease, the 256-byte
floor and the stall watch apply unchanged.  The relay writes each answer to a
L{_PieceSink}, this door's L{IAudioSink}, which turns the worker's audio into binary
messages and registers the relay as the WebSocket's producer, so a listener that reads
slowly pauses the worker's socket, as it would over HTTP.  One piece is spoken at a time,
in order.

twisted.web.websocket (Twisted's own, from the C{websocket} extra) carries the frames.
Three things it leaves to its user, found here:

  - the HTTP channel stays registered as the socket's producer after the upgrade, so a
    producer can be attached only once it is detached (L{StreamSession.negotiationFinished});
  - the channel's idle timeout is off for the request being answered, and the upgrade
    leaves it so: a quiet WebSocket is not timed out by it, and this module's own
    timers bound a session instead;
  - a message is buffered whole, with no bound, before it is delivered: the bytes
    arriving between two messages are counted here, and past the bound the session is
    closed 1009 instead of buffering on.
"""

from __future__ import annotations

import json
import re
from collections import deque
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Mapping, Sequence, Union

from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.error import ConnectionAborted, ConnectionDone
from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.server import Request
from twisted.web.websocket import WebSocketResource, WebSocketTransport
from wsproto.utilities import LocalProtocolError
from zope.interface import implementer

from rhapsode_protocol import contract
from rhapsode_protocol.errors import BadRequest, Internal, SpeechError, Unsupported
from rhapsode_protocol.schemas import OPENAI_SPEECH_REQUEST
from rhapsode_protocol.text import GRANULARITIES, TextCutter
from rhapsode_protocol.validation import TooDeep, loads_json
from rhapsode_protocol.vocab import is_speakable

from .._fleet.registry import Registry
from .._http.envelopes import openai_envelope, render_error
from .._interfaces import ISpeech, ITimedSink, Utterance
from .._speech.preflight import forward_speak
from .._speech.translate import OpenAITranslation

__all__ = ["SpeechStreams", "StreamSession"]

#: The most one message from the client may be, in bytes: 1009 past it.
MAX_MESSAGE_BYTES = 64 * 1024
#: What may arrive between two messages beyond that (frame headers, pings), and the
#: most one read can add past the count, before the session stops buffering: 1009.
_FRAMING_SLACK = 64 * 1024
#: The most text a session holds unspoken, queued and not yet cut together: 1009 past it.
MAX_PENDING_CHARACTERS = contract.MAX_TEXT_CHARACTERS
#: The most message text waiting to be read while a session.config is checked: 1009.
MAX_UNREAD_BYTES = 1024 * 1024
#: How long a new session may go without an accepted session.config: 1008 then.
CONFIG_SECONDS = 10.0
#: How long a session may go with nothing arriving and nothing being spoken: 1000 then.
IDLE_SECONDS = 60.0
#: How long a closing handshake may take before the connection is aborted: a client
#: that reads nothing would otherwise hold it open on its unsent bytes.
CLOSE_SECONDS = 10.0
#: What a session config's split_granularity is when it names none.
DEFAULT_GRANULARITY = "sentence"

# Close codes (RFC 6455 section 7.4.1).
NORMAL, GOING_AWAY, UNSUPPORTED_DATA, INVALID_DATA, POLICY, TOO_BIG, INTERNAL = (
    1000, 1001, 1003, 1007, 1008, 1009, 1011
)

#: session.config: the OpenAI speech request's fields but its input (the text comes in
#: input.text) and stream_format, and the peer's additions.
_OPENAI_FIELDS = {k: v for k, v in OPENAI_SPEECH_REQUEST["properties"].items() if k not in ("input", "stream_format")}
SESSION_CONFIG: dict[str, Any] = {
    "type": "object",
    "properties": {
        **_OPENAI_FIELDS,
        "language": {"type": "string", "minLength": 1, "maxLength": 35},
        "seed": {"type": "integer", "minimum": 0, "maximum": contract.MAX_SEED},
        "split_granularity": {"type": "string", "enum": list(GRANULARITIES)},
        "stream_audio": {"type": "boolean"},
        # Timings of each piece's audio (protocol.md section 4), as timestamps messages.
        "timestamps": {"type": "string", "enum": list(contract.TIMESTAMP_UNITS)},
    },
    "required": ["model"],
    "additionalProperties": False,
}

_RATE = re.compile(rb"(?:^|;)\s*rate=(\d+)", re.IGNORECASE)
_CHANNELS = re.compile(rb"(?:^|;)\s*channels=(\d+)", re.IGNORECASE)


@dataclass(frozen=True)
class SessionConfig:
    """
    An accepted session.config: the OpenAI fields each piece's C{/speak} is built from,
    the native fields added to it, how text is cut, and the most one piece may hold.
    """

    fields: Mapping[str, Any]
    native: Mapping[str, Any]
    granularity: str
    ceiling: int


@dataclass(frozen=True)
class _Piece:
    """A piece of text to speak, with the config it was sent under."""

    text: str
    config: SessionConfig
    utterance: int
    index: int


@dataclass(frozen=True)
class _UtteranceEnd:
    """An input.done reached: session.done once every piece before it is spoken."""

    utterance: int
    total: int


@dataclass(frozen=True)
class _SessionEnd:
    """A session.close reached: the session closes once every piece before it is spoken."""


_Item = Union[_Piece, _UtteranceEnd, _SessionEnd]


class _Phase(Enum):
    """
    Where a session is.  Its one timer is this phase's: the config deadline while
    CONFIGURING (none while a session.config is checked), the idle timer while OPEN with
    nothing to speak (none while speaking or ENDING), the closing handshake's deadline
    once CLOSING, none once GONE.
    """

    CONFIGURING = "configuring"  # connected, no session.config accepted yet
    OPEN = "open"  # configured: text is taken and spoken
    ENDING = "ending"  # session.close received: what was sent is spoken, then a close
    CLOSING = "closing"  # the server has sent its close: nothing more is read or sent
    GONE = "gone"  # the connection is lost


@dataclass(frozen=True)
class _Speaking:
    """
    What a session speaks with: the speech service, the OpenAI translation its config
    is read by, the registry its model names, and the clock its timers run on.
    """

    speech: ISpeech
    translation: OpenAITranslation
    registry: Registry
    clock: IReactorTime


class SpeechStreams:
    """
    The WebSocket route's resource and its sessions, over the speech service.
    """

    log = Logger()

    def __init__(
        self, *, speech: ISpeech, translation: OpenAITranslation, registry: Registry, clock: IReactorTime
    ) -> None:
        self._speaking = _Speaking(speech, translation, registry, clock)
        self.sessions: set[StreamSession] = set()
        self._resource = _StreamResource(self)

    def handlers(self) -> dict[str, Callable[..., Any]]:
        """
        The handler of the table's WebSocket route, by name.
        """
        return {"openai_stream": lambda request: self.resource()}

    def resource(self) -> WebSocketResource:
        """
        The twisted.web resource that upgrades C{GET /v1/audio/speech/stream}.
        """
        return self._resource

    def buildProtocol(self, request: Request) -> "StreamSession":
        session = StreamSession(self._speaking, request, self.sessions.discard)
        self.sessions.add(session)
        return session

    def close(self) -> None:
        """
        Shutting down: every session is closed (1001), its speech stopped.
        """
        for session in list(self.sessions):
            session.shut(GOING_AWAY, "the server is shutting down")


class _StreamResource(WebSocketResource):
    """
    Twisted's WebSocket resource, which answers a GET that does not ask for the upgrade
    with 426 in the OpenAI envelope rather than a bare 400 and an error in the log.
    """

    def render_GET(self, request: Request) -> bytes | int:
        upgrade = (request.getHeader(b"upgrade") or b"").lower()
        if b"websocket" not in upgrade:
            request.setHeader(b"Upgrade", b"websocket")
            return render_error(request, BadRequest(
                "this route is a WebSocket: connect with Upgrade: websocket", field="headers", status=426
            ))
        return super().render_GET(request)


class StreamSession:
    """
    One WebSocket session: its messages read in order, its text cut, its pieces spoken
    one at a time through the core's speech path, and its frames sent.

    Its timers run on the core's reactor (C{speaking.clock}).

    @ivar utterances: how many utterances it has ended (input.done).
    @ivar spoken: how many pieces it has spoken, well or not.
    """

    log = Logger()

    def __init__(self, speaking: _Speaking, request: Request, forget: Callable[["StreamSession"], None]) -> None:
        self._speaking = speaking
        self._request = request
        self._forget = forget
        self._clock = speaking.clock
        self._phase = _Phase.CONFIGURING
        self._timer: IDelayedCall | None = None
        self._ws: Any = None  # the WebSocket transport; its loseConnection takes a reason
        self._config: SessionConfig | None = None
        self._cutter = TextCutter(DEFAULT_GRANULARITY)
        # The utterance text is arriving for, how many pieces it has so far, and
        # whether any text has arrived for it (a session.config is refused then).
        self._utterance = 0
        self._count = 0
        self._begun = False
        self._inbox: deque[tuple[dict[str, Any], int]] = deque()
        self._inbox_bytes = 0
        self._reader: Deferred[None] | None = None
        self._queue: deque[_Item] = deque()
        self._queued_characters = 0
        self._speaker: Deferred[None] | None = None
        self._sentence: _PieceSink | None = None
        self._unread = 0
        self._closed_with: tuple[int, str] | None = None
        self.utterances = 0
        self.spoken = 0

    # -- the WebSocket protocol (twisted.web.websocket.WebSocketProtocol) ----------------

    def negotiationStarted(self, transport: WebSocketTransport) -> None:
        self._ws = transport

    def negotiationFinished(self) -> None:
        # The HTTP channel is still the socket's producer: without this, attaching the
        # first relay raises RuntimeError ("... was never unregistered").
        self._ws.detachProducer()
        channel = self._request.channel
        # Off already (twisted.web turns it off while a request is answered, and the
        # upgraded request is never finished); said here so that no change there can
        # time out a quiet stream behind the session's own timers.
        channel.setTimeout(None)
        self._guard(channel)
        self._timer = self._clock.callLater(CONFIG_SECONDS, self._no_config)
        self.log.debug("speech stream opened from {peer}", peer=self._peer())

    def pongReceived(self, payload: bytes) -> None:
        self._unread = 0

    def textMessageReceived(self, message: str) -> None:
        self._unread = 0
        if self._phase in (_Phase.CLOSING, _Phase.GONE) or self._closing_underneath():
            return
        if len(message) > MAX_MESSAGE_BYTES or len(message.encode("utf-8")) > MAX_MESSAGE_BYTES:
            self.shut(TOO_BIG, f"a message is over {MAX_MESSAGE_BYTES} bytes")
            return
        try:
            parsed = loads_json(message)
        except TooDeep as error:
            self.shut(INVALID_DATA, f"a message {error.message.removeprefix('body ')}")
            return
        except ValueError:
            self.shut(INVALID_DATA, "a message is not JSON")
            return
        if not isinstance(parsed, dict) or not isinstance(parsed.get("type"), str):
            self.shut(INVALID_DATA, 'a message is not a JSON object with a string "type"')
            return
        self._inbox.append((parsed, len(message)))
        self._inbox_bytes += len(message)
        if self._inbox_bytes > MAX_UNREAD_BYTES:
            self.shut(TOO_BIG, f"over {MAX_UNREAD_BYTES} bytes of messages waiting while a session.config is checked")
            return
        self._read()

    def bytesMessageReceived(self, data: bytes | bytearray) -> None:
        self._unread = 0
        if self._phase in (_Phase.CLOSING, _Phase.GONE) or self._closing_underneath():
            return
        self.shut(UNSUPPORTED_DATA, "binary messages are not read here: send JSON text messages")

    def connectionLost(self, reason: Failure) -> None:
        if self._phase is _Phase.GONE:
            return
        self._phase = _Phase.GONE
        self._cancel_timer()
        self._inbox.clear()
        self._queue.clear()
        self._stop_speech(reason)
        self._forget(self)
        code, why = self._closed_with or (None, "by the client")
        self.log.info(
            "speech stream from {peer} closed{code} {why}: {utterances} utterances, {spoken} pieces spoken",
            peer=self._peer(), code=f" {code}" if code else "", why=why,
            utterances=self.utterances, spoken=self.spoken,
        )

    # -- closing -------------------------------------------------------------------------

    def shut(self, code: int, reason: str) -> None:
        """
        Close the session with C{code} and C{reason}: its speech stops, nothing more is
        read or sent, and the connection is aborted should the closing handshake not
        finish within L{CLOSE_SECONDS}.
        """
        if self._phase in (_Phase.CLOSING, _Phase.GONE):
            return
        self._phase = _Phase.CLOSING
        self._closed_with = (code, reason)
        self._cancel_timer()
        self._inbox.clear()
        self._queue.clear()
        self._stop_speech(Failure(ConnectionDone(reason)))
        try:
            self._ws.loseConnection(code, reason)
        except LocalProtocolError:
            # The client's own close came first: the handshake is already answered.
            self._socket().loseConnection()
        self._timer = self._clock.callLater(CLOSE_SECONDS, self._abort)

    def _abort(self) -> None:
        self._timer = None
        self._socket().abortConnection()

    def _no_config(self) -> None:
        self._timer = None
        self.shut(POLICY, f"no acceptable session.config within {CONFIG_SECONDS:g} s")

    def _idle(self) -> None:
        self._timer = None
        self.shut(NORMAL, f"nothing arrived and nothing was spoken for {IDLE_SECONDS:g} s")

    def _cancel_timer(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None and timer.active():
            timer.cancel()

    def _rearm(self) -> None:
        """
        The idle timer, afresh, when the session is open with nothing to speak; none
        while it speaks.  Called whenever a message arrives or the speaking stops.
        """
        if self._phase is not _Phase.OPEN:
            return
        self._cancel_timer()
        if self._speaker is None and not self._queue:
            self._timer = self._clock.callLater(IDLE_SECONDS, self._idle)

    # -- reading messages, in order --------------------------------------------------------

    def _read(self) -> None:
        if self._reader is not None:
            return
        reading = Deferred.fromCoroutine(self._read_all())
        reading.addErrback(self._failed, "reading a message")
        if not reading.called:
            self._reader = reading

    async def _read_all(self) -> None:
        # One message at a time: a session.config is checked before the text after it.
        try:
            while self._inbox and self._phase in (_Phase.CONFIGURING, _Phase.OPEN, _Phase.ENDING):
                message, size = self._inbox.popleft()
                self._inbox_bytes -= size
                if self._phase is _Phase.ENDING:
                    self.shut(POLICY, f"{message['type'][:40]} after session.close")
                    return
                await self._handle(message)
                self._rearm()
        finally:
            self._reader = None

    async def _handle(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "session.config":
            await self._configure(message)
        elif kind == "input.text":
            self._take(message)
        elif kind == "input.done":
            self._end_utterance()
        elif kind == "session.close":
            self._end_session()
        else:
            self._send_error(BadRequest(f'no message type "{kind[:40]}": this one is ignored', field="type"))

    async def _configure(self, message: dict[str, Any]) -> None:
        if self._begun:
            self._send_error(BadRequest(
                "session.config is refused in the middle of an utterance: send input.done first",
                field="type",
            ))
            return
        if self._phase is _Phase.CONFIGURING:
            # The deadline is the client's: checking may start the engine's worker.
            self._cancel_timer()
        try:
            config = await self._check(message)
        except SpeechError as refused:
            self._send_error(refused)
            if self._phase is _Phase.CONFIGURING:
                self._timer = self._clock.callLater(CONFIG_SECONDS, self._no_config)
            return
        self._config = config
        self._cutter = TextCutter(config.granularity)
        if self._phase is _Phase.CONFIGURING:
            self._phase = _Phase.OPEN

    async def _check(self, message: dict[str, Any]) -> SessionConfig:
        """
        A session.config as it will be spoken with, refused now for whatever every
        piece would be refused for (an unknown model, a format, a language, a dial).
        """
        fields = {k: v for k, v in message.items() if k != "type"}
        contract.validate(SESSION_CONFIG, fields)
        granularity = fields.pop("split_granularity", DEFAULT_GRANULARITY)
        fields.pop("stream_audio", None)  # every piece streams: there is nothing to choose
        extra: dict[str, Any] = {k: fields.pop(k) for k in ("language", "seed", "timestamps") if k in fields}
        fields.setdefault("response_format", "pcm")
        if fields["response_format"] != "pcm":
            raise Unsupported(
                f'the stream carries pcm, not "{fields["response_format"]}"', field="response_format"
            )
        translation = self._speaking.translation
        native = await translation.native({**fields, "input": "a"}, stream=True)
        native.update(extra)
        contract.validate(contract.PUBLIC_SPEAK_REQUEST, native)
        engine = self._speaking.registry.get(native["engine"])
        caps = await engine.capabilities()
        variant = translation.effective(engine, native.get("variant"))
        forward_speak(native, caps, variant)
        most = caps["variants"][variant].get("maxCharacters")
        ceiling = min(most, MAX_PENDING_CHARACTERS) if isinstance(most, int) else MAX_PENDING_CHARACTERS
        return SessionConfig(fields, extra, granularity, ceiling)

    def _configured(self, kind: str) -> SessionConfig | None:
        if self._config is None:
            self.shut(POLICY, f"{kind} before an accepted session.config")
        return self._config

    def _take(self, message: dict[str, Any]) -> None:
        text = message.get("text")
        if not isinstance(text, str):
            self.shut(INVALID_DATA, 'input.text without a string "text"')
            return
        config = self._configured("input.text")
        if config is None or not text:
            return
        self._begun = True
        self._queue_pieces(self._cutter.feed(text), config)
        held = self._cutter.held
        if held > config.ceiling:
            unit = "an input.done" if config.granularity == "none" else f"the end of a {config.granularity}"
            self.shut(TOO_BIG, f"over {config.ceiling} characters held before {unit}, the most one piece may be")
        elif held + self._queued_characters > MAX_PENDING_CHARACTERS:
            self.shut(TOO_BIG, f"over {MAX_PENDING_CHARACTERS} characters waiting to be spoken")
        else:
            self._speak()

    def _end_utterance(self) -> None:
        config = self._configured("input.done")
        if config is None:
            return
        self._queue_pieces(self._cutter.flush(), config)
        self._queue.append(_UtteranceEnd(self._utterance, self._count))
        self._utterance += 1
        self._count = 0
        self._begun = False
        self._speak()

    def _end_session(self) -> None:
        if self._config is not None and self._begun:
            self._end_utterance()
        self._phase = _Phase.ENDING
        self._cancel_timer()
        self._queue.append(_SessionEnd())
        self._speak()

    def _queue_pieces(self, pieces: list[str], config: SessionConfig) -> None:
        for text in pieces:
            if not is_speakable(text):
                continue  # a lone "..." or quote: nothing to say, and nothing counted
            self._queue.append(_Piece(text, config, self._utterance, self._count))
            self._queued_characters += len(text)
            self._count += 1

    # -- speaking, one piece at a time -------------------------------------------------

    def _speak(self) -> None:
        if self._speaker is not None or not self._queue:
            return
        speaking = Deferred.fromCoroutine(self._speak_all())
        speaking.addErrback(self._failed, "speaking")
        if not speaking.called:
            self._speaker = speaking
            self._rearm()

    async def _speak_all(self) -> None:
        try:
            while self._queue and self._phase in (_Phase.OPEN, _Phase.ENDING):
                item = self._queue.popleft()
                if isinstance(item, _Piece):
                    self._queued_characters -= len(item.text)
                    await self._say(item)
                elif isinstance(item, _UtteranceEnd):
                    self.utterances += 1
                    self._send({
                        "type": "session.done", "utterance_index": item.utterance, "total_sentences": item.total
                    })
                else:
                    self.shut(NORMAL, "session.close: everything sent was spoken")
        finally:
            self._speaker = None
            self._rearm()

    async def _say(self, piece: _Piece) -> None:
        """
        Speak one piece through the speech service, its audio sent as it comes,
        and then say how it went.
        """
        sentence = _PieceSink(self, piece)
        self._sentence = sentence
        failure: SpeechError | None = None
        try:
            native = await self._speaking.translation.native({**piece.config.fields, "input": piece.text}, stream=True)
            native.update(piece.config.native)
            await self._speaking.speech.speak(sentence, Utterance(native["engine"], native, route="stream"))
        except CancelledError:
            raise
        except SpeechError as refused:
            failure = refused
        except Exception:
            self.log.failure("speaking a piece of a speech stream")
            failure = Internal("the piece could not be spoken: the server failed")
        finally:
            self._sentence = None
            sentence.done()
        self.spoken += 1
        if failure is None and sentence.broken:
            failure = Internal(f"the audio broke off after {sentence.sent} bytes")
        if failure is not None:
            self._send_error(failure, piece)
        self._send({
            "type": "audio.done",
            "utterance_index": piece.utterance,
            "sentence_index": piece.index,
            "total_bytes": sentence.sent,
            "error": failure is not None,
        })

    def _stop_speech(self, why: Failure) -> None:
        """
        Stop the piece being spoken (its worker request cancelled, or its audio stopped)
        and the speaking of the rest.
        """
        sentence = self._sentence
        if sentence is not None:
            sentence.lose(why)
        for task in (self._speaker, self._reader):
            if task is not None:
                task.cancel()

    def _failed(self, failure: Failure, doing: str) -> None:
        if failure.check(CancelledError):
            return
        self.log.failure("the speech stream failed {doing}", failure, doing=doing)
        self.shut(INTERNAL, "the server failed")

    # -- what the relay's answer becomes ---------------------------------------------------

    def attach(self, producer: IPushProducer) -> None:
        """
        The relay of the piece being spoken is now the WebSocket's producer.
        """
        if self._phase in (_Phase.CLOSING, _Phase.GONE):
            producer.stopProducing()
            return
        self._ws.attachProducer(producer)

    def detach(self) -> None:
        if self._phase is _Phase.GONE:
            return
        self._ws.detachProducer()

    def audio_starts(self, sentence: "_PieceSink") -> None:
        piece = sentence.piece
        self._send({
            "type": "audio.start",
            "utterance_index": piece.utterance,
            "sentence_index": piece.index,
            "sentence_text": piece.text,
            "format": "pcm",
            "sample_rate": sentence.sample_rate,
            "channels": sentence.channels,
        })

    def send_timestamps(self, piece: _Piece, alignment: Sequence[Mapping[str, Any]]) -> None:
        """
        A piece's timings, before the binary messages holding their first samples:
        seconds from the piece's audio.start, offsets into its sentence_text.
        """
        self._send({
            "type": "timestamps",
            "utterance_index": piece.utterance,
            "sentence_index": piece.index,
            "alignment": list(alignment),
        })

    def send_audio(self, data: bytes) -> None:
        if self._phase in (_Phase.OPEN, _Phase.ENDING):
            try:
                self._ws.sendBytesMessage(data)
            except LocalProtocolError:
                self._closed_underneath()

    def _send(self, payload: dict[str, Any]) -> None:
        if self._phase in (_Phase.CLOSING, _Phase.GONE):
            return
        try:
            self._ws.sendTextMessage(json.dumps(payload, ensure_ascii=False, separators=(",", ":")))
        except LocalProtocolError:
            self._closed_underneath()

    def _send_error(self, error: SpeechError, piece: _Piece | None = None) -> None:
        """
        An error message: the session goes on.  Its fields are OpenAI's error object's
        but its type (which names the message), with the piece it is about.
        """
        shown = openai_envelope(error)["error"]
        payload: dict[str, Any] = {
            "type": "error",
            "message": shown["message"],
            "code": shown["code"],
            "param": shown["param"],
            "retryable": shown["retryable"],
        }
        if piece is not None:
            payload["utterance_index"] = piece.utterance
            payload["sentence_index"] = piece.index
        self._send(payload)

    def _closed_underneath(self) -> None:
        # The client's close frame has arrived and been answered: nothing can be sent,
        # and the connection is on its way down.
        if self._phase in (_Phase.CLOSING, _Phase.GONE):
            return
        self._phase = _Phase.CLOSING
        self._closed_with = (NORMAL, "by the client")
        self._cancel_timer()
        self._queue.clear()
        self._stop_speech(Failure(ConnectionDone("the client closed the WebSocket")))

    def _closing_underneath(self) -> bool:
        return bool(getattr(self._socket(), "disconnecting", False))

    # -- the connection underneath ---------------------------------------------------------

    def _socket(self) -> Any:
        return self._request.channel.transport

    def _guard(self, channel: Any) -> None:
        """
        Count the bytes that arrive between two messages, and close (1009) rather than
        let twisted.web buffer a message without end.
        """
        deliver = channel.dataReceived
        bound = MAX_MESSAGE_BYTES + _FRAMING_SLACK

        def received(data: bytes) -> None:
            if self._phase in (_Phase.CLOSING, _Phase.GONE):
                return
            self._unread += len(data)
            if self._unread > bound:
                self.shut(TOO_BIG, f"a message is over {MAX_MESSAGE_BYTES} bytes")
                return
            deliver(data)

        # The upgrade replaced the channel's dataReceived with the WebSocket's; this
        # wraps that in turn.
        channel.dataReceived = received

    def _peer(self) -> str:
        try:
            return str(getattr(self._request.getClientAddress(), "host", "-"))
        except Exception:
            return "-"


@implementer(ITimedSink)
class _PieceSink:
    """
    What the speech relay writes one piece's answer to: the status and headers are kept,
    the first write announces the audio (audio.start, with the rate the Content-Type
    gave) and every write is a binary message, and the relay registers as the
    WebSocket's producer.  An abort (a body under the floor, truncated or stalled) fails
    this piece, never the WebSocket.

    @ivar finished: fires when the piece is done, and fails when the connection is lost
        or the relay aborts it.
    """

    def __init__(self, session: StreamSession, piece: _Piece) -> None:
        self.session = session
        self.piece = piece
        self.finished: Deferred[None] = Deferred()
        self.code: int | None = None
        self.content_type = b""
        self.started = False
        self._writing = False
        self.producer: IPushProducer | None = None
        self.sent = 0
        self.broken = False

    @property
    def sample_rate(self) -> int | None:
        found = _RATE.search(self.content_type)
        return int(found.group(1)) if found else None

    @property
    def channels(self) -> int:
        found = _CHANNELS.search(self.content_type)
        return int(found.group(1)) if found else 1

    def gathered(self) -> AbstractContextManager[None]:
        return nullcontext()

    def begin(self, code: int, headers: Sequence[tuple[bytes, bytes]]) -> None:
        self.started = True
        self.code = code
        for name, value in headers:
            if name.lower() == b"content-type":
                self.content_type = value

    def registerProducer(self, producer: IPushProducer) -> None:
        self.producer = producer
        self.session.attach(producer)

    def unregisterProducer(self) -> None:
        if self.producer is not None:
            self.producer = None
            self.session.detach()

    def write(self, data: bytes) -> None:
        if not data:
            return
        self._starting()
        self.sent += len(data)
        self.session.send_audio(data)

    def timestamps(self, alignment: Sequence[Mapping[str, Any]]) -> None:
        self._starting()
        self.session.send_timestamps(self.piece, alignment)

    def _starting(self) -> None:
        if not self._writing:
            self._writing = True
            self.session.audio_starts(self)

    def room(self) -> "Deferred[None]":
        return succeed(None)  # every piece streams, paused by the WebSocket

    def end(self, duration_ms: int | None) -> None:
        pass  # audio.done says it, once the speech service has returned

    def abort(self, error: SpeechError | None) -> "Deferred[None]":
        """
        The relay gives up on this piece after its first bytes: it failed.
        """
        self.broken = True
        if not self.finished.called:
            self.finished.errback(Failure(ConnectionAborted("the piece's audio broke off")))
        return succeed(None)

    def lose(self, why: Failure) -> None:
        """
        The WebSocket is closing or gone: the worker's request is cancelled, or its
        audio stopped.
        """
        producer = self.producer
        if producer is not None:
            producer.stopProducing()
        if not self.finished.called:
            self.finished.errback(why)

    def done(self) -> None:
        if not self.finished.called:
            self.finished.callback(None)
        # Consumed once the relay has seen it, so a failure is never logged as unhandled.
        self.finished.addErrback(lambda _: None)
