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

__all__ = ["AUDIO", "DONE", "FRAMES", "FrameError", "FrameReader", "MAX_FRAME_BYTES", "TIMINGS", "frame", "head"]

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


def head(kind: bytes, length: int) -> bytes:
    """
    The head of a frame of C{kind} holding C{length} bytes, to write before them (so a
    large payload goes out without being copied into one frame).
    """
    return _HEAD.pack(kind, length)


def frame(kind: bytes, payload: bytes) -> bytes:
    """
    One frame of C{kind} holding C{payload}.
    """
    return _HEAD.pack(kind, len(payload)) + payload


class FrameReader:
    """
    Frames as they arrive, in any pieces.  C{feed} gives back what each piece completes:
    audio as it comes, a frame's bytes possibly in several parts (each C{(AUDIO,
    bytes)}), so that audio is relayed as soon as it arrives and never copied whole
    again; a timings or end frame once all of it is in, decoded from JSON.
    """

    def __init__(self, limit: int = MAX_FRAME_BYTES) -> None:
        self._limit = limit
        self._head = b""
        self._kind = b""
        self._need = 0
        self._parts: list[bytes] = []

    @property
    def holding(self) -> bool:
        """Whether part of a frame is still waiting for the rest."""
        return bool(self._head or self._need)

    def feed(self, data: bytes) -> list[tuple[bytes, Any]]:
        """
        @raise FrameError: a frame over the bound, or JSON that is not JSON.
        """
        found: list[tuple[bytes, Any]] = []
        at, size = 0, len(data)
        while at < size:
            if self._need:
                take = min(self._need, size - at)
                piece = data if (at == 0 and take == size) else data[at:at + take]
                at += take
                self._need -= take
                if self._kind == AUDIO:
                    found.append((AUDIO, piece))
                else:
                    self._parts.append(piece)
                    if not self._need:
                        self._complete(found)
                continue
            wanted = _HEAD.size - len(self._head)
            self._head += data[at:at + wanted]
            at += min(wanted, size - at)
            if len(self._head) < _HEAD.size:
                break
            kind, length = _HEAD.unpack(self._head)
            self._head = b""
            if length > self._limit:
                raise FrameError(f"a frame of {length} bytes, over the {self._limit} a frame may hold")
            self._kind, self._need = kind, length
            if not length and kind != AUDIO:
                self._complete(found)
        return found

    def _complete(self, found: list[tuple[bytes, Any]]) -> None:
        payload, self._parts = b"".join(self._parts), []
        if self._kind in (TIMINGS, DONE):
            try:
                found.append((self._kind, json.loads(payload)))
            except ValueError:
                raise FrameError("a frame's JSON is not JSON") from None
        # A frame of a kind not named here is a newer worker's: skipped.
