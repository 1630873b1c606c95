"""
How a cluster's router ranks its nodes for a request (rhapsode._cluster.ranking), from
what each node reports of its own residency: the holder first, then room, then a node
that can evict, then the rest.
"""

from __future__ import annotations

import random
from typing import Any

from rhapsode._cluster.ranking import (
    CLAIM_SECONDS, CLAIMS_KEPT, PROMISE_SECONDS, REMEMBER_SECONDS, SPILL_SECONDS, Candidate, Claims, NodeReport, Offer,
    Sent, first, model_of, offered, promise, rank, still_promised, unplaced,
)


def report(*resident: tuple[str, str, int], slots: int = 0, free: int | None = None,
           sizes: dict[tuple[str, str], int] | None = None, engines: tuple[str, ...] = ("tone", "piper"),
           promised: tuple[str, ...] = (), number: int | None = None) -> NodeReport:
    models = [
        {"engine": e, "variant": v, "leases": n, "lastUsedAt": f"2026-12-01T00:00:0{i}.000Z",
         **({"sizeBytes": (sizes or {})[(e, v)]} if (e, v) in (sizes or {}) else {})}
        for i, (e, v, n) in enumerate(resident)
    ]
    stats: dict[str, Any] = {"engines": list(engines), "residency": {"models": models}, "slots": slots,
                             "promised": list(promised)}
    if free is not None:
        stats["memory"] = {"freeBytes": free, "totalBytes": 2 * free}
    if number is not None:
        stats["report"] = number
    return NodeReport.read(stats)


def test_a_routing_key_names_an_engine_and_maybe_a_variant() -> None:
    """
    engine/variant splits at the slash; an engine alone names no variant.
    """
    assert model_of("piper/medium") == ("piper", "medium")
    assert model_of("tone") == ("tone", None)


def test_the_node_holding_the_model_comes_first_fewest_leases_first() -> None:
    """
    Nodes holding the model (any variant for a key naming none) rank first, by their
    leases on it; the others follow in their own ranks.
    """
    busy = Candidate("busy", report(("piper", "medium", 1)))
    quiet = Candidate("quiet", report(("piper", "medium", 0)))
    empty = Candidate("empty", report(slots=1))
    assert rank([busy, empty, quiet], "piper/medium") == [["quiet", "busy"], ["empty"]]
    assert rank([busy, empty], "piper") == [["busy"], ["empty"]]
    assert rank([busy, empty], "piper/other") == [["empty"], ["busy"]]


def test_a_node_just_sent_the_model_counts_as_holding_it_until_it_reports() -> None:
    """
    Between two reports a node the router has just sent the model to ranks as its
    holder, so a burst does not load it on every node.
    """
    sent = Candidate("sent", report(slots=1), sent=True)
    other = Candidate("other", report(slots=1))
    assert rank([other, sent], "tone/v1") == [["sent"], ["other"]]


def test_a_model_a_node_reports_promised_counts_as_held_there_and_takes_a_slot() -> None:
    """
    A report made after the node's replica answered a route for a model, but before the
    front's request reached the node, says the model is promised: that node ranks as its
    holder (a second router, or the first after forgetting, sends it there too), and the
    promised model takes one of the slots the report still counts free.
    """
    coming = Candidate("coming", report(slots=1, promised=("tone/v1",)))
    other = Candidate("other", report(slots=1))
    assert rank([other, coming], "tone/v1") == [["coming"], ["other"]]
    assert rank([other, coming], "tone") == [["coming"], ["other"]]
    assert rank([coming, other], "piper/medium") == [["other"], ["coming"]]
    assert rank([coming, other], "tone/v2") == [["other"], ["coming"]]  # another variant: not held, no room
    assert NodeReport.read({"promised": ["tone/v1", 3]}).promised == {"tone/v1"}


