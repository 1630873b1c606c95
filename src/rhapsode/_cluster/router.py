"""
The cluster's request router: a Ray Serve C{RequestRouter} that sends each request to the
node already holding its model, by the nodes' own residency reports
(L{rhapsode._cluster.ranking}).

Each replica reports its node core's C{GET /node} as its routing stats.  Between two
reports a router remembers where it just sent each model, so a burst for a model that no
node holds yet loads it once, on one node, rather than on every node that had room.
Which replica of a rank takes the request is Serve's own choice (the one with the
shortest queue), and a rank whose replicas are all at their most requests passes the
request to the next rank.
"""

from __future__ import annotations

import time
from typing import Any, List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from .ranking import Candidate, NodeReport, model_of, rank

__all__ = ["ResidencyRouter"]

#: How long a model the router sent to a node counts as that node's, waiting for its
#: report to say so (a few report periods).
REMEMBER_SECONDS = 5.0


class ResidencyRouter(RequestRouter):  # type: ignore[misc]
    """
    Ranks the replicas for a request by what their nodes report holding.
    """

    _sent: dict[str, tuple[ReplicaID, float]]

    def initialize_state(self, **kwargs: Any) -> None:
        self._sent = {}

    def _memory(self) -> dict[str, tuple[ReplicaID, float]]:
        # Serve calls initialize_state as it builds the router; made here should it not.
        if not hasattr(self, "_sent"):
            self._sent = {}
        return self._sent

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
        if not model:
            return [candidate_replicas]
        now = time.monotonic()
        memory = self._memory()
        sent = memory.get(model)
        if sent is not None and now - sent[1] > REMEMBER_SECONDS:
            del memory[model]
            sent = None
        candidates = []
        for replica in candidate_replicas:
            report = NodeReport.read(replica.routing_stats)
            # Other models just sent here that its report does not show yet.
            pending = sum(
                1 for other, (where, when) in memory.items()
                if other != model and where == replica.replica_id and now - when <= REMEMBER_SECONDS
                and report.holds(*model_of(other)) is None
            )
            candidates.append(Candidate(
                replica, report, sent=sent is not None and replica.replica_id == sent[0], pending=pending,
            ))
        ranked: List[List[RunningReplica]] = rank(candidates, model)
        return ranked

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        model = self._model_of(pending_request)
        if model:
            self._memory()[model] = (replica_id, time.monotonic())
