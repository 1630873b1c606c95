"""
The conformance checker against a real Kokoro worker in its own virtualenv: no FAIL line.

Kept apart from test_engine_kokoro.py because the checker speaks some thirty requests,
which at Kokoro's CPU speed is most of a minute on its own.  The weights come from the
shared cache (.venvs/kokoro-cache); a cold cache is fetched by the worker's first load.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
from pathlib import Path

from _worker import ROOT, engine_python
from test_conform import check_summary, conform, failures, lines_of

CACHE = ROOT / ".venvs" / "kokoro-cache"
#: Hang guards, not timings: the handshake takes seconds and a whole run most of a
#: minute on an idle two-core box; these pass on one ten times slower.
STARTUP_SECONDS = 120.0
RUN_SECONDS = 1800.0
PROBE_SECONDS = 600.0


def test_kokoro_conforms(tmp_path: Path) -> None:
    """
    The Kokoro worker passes every check the checker can decide, a seed reproducing its
    audio and a blend made and spoken included; cues and deliveries, which it does not
    claim, are the only checks left undecided.
    """
    socket_path = tmp_path / "kokoro.sock"
    env = dict(os.environ)
    env.update(
        {
            "RHAPSODE_WORKER_LISTEN": f"unix:{socket_path}",
            "RHAPSODE_WORKER_ENGINE": "kokoro",
            "RHAPSODE_WORKER_CONTRACT": "1",
            "RHAPSODE_WORKER_VOICE_DIR": str(tmp_path / "voices"),
            "RHAPSODE_KOKORO_CACHE": str(CACHE),
        }
    )
    python = engine_python("kokoro")
    # stderr to a file: a pipe nobody reads would fill with log lines and stall the worker.
    with open(tmp_path / "stderr.log", "wb") as stderr:
        process = subprocess.Popen(
            [python, "-m", "rhapsode_engine_kokoro"], env=env, stdout=subprocess.PIPE, stderr=stderr
        )
    try:
        assert process.stdout is not None
        readable, _, _ = select.select([process.stdout], [], [], STARTUP_SECONDS)
        line = process.stdout.readline() if readable else b""
        assert line, (tmp_path / "stderr.log").read_text()
        assert json.loads(line)["engine"] == "kokoro"
        run = conform(str(socket_path), run_seconds=RUN_SECONDS, probe_seconds=PROBE_SECONDS)
    finally:
        process.kill()
        process.wait(timeout=10)
    assert run.returncode == 0, run.stdout + run.stderr
    assert failures(run) == {}
    check_summary(run)
    passed = set(lines_of(run, "pass  "))
    assert {
        "speak loads on demand",
        "a seed reproduces audio in variant v1.0-int8",
        "a blend is created, listed, spoken and deleted",
        "a clone from a reference of an unlisted type is unsupported",
    } <= passed
    undecided = {line.split(":")[0] for line in lines_of(run, "cannot be decided ")}
    assert undecided <= {
        "an undeclared format is unsupported, naming it",
        "claimed cues change the audio in variant v1.0-int8",
        "claimed deliveries change the audio in variant v1.0-int8",
        "a variant of one language ignores the language asked for",
    }