def test_a_promise_lasts_until_the_node_holds_the_model_or_it_grows_old() -> None:
    """
    A replica keeps a route it answered in its reports until its node's residency shows
    that model (its engine and variant: another variant of the engine keeps the promise),
    or for PROMISE_SECONDS at most; what it drops it forgets.
    """
    routed = {"tone/v1": 100.0, "piper/medium": 100.0, "espeak/fast": 100.0, "kokoro/v1": 100.0 - PROMISE_SECONDS - 1}
    node = {"residency": {"models": [{"engine": "piper", "variant": "medium", "leases": 1},
                                     {"engine": "espeak", "variant": "default", "leases": 0}]}}
    assert still_promised(routed, node, 101.0) == ["espeak/fast", "tone/v1"]
    assert routed == {"espeak/fast": 100.0, "tone/v1": 100.0}
    assert still_promised(routed, {}, 100.0 + PROMISE_SECONDS + 0.1) == [] and routed == {}


def test_only_a_route_for_a_model_is_a_promise_never_one_for_an_engine_alone() -> None:
    """
    A route answered for engine/variant promises that model to the node; one for an
    engine alone (the front asks so for capabilities, voices and health, which load
    nothing) promises nothing, so it holds no slot and draws no model to that node.
    """
    routed: dict[str, float] = {}
    promise(routed, "tone/v1", 5.0)
    assert routed == {"tone/v1": 5.0}
    promise(routed, "espeak", 6.0)
    promise(routed, "", 7.0)
    assert routed == {"tone/v1": 5.0}
    promise(routed, "tone/v1", 8.0)
    assert routed == {"tone/v1": 8.0}


def test_room_needs_a_slot_and_the_models_measured_size_in_free_memory() -> None:
    """
    A free slot is room, unless some node measured the model larger than this node's
    free memory; a full node whose least recently used model has no lease can evict;
    a node whose models are all leased comes last.
    """
    sizes = {("piper", "medium"): 500}
    holder = Candidate("holder", report(("piper", "medium", 1), sizes=sizes))
    roomy = Candidate("roomy", report(slots=1, free=1000))
    tight = Candidate("tight", report(slots=1, free=100))
    evicts = Candidate("evicts", report(("tone", "v1", 0)))
    leased = Candidate("leased", report(("tone", "v1", 1)))
    assert rank([leased, evicts, tight, roomy, holder], "piper/medium") == [
        ["holder"], ["roomy"], ["evicts"], ["tight", "leased"],
    ]
    assert rank([tight], "tone/v1") == [["tight"]]


def test_a_node_that_has_not_reported_counts_one_free_slot() -> None:
    """
    A node with no report yet (just started) is taken to have one free slot, so a burst
    at a new cluster spreads over its fresh nodes; once a model has been sent to it, it
    has none left until it reports, and it is never left out.
    """
    new, other = NodeReport.read(None), report(("tone", "v1", 0))
    assert rank([Candidate("busy", other), Candidate("new", new)], "piper/medium") == [["new"], ["busy"]]
    assert rank([Candidate("busy", other), Candidate("new", new, pending=1)], "piper/medium") == [["busy"], ["new"]]


def test_a_slot_a_model_was_just_sent_to_is_not_room_for_another() -> None:
    """
    A node the router just sent another model to ranks as having that slot taken until
    its report shows the model, so a burst of two models goes to two nodes.
    """
    busy = Candidate("busy", report(slots=1), pending=1)
    free = Candidate("free", report(slots=1))
    assert rank([busy, free], "piper/medium") == [["free"], ["busy"]]


def test_a_model_in_demand_spreads_to_a_node_with_room_before_it_waits_or_evicts() -> None:
    """
    A holder with spread_at leases or more on the model ranks after a node with room
    (a second copy loads there), yet before a node that would have to evict for it.
    """
    busy = Candidate("busy", report(("tone", "v1", 2)))
    spare = Candidate("spare", report(slots=1))
    full = Candidate("full", report(("piper", "medium", 0)))
    assert rank([busy, spare, full], "tone/v1") == [["spare"], ["busy"], ["full"]]
    assert rank([busy, spare, full], "tone/v1", spread_at=3) == [["busy"], ["spare"], ["full"]]
    assert rank([busy, full], "tone/v1") == [["busy"], ["full"]]


