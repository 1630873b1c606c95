"""
From text to tones: the tone engine's reading of a line.

Text becomes events (words, cues, pauses); a L{Reader} turns them into PCM.  Each
word is one tone per syllable-sized chunk of letters, at a pitch drawn from the word
itself, the voice and the sentence's intonation, for as long as its letters take to
say at about fourteen characters a second.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from random import Random
from typing import Iterator, Sequence, Union

from rhapsode_worker import Timing

from ._cues import CUES, Throat
from ._synth import LANGUAGES, SAMPLE_RATE, Palette, mix, ramped, silence, tone

#: The engine's own tag syntax, which nobody may use: it is stripped, never read out.
PRIVATE_TAG = r"<[A-Za-z]+>"

CHARACTERS_PER_SECOND = 14.0
# Pauses, in characters' worth of time, so the rate scales them with everything else.
_WORD_GAP = 1.0
_CLAUSE_PAUSE = 3.5
_SENTENCE_PAUSE = 6.3

_TOKENS = re.compile(
    r"\[(?P<bracket>[^\[\]]*)\]"
    rf"|{PRIVATE_TAG}"
    r"|(?P<word>[^\W_]+(?:['’][^\W_]+)*)"
    r"|(?P<sentence>[.!?…。！？]+)"
    r"|(?P<clause>[,;:、，；：—–])"
)


@dataclass(frozen=True)
class Word:
    """
    A word, its place in its sentence, and the mark that ends the sentence on it.
    """

    text: str
    position: int
    final: str = ""
    #: Where the word stands in the text parsed, in code points.
    span: tuple[int, int] = (0, 0)


@dataclass(frozen=True)
class Cue:
    """
    A cue of the vocabulary, performed where it was written.
    """

    name: str


@dataclass(frozen=True)
class Pause:
    """
    A pause after punctuation, as long as this many characters take to say.
    """

    characters: float


Event = Union[Word, Cue, Pause]


def parse(text: str, cues: frozenset[str]) -> list[Event]:
    """
    The events of C{text}, performing only C{cues}.

    Any other bracketed text, a cue or not, and the engine's private tags are skipped:
    they are never read as words.
    """
    events: list[Event] = []
    position = 0
    for match in _TOKENS.finditer(text):
        if match["bracket"] is not None:
            name = " ".join(match["bracket"].lower().split())
            if name in cues:
                events.append(Cue(name))
        elif match["word"] is not None:
            events.append(Word(match["word"], position, span=match.span()))
            position += 1
        elif match["sentence"] is not None:
            if events and isinstance(events[-1], Word):
                last = events[-1]
                mark = "?" if any(c in "?？" for c in match["sentence"]) else "."
                events[-1] = Word(last.text, last.position, mark, last.span)
            events.append(Pause(_SENTENCE_PAUSE))
            position = 0
        elif match["clause"] is not None:
            events.append(Pause(_CLAUSE_PAUSE))
    return events


def _syllables(word: str, letters: int) -> list[str]:
    count = -(-len(word) // letters)
    size, extra = divmod(len(word), count)
    chunks = []
    start = 0
    for i in range(count):
        end = start + size + (1 if i < extra else 0)
        chunks.append(word[start:end])
        start = end
    return chunks


@dataclass(frozen=True)
class Reader:
    """
    One voice reading in one language, with its delivery and dials already applied.

    @ivar pitch: the reader's base pitch in Hz.
    @ivar gain: the reader's level, a fraction of full scale.
    @ivar seconds_per_character: how long a letter takes; pauses scale with it.
    @ivar tremolo: (rate Hz, depth), or None.
    @ivar breath: the level of breath noise under each tone, a fraction of full scale.
    """

    palette: Palette
    language: str
    brightness: float
    pitch: float
    gain: float
    seconds_per_character: float
    tremolo: tuple[float, float] | None = None
    breath: float = 0.0

    @property
    def table(self) -> list[float]:
        return self.palette.table(self.language, self.brightness)

    def _characters(self, count: float) -> int:
        return round(count * self.seconds_per_character * SAMPLE_RATE)

    def perform(self, events: Sequence[Event], rng: Random, timed: str | None = None) -> Iterator[bytes | Timing]:
        """
        PCM for C{events}, a piece per word, cue or gap; with C{timed} ("word" or
        "phoneme"), each word's L{Timing} (and each of its syllable tones', for
        phonemes) before its PCM, exact to the sample, counted from this call's first.

        Pauses before the first sound and after the last are dropped, and a run of
        pauses is the longest of them, so ", ." does not pause twice.
        """
        table = self.table
        pending: float | None = None
        started = False
        samples = 0
        for event in events:
            if isinstance(event, Pause):
                pending = max(pending or 0.0, event.characters)
                continue
            if started:
                gap = silence(self._characters(pending or _WORD_GAP))
                samples += len(gap) // 2
                yield gap
            pending = None
            started = True
            if isinstance(event, Cue):
                sound = CUES[event.name](Throat(self.palette, table, self.pitch, self.gain, rng))
                samples += len(sound) // 2
                yield sound
                continue
            tones = list(self._word(table, event, rng))
            if timed is not None:
                yield from self._timings(event, tones, samples, timed)
            for pcm in tones:
                samples += len(pcm) // 2
                yield pcm

    def _timings(self, word: Word, tones: Sequence[bytes], at: int, unit: str) -> Iterator[Timing]:
        """
        The timings of one word whose tones start C{at} samples in: the word, then its
        syllables as phonemes.
        """
        chunks = _syllables(word.text, LANGUAGES[self.language].syllable_letters)
        lengths = [len(pcm) // 2 for pcm in tones]
        total = sum(lengths)
        yield Timing("word", at / SAMPLE_RATE, (at + total) / SAMPLE_RATE,
                     text_start=word.span[0], text_end=word.span[1])
        if unit != "phoneme":
            return
        for chunk, length in zip(chunks, lengths):
            yield Timing("phoneme", at / SAMPLE_RATE, (at + length) / SAMPLE_RATE, text=chunk)
            at += length

    def _word(self, table: list[float], word: Word, rng: Random) -> Iterator[bytes]:
        # A stable hash (never the salted hash()) makes each word's melody the same in
        # every process, and different in each language.
        digest = zlib.crc32(f"{self.language}:{word.text.lower()}".encode())
        semitones = (
            digest % 7 - 3 - min(2.0, 0.3 * word.position) + rng.uniform(-0.4, 0.4)
        )
        chunks = _syllables(word.text, LANGUAGES[self.language].syllable_letters)
        for i, chunk in enumerate(chunks):
            step = ((digest >> (8 + (2 * i) % 24)) & 3) * 0.5 - 0.75
            if i == len(chunks) - 1 and word.final:
                step += 3.0 if word.final == "?" else -1.5
            freq = self.pitch * 2 ** ((semitones + step) / 12)
            count = self._characters(len(chunk))
            pcm = tone(table, freq, count, self.gain, self.tremolo)
            if self.breath:
                pcm = ramped(
                    mix(pcm, self.palette.breath(rng.randrange(SAMPLE_RATE), count, self.breath))
                )
            yield pcm
