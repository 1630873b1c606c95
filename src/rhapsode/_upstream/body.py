"""
A worker's body read whole, within a limit: an error envelope, a small JSON answer, or
a buffered (C{stream: false}) response.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone

__all__ = ["BodyTooLarge", "BufferRelay", "collect"]


class BodyTooLarge(ValueError):
    """
    A body ran past the limit it was read with; what came was dropped.
    """


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
            self.done.errback(BodyTooLarge(f"body over {self._limit} bytes"))
        elif isinstance(reason.value, ResponseDone):
            self.done.callback(b"".join(self._chunks))
        else:
            self.done.errback(reason)


def collect(response: Any, limit: int) -> "Deferred[bytes]":
    relay = BufferRelay(limit)
    response.deliverBody(relay)
    return relay.done


