"""
A timed answer from a worker to a sink (protocol.md section 4, "timestamps").

The worker frames timings as the public API does: a stream is server-sent events
(C{speech.audio.delta} with base64 audio, C{speech.timestamps.delta} before the audio
that holds its entries' first samples, C{speech.audio.done} with the duration), a
buffered answer one JSON document (the audio in base64 beside the whole alignment).  So
an engine author sees with curl what a client of the core sees, one framing is specified
and tested, and the core asks for it with the client's own Accept.  The cost is base64's
third more bytes on the worker's socket and its encoding and decoding, under a
millisecond per megabyte (bench/timestamps.py measures the whole path).

The relay reads that framing here and writes an L{ITimedSink}: audio as bytes and
timings as entries, in the order they came, so that each door frames them its own way
(events, a document, WebSocket messages, MCP's result).  Everything else is the relay's
rule for any answer: the relay is the sink's producer, so a slow reader pauses the
worker's socket; a body under the floor, truncated, stalled, or ended without its done
event aborts a sink that has started and is the door's error before that; a buffered
answer is read whole within a bound and the core's budget before anything is written.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any, Mapping

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from zope.interface import implementer

from rhapsode_protocol import contract
from rhapsode_protocol.errors import Internal, SpeechError

from .._interfaces import ITimedSink
from .._upstream import Stalls, Watched, stalled
from .metrics import Measured

__all__ = [
    "AUDIO_TYPE_HEADER",
    "CHANNELS_HEADER",
    "RATE_HEADER",
    "EventReader",
    "MAX_EVENT_BYTES",
    "TimedStreamRelay",
    "accept_for",
    "read_document",
    "timed_limit",
]

#: What a worker is asked to answer with, by whether the answer streams.
_ACCEPT = {True: contract.TIMED_EVENTS.encode("ascii"), False: contract.TIMED_JSON.encode("ascii")}
#: The header of a timed answer naming its audio's own type.
AUDIO_TYPE_HEADER = b"X-Rhapsode-Audio-Type"
#: What a buffered timed answer's audio is, told to its sink beside the Content-Type
#: (the document it is answered in says them).
RATE_HEADER = b"X-Rhapsode-Sample-Rate"
CHANNELS_HEADER = b"X-Rhapsode-Channels"
#: The most one event from a worker may be: a batch of audio (256 KiB of PCM, a third
#: more as base64) with room to spare.  A longer line is not the protocol.
MAX_EVENT_BYTES = 4 * 1024 * 1024
#: What a timed answer's alignment may add per character of text, as JSON: a word and
#: its phonemes take a few entries of about a hundred bytes each.
_ALIGNMENT_BYTES_PER_CHARACTER = 512


def accept_for(stream: bool) -> bytes:
    """
    The Accept header a timed request to a worker carries.
    """
    return _ACCEPT[stream]


def timed_limit(buffered: int, caps: Mapping[str, Any], variant: str) -> int:
    """
    The most a buffered timed answer can be: its audio's bound as base64, and its
    alignment's for the variant's ceiling of text.
    """
    performs = caps.get("variants", {}).get(variant, {})
    characters = int(performs.get("maxCharacters") or 4096)
    return buffered * 4 // 3 + 4096 + characters * _ALIGNMENT_BYTES_PER_CHARACTER


def read_document(raw: bytes) -> tuple[bytes, dict[str, Any]]:
    """
    A buffered timed answer: its audio, and the rest of its document.

    @raise Internal: a body that is not the contract's TimedAudio document.
    """
    try:
        document = json.loads(raw)
        contract.validate(contract.TIMED_AUDIO, document)
        audio = base64.b64decode(document.pop("audio"), validate=True)
    except (ValueError, SpeechError, binascii.Error):
        raise Internal("the worker's timed answer is not a TimedAudio document") from None
    return audio, document


class EventReader:
    """
    Server-sent events as they arrive, in any pieces: each complete frame's event name
    and data (one JSON object).  A worker writes one data line per frame.
    """

    def __init__(self, limit: int = MAX_EVENT_BYTES) -> None:
        self._limit = limit
        self._pending = b""

    def feed(self, data: bytes) -> list[tuple[str, dict[str, Any]]]:
        """
        @raise Internal: a frame over the limit, or one that is not an event of JSON.
        """
        buffer = self._pending + data if self._pending else data
        frames = buffer.split(b"\n\n")
        self._pending = frames.pop()
        if len(self._pending) > self._limit:
            raise Internal(f"the worker sent an event over {self._limit} bytes")
        events = []
        for frame in frames:
            if frame.strip():
                events.append(_event(frame))
        return events

    @property
    def holding(self) -> bool:
        """Whether part of a frame is still waiting for its end."""
        return bool(self._pending.strip())


def _event(frame: bytes) -> tuple[str, dict[str, Any]]:
    name = b"message"
    data: list[bytes] = []
    for line in frame.split(b"\n"):
        field, _, value = line.partition(b":")
        value = value[1:] if value.startswith(b" ") else value
        if field == b"event":
            name = value
        elif field == b"data":
            data.append(value)
    try:
        payload = json.loads(b"\n".join(data))
    except ValueError:
        payload = None
    if not isinstance(payload, dict):
        raise Internal("the worker sent an event whose data is not a JSON object")
    return name.decode("utf-8", "replace"), payload


@implementer(IPushProducer)
class TimedStreamRelay(Protocol):
    """
    Receives a worker's 200 event stream and writes its audio and timings to a sink as
    they arrive, the sink's producer as the relay's plain one is.

    C{done} fires with the audio's byte count once the worker ended the stream with its
    done event, and fails when it did not (a truncated, broken or stalled stream);
    C{duration_ms} is then what the done event said.
    """

    def __init__(
        self, sink: ITimedSink, stalls: Stalls | None = None, measured: Measured | None = None
    ) -> None:
        self._sink = sink
        self._stalls = stalls
        self._measured = measured
        self._stall: Watched | None = None
        self._stalled = False
        self._reader = EventReader()
        self._broken: SpeechError | None = None
        self.whole = False
        self.received = 0
        self.duration_ms: int | None = None
        self.done: Deferred[int] = Deferred()

    def connectionMade(self) -> None:
        if self._stalls is not None:
            self._stall = self._stalls.watch(self._give_up)
        self._sink.registerProducer(self)

    def dataReceived(self, data: bytes) -> None:
        if self._broken is not None:
            return
        if self._stall is not None:
            self._stall.progress()
        try:
            for name, payload in self._reader.feed(data):
                self._event(name, payload)
        except SpeechError as error:
            self._broken = error
            self.stopProducing()

    def _event(self, name: str, payload: dict[str, Any]) -> None:
        if self.whole:
            raise Internal(f"the worker sent {name} after speech.audio.done")
        if name == "speech.audio.delta":
            try:
                audio = base64.b64decode(payload["audio"], validate=True)
            except (KeyError, TypeError, ValueError, binascii.Error):
                raise Internal("the worker sent an audio delta that is not base64") from None
            if not audio:
                return
            if not self.received and self._measured is not None:
                self._measured.first_audio()
            self.received += len(audio)
            self._sink.write(audio)
        elif name == "speech.timestamps.delta":
            try:
                contract.validate(contract.TIMESTAMPS_EVENT, payload)
            except SpeechError:
                raise Internal("the worker sent timestamps that are not the contract's Timing entries") from None
            self._sink.timestamps(payload["alignment"])
        elif name == "speech.audio.done":
            duration = payload.get("durationMs")
            self.duration_ms = duration if isinstance(duration, int) and not isinstance(duration, bool) else None
            self.whole = True
        # Any other event is a newer worker's, and an older reader ignores it (section 9).

    def connectionLost(self, reason: Failure = Failure(ResponseDone())) -> None:
        if self._stall is not None:
            self._stall.stop()
        self._sink.unregisterProducer()
        if self._stalled:
            self.done.errback(stalled(self._stalls.seconds if self._stalls else 0))
        elif self._broken is not None:
            self.done.errback(self._broken)
        elif not isinstance(reason.value, ResponseDone):
            self.done.errback(reason)
        elif not self.whole or self._reader.holding:
            self.done.errback(Internal("the worker's event stream ended without speech.audio.done"))
        else:
            self.done.callback(self.received)

    def _give_up(self) -> None:
        self._stalled = True
        self.stopProducing()

    # IPushProducer, for the sink

    def pauseProducing(self) -> None:
        if self._stall is not None:
            self._stall.pause()
        self.transport.pauseProducing()  # type: ignore[union-attr]

    def resumeProducing(self) -> None:
        if self._stall is not None:
            self._stall.resume()
        self.transport.resumeProducing()  # type: ignore[union-attr]

    def stopProducing(self) -> None:
        self.transport.stopProducing()  # type: ignore[union-attr]
