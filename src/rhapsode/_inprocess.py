"""
Running a public route in process, for the translations that sit on top of the public
API (protocol.md sections 11 and 12, and the batch route): an MCP tool or a batch item
builds the route's own request and hands it to the route's own handler, so the
validation, the ceiling, the dial check, the residency lease and the error taxonomy are
the route's and cannot drift from what curl gets.

The request lives in memory: no connection, no socket.  It is for answers the handler
gives whole (a JSON document, or audio with C{stream: false}); a streamed answer needs
a real connection to push back on, and none of these callers asks for one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from io import BytesIO
from typing import Any, Awaitable, Callable

from twisted.internet.defer import Deferred, succeed
from twisted.web.http_headers import Headers

__all__ = ["Answer", "InProcessRequest", "run"]


class InProcessRequest:
    """
    The part of twisted.web's request a route handler uses, in memory.

    @ivar code: the status the handler set (200 until it sets one).
    @ivar responseHeaders: the headers it set.
    """

    channel = None
    #: The route a speech request is counted under in the metrics (mcp, batch).
    metrics_route: str | None = None
    startedWriting = False
    finished = False
    error_reason: str | None = None

    def __init__(self, method: bytes, path: str, body: Any = None, args: dict[bytes, list[bytes]] | None = None) -> None:
        self.method = method
        self.path = path.encode("utf-8")
        self.uri = self.path
        self.args = dict(args or {})
        raw = b"" if body is None else json.dumps(body).encode("utf-8")
        self.content = BytesIO(raw)
        self.requestHeaders = Headers({b"Content-Type": [b"application/json"]} if body is not None else {})
        self.responseHeaders = Headers()
        self.code = 200
        self._written: list[bytes] = []
        self._finish_waiters: list[Deferred[None]] = []

    def setResponseCode(self, code: int, message: bytes | None = None) -> None:
        self.code = code

    def setHeader(self, name: bytes | str, value: bytes | str) -> None:
        self.responseHeaders.setRawHeaders(
            name if isinstance(name, bytes) else name.encode("latin-1"),
            [value if isinstance(value, bytes) else value.encode("latin-1")],
        )

    def getHeader(self, name: bytes | str) -> bytes | None:
        key = name if isinstance(name, bytes) else name.encode("latin-1")
        values = self.requestHeaders.getRawHeaders(key)
        return values[-1] if values else None

    def write(self, data: bytes) -> None:
        self.startedWriting = True
        self._written.append(data)

    def notifyFinish(self) -> "Deferred[None]":
        if self.finished:
            return succeed(None)
        waiter: Deferred[None] = Deferred()
        self._finish_waiters.append(waiter)
        return waiter

    def finish(self) -> None:
        """
        The caller is done with the answer: what the route held for it (a buffered
        answer's share of the core's budget) is given back.
        """
        if self.finished:
            return
        self.finished = True
        waiters, self._finish_waiters = self._finish_waiters, []
        for waiter in waiters:
            waiter.callback(None)

    def written(self) -> bytes:
        return b"".join(self._written)


@dataclass
class Answer:
    """
    What a route answered: its status, its Content-Type and its body.
    """

    code: int
    content_type: str
    body: bytes
    headers: Headers

    def json(self) -> Any:
        return json.loads(self.body)

    def header(self, name: bytes) -> str | None:
        values = self.headers.getRawHeaders(name)
        return values[0].decode("latin-1") if values else None


async def run(
    handler: Callable[..., Awaitable[Any]],
    request: InProcessRequest,
    *arguments: Any,
    hold: Callable[[Answer], Awaitable[Any]] | None = None,
) -> Any:
    """
    Run C{handler(request, *arguments)} and read its answer.

    The request is finished once the answer has been read, and, with C{hold}, only
    after C{hold(answer)} has used it: a buffered answer's bytes stay counted against
    the core's budget while the caller encodes them.

    @return: the L{Answer}, or what C{hold} returned.
    """
    try:
        result = await handler(request, *arguments)
        body = result if isinstance(result, bytes) else request.written()
        content_type = request.responseHeaders.getRawHeaders(b"Content-Type", [b""])[0].decode("latin-1")
        answer = Answer(request.code, content_type, body, request.responseHeaders)
        if hold is None:
            return answer
        return await hold(answer)
    finally:
        request.finish()