def test_among_nodes_that_can_evict_the_coldest_model_goes_first() -> None:
    """
    With no node holding the model and none with room, the node whose least recently
    used model was used longest ago ranks first, as one residency would evict it, in a
    rank of its own (Serve picks among a rank's nodes as it likes).
    """
    def used(at: str) -> NodeReport:
        return NodeReport.read({"engines": ["tone", "piper"], "slots": 0, "residency": {"models": [
            {"engine": "piper", "variant": "medium", "leases": 0, "lastUsedAt": at}]}})

    warm = Candidate("warm", used("2026-12-01T10:00:05.000Z"))
    cold = Candidate("cold", used("2026-12-01T09:59:59.500Z"))
    assert rank([warm, cold], "tone/classic") == [["cold"], ["warm"]]
    assert rank([cold, warm], "tone/classic") == [["cold"], ["warm"]]


def test_a_model_sent_to_a_node_is_remembered_until_its_report_shows_it_or_it_grows_old() -> None:
    """
    A router remembers the node it sent a model to, as that model's holder there and a
    slot taken for any other model, through reports that show neither the model nor its
    promise (a report the replica made before it answered the route is such a one);
    it forgets once a report shows the model resident or promised, or after
    REMEMBER_SECONDS.
    """
    def nodes(a: NodeReport) -> list[tuple[str, str, NodeReport]]:
        return [("a", "A", a), ("b", "B", report(slots=1))]

    for shown in (report(("tone", "v1", 0)), report(slots=1, promised=("tone/v1",))):
        sent: Sent[str] = Sent()
        sent.record("tone/v1", "a", 100.0)
        for later in (report(slots=1), report(slots=1), report(slots=1)):
            held = {c.replica: (c.sent, c.pending) for c in sent.candidates(nodes(later), "tone/v1", 101.0)}
            assert held == {"A": (True, 0), "B": (False, 0)}
            other = {c.replica: (c.sent, c.pending) for c in sent.candidates(nodes(later), "piper/medium", 101.0)}
            assert other == {"A": (False, 1), "B": (False, 0)}
        assert [(c.sent, c.pending) for c in sent.candidates(nodes(shown), "piper/medium", 102.0)] == [(False, 0)] * 2
        # Forgotten: a report that no longer shows it does not bring it back.
        assert [(c.sent, c.pending) for c in sent.candidates(nodes(report(slots=1)), "tone/v1", 102.0)] == [(False, 0)] * 2

    sent = Sent()
    sent.record("tone/v1", "a", 100.0)
    assert [c.sent for c in sent.candidates(nodes(report(slots=1)), "tone/v1", 100.0 + REMEMBER_SECONDS)] == [True, False]
    assert [c.sent for c in sent.candidates(nodes(report(slots=1)), "tone/v1", 100.1 + REMEMBER_SECONDS)] == [False, False]
    sent.record("tone/v1", "a", 200.0)
    assert [c.sent for c in sent.candidates([("b", "B", report(slots=1))], "tone/v1", 200.5)] == [False]
    assert [c.sent for c in sent.candidates(nodes(report(slots=1)), "tone/v1", 200.5)] == [False, False]


def test_a_route_for_an_engine_alone_is_not_remembered() -> None:
    """
    What a router sends for an engine alone (the front's capabilities and health calls,
    every second, which load nothing) is neither a holder of any model nor a slot taken
    on its node.
    """
    sent: Sent[str] = Sent()
    for engine in ("tone", "piper", ""):
        sent.record(engine, "a", 100.0)
    nodes = [("a", "A", report(slots=1)), ("b", "B", report(slots=1))]
    for model in ("tone/v1", "piper/medium", "tone"):
        assert [(c.sent, c.pending) for c in sent.candidates(nodes, model, 100.5)] == [(False, 0), (False, 0)]


