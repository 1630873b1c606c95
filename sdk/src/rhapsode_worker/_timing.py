"""
Timings from an adapter to the wire (protocol.md section 4, "timestamps"): what the SDK
does with the L{Timing}s an adapter yields among its PCM, so that no adapter ever
counts segments, maps offsets or writes a frame.

  - B{Offsets.}  An adapter times its own audio, from the start of what one call of
    C{speak} yields.  The SDK adds everything the answer holds before that: the
    segments before it and the joint silences it put between them (L{Timeline.step}).
  - B{Text.}  An adapter gives offsets into the text it was handed, one segment of the
    cleaned text; the SDK takes them back through its splitting
    (L{rhapsode_protocol.text.Piece}) and its cleaning
    (L{rhapsode_protocol.vocab.TextMap}) to the text the caller sent, and each word's
    C{text} is then the caller's own at those offsets.
  - B{Merging.}  The words an engine speaks for one stretch of text overlap there
    (eSpeak reads "3:45" as words at 3, 45 and 5); those handed over together become
    one entry covering the stretch, from the first's start to the last's end.  Entries
    of one unit never overlap in time and stay in order.
  - B{Framing.}  Server-sent events for a stream and one JSON document for a buffered
    answer, as the public API answers (L{EVENTS}); for the core, which asks with
    C{Accept: application/vnd.rhapsode.frames}, length-prefixed frames that carry the
    audio untouched (L{FRAMED}, L{rhapsode_protocol.frames}).  The response writes them
    (L{rhapsode_worker._routes}).

Everything here runs on the reactor thread, on the few entries of one batch at a time.
"""

from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

from twisted.web.iweb import IRequest

from rhapsode_protocol import frames
from rhapsode_protocol.errors import BadRequest
from rhapsode_protocol.http.answers import accepts
from rhapsode_protocol.schemas import TIMED_EVENTS, TIMED_JSON
from rhapsode_protocol.text import Piece
from rhapsode_protocol.vocab import TextMap

from ._engine import Timing

__all__ = ["EVENTS", "FRAMED", "Framing", "LazyMap", "Source", "Timeline", "framing_for", "sse_event"]

#: Seconds are written to the microsecond: below a sample at any rate an engine makes.
_PER_SECOND = 1e6
#: How the wire's JSON is written: compact, and UTF-8 as it is (made once, not per call).
_ENCODE = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


class Spans(Protocol):
    """Where a cleaned text's spans came from (L{TextMap})."""

    def span(self, start: int, end: int) -> tuple[int, int]: ...


class LazyMap:
    """
    A L{TextMap} made the first time a timing needs it, off the path to first audio: the
    synthesis starts on the cleaned text, and the map (several times the cleaning's
    work) is made while the engine makes its first audio.
    """

    def __init__(self, make: Callable[[], TextMap]) -> None:
        self._make = make
        self._map: TextMap | None = None

    def span(self, start: int, end: int) -> tuple[int, int]:
        if self._map is None:
            self._map = self._make()
        return self._map.span(start, end)


@dataclass(frozen=True)
class Source:
    """
    Where one step's (or one turn's) text came from: the caller's text, how cleaning
    moved it (C{cleaned}), and for a step of a split text the piece it was handed.
    """

    caller: str
    cleaned: Spans
    piece: Piece | None = None
    speaker: str | None = None

    def caller_span(self, start: int, end: int) -> tuple[int, int]:
        """
        The caller's span for the adapter's C{[start, end)}, whitespace trimmed off
        both ends (an engine's word may take the space after it).
        """
        if self.piece is not None:
            start, end = self.piece.source(start, end)
        start, end = self.cleaned.span(start, end)
        text = self.caller
        while start < end and text[start].isspace():
            start += 1
        while end > start and text[end - 1].isspace():
            end -= 1
        return start, end


