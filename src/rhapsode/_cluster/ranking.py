"""
How a cluster's router ranks its nodes for one request (docs/cluster.md): by what each
node reports of its own residency (its C{GET /node}), never by a residency of the
router's own.  Pure functions of those reports, so they are tested without Ray.

For the model a request is for (C{engine/variant}, or C{engine} alone for a request that
loads nothing), the ranks are, best first:

  1. nodes that hold it now (or were just sent it, until their next report says so, or
     report it promised: their replica answered a route for it whose request has not
     arrived), and are not busy with it (fewer than C{spread_at} leases), fewest leases
     first; a node's leases are those its last report counted and the routes for the
     model this router sent it since that report, whose requests the report could not
     count yet (a burst of requests arrives well inside one report period);
  2. nodes with room for it: a free slot (not counting those that models just sent or
     promised there will take; a node that has not reported yet counts one), and free
     memory for its measured size where any node has measured it; a node holding
     another variant of its engine has no room for it, whatever its slots, for a node's
     engine speaks one variant at a time and the model would take that one's place;
  3. nodes whose least recently used model has no lease, so their own residency can
     evict it, the coldest first (the one whose model was used longest ago: the cluster
     evicts as one residency would, least recently used first), and nodes holding
     another variant of its engine that no stream holds;
  4. nodes that hold it but are busy with it: a model in demand spreads to a node with
     room before it waits behind its own requests, and before it evicts another's; each
     in a rank of its own, fewest leases first, so the next request goes to the node with
     the shortest queue for the model rather than any of them;
  5. every other node: the request waits there as section 3 says, and that node's
     evictionWaitSeconds decides.

Eviction stays with each node's residency manager; a router never evicts by count.

A cluster has a router in each of Serve's proxies (one on the head and on each node with a
replica, which clients reach in turn behind a load balancer or a shared port), and each
knows only its own choices until the nodes report them, half a second or more later.  A
model that no node shows in a router's view is placed through L{Claims}, which the
cluster's directory actor keeps for every router: a model another router placed a moment
ago goes where that one went, and a slot another router just gave to another model counts
as taken.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Generic, Hashable, Iterable, Mapping, NamedTuple, Sequence, TypeVar

__all__ = [
    "CLAIM_SECONDS", "CLAIMS_KEPT", "PROMISE_SECONDS", "REMEMBER_SECONDS", "SPILL_SECONDS", "SPREAD_AT", "Candidate",
    "Claims", "NodeReport", "Offer", "Sent", "first", "model_of", "offered", "promise", "rank", "still_promised",
    "unplaced",
]

#: Leases on a model at which the node holding it counts as busy with it, and a node
#: with room is preferred (a second copy loads there).
SPREAD_AT = 2
#: How long a model a replica answered a route for counts as coming to its node (its
#: report's C{promised}) while the node's own residency does not show it yet.
PROMISE_SECONDS = 10.0
#: How long a model a router sent to a node counts as that node's while the node's own
#: reports show it neither resident nor promised (a few report periods).
REMEMBER_SECONDS = 5.0
#: How long a request is offered only its best rank before the ranks after it too.
SPILL_SECONDS = 5.0
#: How long a model placed on a node stays claimed there for every router (L{Claims}):
#: as long as the node's replica counts it promised, by which time every router's view
#: shows it.
CLAIM_SECONDS = PROMISE_SECONDS
#: The most models L{Claims} keeps (a model id comes from a request's header): the
#: oldest claims go first.
CLAIMS_KEPT = 1024

_R = TypeVar("_R")
_K = TypeVar("_K")


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
    #: Models its replica was routed (it answered C{/_route} for them) that the node does
    #: not hold yet: the front's request is on its way (C{engine/variant} routing keys).
    promised: frozenset[str] = frozenset()
    #: The replica's count of its reports, which tells a router a report newer than the
    #: routes it sent since the last one (None where the replica numbers none).
    number: int | None = None

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
            promised=frozenset(str(m) for m in stats.get("promised") or () if isinstance(m, str)),
            number=stats["report"] if isinstance(stats.get("report"), int) else None,
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
    #: Requests for this model the router sent it since its report, each a lease the
    #: report does not count yet.
    routed: int = 0
    #: The other models the router sent it that its report does not show yet (as many
    #: as C{pending}, by name).
    coming: frozenset[str] = frozenset()

    def shows(self, model_id: str) -> bool:
        """
        Whether this router's view puts C{model_id} on this node: resident, promised, or
        sent (or routed) here by this router since the node's last report.
        """
        engine, variant = model_of(model_id)
        report = self.report
        return bool(
            report.holds(engine, variant) is not None or self.sent or self.routed or report.expects(engine, variant)
        )

    def swaps(self, model_id: str) -> int | None:
        """
        Where this router's view puts another variant of C{model_id}'s engine on this
        node, the leases on it (a variant promised or sent here counts one: its request
        is on its way); None where it puts none.  A node's engine speaks one variant at a
        time, so the model would take that variant's place there, not a free slot.
        """
        engine, variant = model_of(model_id)
        if variant is None:
            return None
        leases = [n for (e, v), n in self.report.resident.items() if e == engine and v != variant]
        for other in self.report.promised | self.coming:
            other_engine, other_variant = model_of(other)
            if other_engine == engine and other_variant != variant:
                leases.append(1)
        return max(leases) if leases else None

    def free(self, model_id: str) -> int:
        """
        The slots this router's view counts free here for C{model_id}: the report's,
        less those the other models sent or promised here will take; none where another
        variant of its engine is here (L{swaps}).
        """
        if self.swaps(model_id) is not None:
            return 0
        return self.report.slots - max(self.pending, self.report.others_promised(model_id))

    def evicts(self, model_id: str) -> bool:
        """
        Whether C{model_id} could start here by evicting a model no stream holds: the
        variant of its engine it would replace, or else the least recently used model.
        """
        swap = self.swaps(model_id)
        return swap == 0 if swap is not None else self.report.lru_leases == 0

    def placed(self) -> frozenset[str]:
        """
        Every model this router's view puts on this node (C{engine/variant} keys).
        """
        resident = {f"{engine}/{variant}" for engine, variant in self.report.resident}
        return frozenset(resident | self.report.promised | self.coming)

    def offer(self, key: _K, model_id: str) -> "Offer[_K]":
        """
        This node, known as C{key}, as this router's view offers it to L{Claims} for
        C{model_id}.
        """
        free = self.free(model_id)
        return Offer(key, free, self.placed(), free > 0 or self.evicts(model_id))


def rank(
    candidates: Sequence[Candidate[_R]], model_id: str, spread_at: int = SPREAD_AT, ties: random.Random | None = None
) -> list[list[_R]]:
    """
    The nodes for a request for C{model_id}, in the five ranks above (empty ranks left
    out), each rank in order of fewest leases; rank 3 is split into one rank a node,
    coldest first, since Serve chooses among the nodes of one rank by its own measure.

    Nodes equal by those orders keep the order of C{candidates}, or a random one drawn
    from C{ties}: a router takes the first node of the best rank (L{offered}), and each
    of a cluster's proxies has a router of its own that knows only its own choices
    until the nodes report them, so routers that all broke ties alike sent two new
    models to one empty node as often as the models came together.
    """
    if ties is not None:
        candidates = list(candidates)
        ties.shuffle(candidates)
    engine, variant = model_of(model_id)
    size = _measured(candidates, engine, variant)
    held: list[tuple[int, Candidate[_R]]] = []
    busy: list[tuple[int, Candidate[_R]]] = []
    room: list[Candidate[_R]] = []
    evictable: list[Candidate[_R]] = []
    rest: list[Candidate[_R]] = []
    for candidate in candidates:
        report = candidate.report
        if candidate.shows(model_id):
            load = (report.holds(engine, variant) or 0) + candidate.routed
            (busy if load >= spread_at else held).append((load, candidate))
        elif candidate.free(model_id) > 0 and (size is None or report.free_bytes is None or report.free_bytes >= size):
            room.append(candidate)
        elif candidate.evicts(model_id):
            evictable.append(candidate)
        else:
            rest.append(candidate)
    ranks = [
        [c.replica for _, c in sorted(held, key=lambda pair: pair[0])],
        [c.replica for c in _by_leases(room)],
        # One rank a node, fewest leases first: Serve would pick among a rank's by
        # queue lengths, which for a route answered at once are all naught.
        *([c.replica] for _, c in sorted(busy, key=lambda pair: pair[0])),
        # One rank a node, coldest first: Serve picks freely among the nodes of one rank.
        *([c.replica] for c in sorted(evictable, key=lambda c: (c.report.lru_used, sum(c.report.resident.values())))),
        [c.replica for c in _by_leases(rest)],
    ]
    return [r for r in ranks if r]


class Sent(Generic[_K]):
    """
    A router's memory of where it sent each model, keyed by its own handle on each node
    (C{_K}), until that node's report shows the model resident or promised, or for
    L{REMEMBER_SECONDS} at most.

    A report made after the routing is not enough to forget it: the replica may have
    made that report before it answered the route (its promise comes with the answer),
    so the report shows neither the model nor its promise, and the node would read as
    room for another model and as a stranger to this one.  And only models are
    remembered, never an engine alone: a route for an engine loads nothing (the front
    asks so every second for capabilities and health), and remembered it would take a
    slot on that node that no model ever fills.
    """

    def __init__(self) -> None:
        #: model -> (the node it was sent to, when).
        self._sent: dict[str, tuple[_K, float]] = {}
        #: node -> (the number of the last report seen of it, model -> requests sent
        #: it for that model since).
        self._routed: dict[_K, tuple[int | None, dict[str, int]]] = {}
        #: request -> (its model, the node chosen for it, when): chosen, not yet routed.
        self._chosen: dict[Hashable, tuple[str, _K, float]] = {}

    def choose(self, request: Hashable, model_id: str, where: _K, now: float) -> None:
        """
        The router chose the node C{where} for C{request}, for C{model_id}, at C{now}.

        Serve asks a router to rank every request of a burst before it routes the first
        of them, so what was chosen counts at once, as if sent: the next request of the
        burst sees it (a model no node holds goes to one node, a queue grows on one node
        only as far as the spreading rule allows).  Choosing again for the same request
        replaces its choice.
        """
        if _names_model(model_id):
            self._chosen[request] = (model_id, where, now)
            self._sent[model_id] = (where, now)

    def record(self, model_id: str, where: _K, now: float, request: Hashable = None) -> None:
        """
        The router sent C{request}, for C{model_id}, to the node C{where} at C{now}.
        """
        self._chosen.pop(request, None)
        if _names_model(model_id):
            self._sent[model_id] = (where, now)
            counts = self._routed.setdefault(where, (None, {}))[1]
            counts[model_id] = counts.get(model_id, 0) + 1

    def candidates(self, nodes: Sequence[tuple[_K, _R, NodeReport]], model_id: str, now: float) -> list[Candidate[_R]]:
        """
        The candidates for a request for C{model_id} among C{nodes} (each node's key,
        the router's replica for it, and its report), with what was sent to each; what
        the nodes' reports now show, or that grew old, is forgotten first.
        """
        reports = {key: report for key, _, report in nodes}
        for key in [key for key in self._routed if key not in reports]:
            del self._routed[key]  # a node gone from the cluster
        for key, shown in reports.items():
            seen = self._routed.get(key)
            if seen is None or shown.number is None or shown.number != seen[0]:
                # A report not seen before counts every lease up to it: what was sent
                # before it starts again from naught (and an unnumbered one always).
                self._routed[key] = (shown.number, {})
        for request, (_, _, when) in list(self._chosen.items()):
            if now - when > REMEMBER_SECONDS:
                del self._chosen[request]  # Serve never routed it (cancelled, or gone)
        for other, (where, when) in list(self._sent.items()):
            report = reports.get(where)
            engine, variant = model_of(other)
            if (now - when > REMEMBER_SECONDS or report is None or report.holds(engine, variant) is not None
                    or report.expects(engine, variant)):
                del self._sent[other]
        sent = self._sent.get(model_id)
        coming = {
            key: frozenset(other for other, (where, _) in self._sent.items() if other != model_id and where == key)
            for key in reports
        }
        return [
            Candidate(
                replica, report, sent=sent is not None and sent[0] == key, pending=len(coming[key]), coming=coming[key],
                routed=self._routed.get(key, (None, {}))[1].get(model_id, 0) + sum(
                    1 for model, where, _ in self._chosen.values() if model == model_id and where == key
                ),
            )
            for key, replica, report in nodes
        ]


def unplaced(candidates: Sequence[Candidate[_R]], model_id: str) -> bool:
    """
    Whether a request for C{model_id} would place it: it names a model (an engine alone
    loads nothing), and this router's view shows it on no node.
    """
    return _names_model(model_id) and not any(candidate.shows(model_id) for candidate in candidates)


def first(ranks: list[list[_R]], chosen: _R) -> list[list[_R]]:
    """
    C{ranks} with C{chosen} taken out of its rank and put before them all, in a rank of
    its own; C{ranks} unchanged where C{chosen} is in none of them.
    """
    if not any(chosen in each for each in ranks):
        return ranks
    rest = [[replica for replica in each if replica != chosen] for each in ranks]
    return [[chosen], *(each for each in rest if each)]


class Offer(NamedTuple, Generic[_K]):
    """
    One node as a router's view offers it for a model to L{Claims.place}.
    """

    #: The router's key for the node.
    key: _K
    #: The slots the router's view counts free there for the model.
    free: int
    #: The models the router's view puts there.
    placed: frozenset[str]
    #: Whether the model could start there without waiting: a free slot, or a model no
    #: stream holds for it to replace (L{Candidate.evicts}).
    ready: bool


class Claims(Generic[_K]):
    """
    Where models were placed a moment ago, for every router of a cluster: its directory
    actor keeps one, and a router asks it (L{place}) before it places a model its own
    view shows on no node.

    Each router knows only its own choices until the nodes report them, so two routers
    placing two models at once, or one placing a model another has just placed, would
    send both models to one empty node, or load one model on two nodes, as often as
    their views were older than the requests between them (a front speaking one request
    after another through proxies that answer in turn did so in 3 of 6 runs in CI).  A claim
    lasts L{CLAIM_SECONDS}: by then every router's view shows the model, resident or
    promised.
    """

    def __init__(self) -> None:
        #: model -> (the node it was placed on, when).
        self._claims: dict[str, tuple[_K, float]] = {}

    def place(self, model_id: str, offers: Sequence[Offer[_K]], now: float) -> _K | None:
        """
        The node to place C{model_id} on, at C{now}, from a router's C{offers}, in the
        router's order (best first).

        Where the model is claimed on one of those nodes and the router's view has it
        ready there (room, or a model it can evict: a node that evicted the model since
        for a model now leased would make it wait), that node.  Otherwise, where the
        router's best node has room in its view, the first node whose room is not taken
        by models claimed there that the router's view does not show; where it has none
        (the router would evict), or no node keeps room, the first node with no such
        claims, or the router's best.  The node chosen is claimed for the model; None
        without offers.
        """
        for model, (_, when) in list(self._claims.items()):
            if now - when > CLAIM_SECONDS:
                del self._claims[model]
        if not offers:
            return None
        claimed = self._claims.get(model_id)
        if claimed is not None and any(offer.key == claimed[0] and offer.ready for offer in offers):
            return claimed[0]

        def unseen(offer: Offer[_K]) -> int:
            return sum(1 for model, (where, _) in self._claims.items()
                       if where == offer.key and model != model_id and model not in offer.placed)

        chosen: _K | None = None
        if offers[0].free > 0:
            chosen = next((offer.key for offer in offers if offer.free - unseen(offer) > 0), None)
        if chosen is None:
            chosen = next((offer.key for offer in offers if not unseen(offer)), offers[0].key)
        self._claims.pop(model_id, None)
        self._claims[model_id] = (chosen, now)
        while len(self._claims) > CLAIMS_KEPT:
            del self._claims[next(iter(self._claims))]
        return chosen


def offered(ranks: list[list[_R]], waited: float, spill_seconds: float = SPILL_SECONDS) -> list[list[_R]]:
    """
    The ranks a router offers Serve for a request that has waited C{waited} seconds to
    be routed: the first node of the best rank alone (the router's own choice, which it
    counts at once: L{Sent.choose}), then the rest of that rank; after C{spill_seconds},
    every later rank too, best first.

    The choice is the router's because Serve picks among the nodes of one rank by their
    queue lengths, which for a route (answered at once) are all naught: it would send a
    burst anywhere in the rank, and the router could not count what it had not chosen.
    Serve passes a request to the next rank not only when every replica of a rank has
    its most requests but also when none answered its queue-length probe within the
    probe's deadline (a tenth of a second at first).  On a loaded box that happens: a
    request for a model went to a node that had to evict its own model to load it, and
    the next request for that one evicted another's.  Offered the best rank alone, a
    request whose probes are late waits while Serve asks again, with longer deadlines;
    a best rank that stays unable to take it (its replicas full, or gone, which Serve
    removes) gives way to the rest after C{spill_seconds}.
    """
    if not ranks:
        return []
    chosen, *peers = ranks[0]
    later = ranks[1:] if waited >= spill_seconds else []
    return [[chosen], *([peers] if peers else []), *later]


def promise(routed: dict[str, float], model_id: str, now: float) -> None:
    """
    Record in C{routed} that a replica answered a route for C{model_id} at C{now}: a model
    (C{engine/variant}) is promised to its node; an engine alone is not, for a route
    asked that way is for a request that loads nothing (the front's calls for an
    engine's capabilities, voices or health, every second), and a promise made by those
    would never be kept: it would hold a slot and draw the engine's models to a node
    that is never sent them.
    """
    if _names_model(model_id):
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


def _names_model(model_id: str) -> bool:
    # engine/variant, as a request that loads a model is routed; an engine alone is not.
    engine, variant = model_of(model_id or "")
    return bool(engine and variant)


def _by_leases(candidates: Iterable[Candidate[_R]]) -> list[Candidate[_R]]:
    return sorted(candidates, key=lambda c: sum(c.report.resident.values()))


def _measured(candidates: Sequence[Candidate[_R]], engine: str, variant: str | None) -> int | None:
    for candidate in candidates:
        for (e, v), size in candidate.report.sizes.items():
            if e == engine and (variant is None or v == variant):
                return size
    return None