def test_three_models_back_to_back_load_on_three_nodes_however_late_the_reports() -> None:
    """
    Three models sent one after another, to three nodes whose reports are all from
    before any route (and whose replicas the front asked for each engine alone in
    between): each model ranks its own node first, every round, and a fourth finds no
    room anywhere.
    """
    sent: Sent[str] = Sent()
    stale = [(key, key.upper(), report(slots=1)) for key in ("a", "b", "c")]
    chosen: dict[str, str] = {}
    for now, model in enumerate(("tone/v1", "espeak/default", "piper/medium")):
        ranks = rank(sent.candidates(stale, model, 100.0 + now / 10), model)
        assert len(ranks[0]) == 3 - now, ranks  # the nodes not yet sent a model
        where = sorted(ranks[0])[0]
        chosen[model] = where
        sent.record(model, where.lower(), 100.0 + now / 10)
        sent.record(model_of(model)[0], "abc"[(now + 1) % 3], 100.0 + now / 10)
    assert sorted(chosen.values()) == ["A", "B", "C"]
    for round_ in range(1, 4):
        for model, where in chosen.items():
            assert rank(sent.candidates(stale, model, 101.0 + round_ / 10), model)[0] == [where]
    fourth = sent.candidates(stale, "kokoro/v1", 102.0)
    assert [(c.sent, c.pending) for c in fourth] == [(False, 1)] * 3
    # No room on any: one rank of all three, where a node with room would come first.
    spare = ("d", "D", report(slots=1))
    assert rank(sent.candidates([*stale, spare], "kokoro/v1", 102.0), "kokoro/v1") == [["D"], ["A", "B", "C"]]


def test_a_request_is_offered_its_best_rank_alone_until_it_has_waited_spill_seconds() -> None:
    """
    Serve passes a request to a later rank when the best rank's replicas miss its
    queue-length probe's deadline, which a loaded box does: a later rank would load
    the model on a second node.  So the router offers the best rank alone (Serve asks
    it again, with longer deadlines) until the request has waited SPILL_SECONDS, then
    every rank, best first.  Within the best rank its first node, the router's choice,
    comes alone, then the others of that rank.
    """
    holder = Candidate("holder", report(("piper", "medium", 0)))
    room = Candidate("room", report(slots=1))
    full = Candidate("full", report(("tone", "v1", 0)))
    ranks = rank([full, room, holder], "piper/medium")
    assert ranks == [["holder"], ["room"], ["full"]]
    assert offered(ranks, 0.0) == [["holder"]]
    assert offered(ranks, SPILL_SECONDS - 0.01) == [["holder"]]
    assert offered(ranks, SPILL_SECONDS) == ranks
    assert offered(ranks, 0.5, spill_seconds=0.5) == ranks
    assert offered([["a", "b", "c"]], 0.0) == [["a"], ["b", "c"]]
    assert offered([["a", "b"], ["c"]], SPILL_SECONDS) == [["a"], ["b"], ["c"]]
    assert offered([], 0.0) == []


def test_routers_that_know_nothing_of_each_other_break_ties_apart() -> None:
    """
    Each proxy's router knows only its own choices: three routers ranking three new
    models at once over three empty nodes (no report shows any yet) do not all send
    them to the same node, as routers that broke ties by the nodes' order did every
    time; and a tie broken at random still keeps the ranks' order (the node with fewer
    leases, the colder node, first).
    """
    nodes = [(key, key.upper(), report(slots=1)) for key in ("a", "b", "c")]
    ties = random.Random(11)
    together = 0
    firsts = set()
    for _ in range(200):
        chosen = []
        for model in ("tone/v1", "espeak/default", "piper/medium"):
            router: Sent[str] = Sent()
            chosen.append(offered(rank(router.candidates(nodes, model, 100.0), model, ties=ties), 0.0)[0][0])
        firsts.update(chosen)
        together += len(set(chosen)) == 1
    assert firsts == {"A", "B", "C"}
    assert together < 40  # 1 in 9 by chance, where breaking ties by order made it 200 of 200
    unequal = [
        Candidate("busy", report(("tone", "v1", 1), slots=2)),
        Candidate("idle", report(slots=2)),
        Candidate("cold", NodeReport(resident={("espeak", "default"): 0}, lru_leases=0, lru_used="2026-01-01T00:00:00Z")),
        Candidate("warm", NodeReport(resident={("espeak", "default"): 0}, lru_leases=0, lru_used="2026-06-01T00:00:00Z")),
    ]
    for _ in range(50):
        assert rank(unequal, "piper/medium", ties=ties) == [["idle", "busy"], ["cold"], ["warm"]]


