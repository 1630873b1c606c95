"""
The speech relay (protocol.md sections 3 and 6): a request the router has checked goes
to its worker under a residency lease, and the worker's audio comes back to the client.

A streamed answer is relayed chunk by chunk with backpressure by wiring rather than
buffering: the worker's connection is registered as the client request's producer, so a
slow client pauses the worker's socket and nothing in the core holds a whole stream.  A
body that ends short of the 256-byte floor, or that the worker truncates, makes the core
abort the client's connection ("Failing after the headers have gone"): a client never
receives a clean short 200.  A buffered answer is read whole, within a bound, before
anything is written, so every failure is still an error envelope.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.iweb import IRequest

from rhapsode_worker import contract
from rhapsode_worker.errors import Internal, SpeechError
from rhapsode_worker.web import DURATION_HEADER, abort_connection, write_trailer

from ._registry import EngineHandle
from ._residency import Residency
from ._upstream import BytesProducer, collect

#: Under this many bytes a body is not audio, whatever its status said.
FLOOR_BYTES = 256
#: A buffered body is at most a request's ceiling of audio; this bounds a runaway one.
BUFFERED_LIMIT = 512 * 1024 * 1024
#: An error envelope from a worker is a few hundred bytes.
ERROR_LIMIT = 64 * 1024


def _duration_ms(fmt: str, native: dict[str, Any], byte_count: int) -> int | None:
    """
    What a streamed body's bytes say about its length, where the format lets the core
    count (pcm, and wav past its 44-byte header); None for compressed formats.
    """
    frame = 2 * int(native.get("channels", 1))
    rate = int(native.get("sampleRate", 0))
    if not rate:
        return None
    if fmt == "pcm":
        return (byte_count // frame) * 1000 // rate
    if fmt == "wav":
        return (max(byte_count - 44, 0) // frame) * 1000 // rate
    return None


class StreamRelay(Protocol):
    """
    Receives a worker's 200 body and writes it to the client as it arrives.

    C{done} fires with the byte count when the worker ended the body properly, and fails
    when it did not; C{trailers} then holds the trailer fields the worker ended it with.
    """

    def __init__(self, request: IRequest, response: Any) -> None:
        self._request = request
        self._response = response
        self.received = 0
        self.trailers: dict[bytes, bytes] = {}
        self.done: Deferred[int] = Deferred()

    def connectionMade(self) -> None:
        # The worker's socket is the client request's producer: a full client buffer
        # pauses reading from the worker.
        self._request.registerProducer(self.transport, True)  # type: ignore[attr-defined]

    def dataReceived(self, data: bytes) -> None:
        self.received += len(data)
        # On the core's own site each piece (the first with the headers) is sent as it
        # is written (rhapsode_worker.site.EagerChannel).
        self._request.write(data)

    def connectionLost(self, reason: Failure = Failure(ResponseDone())) -> None:
        if getattr(self._request, "producer", None) is not None:
            self._request.unregisterProducer()  # type: ignore[attr-defined]
        if isinstance(reason.value, ResponseDone):
            self.trailers = dict(getattr(self._response, "trailers", {}))
            self.done.callback(self.received)
        else:
            self.done.errback(reason)


def relay(response: Any, request: IRequest) -> "Deferred[StreamRelay]":
    stream = StreamRelay(request, response)
    response.deliverBody(stream)
    return stream.done.addCallback(lambda _: stream)


class SpeechRelay:
    """
    Speaking through a worker: a lease on its engine's model for as long as the answer
    takes, the request sent, and the audio relayed or buffered.
    """

    log = Logger()

    def __init__(self, residency: Residency) -> None:
        self.residency = residency
        self._background: set[Deferred[None]] = set()
        self._measuring: set[str] = set()

    def close(self) -> None:
        """
        Shutting down: stop any measurement still in flight.
        """
        for task in list(self._background):
            task.cancel()

    async def dispatch(
        self,
        request: IRequest,
        finished: Any,
        engine: EngineHandle,
        path: str,
        forward: dict[str, Any],
        caps: dict[str, Any],
        keep_alive: int | None,
    ) -> Any:
        """
        Take a lease on the model for as long as the answer streams, then speak.
        """
        variant = forward["variant"]
        lease = await self.residency.acquire(engine.id, variant, keep_alive)
        try:
            client = await engine.ready()
            pending = client.request(
                b"POST", path, BytesProducer(json.dumps(forward).encode()),
                {b"Content-Type": [b"application/json"]},
            )
            # A client that hangs up before the worker answers cancels the upstream request.
            finished.addErrback(lambda _: pending.cancel())
            response = await pending
            if response.code != 200:
                return await self._relay_error(request, response)
            if not self.residency.state(engine.id).get("measured", True) and engine.id not in self._measuring:
                # Once per load: a worker that could not measure it is not asked again.
                self._measuring.add(engine.id)
                task = Deferred.fromCoroutine(self._measure(engine, variant))
                self._background.add(task)

                def measured(_: object) -> None:
                    self._background.discard(task)
                    self._measuring.discard(engine.id)

                task.addBoth(measured)
            fmt = forward.get("format", "wav")
            if not forward.get("stream", True):
                return await self.buffered(request, response)
            return await self._streamed(request, finished, response, fmt, caps)
        finally:
            lease.release()

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

    async def _relay_error(self, request: IRequest, response: Any) -> bytes:
        raw = await collect(response, ERROR_LIMIT)
        try:
            envelope = json.loads(raw)
            contract.validate(contract.ERROR, envelope)
        except (ValueError, SpeechError):
            raise Internal(f"worker answered {response.code} without an error envelope") from None
        request.setResponseCode(response.code)
        request.setHeader(b"Content-Type", b"application/json")
        return raw

    async def buffered(self, request: IRequest, response: Any) -> bytes:
        if response.code != 200:
            return await self._relay_error(request, response)
        body = await collect(response, BUFFERED_LIMIT)
        if len(body) < FLOOR_BYTES:
            # Not audio, whatever the status said; the headers have not gone, so say so.
            raise Internal(f"the worker answered 200 with {len(body)} bytes, which is not audio")
        headers = response.headers
        request.setResponseCode(200)
        for name in (b"Content-Type", DURATION_HEADER):
            value = headers.getRawHeaders(name)
            if value:
                request.setHeader(name, value[0])
        request.setHeader(b"Content-Length", b"%d" % len(body))
        return body

    async def _streamed(
        self, request: IRequest, finished: Any, response: Any, fmt: str, caps: dict[str, Any]
    ) -> Any:
        request.setResponseCode(200)
        content_type = response.headers.getRawHeaders(b"Content-Type")
        if content_type:
            request.setHeader(b"Content-Type", content_type[0])
        request.setHeader(b"Trailer", DURATION_HEADER)
        try:
            stream = await relay(response, request)
        except Exception:
            abort_connection(request)
            await _settled(finished)
            return None
        received = stream.received
        if received < FLOOR_BYTES:
            # Too late for an envelope: the status is on the wire.  An abort is the only
            # way left to say this was not audio.
            self.log.warn("aborting a {n}-byte stream: under the floor", n=received)
            abort_connection(request)
            await _settled(finished)
            return None
        # The worker's own trailer is authoritative (it counted the PCM); where it cannot
        # be read, pcm and wav can still be counted from the bytes.
        told = stream.trailers.get(DURATION_HEADER.lower(), b"")
        duration = int(told) if told.isdigit() else _duration_ms(fmt, caps.get("nativeFormat", {}), received)
        write_trailer(request, duration)
        return None


async def _settled(finished: Any) -> None:
    """
    Wait for the client connection's end to land before Klein looks at the request.
    """
    try:
        await finished
    except Exception:
        pass
