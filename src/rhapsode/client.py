"""
A Twisted client of Rhapsode's public API, and the errors it raises.

    client = RhapsodeClient("http://127.0.0.1:8080")
    audio = await client.speak("kokoro", "Hello there.", voice="af_bella", format="wav")

Every refusal is one of the taxonomy's exceptions (protocol.md section 6), each with
C{.code}, C{.retryable} and C{.field}; a stream the server aborted raises
L{TruncatedResponse}.
"""

from rhapsode_protocol.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    Internal,
    ModelUnavailable,
    OutOfMemory,
    Overloaded,
    SpeechError,
    UnknownEngine,
    UnknownVoice,
    Unsupported,
)

from ._client import Audio, AudioSink, RhapsodeClient, TruncatedResponse

__all__ = [
    "Audio",
    "AudioSink",
    "BadRequest",
    "Conflict",
    "Forbidden",
    "Internal",
    "ModelUnavailable",
    "OutOfMemory",
    "Overloaded",
    "RhapsodeClient",
    "SpeechError",
    "TruncatedResponse",
    "UnknownEngine",
    "UnknownVoice",
    "Unsupported",
]