def test_nodes_busy_with_a_model_rank_one_a_rank_fewest_leases_first() -> None:
    """
    Where every holder is busy with the model and no node has room, each holder is a
    rank of its own, the one with the fewest leases on it first: Serve would choose
    among one rank's nodes by queue lengths that a route's instant answer leaves at
    naught, and the request belongs with the shortest queue.
    """
    nodes = [Candidate(name, report(("tone", "v1", leases))) for name, leases in (("a", 5), ("b", 2), ("c", 9))]
    assert rank(nodes, "tone/v1") == [["b"], ["a"], ["c"]]


def test_requests_sent_since_a_nodes_report_count_as_its_leases_until_the_next() -> None:
    """
    A request the router sent a node for a model counts as a lease on it there until
    the node's next report (a report with another number), which counts it itself; a
    node whose replica numbers no reports is never credited; a node gone from the
    cluster is forgotten.
    """
    sent: Sent[str] = Sent()
    nodes = [("a", "A", report(("tone", "v1", 1), number=1)), ("b", "B", report(("tone", "v1", 1)))]
    assert [c.routed for c in sent.candidates(nodes, "tone/v1", 100.0)] == [0, 0]
    for _ in range(2):
        sent.record("tone/v1", "a", 100.1)
        sent.record("tone/v1", "b", 100.1)
    sent.record("tone", "a", 100.1)  # an engine alone: loads nothing, leases nothing
    assert [c.routed for c in sent.candidates(nodes, "tone/v1", 100.2)] == [2, 0]
    assert [c.routed for c in sent.candidates(nodes, "tone/v2", 100.2)] == [0, 0]
    assert rank(sent.candidates(nodes, "tone/v1", 100.2), "tone/v1") == [["B"], ["A"]]  # 1 + 2 leases: busy
    later = [("a", "A", report(("tone", "v1", 3), number=2)), ("b", "B", report(("tone", "v1", 3)))]
    assert [c.routed for c in sent.candidates(later, "tone/v1", 100.7)] == [0, 0]
    sent.record("tone/v1", "a", 100.8)
    assert [c.routed for c in sent.candidates([("b", "B", report(("tone", "v1", 3)))], "tone/v1", 100.9)] == [0]
    assert [c.routed for c in sent.candidates(later, "tone/v1", 101.0)] == [0, 0]  # a was forgotten with its count


def test_a_choice_counts_at_once_until_serve_routes_it_or_it_grows_old() -> None:
    """
    What the router chose for a request counts as sent there at once (Serve ranks a
    whole burst before it routes any of it): as a lease on the model, and as the model's
    holder where the node's report does not show it.  Choosing again for the same
    request replaces the choice; Serve routing it turns the choice into a request sent
    where Serve did send it; one never routed is dropped after REMEMBER_SECONDS.
    """
    sent: Sent[str] = Sent()
    nodes = [("a", "A", report(slots=1, number=1)), ("b", "B", report(slots=1, number=1))]
    sent.choose("r1", "tone/v1", "a", 100.0)
    assert [(c.sent, c.routed) for c in sent.candidates(nodes, "tone/v1", 100.0)] == [(True, 1), (False, 0)]
    sent.choose("r1", "tone/v1", "b", 100.1)
    assert [(c.sent, c.routed) for c in sent.candidates(nodes, "tone/v1", 100.1)] == [(False, 0), (True, 1)]
    sent.choose("r2", "tone/v1", "b", 100.1)
    assert [c.routed for c in sent.candidates(nodes, "tone/v1", 100.1)] == [0, 2]
    sent.record("tone/v1", "a", 100.2, "r1")  # Serve sent r1 elsewhere than chosen
    assert [c.routed for c in sent.candidates(nodes, "tone/v1", 100.2)] == [1, 1]
    sent.choose("r3", "tone", "a", 100.2)  # an engine alone is never counted
    assert [c.routed for c in sent.candidates(nodes, "tone/v1", 100.2)] == [1, 1]
    assert [c.routed for c in sent.candidates(nodes, "tone/v1", 100.2 + REMEMBER_SECONDS)] == [1, 0]


