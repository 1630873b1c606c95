"""
Reading a reference clip for cloning (protocol.md section 7): any file type ffmpeg decodes,
as mono float32 samples at the rate a model wants, checked before anything is stored.

A clone's reference arrives as bytes with a filename.  L{decode_reference} hands the
bytes to ffmpeg on its standard input (never a path the uploader chose) and reads raw
C{f32le} back, so an adapter stores and reads one format whatever was uploaded; a file
that does not decode, or that is shorter or longer than the adapter accepts, is
C{bad_request} naming C{reference}, before it is stored.

Blocks (it runs ffmpeg): called from C{create_voice}, on a worker thread.
"""

from __future__ import annotations

import subprocess
from array import array
from typing import Sequence

from rhapsode_protocol.errors import BadRequest, Internal

from ._encode import find_ffmpeg

__all__ = ["Clip", "decode_reference"]

#: How long ffmpeg may take over one clip (a 25 MB upload decodes in well under a second).
_DECODE_SECONDS = 60


class Clip:
    """
    Decoded mono samples, as floats in [-1, 1], and their rate.
    """

    def __init__(self, samples: "array[float]", rate: int) -> None:
        self.samples = samples
        self.rate = rate

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.rate

    def f32le(self) -> bytes:
        return self.samples.tobytes()


def decode_reference(
    data: bytes,
    rate: int,
    seconds: Sequence[float] | None = None,
    ffmpeg: str | None = None,
) -> Clip:
    """
    The clip C{data} holds, mono at C{rate}; within C{seconds} (min, max) when given.

    @raise BadRequest: naming C{reference}, if it does not decode or is out of range.
    @raise Internal: if there is no ffmpeg to decode with.
    """
    ffmpeg = ffmpeg or find_ffmpeg()
    if ffmpeg is None:
        raise Internal("reading a reference needs ffmpeg, and there is none on this box")
    try:
        result = subprocess.run(
            [ffmpeg, "-hide_banner", "-loglevel", "error", "-i", "pipe:0", "-map", "0:a:0",
             "-ac", "1", "-ar", str(rate), "-f", "f32le", "pipe:1"],
            input=data, capture_output=True, timeout=_DECODE_SECONDS,
        )
    except subprocess.TimeoutExpired:
        raise BadRequest("the reference took too long to decode", field="reference") from None
    if result.returncode != 0 or not result.stdout:
        why = result.stderr.decode("utf-8", "replace").strip().splitlines()
        raise BadRequest(f"the reference is not audio ffmpeg can read ({why[-1] if why else 'no audio'})",
                         field="reference")
    samples = array("f")
    samples.frombytes(result.stdout[: len(result.stdout) // 4 * 4])
    clip = Clip(samples, rate)
    if seconds is not None:
        low, high = seconds
        if not low <= clip.seconds <= high:
            raise BadRequest(f"the reference lasts {clip.seconds:.1f} s; this engine takes "
                             f"{low:g} to {high:g} s", field="reference")
    if not any(abs(s) > 1e-4 for s in samples[:: max(1, len(samples) // 4096)]):
        raise BadRequest("the reference is silent", field="reference")
    return clip
