"""
What a speech server's answer means: its refusals as the taxonomy's, and vLLM-Omni's
SSE of PCM as events (L{Events}), fed bytes as they arrive by whichever reader holds them.

vLLM-Omni's SSE (C{speech.audio.delta} events of base64 PCM) is read until its explicit
C{speech.audio.done}: an error event, an event that is not one, or an end without done is
a failure, so an answer cut short can never pass for a whole one.  An OpenAI server's
PCM body is read as it arrives, and one that ends short of its Content-Length or without
its last chunk fails the same way.  Every failure here comes after audio may have gone,
so the SDK aborts the connection on it: the client sees a truncated body, never a clean
short one.  The worker reads its answers on the reactor (L{rhapsode_engine_remote._relay}).
"""

from __future__ import annotations

import base64
import json
from typing import Iterator

from rhapsode_worker import BadRequest, Internal, ModelUnavailable, Overloaded, SpeechError, UnknownVoice

from ._client import ServerError

#: What one SSE line may be, and one event's data in all: a delta of a few hundred
#: milliseconds of base64 PCM is far less.  Longer is refused, never held.
_LINE_LIMIT = 8 * 1024 * 1024


def refusal(error: ServerError, where: str, voice: str | None) -> SpeechError:
    """
    A server's error status as the taxonomy's: its 400 naming a speaker or voice is
    unknown_voice; other 4xx the request's fault (bad_request); 429 overloaded; 401 and
    403 the operator's key (internal, not retryable); 404 a model the server no longer
    serves, and 5xx, model_unavailable (retryable), except a plain 500 (internal).
    """
    said = f"{where} answered {error.status}: {error.message}"
    lowered = error.message.lower()
    if error.status == 400 and voice is not None and ("speaker" in lowered or "voice" in lowered):
        return UnknownVoice(f'no voice "{voice}" on {where}: {error.message}', field="voice")
    if error.status == 429:
        return Overloaded(said)
    if error.status in (401, 403):
        return Internal(f"{where} refused this engine's key ({error.status}); its operator must set the right one")
    if error.status == 404:
        return ModelUnavailable(said)
    if 400 <= error.status < 500:
        field = {"input": "text", "voice": "voice", "instructions": "instructions", "language": "language"}
        return BadRequest(said, field=field.get(error.param or "", "text"))
    if error.status == 500:
        return Internal(said)
    return ModelUnavailable(said)


class Events:
    """
    vLLM-Omni's C{speech.audio.*} events, fed the body's bytes as they come: each
    delta's PCM, until C{speech.audio.done} (then L{done}, and whatever follows is not
    read).  Lines end at LF (a CR before it is dropped); C{data:} lines make an event, a
    blank line ends it; C{event:}, C{id:} and comments are skipped.

    @ivar where: the server, for the errors' messages.
    """

    def __init__(self, where: str) -> None:
        self.where = where
        self.done = False
        self._partial = bytearray()
        self._data: list[bytes] = []
        self._size = 0

    def feed(self, data: bytes) -> Iterator[bytes]:
        """
        The PCM of each delta that C{data} completes, in order.

        @raise ModelUnavailable: on an error event, an event that is not JSON (or nests
            deeper than the parser recurses) or not base64, or a line or an event longer
            than the limit; after the PCM of the events before it.
        """
        if self.done:
            return
        start = 0
        if self._partial:
            # A line begun in an earlier piece: only this piece is searched for its end,
            # so a long line costs its length once, not once per piece.
            start = data.find(b"\n") + 1
            if not start:
                self._keep(data)
                return
            self._keep(data[:start - 1])
            line, self._partial = bytes(self._partial), bytearray()
            pcm = self._line(line.rstrip(b"\r"))
            if pcm:
                yield pcm
        while not self.done:
            end = data.find(b"\n", start)
            if end < 0:
                self._keep(data[start:])
                return
            if end - start > _LINE_LIMIT:
                raise self._too_long()
            pcm = self._line(data[start:end].rstrip(b"\r"))
            start = end + 1
            if pcm:
                yield pcm

    def _keep(self, piece: bytes) -> None:
        self._partial += piece
        if len(self._partial) > _LINE_LIMIT:
            raise self._too_long()

    def end(self) -> None:
        """
        The body ended.

        @raise ModelUnavailable: before C{speech.audio.done}.
        """
        if not self.done:
            raise ModelUnavailable(f"{self.where} ended its stream without speech.audio.done")

    def _too_long(self) -> ModelUnavailable:
        return ModelUnavailable(f"{self.where} sent an event longer than {_LINE_LIMIT} bytes")

    def _line(self, line: bytes) -> bytes | None:
        if line.startswith(b"data:"):
            piece = line[5:].lstrip()
            self._size += len(piece)
            if self._size > _LINE_LIMIT:
                raise self._too_long()
            self._data.append(piece)
            return None
        if line or not self._data:
            return None  # event:, id:, comments; or a blank line with no data yet
        raw = self._data[0] if len(self._data) == 1 else b"\n".join(self._data)
        self._data, self._size = [], 0
        try:
            event = json.loads(raw)
        except (ValueError, RecursionError):  # nested past the parser's recursion, too
            raise ModelUnavailable(f"{self.where} sent an event that is not JSON") from None
        kind = event.get("type") if isinstance(event, dict) else None
        if kind == "speech.audio.delta":
            try:
                return base64.b64decode(event.get("audio", ""), validate=True)
            except (ValueError, TypeError):
                raise ModelUnavailable(f"{self.where} sent a delta that is not base64") from None
        if kind == "speech.audio.done":
            self.done = True
        elif kind == "speech.audio.error":
            error = event.get("error") if isinstance(event.get("error"), dict) else {}
            raise ModelUnavailable(f"{self.where} failed while speaking: {error.get('message', 'no message')}")
        return None
