"""
What the Piper adapter decides without Piper: the voice's config read as plain JSON, the
dials it declares, what a delivery does to them, and what
becomes of a segment's text before Piper reads it.

Free of onnxruntime, numpy and piper, so that it can be tested where none is installed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

#: Piper's own syntax: ``[[ phonemes ]]`` is read as raw phonemes, not as text.
RAW_PHONEMES = r"\[\[.*?\]\]"

LENGTH_SCALE = "lengthScale"
NOISE_SCALE = "noiseScale"
NOISE_W = "noiseW"

# How far each dial may go.  Past 2.0 the length scale drawls and below 0.5 it gabbles;
# past 1.2 the phoneme-width noise starts stretching single phonemes into seconds.
_LENGTH_RANGE = (0.5, 2.0)
_NOISE_RANGE = (0.0, 1.2)


@dataclass(frozen=True)
class VoiceFile:
    """
    The parts of a Piper voice config (``<voice>.onnx.json``) the adapter declares.

    @ivar language: the voice's language as a BCP 47 tag (``en_US`` becomes ``en-US``).
    """

    sample_rate: int
    language: str
    quality: str
    length_scale: float
    noise_scale: float
    noise_w: float

    @classmethod
    def read(cls, path: Path) -> "VoiceFile":
        config = json.loads(path.read_text(encoding="utf-8"))
        inference = config.get("inference", {})
        return cls(
            sample_rate=int(config["audio"]["sample_rate"]),
            language=config["language"]["code"].replace("_", "-"),
            quality=str(config["audio"].get("quality", "")),
            # Piper's own fallbacks where a config leaves one out (piper.config).
            length_scale=float(inference.get("length_scale", 1.0)),
            noise_scale=float(inference.get("noise_scale", 0.667)),
            noise_w=float(inference.get("noise_w", 0.8)),
        )

    def dials(self) -> dict[str, tuple[float, float, float]]:
        """
        The dials of this voice, each defaulting to the voice's own setting.
        """
        return {
            LENGTH_SCALE: (*_LENGTH_RANGE, self.length_scale),
            NOISE_SCALE: (*_NOISE_RANGE, self.noise_scale),
            NOISE_W: (*_NOISE_RANGE, self.noise_w),
        }


@dataclass(frozen=True)
class Settings:
    """
    What one generation is asked for: Piper's three scales and a gain after its
    peak normalisation.
    """

    length_scale: float
    noise_scale: float
    noise_w: float
    gain: float = 1.0


@dataclass(frozen=True)
class _Delivery:
    """
    A delivery as factors on the request's own settings, so that it reads relative to
    the voice and to whatever the dials already asked for.
    """

    length: float
    noise: float
    noise_w: float
    gain: float


DELIVERIES: dict[str, _Delivery] = {
    # Slower, steadier and 9 dB down: a calm, quiet reading.  Piper cannot whisper.
    # Phoneme lengths are whole frames, so a factor on the length scale moves the
    # duration by roughly half as much: 1.2 reads about 10% slower.
    "hushed": _Delivery(length=1.2, noise=0.6, noise_w=0.6, gain=0.35),
    # About 15% faster, and less even in timing and intonation.  Piper already peaks
    # at full scale, so it cannot be louder without clipping.
    "frantic": _Delivery(length=0.75, noise=1.25, noise_w=1.4, gain=1.0),
}


def _within(value: float, bounds: tuple[float, float]) -> float:
    return min(max(value, bounds[0]), bounds[1])


def settings_for(params: Mapping[str, float], delivery: str | None) -> Settings:
    """
    The settings for a request's dials (every one present, as the SDK fills them) and
    delivery, which stay inside the dials' ranges.
    """
    plain = Settings(
        length_scale=params[LENGTH_SCALE],
        noise_scale=params[NOISE_SCALE],
        noise_w=params[NOISE_W],
    )
    if delivery is None:
        return plain
    d = DELIVERIES[delivery]
    return Settings(
        length_scale=_within(plain.length_scale * d.length, _LENGTH_RANGE),
        noise_scale=_within(plain.noise_scale * d.noise, _NOISE_RANGE),
        noise_w=_within(plain.noise_w * d.noise_w, _NOISE_RANGE),
        gain=d.gain,
    )


def continued(text: str, last: bool) -> str:
    """
    A segment as Piper should read it: one that stops between two words (the splitter
    cut a sentence too long for its segment, most often to fit the short first one)
    ends in a comma, so that it is read as a phrase that goes on rather than with the
    fall of a finished one.
    """
    if last or not text[-1:].isalnum():
        return text
    return text + ","


def unbracketed(text: str) -> str:
    """
    The text with no square bracket left for Piper to read a raw-phoneme block from.

    The SDK has already removed every tag and ``[[...]]`` span, but closing the gaps
    can bring two brackets together again; a bracket is never spoken and this adapter
    claims no cue, so none need survive.
    """
    return re.sub(r"[\[\]]+", " ", text).strip()
