"""
How a worker hands a timed answer to the core (protocol.md section 4, "timestamps"):
length-prefixed frames, audio as it is and timings as JSON, in the order they are made.

A client of the public API (and an engine author with curl at a worker) gets timings as
server-sent events or a JSON document, which carry the audio in base64.  Between the
core and its worker that would cost a third more bytes and two passes of base64 over
every answer (about 40 ms for the 5.7 MB of PCM in 2000 characters of eSpeak NG, whose
synthesis of them takes about 100 ms), so the core asks a worker for this framing
instead (C{Accept: application/vnd.rhapsode.frames}), and the worker sends the audio's
bytes untouched.  Each frame is one byte naming it, four bytes of big-endian length and
that many bytes:

  - C{a}: the next bytes of audio, in the format asked for;
  - C{t}: a JSON array of Timing entries, before the audio holding their first samples;
  - C{d}: the end, a JSON object (C{durationMs}); a body without it broke off.

A frame of a kind not named here is skipped (a newer worker's, section 9).  Standard
library only: the core imports it.
"""

from __future__ import annotations

import json
import struct
from typing import Any

__all__ = ["AUDIO", "DONE", "FRAMES", "FrameError", "FrameReader", "MAX_FRAME_BYTES", "TIMINGS", "frame"]

#: The media type of a framed timed answer.
FRAMES = "application/vnd.rhapsode.frames"
AUDIO, TIMINGS, DONE = b"a", b"t", b"d"
#: The most one frame may hold: a batch of audio is at most a few hundred kilobytes.
MAX_FRAME_BYTES = 16 * 1024 * 1024

_HEAD = struct.Struct(">cI")


class FrameError(ValueError):
    """
    Bytes that are not frames: a frame over the bound, or timings that are not JSON.
    """


def frame(kind: bytes, payload: bytes) -> bytes:
    """
    One frame of C{kind} holding C{payload}.
    """
    return _HEAD.pack(kind, len(payload)) + payload


class FrameReader:
    """
    Frames as they arrive, in any pieces: C{feed} gives back each complete frame's kind
    and payload, the audio's as bytes and the others' decoded from JSON.
    """

    def __init__(self, limit: int = MAX_FRAME_BYTES) -> None:
        self._limit = limit
        self._buffer = bytearray()

    @property
    def holding(self) -> bool:
        """Whether part of a frame is still waiting for the rest."""
        return bool(self._buffer)

    def feed(self, data: bytes) -> list[tuple[bytes, Any]]:
        """
        @raise FrameError: a frame over the bound, or JSON that is not JSON.
        """
        buffer = self._buffer
        buffer += data
        found: list[tuple[bytes, Any]] = []
        at = 0
        size = len(buffer)
        while size - at >= _HEAD.size:
            kind, length = _HEAD.unpack_from(buffer, at)
            if length > self._limit:
                raise FrameError(f"a frame of {length} bytes, over the {self._limit} a frame may hold")
            end = at + _HEAD.size + length
            if end > size:
                break
            payload = bytes(buffer[at + _HEAD.size:end])
            at = end
            if kind == AUDIO:
                found.append((kind, payload))
            elif kind in (TIMINGS, DONE):
                try:
                    found.append((kind, json.loads(payload)))
                except ValueError:
                    raise FrameError("a frame's JSON is not JSON") from None
        del buffer[:at]
        return found
