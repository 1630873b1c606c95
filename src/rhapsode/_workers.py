"""
HTTP to one worker, over its Unix socket or a remote URL: the same protocol either way
(protocol.md section 1), through a persistent connection pool.

Bodies are never buffered here: callers get the C{IResponse} and choose to stream it
(C{deliverBody}) or collect a bounded one.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from twisted.internet.defer import CancelledError, succeed
from twisted.python.failure import Failure
from twisted.internet.endpoints import HostnameEndpoint, UNIXClientEndpoint
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.web.client import Agent, HTTPConnectionPool
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgentEndpointFactory, IBodyProducer, IResponse
from zope.interface import implementer

from rhapsode_worker._errors import ModelUnavailable, SpeechError

from ._proxy import collect

_JSON_LIMIT = 4 * 1024 * 1024


@implementer(IBodyProducer)
class BytesProducer:
    """
    A small request body known in full, written at once (no cooperator, no reactor).
    """

    def __init__(self, data: bytes) -> None:
        self._data = data
        self.length = len(data)

    def startProducing(self, consumer: Any) -> Any:
        consumer.write(self._data)
        return succeed(None)

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass


_TAIL = 512


class _Sniffer(ProtocolWrapper):
    """
    Keeps the last bytes a worker sent on one connection.  twisted.web's client parses a
    chunked body's trailer and throws it away; the tail is how the core reads the
    duration a worker put there, once the body has ended.
    """

    tail = b""

    def dataReceived(self, data: bytes) -> None:
        # Before the parser sees it: the response may end inside this very call.
        self.tail = (self.tail + data)[-_TAIL:]
        super().dataReceived(data)


class _SniffingEndpoint:
    def __init__(self, endpoint: Any) -> None:
        self._endpoint = endpoint

    def connect(self, factory: Any) -> Any:
        # The pool must hold the HTTP protocol itself, not the wrapper around it.
        wrapping = WrappingFactory(factory)
        wrapping.protocol = _Sniffer
        return self._endpoint.connect(wrapping).addCallback(lambda w: w.wrappedProtocol)


@implementer(IAgentEndpointFactory)
class _Endpoints:
    def __init__(self, reactor: Any, address: str) -> None:
        self._reactor = reactor
        self._address = address

    def endpointForURI(self, uri: Any) -> Any:
        if self._address.startswith("unix:"):
            return _SniffingEndpoint(UNIXClientEndpoint(self._reactor, self._address[len("unix:"):]))
        return _SniffingEndpoint(HostnameEndpoint(self._reactor, uri.host, uri.port))


class WorkerClient:
    """
    Requests to one worker at C{address}: C{unix:/path} or C{http://host:port}.
    """

    def __init__(self, reactor: Any, address: str) -> None:
        self.address = address
        self._pool = HTTPConnectionPool(reactor, persistent=True)
        self._pool.maxPersistentPerHost = 64
        if address.startswith("unix:"):
            self._base = b"http://worker"
        else:
            self._base = address.rstrip("/").encode("ascii")
        if address.startswith("https:"):
            self._agent = Agent(reactor, pool=self._pool)
        else:
            endpoints = _Endpoints(reactor, address)
            self._agent = Agent.usingEndpointFactory(reactor, endpoints, pool=self._pool)

    def request(
        self,
        method: bytes,
        path: str,
        body: IBodyProducer | None = None,
        headers: Mapping[bytes, list[bytes]] | None = None,
    ) -> "Any":
        """
        Send a request; the Deferred fires with the C{IResponse} once headers arrive.
        Cancelling it before then abandons the request.
        """
        pending = self._agent.request(
            method, self._base + path.encode("utf-8"), Headers(dict(headers or {})), body
        )
        return pending.addErrback(self._unreachable)

    def _unreachable(self, failure: Failure) -> Failure:
        # A worker that cannot be reached, or hung up before answering, is a model that is
        # not available right now: retryable, unlike the adapter's own errors.
        if failure.check(CancelledError, SpeechError):
            return failure
        reason = failure.value
        inner = getattr(reason, "reasons", None)
        if inner:
            reason = inner[0].value
        return Failure(ModelUnavailable(f"worker at {self.address} did not answer: {reason}"))

    async def json(self, method: bytes, path: str, body: Any = None) -> tuple[int, Any]:
        """
        A small JSON exchange (capabilities, voices, health).
        """
        producer = None
        headers = {}
        if body is not None:
            producer = BytesProducer(json.dumps(body).encode())
            headers = {b"Content-Type": [b"application/json"]}
        response: IResponse = await self.request(method, path, producer, headers)
        raw = await collect(response, _JSON_LIMIT)
        return response.code, json.loads(raw) if raw else None

    def close(self) -> Any:
        return self._pool.closeCachedConnections()
