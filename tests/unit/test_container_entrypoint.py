"""
The container's entrypoint (tools/container/entrypoint.py) turns the image's defaults, an
operator's mounted file and RHAPSODE_CONFIG_* variables into the one config file the core
reads; these run it on temporary folders, without a container.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ENTRYPOINT = Path(__file__).resolve().parents[2] / "tools" / "container" / "entrypoint.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("rhapsode_container_entrypoint", ENTRYPOINT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


entrypoint = load()


def test_defaults_put_state_in_the_volume_and_listen_everywhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """
    With no file and no variable the config listens on every interface, keeps voices and
    virtualenvs under the volume, and, with no accelerator device, keeps engines loaded.
    """
    monkeypatch.setattr(entrypoint, "DEFAULT_FILE", str(tmp_path / "absent.json"))
    document, notes = entrypoint.assemble({}, Path("/var/lib/rhapsode"), dev=tmp_path)
    assert notes == []
    assert document["server"] == {"host": "0.0.0.0", "port": 8080}
    assert document["workers"]["voiceDir"] == "/var/lib/rhapsode/voices"
    assert document["install"]["venvDir"] == "/var/lib/rhapsode/venvs"
    assert document["residency"] == {"maxResidentModels": 8, "keepAliveSeconds": -1}
    (tmp_path / "nvidiactl").touch()
    with_gpu, _ = entrypoint.assemble({}, Path("/data"), dev=tmp_path)
    assert "residency" not in with_gpu


def test_a_mounted_file_merges_over_the_defaults_key_by_key(tmp_path: Path) -> None:
    """The operator's file changes the keys it names and leaves the image's others."""
    mounted = tmp_path / "rhapsode.json"
    mounted.write_text(json.dumps({"server": {"port": 9000}, "cors": {"origins": ["*"]}}))
    document, notes = entrypoint.assemble({"RHAPSODE_CONFIG": str(mounted)}, Path("/v"), dev=tmp_path)
    assert document["server"] == {"host": "0.0.0.0", "port": 9000}
    assert document["cors"] == {"origins": ["*"]}
    assert notes == [f"config from {mounted}"]


def test_variables_name_settings_in_capitals_and_win_over_the_file(tmp_path: Path) -> None:
    """
    RHAPSODE_CONFIG_<SECTION>_<KEY> sets section.camelCaseKey, over the file; a JSON-looking
    value is JSON, anything else a string (which the core reads numbers from), an empty one
    nothing, and the token is never echoed.
    """
    mounted = tmp_path / "rhapsode.json"
    mounted.write_text(json.dumps({"server": {"shutdownGraceMs": 1000}}))
    environ = {
        "RHAPSODE_CONFIG": str(mounted),
        "RHAPSODE_CONFIG_SERVER_SHUTDOWN_GRACE_MS": "20000",
        "RHAPSODE_CONFIG_METRICS_PUBLIC": "true",
        "RHAPSODE_CONFIG_CORS_ORIGINS": '["https://studio.example"]',
        "RHAPSODE_CONFIG_MANAGEMENT_TOKEN": "s3cret-s3cret-s3cret",
        "RHAPSODE_CONFIG_LOG_LEVEL": "",
        "RHAPSODE_URL": "http://elsewhere:1",
    }
    document, notes = entrypoint.assemble(environ, Path("/v"), dev=tmp_path)
    assert document["server"]["shutdownGraceMs"] == "20000"
    assert document["metrics"] == {"public": True}
    assert document["cors"] == {"origins": ["https://studio.example"]}
    assert document["management"] == {"token": "s3cret-s3cret-s3cret"}
    assert "log" not in document, "an empty variable is as if unset"
    assert not any("s3cret" in note for note in notes)
    assert "RHAPSODE_CONFIG_SERVER_SHUTDOWN_GRACE_MS -> server.shutdownGraceMs = 20000" in notes


def test_a_variable_without_a_key_or_a_broken_file_stops_the_start(tmp_path: Path) -> None:
    """
    A variable naming only a section or holding an unexpanded `${...}`, a file that is not
    JSON, or a missing named file: each fails the start, naming it.
    """
    with pytest.raises(SystemExit, match="RHAPSODE_CONFIG_SERVER: want"):
        entrypoint.assemble({"RHAPSODE_CONFIG_SERVER": "1"}, Path("/v"), dev=tmp_path)
    with pytest.raises(SystemExit, match="a compose variable left unexpanded"):
        entrypoint.assemble({"RHAPSODE_CONFIG_MANAGEMENT_TOKEN": "${TOKEN:-}"}, Path("/v"), dev=tmp_path)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(SystemExit, match="broken.json: not a JSON config"):
        entrypoint.assemble({"RHAPSODE_CONFIG": str(broken)}, Path("/v"), dev=tmp_path)
    with pytest.raises(SystemExit, match="no such file"):
        entrypoint.assemble({"RHAPSODE_CONFIG": str(tmp_path / "absent.json")}, Path("/v"), dev=tmp_path)


def test_an_extra_ca_file_is_added_to_the_system_bundle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """RHAPSODE_CA_FILE gives pip and the weights fetch the system's roots and that bundle together."""
    system = tmp_path / "system.pem"
    system.write_text("SYSTEM\n")
    extra = tmp_path / "extra.pem"
    extra.write_text("EXTRA\n")
    monkeypatch.setattr(entrypoint, "SYSTEM_CA", str(system))
    monkeypatch.setattr(entrypoint, "CA_BUNDLE", tmp_path / "bundle.pem")
    variables = entrypoint.ca_bundle({"RHAPSODE_CA_FILE": str(extra)})
    assert set(variables) == {"PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"}
    assert Path(variables["PIP_CERT"]).read_text() == "SYSTEM\n\nEXTRA\n"
    assert entrypoint.ca_bundle({}) == {}


def test_serve_writes_the_config_into_the_volume_and_execs_the_server(tmp_path: Path) -> None:
    """
    `rhapsode-container rhapsode serve` writes $RHAPSODE_HOME/rhapsode.json (mode 0600)
    and replaces itself with `rhapsode serve --config` that file; here `rhapsode` is a
    stand-in on PATH that prints its arguments.
    """
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in = bin_dir / "rhapsode"
    stand_in.write_text("#!/bin/sh\necho \"args: $*\"\n")
    stand_in.chmod(0o755)
    home = tmp_path / "home"
    mounted = tmp_path / "rhapsode.json"
    mounted.write_text("{}")
    environ = {"PATH": f"{bin_dir}:/usr/bin:/bin", "RHAPSODE_HOME": str(home),
               "RHAPSODE_CONFIG": str(mounted), "RHAPSODE_CONFIG_LOG_LEVEL": "debug"}
    done = subprocess.run([sys.executable, str(ENTRYPOINT), "rhapsode", "serve"], env=environ,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    config = home / "rhapsode.json"
    assert f"args: serve --config {config}" in done.stdout
    assert json.loads(config.read_text())["log"] == {"level": "debug"}
    assert config.stat().st_mode & 0o777 == 0o600
