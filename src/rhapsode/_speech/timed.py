"""
A timed answer from a worker to a sink (protocol.md section 4, "timestamps").

The core asks a worker for a timed answer in frames (L{rhapsode_protocol.frames},
C{Accept: application/vnd.rhapsode.frames}): the audio's bytes as they are, the timings
as JSON before the audio holding their first samples, and an end.  A worker answers its
other clients (an engine author with curl) as the public API does, in events or a JSON
document with the audio in base64; between the core and its worker that would be a
third more bytes and a pass of base64 each way over all the audio, which measured about
40 ms for the 5.7 MB of PCM in 2000 characters of eSpeak NG, whose synthesis of them
takes about 100 ms (bench/timestamps.py).

The relay reads the frames here and writes an L{ITimedSink}: audio as bytes and timings
as entries, in the order they came, so that each door frames them its own way (events,
a document, WebSocket messages, MCP's result).  Everything else is the relay's rule for
any answer: the relay is the sink's producer, so a slow reader pauses the worker's
socket; a body under the floor, truncated, stalled, or ended without its end frame
aborts a sink that has started and is the door's error before that; a buffered answer
is read whole within a bound and the core's budget before anything is written.
"""

from __future__ import annotations

from typing import Any, Mapping

from twisted.internet.defer import Deferred
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone

from rhapsode_protocol import contract, frames
from rhapsode_protocol.errors import Internal, SpeechError

from .._interfaces import ITimedSink
from .._upstream import Stalls, WatchedBody
from .metrics import Measured

__all__ = [
    "AUDIO_TYPE_HEADER",
    "CHANNELS_HEADER",
    "RATE_HEADER",
    "TimedStreamRelay",
    "WORKER_ACCEPT",
    "read_frames",
    "timed_limit",
]

#: What a timed request to a worker asks for: frames, streamed or buffered.
WORKER_ACCEPT = frames.FRAMES.encode("ascii")
#: The header of a timed answer naming its audio's own type.
AUDIO_TYPE_HEADER = b"X-Rhapsode-Audio-Type"
#: What a buffered timed answer's audio is, told to its sink beside the Content-Type
#: (the document it is answered in says them).
RATE_HEADER = b"X-Rhapsode-Sample-Rate"
CHANNELS_HEADER = b"X-Rhapsode-Channels"
#: What a timed answer's alignment may add per character of text, as JSON: a word and
#: its phonemes take a few entries of about a hundred bytes each.
_ALIGNMENT_BYTES_PER_CHARACTER = 512
#: The end of a buffered timed answer: what the document says of the audio.
_BUFFERED_END: dict[str, Any] = {
    "type": "object",
    "properties": {
        key: contract.TIMED_AUDIO["properties"][key]
        for key in ("format", "contentType", "sampleRate", "channels", "durationMs")
    },
    "required": ["format", "contentType", "sampleRate", "channels", "durationMs"],
}
_ALIGNMENT = contract.TIMED_AUDIO["properties"]["alignment"]


def timed_limit(buffered: int, caps: Mapping[str, Any], variant: str) -> int:
    """
    The most a buffered timed answer can be: its audio's bound, and its alignment's for
    the variant's ceiling of text.
    """
    performs = caps.get("variants", {}).get(variant, {})
    characters = int(performs.get("maxCharacters") or 4096)
    return buffered + 4096 + characters * _ALIGNMENT_BYTES_PER_CHARACTER


def _entries(value: Any) -> list[Any]:
    try:
        contract.validate(_ALIGNMENT, value)
    except SpeechError:
        raise Internal("the worker sent timings that are not the contract's Timing entries") from None
    return list(value)


def read_frames(raw: bytes) -> tuple[list[bytes], list[Any], dict[str, Any]]:
    """
    A buffered timed answer: its audio (the pieces the worker framed it in, in order),
    its timings and its end.

    @raise Internal: a body that is not the frames of one whole answer.
    """
    reader = frames.FrameReader()
    try:
        found = reader.feed(raw)
    except frames.FrameError as error:
        raise Internal(f"the worker's timed answer is not frames: {error}") from None
    audio: list[bytes] = []
    entries: list[Any] = []
    end: dict[str, Any] | None = None
    for kind, payload in found:
        if kind == frames.AUDIO:
            audio.append(payload)
        elif kind == frames.TIMINGS:
            entries.extend(_entries(payload))
        elif kind == frames.DONE:
            end = payload
    if end is None or reader.holding:
        raise Internal("the worker's timed answer ended without its end")
    try:
        contract.validate(_BUFFERED_END, end)
    except SpeechError:
        raise Internal("the worker's timed answer ended without saying what its audio is") from None
    return audio, entries, end


class TimedStreamRelay(WatchedBody):
    """
    Receives a worker's 200 event stream and writes its audio and timings to a sink as
    they arrive, the sink's producer (L{rhapsode._upstream.WatchedBody}).

    C{done} fires with the audio's byte count once the worker ended the stream with its
    end frame, and fails when it did not (a truncated, broken or stalled stream);
    C{duration_ms} is then what the end said.
    """

    def __init__(
        self, sink: ITimedSink, stalls: Stalls | None = None, measured: Measured | None = None
    ) -> None:
        super().__init__(sink, stalls)
        self._timed = sink
        self._measured = measured
        self._reader = frames.FrameReader()
        self._broken: SpeechError | None = None
        self.whole = False
        self.received = 0
        self.duration_ms: int | None = None
        self.done: Deferred[int] = Deferred()

    def dataReceived(self, data: bytes) -> None:
        if self._broken is not None:
            return
        self.progress()
        try:
            found = self._reader.feed(data)
        except frames.FrameError as error:
            self._fail(Internal(f"the worker's timed stream is not frames: {error}"))
            return
        try:
            for kind, payload in found:
                self._frame(kind, payload)
        except SpeechError as error:
            self._fail(error)

    def _fail(self, error: SpeechError) -> None:
        self._broken = error
        self.stopProducing()

    def _frame(self, kind: bytes, payload: Any) -> None:
        if self.whole:
            raise Internal("the worker sent a frame after its end")
        if kind == frames.AUDIO:
            if not payload:
                return
            if not self.received and self._measured is not None:
                self._measured.first_audio()
            self.received += len(payload)
            self._timed.write(payload)
        elif kind == frames.TIMINGS:
            self._timed.timestamps(_entries(payload))
        elif kind == frames.DONE:
            duration = payload.get("durationMs") if isinstance(payload, dict) else None
            self.duration_ms = duration if isinstance(duration, int) and not isinstance(duration, bool) else None
            self.whole = True

    def connectionLost(self, reason: Failure = Failure(ResponseDone())) -> None:
        gave_up = self.finished()
        if gave_up is not None:
            self.done.errback(gave_up)
        elif self._broken is not None:
            self.done.errback(self._broken)
        elif not isinstance(reason.value, ResponseDone):
            self.done.errback(reason)
        elif not self.whole or self._reader.holding:
            self.done.errback(Internal("the worker's timed stream ended without its end"))
        else:
            self.done.callback(self.received)
