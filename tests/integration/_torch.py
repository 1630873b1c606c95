"""
The torch engines' test weights and the hub that serves them: random-weight checkpoints of
the real architectures, built once by tools/random_weights/ with each engine's own
interpreter into a cache outside the tree, served by a Hugging Face hub of our own on
loopback (L{rhapsode_worker.fakehub}) at the revisions the adapters pin, so a worker's
fetch runs the real client against it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from _worker import ROOT, Worker, engine_python, spawn_worker
from twisted.internet.task import deferLater

from rhapsode_worker.fakehub import FakeHub, FakeRepo, listen

#: Generous: a cold build of Chatterbox at its real size takes minutes on a busy box.
BUILD_SECONDS = 3600
#: The token the test hub demands, given to workers as HF_TOKEN: proves it is sent.
TOKEN = "hf_rhapsode_test_token"


@dataclass
class Built:
    folder: Path
    commit: str
    repos: dict[str, Path]
    info: dict[str, Any]


def build(engine: str, *args: str) -> Built:
    """
    The engine's random-weight checkpoint, built if the cache has none.
    """
    builder = ROOT / "tools" / "random_weights" / f"build_{engine}.py"
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", HF_HUB_DISABLE_PROGRESS_BARS="1",
               HF_HUB_OFFLINE="1")
    run = subprocess.run([engine_python(engine), str(builder), *args], capture_output=True, text=True,
                         timeout=BUILD_SECONDS, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    info = json.loads(run.stdout.strip().splitlines()[-1])
    folder = Path(info["folder"])
    return Built(folder, info["commit"], {repo: folder / rel for repo, rel in info["repos"].items()}, info)


def pins(engine: str) -> dict[str, str]:
    """
    The commits the engine's catalog record pins, by repository (branches are left out:
    the test hub serves a branch at the built checkpoint's commit).
    """
    record = json.loads((ROOT / "engines" / engine / "catalog.json").read_text())
    found: dict[str, str] = {}

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            repo, revision = node.get("repo"), node.get("revision")
            if isinstance(repo, str) and isinstance(revision, str) and len(revision) == 40:
                found[repo] = revision
            for value in node.values():
                walk(value)

    walk(record.get("weights", {}))
    return found


def hub_of(built: Built, engine: str) -> FakeHub:
    hub = FakeHub(token=TOKEN)
    pinned = pins(engine)
    for repo, folder in built.repos.items():
        hub.add(FakeRepo.from_folder(repo, pinned.get(repo, built.commit), folder))
    return hub


@dataclass
class Served:
    """
    A worker of a torch engine, the hub it fetches from, and where its cache is.
    """

    worker: Worker
    hub: FakeHub
    port: Any
    cache: Path

    async def stop(self) -> None:
        await self.worker.stop()
        await self.port.stopListening()
        # A pulled Chatterbox is 3.2 GB, and pytest keeps its last three runs' folders.
        shutil.rmtree(self.cache, ignore_errors=True)


async def serve(engine: str, built: Built, tmp: Path, extra: dict[str, str] | None = None) -> Served:
    """
    The hub on loopback and a worker of C{engine} pointed at it, with a cache of its own.
    """
    from twisted.internet import reactor

    hub = hub_of(built, engine)
    port = listen(reactor, hub)
    cache = tmp / "hf-cache"
    env = {
        "HF_ENDPOINT": f"http://127.0.0.1:{port.getHost().port}",
        "HF_HUB_CACHE": str(cache),
        "HF_TOKEN": TOKEN,
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_XET": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "RHAPSODE_WORKER_DEVICE": "cpu",
        **(extra or {}),
    }
    worker = await spawn_worker(reactor, tmp, module=f"rhapsode_engine_{engine}", engine=engine,
                                python=engine_python(engine), extra_env=env)
    return Served(worker, hub, port, cache)


#: make test-heavy: a model of real size on a busy two-core CPU.  Measured there: a Dia-1.6B
#: load and first speak passed the checker's 120 s probe deadline, and forty Chatterbox
#: generations passed twenty minutes.
HEAVY = os.environ.get("RHAPSODE_TEST_HEAVY") == "1"


def conform(target: str) -> "subprocess.CompletedProcess[str]":
    """
    The conformance checker against C{target}: its default probe deadline for the tiny
    models of every push, ten minutes a probe and three hours in all at real size.
    """
    probe = ["--timeout", "600"] if HEAVY else []
    return subprocess.run([sys.executable, "-m", "rhapsode_conform", *probe, target], capture_output=True,
                          text=True, timeout=3 * 3600 if HEAVY else 1200)


def messages(worker: Worker) -> list[str]:
    return [str(line.get("message", "")) for line in worker.protocol.log_lines()]


async def logged(worker: Worker, wanted: Callable[[list[str]], bool], seconds: float = 120.0) -> list[str]:
    """
    The worker's log lines once C{wanted} holds of them: its stderr is read as it comes,
    so a line written just before an answer may arrive just after it.  A hang guard only.
    """
    from twisted.internet import reactor

    deadline = time.monotonic() + seconds
    while True:
        lines = messages(worker)
        if wanted(lines) or time.monotonic() > deadline:
            return lines
        await deferLater(reactor, 0.1, lambda: None)
