"""
What a cluster's front knows of the cluster's nodes (docs/cluster.md): every few seconds
it asks each cluster app it fronts for its nodes (C{GET <app>/_nodes}, the directory the
replicas register with) and each node for its state (C{GET /node}), and keeps the last
answers, so that C{/residency}, C{/engines}, C{/catalog} and C{/metrics} show the nodes
at once, from memory, without a request ever waiting on a node.

A node that stops answering is shown as not answering, with what it last said; one that
leaves the directory is forgotten.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from .._interfaces import IWorkerClient

__all__ = ["ClusterView", "NodeState"]


@dataclass
class NodeState:
    """
    One node as the front last heard of it.
    """

    name: str
    url: str
    cluster: str
    state: dict[str, Any] = field(default_factory=dict)
    answering: bool = False
    #: When it last answered, by the front's clock.
    seen: float | None = None

    def models(self) -> list[dict[str, Any]]:
        residency = self.state.get("residency") or {}
        return [dict(m, node=self.name) for m in residency.get("models") or () if isinstance(m, dict)]

    def summary(self) -> dict[str, Any]:
        residency = self.state.get("residency") or {}
        return {
            "node": self.name,
            "url": self.url,
            "answering": self.answering,
            "engines": list(self.state.get("engines") or ()),
            "resident": residency.get("resident", 0),
            "max": residency.get("max", 0),
            "waiting": residency.get("waiting", 0),
            **({"memory": self.state["memory"]} if self.state.get("memory") else {}),
        }


class ClusterView:
    """
    The nodes of the clusters at C{urls}, asked every C{interval} seconds.

    @param client_for: a client of the HTTP server at a URL (a cluster app, a node).
    """

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        urls: Iterable[str],
        client_for: Callable[[str], IWorkerClient],
        interval: float = 5.0,
    ) -> None:
        self._clock = clock
        self.urls = sorted(set(urls))
        self._client_for = client_for
        self._clients: dict[str, IWorkerClient] = {}
        self.interval = interval
        self.nodes: dict[str, NodeState] = {}
        self._loop: LoopingCall | None = None
        self._round: Deferred[Any] | None = None

    def _client(self, url: str) -> IWorkerClient:
        client = self._clients.get(url)
        if client is None:
            client = self._clients[url] = self._client_for(url)
        return client

    def start(self) -> None:
        if not self.urls or self._loop is not None:
            return
        self._loop = LoopingCall(self._poll)
        self._loop.clock = self._clock
        self._loop.start(self.interval, now=True)

    def stop(self) -> "Deferred[Any]":
        """
        Stop asking, and close the connections the asking opened.
        """
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None
        if self._round is not None:
            self._round.cancel()
        return DeferredList([client.close() for client in self._clients.values()], consumeErrors=True)

    def _poll(self) -> None:
        if self._round is not None:
            return  # the last round is still out: one at a time
        self._round = Deferred.fromCoroutine(self.refresh())
        self._round.addErrback(lambda failure: None)

        def done(_: object) -> None:
            self._round = None

        self._round.addBoth(done)

    async def refresh(self) -> None:
        """
        Ask every cluster for its nodes, then every node for its state.
        """
        listed: dict[str, tuple[str, str]] = {}
        for cluster in self.urls:
            try:
                code, nodes = await self._client(cluster).json(b"GET", "/_nodes")
            except Exception as error:
                self.log.debug("cluster {url} did not list its nodes: {why}", url=cluster, why=str(error))
                # Its nodes are kept as they were, shown as not answering below.
                listed.update({name: (node.url, cluster) for name, node in self.nodes.items() if node.cluster == cluster})
                continue
            if code == 200 and isinstance(nodes, list):
                for node in nodes:
                    if isinstance(node, dict) and isinstance(node.get("node"), str) and isinstance(node.get("url"), str):
                        listed[node["node"]] = (node["url"], cluster)
        for name in list(self.nodes):
            if name not in listed:
                del self.nodes[name]
        for name, (url, cluster) in sorted(listed.items()):
            node = self.nodes.get(name)
            if node is None or node.url != url:
                node = self.nodes[name] = NodeState(name, url, cluster)
            try:
                code, state = await self._client(url).json(b"GET", "/node")
            except Exception:
                node.answering = False
                continue
            node.answering = code == 200 and isinstance(state, dict)
            if node.answering:
                node.state = state
                node.seen = self._clock.seconds()

    # -- what the front shows ----------------------------------------------------------

    def models(self) -> list[dict[str, Any]]:
        """
        Every model resident on a node, each tagged with its node.
        """
        return [model for node in self._sorted() for model in node.models()]

    def summaries(self) -> list[dict[str, Any]]:
        return [node.summary() for node in self._sorted()]

    def holding(self, engine_id: str) -> list[dict[str, Any]]:
        """
        The nodes where C{engine_id} has a model resident: the node, variant and leases.
        """
        return [
            {"node": model["node"], "variant": model["variant"], "leases": model["leases"]}
            for model in self.models()
            if model["engine"] == engine_id
        ]

    def offering(self, engine_id: str) -> list[str]:
        """
        The nodes that have C{engine_id} installed.
        """
        return [node.name for node in self._sorted() if engine_id in (node.state.get("engines") or ())]

    def _sorted(self) -> list[NodeState]:
        return [self.nodes[name] for name in sorted(self.nodes)]