class Timeline:
    """
    One answer's timings: the unit asked for, the rate its samples count at, and the
    text sources of its steps (a speech's segments) or turns (a dialogue's).

    @param unit: C{"word"} keeps words; C{"phoneme"} keeps phonemes and the words they
        make up.
    @param offsets: whether the variant claims text offsets; without, none is written.
    @param steps: a speech's sources, one per segment; C{turns} a dialogue's, one per turn.
    """

    def __init__(
        self,
        unit: str,
        rate: int,
        offsets: bool,
        steps: Sequence[Source] = (),
        turns: Sequence[Source] = (),
    ) -> None:
        self._units = {"word"} if unit == "word" else {"word", "phoneme"}
        self._rate = rate
        self._offsets = offsets
        self._steps = steps
        self._turns = turns
        self._step = 0
        self._base = 0.0
        # Per unit, where the last entry written ended, and for words its text span.
        self._ends: dict[str, float] = {}
        self._last_span: tuple[int | None, int] | None = None
        #: Every entry made so far, for a buffered answer's document.
        self.entries: list[dict[str, Any]] = []

    def step(self, index: int, frames: int) -> None:
        """
        Step C{index} begins after C{frames} frames of the answer (its segments before
        and the joints between them).
        """
        self._step = index
        self._base = frames / self._rate

    def take(self, marks: Sequence[Timing]) -> list[dict[str, Any]]:
        """
        The entries for the timings of one hand-over, in order, each offset, mapped and
        merged; those are also kept in L{entries}.
        """
        made: list[dict[str, Any]] = []
        word: dict[str, Any] | None = None  # the last word made, phonemes between or not
        for mark in marks:
            if mark.unit not in self._units:
                continue
            entry = self._entry(mark)
            if entry is None:
                continue
            if word is not None and self._merges(word, entry):
                _absorb(word, entry, self._source(entry).caller)
                continue
            if self._overlaps_written(entry):
                # The words of an expansion handed over apart: the one written already
                # holds this stretch of text, and cannot be changed any more.
                continue
            if entry["unit"] == "word":
                word = entry
            made.append(entry)
        for entry in made:
            self._settle(entry)
        self.entries.extend(made)
        return made

    # -- one entry -------------------------------------------------------------------

    def _source(self, entry: Mapping[str, Any]) -> Source:
        if self._turns:
            return self._turns[entry.get("turn", 0)]
        return self._steps[min(self._step, len(self._steps) - 1)]

    def _entry(self, mark: Timing) -> dict[str, Any] | None:
        # Plain comparisons rather than max(): this runs for every word and phoneme.
        start = float(mark.start)
        if start < 0.0:
            start = 0.0
        end = float(mark.end)
        if end < start:
            end = start
        entry: dict[str, Any] = {"unit": mark.unit, "text": mark.text, "start": self._base + start,
                                 "end": self._base + end}
        if self._turns:
            turn = mark.turn if mark.turn is not None and 0 <= mark.turn < len(self._turns) else None
            if turn is None:
                return None  # a dialogue's timing must say whose turn it is
            entry["turn"] = turn
            speaker = self._turns[turn].speaker
            if speaker is not None:
                entry["speaker"] = speaker
        if (
            self._offsets
            and mark.unit == "word"
            and mark.text_start is not None
            and mark.text_end is not None
            and mark.text_end > mark.text_start >= 0
        ):
            source = self._source(entry)
            begin, finish = source.caller_span(mark.text_start, mark.text_end)
            if finish <= begin:
                return None  # only whitespace: nothing a reader would follow
            entry["textStart"], entry["textEnd"] = begin, finish
            entry["text"] = source.caller[begin:finish]
        return entry

    @staticmethod
    def _merges(previous: Mapping[str, Any], entry: Mapping[str, Any]) -> bool:
        return (
            entry["unit"] == "word" == previous["unit"]
            and "textStart" in entry
            and "textStart" in previous
            and entry.get("turn") == previous.get("turn")
            and entry["textStart"] < previous["textEnd"]
            and entry["textEnd"] > previous["textStart"]
        )

    def _overlaps_written(self, entry: Mapping[str, Any]) -> bool:
        last = self._last_span
        return (
            entry["unit"] == "word"
            and "textStart" in entry
            and last is not None
            and last[0] == entry.get("turn")
            and entry["textStart"] < last[1]
        )

    def _settle(self, entry: dict[str, Any]) -> None:
        """
        Keep the unit in order and without overlaps in time, and round the seconds.
        """
        unit = entry["unit"]
        floor = self._ends.get(unit, 0.0)
        start = entry["start"]
        # To the nearest microsecond, a half up: a third of round(x, 6)'s cost, which
        # works in decimal, for every entry.
        start = math.floor((start if start > floor else floor) * _PER_SECOND + 0.5) / _PER_SECOND
        end = entry["end"]
        end = math.floor(end * _PER_SECOND + 0.5) / _PER_SECOND if end > start else start
        entry["start"], entry["end"] = start, end
        self._ends[unit] = end
        if unit == "word" and "textEnd" in entry:
            self._last_span = (entry.get("turn"), entry["textEnd"])


