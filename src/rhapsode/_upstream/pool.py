"""
HTTP to one worker, over its Unix socket or a remote URL: the same protocol either way
(protocol.md section 1), through kept-alive connections of its own HTTP/1.1 client (L{rhapsode._upstream.wire}).

Bodies are never buffered here: callers get the response and choose to stream it
(C{deliverBody}) or collect a bounded one.
"""

from __future__ import annotations

import json
from typing import Any, Mapping
from urllib.parse import urlsplit

from twisted.internet.defer import CancelledError, Deferred, DeferredList, succeed
from twisted.internet.endpoints import HostnameEndpoint, UNIXClientEndpoint, wrapClientTLS
from twisted.internet.protocol import Factory
from twisted.python.failure import Failure
from twisted.web.iweb import IBodyProducer
from zope.interface import implementer

from rhapsode_protocol.errors import ModelUnavailable, SpeechError

from .._interfaces import IWorkerClient
from .body import collect, worker_json
from .wire import Connection, WorkerResponse, encode_request

_JSON_LIMIT = 4 * 1024 * 1024
#: Idle connections kept per worker; more are closed when they come back.
MAX_IDLE = 64
#: Requests that may be sent again on a fresh connection when a kept one turns out closed.
_REPEATABLE = frozenset([b"GET", b"HEAD", b"OPTIONS", b"DELETE"])


@implementer(IBodyProducer)
class BytesProducer:
    """
    A small request body known in full: written with the request's head, in one send.
    """

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.length = len(data)

    def startProducing(self, consumer: Any) -> Any:
        consumer.write(self.data)
        return succeed(None)

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass


class _Factory(Factory):
    def __init__(self, client: "WorkerClient") -> None:
        self._client = client

    def buildProtocol(self, addr: Any) -> Connection:
        connection = Connection(self._client._idle_again, self._client._gone)
        self._client._open.add(connection)
        return connection


class _Attempt:
    """
    One request on its way to a worker: on a kept connection first, and once more on a
    fresh one when a repeatable request finds the kept connection already closed.

    Each step's callbacks are this object's own methods and nothing refers back to it
    once the answer has come, so a request leaves no reference cycle behind for the
    garbage collector to find (closures that named each other left about twenty
    objects per request to it, and a collection every few dozen requests).
    """

    __slots__ = ("_client", "_method", "_head", "_payload", "_retry", "_step", "_cancelled", "_result")

    def __init__(self, client: "WorkerClient", method: bytes, head: bytes, payload: Any, retry: bool) -> None:
        self._client = client
        self._method = method
        self._head = head
        self._payload = payload
        self._retry = retry
        self._step: Deferred[Any] | None = None
        self._cancelled = False
        # Let go of once it has fired: it refers back to this object (its canceller).
        self._result: Deferred[WorkerResponse] | None = Deferred(self._cancel)

    def start(self, connection: Connection | None) -> "Deferred[WorkerResponse]":
        """
        Send on C{connection} (a kept one), or on a fresh one when None.
        """
        result = self._result
        assert result is not None
        if connection is None:
            self._fresh()
        else:
            self._send(connection, True)
        return result

    def _send(self, connection: Connection, reused: bool) -> None:
        self._step = step = connection.request(self._method, self._head, self._payload)
        step.addCallbacks(self._answered, self._failed, errbackArgs=(reused,))

    def _fresh(self) -> None:
        self._step = connecting = self._client._connect()
        connecting.addCallbacks(self._send, self._failed, callbackArgs=(False,), errbackArgs=(False,))

    def _answered(self, response: WorkerResponse) -> None:
        self._step = None
        result, self._result = self._result, None
        if result is not None and not result.called:
            result.callback(response)

    def _failed(self, failure: Failure, reused: bool) -> None:
        self._step = None
        if self._result is None or self._result.called:
            return
        if self._cancelled:
            result, self._result = self._result, None
            result.errback(CancelledError())
            return
        if reused and self._retry and not failure.check(CancelledError):
            # A kept connection the worker had already closed: once more, afresh.
            self._fresh()
            return
        result, self._result = self._result, None
        result.errback(self._client._unreachable(failure))

    def _cancel(self, _: object) -> None:
        self._cancelled = True
        step, self._step = self._step, None
        if step is not None and not step.called:
            step.cancel()


