"""
The Ray Serve deployment of a Rhapsode cluster (docs/cluster.md).

Each replica (one per GPU, or one per node by a custom resource on CPU boxes) starts a
node core (C{rhapsode serve} with C{server.role} "node") on its own machine.  A front asks
C{GET <app>/_route} for each request, naming its model: the cluster's residency router
sends that to the best node's replica, which answers with its node core's address, and
the front speaks to that core itself (L{rhapsode._upstream.cluster}).  Serve's proxy
buffers a streamed answer whole when its reader falls behind (a client reading nothing
let a 10 MB stream be made and held), so speech does not travel through it.  For clients
that cannot reach the nodes, a replica also forwards any other request to its node core
and streams the answer back, without that backpressure.  Its routing stats are its node
core's C{GET /node}, and its health the node core's C{GET /health}.

The node core runs under a process-group leader whose stdin is a pipe from the replica:
a replica that dies (its Ray node removed, say) closes the pipe, and the leader kills the
node core's whole group, so no core or worker outlives its replica.  Every replica also
registers its node core's address with a directory actor, which the front reads through
C{GET <app>/_nodes} to show every node's residency, engines and metrics.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, AsyncIterator, Mapping

import aiohttp
import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from .._manage.installer import GROUP_LEADER
from .directory import DIRECTORY, NodeDirectory, directory as _directory
from .ranking import promise, still_promised

__all__ = ["DIRECTORY", "NodeDirectory", "RhapsodeNode", "app_from_env", "application"]

#: How long a node core may take to answer /health after it is started.
START_SECONDS = 120.0
#: Headers a request to a node keeps (the rest are the proxy's or the front's own).
_FORWARDED = ("content-type", "content-length", "x-rhapsode-keep-alive", "authorization", "accept", "x-request-id")
#: Headers an answer from a node keeps.
_ANSWERED = ("content-type", "content-length", "x-rhapsode-duration-ms", "x-rhapsode-node", "retry-after",
             "x-request-id", "location", "allow")


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


def node_config(template: Mapping[str, Any], name: str, host: str, port: int, home: Path) -> dict[str, Any]:
    """
    The config a replica's node core runs with: the cluster's template for every node,
    with this node's role, name, address and folders.
    """
    config = json.loads(json.dumps(template))
    server = config.setdefault("server", {})
    server.update({"role": "node", "node": name, "port": port, "host": host})
    workers = config.setdefault("workers", {})
    workers.setdefault("socketDir", str(home / "sock"))
    workers.setdefault("voiceDir", str(home / "voices"))
    config.setdefault("log", {}).setdefault("level", "warn")
    return dict(config)


class RhapsodeNode:
    """
    One replica: a node core on this machine, and the forwarding of requests to it.

    @param template: the node cores' config (engines, residency, workers), as a JSON
        object; each replica adds its role, name, address and folders.
    @param host: the interface node cores listen on (a node's address where the front
        is on another box; loopback by default).
    """

    def __init__(self, template: Mapping[str, Any], host: str = "127.0.0.1") -> None:
        context = serve.get_replica_context()
        node_id = ray.get_runtime_context().get_node_id()
        self.name = f"{socket.gethostname()}-{node_id[:8]}"[:64].replace("_", "-")
        self._home = Path(tempfile.mkdtemp(prefix="rhapsode-node-"))
        port = _free_port(host)
        reach = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        self.base = f"http://{reach}:{port}"
        config = node_config(template, self.name, host, port, self._home)
        (self._home / "rhapsode.json").write_text(json.dumps(config))
        rhapsode = str(Path(sys.executable).parent / "rhapsode")
        self._log = open(self._home / "node.log", "ab")
        # The leader watches its stdin: this replica gone, it kills the whole group.
        self._process = subprocess.Popen(
            [sys.executable, "-c", GROUP_LEADER, rhapsode, "serve", "--config", str(self._home / "rhapsode.json")],
            stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT, cwd=self._home,
            env={**os.environ, "RHAPSODE_UPDATE_CHECK": "0"},
        )
        self._wait_started()
        address = ray.util.get_node_ip_address() if host in ("0.0.0.0", "::") else reach
        self.url = f"http://{address}:{port}"
        self._entry = (self.name, self.url, str(context.replica_id), node_id)
        ray.get(_directory().register.remote(*self._entry))
        self._session: aiohttp.ClientSession | None = None
        #: Routing key -> when this replica answered a route for it.
        self._promised: dict[str, float] = {}
        #: How many reports this replica has made: a router tells a report newer than
        #: the routes it sent here by it (rhapsode._cluster.ranking.Sent).
        self._reports = 0

    def _wait_started(self) -> None:
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                tail = (self._home / "node.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the node core exited {self._process.returncode}: {tail}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the node core did not answer /health within {START_SECONDS:g} s")

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # No total timeout: a long answer streams for as long as it takes; a node core
            # that sends nothing is its own core's stall rule's to end.
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        return self._session

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        prefix = request.scope.get("root_path", "")
        if prefix and path.startswith(prefix):
            path = path[len(prefix):]
        if path == "/_nodes":
            nodes = await _directory().nodes.remote()
            return JSONResponse(nodes)
        if path == "/_route":
            # The router sent this request here for its model: the front speaks to this
            # node's core itself (rhapsode._upstream.cluster), keeping its backpressure.
            # Until the node holds the model, this replica's reports say it is coming, so
            # a report made before the front's request arrives does not read as room.
            promise(self._promised, serve.get_multiplexed_model_id(), time.monotonic())
            return JSONResponse({"node": self.name, "url": self.url})
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED}
        body = await request.body()
        target = self.base + path + (f"?{request.url.query}" if request.url.query else "")
        upstream = await self._client().request(request.method, target, headers=headers, data=body or None)
        answered = {k: v for k, v in upstream.headers.items() if k.lower() in _ANSWERED}
        if upstream.headers.get("content-length") is not None:
            raw = await upstream.read()
            upstream.release()
            return Response(raw, status_code=upstream.status, headers=answered)
        return StreamingResponse(_stream(upstream), status_code=upstream.status, headers=answered)

    async def record_routing_stats(self) -> dict[str, Any]:
        async with self._client().get(self.base + "/node", timeout=aiohttp.ClientTimeout(total=2)) as answer:
            stats: dict[str, Any] = await answer.json()
        stats["promised"] = still_promised(self._promised, stats, time.monotonic())
        self._reports += 1
        stats["report"] = self._reports
        return stats

    async def check_health(self) -> None:
        if self._process.poll() is not None:
            raise RuntimeError(f"the node core exited {self._process.returncode}")
        async with self._client().get(self.base + "/health", timeout=aiohttp.ClientTimeout(total=5)) as answer:
            if answer.status != 200:
                raise RuntimeError(f"the node core answered /health with {answer.status}")
        # Said again at every check, so a directory made afresh hears of every node.
        await _directory().register.remote(*self._entry)

    def __del__(self) -> None:
        process = getattr(self, "_process", None)
        if process is not None and process.poll() is None:
            try:
                ray.get(_directory().unregister.remote(self.name), timeout=5)
            except Exception:
                pass  # the directory goes with the cluster
            if process.stdin is not None:
                process.stdin.close()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()


async def _stream(upstream: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """
    The node core's body as it arrives; a body that breaks off raises, so the stream
    ends in an error rather than a clean end.
    """
    try:
        async for piece in upstream.content.iter_any():
            yield piece
        if not upstream.content.at_eof():
            raise ConnectionError("the node core's answer broke off")
    except asyncio.CancelledError:
        upstream.close()
        raise
    finally:
        upstream.release()


def application(
    template: Mapping[str, Any],
    *,
    replicas: int = 1,
    resource: str | None = "rhapsode_node",
    gpus: float = 0,
    host: str = "127.0.0.1",
    stats_seconds: float = 0.5,
    spread_at: int = 2,
) -> Any:
    """
    The cluster's Serve application: C{replicas} node replicas, each on a node of its own
    (by the custom C{resource} every Ray node offers once, or by a GPU each), routed by
    residency (L{rhapsode._cluster.router.ResidencyRouter}); a model with C{spread_at}
    requests on its node spreads to a node with room.
    """
    actor: dict[str, Any] = {"num_cpus": 0}
    if gpus:
        actor["num_gpus"] = gpus
    if resource:
        actor["resources"] = {resource: 1}
    deployment = serve.deployment(
        RhapsodeNode,
        name="RhapsodeNode",
        num_replicas=replicas,
        ray_actor_options=actor,
        # Requests queue at the node (its own turns and evictionWaitSeconds decide), not
        # in the router: a replica takes many at once.
        max_ongoing_requests=256,
        health_check_period_s=2,
        health_check_timeout_s=10,
        graceful_shutdown_timeout_s=20,
        request_router_config=RequestRouterConfig(
            request_router_class="rhapsode._cluster.router:ResidencyRouter",
            request_router_kwargs={"spread_at": spread_at},
            request_routing_stats_period_s=stats_seconds,
            request_routing_stats_timeout_s=max(2 * stats_seconds, 1.0),
        ),
    )
    return deployment.bind(dict(template), host)


def app_from_env(args: Mapping[str, Any] | None = None) -> Any:
    """
    The app as a Serve config's C{import_path} builds it (KubeRay's RayService, C{serve
    deploy}): the node template from the file C{RHAPSODE_NODE_TEMPLATE} names; the
    replicas, GPUs per replica and node interface from C{RHAPSODE_NODE_REPLICAS},
    C{RHAPSODE_NODE_GPUS} and C{RHAPSODE_NODE_HOST}, where the config does not set them.
    """
    template = json.loads(Path(os.environ["RHAPSODE_NODE_TEMPLATE"]).read_text(encoding="utf-8"))
    gpus = float(os.environ.get("RHAPSODE_NODE_GPUS", "0"))
    return application(
        template,
        replicas=int(os.environ.get("RHAPSODE_NODE_REPLICAS", "1")),
        resource=None if gpus else "rhapsode_node",
        gpus=gpus,
        host=os.environ.get("RHAPSODE_NODE_HOST", "127.0.0.1"),
    )
