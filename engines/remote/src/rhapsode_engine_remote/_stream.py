"""
Reading a speech server's answer as PCM, and its refusals as the taxonomy's.

vLLM-Omni's SSE (C{speech.audio.delta} events of base64 PCM) is read until its explicit
C{speech.audio.done}: an error event, an event that is not one, or an end without done is
a failure, so an answer cut short can never pass for a whole one.  An OpenAI server's
PCM body is read as it arrives, and one that ends short of its Content-Length or without
its last chunk fails the same way.  Every failure here comes after audio may have gone,
so the SDK aborts the connection on it: the client sees a truncated body, never a clean
short one.
"""

from __future__ import annotations

import base64
import json
import socket
from typing import Any, Iterator

from rhapsode_worker import BadRequest, Internal, ModelUnavailable, Overloaded, SpeechError, UnknownVoice

from ._client import ServerError

#: What one SSE line may be: a delta of a few hundred milliseconds of base64 PCM.
_LINE_LIMIT = 8 * 1024 * 1024
_CHUNK = 64 * 1024


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



def raw_pcm(response: Any, where: str) -> Iterator[bytes]:
    """
    A PCM body as it arrives; a body cut short (a chunked one without its end, or one
    short of its Content-Length) or a stall fails, so the worker aborts, never ends clean.
    """
    while True:
        try:
            chunk = response.read1(_CHUNK)
        except (socket.timeout, TimeoutError):
            raise ModelUnavailable(f"{where} stopped sending audio past its stall time") from None
        except Exception as exc:  # http.client.IncompleteRead, a reset: the stream broke off
            raise ModelUnavailable(f"{where} broke off its audio ({type(exc).__name__})") from None
        if not chunk:
            if response.chunked or response.length is None:
                # A chunked body's last chunk closes it; one cut short raised above.  One
                # delimited by the connection's close ends when that closes.
                return
            if response.length:
                raise ModelUnavailable(f"{where} ended its audio {response.length} bytes short")
            response.read()  # what http.client needs to call the body read and reuse the connection
            return
        yield chunk


def sse_pcm(response: Any, where: str) -> Iterator[bytes]:
    """
    vLLM-Omni's C{speech.audio.*} events as PCM: each delta's audio as it comes, until
    C{speech.audio.done}.  An error event, a malformed event, or an end without done
    fails the stream.
    """
    data: list[bytes] = []
    while True:
        try:
            line = response.readline(_LINE_LIMIT)
        except (socket.timeout, TimeoutError):
            raise ModelUnavailable(f"{where} stopped sending audio past its stall time") from None
        except Exception as exc:
            raise ModelUnavailable(f"{where} broke off its audio ({type(exc).__name__})") from None
        if not line:
            raise ModelUnavailable(f"{where} ended its stream without speech.audio.done")
        line = line.rstrip(b"\r\n")
        if line.startswith(b"data:"):
            data.append(line[5:].lstrip())
            continue
        if line or not data:
            continue  # event:, id:, comments; or a blank line with no data yet
        raw, data = b"\n".join(data), []
        try:
            event = json.loads(raw)
        except (ValueError, RecursionError):  # nested past the parser's recursion, too
            raise ModelUnavailable(f"{where} sent an event that is not JSON") from None
        kind = event.get("type") if isinstance(event, dict) else None
        if kind == "speech.audio.delta":
            try:
                pcm = base64.b64decode(event.get("audio", ""), validate=True)
            except ValueError:
                raise ModelUnavailable(f"{where} sent a delta that is not base64") from None
            if pcm:
                yield pcm
        elif kind == "speech.audio.done":
            response.read(_CHUNK)  # the body's end, so the connection can be used again
            return
        elif kind == "speech.audio.error":
            error = event.get("error") if isinstance(event.get("error"), dict) else {}
            raise ModelUnavailable(f"{where} failed while speaking: {error.get('message', 'no message')}")
