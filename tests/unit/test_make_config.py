"""
tools/make_config.py, the writer of the config `make serve` runs from: it writes the file
only when there is none, adds only the engines a file lacks, and says what it did, so a
hand-edited run/rhapsode.json survives `make serve`; on a box with no GPU it keeps every
engine loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "make_config.py"
sys.path.insert(0, str(TOOL.parent))
from make_config import CPU_RESIDENT_MODELS, fresh, has_accelerator  # noqa: E402

HAND_EDITED = """{"server": {"port": 9090, "host": "0.0.0.0"},
 "log": {"level": "debug"},
 "engines": {"tone": {"module": "rhapsode_engine_tone", "env": {"TONE": "1"}},
             "kokoro": {"module": "rhapsode_engine_kokoro", "env": {"RHAPSODE_KOKORO_CACHE": "/data/kokoro"}}}}
"""


def tool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(TOOL), *args, "--venvs", str(cwd / ".venvs")],
        cwd=cwd, capture_output=True, text=True, timeout=60,
    )


def test_write_makes_the_config_when_there_is_none(tmp_path: Path) -> None:
    """
    With no config, write makes one: port 8080 on loopback, the workers' folders beside
    it, each engine spawned from its own virtualenv, all paths absolute; and says so.
    """
    config = tmp_path / "run" / "rhapsode.json"
    run = tool("write", str(config), "tone", "espeak", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert f"wrote {config} with engines tone, espeak configured by hand" in run.stdout
    written = json.loads(config.read_text())
    # This box has no GPU: the config keeps every engine loaded (tested on its own below).
    assert written.pop("residency", None) == (None if has_accelerator() else {
        "maxResidentModels": CPU_RESIDENT_MODELS, "keepAliveSeconds": -1})
    assert written == {
        "server": {"port": 8080, "host": "127.0.0.1"},
        "workers": {"socketDir": str(tmp_path / "run" / "sockets"), "voiceDir": str(tmp_path / "run" / "voices")},
        "install": {"venvDir": str(tmp_path / "run" / "venvs")},
        "engines": {
            e: {"module": f"rhapsode_engine_{e}", "python": str(tmp_path / ".venvs" / e / "bin" / "python")}
            for e in ("tone", "espeak")
        },
    }


def test_write_leaves_an_existing_config_alone(tmp_path: Path) -> None:
    """
    A config that exists, edited by hand, is not rewritten by write, even for engines
    it does not name; the output says it was left alone.
    """
    config = tmp_path / "rhapsode.json"
    config.write_text(HAND_EDITED)
    run = tool("write", str(config), "tone", "espeak", "piper", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert config.read_text() == HAND_EDITED
    assert "left as it is" in run.stdout


def test_add_adds_only_the_missing_engine(tmp_path: Path) -> None:
    """
    add puts a missing engine in a hand-edited config and keeps every other key and
    value as it was; the output names what was added.
    """
    config = tmp_path / "rhapsode.json"
    edited = json.loads(HAND_EDITED)
    del edited["engines"]["kokoro"]
    config.write_text(json.dumps(edited))
    run = tool("add", str(config), "kokoro", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert f"added engine kokoro to {config}" in run.stdout
    kokoro = {"module": "rhapsode_engine_kokoro", "python": str(tmp_path / ".venvs" / "kokoro" / "bin" / "python")}
    assert json.loads(config.read_text()) == {**edited, "engines": {**edited["engines"], "kokoro": kokoro}}


def test_add_leaves_an_engine_already_configured_alone(tmp_path: Path) -> None:
    """
    An engine the config already has, however it was edited, is not replaced: the
    file is byte for byte as it was.
    """
    config = tmp_path / "rhapsode.json"
    config.write_text(HAND_EDITED)
    run = tool("add", str(config), "kokoro", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert config.read_text() == HAND_EDITED
    assert "already configures kokoro: left as it is" in run.stdout


def test_add_without_a_config_leaves_it_to_write(tmp_path: Path) -> None:
    """
    With no config yet, add makes none (make serve will write one with the engine).
    """
    config = tmp_path / "run" / "rhapsode.json"
    run = tool("add", str(config), "kokoro", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert not config.exists() and "does not exist yet" in run.stdout


def test_add_refuses_a_config_that_is_not_json(tmp_path: Path) -> None:
    """
    A config broken by hand is not replaced: add fails saying why and leaves it.
    """
    config = tmp_path / "rhapsode.json"
    config.write_text('{"engines": {')
    run = tool("add", str(config), "kokoro", cwd=tmp_path)
    assert run.returncode != 0 and "is not JSON" in run.stderr
    assert config.read_text() == '{"engines": {'


def test_a_box_without_an_accelerator_keeps_every_engine_loaded(tmp_path: Path) -> None:
    """
    Without an NVIDIA, ROCm or WSL GPU device node, the config written keeps up to eight
    models resident with no expiry; with one, residency is left at the server's defaults.
    """
    assert not has_accelerator(tmp_path)
    (tmp_path / "kfd").touch()
    assert has_accelerator(tmp_path)
    config = tmp_path / "rhapsode.json"
    assert fresh(config, [], tmp_path, accelerator=False)["residency"] == {
        "maxResidentModels": CPU_RESIDENT_MODELS, "keepAliveSeconds": -1}
    assert "residency" not in fresh(config, [], tmp_path, accelerator=True)
