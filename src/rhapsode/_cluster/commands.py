"""
C{rhapsode cluster up|status|down} (docs/cluster.md): thin wrappers over C{ray start},
C{serve.run} and C{ray stop}, for the virtualenv that has the cluster extra.

  - C{up --head}: start Ray's head here, then, with C{--nodes FILE}, deploy the node
    replicas (one per box that offers the C{rhapsode_node} resource, or per GPU) with
    the node cores' config template in FILE;
  - C{up --address HEAD:PORT}: join this box to the cluster as a node;
  - C{status}: Ray's view, and every node core the cluster's directory lists;
  - C{down}: take the app down (on the head) and stop Ray here.

Ray is imported when a command runs, never when the command line starts.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any, Sequence

__all__ = ["add_parser", "run"]

#: The custom resource every node box offers once: one node replica per box.
RESOURCE = "rhapsode_node"


def add_parser(commands: Any) -> None:
    """
    The C{cluster} subcommand and its own subcommands.
    """
    cluster = commands.add_parser("cluster", help="run Rhapsode on a Ray cluster (docs/cluster.md)")
    actions = cluster.add_subparsers(dest="cluster_command", required=True)
    up = actions.add_parser("up", help="start Ray here (the head, or a node joining one) and deploy the nodes")
    where = up.add_mutually_exclusive_group(required=True)
    where.add_argument("--head", action="store_true", help="start the cluster's head on this box")
    where.add_argument("--address", help="join the cluster whose head is at HOST:PORT")
    up.add_argument("--nodes", type=Path, help="the node cores' config template (JSON): deploy the app")
    up.add_argument("--replicas", type=int, default=1, help="node replicas: one per box or GPU (default 1)")
    up.add_argument("--gpus", type=float, default=0, help="GPUs per node replica (0: one per box, on CPU)")
    up.add_argument("--port", type=int, default=8000, help="the port Serve answers on (default 8000)")
    up.add_argument("--host", default="127.0.0.1", help="the interface Serve answers on")
    up.add_argument("--node-host", default="0.0.0.0", help="the interface node cores listen on")
    up.add_argument("--no-node", action="store_true", help="this box runs no node core (a head without a GPU)")
    actions.add_parser("status", help="Ray's view of the cluster, and every node core")
    actions.add_parser("down", help="take the app down and stop Ray on this box")


def _ray(*args: str) -> int:
    ray = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")
    if ray is None:
        print("rhapsode cluster: Ray is not installed here (pip install 'rhapsode[cluster]')", file=sys.stderr)
        return 2
    return subprocess.call([ray, *args])


def _up(ns: argparse.Namespace) -> int:
    resources = [] if ns.no_node else ["--resources", json.dumps({RESOURCE: 1})]
    if ns.head:
        code = _ray("start", "--head", *resources)
    else:
        code = _ray("start", f"--address={ns.address}", *resources)
    if code or ns.nodes is None:
        return code
    import ray
    from ray import serve

    from .deployment import application

    template = json.loads(ns.nodes.read_text(encoding="utf-8"))
    ray.init(address="auto")
    serve.start(http_options={"host": ns.host, "port": ns.port})
    serve.run(
        application(template, replicas=ns.replicas, resource=None if ns.gpus else RESOURCE, gpus=ns.gpus,
                    host=ns.node_host),
        name="rhapsode",
        route_prefix="/rhapsode",
    )
    print(f"rhapsode cluster: {ns.replicas} node replica(s) deployed; front engines take "
          f'"cluster": "http://{ns.host}:{ns.port}/rhapsode"')
    return 0


def _status() -> int:
    code = _ray("status")
    try:
        with urllib.request.urlopen("http://127.0.0.1:8000/rhapsode/_nodes", timeout=10) as answer:
            nodes = json.loads(answer.read())
    except OSError as error:
        print(f"rhapsode cluster: the app does not answer on this box's port 8000: {error}")
        return code or 1
    for node in nodes:
        print(f"{node['node']}\t{node['url']}")
    return code


def _down() -> int:
    try:
        import ray
        from ray import serve

        ray.init(address="auto")
        serve.delete("rhapsode")
    except Exception as error:  # no cluster, or no app on it: stopping Ray is what is left
        print(f"rhapsode cluster: no app to take down here ({error})", file=sys.stderr)
    return _ray("stop")


def run(ns: argparse.Namespace) -> int:
    if ns.cluster_command == "up":
        return _up(ns)
    if ns.cluster_command == "status":
        return _status()
    return _down()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rhapsode")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(argv))
