"""
What a reference clip tells the tone engine: the speaker's pitch and brightness.

Pitch is the median, over voiced frames, of a normalised-autocorrelation estimate
refined by parabolic interpolation, taken on the first few seconds decimated to about
8 kHz: plenty for fundamentals under 500 Hz, and quick in pure Python.
"""

from __future__ import annotations

import io
import math
import statistics
import sys
import wave
from array import array
from dataclasses import dataclass
from operator import mul

from rhapsode_worker import BadRequest

MIN_HZ = 60.0
MAX_HZ = 500.0
# The widest clip read: a header claiming more is refused rather than believed.  The
# analysis reads rate x seconds x channels samples, so a claimed 4 GHz would take the
# whole upload, and decimating it to 8 kHz would build a slice per input sample.
MAX_RATE = 192_000
MAX_CHANNELS = 8
_ANALYSIS_SECONDS = 4.0
_ANALYSIS_RATE = 8000
_FRAME_SECONDS = 0.04
# A frame quieter than this share of the loudest frame's energy is taken as silence.
_QUIET = 0.05
# Below this peak correlation a frame is noise, not voice.
_VOICED = 0.6
# The shortest period scoring this close to the best is the period, not a multiple.
_OCTAVE_TOLERANCE = 0.9


@dataclass(frozen=True)
class Estimate:
    pitch: float
    brightness: float
    seconds: float


def _read(data: bytes) -> tuple[array[int], int, int, float]:
    """
    Up to the first few seconds of a 16-bit PCM WAV as interleaved samples, its
    channels and rate, and the whole clip's length in seconds.
    """
    try:
        with wave.open(io.BytesIO(data), "rb") as clip:
            width = clip.getsampwidth()
            channels = clip.getnchannels()
            rate = clip.getframerate()
            frames = clip.getnframes()
            if width != 2:
                raise BadRequest(
                    f"the reference is {8 * width}-bit audio; this engine reads 16-bit PCM WAV",
                    field="reference",
                )
            if not 2 * MAX_HZ <= rate <= MAX_RATE:
                raise BadRequest(
                    f"the reference's sample rate {rate} Hz is not one this engine reads "
                    f"({2 * MAX_HZ:.0f} to {MAX_RATE} Hz)",
                    field="reference",
                )
            if channels > MAX_CHANNELS:
                raise BadRequest(
                    f"the reference has {channels} channels; this engine reads up to {MAX_CHANNELS}",
                    field="reference",
                )
            raw = clip.readframes(min(frames, round(rate * _ANALYSIS_SECONDS)))
    except (wave.Error, EOFError, RuntimeError) as e:
        # The stdlib's chunk reader raises a bare RuntimeError on a chunk whose size
        # runs past the file, which is a malformed upload like any other.
        raise BadRequest(f"the reference is not a PCM WAV file: {e}", field="reference") from None
    pcm = array("h")
    pcm.frombytes(raw[: len(raw) - len(raw) % (2 * channels)])
    if sys.byteorder == "big":
        pcm.byteswap()
    return pcm, channels, rate, frames / rate


def _decimate(samples: array[int], channels: int, rate: int) -> tuple[list[float], float]:
    """
    Mix to mono, box-filter and keep every n-th frame, to about 8 kHz, centred on zero.
    """
    factor = max(1, round(rate / _ANALYSIS_RATE))
    # The frames one output sample sums are adjacent in the interleaved samples, channels
    # and all, so one sum mixes and filters, over arrays and never a list per sample.
    step = factor * channels
    reduced = list(map(sum, zip(*(samples[j::step] for j in range(step)))))
    mean = sum(reduced) / max(1, len(reduced))
    return [v - mean for v in reduced], rate / factor


def _frame_period(
    x: list[float], start: int, width: int, lags: range, squares: list[float]
) -> float | None:
    """
    The period in samples of the frame at C{start}, or None when it is not voiced.
    """
    frame = x[start : start + width]
    energy = squares[start + width] - squares[start]
    scores = []
    for lag in lags:
        shifted = squares[start + lag + width] - squares[start + lag]
        product = sum(map(mul, frame, x[start + lag : start + lag + width]))
        scores.append(product / math.sqrt(energy * shifted) if shifted > 0 else 0.0)
    best = max(scores)
    if best < _VOICED:
        return None
    for i in range(1, len(scores) - 1):
        here = scores[i]
        if here >= _OCTAVE_TOLERANCE * best and scores[i - 1] <= here >= scores[i + 1]:
            curve = scores[i - 1] - 2 * here + scores[i + 1]
            shift = 0.5 * (scores[i - 1] - scores[i + 1]) / curve if curve else 0.0
            return lags[i] + shift
    return None


def estimate(data: bytes) -> Estimate:
    """
    The pitch (Hz, 60..500) and brightness (0.3..0.9) of the speaker in a WAV clip.

    Brightness comes from how much faster the signal moves than its fundamental alone
    would: the ratio of the first difference's energy to the signal's, over that of a
    pure tone at the estimated pitch, is an effective harmonic number.

    @raise BadRequest: not a 16-bit PCM WAV, or nothing voiced in it.
    """
    samples, channels, rate, seconds = _read(data)
    x, analysis_rate = _decimate(samples, channels, rate)
    width = round(analysis_rate * _FRAME_SECONDS)
    lags = range(math.floor(analysis_rate / MAX_HZ), math.ceil(analysis_rate / MIN_HZ) + 1)
    squares = [0.0]
    for v in x:
        squares.append(squares[-1] + v * v)
    starts = range(0, len(x) - width - lags[-1], width)
    energies = [squares[s + width] - squares[s] for s in starts]
    loudest = max(energies, default=0.0)
    periods: list[float] = []
    harmonic_numbers: list[float] = []
    for start, energy in zip(starts, energies):
        if loudest == 0.0 or energy < _QUIET * loudest:
            continue
        period = _frame_period(x, start, width, lags, squares)
        if period is None:
            continue
        periods.append(period)
        frame = x[start : start + width + 1]
        motion = sum((b - a) ** 2 for a, b in zip(frame, frame[1:]))
        pure = 2 * math.sin(math.pi / period)
        harmonic_numbers.append(math.sqrt(motion / energy) / pure)
    if not periods:
        raise BadRequest(
            "the reference has no voiced sound to take a pitch from", field="reference"
        )
    pitch = min(MAX_HZ, max(MIN_HZ, analysis_rate / statistics.median(periods)))
    harmonic = max(1.0, statistics.median(harmonic_numbers))
    brightness = min(0.9, max(0.3, 0.3 + 0.6 * (1.0 - 1.0 / harmonic)))
    return Estimate(pitch=pitch, brightness=brightness, seconds=seconds)
