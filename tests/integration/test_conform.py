"""
The conformance checker end to end: real workers spawned under the spawn contract, and
C{python -m rhapsode_conform} run against them as a subprocess.  The tone and
chatty engines conform; the liar engine claims a cue, a delivery and seed
reproducibility it does not perform, and must be caught naming exactly those.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import select
import socket
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

HERE = Path(__file__).parent
STARTUP_SECONDS = 60.0  # a hang guard: the handshake comes in a second or two
SUMMARY = re.compile(r"^conformance: (\d+) pass, (\d+) fail, (\d+) cannot be decided$")


@dataclass
class Running:
    handshake: dict[str, Any]
    voice_dir: Path

    @property
    def target(self) -> str:
        listen = str(self.handshake["listen"])
        if listen.startswith("unix:"):
            return listen[len("unix:"):]
        return "http://" + listen[len("tcp:"):]


@contextmanager
def worker(tmp_path: Path, module: str, engine: str, listen: str = "unix") -> Iterator[Running]:
    """
    Spawn C{module} as a worker, read its one handshake line, and kill it afterwards.
    """
    address = f"unix:{tmp_path / 'x.sock'}" if listen == "unix" else "tcp:127.0.0.1:0"
    env = dict(os.environ)
    env.update(
        {
            "RHAPSODE_WORKER_LISTEN": address,
            "RHAPSODE_WORKER_ENGINE": engine,
            "RHAPSODE_WORKER_CONTRACT": "1",
            "RHAPSODE_WORKER_VOICE_DIR": str(tmp_path / "voices"),
            "PYTHONPATH": os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]),
            "PYTHONUNBUFFERED": "1",
        }
    )
    # stderr to a file: a pipe nobody reads would fill with log lines and stall the worker.
    with open(tmp_path / "stderr.log", "wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", module], env=env, stdout=subprocess.PIPE, stderr=stderr
        )
    try:
        assert proc.stdout is not None
        readable, _, _ = select.select([proc.stdout], [], [], STARTUP_SECONDS)
        line = proc.stdout.readline() if readable else b""
        assert line, f"no handshake: {(tmp_path / 'stderr.log').read_text()}"
        yield Running(json.loads(line), tmp_path / "voices")
    finally:
        proc.kill()
        proc.wait(timeout=10)


def conform(target: str, run_seconds: float = 600, probe_seconds: float = 120) -> subprocess.CompletedProcess[str]:
    """
    The checker run against C{target}.  Both limits are hang guards, far past what a run
    takes on a busy box (a tone worker's run takes seconds): how fast is not a test's
    business.
    """
    return subprocess.run(
        [sys.executable, "-m", "rhapsode_conform", target, "--timeout", f"{probe_seconds:g}"],
        capture_output=True,
        text=True,
        timeout=run_seconds,
    )


def lines_of(run: subprocess.CompletedProcess[str], prefix: str) -> list[str]:
    return [line[len(prefix):] for line in run.stdout.splitlines() if line.startswith(prefix)]


def failures(run: subprocess.CompletedProcess[str]) -> dict[str, str]:
    return dict(line.split(": ", 1) for line in lines_of(run, "FAIL  "))


def check_summary(run: subprocess.CompletedProcess[str]) -> None:
    """The last line counts the lines above it, in the checker's own words."""
    lines = run.stdout.splitlines()
    match = SUMMARY.match(lines[-1])
    assert match, lines[-1]
    counts = tuple(int(n) for n in match.groups())
    assert counts == (
        len(lines_of(run, "pass  ")),
        len(lines_of(run, "FAIL  ")),
        len(lines_of(run, "cannot be decided ")),
    )
    assert len(lines) == sum(counts) + 1
    assert not re.search(r"\d+ passed, \d+ failed", run.stdout)


def call(target: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """One JSON request, to see the worker's state around a run."""
    if target.startswith("http://"):
        host, port = target[len("http://"):].rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
    else:
        conn = http.client.HTTPConnection("localhost", timeout=30)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(target)
        conn.sock = sock
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body))
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_tone_conforms_over_a_unix_socket(tmp_path: Path) -> None:
    """
    The tone engine passes every check with no FAIL, exercising cues, deliveries, seeds,
    dialogue and a blend for real, and is left unloaded with no voice it did not have.
    """
    with worker(tmp_path, "rhapsode_engine_tone", "tone") as running:
        _, voices_before = call(running.target, "GET", "/voices")
        run = conform(running.target)
        _, health = call(running.target, "GET", "/health")
        _, voices_after = call(running.target, "GET", "/voices")
    assert run.returncode == 0, run.stdout + run.stderr
    assert failures(run) == {}
    check_summary(run)
    passed = set(lines_of(run, "pass  "))
    assert {
        "speak loads on demand",
        "a stream ends with its duration as a trailer",
        "a seed reproduces audio in variant expressive",
        "cue [laugh] changes the audio in variant expressive",
        "an unclaimed cue is stripped in variant classic",
        "delivery hushed changes the audio in variant classic",
        "dialogue of two turns speaks in variant classic",
        "a blend is created, listed, spoken and deleted",
        "every error carries code, message and retryable, as the table says",
    } <= passed
    assert health["model"] == "unloaded"
    assert voices_after == voices_before
    assert not any(running.voice_dir.glob("**/conform-*"))


