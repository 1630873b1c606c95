"""
The HTTP answers an utterance is written to (L{IAudioSink} over a twisted.web request):
raw audio, chunked with the duration as a trailer or buffered with a Content-Length
(L{HttpSink}), OpenAI's server-sent audio events (L{SseSink}), and with timestamps
(protocol.md section 4) the contract's events (L{TimedEventSink}) or its JSON document
(L{TimedJsonSink}), or for a cluster's front asking a node, a worker's frames
(L{FramedSink}).

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
from contextlib import AbstractContextManager
from typing import Any, Callable, Iterable, Mapping, Sequence

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IPushProducer
from twisted.logger import Logger
from twisted.web.iweb import IRequest
from zope.interface import implementer

from rhapsode_protocol import contract, frames
from rhapsode_protocol.errors import BadRequest, Internal, SpeechError
from rhapsode_protocol.http.answers import DURATION_HEADER, abort_connection, accepts, write_trailer
from rhapsode_protocol.http.site import gathered

from .._interfaces import IAudioSink, ITimedSink
from .._speech.relay import FLOOR_BYTES, NODE_HEADER
from .._speech.timed import AUDIO_TYPE_HEADER, CHANNELS_HEADER, RATE_HEADER

__all__ = [
    "CaptionedSink",
    "FramedSink",
    "HttpSink",
    "SseSink",
    "TimedEventSink",
    "TimedJsonSink",
    "framed_sink",
    "room_on",
    "sse_event",
    "timed_sink",
    "when_delivered",
    "when_sent",
    "write_pieces",
]

_log = Logger()


def _cut(request: IRequest, finished: "Deferred[None]") -> "Deferred[None]":
    """
    Abort C{request}'s connection (its headers have gone): fires once the connection's
    end has landed, which Klein waits for before it looks at the request again.
    """
    abort_connection(request)
    landed: Deferred[None] = Deferred()
    finished.addBoth(lambda _: landed.callback(None) if not landed.called else None)
    return landed


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

    def gathered(self) -> AbstractContextManager[None]:
        return gathered(self._request)

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
        return _cut(self._request, self.finished)


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

    def gathered(self) -> AbstractContextManager[None]:
        return gathered(self._request)

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


_AUDIO_DELTA = b'event: speech.audio.delta\ndata: {"type":"speech.audio.delta","audio":"'


def timed_sink(request: IRequest, body: Mapping[str, Any], finished: "Deferred[None]") -> ITimedSink | None:
    """
    The sink a native speech request with timestamps is answered through: the
    contract's events for a stream, its JSON document for a buffered answer, once the
    client's Accept names the one it gets; None for a request without timestamps.

    @param finished: the route's own C{notifyFinish()} (its other sink's), taken at its
        start: one asked for later would never fire.
    @raise BadRequest: naming C{timestamps}, when the Accept does not say so.
    """
    if "timestamps" not in body:
        return None
    stream = bool(body.get("stream", True))
    wanted = contract.TIMED_EVENTS if stream else contract.TIMED_JSON
    if not accepts(request, wanted):
        how = "a stream of server-sent events" if stream else "a JSON document"
        raise BadRequest(
            f"timestamps with stream {str(stream).lower()} are answered as {how}: send "
            f'"Accept: {wanted}" (raw audio has no place for them)',
            field="timestamps",
        )
    if stream:
        return TimedEventSink(request, finished)
    return TimedJsonSink(request, str(body.get("format", "wav")), finished)


@implementer(ITimedSink)
class TimedEventSink:
    """
    A timed stream as the contract's server-sent events: each batch of timings a
    C{speech.timestamps.delta}, each piece of audio a C{speech.audio.delta} in base64,
    in the order they came (so every timing goes before the audio holding its first
    sample), and the end a C{speech.audio.done} with the duration.  As with L{SseSink},
    nothing goes out before L{FLOOR_BYTES} of audio have arrived, and a failure after
    the first event is a C{speech.audio.error} event.
    """

    def __init__(self, request: IRequest, finished: "Deferred[None] | None" = None) -> None:
        self._request = request
        self.finished: Deferred[None] = request.notifyFinish() if finished is None else finished  # type: ignore[attr-defined]
        self.started = False
        self._head: list[tuple[bytes, bytes]] = []
        self._held: list[bytes] = []
        self._audio = 0
        self._producing = False

    def gathered(self) -> AbstractContextManager[None]:
        return gathered(self._request)

    def begin(self, code: int, headers: Sequence[tuple[bytes, bytes]]) -> None:
        for name, value in headers:
            if name.lower() == b"content-type":
                self._head.append((AUDIO_TYPE_HEADER, value))
            elif name.lower() == NODE_HEADER.lower():
                self._head.append((NODE_HEADER, value))

    def timestamps(self, alignment: Sequence[Mapping[str, Any]]) -> None:
        self._send(sse_event("speech.timestamps.delta", {"alignment": list(alignment)}))

    def write(self, data: bytes) -> None:
        if data:
            self._audio += len(data)
            # Base64's alphabet needs no escaping: spliced in rather than encoded as JSON.
            self._send(b"".join((_AUDIO_DELTA, base64.b64encode(data), b'"}\n\n')))

    def room(self) -> "Deferred[None]":
        return succeed(None)  # a stream, paused by its reader through the relay

    def _send(self, event: bytes) -> None:
        if self.started:
            self._request.write(event)
            return
        self._held.append(event)
        if self._audio >= FLOOR_BYTES:
            self._start()

    def _start(self) -> None:
        self.started = True
        request = self._request
        request.setResponseCode(200)
        request.setHeader(b"Content-Type", b"text/event-stream")
        request.setHeader(b"Cache-Control", b"no-cache")
        for name, value in self._head:
            request.setHeader(name, value)
        held, self._held = self._held, []
        request.write(b"".join(held))

    def registerProducer(self, producer: IPushProducer) -> None:
        self._producing = True
        self._request.registerProducer(producer, True)  # type: ignore[attr-defined]

    def unregisterProducer(self) -> None:
        if self._producing:
            self._producing = False
            self._request.unregisterProducer()  # type: ignore[attr-defined]

    def end(self, duration_ms: int | None) -> None:
        if not self.started:
            self._start()
        done: dict[str, Any] = {} if duration_ms is None else {"durationMs": duration_ms}
        self._request.write(sse_event("speech.audio.done", done))

    def abort(self, error: SpeechError | None) -> "Deferred[None]":
        if error is None:
            error = Internal("the worker's stream broke off")
        late = error.envelope()["error"]
        self._request.write(sse_event("speech.audio.error", {"error": {
            "code": error.code, "message": late["message"], "retryable": error.retryable,
        }}))
        return succeed(None)


class _Base64Pieces:
    """
    The base64 of audio written a piece at a time, each piece encoded as it comes: the
    bytes of a piece that do not fill a quantum (three bytes) wait for the next, so the
    pieces' encodings joined are the whole audio's.
    """

    def __init__(self) -> None:
        self._carry = b""

    def encode(self, data: bytes) -> bytes:
        joined = self._carry + data if self._carry else data
        whole = len(joined) - len(joined) % 3
        self._carry = bytes(joined[whole:])
        return base64.b64encode(memoryview(joined)[:whole]) if whole else b""

    def rest(self) -> bytes:
        tail, self._carry = base64.b64encode(self._carry), b""
        return tail


@implementer(ITimedSink)
class TimedJsonSink:
    """
    A buffered timed answer as the contract's JSON document (TimedAudio): the audio in
    base64 beside the whole alignment.

    Nothing is written before the first audio, so a failure until then is still the
    route's envelope.  From there the document goes out as the audio is written: its
    fields and alignment first, then each piece encoded as it comes (the bytes of a piece
    that do not fill a base64 quantum wait for the next), then the duration that ends
    it.  The core never holds the document whole, nor the audio twice.  The relay writes
    only once it has read the whole answer, so what follows the first write can fail only
    by the reader's going, and that aborts the connection.
    """

    def __init__(self, request: IRequest, fmt: str, finished: "Deferred[None] | None" = None) -> None:
        self._request = request
        self._format = fmt
        self.finished: Deferred[None] = request.notifyFinish() if finished is None else finished  # type: ignore[attr-defined]
        self.started = False
        self._head: dict[bytes, bytes] = {}
        self._alignment: list[Mapping[str, Any]] = []
        self._audio = _Base64Pieces()

    def gathered(self) -> AbstractContextManager[None]:
        return gathered(self._request)

    def begin(self, code: int, headers: Sequence[tuple[bytes, bytes]]) -> None:
        self._head = {name.lower(): value for name, value in headers}

    def timestamps(self, alignment: Sequence[Mapping[str, Any]]) -> None:
        self._alignment.extend(alignment)

    def _start(self) -> None:
        self.started = True
        head = self._head
        fields = dict(_audio_fields(self._format, head), alignment=self._alignment)
        request = self._request
        request.setResponseCode(200)
        request.setHeader(b"Content-Type", b"application/json")
        for name in (DURATION_HEADER, NODE_HEADER):
            value = head.get(name.lower())
            if value is not None:
                request.setHeader(name, value)
        # Base64's alphabet needs no escaping: the audio is spliced into the document.
        request.write(json.dumps(fields)[:-1].encode("utf-8") + b', "audio": "')

    def write(self, data: bytes) -> None:
        if not data:
            return
        if not self.started:
            self._start()
        encoded = self._audio.encode(data)
        if encoded:
            self._request.write(encoded)

    def room(self) -> "Deferred[None]":
        return room_on(self._request)

    def registerProducer(self, producer: IPushProducer) -> None:
        pass  # read whole before anything is written

    def unregisterProducer(self) -> None:
        pass

    def end(self, duration_ms: int | None) -> None:
        if not self.started:
            self._start()
        self._request.write(self._audio.rest() + b'", "durationMs": %d}' % (duration_ms or 0))

    def abort(self, error: SpeechError | None) -> "Deferred[None]":
        if not self.started:
            # Nothing went out: the failure is still the route's envelope.
            return succeed(None)
        return _cut(self._request, self.finished)


@implementer(ITimedSink)
class FramedSink:
    """
    A timed answer in a worker's frames (L{rhapsode_protocol.frames}), for a cluster's
    front that asked a node for it as it asks its own workers: the node passes its
    worker's timings through without the events' base64 and the front reads them with
    the same relay.  Streamed, the audio's type is the X-Rhapsode-Audio-Type header and
    the end a C{d} frame with the duration; nothing goes out before L{FLOOR_BYTES} of
    audio, so a body that is not audio is still the route's envelope, and a failure
    after that aborts the connection (the front then fails the stream as a broken
    worker's).  Buffered, nothing goes out before the first audio (the relay writes once
    it has read the whole answer, a piece at a time as the reader takes them), and the
    C{d} frame at the end says what the audio is, as a worker's buffered frames do.
    """

    def __init__(self, request: IRequest, fmt: str, stream: bool, finished: "Deferred[None] | None" = None) -> None:
        self._request = request
        self._format = fmt
        self._stream = stream
        self.finished: Deferred[None] = request.notifyFinish() if finished is None else finished  # type: ignore[attr-defined]
        self.started = False
        self._head: dict[bytes, bytes] = {}
        self._held: list[bytes] = []
        self._audio = 0
        self._producing = False

    def gathered(self) -> AbstractContextManager[None]:
        return gathered(self._request)

    def begin(self, code: int, headers: Sequence[tuple[bytes, bytes]]) -> None:
        self._head = {name.lower(): value for name, value in headers}

    def timestamps(self, alignment: Sequence[Mapping[str, Any]]) -> None:
        self._send(frames.frame(frames.TIMINGS, json.dumps(list(alignment), separators=(",", ":")).encode("utf-8")))

    def write(self, data: bytes) -> None:
        if data:
            self._audio += len(data)
            self._send(frames.head(frames.AUDIO, len(data)), data)

    def room(self) -> "Deferred[None]":
        # A stream is paused through the relay; a buffered answer's pieces wait for the
        # reader to take the last.
        return succeed(None) if self._stream else room_on(self._request)

    def _send(self, *parts: bytes) -> None:
        if self.started:
            for part in parts:
                self._request.write(part)
            return
        self._held.extend(parts)
        if self._audio >= (FLOOR_BYTES if self._stream else 1):
            self._start()

    def _start(self) -> None:
        self.started = True
        request = self._request
        request.setResponseCode(200)
        request.setHeader(b"Content-Type", frames.FRAMES.encode("ascii"))
        audio_type = self._head.get(b"content-type")
        if audio_type is not None:
            request.setHeader(AUDIO_TYPE_HEADER, audio_type)
        if not self._stream:
            duration = self._head.get(DURATION_HEADER.lower())
            if duration is not None:
                request.setHeader(DURATION_HEADER, duration)
        held, self._held = self._held, []
        request.write(b"".join(held))

    def registerProducer(self, producer: IPushProducer) -> None:
        if self._stream:
            self._producing = True
            self._request.registerProducer(producer, True)  # type: ignore[attr-defined]

    def unregisterProducer(self) -> None:
        if self._producing:
            self._producing = False
            self._request.unregisterProducer()  # type: ignore[attr-defined]

    def end(self, duration_ms: int | None) -> None:
        done: dict[str, Any] = {} if duration_ms is None else {"durationMs": duration_ms}
        if not self._stream:
            done.update(_audio_fields(self._format, self._head), durationMs=duration_ms or 0)
        if not self.started:
            self._start()
        self._request.write(frames.frame(frames.DONE, json.dumps(done).encode("utf-8")))

    def abort(self, error: SpeechError | None) -> "Deferred[None]":
        if not self.started:
            # Nothing went out: the failure is still the route's envelope.
            return succeed(None)
        return _cut(self._request, self.finished)


def framed_sink(request: IRequest, body: Mapping[str, Any], finished: "Deferred[None]") -> FramedSink | None:
    """
    The sink for a timed request whose Accept asks for a worker's frames (a cluster's
    front asking a node), None for any other request.
    """
    if "timestamps" not in body or not accepts(request, frames.FRAMES):
        return None
    return FramedSink(request, str(body.get("format", "wav")), bool(body.get("stream", True)), finished)


def _number(value: bytes | None) -> int | None:
    return int(value) if value is not None and value.isdigit() else None


def _audio_fields(fmt: str, head: Mapping[bytes, bytes]) -> dict[str, Any]:
    """
    What a buffered timed answer says of its audio, from the worker's head (names in
    lower case): its format, type, rate and channels.
    """
    return {
        "format": fmt,
        "contentType": head.get(b"content-type", b"application/octet-stream").decode("latin-1"),
        "sampleRate": _number(head.get(RATE_HEADER.lower())) or 1,
        "channels": _number(head.get(CHANNELS_HEADER.lower())) or 1,
    }


@implementer(ITimedSink)
class CaptionedSink:
    """
    Kokoro-FastAPI's captioned speech (C{POST /dev/captioned_speech}), for the clients
    written for it: JSON objects of C{audio} (base64), C{audio_format} (its media type)
    and C{timestamps} (C{word}, C{start_time}, C{end_time} in seconds).  Streamed, one
    object a line per piece of audio, carrying the words that came before it (so a
    caption never trails its sound; Kokoro-FastAPI holds them the same way), nothing sent
    before L{FLOOR_BYTES} of audio, and a failure after that an aborted connection, as
    for raw audio; buffered, one object with everything, which goes out as its audio is
    written (the relay writes once it has read the whole answer), its base64 a piece at a
    time, so that the core never holds the object whole.
    """

    def __init__(self, request: IRequest, stream: bool, timed: bool, finished: "Deferred[None] | None" = None) -> None:
        self._request = request
        self._stream = stream
        self._timed = timed
        self.finished: Deferred[None] = request.notifyFinish() if finished is None else finished  # type: ignore[attr-defined]
        self.started = False
        self._type = "application/octet-stream"
        self._words: list[dict[str, Any]] = []
        self._audio: list[bytes] = []
        self._size = 0
        self._producing = False
        self._duration: bytes | None = None
        self._whole = _Base64Pieces()

    def gathered(self) -> AbstractContextManager[None]:
        return gathered(self._request)

    def begin(self, code: int, headers: Sequence[tuple[bytes, bytes]]) -> None:
        for name, value in headers:
            if name.lower() == b"content-type":
                self._type = value.decode("latin-1").split(";")[0].strip()
            elif name.lower() == DURATION_HEADER.lower():
                self._duration = value

    def timestamps(self, alignment: Sequence[Mapping[str, Any]]) -> None:
        self._words.extend(
            {"word": entry["text"], "start_time": entry["start"], "end_time": entry["end"]}
            for entry in alignment
            if entry.get("unit") == "word"
        )

    def write(self, data: bytes) -> None:
        if not data:
            return
        if not self._stream:
            if not self.started:
                self._begin_object()
            encoded = self._whole.encode(data)
            if encoded:
                self._request.write(encoded)
            return
        self._audio.append(data)
        self._size += len(data)
        if self._size >= FLOOR_BYTES:
            self._line()

    def room(self) -> "Deferred[None]":
        # A stream is paused through the relay; a buffered answer's pieces wait for the
        # reader to take the last.
        return succeed(None) if self._stream else room_on(self._request)

    def _begin_object(self) -> None:
        self._started(None)
        if self._duration is not None:
            self._request.setHeader(DURATION_HEADER, self._duration)
        words, self._words = self._words, []
        fields = {"audio_format": self._type, "timestamps": words if self._timed else None}
        # The audio last, spliced in: base64's alphabet needs no escaping.
        head = json.dumps(fields, ensure_ascii=False, separators=(",", ":"))[:-1]
        self._request.write(head.encode("utf-8") + b',"audio":"')

    def _object(self, audio: bytes) -> bytes:
        words, self._words = self._words, []
        document = {
            "audio": base64.b64encode(audio).decode("ascii"),
            "audio_format": self._type,
            "timestamps": words if self._timed else None,
        }
        return json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode("utf-8")

    def _started(self, cache: bytes | None) -> None:
        self.started = True
        self._request.setResponseCode(200)
        self._request.setHeader(b"Content-Type", b"application/json")
        if cache is not None:
            self._request.setHeader(b"Cache-Control", cache)

    def _line(self) -> None:
        if not self.started:
            self._started(b"no-cache")
        audio, self._audio = b"".join(self._audio), []
        self._request.write(self._object(audio) + b"\n")

    def registerProducer(self, producer: IPushProducer) -> None:
        if self._stream:
            self._producing = True
            self._request.registerProducer(producer, True)  # type: ignore[attr-defined]

    def unregisterProducer(self) -> None:
        if self._producing:
            self._producing = False
            self._request.unregisterProducer()  # type: ignore[attr-defined]

    def end(self, duration_ms: int | None) -> None:
        if self._stream:
            if self._audio or self._words or not self.started:
                self._line()
            return
        if not self.started:
            if duration_ms is not None:
                self._duration = b"%d" % duration_ms
            self._begin_object()
        self._request.write(self._whole.rest() + b'"}')

    def abort(self, error: SpeechError | None) -> "Deferred[None]":
        if not self._stream and not self.started:
            # Nothing went out: the failure is still the route's envelope.
            return succeed(None)
        # Lines of JSON have no way to say a stream broke: cut it, as for raw audio.
        return _cut(self._request, self.finished)