def test_a_burst_for_a_model_in_demand_spreads_over_the_nodes_before_any_report() -> None:
    """
    Twelve requests for one model ranked back to back, none routed by Serve yet and no
    report newer than the burst: the holder takes as many as the spreading rule allows,
    the model then goes to each node with room in turn, and the rest go to the node
    with the shortest queue each time; the nodes end level.
    """
    sent: Sent[str] = Sent()
    nodes = [("a", "A", report(("tone", "v1", 0))), ("b", "B", report(slots=1)), ("c", "C", report(slots=1))]
    chosen = []
    for number in range(12):
        offer = offered(rank(sent.candidates(nodes, "tone/v1", 100.0), "tone/v1"), 0.0)
        sent.choose(number, "tone/v1", offer[0][0].lower(), 100.0)
        chosen.append(offer[0][0])
    assert chosen[:2] == ["A", "A"] and set(chosen[2:6]) == {"B", "C"}
    assert {node: chosen.count(node) for node in "ABC"} == {"A": 4, "B": 4, "C": 4}


def _routed_alone(router: Sent[str], nodes: list[tuple[str, str, NodeReport]], model: str, now: float,
                  claims: Claims[str] | None, ties: random.Random) -> str:
    """
    What one proxy's router does for a request (rhapsode._cluster.router): ranks by its
    own view, asks the shared claims where its view shows the model nowhere, counts its
    choice; the node chosen, by key.
    """
    candidates = router.candidates(nodes, model, now)
    ranks = rank(candidates, model, ties=ties)
    if claims is not None and unplaced(candidates, model):
        by_key = {c.replica.lower(): c for c in candidates}
        keys = [r.lower() for each in ranks for r in each]
        placed = claims.place(model, [by_key[key].offer(key, model) for key in keys], now)
        assert placed is not None
        ranks = first(ranks, placed.upper())
    where = offered(ranks, 0.0)[0][0].lower()
    router.choose(("request", model, now), model, where, now)
    router.record(model, where, now, ("request", model, now))
    return where


def test_routers_of_several_proxies_place_models_apart_through_the_claims_whatever_their_views() -> None:
    """
    A front speaking one request after another through proxies that answer in turn: each
    model's router knows nothing of the others' choices, and every node's report is from
    before any route.  Without the shared claims, most of 200 runs loaded two models on
    one node, or one model on two (194 of 200 when written); with them, every run places
    the three models on the three nodes, each once, and every later request for a model
    goes where it went.
    """
    ties = random.Random(5)
    stale = [(key, key.upper(), report(slots=1)) for key in ("a", "b", "c")]
    models = ("tone/v1", "espeak/default", "piper/medium")

    def run(claims: Claims[str] | None) -> dict[str, set[str]]:
        routers = {model: Sent[str]() for model in models}
        stranger: Sent[str] = Sent()  # a proxy that routed none of them yet
        where: dict[str, set[str]] = {}
        for round_ in range(3):
            for step, model in enumerate(models):
                now = 100.0 + round_ + step / 10
                router = routers[model] if round_ != 1 else stranger
                where.setdefault(model, set()).add(_routed_alone(router, stale, model, now, claims, ties))
        return where

    apart = 0
    for _ in range(200):
        without = run(None)
        apart += all(len(nodes) == 1 for nodes in without.values()) and len(set().union(*without.values())) == 3
        placed = run(Claims())
        assert all(len(nodes) == 1 for nodes in placed.values()), placed
        assert set().union(*placed.values()) == {"a", "b", "c"}, placed
    assert apart < 100  # the routers alone, with no report to go by, rarely did


