"""
The speech relay (protocol.md sections 3 and 6): an utterance the speech service has
checked gets a turn on its engine and a residency lease, goes to its worker, and the
worker's audio comes back through an L{IAudioSink}: whichever door the utterance came in
by, the relay writes to that interface alone.

A streamed answer is relayed chunk by chunk with backpressure by wiring rather than
buffering: the relay stands between the worker's connection and the sink as the sink's
producer, so a slow reader pauses the worker's socket and nothing in the core holds a
whole stream.  A body that ends short of the 256-byte floor, or that the worker truncates
or stops sending, makes the relay abort the sink ("Failing after the headers have gone"):
a client never receives a clean short 200.  A buffered answer is read whole, within a
bound its variant's ceiling sets and within the core's budget for all buffered answers,
before anything is written, so every failure is still the door's to answer; then, with
the turn and the lease let go, it is written a piece at a time as its reader takes it, and
stays counted against the budget until the sink says its reader is done with it.
"""

from __future__ import annotations

import json
from collections import deque
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Mapping

from twisted.internet.defer import CancelledError, Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone

from rhapsode_protocol import contract
from rhapsode_protocol.errors import BadRequest, Internal, SpeechError, refusal
from rhapsode_protocol.http.answers import DURATION_HEADER
from rhapsode_protocol.validation import loads_json

from .._fleet.registry import EngineHandle
from .._fleet.residency import Residency
from .._interfaces import IAudioSink, ITimedSink
from .._upstream import BytesProducer, Stalls, WatchedBody, collect, collect_pieces, stalled
from .limits import BufferBudget, Turnstile
from .metrics import Measured
from .timed import (
    AUDIO_TYPE_HEADER,
    CHANNELS_HEADER,
    RATE_HEADER,
    WORKER_ACCEPT,
    TimedStreamRelay,
    read_frames,
    timed_limit,
)

__all__ = [
    "BUFFERED_LIMIT",
    "ERROR_LIMIT",
    "FLOOR_BYTES",
    "KEEP_ALIVE_HEADER",
    "MODEL_HEADER",
    "NODE_HEADER",
    "SpeechRelay",
    "StreamRelay",
    "buffered_limit",
    "remote_server",
]

#: Under this many bytes a body is not audio, whatever its status said.
FLOOR_BYTES = 256
#: What a cluster's node says of every answer it gives (its name), passed on to the client.
NODE_HEADER = b"X-Rhapsode-Node"
#: A caller's keep-alive, sent to the node that owns an engine's models (docs/cluster.md).
KEEP_ALIVE_HEADER = b"X-Rhapsode-Keep-Alive"
#: The model a request to a cluster is for (engine/variant): Ray Serve's routing key.
MODEL_HEADER = b"serve_multiplexed_model_id"
#: No buffered answer is bigger than this, whatever its variant claims.
BUFFERED_LIMIT = 512 * 1024 * 1024
#: An error envelope from a worker is a few hundred bytes.
ERROR_LIMIT = 64 * 1024
#: The longest a character of text takes to say, generously: speech runs near fifteen
#: characters a second, a slow voice at half that, and a cue may last a second.  With a
#: variant's maxCharacters and its PCM it bounds a buffered answer.
SECONDS_PER_CHARACTER = 0.25


