"""
The cluster's directory: one named actor on the head, which every replica registers its
node core with (the front reads it through C{GET <app>/_nodes}), and which every router
asks before it places a model its own view shows on no node (L{rhapsode._cluster.ranking.Claims}).
"""

from __future__ import annotations

import time
from typing import Any

import ray

from .ranking import Claims, Offer

__all__ = ["DIRECTORY", "FORGET_SECONDS", "PLACEMENTS_KEPT", "NodeDirectory", "directory"]

#: The name of the actor every replica registers its node core with.
DIRECTORY = "rhapsode-node-directory"
#: A node its replica has not said again for this long (a few health checks) is gone.
FORGET_SECONDS = 10.0
#: The most models whose placements the directory counts: a model id comes from a
#: request's header, so the count keeps the newest this many.
PLACEMENTS_KEPT = 1024


@ray.remote(num_cpus=0)
class NodeDirectory:
    """
    The node cores of the cluster, by name: where each answers, as its replica said; and
    where models were placed a moment ago, by the replica routers chose for them.
    """

    def __init__(self) -> None:
        self._nodes: dict[str, dict[str, Any]] = {}
        self._claims: Claims[str] = Claims()
        #: model -> how many times a router asked to place it, and where it last went.
        self._placed: dict[str, tuple[int, str | None]] = {}

    def register(self, name: str, url: str, replica: str, ray_node: str) -> None:
        known = self._nodes.get(name)
        since = known["since"] if known is not None and known["url"] == url else time.time()
        self._nodes[name] = {"node": name, "url": url, "replica": replica, "rayNode": ray_node, "since": since,
                             "seen": time.monotonic()}

    def unregister(self, name: str) -> None:
        self._nodes.pop(name, None)

    def nodes(self) -> list[dict[str, Any]]:
        # A replica says its node again at each health check: one that stopped is gone.
        now = time.monotonic()
        for name in [n for n, node in self._nodes.items() if now - node["seen"] > FORGET_SECONDS]:
            del self._nodes[name]
        return sorted(({k: v for k, v in node.items() if k != "seen"} for node in self._nodes.values()),
                      key=lambda node: str(node["node"]))

    def place(self, model_id: str, offers: list[Offer[str]]) -> str | None:
        """
        The replica to place C{model_id} on, from a router's offers (L{Claims.place}), by
        this actor's clock: one clock and one order for every router.
        """
        chosen = self._claims.place(model_id, offers, time.monotonic())
        count = self._placed.pop(model_id, (0, None))[0] + 1
        self._placed[model_id] = (count, chosen)
        while len(self._placed) > PLACEMENTS_KEPT:
            del self._placed[next(iter(self._placed))]
        return chosen

    def placements(self) -> dict[str, tuple[int, str | None]]:
        """
        Each model routers asked this directory to place: how many times, and the
        replica it last said.
        """
        return dict(self._placed)


def directory() -> Any:
    """
    The cluster's directory actor, made where it is not yet: on the head, which stays as
    long as the cluster does (a node may leave with its actors).
    """
    # ray.remote made NodeDirectory an actor class, which Ray's types do not say.
    actor: Any = NodeDirectory
    return actor.options(
        name=DIRECTORY, namespace="serve", get_if_exists=True, lifetime="detached",
        resources={"node:__internal_head__": 0.001},
    ).remote()