def room(key: str, free: int = 1, *placed: str, ready: bool | None = None) -> Offer[str]:
    """
    A node offered to the claims: C{free} slots in the router's view, C{placed} the
    models its view puts there; ready where it has room unless told otherwise.
    """
    return Offer(key, free, frozenset(placed), free > 0 if ready is None else ready)


def test_a_claim_sends_its_model_where_it_went_and_takes_the_slot_from_others_until_it_grows_old() -> None:
    """
    A model claimed on a node goes there again for any router, while that node is among
    its offers; another model does not take that node's slot unless the router's view
    already shows the claimed model there (the slot it counts free is then truly free);
    after CLAIM_SECONDS the claim is gone.
    """
    claims: Claims[str] = Claims()
    assert claims.place("tone/v1", [room("a"), room("b")], 0.0) == "a"
    assert claims.place("tone/v1", [room("b"), room("a")], 1.0) == "a"
    assert claims.place("tone/v1", [room("b"), room("c")], 1.0) == "b"  # a gone: placed anew
    assert claims.place("piper/medium", [room("b"), room("c")], 2.0) == "c"
    assert claims.place("kokoro/v1", [room("b", 1, "tone/v1"), room("c")], 2.0) == "b"
    assert claims.place("espeak/default", [room("d")], 2.0 + CLAIM_SECONDS / 2) == "d"
    # tone, piper and kokoro grew old; espeak did not.
    assert claims.place("dia/v1", [room("b"), room("c"), room("d")], 2.5 + CLAIM_SECONDS) == "b"
    assert claims.place("tone/v1", [room("d", 2), room("b")], 2.5 + CLAIM_SECONDS) == "d"
    assert claims.place("x/v1", [], 0.0) is None


def test_a_claim_on_a_node_the_model_could_not_start_on_now_gives_way() -> None:
    """
    A claimed node that the asking router's view shows full of leased models (it evicted
    the model since, for one now in use) is not where the model goes again: the model
    is placed anew, and claimed there; one whose model could be evicted still is.
    """
    claims: Claims[str] = Claims()
    assert claims.place("tone/v1", [room("a"), room("b")], 0.0) == "a"
    assert claims.place("tone/v1", [room("b"), room("a", 0, "piper/medium", ready=True)], 1.0) == "a"
    assert claims.place("tone/v1", [room("b"), room("a", 0, "piper/medium", ready=False)], 2.0) == "b"
    assert claims.place("tone/v1", [room("a"), room("b")], 3.0) == "b"
    leased = Candidate("a", report(("piper", "medium", 1)))
    idle = Candidate("a", report(("piper", "medium", 0)))
    assert leased.offer("a", "tone/v1") == Offer("a", 0, frozenset({"piper/medium"}), False)
    assert idle.offer("a", "tone/v1") == Offer("a", 0, frozenset({"piper/medium"}), True)


def test_a_router_that_would_evict_is_sent_to_a_node_no_other_router_just_filled() -> None:
    """
    Where the router's best node has no room in its view (it would evict there), the
    claims send the model to the first offered node with no model just placed on it that
    the router cannot see; and where every node has one, the router's best.
    """
    claims: Claims[str] = Claims()
    assert claims.place("tone/v1", [room("a")], 0.0) == "a"
    assert claims.place("piper/medium", [room("a", 0, ready=True), room("b", 0, ready=True)], 0.5) == "b"
    assert claims.place("espeak/default", [room("a", 0, ready=True), room("b", 0, ready=True)], 1.0) == "a"
    # A best node with room that another model just filled: the next with room, else
    # the first with no such claim.
    assert claims.place("kokoro/v1", [room("a"), room("b"), room("c", 0, ready=True)], 1.5) == "c"