@implementer(IWorkerClient)
class WorkerClient:
    """
    Requests to one worker at C{address}: C{unix:/path} or C{http(s)://host:port[/prefix]},
    over kept-alive connections (at most L{MAX_IDLE} of them idle).
    """

    def __init__(self, reactor: Any, address: str) -> None:
        self.address = address
        self._idle: list[Connection] = []
        #: Every connection open to the worker, idle or carrying a request.
        self._open: set[Connection] = set()
        self._factory = _Factory(self)
        if address.startswith("unix:"):
            self._host = b"worker"
            self._prefix = b""
            self._endpoint: Any = UNIXClientEndpoint(reactor, address[len("unix:"):])
        else:
            parts = urlsplit(address)
            tls = parts.scheme == "https"
            port = parts.port or (443 if tls else 80)
            host = parts.hostname or ""
            self._host = parts.netloc.encode("ascii")
            self._prefix = parts.path.rstrip("/").encode("utf-8")
            self._endpoint = HostnameEndpoint(reactor, host.encode("idna"), port)
            if tls:
                from twisted.internet.ssl import optionsForClientTLS

                self._endpoint = wrapClientTLS(optionsForClientTLS(host), self._endpoint)

    # -- the pool ------------------------------------------------------------------

    def _idle_again(self, connection: Connection) -> None:
        if len(self._idle) < MAX_IDLE:
            self._idle.append(connection)
        else:
            connection.transport.loseConnection()  # type: ignore[union-attr]

    def _gone(self, connection: Connection) -> None:
        self._open.discard(connection)
        if connection in self._idle:
            self._idle.remove(connection)

    def abort_all(self) -> None:
        """
        Drop every connection to the worker now: what is in flight on them fails (a
        stream is aborted), and the next request connects afresh.
        """
        self._idle = []
        for connection in list(self._open):
            transport = connection.transport
            if transport is not None:
                abort = getattr(transport, "abortConnection", None)
                (abort or transport.loseConnection)()

    def _connect(self) -> "Deferred[Connection]":
        return self._endpoint.connect(self._factory)

    # -- requests -------------------------------------------------------------------

    def request(
        self,
        method: bytes,
        path: str,
        body: IBodyProducer | None = None,
        headers: Mapping[bytes, list[bytes]] | None = None,
    ) -> "Deferred[WorkerResponse]":
        """
        Send a request; the Deferred fires with the response once its head arrives.
        Cancelling it before then abandons the request (and its connection).
        """
        length = None if body is None else body.length
        if length is None and method in (b"POST", b"PUT"):
            length = 0
        head = encode_request(method, self._prefix + path.encode("utf-8"), self._host, dict(headers or {}), length)
        payload: Any = body.data if isinstance(body, BytesProducer) else body
        retry = method in _REPEATABLE and body is None
        attempt = _Attempt(self, method, head, payload, retry)
        while self._idle:
            connection = self._idle.pop()
            if connection.transport is not None and not connection.busy:
                return attempt.start(connection)
        return attempt.start(None)

    def _unreachable(self, failure: Failure) -> Failure:
        # A worker that cannot be reached, or hung up before answering, is a model that is
        # not available right now: retryable, unlike the adapter's own errors.
        if failure.check(CancelledError, SpeechError):
            return failure
        reason = failure.value
        inner = getattr(reason, "reasons", None)
        if inner:
            reason = inner[0].value
        # The worker's address (a socket's path, a URL) stays out of a caller's message.
        kind = type(reason).__name__
        return Failure(ModelUnavailable(f"the worker did not answer ({kind})"))

    async def json(self, method: bytes, path: str, body: Any = None) -> tuple[int, Any]:
        """
        A small JSON exchange (capabilities, voices, health).

        @raise Internal: the answer is not JSON, or nests too deep to parse.
        """
        producer = None
        headers = {}
        if body is not None:
            producer = BytesProducer(json.dumps(body).encode())
            headers = {b"Content-Type": [b"application/json"]}
        response = await self.request(method, path, producer, headers)
        raw = await collect(response, _JSON_LIMIT)
        return response.code, worker_json(raw, f"{method.decode()} {path}") if raw else None

    def close(self) -> "Deferred[Any]":
        """
        Close the idle connections; fires once they have closed.
        """
        idle, self._idle = self._idle, []
        waits = [c.lost for c in idle if c.transport is not None]
        for connection in idle:
            if connection.transport is not None:
                connection.transport.loseConnection()
        return DeferredList(waits, consumeErrors=True)
