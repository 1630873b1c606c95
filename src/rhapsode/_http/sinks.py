"""
The HTTP answers an utterance is written to (L{IAudioSink} over a twisted.web request):
raw audio, chunked with the duration as a trailer or buffered with a Content-Length
(L{HttpSink}), and OpenAI's server-sent audio events (L{SseSink}).

Either way the relay is the request's producer, so a reader that falls behind pauses the
worker's socket; and a stream that cannot be whole is cut off (an aborted connection for
raw audio, an error event for an event stream), never ended cleanly.
"""

from __future__ import annotations

import base64
import json
from typing import Any, Mapping, Sequence

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IPushProducer
from twisted.web.iweb import IRequest
from zope.interface import implementer

from rhapsode_protocol.errors import Internal, SpeechError
from rhapsode_protocol.http.answers import abort_connection, write_trailer

from .._interfaces import IAudioSink
from .._speech.relay import FLOOR_BYTES

__all__ = ["HttpSink", "SseSink", "sse_event"]


@implementer(IAudioSink)
class HttpSink:
    """
    An utterance's answer as the HTTP response to C{request}: its status and headers
    are committed at L{begin} (a later failure can only abort the connection).

    Made at the start of the route, so its C{finished} is the request's own
    C{notifyFinish()} (one asked for once the connection is lost would never fire).
    """

    def __init__(self, request: IRequest) -> None:
        self._request = request
        self.finished: Deferred[None] = request.notifyFinish()  # type: ignore[attr-defined]
        self.started = False
        self._producing = False

    def begin(self, code: int, headers: Sequence[tuple[bytes, bytes]]) -> None:
        self.started = True
        self._request.setResponseCode(code)
        for name, value in headers:
            self._request.setHeader(name, value)

    def write(self, data: bytes) -> None:
        # On the core's own site each piece (the first with the headers) is sent as it
        # is written (rhapsode_protocol.http.site.EagerChannel).
        self._request.write(data)

    def registerProducer(self, producer: IPushProducer) -> None:
        self._producing = True
        self._request.registerProducer(producer, True)  # type: ignore[attr-defined]

    def unregisterProducer(self) -> None:
        if self._producing:
            self._producing = False
            self._request.unregisterProducer()  # type: ignore[attr-defined]

    def end(self, duration_ms: int | None) -> None:
        # A chunked body ends with the trailer; one with a Content-Length has nothing to add.
        write_trailer(self._request, duration_ms)

    def abort(self, error: SpeechError | None) -> "Deferred[None]":
        abort_connection(self._request)
        # Klein looks at the request once the route returns: not before its connection's
        # end has landed.
        landed: Deferred[None] = Deferred()
        self.finished.addBoth(lambda _: landed.callback(None) if not landed.called else None)
        return landed


@implementer(IAudioSink)
class SseSink:
    """
    An utterance's audio as OpenAI's server-sent events (C{stream_format: "sse"}): each
    piece that arrives is a C{speech.audio.delta} carrying it in base64, the end a
    C{speech.audio.done}.  Nothing goes out before L{FLOOR_BYTES} have arrived, so a
    body that is not audio can still be refused with an envelope; a failure after the
    first event is a C{speech.audio.error} event and a clean end, which an event stream,
    unlike raw audio, can say.
    """

    def __init__(self, request: IRequest) -> None:
        self._request = request
        self.finished: Deferred[None] = request.notifyFinish()  # type: ignore[attr-defined]
        self.started = False
        self._held: list[bytes] = []
        self._received = 0
        self._producing = False

    def begin(self, code: int, headers: Sequence[tuple[bytes, bytes]]) -> None:
        # The stream's own head goes out with its first event: the worker's is not it.
        pass

    def write(self, data: bytes) -> None:
        self._received += len(data)
        if self._received < FLOOR_BYTES:
            self._held.append(data)
            return
        if self._held:
            data = b"".join(self._held) + data
            self._held = []
        if not self.started:
            self.started = True
            self._request.setResponseCode(200)
            self._request.setHeader(b"Content-Type", b"text/event-stream")
            self._request.setHeader(b"Cache-Control", b"no-cache")
        self._request.write(sse_event("speech.audio.delta", {"audio": base64.b64encode(data).decode("ascii")}))

    def registerProducer(self, producer: IPushProducer) -> None:
        self._producing = True
        self._request.registerProducer(producer, True)  # type: ignore[attr-defined]

    def unregisterProducer(self) -> None:
        if self._producing:
            self._producing = False
            self._request.unregisterProducer()  # type: ignore[attr-defined]

    def end(self, duration_ms: int | None) -> None:
        self._request.write(sse_event("speech.audio.done", {}))

    def abort(self, error: SpeechError | None) -> "Deferred[None]":
        if error is None:
            error = Internal("the worker's stream broke off")
        late = error.envelope()["error"]
        kind = "invalid_request_error" if error.status < 500 and not error.retryable else "server_error"
        self._request.write(sse_event("speech.audio.error", {"error": {
            "message": late["message"], "type": kind, "code": error.code, "retryable": error.retryable,
        }}))
        # The stream ends cleanly once the door returns: nothing to wait for.
        return succeed(None)


def sse_event(kind: str, payload: Mapping[str, Any]) -> bytes:
    """
    One server-sent event named C{kind}; its data is C{payload} with C{type} as JSON.
    """
    data = json.dumps({"type": kind, **payload}, separators=(",", ":"))
    return b"event: %s\ndata: %s\n\n" % (kind.encode("ascii"), data.encode("utf-8"))