def test_claims_keep_at_most_claims_kept_models_the_newest() -> None:
    """
    Model ids come from requests' headers: the claims keep the CLAIMS_KEPT placed last,
    and a model placed again where it is claimed keeps its claim as it was.
    """
    claims: Claims[str] = Claims()
    claims.place("first/v1", [room("a")], 0.0)
    claims.place("second/v1", [room("b")], 0.0)
    assert claims.place("first/v1", [room("c"), room("a")], 0.5) == "a"
    for n in range(CLAIMS_KEPT - 1):
        claims.place(f"model/{n}", [room(f"n{n}")], 1.0)
    # second/v1 is still claimed on b; first/v1, the oldest, was dropped.
    assert claims.place("second/v1", [room("c"), room("b")], 2.0) == "b"
    assert claims.place("first/v1", [room("c"), room("a")], 2.0) == "c"


def test_a_model_is_unplaced_where_the_routers_view_shows_it_on_no_node() -> None:
    """
    unplaced: a model no candidate holds, expects, or was sent or routed by this
    router; never an engine alone.  first() puts a chosen node before the ranks.
    """
    empty = Candidate("empty", report(slots=1))
    assert unplaced([empty], "tone/v1") is True
    assert unplaced([empty], "tone") is False
    assert unplaced([empty, Candidate("held", report(("tone", "v1", 0)))], "tone/v1") is False
    assert unplaced([empty, Candidate("coming", report(slots=1, promised=("tone/v1",)))], "tone/v1") is False
    assert unplaced([Candidate("sent", report(slots=1), sent=True)], "tone/v1") is False
    assert unplaced([Candidate("routed", report(slots=1), routed=1)], "tone/v1") is False
    both = Candidate("both", report(("piper", "medium", 0), slots=2, promised=("espeak/default",)),
                     pending=1, coming=frozenset({"kokoro/v1"}))
    assert both.placed() == {"piper/medium", "espeak/default", "kokoro/v1"}
    assert both.free("tone/v1") == 1
    assert first([["a", "b"], ["c"]], "c") == [["c"], ["a", "b"]]
    assert first([["a", "b"], ["c"]], "b") == [["b"], ["a"], ["c"]]
    assert first([["a"], ["c"]], "a") == [["a"], ["c"]]
    assert first([["a"], ["c"]], "z") == [["a"], ["c"]]


def test_a_node_speaking_another_variant_of_the_engine_has_no_room_for_this_one() -> None:
    """
    A node's engine speaks one variant at a time, so a node holding tone/expressive has no
    room for tone/classic whatever slots it has left: the classic variant would take the
    expressive one's place.  An empty node comes first; the swap ranks with the nodes
    that can evict when no stream holds the other variant, and with the rest when one
    does; a variant promised or just sent there counts as held by its coming request.
    """
    swapper = Candidate("swapper", report(("tone", "expressive", 0), slots=1))
    leased = Candidate("leased", report(("tone", "expressive", 1), slots=1))
    promised = Candidate("promised", report(slots=2, promised=("tone/expressive",)))
    sent = Candidate("sent", report(slots=2), pending=1, coming=frozenset({"tone/expressive"}))
    empty = Candidate("empty", report(slots=1))
    other = Candidate("other", report(("piper", "medium", 0), slots=1))
    assert swapper.swaps("tone/classic") == 0 and swapper.free("tone/classic") == 0
    assert leased.swaps("tone/classic") == 1 and promised.swaps("tone/classic") == 1
    assert sent.swaps("tone/classic") == 1 and other.swaps("tone/classic") is None
    assert swapper.swaps("tone") is None and swapper.swaps("tone/expressive") is None
    assert rank([swapper, leased, empty, other], "tone/classic") == [["empty", "other"], ["swapper"], ["leased"]]
    assert rank([swapper, leased], "tone/classic") == [["swapper"], ["leased"]]
    assert rank([promised, sent, other], "tone/classic") == [["other"], ["promised", "sent"]]
    # Its own variant is still held there: a request for it goes there first.
    assert rank([swapper, empty], "tone/expressive") == [["swapper"], ["empty"]]
    assert swapper.offer("s", "tone/classic") == Offer("s", 0, frozenset({"tone/expressive"}), True)
    assert leased.offer("l", "tone/classic") == Offer("l", 0, frozenset({"tone/expressive"}), False)
    assert other.offer("o", "tone/classic").ready is True
