"""
The error taxonomy of protocol.md section 6, as exceptions an adapter may raise.

Each class fixes the code, the HTTP status and whether a caller should retry; the
table is the single source both the SDK and the contract module read.  Public, and
standard library only: the core and its client raise and read the same classes.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = [
    "ERROR_TABLE",
    "BadRequest",
    "Conflict",
    "Forbidden",
    "Internal",
    "ModelUnavailable",
    "OutOfMemory",
    "Overloaded",
    "SpeechError",
    "UnknownEngine",
    "UnknownVoice",
    "Unsupported",
    "as_speech_error",
    "error_from_envelope",
    "refusal",
]

# code -> (HTTP status, retryable, meaning).  Order is the spec's; new codes go at the end.
ERROR_TABLE: dict[str, tuple[int, bool, str]] = {
    "bad_request": (400, False, "Malformed, or a params key the variant does not have"),
    "unknown_engine": (404, False, "Not in GET /engines. Core only; a worker is one engine"),
    "unknown_voice": (404, False, "Not in GET /voices"),
    "unsupported": (422, False, "A format, language or feature this variant does not do"),
    "model_unavailable": (503, True, "Loading, evicted, or a load that ran out of time"),
    "oom": (503, True, "Out of device memory"),
    "overloaded": (429, True, "Draining, or at the concurrency limit"),
    "internal": (500, False, "The adapter threw"),
    "forbidden": (403, False, "A management route called from somewhere it does not answer"),
    "conflict": (409, False, "A management route asked for something the current state rules out"),
}


#: Codes whose message tells of the box's own failure rather than the request's.
_THE_BOXS_OWN = frozenset({"internal", "oom", "model_unavailable"})
# An absolute path, POSIX or a Windows drive's: two or more components, not part of a
# URL ("https://host/a/b") or of a relative path ("voices/a/b").
_ABSOLUTE_PATH = re.compile(
    r"(?<![\w.~/\\-])(?:/|[A-Za-z]:[\\/])(?:[^\s'\"`,;:()<>\[\]{}|*?\\/]+[\\/])+([^\s'\"`,;:()<>\[\]{}|*?\\/]*)"
)


def _without_paths(text: str) -> str:
    """
    C{text} with each absolute path cut to its last component, a file's name.
    """
    return _ABSOLUTE_PATH.sub(lambda m: m.group(1) or "...", text)


class SpeechError(Exception):
    """
    A failure with a place in the taxonomy.

    @ivar field: the request field the failure is about, when there is one; it is
        named in the message and carried in the envelope so a client can point at it.
    @ivar status: the HTTP status, the table's for the code unless the refusal is about
        the HTTP message itself: a bad_request for an unknown route is 404, a wrong
        method 405, and a head or body over its limit 408, 413, 414 or 431.
    """

    code = "internal"
    #: Response headers a refusal carries beside its envelope (Allow, Location).
    headers: tuple[tuple[bytes, bytes], ...] = ()

    def __init__(self, message: str, field: str | None = None, *, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self._status = status

    @property
    def status(self) -> int:
        return self._status or ERROR_TABLE[self.code][0]

    @property
    def retryable(self) -> bool:
        return ERROR_TABLE[self.code][1]

    def envelope(self) -> dict[str, Any]:
        message = self.message
        if self.code in _THE_BOXS_OWN:
            # Often an exception's own text: where on the box it happened (interpreter,
            # socket, virtualenv, voice dir, ffmpeg) is the log's to say, not a client's.
            message = _without_paths(message)
        body: dict[str, Any] = {
            "code": self.code,
            "message": message,
            "retryable": self.retryable,
        }
        if self.field is not None:
            body["field"] = self.field
        return {"error": body}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, field={self.field!r})"


class BadRequest(SpeechError):
    code = "bad_request"


class UnknownEngine(SpeechError):
    code = "unknown_engine"


class UnknownVoice(SpeechError):
    code = "unknown_voice"


class Unsupported(SpeechError):
    code = "unsupported"


class ModelUnavailable(SpeechError):
    code = "model_unavailable"


class OutOfMemory(SpeechError):
    code = "oom"


class Overloaded(SpeechError):
    code = "overloaded"


class Internal(SpeechError):
    code = "internal"


class Forbidden(SpeechError):
    code = "forbidden"


class Conflict(SpeechError):
    code = "conflict"


_BY_CODE: dict[str, type[SpeechError]] = {
    cls.code: cls
    for cls in (
        BadRequest,
        UnknownEngine,
        UnknownVoice,
        Unsupported,
        ModelUnavailable,
        OutOfMemory,
        Overloaded,
        Internal,
        Forbidden,
        Conflict,
    )
}


def error_from_envelope(body: Any, status: int) -> SpeechError:
    """
    Rebuild the exception an envelope describes (for clients of a worker or the core).
    """
    try:
        err = body["error"]
        cls = _BY_CODE.get(err["code"], Internal)
        return cls(str(err.get("message", "")), err.get("field"))
    except (KeyError, TypeError):
        return Internal(f"HTTP {status} without an error envelope")


def refusal(error: Any, status: int) -> SpeechError:
    """
    The taxonomy's error an envelope's C{error} object describes, its status kept (a
    route may have answered a code's refusal with a status of its own: 404, 413).
    """
    found = error_from_envelope({"error": error}, status)
    if found.status != status:
        found = type(found)(found.message, found.field, status=status)
    return found


def _looks_like_oom(exc: BaseException) -> bool:
    # torch.cuda.OutOfMemoryError, torch.OutOfMemoryError, MPS and onnxruntime's
    # allocation failures all say so in their type or message; matching names keeps the
    # SDK free of any import of those libraries.
    if isinstance(exc, MemoryError):
        return True
    name = type(exc).__name__.lower()
    if "outofmemory" in name:
        return True
    text = str(exc).lower()
    return "out of memory" in text or "failed to allocate memory" in text


def as_speech_error(exc: BaseException) -> SpeechError:
    """
    Map whatever an adapter raised onto the taxonomy.

    A L{SpeechError} passes through; an out-of-memory of any framework becomes C{oom}
    (503, retryable); anything else is C{internal}, naming the exception type.
    """
    if isinstance(exc, SpeechError):
        return exc
    if _looks_like_oom(exc):
        return OutOfMemory(f"out of memory: {exc}")
    return Internal(f"{type(exc).__name__}: {exc}")
