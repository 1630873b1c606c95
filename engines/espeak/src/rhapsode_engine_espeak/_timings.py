"""
eSpeak NG's synthesis events as timings (L{rhapsode_worker.Timing}).

espeak reports where things begin, never where they end: with each buffer of PCM the
synthesis callback gets the events that fall in it, a word's (its place in the text and
its first sample), a phoneme's (its IPA and its first sample; a pause is a phoneme with
no name), and the end of a clause.  So an entry is complete only once what follows it
has begun:

  - a phoneme ends where the next phoneme, pause, word or clause end begins;
  - a word ends where its last sound ends: before the pauses that trail it (the one
    after "dog." is not part of "dog"), not before one inside it ("p.m." has one);
  - the words espeak speaks for one stretch of text overlap there ("3:45" is read as
    words at 3, 45 and 5, and "45" and "5" share the 5), and they are handed over
    together, so that the SDK makes them one entry;
  - espeak reads a short unstressed word with the one before it ("was a", "on the",
    the m of "p.m.") and reports no event of its own for it: its sounds are timed with
    that word, so the word's text is taken on over it, up to the next word reported.

The SDK sends each timing before the audio holding its first sample, so L{Aligner} holds
back the PCM from the first sample of the first entry not complete yet, and gives out
the rest: on the first buffer that is the audio before the second word, so first audio
leaves with the same callback it would without timings.
"""

from __future__ import annotations

import struct
from typing import Iterable, NamedTuple

from rhapsode_worker import Timing

#: espeak_EVENT_TYPE values (speak_lib.h).
WORD, SENTENCE, END, PHONEME = 1, 2, 5, 7
#: One espeak_EVENT as the callback's list holds it, in the machine's own layout: type,
#: unique_identifier, text_position (1-based), length, audio_position, sample,
#: user_data, and the id union read as its 8-byte string (a phoneme's name).  The
#: callback copies the list out as these bytes, and the timings are read from them here,
#: off espeak's thread: making a Python object of every event in the callback cost more
#: than the rest of the timing.
RAW_EVENT = struct.Struct("@iIiiiiP8s")


class Event(NamedTuple):
    """
    One espeak event: its type, its place in the text (0-based code points; espeak's
    own are 1-based) and length, and the sample it falls on from the synthesis' start;
    a phoneme's IPA (none for a pause).
    """

    kind: int
    position: int
    length: int
    sample: int
    name: str = ""


def raw_events(events: Iterable[Event]) -> bytes:
    """
    Events as the callback copies them out (L{RAW_EVENT}): what a test feeds an
    L{Aligner} with.
    """
    return b"".join(
        RAW_EVENT.pack(e.kind, 0, e.position + 1, e.length, 0, e.sample, 0, e.name.encode("utf-8")[:8])
        for e in events
    )


class _Word:
    __slots__ = ("start", "text_start", "text_end", "sound_end")

    def __init__(self, start: int, text_start: int, text_end: int) -> None:
        self.start = start
        self.text_start = text_start
        self.text_end = text_end
        #: Where the last sound of the word heard so far ended; None before any.
        self.sound_end: int | None = None


