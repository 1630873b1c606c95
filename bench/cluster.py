"""
Benchmark of a Rhapsode cluster on a local Ray cluster, run by hand in the cluster's
virtualenv (`.venvs/cluster/bin/python bench/cluster.py`, after `make cluster-venv
engines`).  Prints, in one run:

  1. routing overhead: a kept-alive client's one-sentence tone request through a front
     whose engine is on the cluster (routed by Ray, then spoken to the node), against
     the same front speaking straight to that node core (its worker route as a URL);
  2. throughput with 1, 2 and 3 nodes on a fixed-cost engine (tone paced at half real
     time, so that the cores are not the limit), against N times one node;
  3. residency hit rate on a skewed mix (Zipf over 6 models, 3 nodes with 2 slots each):
     requests served without a load, with the residency router and with Serve's own
     (power of two choices by queue length, blind to residency).

Everything runs on this one box (the clients, the front, Ray and the node cores share its
cores), so the figures are this box's.  Asserts nothing.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import ray
from ray import serve
from ray.cluster_utils import Cluster

from rhapsode._cluster.deployment import application

ROOT = Path(__file__).resolve().parents[1]
VENVS = ROOT / ".venvs"
TONE = str(VENVS / "tone" / "bin" / "python")
SENTENCE = "The quick brown fox jumps over the lazy dog."


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=120) as answer:
        return json.loads(answer.read())


def wait(check: Any, seconds: float = 600) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            found = check()
        except OSError:
            found = None
        if found:
            return found
        time.sleep(0.25)
    raise RuntimeError("gave up waiting")


def tone_engines(ids: list[str], pace: float = 0.0) -> dict[str, Any]:
    env = {"RHAPSODE_TONE_PACE": str(pace)} if pace else {}
    return {i: {"module": "rhapsode_engine_tone", "python": TONE, "env": env} for i in ids}


class Front:
    """
    A front (`rhapsode serve`) over the given engines.
    """

    def __init__(self, home: Path, engines: dict[str, Any]) -> None:
        self.port = free_port()
        config = home / f"front-{self.port}.json"
        config.write_text(json.dumps({
            "server": {"port": self.port}, "log": {"level": "error"},
            "limits": {"concurrentPerEngine": 512, "queuedPerEngine": 512},
            "workers": {"socketDir": str(home / f"sock-{self.port}"), "voiceDir": str(home / "voices")},
            "engines": engines,
        }))
        rhapsode = str(Path(sys.executable).parent / "rhapsode")
        self.process = subprocess.Popen([rhapsode, "serve", "--config", str(config)], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, env={**os.environ, "RHAPSODE_UPDATE_CHECK": "0"})
        wait(lambda: get(f"http://127.0.0.1:{self.port}/health"))

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=60)


class Speaker:
    """
    One kept-alive client of a front.
    """

    def __init__(self, port: int) -> None:
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)

    def speak(self, engine: str, text: str = SENTENCE, variant: str | None = None) -> tuple[float, dict[str, str]]:
        body: dict[str, Any] = {"engine": engine, "text": text, "format": "pcm", "stream": False}
        if variant:
            body["variant"] = variant
        began = time.perf_counter()
        self.connection.request("POST", "/speak", json.dumps(body), {"Content-Type": "application/json"})
        answer = self.connection.getresponse()
        answer.read()
        if answer.status != 200:
            raise RuntimeError(f"HTTP {answer.status}")
        return time.perf_counter() - began, {k.lower(): v for k, v in answer.getheaders()}


class Cloud:
    """
    A local Ray cluster (a head and N nodes offering the node resource) and the app.
    """

    def __init__(self, nodes: int, template: dict[str, Any], router: str | None = None) -> None:
        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        for _ in range(nodes):
            self.cluster.add_node(num_cpus=1, resources={"rhapsode_node": 1})
        ray.init(address=self.cluster.address, logging_level="ERROR", log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = application(template, replicas=nodes, stats_seconds=0.5) if router is None else (
            _with_router(template, nodes, router))
        self.url = f"http://127.0.0.1:{port}/rhapsode"
        serve.run(app, name="rhapsode", route_prefix="/rhapsode")
        wait(lambda: len(get(self.url + "/_nodes")) == nodes)
        time.sleep(3)

    def nodes(self) -> list[dict[str, Any]]:
        return list(get(self.url + "/_nodes"))

    def close(self) -> None:
        serve.shutdown()
        ray.shutdown()
        self.cluster.shutdown()


def _with_router(template: dict[str, Any], nodes: int, router: str) -> Any:
    from ray.serve.config import RequestRouterConfig

    from rhapsode._cluster.deployment import RhapsodeNode

    return serve.deployment(
        RhapsodeNode, name="RhapsodeNode", num_replicas=nodes,
        ray_actor_options={"num_cpus": 0, "resources": {"rhapsode_node": 1}}, max_ongoing_requests=256,
        request_router_config=RequestRouterConfig(request_router_class=router),
    ).bind(dict(template), "127.0.0.1")


def loads_of(nodes: list[dict[str, Any]]) -> float:
    total = 0.0
    for node in nodes:
        with urllib.request.urlopen(node["url"] + "/metrics", timeout=60) as answer:
            text = answer.read().decode()
        total += sum(float(v) for v in re.findall(r"^rhapsode_model_loads_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))
    return total


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def routing_overhead(home: Path, rounds: int) -> None:
    template = {"metrics": {"public": True}, "engines": tone_engines(["tone"])}
    cloud = Cloud(1, template)
    try:
        [node] = cloud.nodes()
        routed = Front(home, {"tone": {"cluster": cloud.url}})
        direct = Front(home, {"tone": {"url": node["url"] + "/worker/tone"}})
        try:
            times: dict[str, list[float]] = {"through the cluster": [], "straight to the node": []}
            speakers = {"through the cluster": Speaker(routed.port), "straight to the node": Speaker(direct.port)}
            for name, speaker in speakers.items():
                for _ in range(50):
                    speaker.speak("tone")  # warm: the model loaded, the connections made
            for _ in range(rounds):
                for name, speaker in speakers.items():
                    times[name].append(speaker.speak("tone")[0] * 1000)
            print(f"1. routing overhead, one sentence of tone, kept-alive, {rounds} requests each (ms)")
            for name, values in times.items():
                print(f"   {name:22} p50 {percentile(values, 0.5):6.2f}  p99 {percentile(values, 0.99):6.2f}")
            extra = [a - b for a, b in zip(times["through the cluster"], times["straight to the node"])]
            print(f"   overhead               p50 {statistics.median(extra):6.2f}  (goal <= 2 ms)")
        finally:
            routed.stop()
            direct.stop()
    finally:
        cloud.close()


def throughput(home: Path, seconds: float, clients: int, pace: float = 0.5) -> None:
    print(f"2. throughput, tone paced at {pace:g} s per second of audio, {clients} clients for {seconds:g} s")
    one = None
    for nodes in (1, 2, 3):
        cloud = Cloud(nodes, {"engines": tone_engines(["tone"], pace=pace),
                              "limits": {"concurrentPerEngine": 64, "queuedPerEngine": 256}})
        try:
            front = Front(home, {"tone": {"cluster": cloud.url}})
            try:
                Speaker(front.port).speak("tone")
                done = [0]
                stop = time.monotonic() + seconds
                lock = threading.Lock()

                def client() -> None:
                    speaker = Speaker(front.port)
                    while time.monotonic() < stop:
                        speaker.speak("tone")
                        with lock:
                            done[0] += 1

                threads = [threading.Thread(target=client) for _ in range(clients)]
                began = time.monotonic()
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                rate = done[0] / (time.monotonic() - began)
                one = one or rate
                print(f"   {nodes} node(s): {rate:6.2f} requests/s, {rate / one:4.2f} x one node "
                      f"(goal >= {0.9 * nodes:.1f})")
            finally:
                front.stop()
        finally:
            cloud.close()


def zipf_mix(models: list[tuple[str, str]], count: int, seed: int = 7) -> Iterator[tuple[str, str]]:
    rng = random.Random(seed)
    weights = [1 / (rank + 1) for rank in range(len(models))]
    for _ in range(count):
        yield rng.choices(models, weights)[0]


def hit_rate(home: Path, count: int) -> None:
    ids = ["tone-a", "tone-b", "tone-c"]
    models = [(engine, variant) for engine in ids for variant in ("expressive", "classic")]
    template = {"residency": {"maxResidentModels": 2, "evictionWaitSeconds": 30}, "metrics": {"public": True},
                "engines": tone_engines(ids)}
    print(f"3. residency hit rate, Zipf over 6 models, 3 nodes of 2 slots, {count} requests, one at a time")
    for name, router in (("residency router", None),
                         ("Serve's own router", "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter")):
        cloud = Cloud(3, template, router)
        try:
            front = Front(home, {engine: {"cluster": cloud.url} for engine in ids})
            try:
                speaker = Speaker(front.port)
                for engine, variant in zipf_mix(models, count):
                    speaker.speak(engine, variant=variant)
                loads = loads_of(cloud.nodes())
                print(f"   {name:20} {count - loads:4.0f} of {count} without a load: {(count - loads) / count:6.1%} "
                      "(goal >= 90%)")
            finally:
                front.stop()
        finally:
            cloud.close()


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__)
    options.add_argument("--rounds", type=int, default=300)
    options.add_argument("--seconds", type=float, default=20)
    options.add_argument("--clients", type=int, default=24)
    options.add_argument("--mix", type=int, default=300)
    options.add_argument("--pace", type=float, default=0.5, help="tone's wall seconds per second of audio (part 2)")
    options.add_argument("--only", type=int, choices=(1, 2, 3), action="append",
                         help="run only this part (again for more); all three by default")
    ns = options.parse_args()
    parts = set(ns.only or (1, 2, 3))
    print(f"load average at the start: {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as folder:
        home = Path(folder)
        if 1 in parts:
            routing_overhead(home, ns.rounds)
        if 2 in parts:
            throughput(home, ns.seconds, ns.clients, ns.pace)
        if 3 in parts:
            hit_rate(home, ns.mix)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
