"""
The HTTP answers an utterance is written to (L{IAudioSink} over a twisted.web request):
raw audio, chunked with the duration as a trailer or buffered with a Content-Length
(L{HttpSink}), and OpenAI's server-sent audio events (L{SseSink}).

Either way the relay is the request's producer, so a reader that falls behind pauses the
worker's socket; and a stream that cannot be whole is cut off (an aborted connection for
raw audio, an error event for an event stream), never ended cleanly.

A buffered answer is the core's memory until it has left the process, not merely until
it was handed to the transport: an L{HttpSink}'s C{finished} fires only once the request
has finished and its connection has sent what it holds (L{when_delivered}), so the buffer
budget counts a reader that reads nothing for as long as it holds the core's bytes.
"""

from __future__ import annotations

import base64
import json
from typing import Any, Callable, Iterable, Mapping, Sequence

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IPushProducer
from twisted.logger import Logger
from twisted.web.iweb import IRequest
from zope.interface import implementer

from rhapsode_protocol.errors import Internal, SpeechError
from rhapsode_protocol.http.answers import abort_connection, write_trailer

from .._interfaces import IAudioSink
from .._speech.relay import FLOOR_BYTES

__all__ = ["HttpSink", "SseSink", "room_on", "sse_event", "when_delivered", "when_sent", "write_pieces"]

_log = Logger()


@implementer(IAudioSink)
class HttpSink:
    """
    An utterance's answer as the HTTP response to C{request}: its status and headers
    are committed at L{begin} (a later failure can only abort the connection).

    Made at the start of the route, so its C{finished} follows the request's own
    C{notifyFinish()} (one asked for once the connection is lost would never fire): it
    fails when the client goes before the answer is finished, and fires once a finished
    answer has left the process.
    """

    def __init__(self, request: IRequest) -> None:
        self._request = request
        self.finished: Deferred[None] = Deferred()
        # Asked of now: twisted.web forgets a request's channel as it tells it finished.
        sent = _sent_of(request)
        request.notifyFinish().addCallbacks(  # type: ignore[attr-defined]
            lambda _: sent().addBoth(self._delivered), self.finished.errback
        )
        self.started = False
        self._producing = False

    def _delivered(self, _: object) -> None:
        self.finished.callback(None)

    def begin(self, code: int, headers: Sequence[tuple[bytes, bytes]]) -> None:
        self.started = True
        self._request.setResponseCode(code)
        for name, value in headers:
            self._request.setHeader(name, value)

    def write(self, data: bytes) -> None:
        # On the core's own site each piece (the first with the headers) is sent as it
        # is written (rhapsode_protocol.http.site.EagerChannel).
        self._request.write(data)

    def room(self) -> "Deferred[None]":
        return room_on(self._request)

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

    def room(self) -> "Deferred[None]":
        return succeed(None)  # a stream, paused by its reader through the relay

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


def room_on(request: IRequest) -> "Deferred[None]":
    """
    Fires once C{request}'s connection has sent what was written to it (L{when_sent}),
    so that the next piece of a buffered answer can be written without the socket
    holding a second copy of the answer; or once the connection has gone.  A client
    that takes nothing for the site's idle timeout (C{server.idleTimeoutSeconds}) has its
    connection aborted, as an idle one is: an answer nobody reads does not hold the
    core's memory for ever.
    """
    sent = when_sent(request)
    if sent.called:
        return sent
    channel = getattr(request, "channel", None)
    # The site's: a channel's own is off while it answers a request.
    seconds = getattr(getattr(channel, "site", None), "timeOut", None)
    call_later = getattr(channel, "callLater", None)
    if seconds and call_later is not None:
        timer = call_later(seconds, _unread, request, seconds)
        sent.addBoth(lambda result: (timer.cancel() if timer.active() else None, result)[1])
    return sent


def _unread(request: IRequest, seconds: float) -> None:
    _log.info("{method} {path}: the client read nothing of its answer for {seconds:g} s; closing",
              method=request.method.decode("latin-1"), path=request.uri.decode("latin-1")[:200],
              seconds=seconds)
    abort_connection(request)


async def write_pieces(request: IRequest, pieces: Iterable[bytes]) -> None:
    """
    Write an answer that is held in C{pieces} a piece at a time, each once the socket
    has sent the last (L{room_on}), so that the socket never holds a copy of the whole;
    stops writing once the client has gone.
    """
    for piece in pieces:
        await room_on(request)
        if getattr(request, "_disconnected", False):
            return
        request.write(piece)


def when_sent(request: IRequest) -> "Deferred[None]":
    """
    Fires once what has been written of C{request}'s answer has left the process (the
    protocol's L{EagerChannel.when_sent}), or its connection has gone; at once for a
    request on any other channel.
    """
    return _sent_of(request)()


def _sent_of(request: IRequest) -> Callable[[], "Deferred[None]"]:
    """
    What tells when C{request}'s connection has sent what it holds, found now: the
    request forgets its channel once it has finished.
    """
    sent = getattr(getattr(request, "channel", None), "when_sent", None)
    return sent if sent is not None else lambda: succeed(None)


def when_delivered(request: IRequest) -> "Deferred[None]":
    """
    Fires once C{request} is finished and its answer has left the process, or once its
    client has gone, whichever comes first; it never fails.  What a door holds of the
    buffer budget for an answer it wrote itself is given back then.
    """
    delivered: Deferred[None] = Deferred()
    if getattr(request, "_disconnected", False):
        # Gone already: twisted.web would never tell a notifyFinish asked for now.
        delivered.callback(None)
        return delivered

    def done(_: object) -> None:
        if not delivered.called:
            delivered.callback(None)

    sent = _sent_of(request)
    request.notifyFinish().addCallbacks(  # type: ignore[attr-defined]
        lambda _: sent().addBoth(done), done
    )
    return delivered


def sse_event(kind: str, payload: Mapping[str, Any]) -> bytes:
    """
    One server-sent event named C{kind}; its data is C{payload} with C{type} as JSON.
    """
    data = json.dumps({"type": kind, **payload}, separators=(",", ":"))
    return b"event: %s\ndata: %s\n\n" % (kind.encode("ascii"), data.encode("utf-8"))
