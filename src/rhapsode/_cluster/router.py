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

from .ranking import SPREAD_AT, Candidate, NodeReport, rank

__all__ = ["ResidencyRouter"]

#: How long a model the router sent to a node counts as that node's while no report of
#: the node's since says otherwise (a few report periods).
REMEMBER_SECONDS = 5.0


class ResidencyRouter(RequestRouter):  # type: ignore[misc]
    """
    Ranks the replicas for a request by what their nodes report holding.
    """

    #: model -> (replica, when, the replica's report number then), for each model sent.
    _sent: dict[str, tuple[ReplicaID, float, int]]

    def initialize_state(self, **kwargs: Any) -> None:
        self._sent = {}
        self._spread_at = int(kwargs.get("spread_at", SPREAD_AT))

    def _memory(self) -> dict[str, tuple[ReplicaID, float, int]]:
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
        reports = {replica.replica_id: NodeReport.read(replica.routing_stats) for replica in candidate_replicas}

        def unreported(where: ReplicaID, when: float, number: int) -> bool:
            # Sent there, and no report of that node's since: it cannot show it yet.
            report = reports.get(where)
            return now - when <= REMEMBER_SECONDS and report is not None and report.number <= number

        for other, (where, when, number) in list(memory.items()):
            if not unreported(where, when, number):
                del memory[other]
        sent = memory.get(model)
        candidates = []
        for replica in candidate_replicas:
            report = reports[replica.replica_id]
            pending = sum(1 for other, (where, _, _) in memory.items() if other != model and where == replica.replica_id)
            candidates.append(Candidate(
                replica, report, sent=sent is not None and replica.replica_id == sent[0], pending=pending,
            ))
        ranked: List[List[RunningReplica]] = rank(candidates, model, getattr(self, "_spread_at", SPREAD_AT))
        return ranked

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        model = self._model_of(pending_request)
        if not model:
            return
        number = 0
        for replica in self.curr_replicas.values() if hasattr(self, "curr_replicas") else ():
            if replica.replica_id == replica_id:
                number = NodeReport.read(replica.routing_stats).number
        self._memory()[model] = (replica_id, time.monotonic(), number)
