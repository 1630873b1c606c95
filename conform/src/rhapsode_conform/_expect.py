"""
What the checks expect of an answer: an error envelope of a given status, code and field;
a document that matches the contract; audio that is not silent; the duration header,
Content-Length and the audio/L16 parameters.  Each raises L{Failed} saying what it found.
"""

from __future__ import annotations

from typing import Any, Mapping

from rhapsode_protocol import contract
from rhapsode_protocol.errors import SpeechError

from ._audio import Pcm
from ._client import Response
from ._report import Failed
from ._wire import DURATION_HEADER, parse_media_type

#: Audio with an RMS below this share of full scale (-60 dBFS) is silence.
SILENCE_FLOOR = 0.001


def reproducible(variant: Mapping[str, Any]) -> bool:
    """Whether a variant claims seed reproducibility; one that does not say claims nothing."""
    return bool(variant.get("seeding", {}).get("reproducible", False))


def refused(
    response: Response, status: int, code: str, field: str | None = None, names: str | None = None
) -> None:
    """
    Fail unless C{response} is the error envelope with this status and code, carrying
    C{field} and a message that mentions C{names}.
    """
    wanted = f"{status} {code}" + (f' naming field "{field}"' if field else "")
    if response.status != status:
        raise Failed(f"expected {wanted}, got {response.describe()}")
    doc = response.json()
    error = doc.get("error") if isinstance(doc, dict) else None
    if not isinstance(error, dict) or error.get("code") != code:
        raise Failed(f"expected {wanted}, got {response.describe()}")
    if field is not None and error.get("field") != field:
        raise Failed(f"expected {wanted}, got {response.describe()}")
    if names is not None and names not in str(error.get("message", "")):
        raise Failed(f'the message does not name "{names}": {error.get("message")!r}')


def conforms(schema: dict[str, Any], value: Any, what: str) -> None:
    try:
        contract.validate(schema, value)
    except SpeechError as exc:
        raise Failed(f"{what} does not match the contract: {exc.message}") from None


def audible(pcm: Pcm, what: str) -> None:
    if pcm.rms < SILENCE_FLOOR:
        raise Failed(f"{what} is silent (RMS {pcm.rms:.5f} of full scale)")


def duration_header(response: Response) -> int:
    value = response.header(DURATION_HEADER)
    if value is None:
        raise Failed("no X-Rhapsode-Duration-Ms header")
    if not value.strip().isdigit():
        raise Failed(f"X-Rhapsode-Duration-Ms is {value!r}, not a whole number")
    return int(value)


def buffered_length(response: Response) -> None:
    length = response.header("content-length")
    if length is None:
        raise Failed("no Content-Length on a buffered response")
    if "chunked" in (response.header("transfer-encoding") or "").lower():
        raise Failed("a buffered response was sent chunked")
    if not length.strip().isdigit() or int(length) != len(response.body):
        raise Failed(f"Content-Length says {length} but the body is {len(response.body)} bytes")


def l16_parameters(value: str | None, native: tuple[int, int]) -> tuple[int, int]:
    """Check an C{audio/L16; rate=N; channels=C} type against the native format."""
    kind, params = parse_media_type(value or "")
    if kind != "audio/l16":
        raise Failed(f"Content-Type is {value!r}, not audio/L16")
    try:
        rate, channels = int(params["rate"]), int(params["channels"])
    except (KeyError, ValueError):
        raise Failed(f"Content-Type {value!r} does not give rate and channels") from None
    if (rate, channels) != native:
        raise Failed(f"Content-Type {value!r} is not the native {native[0]} Hz, {native[1]} channel(s)")
    return rate, channels
