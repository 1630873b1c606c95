"""
The Makefile's config, run for real: a hand-edited run/rhapsode.json survives
`make fetch-kokoro` and the `make serve` after it, gaining only the kokoro engine.
The fetch runs against the weights the Kokoro tests keep in .venvs/kokoro-cache, so it
verifies them and downloads nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
CACHE = ROOT / ".venvs" / "kokoro-cache"
KOKORO_VENV = ".venvs/kokoro/.installed"


def make(run: Path, *targets: str) -> subprocess.CompletedProcess[str]:
    # -o: the kokoro virtualenv counts as built, so nothing is installed here.
    return subprocess.run(
        ["make", "-o", KOKORO_VENV, f"RUN={run}", *targets],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "RHAPSODE_KOKORO_CACHE": str(CACHE)},
    )


def test_fetching_kokoro_adds_it_to_a_hand_edited_config_and_keeps_the_edits(tmp_path: Path) -> None:
    """
    With run/rhapsode.json edited by hand (another port, a log level, an engine's env),
    `make fetch-kokoro` adds the kokoro engine and says so, and the config step of
    `make serve` after it rewrites nothing: every edit is still there.
    """
    # Asked when the test runs, not when it is collected: on a fresh clone the Kokoro
    # tests that run before this one are what fetch the cache.
    if shutil.which("make") is None or not (ROOT / KOKORO_VENV).exists() or not CACHE.is_dir():
        pytest.skip("needs make, .venvs/kokoro and a fetched .venvs/kokoro-cache (make test builds them)")
    config = tmp_path / "rhapsode.json"
    edited = {
        "server": {"port": 9191, "host": "127.0.0.1"},
        "log": {"level": "warn"},
        "engines": {"tone": {"module": "rhapsode_engine_tone", "env": {"EDITED": "by hand"}}},
    }
    config.write_text(json.dumps(edited))
    fetched = make(tmp_path, "fetch-kokoro")
    assert fetched.returncode == 0, fetched.stdout[-2000:] + fetched.stderr[-2000:]
    assert f"added engine kokoro to {config}" in fetched.stdout
    serving = make(tmp_path, str(config))
    assert serving.returncode == 0, serving.stdout + serving.stderr
    kokoro = {"module": "rhapsode_engine_kokoro", "python": str(ROOT / ".venvs" / "kokoro" / "bin" / "python")}
    assert json.loads(config.read_text()) == {**edited, "engines": {**edited["engines"], "kokoro": kokoro}}


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_serve_writes_the_config_only_when_it_is_missing(tmp_path: Path) -> None:
    """
    The config step of `make serve` writes run/rhapsode.json with the tree's engines
    when there is none, and leaves one that exists alone.
    """
    config = tmp_path / "rhapsode.json"
    written = make(tmp_path, str(config))
    assert written.returncode == 0, written.stdout + written.stderr
    engines = json.loads(config.read_text())["engines"]
    assert {"tone", "espeak", "piper"} <= set(engines) and "kokoro" not in engines
    config.write_text('{"engines": {}}')
    again = make(tmp_path, str(config))
    assert again.returncode == 0 and config.read_text() == '{"engines": {}}'
