"""
A cluster engine's upstream (docs/cluster.md): each request asks the cluster's Serve app
where its model should go (C{GET <app>/_route}, which the cluster's residency router
sends to the best node's replica, which answers with its node core's address), then goes
to that node core itself, over a kept-alive connection of its own.

Asking through Ray and speaking directly keeps what a worker connection gives: a reader
that falls behind pauses the node's socket (Ray Serve's proxy buffers a streamed answer
whole, measured with a client that read nothing), the duration trailer arrives, and a node
that dies mid-answer cuts the connection, never ending it cleanly.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.interfaces import IProtocol, IReactorTime
from twisted.python.failure import Failure
from twisted.web.iweb import IBodyProducer
from zope.interface import implementer

from rhapsode_protocol.errors import ModelUnavailable
from rhapsode_protocol.validation import TooDeep, loads_json

from .._interfaces import IWorkerClient
from .body import collect

__all__ = ["ROUTE_PATH", "ClusterClient"]

#: Where a cluster's Serve app answers which node a request's model should go to.
ROUTE_PATH = "/_route"
_ROUTE_LIMIT = 64 * 1024
#: How long the cluster's answer for a model stands for the next request, when this
#: front has no other request for that model in flight: a request through Ray Serve costs
#: a proxy hop and two actor calls (20 ms p50 on a loaded 2-core box, bench/cluster.py),
#: which one caller speaking line after line would pay on every line, for an answer that
#: would not change.  A request made while another for the same model is still being
#: answered always asks: whether the node holding the model is busy enough that a second
#: node should load it is the cluster router's question (it ranks by every node's leases),
#: and an answer kept here would send every request of a burst to one node.  A request
#: that fails before the node answers drops the answer, so a node that went asks again.
ROUTE_SECONDS = 1.0


@implementer(IWorkerClient)
class ClusterClient:
    """
    Requests for one engine of a cluster: each routed by the cluster, then sent to the
    node it chose, at that node's C{/worker/<engine>}.

    @param app: the client of the cluster's Serve app (its C{/rhapsode} prefix).
    @param engine_id: the engine this client's requests are for.
    @param model_header: the header naming each request's model to the cluster's router.
    @param node_client: a client of a node core at a URL.
    """

    def __init__(
        self,
        app: IWorkerClient,
        engine_id: str,
        model_header: bytes,
        node_client: Callable[[str], IWorkerClient],
        clock: IReactorTime | None = None,
        route_seconds: float = ROUTE_SECONDS,
    ) -> None:
        self._app = app
        self._clock = clock
        self._route_seconds = route_seconds
        #: model -> (the node's client, its name, until when the answer stands).
        self._routes: dict[bytes, tuple[IWorkerClient, str, float]] = {}
        #: model -> this client's requests for it whose answers have not ended.
        self._answering: dict[bytes, int] = {}
        self.engine_id = engine_id
        self._model_header = model_header
        self._node_client = node_client
        self._nodes: dict[str, IWorkerClient] = {}
        self.address = f"{getattr(app, 'address', '')}{ROUTE_PATH}"
        #: The node each request last went to, by its name (for the front's metrics and tests).
        self.last_node: str | None = None

    def _model(self, headers: Mapping[bytes, list[bytes]] | None) -> bytes:
        return ((headers or {}).get(self._model_header) or [self.engine_id.encode()])[0]

    async def _route(self, headers: Mapping[bytes, list[bytes]] | None) -> IWorkerClient:
        model = self._model(headers)
        known = self._routes.get(model)
        now = self._clock.seconds() if self._clock is not None else None
        if known is not None and now is not None and now < known[2] and not self._answering.get(model):
            self.last_node = known[1]
            return known[0]
        response = await self._app.request(b"GET", ROUTE_PATH, None, {self._model_header: [model]})
        raw = await collect(response, _ROUTE_LIMIT)
        try:
            node = loads_json(raw)
            url, name = str(node["url"]), str(node["node"])
        except (TooDeep, ValueError, KeyError, TypeError):
            raise ModelUnavailable(f"the cluster answered {ROUTE_PATH} with {response.code} and no node") from None
        if response.code != 200:
            raise ModelUnavailable(f"the cluster answered {ROUTE_PATH} with {response.code}")
        client = self._nodes.get(url)
        if client is None:
            client = self._nodes[url] = self._node_client(f"{url}/worker/{self.engine_id}")
        self.last_node = name
        if now is not None:
            self._routes[model] = (client, name, now + self._route_seconds)
        return client

    def request(
        self,
        method: bytes,
        path: str,
        body: IBodyProducer | None = None,
        headers: Mapping[bytes, list[bytes]] | None = None,
    ) -> "Deferred[Any]":
        model = self._model(headers)

        async def send() -> Any:
            client = await self._route(headers)
            self._answering[model] = self._answering.get(model, 0) + 1
            try:
                response = await client.request(method, path, body, headers)
            except Exception:
                self._answered(model)
                # The node did not answer: the next request asks the cluster afresh.
                self._routes.pop(model, None)
                raise
            return _Answer(response, lambda: self._answered(model))

        return Deferred.fromCoroutine(send())

    def _answered(self, model: bytes) -> None:
        left = self._answering.get(model, 0) - 1
        if left > 0:
            self._answering[model] = left
        else:
            self._answering.pop(model, None)

    async def json(self, method: bytes, path: str, body: Any = None) -> tuple[int, Any]:
        client = await self._route(None)
        try:
            return await client.json(method, path, body)
        except Exception:
            self._routes.pop(self._model(None), None)
            raise

    def abort_all(self) -> None:
        for client in self._nodes.values():
            client.abort_all()

    def close(self) -> "Deferred[Any]":
        closing = [client.close() for client in self._nodes.values()]
        return DeferredList([*closing, self._app.close()], consumeErrors=True)


class _Answer:
    """
    A node's response, whose body's end (however it ends) is told to C{ended} once;
    everything else is the response's own.
    """

    def __init__(self, response: Any, ended: Callable[[], None]) -> None:
        self._response = response
        self._ended: Callable[[], None] | None = ended

    def __getattr__(self, name: str) -> Any:
        return getattr(self._response, name)

    def deliverBody(self, protocol: IProtocol) -> None:
        self._response.deliverBody(_Ending(protocol, self._end))

    def _end(self) -> None:
        ended, self._ended = self._ended, None
        if ended is not None:
            ended()


@implementer(IProtocol)
class _Ending:
    """
    A body's reader, told through to C{protocol}, that calls C{ended} as the body ends.
    """

    def __init__(self, protocol: IProtocol, ended: Callable[[], None]) -> None:
        self._protocol = protocol
        self._ended = ended

    def makeConnection(self, transport: Any) -> None:
        self._protocol.makeConnection(transport)

    def connectionMade(self) -> None:
        # The reader's own connectionMade runs inside its makeConnection, above.
        pass

    def dataReceived(self, data: bytes) -> None:
        self._protocol.dataReceived(data)

    def connectionLost(self, reason: Failure) -> None:
        self._ended()
        self._protocol.connectionLost(reason)
