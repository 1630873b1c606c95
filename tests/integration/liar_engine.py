"""
A test adapter that claims what it does not do, for the conformance checker to catch.
Run as C{python -m liar_engine} with this folder on PYTHONPATH.

Both variants claim the cue laugh, the delivery hushed and seed reproducibility.
"deaf" (the default) ignores all three: its audio is a tone fixed by the text alone, with
its cues taken out, so a seed, a [laugh] and hushed change nothing (the seed claim is
then true by accident: nothing varies).  "noisy" speaks fresh
random noise on every call, so no seed reproduces it.  Everything else it does honestly.
"""

from __future__ import annotations

import math
import random
import re
import sys
import zlib
from array import array
from typing import Iterator

from rhapsode_worker import Engine, License, NativeFormat, SpeakRequest, Variant, serve

RATE = 16000
_CUE = re.compile(r"\s*\[[^\]]*\]")


class LiarEngine(Engine):
    id = "liar"
    display_name = "Liar"
    license = License(code="MIT", weights="MIT", weights_commercial_use=True, notes="test adapter")
    native_format = NativeFormat(sample_rate=RATE)
    default_variant = "deaf"
    segment_characters = 80

    def variants(self) -> dict[str, Variant]:
        claims = Variant(cues=("laugh",), deliveries=("hushed",), seed_reproducible=True)
        return {"deaf": claims, "noisy": claims}

    def speak(self, request: SpeakRequest) -> Iterator[bytes]:
        text = _CUE.sub("", request.text)
        frames = RATE * 60 * len(text) // 1000
        if request.variant == "noisy":
            noise = random.Random()
            samples = array("h", (noise.randint(-8000, 8000) for _ in range(frames)))
        else:
            pitch = 150 + zlib.crc32(text.encode()) % 200
            samples = array("h", (int(8000 * math.sin(2 * math.pi * pitch * i / RATE)) for i in range(frames)))
        if sys.byteorder == "big":
            samples.byteswap()
        yield samples.tobytes()


if __name__ == "__main__":
    serve(LiarEngine)