class Aligner:
    """
    One synthesis' PCM and events in, its PCM and timings out, each timing before the
    audio of its first sample.

    @param rate: the PCM's sample rate.
    @param unit: C{"word"}, or C{"phoneme"} for phonemes too.
    @param text: the text espeak is speaking, which its events' positions are into.
    @param frame: bytes per sample of the PCM.
    """

    def __init__(self, rate: int, unit: str, text: str = "", frame: int = 2) -> None:
        self._rate = rate
        self._text = text
        self._phonemes = unit == "phoneme"
        self._frame = frame
        # PCM not given out yet, in the pieces it came in (most go out whole, uncopied).
        self._held: list[bytes] = []
        self._released = 0  # samples given out
        self._received = 0
        self._word: _Word | None = None
        self._phoneme: tuple[int, str] | None = None
        # Words complete but waiting: the next word might still overlap their text.
        self._group: list[_Word] = []
        self._ready: list[tuple[int, int, Timing]] = []
        # Timing words only, a phoneme tells nothing but whether it sounds: whether the
        # last one did (a word's start counts as silence, so its first sound is seen).
        self._sounding = False

    def feed(self, pcm: bytes, raw: bytes) -> list[bytes | Timing]:
        """
        One callback's buffer and its events (L{RAW_EVENT}s): what can go out now.
        """
        if pcm:
            self._held.append(pcm)
        self._received += len(pcm) // self._frame
        if raw:
            self._events(raw)
        return self._release(self._hold())

    def close(self) -> list[bytes | Timing]:
        """
        The synthesis is over: everything still held.
        """
        self._end(self._received, len(self._text))
        return self._release(None)

    # -- events ----------------------------------------------------------------------

    def _events(self, raw: bytes) -> None:
        # Each buffer's few events unpacked in one C call: cheaper than reading them as
        # columns of ints.
        if not self._phonemes:
            self._word_events(raw)
            return
        for kind, _, position, length, _, sample, _, name in RAW_EVENT.iter_unpack(raw):
            if kind == PHONEME:
                self._close_phoneme(sample)
                if name[0]:  # a pause has no name
                    self._phoneme = (sample, name.split(b"\0", 1)[0].decode("utf-8", "replace").strip())
            elif kind == WORD:
                self._close_phoneme(sample)
                self._open_word(sample, position, length)
            elif kind == END:
                self._end(sample, position - 1)

    def _word_events(self, raw: bytes) -> None:
        """
        L{_events} timing words alone: a phoneme matters only where sound begins (a
        word's sounds are under way) or stops (the last sound so far ends there).
        """
        sounding = self._sounding
        for kind, _, position, length, _, sample, _, name in RAW_EVENT.iter_unpack(raw):
            if kind == PHONEME:
                sounds = name[0] != 0  # a pause has no name
                if sounds == sounding:
                    continue  # no change: nothing ends or begins
                sounding = sounds
                if self._phoneme is not None:
                    self._close_phoneme(sample)
                if sounds:
                    self._phoneme = (sample, "~")
            elif kind == WORD or kind == END:
                sounding = False
                if kind == WORD:
                    self._close_phoneme(sample)
                    self._open_word(sample, position, length)
                else:
                    self._end(sample, position - 1)
        self._sounding = sounding

    def _open_word(self, sample: int, position: int, length: int) -> None:
        """A word begins at C{sample}, at espeak's 1-based C{position} in the text."""
        word = _Word(sample, position - 1, position - 1 + max(length, 0))
        self._close_word(sample, word)
        self._word = word

    def _end(self, sample: int, position: int) -> None:
        self._close_phoneme(sample)
        self._close_word(sample, None, position)

    def _close_phoneme(self, sample: int) -> None:
        phoneme, self._phoneme = self._phoneme, None
        if phoneme is None:
            return
        start, name = phoneme
        if self._word is not None:
            self._word.sound_end = sample
        if self._phonemes:
            self._ready.append((start, 1, Timing("phoneme", start / self._rate, sample / self._rate, text=name)))

    def _close_word(self, sample: int, following: _Word | None, limit: int | None = None) -> None:
        """
        The open word ends (at its last sound, else at C{sample}, its text taken on
        over words espeak read with it, up to C{following} or C{limit}); it waits with
        its group while C{following} overlaps the group's text, else the group goes out.
        """
        word, self._word = self._word, None
        if word is not None:
            bound = following.text_start if following is not None else limit
            word.text_end = self._taken_on(word.text_end, bound if bound is not None else word.text_end)
            self._group.append(word)
        if not self._group:
            return
        if following is not None and word is not None and self._overlaps(following):
            return
        for member in self._group:
            end = member.sound_end if member.sound_end is not None else sample
            timing = Timing(
                "word",
                member.start / self._rate,
                max(end, member.start) / self._rate,
                text_start=member.text_start,
                text_end=member.text_end,
            )
            self._ready.append((member.start, 0, timing))
        self._group = []

    def _taken_on(self, end: int, bound: int) -> int:
        """
        Where a word's text ends once it takes on the words after it that have no event
        of their own: the end of the last run of letters or digits before C{bound}.
        """
        text = self._text
        last = end
        for index in range(end, min(bound, len(text))):
            if text[index].isalnum():
                last = index + 1
        return last

    def _overlaps(self, word: _Word) -> bool:
        group = self._group
        if len(group) == 1:  # nearly always: one word, no expansion
            start, end = group[0].text_start, group[0].text_end
        else:
            start = min(member.text_start for member in group)
            end = max(member.text_end for member in group)
        return word.text_start < end and word.text_end > start

    # -- what goes out -----------------------------------------------------------------

    def _hold(self) -> int | None:
        """
        The first sample of the first entry not complete yet (None: nothing is open).
        """
        hold = self._group[0].start if self._group else None
        if self._word is not None and (hold is None or self._word.start < hold):
            hold = self._word.start
        if self._phonemes and self._phoneme is not None and (hold is None or self._phoneme[0] < hold):
            hold = self._phoneme[0]
        return hold

    def _release(self, hold: int | None) -> list[bytes | Timing]:
        ready = self._ready
        received, released = self._received, self._released
        upto = received if hold is None or hold >= received else hold if hold > released else released
        if not ready and upto == released:
            return []  # about half the buffers: a word goes on, nothing is complete
        out: list[bytes | Timing] = []
        if ready:
            if len(ready) > 1:
                # In order of start, a word before the phonemes it begins with.
                ready.sort(key=_order)
            if hold is None or ready[-1][0] < hold:
                out.extend([item[2] for item in ready])
                self._ready = []
            else:
                keep: list[tuple[int, int, Timing]] = []
                for item in ready:
                    if item[0] < hold:
                        out.append(item[2])
                    else:
                        keep.append(item)
                self._ready = keep
        count = (upto - released) * self._frame
        if count <= 0:
            return out
        held = self._held
        self._released = upto
        if len(held[0]) == count:  # nothing to cut: the first piece held goes whole
            out.append(held.pop(0))
            return out
        pieces: list[bytes] = []
        while count and held:
            piece = held[0]
            if len(piece) <= count:
                pieces.append(held.pop(0))
                count -= len(piece)
            else:
                pieces.append(piece[:count])
                held[0] = piece[count:]
                count = 0
        out.append(pieces[0] if len(pieces) == 1 else b"".join(pieces))
        return out


def _order(item: tuple[int, int, Timing]) -> tuple[int, int]:
    return item[0], item[1]