def _duration_ms(fmt: str, native: Mapping[str, Any], byte_count: int) -> int | None:
    """
    What a streamed body's bytes say about its length, where the format lets the core
    count (pcm, and wav past its 44-byte header), to the nearest millisecond; None for
    compressed formats.
    """
    frame = 2 * int(native.get("channels", 1))
    rate = int(native.get("sampleRate", 0))
    if not rate:
        return None
    if fmt == "pcm":
        return round((byte_count // frame) * 1000 / rate)
    if fmt == "wav":
        return round((max(byte_count - 44, 0) // frame) * 1000 / rate)
    return None


def remote_server(caps: Mapping[str, Any], variant: str) -> str | None:
    """
    Where C{variant}'s model is served, for one served elsewhere (its capability's
    C{remote.server}); None for a model its worker loads.
    """
    remote = caps.get("variants", {}).get(variant, {}).get("remote")
    server = remote.get("server") if isinstance(remote, Mapping) else None
    return server if isinstance(server, str) and server else None


def buffered_limit(caps: Mapping[str, Any], variant: str, turns: int = 1) -> int:
    """
    The most a buffered answer of C{variant} can be: its ceiling of text, said slowly,
    as its native PCM (every format here is at most that, plus a header).
    """
    performs = caps.get("variants", {}).get(variant, {})
    characters = int(performs.get("maxCharacters") or 4096)
    native = caps.get("nativeFormat", {})
    per_second = int(native.get("sampleRate", 48_000)) * int(native.get("channels", 1)) * 2
    bound = int(characters * SECONDS_PER_CHARACTER * per_second) + turns * 64 * 1024
    return min(bound, BUFFERED_LIMIT)


class StreamRelay(WatchedBody):
    """
    Receives a worker's 200 body and writes it to a sink as it arrives.

    It is the sink's producer (L{WatchedBody}).  C{done} fires with the byte count when
    the worker ended the body properly, and fails when it did not; C{trailers} then holds
    the trailer fields the worker sent.
    """

    def __init__(
        self, sink: IAudioSink, response: Any, stalls: Stalls | None = None, measured: Measured | None = None
    ) -> None:
        super().__init__(sink, stalls)
        self._audio_sink = sink
        self._response = response
        self._measured = measured
        self.received = 0
        self.trailers: dict[bytes, bytes] = {}
        self.done: Deferred[int] = Deferred()

    def dataReceived(self, data: bytes) -> None:
        if not self.received and self._measured is not None:
            self._measured.first_audio()
        self.received += len(data)
        self.progress()
        self._audio_sink.write(data)

    def connectionLost(self, reason: Failure = Failure(ResponseDone())) -> None:
        gave_up = self.finished()
        if gave_up is not None:
            self.done.errback(gave_up)
        elif isinstance(reason.value, ResponseDone):
            self.trailers = dict(getattr(self._response, "trailers", {}))
            self.done.callback(self.received)
        else:
            self.done.errback(reason)


def relay(
    response: Any, sink: IAudioSink, stalls: Stalls | None = None, measured: Measured | None = None
) -> "Deferred[StreamRelay]":
    stream = StreamRelay(sink, response, stalls, measured)
    response.deliverBody(stream)
    return stream.done.addCallback(lambda _: stream)


class SpeechRelay:
    """
    Speaking through a worker: a turn on its engine, a lease on its model for as long
    as the answer takes, the request sent, and the audio relayed or buffered.

    @param stalls: the sweep that fails a request whose worker sends nothing (no head,
        no audio) for its stall time while the reader is ready.
    """

    log = Logger()

    def __init__(
        self,
        residency: Residency,
        turnstile: Turnstile,
        budget: BufferBudget,
        stalls: Stalls,
    ) -> None:
        self.residency = residency
        self.turnstile = turnstile
        self.budget = budget
        self.stalls = stalls
        self._background: set[Deferred[None]] = set()
        self._measuring: set[str] = set()

    def close(self) -> None:
        """
        Shutting down: stop any measurement still in flight, and the stall sweep.
        """
        self.stalls.close()
        for task in list(self._background):
            task.cancel()

    async def dispatch(
        self,
        sink: IAudioSink,
        engine: EngineHandle,
        path: str,
        forward: dict[str, Any],
        caps: Mapping[str, Any],
        keep_alive: int | None,
        measured: Measured | None = None,
    ) -> None:
        """
        Speak C{forward} through the worker's C{path} into C{sink}, holding a turn and a
        lease on the model for as long as the answer takes.

        @raise SpeechError: refused before C{sink} started (the door answers it).
        """
        variant = forward["variant"]
        body = BytesProducer(json.dumps(forward).encode())
        stream = forward.get("stream", True)
        extra = _elsewhere(engine, variant, keep_alive)
        timed = "timestamps" in forward
        if timed:
            if not ITimedSink.providedBy(sink):
                raise BadRequest("this route's answer has no place for timestamps", field="timestamps")
            # In frames: the audio as it is, beside the timings (rhapsode._speech.timed).
            extra[b"Accept"] = [WORKER_ACCEPT]
        async with self._speaking(engine, variant, keep_alive, remote_server(caps, variant)):
            response = await self._ask(engine, sink.finished, b"POST", path, body, extra)
            if not self._answered(engine, variant, response.code):
                await self._relay_error(response)
            if stream:
                if timed:
                    await self._timed_streamed(ITimedSink(sink), response, measured)
                    return
                await self._streamed(sink, response, forward.get("format", "wav"), caps, measured)
                return
            turns = len(forward.get("turns", ())) or 1
            limit = buffered_limit(caps, variant, turns)
            held: _Buffered | _TimedBuffered
            if timed:
                held = await self._timed_hold(sink, response, timed_limit(limit, caps, variant), measured)
            else:
                held = await self._hold(sink, response, limit, measured)
        # The turn and the lease are the worker's: a reader slow to take the answer
        # holds neither.
        await held.deliver(sink)

    async def preview(
        self, sink: IAudioSink, engine: EngineHandle, voice_id: str, caps: Mapping[str, Any], variant: str
    ) -> None:
        """
        A voice's preview, which speaks, so takes a turn and a lease as speech does.
        """
        async with self._speaking(engine, variant, None, remote_server(caps, variant)):
            response = await self._ask(
                engine, sink.finished, b"GET", f"/voices/{voice_id}/preview", None, _elsewhere(engine, variant, None)
            )
            self._answered(engine, variant, response.code)
            held = await self._hold(sink, response, buffered_limit(caps, variant))
        await held.deliver(sink)

    @asynccontextmanager
    async def _speaking(
        self, handle: EngineHandle, variant: str, keep_alive: int | None, server: str | None = None
    ) -> AsyncIterator[None]:
        """
        A turn on the engine, then a lease on its model in C{variant} (outside the budget
        for a model served elsewhere, on C{server}), both held until the block ends,
        however it ends; neither for an engine whose models are another core's to keep
        (a cluster's nodes take their own).  The turn is what keeps a remote server from
        more of this core's requests at once than the engine's limits allow.
        """
        if handle.elsewhere:
            yield
            return
        engine = handle.id
        turn = await self.turnstile.enter(engine)
        try:
            lease = await self.residency.acquire(engine, variant, keep_alive, server)
            try:
                yield
            finally:
                lease.release()
        finally:
            turn.leave()

    async def _ask(
        self,
        engine: EngineHandle,
        finished: Any,
        method: bytes,
        path: str,
        body: Any,
        extra: dict[bytes, list[bytes]] | None = None,
    ) -> Any:
        """
        Send a request to the worker; its response once the head is in.  A client that
        hangs up before then cancels it.
        """
        client = await engine.ready()
        headers = {b"Content-Type": [b"application/json"]} if body is not None else {}
        headers.update(extra or {})
        pending = client.request(method, path, body, headers)
        finished.addErrback(lambda _: pending.cancel())
        return await self._head(pending)

    def _answered(self, engine: EngineHandle, variant: str, code: int) -> bool:
        """
        What the worker's status says of its model: a 200 means it is loaded (and what
        the load cost is asked for once); a server error before it ever answered means
        the load failed and the model is not on the card, whatever was admitted.
        """
        if engine.elsewhere:
            return code == 200
        if code == 200:
            self.residency.mark_loaded(engine.id, variant)
            self._measure_once(engine, variant)
            return True
        if code >= 500 and not self.residency.loaded(engine.id):
            self.residency.forget(engine.id)
        return False

    async def _head(self, pending: "Deferred[Any]") -> Any:
        """
        The worker's response head, or a retryable failure once it has sent nothing
        for the stall time.
        """
        late: list[bool] = []

        def give_up() -> None:
            late.append(True)
            pending.cancel()

        watched = self.stalls.watch(give_up)
        try:
            return await pending
        except CancelledError:
            if late:
                raise stalled(self.stalls.seconds) from None
            raise
        finally:
            watched.stop()

    def _measure_once(self, engine: EngineHandle, variant: str) -> None:
        if self.residency.state(engine.id).get("measured", True) or engine.id in self._measuring:
            return
        # Once per load: a worker that could not measure it is not asked again.
        self._measuring.add(engine.id)
        task = Deferred.fromCoroutine(self._measure(engine, variant))
        self._background.add(task)

        def measured(_: object) -> None:
            self._background.discard(task)
            self._measuring.discard(engine.id)

        task.addBoth(measured)

    async def _measure(self, engine: EngineHandle, variant: str) -> None:
        """
        Record what the load cost, from the worker's own measurement; best effort, off
        the request's path.
        """
        try:
            code, health = await engine.client.json(b"GET", "/health")
        except (Exception, CancelledError):
            return
        if code == 200 and isinstance(health, dict) and health.get("variant") == variant:
            # Recorded even when absent: the worker had nothing to say about this load.
            self.residency.record_size(engine.id, variant, health.get("modelBytes"))

    async def _relay_error(self, response: Any) -> None:
        """
        Raise the refusal the worker answered with, its status kept, for the door to
        write in its own envelope (the taxonomy's, or a translation's).
        """
        raw = await collect(response, ERROR_LIMIT, stalls=self.stalls)
        try:
            envelope = loads_json(raw)
            contract.validate(contract.ERROR, envelope)
        except (ValueError, SpeechError):
            raise Internal(f"worker answered {response.code} without an error envelope") from None
        raise refusal(envelope["error"], response.code)

    async def _hold(
        self,
        sink: IAudioSink,
        response: Any,
        limit: int = 0,
        measured: Measured | None = None,
    ) -> "_Buffered":
        """
        A worker's whole answer read within C{limit} and the buffer budget, which it
        stays counted against until C{sink}'s reader is done with it.
        """
        if response.code != 200:
            await self._relay_error(response)
        pieces = await collect_pieces(response, limit or BUFFERED_LIMIT, self.budget, self.stalls)
        size = sum(map(len, pieces))
        sink.finished.addBoth(lambda _: self.budget.give_back(size))
        if size < FLOOR_BYTES:
            # Not audio, whatever the status said; nothing has gone, so say so.
            raise Internal(f"the worker answered 200 with {size} bytes, which is not audio")
        headers = response.headers
        head: list[tuple[bytes, bytes]] = []
        for name in (b"Content-Type", DURATION_HEADER, NODE_HEADER):
            value = headers.getRawHeaders(name)
            if value:
                head.append((name, value[0]))
        head.append((b"Content-Length", b"%d" % size))
        told = headers.getRawHeaders(DURATION_HEADER)
        duration = int(told[0]) if told and told[0].isdigit() else None
        if measured is not None:
            measured.first_audio()
            measured.sent = size
            measured.audio_ms = duration
        return _Buffered(head, deque(pieces), duration)

    async def _streamed(
        self,
        sink: IAudioSink,
        response: Any,
        fmt: str,
        caps: Mapping[str, Any],
        measured: Measured | None = None,
    ) -> None:
        head = [(b"Trailer", DURATION_HEADER)]
        for name in (NODE_HEADER, b"Content-Type"):
            value = response.headers.getRawHeaders(name)
            if value:
                head.insert(0, (name, value[0]))
        sink.begin(200, head)
        try:
            stream = await relay(response, sink, self.stalls, measured)
        except Exception as exc:
            error = exc if isinstance(exc, SpeechError) else Internal(f"the worker's stream broke off: {exc}")
            if not sink.started:
                raise error from None
            if isinstance(exc, SpeechError):
                self.log.warn("aborting a stream: {why}", why=error.message)
            _aborted(measured, exc)
            await sink.abort(error)
            return
        received = stream.received
        if measured is not None:
            measured.sent = received
        if received < FLOOR_BYTES:
            if not sink.started:
                raise Internal(f"the worker answered 200 with {received} bytes, which is not audio")
            # Too late for an envelope: the status is on the wire.  An abort is the only
            # way left to say this was not audio.
            self.log.warn("aborting a {n}-byte stream: under the floor", n=received)
            _aborted(measured, None)
            await sink.abort(Internal(f"the worker answered 200 with {received} bytes, which is not audio"))
            return
        # The worker's own trailer is authoritative (it counted the PCM); where it cannot
        # be read, pcm and wav can still be counted from the bytes.
        told = stream.trailers.get(DURATION_HEADER.lower(), b"")
        duration = int(told) if told.isdigit() else _duration_ms(fmt, caps.get("nativeFormat", {}), received)
        if measured is not None:
            measured.audio_ms = duration
        sink.end(duration)


    # -- answers with timestamps (rhapsode._speech.timed) ------------------------------

    async def _timed_hold(
        self, sink: IAudioSink, response: Any, limit: int, measured: Measured | None
    ) -> "_TimedBuffered":
        """
        A worker's whole timed answer read within C{limit} and the budget, which it stays
        counted against until C{sink}'s reader is done with it.
        """
        body = await collect(response, limit, self.budget, self.stalls)
        counted = len(body)
        sink.finished.addBoth(lambda _: self.budget.give_back(counted))
        # The frames' audio is copied out of the body, which goes now: the pieces are
        # what stays, no more than was counted.
        audio, entries, document = read_frames(body)
        del body
        size = sum(len(piece) for piece in audio)
        if size < FLOOR_BYTES:
            raise Internal(f"the worker answered 200 with {size} bytes of audio, which is not audio")
        duration = document["durationMs"]
        head = [
            (b"Content-Type", document["contentType"].encode("latin-1", "replace")),
            (DURATION_HEADER, b"%d" % duration),
            (RATE_HEADER, b"%d" % document["sampleRate"]),
            (CHANNELS_HEADER, b"%d" % document["channels"]),
        ]
        node = response.headers.getRawHeaders(NODE_HEADER)
        if node:
            head.append((NODE_HEADER, node[0]))
        if measured is not None:
            measured.first_audio()
            measured.sent = size
            measured.audio_ms = duration
        return _TimedBuffered(head, entries, deque(audio), duration)

    async def _timed_streamed(self, sink: ITimedSink, response: Any, measured: Measured | None) -> None:
        """
        A worker's timed event stream relayed as it arrives: the sink begins with the
        audio's own type, gets each batch of timings and of audio in order, and is
        aborted by the rules any stream is (under the floor, broken, stalled, unended).
        """
        head: list[tuple[bytes, bytes]] = [(b"Trailer", DURATION_HEADER)]
        for name, as_name in ((NODE_HEADER, NODE_HEADER), (AUDIO_TYPE_HEADER, b"Content-Type")):
            value = response.headers.getRawHeaders(name)
            if value:
                head.insert(0, (as_name, value[0]))
        sink.begin(200, head)
        stream = TimedStreamRelay(sink, self.stalls, measured)
        response.deliverBody(stream)
        try:
            received = await stream.done
        except Exception as exc:
            error = exc if isinstance(exc, SpeechError) else Internal(f"the worker's stream broke off: {exc}")
            if not sink.started:
                raise error from None
            self.log.warn("aborting a timed stream: {why}", why=error.message)
            _aborted(measured, exc)
            await sink.abort(error)
            return
        if measured is not None:
            measured.sent = received
            measured.audio_ms = stream.duration_ms
        if received < FLOOR_BYTES:
            failure = Internal(f"the worker answered 200 with {received} bytes of audio, which is not audio")
            if not sink.started:
                raise failure
            _aborted(measured, None)
            await sink.abort(failure)
            return
        sink.end(stream.duration_ms)

class _Buffered:
    """
    A buffered answer read whole: its head, its pieces, its duration.
    """

    def __init__(self, head: list[tuple[bytes, bytes]], pieces: "deque[bytes]", duration: int | None) -> None:
        self.head = head
        self.pieces = pieces
        self.duration = duration

    async def deliver(self, sink: IAudioSink) -> None:
        """
        Write the answer to C{sink} a piece at a time, each once the reader has taken
        the last (L{IAudioSink.room}), so that nothing holds a second copy of it.
        """
        sink.begin(200, self.head)
        pieces = self.pieces
        while pieces:
            await sink.room()
            sink.write(pieces.popleft())
        sink.end(self.duration)


#: The most audio a buffered timed answer writes at once: a whole number of base64's
#: three-byte quanta, so a JSON document's slices encode with nothing carried over.
_TIMED_PIECE = 3 * 64 * 1024


class _TimedBuffered:
    """
    A buffered timed answer read whole: its head, its timings, its audio (the worker's
    pieces), its duration.
    """

    def __init__(self, head: list[tuple[bytes, bytes]], entries: list[Any], pieces: "deque[bytes]", duration: int) -> None:
        self.head = head
        self.entries = entries
        self.pieces = pieces
        self.duration = duration

    async def deliver(self, sink: IAudioSink) -> None:
        """
        Write the answer to C{sink}: its timings, then its audio a piece at a time, each
        once the reader has taken the last (L{IAudioSink.room}), as L{_Buffered} does.
        """
        timed = ITimedSink(sink)
        timed.begin(200, self.head)
        timed.timestamps(self.entries)
        pieces = self.pieces
        while pieces:
            piece = pieces.popleft()
            # A worker frames a buffered answer's audio whole: written in slices, so
            # that what a sink makes of a write (a JSON document's base64) is a slice's
            # worth, not a second copy of the answer.  (A piece within one slice is
            # written as it is: slicing all of a bytes object copies nothing.)
            for at in range(0, len(piece), _TIMED_PIECE):
                await timed.room()
                timed.write(piece[at:at + _TIMED_PIECE])
        timed.end(self.duration)


def _elsewhere(engine: EngineHandle, variant: str, keep_alive: int | None) -> dict[bytes, list[bytes]]:
    """
    What a request to a cluster says beyond the worker protocol: the model it is for,
    which routes it to the node holding it, and the caller's keep-alive, which that node
    applies.
    """
    if not engine.elsewhere:
        return {}
    headers = {MODEL_HEADER: [f"{engine.id}/{variant}".encode()]}
    if keep_alive is not None:
        headers[KEEP_ALIVE_HEADER] = [b"%d" % keep_alive]
    return headers


def _aborted(measured: Measured | None, error: BaseException | None) -> None:
    """
    A stream that ended after its headers without being whole: counted as aborted, or
    as cancelled where its client went first.
    """
    if measured is not None:
        measured.end("cancelled" if isinstance(error, CancelledError) else "aborted")