def _absorb(into: dict[str, Any], entry: Mapping[str, Any], caller: str) -> None:
    """
    Two words spoken for overlapping text are one: the stretch they cover together, from
    the first's start to the last's end.
    """
    into["textStart"] = min(into["textStart"], entry["textStart"])
    into["textEnd"] = max(into["textEnd"], entry["textEnd"])
    into["text"] = caller[into["textStart"]:into["textEnd"]]
    into["start"] = min(into["start"], entry["start"])
    into["end"] = max(into["end"], entry["end"])


def sse_event(kind: str, payload: Mapping[str, Any]) -> bytes:
    """
    One server-sent event named C{kind}; its data is C{payload} with C{type} as JSON, on
    one line (JSON escapes every line break a string holds).
    """
    data = _ENCODE({"type": kind, **payload})
    return b"event: %s\ndata: %s\n\n" % (kind.encode("ascii"), data.encode("utf-8"))


class Framing:
    """
    How a timed answer is written: each piece of audio, each batch of timings and the
    end of a stream, or a buffered answer whole; and the Content-Type of each.
    """

    stream_type = ""
    document_type = ""

    def audio(self, data: bytes) -> Sequence[bytes]:
        """The bytes to write for a piece of audio, in order."""
        raise NotImplementedError

    def timings(self, entries: Sequence[Mapping[str, Any]]) -> bytes:
        raise NotImplementedError

    def done(self, duration_ms: int) -> bytes:
        raise NotImplementedError

    def document(self, audio: bytes, head: Mapping[str, Any], entries: Sequence[Mapping[str, Any]]) -> bytes:
        raise NotImplementedError


class _Events(Framing):
    """
    The public API's: server-sent events (audio deltas with OpenAI's names, timings,
    done), and the TimedAudio document.
    """

    stream_type = TIMED_EVENTS
    document_type = TIMED_JSON

    def audio(self, data: bytes) -> Sequence[bytes]:
        # Base64's alphabet needs no escaping: spliced in rather than encoded as JSON.
        return (b"".join((
            b'event: speech.audio.delta\ndata: {"type":"speech.audio.delta","audio":"',
            base64.b64encode(data),
            b'"}\n\n',
        )),)

    def timings(self, entries: Sequence[Mapping[str, Any]]) -> bytes:
        return sse_event("speech.timestamps.delta", {"alignment": list(entries)})

    def done(self, duration_ms: int) -> bytes:
        return sse_event("speech.audio.done", {"durationMs": duration_ms})

    def document(self, audio: bytes, head: Mapping[str, Any], entries: Sequence[Mapping[str, Any]]) -> bytes:
        rest = json.dumps({**head, "alignment": list(entries)}, ensure_ascii=False)
        return b"".join((b'{"audio":"', base64.b64encode(audio), b'",', rest[1:].encode("utf-8")))


class _Frames(Framing):
    """
    The core's: length-prefixed frames, the audio as it is (L{rhapsode_protocol.frames}).
    A buffered answer is its timings, its audio and its end, the end holding what the
    document would say of the audio.
    """

    stream_type = document_type = frames.FRAMES

    def audio(self, data: bytes) -> Sequence[bytes]:
        # The head, then the audio itself: never copied into one frame.
        return frames.head(frames.AUDIO, len(data)), data

    def timings(self, entries: Sequence[Mapping[str, Any]]) -> bytes:
        return frames.frame(frames.TIMINGS, _json(list(entries)))

    def done(self, duration_ms: int) -> bytes:
        return frames.frame(frames.DONE, _json({"durationMs": duration_ms}))

    def document(self, audio: bytes, head: Mapping[str, Any], entries: Sequence[Mapping[str, Any]]) -> bytes:
        # The audio's head beside it, not a frame made of both: a copy of the audio fewer.
        return b"".join((
            self.timings(entries),
            frames.head(frames.AUDIO, len(audio)),
            audio,
            frames.frame(frames.DONE, _json(head)),
        ))


def _json(value: Any) -> bytes:
    return _ENCODE(value).encode("utf-8")


EVENTS: Framing = _Events()
FRAMED: Framing = _Frames()


def framing_for(request: IRequest, stream: bool) -> Framing:
    """
    The framing a request with timestamps reads, by its Accept: the core's frames where
    it names them, else the public API's, which it must name.

    @raise BadRequest: naming C{timestamps}, for an Accept that names neither.
    """
    if accepts(request, frames.FRAMES):
        return FRAMED
    wanted = TIMED_EVENTS if stream else TIMED_JSON
    if accepts(request, wanted):
        return EVENTS
    how = "a stream of server-sent events" if stream else "a JSON document"
    raise BadRequest(
        f"timestamps with stream {str(stream).lower()} are answered as {how}: send "
        f'"Accept: {wanted}" (raw audio has no place for them)',
        field="timestamps",
    )
