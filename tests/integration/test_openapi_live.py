"""
The document is the truth (issue 23, section 5): schemathesis, driven by the core's own
/openapi.json, sends every public and management route its generated cases against a
live core serving the tone engine, and every check holds: no 5xx, every status and
header documented, every answer in its schema, what the schema refuses refused and what
it takes taken (less what tests/integration/schemathesis.toml says a schema cannot
state), Allow naming exactly the path's methods.

Deterministic (the same cases each run) and bounded (25 examples an operation); the
process's own limit is a hang guard only.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _worker import serving_core

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "schemathesis.toml"
HOOKS = "_schemathesis_hooks"
SCHEMATHESIS = Path(sys.executable).parent / "schemathesis"
TONE = {"tone": {"module": "rhapsode_engine_tone"}}
#: A hang guard: the run takes a minute or two on an idle two-core box.
RUN_SECONDS = 1800


def test_schemathesis_finds_no_mismatch_between_the_document_and_the_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """
    schemathesis's every check over every operation of /openapi.json passes against a
    live core: the run exits 0 and reports no failure, and the core answered every
    request (it is still up at the end).
    """
    # Nothing a PATCH may write reaches the network: no update check is ever made.
    monkeypatch.setenv("RHAPSODE_UPDATE_CHECK", "0")
    install = {"sourceDir": str(tmp_path / "src"), "venvDir": str(tmp_path / "venvs")}
    # The hooks apply two rules the document states in words (texts with nothing to speak
    # are left out; a request for timestamps sends the Accept they need); only schemathesis
    # loads them (the core and its workers run without them on their path).
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "SCHEMATHESIS_HOOKS": HOOKS, "PYTHONPATH": path}
    with serving_core(tmp_path, TONE, install=install) as (core, port):
        run = subprocess.run(
            [str(SCHEMATHESIS), "--config-file", str(CONFIG), "run", f"http://127.0.0.1:{port}/openapi.json",
             "--checks", "all", "--no-color", "--report", "junit", "--report-dir", str(tmp_path / "report")],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_SECONDS,
        )
        alive = core.poll() is None
    output = run.stdout[-20000:] + run.stderr[-5000:]
    assert run.returncode == 0, output
    summary = run.stdout.split("Test cases:")[-1]
    assert " passed" in summary and "fail" not in summary and "error" not in summary, output
    assert alive, output
