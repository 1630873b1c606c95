"""
Relaying a worker's audio to a client (protocol.md section 6, "Failing after the headers
have gone"), chunk by chunk, with backpressure by wiring rather than buffering.

The worker's connection is registered as the client request's producer, so a slow client
pauses the worker's socket and nothing in the core holds a whole stream.  A body that
ends short of the 256-byte floor, or that the worker truncates, makes the core abort the
client's connection: a client never receives a clean short 200.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.iweb import IRequest

#: Under this many bytes a body is not audio, whatever its status said.
FLOOR_BYTES = 256


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
        # is written (rhapsode_worker._http.EagerChannel).
        self._request.write(data)

    def connectionLost(self, reason: Failure = Failure(ResponseDone())) -> None:
        if getattr(self._request, "producer", None) is not None:
            self._request.unregisterProducer()  # type: ignore[attr-defined]
        if isinstance(reason.value, ResponseDone):
            self.trailers = dict(getattr(self._response, "trailers", {}))
            self.done.callback(self.received)
        else:
            self.done.errback(reason)


class BufferRelay(Protocol):
    """
    Collects a (bounded) buffered body.  Used for C{stream: false} and error envelopes.
    """

    def __init__(self, limit: int) -> None:
        self._chunks: list[bytes] = []
        self._size = 0
        self._limit = limit
        self.done: Deferred[bytes] = Deferred()

    def dataReceived(self, data: bytes) -> None:
        self._size += len(data)
        if self._size > self._limit:
            self.transport.stopProducing()  # type: ignore[union-attr]
            return
        self._chunks.append(data)

    def connectionLost(self, reason: Failure = Failure(ResponseDone())) -> None:
        if self._size > self._limit:
            self.done.errback(ValueError(f"body over {self._limit} bytes"))
        elif isinstance(reason.value, ResponseDone):
            self.done.callback(b"".join(self._chunks))
        else:
            self.done.errback(reason)


def collect(response: Any, limit: int) -> "Deferred[bytes]":
    relay = BufferRelay(limit)
    response.deliverBody(relay)
    return relay.done


def relay(response: Any, request: IRequest) -> "Deferred[StreamRelay]":
    stream = StreamRelay(request, response)
    response.deliverBody(stream)
    return stream.done.addCallback(lambda _: stream)

