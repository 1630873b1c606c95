"""
How a cluster's router ranks its nodes for one request (docs/cluster.md): by what each
node reports of its own residency (its C{GET /node}), never by a residency of the
router's own.  Pure functions of those reports, so they are tested without Ray.

For the model a request is for (C{engine/variant}, or C{engine} alone for a request that
loads nothing), the ranks are, best first:

  1. nodes that hold it now (or were just sent it, until their next report says so, or
     report it promised: their replica answered a route for it whose request has not
     arrived), and are not busy with it (fewer than C{spread_at} leases), fewest leases
     first;
  2. nodes with room for it: a free slot (not counting those that models just sent or
     promised there will take; a node that has not reported yet counts one), and free
     memory for its measured size where any node has measured it;
  3. nodes whose least recently used model has no lease, so their own residency can
     evict it, the coldest first (the one whose model was used longest ago: the cluster
     evicts as one residency would, least recently used first);
  4. nodes that hold it but are busy with it: a model in demand spreads to a node with
     room before it waits behind its own requests, and before it evicts another's;
  5. every other node: the request waits there as section 3 says, and that node's
     evictionWaitSeconds decides.

Eviction stays with each node's residency manager; a router never evicts by count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, Iterable, Mapping, Sequence, TypeVar

__all__ = ["PROMISE_SECONDS", "SPREAD_AT", "Candidate", "NodeReport", "model_of", "promise", "rank", "still_promised"]

#: Leases on a model at which the node holding it counts as busy with it, and a node
#: with room is preferred (a second copy loads there).
SPREAD_AT = 2
#: How long a model a replica answered a route for counts as coming to its node (its
#: report's C{promised}) while the node's own residency does not show it yet.
PROMISE_SECONDS = 10.0

_R = TypeVar("_R")


def model_of(model_id: str) -> tuple[str, str | None]:
    """
    The engine and variant a routing key names: C{engine/variant}, or C{engine}.
    """
    engine, _, variant = model_id.partition("/")
    return engine, variant or None


@dataclass(frozen=True)
class NodeReport:
    """
    What one node last said of itself (its C{GET /node}), as the router reads it.
    """

    engines: frozenset[str] = frozenset()
    #: (engine, variant) -> leases, for each model resident on the node.
    resident: Mapping[tuple[str, str], int] = field(default_factory=dict)
    #: (engine, variant) -> its measured size, where the node measured it.
    sizes: Mapping[tuple[str, str], int] = field(default_factory=dict)
    slots: int = 0
    free_bytes: int | None = None
    #: The least recently used resident model's leases, or None with nothing resident.
    lru_leases: int | None = None
    #: When that model was last used, as the node's clock wrote it (ISO 8601 in UTC, a
    #: fixed width, so text order is time order; "" with nothing resident).
    lru_used: str = ""
    #: Whether the node has reported at all: one that has not (just started) is taken to
    #: have one free slot, so a burst at a new cluster spreads over its fresh nodes.
    known: bool = True
    #: The node's count of its own reports: a later one has seen what was sent before it.
    number: int = 0
    #: Models its replica was routed (it answered C{/_route} for them) that the node does
    #: not hold yet: the front's request is on its way (C{engine/variant} routing keys).
    promised: frozenset[str] = frozenset()

    @classmethod
    def read(cls, stats: Mapping[str, Any] | None) -> "NodeReport":
        """
        A report from a node's C{GET /node} document; an unknown one (a node that has
        not reported yet) where there is none.
        """
        if not stats:
            return cls(slots=1, known=False)
        residency = stats.get("residency") or {}
        models = [m for m in residency.get("models") or () if isinstance(m, Mapping)]
        resident = {(str(m["engine"]), str(m["variant"])): int(m.get("leases", 0)) for m in models}
        sizes = {(str(m["engine"]), str(m["variant"])): int(m["sizeBytes"]) for m in models if m.get("sizeBytes")}
        oldest = min(models, key=lambda m: str(m.get("lastUsedAt", "")), default=None)
        memory = stats.get("memory") or {}
        free = memory.get("freeBytes")
        return cls(
            engines=frozenset(str(e) for e in stats.get("engines") or ()),
            resident=resident,
            sizes=sizes,
            slots=int(stats.get("slots", 0)),
            free_bytes=int(free) if isinstance(free, int) else None,
            lru_leases=int(oldest.get("leases", 0)) if oldest is not None else None,
            lru_used=str(oldest.get("lastUsedAt", "")) if oldest is not None else "",
            number=int(stats.get("report", 0)),
            promised=frozenset(str(m) for m in stats.get("promised") or () if isinstance(m, str)),
        )

    def holds(self, engine: str, variant: str | None) -> int | None:
        """
        The leases on the model resident here (any variant of C{engine} where no
        variant is named), or None where it is not resident.
        """
        leases = [n for (e, v), n in self.resident.items() if e == engine and (variant is None or v == variant)]
        return min(leases) if leases else None

    def expects(self, engine: str, variant: str | None) -> bool:
        """
        Whether the model was promised here: routed to this node, not yet arrived.
        """
        for key in self.promised:
            promised_engine, promised_variant = model_of(key)
            if promised_engine == engine and (variant is None or promised_variant == variant):
                return True
        return False

    def others_promised(self, model_id: str) -> int:
        """
        How many models other than C{model_id} were promised here: each will take a
        slot the report still counts free.
        """
        return sum(1 for key in self.promised if key != model_id)


@dataclass
class Candidate(Generic[_R]):
    """
    One node as the ranking sees it: the router's own handle on it and its report.
    """

    replica: _R
    report: NodeReport
    #: The router sent it this model since its last report.
    sent: bool = False
    #: Other models the router sent it that its report does not show yet: each will
    #: take one of the slots the report still counts free.
    pending: int = 0


def rank(candidates: Sequence[Candidate[_R]], model_id: str, spread_at: int = SPREAD_AT) -> list[list[_R]]:
    """
    The nodes for a request for C{model_id}, in the five ranks above (empty ranks left
    out), each rank in order of fewest leases; rank 3 is split into one rank a node,
    coldest first, since Serve chooses among the nodes of one rank by its own measure.
    """
    engine, variant = model_of(model_id)
    size = _measured(candidates, engine, variant)
    held: list[tuple[int, Candidate[_R]]] = []
    busy: list[tuple[int, Candidate[_R]]] = []
    room: list[Candidate[_R]] = []
    evictable: list[Candidate[_R]] = []
    rest: list[Candidate[_R]] = []
    for candidate in candidates:
        report = candidate.report
        leases = report.holds(engine, variant)
        if leases is not None and leases >= spread_at:
            busy.append((leases, candidate))
        elif leases is not None or candidate.sent or report.expects(engine, variant):
            held.append((leases or 0, candidate))
        elif report.slots - max(candidate.pending, report.others_promised(model_id)) > 0 and (
            size is None or report.free_bytes is None or report.free_bytes >= size
        ):
            room.append(candidate)
        elif report.lru_leases == 0:
            evictable.append(candidate)
        else:
            rest.append(candidate)
    ranks = [
        [c.replica for _, c in sorted(held, key=lambda pair: pair[0])],
        [c.replica for c in _by_leases(room)],
        [c.replica for _, c in sorted(busy, key=lambda pair: pair[0])],
        # One rank a node, coldest first: Serve picks freely among the nodes of one rank.
        *([c.replica] for c in sorted(evictable, key=lambda c: (c.report.lru_used, sum(c.report.resident.values())))),
        [c.replica for c in _by_leases(rest)],
    ]
    return [r for r in ranks if r]


def promise(routed: dict[str, float], model_id: str, now: float) -> None:
    """
    Record in C{routed} that a replica answered a route for C{model_id} at C{now}: a model
    (C{engine/variant}) is promised to its node; an engine alone is not, for a route
    asked that way is for a request that loads nothing (the front's calls for an
    engine's capabilities, voices or health, every second), and a promise made by those
    would never be kept: it would hold a slot and draw the engine's models to a node
    that is never sent them.
    """
    engine, variant = model_of(model_id or "")
    if engine and variant:
        routed[model_id] = now


def still_promised(routed: dict[str, float], stats: Mapping[str, Any], now: float) -> list[str]:
    """
    The routing keys in C{routed} (key -> when a replica answered a route for it) still
    coming to the node whose C{GET /node} is C{stats}: answered less than
    L{PROMISE_SECONDS} ago and not yet resident there.  The others are dropped from
    C{routed}.
    """
    # A promise names a model (L{promise}), never an engine alone.
    held = {
        f"{model.get('engine')}/{model.get('variant')}"
        for model in (stats.get("residency") or {}).get("models") or ()
        if isinstance(model, Mapping)
    }
    for key, when in list(routed.items()):
        if key in held or now - when > PROMISE_SECONDS:
            del routed[key]
    return sorted(routed)


def _by_leases(candidates: Iterable[Candidate[_R]]) -> list[Candidate[_R]]:
    return sorted(candidates, key=lambda c: sum(c.report.resident.values()))


def _measured(candidates: Sequence[Candidate[_R]], engine: str, variant: str | None) -> int | None:
    for candidate in candidates:
        for (e, v), size in candidate.report.sizes.items():
            if e == engine and (variant is None or v == variant):
                return size
    return None