def test_tone_conforms_over_tcp_and_is_left_loaded(tmp_path: Path) -> None:
    """
    The checker speaks plain HTTP to http://host:port as well, and a worker that had a
    variant loaded has it loaded again afterwards.
    """
    with worker(tmp_path, "rhapsode_engine_tone", "tone", listen="tcp") as running:
        assert running.target.startswith("http://127.0.0.1:")
        status, _ = call(running.target, "POST", "/load", {"variant": "classic"})
        assert status == 200
        run = conform(running.target)
        _, health = call(running.target, "GET", "/health")
    assert run.returncode == 0, run.stdout + run.stderr
    assert failures(run) == {}
    check_summary(run)
    assert (health["model"], health["variant"]) == ("loaded", "classic")


def test_chatty_conforms_with_its_seed_checks_undecided(tmp_path: Path) -> None:
    """
    The chatty engine conforms; it claims no seed reproducibility, so the seed check is
    "cannot be decided" rather than a pass it could not have failed.
    """
    with worker(tmp_path, "chatty_engine", "chatty") as running:
        run = conform(running.target)
    assert run.returncode == 0, run.stdout + run.stderr
    assert failures(run) == {}
    check_summary(run)
    undecided = lines_of(run, "cannot be decided ")
    assert "a seed reproduces audio in variant only: the variant does not claim it" in undecided
    assert not any(line.startswith("a seed reproduces audio") for line in lines_of(run, "pass  "))


def test_liar_is_caught_naming_each_false_claim(tmp_path: Path) -> None:
    """
    A worker claiming a cue and a delivery it ignores, or seed reproducibility its random
    audio breaks, fails exactly those checks, and the checker exits 1; where the audio is
    random, the cue and delivery checks cannot be decided rather than passing.  (A variant
    whose audio ignores the seed but never varies does reproduce: that is not a failure.)
    """
    with worker(tmp_path, "liar_engine", "liar") as running:
        run = conform(running.target)
    assert run.returncode == 1, run.stdout + run.stderr
    check_summary(run)
    assert set(failures(run)) == {
        "a seed reproduces audio in variant noisy",
        "cue [laugh] changes the audio in variant deaf",
        "delivery hushed changes the audio in variant deaf",
    }
    undecided = " ".join(lines_of(run, "cannot be decided "))
    assert "cue [laugh] changes the audio in variant noisy" in undecided
    assert "delivery hushed changes the audio in variant noisy" in undecided


def test_nothing_listening_exits_2(tmp_path: Path) -> None:
    """
    A target where nothing answers is exit status 2, with the reason on stderr and no
    report.
    """
    run = conform(str(tmp_path / "absent.sock"))
    assert run.returncode == 2
    assert "cannot reach" in run.stderr
    assert run.stdout == ""


def _engines_in_tree() -> list[str]:
    """
    The module of every engine distribution under engines/ (rhapsode-engine-<id>).
    """
    root = HERE.parent.parent / "engines"
    return sorted(f"rhapsode_engine_{path.name}" for path in root.iterdir() if (path / "setup.cfg").exists())


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None



@pytest.mark.parametrize("module", _engines_in_tree())
def test_every_engine_in_the_tree_conforms(tmp_path: Path, module: str) -> None:
    """
    Every engine distribution in engines/ that is installed here passes the checker with
    no FAIL line (engines that cannot run on this machine are skipped, naming why).
    """
    if not _importable(module):
        pytest.skip(f"{module} is not installed in this environment")
    engine = module.removeprefix("rhapsode_engine_")
    with worker(tmp_path, module, engine) as running:
        run = conform(running.target)
    assert run.returncode == 0, run.stdout + run.stderr
    assert not failures(run)
    check_summary(run)
