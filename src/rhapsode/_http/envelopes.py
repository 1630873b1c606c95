"""
The error envelopes the public port's doors answer in: the taxonomy's own (protocol.md
section 6, L{rhapsode_protocol.http.answers.error_response}) everywhere but the OpenAI
routes, whose clients parse only OpenAI's shape (L{openai_envelope}), with the taxonomy's
status and code kept and an C{x-should-retry} header that makes the official SDKs retry
exactly what the taxonomy calls retryable.

A leaf: the site (for refusals at the head), the OpenAI shim and the WebSocket door all
render through it, and it imports no part of the core.
"""

from __future__ import annotations

from typing import Any

from twisted.web.iweb import IRequest

from rhapsode_protocol.errors import SpeechError
from rhapsode_protocol.http.answers import json_response

__all__ = ["openai_envelope", "render_error", "should_retry"]


#: The native field a refusal names, as the OpenAI request calls it.
_PARAM = {
    "engine": "model",
    "variant": "model",
    "text": "input",
    "format": "response_format",
    "params.speed": "speed",
    "voice": "voice",
    "sampleRate": "sample_rate",
}


def _param(field: str | None) -> str | None:
    if field is None or field in ("body", "path", "headers", "method"):
        return None
    return _PARAM.get(field, field)


def openai_envelope(error: SpeechError) -> dict[str, Any]:
    """
    C{error} in OpenAI's envelope: the taxonomy's code and retryable flag kept, the
    field it is about named as the OpenAI request names it (C{param}).
    """
    native = error.envelope()["error"]
    wrong = error.status < 500 and not error.retryable
    param = _param(error.field)
    message = native["message"]
    if param is not None and error.field != param:
        # The native request's name for the field, in a message to a client that sent
        # the OpenAI one.
        message = message.replace(f'"{error.field}"', f'"{param}"')
    return {
        "error": {
            "message": message,
            "type": "invalid_request_error" if wrong else "server_error",
            "param": param,
            "code": error.code,
            "retryable": error.retryable,
        }
    }


def should_retry(error: SpeechError) -> tuple[bytes, bytes]:
    """
    The header OpenAI's SDKs read before the status: without it they retry every 5xx
    (an internal error three times) and no 4xx but 408, 409 and 429.
    """
    return (b"x-should-retry", b"true" if error.retryable else b"false")


def render_error(request: IRequest, error: SpeechError) -> bytes:
    """
    Answer C{error} in OpenAI's envelope, with its status and headers and C{x-should-retry}.
    """
    for name, value in (*error.headers, should_retry(error)):
        request.setHeader(name, value)
    try:
        request.error_reason = f"{error.code}: {error.message}"  # type: ignore[attr-defined]
    except AttributeError:
        pass
    return json_response(request, error.status, openai_envelope(error))


