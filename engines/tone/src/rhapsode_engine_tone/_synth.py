"""
Pure-Python sound primitives for the tone engine: wavetables, tones, glides, noise.

Speed comes from building one short unit that holds a whole number of cycles and
repeating its bytes; per-sample arithmetic is kept to ramps, mixing and the short
noise bursts of cues.  All PCM here is 16-bit signed in the machine's byte order;
the engine turns it little-endian on the way out.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass
from operator import add
from random import Random
from typing import Callable

SAMPLE_RATE = 24000
FULL_SCALE = 32767

_TABLE_BITS = 11
_TABLE_SIZE = 1 << _TABLE_BITS
_TABLE_MASK = _TABLE_SIZE - 1
# A unit this long keeps the frequency error under half a sample per unit (~0.4%).
_UNIT_SECONDS = 0.005
_RAMP_SAMPLES = 96  # 4 ms: long enough to avoid a click, short enough to keep the onset
_GLIDE_STEP_SECONDS = 0.01
_TREMOLO_LEVELS = 32


@dataclass(frozen=True)
class Language:
    """
    How one language sounds: its harmonic recipe and how many letters make a syllable.
    """

    harmonics: tuple[float, ...]
    syllable_letters: int


LANGUAGES: dict[str, Language] = {
    "en": Language((1.0, 0.5, 0.33, 0.25, 0.2, 0.16, 0.14, 0.12), 3),
    "fr": Language((1.0, 0.15, 0.5, 0.1, 0.3, 0.05, 0.15, 0.05), 3),
    "de": Language((1.0, 0.0, 0.33, 0.0, 0.2, 0.0, 0.14, 0.0), 4),
    "es": Language((1.0, 0.7, 0.2, 0.1, 0.05), 2),
    "ja": Language((1.0, 0.25, 0.1, 0.4, 0.1, 0.2, 0.0, 0.1), 2),
}


def wavetable(language: str, brightness: float) -> list[float]:
    """
    One period of a language's waveform, coloured by a voice's brightness, peak 1.

    Every harmonic starts at phase zero, so each cycle begins and ends at zero and
    pieces joined on cycle boundaries do not click.
    """
    partials = [
        (h + 1, a * brightness**h) for h, a in enumerate(LANGUAGES[language].harmonics) if a
    ]
    step = 2 * math.pi / _TABLE_SIZE
    table = [sum(a * math.sin(o * i * step) for o, a in partials) for i in range(_TABLE_SIZE)]
    peak = max(abs(v) for v in table)
    return [v / peak for v in table]


def white_noise(seconds: float, seed: int) -> list[float]:
    """
    Uniform noise in [-1, 1]; a fixed seed makes it part of the engine, not the request.
    """
    rng = Random(seed)
    return [rng.uniform(-1.0, 1.0) for _ in range(round(seconds * SAMPLE_RATE))]


def samples(seconds: float) -> int:
    return max(0, round(seconds * SAMPLE_RATE))


def silence(count: int) -> bytes:
    return bytes(2 * count)


def _pcm(values: list[float], gain: float) -> bytes:
    scale = gain * FULL_SCALE
    return array("h", [int(scale * v) for v in values]).tobytes()


def _unit(table: list[float], freq: float) -> list[float]:
    """
    About 5 ms of samples holding a whole number of cycles, so it repeats seamlessly.
    """
    cycles = max(1, round(freq * _UNIT_SECONDS))
    length = max(2, round(cycles * SAMPLE_RATE / freq))
    step = cycles * _TABLE_SIZE
    return [table[(i * step // length) & _TABLE_MASK] for i in range(length)]


def ramped(pcm: bytes, ramp: int = _RAMP_SAMPLES) -> bytes:
    """
    Fade C{pcm} in and out over C{ramp} samples each.
    """
    ramp = min(ramp, len(pcm) // 4)
    if ramp == 0:
        return pcm
    head = array("h")
    head.frombytes(pcm[: 2 * ramp])
    tail = array("h")
    tail.frombytes(pcm[-2 * ramp :])
    for i in range(ramp):
        head[i] = head[i] * i // ramp
        tail[i] = tail[i] * (ramp - 1 - i) // ramp
    return head.tobytes() + pcm[2 * ramp : -2 * ramp] + tail.tobytes()


def tone(
    table: list[float],
    freq: float,
    count: int,
    gain: float,
    tremolo: tuple[float, float] | None = None,
) -> bytes:
    """
    C{count} samples of a steady tone, faded in and out.

    @param tremolo: (rate in Hz, depth 0..1): the gain dips by up to C{depth} at that rate,
        stepped once per unit, on cycle boundaries where the waveform is at zero.
    """
    unit = _unit(table, freq)
    length = len(unit)
    whole, rest = divmod(count, length)
    if tremolo is None:
        piece = _pcm(unit, gain)
        return ramped(piece * whole + piece[: 2 * rest])
    rate, depth = tremolo
    levels: dict[int, bytes] = {}
    pieces = []
    for j in range(whole + 1):
        swing = 0.5 - 0.5 * math.cos(2 * math.pi * rate * j * length / SAMPLE_RATE)
        level = round(_TREMOLO_LEVELS * (1.0 - depth * swing))
        if level not in levels:
            levels[level] = _pcm(unit, gain * level / _TREMOLO_LEVELS)
        pieces.append(levels[level])
    return ramped(b"".join(pieces)[: 2 * count])


def glide(
    table: list[float],
    start_hz: float,
    end_hz: float,
    count: int,
    start_gain: float,
    end_gain: float,
) -> bytes:
    """
    About C{count} samples sliding geometrically between two pitches and two gains.

    Each 10 ms step is whole cycles of its own pitch, so steps join at zero.
    """
    steps = max(2, round(count / (_GLIDE_STEP_SECONDS * SAMPLE_RATE)))
    step_samples = count / steps
    pieces = []
    for j in range(steps):
        t = j / (steps - 1)
        freq = start_hz * (end_hz / start_hz) ** t
        period = max(2, round(SAMPLE_RATE / freq))
        cycle = [table[i * _TABLE_SIZE // period] for i in range(period)]
        repeats = max(1, round(step_samples / period))
        pieces.append(_pcm(cycle, start_gain + (end_gain - start_gain) * t) * repeats)
    return ramped(b"".join(pieces))


def lowpass(values: list[float]) -> list[float]:
    """
    A one-pole low-pass, scaled back towards unit level: white noise to rumble or breath.
    """
    out = []
    smoothed = 0.0
    for x in values:
        smoothed += 0.12 * (x - smoothed)
        out.append(max(-1.0, min(1.0, 3.0 * smoothed)))
    return out


def highpass(values: list[float]) -> list[float]:
    """
    A first difference: white noise to hiss.
    """
    return [0.5 * (b - a) for a, b in zip([0.0] + values, values)]


def cyclic(values: list[float], offset: int, count: int) -> list[float]:
    """
    C{count} values of C{values} from C{offset}, wrapping round.
    """
    size = len(values)
    return [values[(offset + i) % size] for i in range(count)]


def shaped(values: list[float], envelope: Callable[[float], float]) -> bytes:
    """
    C{values} under C{envelope}, a function from the fraction of the run elapsed to a
    gain as a fraction of full scale.
    """
    step = 1.0 / max(1, len(values))
    return array(
        "h", [int(FULL_SCALE * x * envelope(i * step)) for i, x in enumerate(values)]
    ).tobytes()


def mix(first: bytes, second: bytes) -> bytes:
    """
    The sample-wise sum of two PCM runs, as long as the longer.

    Callers keep the summed gains under full scale; a sum that is not raises
    OverflowError rather than wrapping around into a crack.
    """
    a = array("h")
    a.frombytes(first)
    b = array("h")
    b.frombytes(second)
    if len(a) < len(b):
        a, b = b, a
    return array("h", map(add, a, b)).tobytes() + a[len(b) :].tobytes()


class Palette:
    """
    What a loaded variant holds: wavetables per language and timbre, and the noises.

    Tables for the built-in timbres are made at construction, which is what loading
    means for this engine; others (created voices, deliveries) are made on first use.
    """

    def __init__(self, languages: tuple[str, ...], brightnesses: tuple[float, ...]) -> None:
        self._tables: dict[tuple[str, float], list[float]] = {}
        self._breaths: dict[int, bytes] = {}
        for language in languages:
            for brightness in brightnesses:
                self.table(language, brightness)
        self.noise = white_noise(1.0, 0x70E)
        self.rumble = lowpass(self.noise)
        self.hiss = highpass(self.noise)

    def table(self, language: str, brightness: float) -> list[float]:
        key = (language, brightness)
        if key not in self._tables:
            self._tables[key] = wavetable(language, brightness)
        return self._tables[key]

    def breath(self, offset: int, count: int, gain: float) -> bytes:
        """
        C{count} samples of breath noise at C{gain}, from C{offset} into the engine's second
        of it; the second is rendered once per gain.
        """
        level = round(gain * 1024)
        if level not in self._breaths:
            self._breaths[level] = _pcm(self.rumble, level / 1024)
        second = self._breaths[level]
        start = 2 * (offset % len(self.rumble))
        run = second[start:]
        while len(run) < 2 * count:
            run += second
        return run[: 2 * count]
