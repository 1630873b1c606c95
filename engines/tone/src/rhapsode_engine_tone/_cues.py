"""
The eight cues of the standard vocabulary, each a sound pattern of its own.

A cue is performed in the reader's own waveform and pitch, so a laugh in the bass
voice is a bass laugh; the request's random generator varies the details, so a seed
holds them fixed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from random import Random
from typing import Callable

from ._synth import (
    SAMPLE_RATE,
    Palette,
    cyclic,
    glide,
    mix,
    ramped,
    samples,
    shaped,
    silence,
    tone,
)


@dataclass(frozen=True)
class Throat:
    """
    What a cue is made with: the reader's waveform, pitch and level, and the noises.
    """

    palette: Palette
    table: list[float]
    pitch: float
    gain: float
    rng: Random

    def breath(self, count: int, gain: float) -> bytes:
        return self.palette.breath(self.rng.randrange(SAMPLE_RATE), count, gain)

    def noise(
        self, source: list[float], seconds: float, envelope: Callable[[float], float]
    ) -> bytes:
        run = cyclic(source, self.rng.randrange(len(source)), samples(seconds))
        return shaped(run, envelope)


def _bursts(pieces: list[bytes], gap: float) -> bytes:
    return silence(samples(gap)).join(pieces)


def _laugh(t: Throat) -> bytes:
    pieces = []
    for i in range(t.rng.choice((4, 5))):
        start = t.pitch * (1.2 + 0.08 * i)
        voiced = glide(t.table, start, 1.3 * start, samples(0.085), 0.85 * t.gain, 0.55 * t.gain)
        pieces.append(ramped(mix(voiced, t.breath(len(voiced) // 2, 0.15 * t.gain))))
    return _bursts(pieces, 0.07)


def _chuckle(t: Throat) -> bytes:
    pieces = []
    for _ in range(t.rng.choice((2, 3))):
        voiced = glide(t.table, 1.1 * t.pitch, t.pitch, samples(0.07), 0.4 * t.gain, 0.3 * t.gain)
        pieces.append(ramped(mix(voiced, t.breath(len(voiced) // 2, 0.08 * t.gain))))
    return _bursts(pieces, 0.11)


def _sigh(t: Throat) -> bytes:
    voiced = glide(
        t.table, 1.15 * t.pitch, 0.7 * t.pitch, samples(0.9), 0.3 * t.gain, 0.04 * t.gain
    )
    air = t.noise(t.palette.rumble, 0.9, lambda x: 0.25 * t.gain * math.sin(math.pi * x))
    return ramped(mix(voiced, air))


def _gasp(t: Throat) -> bytes:
    voiced = glide(t.table, 0.9 * t.pitch, 1.9 * t.pitch, samples(0.2), 0.3 * t.gain, 0.8 * t.gain)
    air = t.noise(t.palette.hiss, 0.2, lambda x: 0.3 * t.gain * x)
    return ramped(mix(voiced, air), 24)


def _cough(t: Throat) -> bytes:
    pieces = []
    for _ in range(2):
        bark = t.noise(t.palette.noise, 0.14, lambda x: 0.9 * t.gain * math.exp(-5.0 * x))
        buzz = glide(
            t.table, 0.9 * t.pitch, 0.7 * t.pitch, samples(0.14), 0.5 * t.gain, 0.1 * t.gain
        )
        pieces.append(ramped(mix(bark, buzz), 24))
    return _bursts(pieces, 0.13)


def _clear_throat(t: Throat) -> bytes:
    def rough(x: float) -> float:
        # A 25 Hz flutter over the rumble is what makes it a rasp rather than a hum.
        flutter = 0.6 + 0.4 * math.sin(2 * math.pi * 25 * 0.45 * x)
        return 0.5 * t.gain * flutter * math.sin(math.pi * x)

    rumble = t.noise(t.palette.rumble, 0.45, rough)
    hum = tone(t.table, 0.5 * t.pitch, samples(0.45), 0.3 * t.gain)
    return ramped(mix(rumble, hum))


def _sniff(t: Throat) -> bytes:
    blips = [
        t.noise(t.palette.hiss, 0.08, lambda x: 3.2 * t.gain * x * (1.0 - x)) for _ in range(2)
    ]
    return _bursts([ramped(b, 24) for b in blips], 0.07)


def _groan(t: Throat) -> bytes:
    voiced = glide(
        t.table, 0.85 * t.pitch, 0.6 * t.pitch, samples(0.75), 0.7 * t.gain, 0.35 * t.gain
    )
    return ramped(mix(voiced, t.breath(len(voiced) // 2, 0.1 * t.gain)))


CUES: dict[str, Callable[[Throat], bytes]] = {
    "laugh": _laugh,
    "chuckle": _chuckle,
    "sigh": _sigh,
    "gasp": _gasp,
    "cough": _cough,
    "clear throat": _clear_throat,
    "sniff": _sniff,
    "groan": _groan,
}
