"""
eSpeak NG's offer in Rhapsode's terms: which espeak voice speaks each language, which
espeak variants are Rhapsode voices, and the espeak parameters a request's dials and
delivery come to.

Pure functions over the records espeak_ListVoices returns, with no ctypes, so that they
are unit-tested without the library.

The mapping: espeak's own "voices" are languages (gmw/en-US speaks American English),
and its "variants" (!v/f3, !v/whisper, !v/klatt...) are timbres that any language can
wear.  So a Rhapsode language picks the espeak voice, a Rhapsode voice picks the
variant, and a request with no voice hears the language's own voice, no variant.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Container, Iterable, Mapping

from rhapsode_worker import Dial

#: espeak_PARAMETER values (speak_lib.h).
RATE = 1
VOLUME = 2
PITCH = 3
RANGE = 4
WORDGAP = 7

#: The dials are espeak's own parameters, with the ranges and defaults speak_lib.h gives
#: them.  Above 450 words a minute espeak speeds its output up with libsonic rather than
#: speaking faster, which speak_lib.h leaves out of the range, and so do we.  Word gap
#: has no ceiling in espeak: a second between words is ours.
DIALS: dict[str, Dial] = {
    "rate": Dial(80, 450, 175),  # words per minute
    "pitch": Dial(0, 100, 50),  # 50 is the voice's own
    "volume": Dial(0, 200, 100),  # amplitude: 0 is silence, above 100 espeak compresses
    "wordGap": Dial(0, 100, 0),  # extra pause between words, in 10 ms at the default rate
}

#: espeak's embedded commands: control-A, an optional signed number and a command
#: letter ("\x0120A" sets the amplitude).  espeak obeys them even in plain text, so
#: they are the engine's private tag syntax, removed before espeak sees the text.
EMBEDDED_COMMAND = r"\x01[+-]?\d*[A-Za-z]?"

#: espeak's pitch range (espeakRANGE) when no delivery asks otherwise: "normal".
NORMAL_RANGE = 50

_MAX_ID = 64
_SPACES = re.compile(r"\s+")
_UNFIT = re.compile(r"[^a-z0-9_-]")


@dataclass(frozen=True)
class VoiceRecord:
    """
    One espeak_VOICE, as espeak_ListVoices gives it.

    @ivar languages: (priority, code) pairs; the lower the number, the better the voice
        speaks that language.
    @ivar gender: 0 unknown, 1 male, 2 female.
    """

    name: str
    identifier: str
    gender: int
    age: int
    languages: tuple[tuple[int, str], ...]


@dataclass(frozen=True)
class Timbre:
    """
    A Rhapsode voice: an espeak variant, worn by whichever language is asked for.

    @ivar variant: the variant's file name, which "<voice>+<variant>" selects.
    """

    id: str
    label: str
    variant: str
    gender: int
    age: int


@dataclass(frozen=True)
class Delivery:
    """
    How a delivery moves espeak's parameters away from the request's own: factors on
    rate, volume and pitch range, and a step in espeak's 0-100 pitch scale.
    """

    rate: float
    pitch: float
    volume: float
    range: float


DELIVERIES: dict[str, Delivery] = {
    # Quieter by 7 dB, a little lower, slower and flatter.
    "hushed": Delivery(rate=0.85, pitch=-12, volume=0.45, range=0.6),
    # Faster, higher, louder, and with a wider swing of pitch.
    "frantic": Delivery(rate=1.35, pitch=15, volume=1.3, range=1.6),
}


def voice_id(name: str, taken: Container[str]) -> str:
    """
    A voice id made of an espeak name: lower case, accents dropped, spaces as hyphens,
    anything else outside the id rule removed, and a number appended when C{taken}
    already has it.
    """
    ascii_name = unicodedata.normalize("NFKD", name).encode("ascii", "ignore").decode()
    base = _UNFIT.sub("", _SPACES.sub("-", ascii_name.strip().lower())).lstrip("-_")
    base = base[:_MAX_ID] or "voice"
    candidate, n = base, 1
    while candidate in taken:
        n += 1
        suffix = f"-{n}"
        candidate = base[: _MAX_ID - len(suffix)] + suffix
    return candidate


def timbres(variants: Iterable[VoiceRecord]) -> list[Timbre]:
    """
    Rhapsode's voices, one per espeak variant, in espeak's order.
    """
    made: list[Timbre] = []
    taken: set[str] = set()
    for record in variants:
        id = voice_id(record.name, taken)
        taken.add(id)
        variant = record.identifier.rsplit("/", 1)[-1]
        made.append(Timbre(id, record.name, variant, record.gender, record.age))
    return made


def language_voices(voices: Iterable[VoiceRecord], default: str = "en") -> dict[str, str]:
    """
    Each language code any voice lists, mapped to the identifier of the voice that
    speaks it best (the lowest priority number; the first listed of equals).  C{default}
    comes first where some voice speaks it, then the rest in order of code.
    """
    best: dict[str, tuple[int, str]] = {}
    for record in voices:
        for priority, code in record.languages:
            if code not in best or priority < best[code][0]:
                best[code] = (priority, record.identifier)
    order = sorted(best, key=lambda code: (code != default, code))
    return {code: best[code][1] for code in order}


def dictionary_name(voice_file: str) -> str | None:
    """
    The dictionary a voice file has libespeak-ng load (C{<name>_dict} in the data), as
    its LoadVoice decides it: the first language's code up to its first hyphen, unless
    a C{dictionary} line names another (the last such line read wins).  None for a file
    that says neither, such as a variant's.
    """
    name: str | None = None
    language_seen = False
    for line in voice_file.splitlines():
        words = line.split("//", 1)[0].split()
        if len(words) < 2:
            continue
        keyword, value = words[0], words[1]
        if keyword == "language" and value != "variant" and not language_seen:
            language_seen = True
            name = value.split("-", 1)[0]
        elif keyword == "dictionary":
            name = value
    return name


def espeak_settings(params: Mapping[str, float], delivery: str | None) -> dict[int, int]:
    """
    The espeak parameters for a request's dials (every one present) and delivery,
    each delivery relative to the request's own settings and kept within the dials'
    ranges.
    """
    rate, pitch, volume = params["rate"], params["pitch"], params["volume"]
    spread = float(NORMAL_RANGE)
    if delivery is not None:
        d = DELIVERIES[delivery]
        rate, pitch, volume, spread = rate * d.rate, pitch + d.pitch, volume * d.volume, spread * d.range
    return {
        RATE: _within(DIALS["rate"], rate),
        PITCH: _within(DIALS["pitch"], pitch),
        VOLUME: _within(DIALS["volume"], volume),
        RANGE: round(min(100.0, max(0.0, spread))),
        WORDGAP: round(params["wordGap"]),
    }


def _within(dial: Dial, value: float) -> int:
    return round(min(dial.max, max(dial.min, value)))

