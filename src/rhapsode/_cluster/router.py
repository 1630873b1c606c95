"""
The cluster's request router: a Ray Serve C{RequestRouter} that sends each request to the
node already holding its model, by the nodes' own residency reports
(L{rhapsode._cluster.ranking}).

Each replica reports its node core's C{GET /node} as its routing stats, numbered.  Until
a node's report shows a model it was sent (L{rhapsode._cluster.ranking.Sent}), a router
remembers sending it there, so a burst for a model that no node holds yet loads it once,
on one node, rather than on every node that had room; and the requests it sent a node
since that node's last report count as leases there, so a burst for a model in demand
spreads rather than queueing on one node.  Serve ranks every request of a burst before it
routes the first, so the router counts its choice as it makes it: the first node of the
best rank (ties broken at random: each proxy has a router of its own), offered alone
(L{rhapsode._cluster.ranking.offered}), then the rest of that rank, and after a few
seconds the later ranks (Serve passes to the next rank when a rank's replicas are late
with their queue lengths, not only when they are full).

A cluster has a router in each of Serve's proxies, and a router's view of what the others
chose is as old as the nodes' reports; so a model that no node shows in a router's view
is placed where the cluster's directory says (L{rhapsode._cluster.ranking.Claims}), which
every router asks.  A directory that does not answer within L{PLACE_SECONDS} leaves the
choice to the router alone.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any, List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from .directory import directory
from .ranking import SPREAD_AT, Candidate, NodeReport, Sent, first, offered, rank, unplaced

__all__ = ["PLACE_SECONDS", "ResidencyRouter"]

#: How long a router waits for the directory's answer before it places a model alone: a
#: placement comes before a model's load, which takes seconds.
PLACE_SECONDS = 1.0

_log = logging.getLogger(__name__)


class ResidencyRouter(RequestRouter):  # type: ignore[misc]
    """
    Ranks the replicas for a request by what their nodes report holding.
    """

    _sent: Sent[ReplicaID]

    def initialize_state(self, **kwargs: Any) -> None:
        self._sent = Sent()
        self._spread_at = int(kwargs.get("spread_at", SPREAD_AT))
        self._ties = random.Random()

    def _memory(self) -> Sent[ReplicaID]:
        # Serve calls initialize_state as it builds the router; made here should it not.
        if not hasattr(self, "_sent"):
            self._sent = Sent()
        return self._sent

    def _tie_breaker(self) -> random.Random:
        # As _memory: made here should Serve not have called initialize_state.
        if not hasattr(self, "_ties"):
            self._ties = random.Random()
        return self._ties

    def _model_of(self, pending: Optional[PendingRequest]) -> str:
        if pending is None:
            return ""
        return str(getattr(pending.metadata, "multiplexed_model_id", "") or "")

    async def choose_replicas(
        self,
        candidate_replicas: List[RunningReplica],
        pending_request: Optional[PendingRequest] = None,
    ) -> List[List[RunningReplica]]:
        model = self._model_of(pending_request)
        if pending_request is None or not model:
            return [candidate_replicas]
        nodes = [(replica.replica_id, replica, NodeReport.read(replica.routing_stats)) for replica in candidate_replicas]
        now = time.monotonic()
        memory = self._memory()
        candidates = memory.candidates(nodes, model, now)
        ranked: List[List[RunningReplica]] = rank(
            candidates, model, getattr(self, "_spread_at", SPREAD_AT), self._tie_breaker()
        )
        if ranked and unplaced(candidates, model):
            ranked = await self._placed(model, ranked, candidates)
        # Serve's own record of when the request came, by the wall clock.
        waited = time.time() - pending_request.created_at
        offer = offered(ranked, waited)
        if offer:
            memory.choose(pending_request.metadata.internal_request_id, model, offer[0][0].replica_id, now)
        return offer

    async def _placed(
        self, model: str, ranked: List[List[RunningReplica]], candidates: List[Candidate[RunningReplica]]
    ) -> List[List[RunningReplica]]:
        """
        C{ranked} led by the replica the cluster's directory places C{model} on, from this
        router's ranks and view; C{ranked} unchanged where the directory does not answer.
        """
        by_key = {candidate.replica.replica_id.unique_id: candidate for candidate in candidates}
        keys = [replica.replica_id.unique_id for each in ranked for replica in each]
        offers = [by_key[key].offer(key, model) for key in keys]
        try:
            if getattr(self, "_directory", None) is None:
                self._directory = directory()
            key = await asyncio.wait_for(self._directory.place.remote(model, offers), PLACE_SECONDS)
        except Exception as failure:  # the directory gone or slow: this router's choice stands
            self._directory = None
            _log.warning("the cluster's directory did not place %s (%r): this router places it", model, failure)
            return ranked
        if key is None or key not in by_key:
            return ranked
        return first(ranked, by_key[key].replica)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        self._memory().record(
            self._model_of(pending_request), replica_id, time.monotonic(), pending_request.metadata.internal_request_id
        )
