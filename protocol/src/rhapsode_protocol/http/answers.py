"""
The HTTP habits the worker and the core share (protocol.md section 6): JSON answers and
error envelopes, JSON bodies read within a limit, multipart forms read within the
SDK's caps (L{read_form}), failures mapped onto the taxonomy
before headers and turned into an abort after them, and the duration trailer that
twisted.web has no API for.
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from twisted.internet.defer import CancelledError, Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest

from ..errors import BadRequest, SpeechError, as_speech_error
from ..validation import parse_json_body
from .form import read_form
from .site import no_such_path, wrong_method

__all__ = [
    "DURATION_HEADER",
    "InFlight",
    "abort_connection",
    "accepts",
    "answer",
    "answer_failure",
    "error_response",
    "json_response",
    "no_route",
    "read_form",
    "read_json",
    "transport_of",
    "write_trailer",
]

DURATION_HEADER = b"X-Rhapsode-Duration-Ms"


def json_response(request: IRequest, status: int, body: Any) -> bytes:
    request.setResponseCode(status)
    request.setHeader(b"Content-Type", b"application/json")
    return json.dumps(body).encode("utf-8")


def accepts(request: IRequest, media_type: str) -> bool:
    """
    Whether the request's Accept names C{media_type} itself, at a quality above zero.
    A wildcard does not count: where an answer's shape depends on it (timestamps), a
    client that has not said it reads that shape must not be handed it unasked.
    """
    for value in request.requestHeaders.getRawHeaders(b"accept", []):
        for item in value.decode("latin-1").split(","):
            name, _, parameters = item.partition(";")
            if name.strip().lower() != media_type:
                continue
            quality = [p.strip()[2:] for p in parameters.split(";") if p.strip().lower().startswith("q=")]
            try:
                if quality and float(quality[0]) <= 0:
                    continue
            except ValueError:
                continue
            return True
    return False


def error_response(request: IRequest, error: SpeechError) -> bytes:
    """
    The envelope of C{error}, with its status and any headers it carries; the access
    line names its code and message.
    """
    for name, value in error.headers:
        request.setHeader(name, value)
    try:
        request.error_reason = f"{error.code}: {error.message}"  # type: ignore[attr-defined]
    except AttributeError:
        pass  # a request that keeps no attributes of ours
    return json_response(request, error.status, error.envelope())


def read_json(request: IRequest, schema: dict[str, Any], limit: int) -> dict[str, Any]:
    """
    The request's JSON body checked against C{schema}; no body is an empty object (so
    POST /load with nothing loads the default).
    """
    request.content.seek(0)
    raw = request.content.read(limit + 1)
    if len(raw) > limit:
        raise BadRequest(f"body is over {limit} bytes", field="body")
    return parse_json_body(raw if raw.strip() else b"{}", schema)


def abort_connection(request: IRequest) -> None:
    """
    End a response whose headers have gone without finishing it: the client sees a
    truncated body, never a clean short one.
    """
    transport = transport_of(request)
    if transport is None:
        return
    abort = getattr(transport, "abortConnection", None)
    (abort or transport.loseConnection)()


def answer_failure(
    request: IRequest,
    exc: Exception,
    log: Logger,
    render: Callable[[IRequest, SpeechError], bytes] = error_response,
) -> bytes | None:
    """
    What to do with a failure: an error envelope (as C{render} writes one) while no
    header has gone, an aborted connection after.  Only an adapter's or the core's own
    bug is logged as one.
    """
    error = as_speech_error(exc)
    if error.code == "internal":
        log.failure("request failed", Failure(exc))
    if getattr(request, "startedWriting", False):
        abort_connection(request)
        return None
    return render(request, error)


async def answer(
    request: IRequest,
    handler: Callable[[], Awaitable[Any]],
    log: Logger,
    enter: Callable[[], None] = lambda: None,
    leave: Callable[[], None] = lambda: None,
    render: Callable[[IRequest, SpeechError], bytes] = error_response,
) -> Any:
    """
    Run a route's handler: counted in flight between C{enter} (which may refuse, raising
    a L{SpeechError}) and C{leave}; a failure before any header is the taxonomy's
    envelope, one after it an aborted connection.  A cancelled handler (its client hung
    up) stays cancelled.  C{render} writes an envelope: the taxonomy's by default, or
    another shape for a translation whose clients read another (the OpenAI shim).
    """
    try:
        enter()
    except SpeechError as error:
        return render(request, error)
    try:
        return await handler()
    except CancelledError:
        raise
    except Exception as exc:
        return answer_failure(request, exc, log, render)
    finally:
        leave()


def no_route(request: IRequest, failure: Any = None) -> bytes:
    """
    The answer to a request the router has no route for: 404, or 405 with C{Allow} for
    a method the path does not take.  The site refuses both at the head already; this
    is what the router answers should one reach it some other way.
    """
    method = request.method.decode("ascii", "replace")
    path = request.path.decode("utf-8", "replace")
    allowed = getattr(getattr(failure, "value", None), "valid_methods", None)
    error = wrong_method(method, path, allowed) if allowed else no_such_path(path)
    return error_response(request, error)


def write_trailer(request: IRequest, duration_ms: int | None) -> None:
    """
    End a chunked body with the duration trailer (nothing to do for a body that is not
    chunked, e.g. to an HTTP/1.0 client).  The caller then finishes the request, which
    writes no terminator of its own once C{chunked} is off.
    """
    if not getattr(request, "chunked", False):
        return
    request.chunked = 0  # type: ignore[attr-defined]
    trailer = b"" if duration_ms is None else b"%s: %d\r\n" % (DURATION_HEADER, duration_ms)
    request.channel.write(b"0\r\n" + trailer + b"\r\n")  # type: ignore[attr-defined]


class InFlight:
    """
    How many requests are being answered, and who is waiting for that to reach zero
    (a drain, a graceful shutdown).
    """

    def __init__(self) -> None:
        self.count = 0
        self._waiters: list[Deferred[None]] = []

    def enter(self) -> None:
        self.count += 1

    def leave(self) -> None:
        self.count -= 1
        if not self.count:
            waiters, self._waiters = self._waiters, []
            for d in waiters:
                d.callback(None)

    def when_idle(self) -> "Deferred[None]":
        """
        Fires once no request is being answered (at once if none is).
        """
        d: Deferred[None] = Deferred()
        if self.count:
            self._waiters.append(d)
        else:
            d.callback(None)
        return d


def transport_of(request: Any) -> Any:
    """
    The connection a twisted.web request came on, or None (a test double may have none).
    """
    return getattr(getattr(request, "channel", None), "transport", None)
