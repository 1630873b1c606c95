"""
Tests for L{rhapsode._config}: defaults, coercion, refusals naming the key path, paths
resolved against the config file's directory, and the example file in docs/.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rhapsode._config import (
    Config,
    ConfigError,
    EngineConfig,
    load_config,
    parse_config,
)

BASE = Path("/etc/rhapsode")
EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "config.example.json"


def parse(raw: dict[str, Any]) -> Config:
    return parse_config(raw, BASE)


def refusal(raw: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as caught:
        parse(raw)
    return str(caught.value)


def test_defaults_without_a_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """
    With no file every setting has the documented default and there are no engines.
    """
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    monkeypatch.setenv("XDG_DATA_HOME", "/home/op/.data")
    config = load_config(None)
    assert (config.server.port, config.server.host, config.server.shutdown_grace_ms) == (
        8080,
        "127.0.0.1",
        10000,
    )
    assert config.log.level == "info"
    assert config.residency.max_resident_models == 1
    assert config.residency.eviction_wait_seconds == 30
    assert config.residency.keep_alive_seconds == 300
    assert config.workers.socket_dir == Path("/run/user/1000/rhapsode/workers")
    assert config.workers.voice_dir == Path("/home/op/.data/rhapsode/voices")
    assert config.workers.startup_timeout_seconds == 120
    assert config.workers.drain_grace_ms == 10000
    assert config.workers.max_restarts == 5
    assert config.workers.restart_decay_seconds == 300
    assert config.management.token is None
    assert config.management.origins == ()
    assert dict(config.engines) == {}


def test_directory_defaults_without_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """
    Without the XDG variables (or with relative ones, which XDG says to ignore) the
    socket directory is per-user under /tmp and voices live under ~/.local/share.
    """
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", "relative/data")
    monkeypatch.setenv("HOME", str(tmp_path))
    workers = parse({}).workers
    assert workers.socket_dir == Path(f"/tmp/rhapsode-{os.getuid()}/workers")
    assert workers.voice_dir == tmp_path / ".local" / "share" / "rhapsode" / "voices"
    monkeypatch.setenv("XDG_RUNTIME_DIR", "run")
    assert parse({}).workers.socket_dir == Path(f"/tmp/rhapsode-{os.getuid()}/workers")


def test_example_file_parses() -> None:
    """
    docs/config.example.json is a valid config: a module engine and a remote one.
    """
    config = load_config(EXAMPLE)
    docs = EXAMPLE.parent
    assert config.workers.socket_dir == docs / "run" / "workers"
    assert config.workers.voice_dir == docs / "voices"
    assert config.management.origins == ("https://studio.example",)
    tone = config.engine("tone")
    assert tone == EngineConfig(
        id="tone",
        module="rhapsode_engine_tone",
        python=sys.executable,
        env={"PYTHONUNBUFFERED": "1"},
        keep_alive_seconds=60,
        max_concurrent=16,
    )
    assert config.limits.queued_per_engine == 32 and config.server.head_timeout_seconds == 10
    remote = config.engine("kokoro-remote")
    assert (remote.url, remote.module, remote.python, dict(remote.env)) == (
        "http://gpu-box.lan:9000",
        None,
        None,
        {},
    )
    assert remote.keep_alive_seconds == 900


def test_engine_lookup_raises_key_error() -> None:
    """
    Config.engine answers a configured engine and raises KeyError for any other id.
    """
    config = parse({"engines": {"tone": {"module": "rhapsode_engine_tone"}}})
    assert config.engine("tone").module == "rhapsode_engine_tone"
    with pytest.raises(KeyError):
        config.engine("kokoro")


def test_config_is_frozen() -> None:
    """
    The parsed config cannot be changed in place, engines and env included.
    """
    config = parse({"engines": {"tone": {"module": "m", "env": {"A": "1"}}}})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.server.port = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.engines["x"] = config.engine("tone")  # type: ignore[index]
    with pytest.raises(TypeError):
        config.engine("tone").env["B"] = "2"  # type: ignore[index]


@pytest.mark.parametrize(
    "raw, read",
    [
        ({"server": {"port": "8080"}}, lambda c: c.server.port == 8080),
        ({"server": {"port": " 9090 "}}, lambda c: c.server.port == 9090),
        ({"server": {"port": 9090.0}}, lambda c: c.server.port == 9090),
        ({"residency": {"keepAliveSeconds": "-1"}}, lambda c: c.residency.keep_alive_seconds == -1),
        ({"residency": {"evictionWaitSeconds": "2.5"}}, lambda c: c.residency.eviction_wait_seconds == 2.5),
        ({"residency": {"evictionWaitSeconds": 0}}, lambda c: c.residency.eviction_wait_seconds == 0),
        ({"workers": {"startupTimeoutSeconds": "1e1"}}, lambda c: c.workers.startup_timeout_seconds == 10),
        ({"workers": {"maxRestarts": 0}}, lambda c: c.workers.max_restarts == 0),
        ({"server": {"port": None}}, lambda c: c.server.port == 8080),
        ({"server": None}, lambda c: c.server.port == 8080),
        ({"management": {"token": None, "origins": None}}, lambda c: c.management.token is None),
        ({"engines": None}, lambda c: dict(c.engines) == {}),
        ({"engines": {"tone": None}}, lambda c: "tone" not in c.engines),
        ({"log": {"level": "trace"}}, lambda c: c.log.level == "trace"),
        ({"server": {"host": "::"}}, lambda c: c.server.host == "::"),
        ({"engines": {"t": {"module": "m", "device": "CUDA:1 "}}}, lambda c: c.engine("t").device == "cuda:1"),
        ({"engines": {"t": {"module": "m"}}}, lambda c: c.engine("t").device is None),
        ({"install": {"box": "cpu"}}, lambda c: c.install.box == "cpu"),
        ({}, lambda c: c.install.box == "auto"),
    ],
)
def test_coercion_and_null(raw: dict[str, Any], read: Any) -> None:
    """
    Numbers written as strings are read as numbers, integral floats as integers, and
    null is the same as leaving the setting out.
    """
    assert read(parse(raw))


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"servr": {}}, "servr: unknown key"),
        ({"server": {"prot": 1}}, "server.prot: unknown key"),
        ({"engines": {"tone": {"modul": "x"}}}, "engines.tone.modul: unknown key"),
        ({"server": {"port": 0}}, "server.port: must be an integer from 1 to 65535, not 0"),
        ({"server": {"port": 65536}}, "server.port: must be an integer from 1 to 65535, not 65536"),
        ({"server": {"port": True}}, "server.port: must be an integer from 1 to 65535, not true"),
        ({"server": {"port": "80a"}}, 'server.port: must be an integer from 1 to 65535, not "80a"'),
        ({"server": {"port": "8080.0"}}, 'server.port: must be an integer from 1 to 65535, not "8080.0"'),
        ({"server": {"port": 80.5}}, "server.port: must be an integer from 1 to 65535, not 80.5"),
        ({"server": {"host": ""}}, 'server.host: must be a non-empty string, not ""'),
        ({"server": {"shutdownGraceMs": -1}}, "server.shutdownGraceMs: must be an integer from 0 to 600000, not -1"),
        (
            {"residency": {"keepAliveSeconds": 10**18}},
            "residency.keepAliveSeconds: must be an integer from -1 to 604800, not 1000000000000000000",
        ),
        (
            {"server": {"headTimeoutSeconds": 601}},
            "server.headTimeoutSeconds: must be a number > 0 and <= 600, not 601",
        ),
        (
            {"limits": {"concurrentPerEngine": 0}},
            "limits.concurrentPerEngine: must be an integer from 1 to 10000, not 0",
        ),
        (
            {"limits": {"bufferedBytes": 10}},
            "limits.bufferedBytes: must be an integer from 1048576 to 17179869184, not 10",
        ),
        (
            {"workers": {"maxRestarts": 10**6}},
            "workers.maxRestarts: must be an integer from 0 to 1000, not 1000000",
        ),
        ({"server": []}, "server: must be an object, not []"),
        ({"log": {"level": "INFO"}}, 'log.level: must be one of error, warn, info, debug, trace, not "INFO"'),
        (
            {"residency": {"maxResidentModels": 0}},
            "residency.maxResidentModels: must be an integer from 1 to 64, not 0",
        ),
        (
            {"residency": {"keepAliveSeconds": -2}},
            "residency.keepAliveSeconds: must be an integer from -1 to 604800, not -2",
        ),
        (
            {"residency": {"evictionWaitSeconds": -0.5}},
            "residency.evictionWaitSeconds: must be a number >= 0 and <= 3600, not -0.5",
        ),
        (
            {"residency": {"evictionWaitSeconds": False}},
            "residency.evictionWaitSeconds: must be a number >= 0 and <= 3600, not false",
        ),
        (
            {"residency": {"evictionWaitSeconds": "nan"}},
            'residency.evictionWaitSeconds: must be a number >= 0 and <= 3600, not "nan"',
        ),
        (
            {"residency": {"evictionWaitSeconds": "1_0"}},
            'residency.evictionWaitSeconds: must be a number >= 0 and <= 3600, not "1_0"',
        ),
        (
            {"residency": {"evictionWaitSeconds": float("inf")}},
            "residency.evictionWaitSeconds: must be a number >= 0 and <= 3600, not Infinity",
        ),
        (
            {"workers": {"startupTimeoutSeconds": 0}},
            "workers.startupTimeoutSeconds: must be a number > 0 and <= 3600, not 0",
        ),
        (
            {"workers": {"restartDecaySeconds": "0"}},
            'workers.restartDecaySeconds: must be a number > 0 and <= 86400, not "0"',
        ),
        ({"workers": {"drainGraceMs": -5}}, "workers.drainGraceMs: must be an integer from 0 to 600000, not -5"),
        ({"workers": {"maxRestarts": -1}}, "workers.maxRestarts: must be an integer from 0 to 1000, not -1"),
        ({"workers": {"socketDir": 3}}, "workers.socketDir: must be a non-empty string, not 3"),
        (
            {"management": {"token": "short"}},
            "management.token: must be a string of at least 16 characters without surrounding spaces",
        ),
        (
            {"management": {"token": " 0123456789abcdef"}},
            "management.token: must be a string of at least 16 characters without surrounding spaces",
        ),
        ({"management": {"origins": "https://a.example"}}, "management.origins: must be a list of origins"),
        ({"management": {"origins": ["https://a.example/"]}}, "management.origins[0]: must be an absolute"),
        ({"management": {"origins": ["https://ok.example", "https://a.example/app"]}}, "management.origins[1]:"),
        ({"management": {"origins": ["ftp://a.example"]}}, "management.origins[0]:"),
        ({"management": {"origins": ["https://u@a.example"]}}, "management.origins[0]:"),
        ({"management": {"origins": ["https://a.example?x=1"]}}, "management.origins[0]:"),
        ({"management": {"origins": ["a.example"]}}, "management.origins[0]:"),
        ({"management": {"origins": ["null"]}}, "management.origins[0]:"),
        ({"management": {"origins": [7]}}, "management.origins[0]: must be an absolute"),
        ({"engines": []}, "engines: must be an object of engines, not []"),
        ({"engines": {"bad id": {"module": "m"}}}, "engines.bad id: an engine id is 1 to 64"),
        ({"engines": {"-tone": {"module": "m"}}}, "engines.-tone: an engine id is"),
        ({"engines": {"x" * 65: {"module": "m"}}}, f"engines.{'x' * 65}: an engine id is"),
        ({"engines": {"tone": {}}}, "engines.tone: needs exactly one of module, url or cluster"),
        (
            {"engines": {"tone": {"module": "m", "url": "http://h:1"}}},
            "engines.tone: needs exactly one of module, url or cluster",
        ),
        ({"engines": {"tone": "m"}}, 'engines.tone: must be an object, not "m"'),
        ({"engines": {"tone": {"module": "no-dashes"}}}, "engines.tone.module: must be a dotted Python module name"),
        ({"engines": {"tone": {"module": "a..b"}}}, "engines.tone.module: must be a dotted Python module name"),
        (
            {"engines": {"r": {"url": "http://h:1", "python": "/usr/bin/python3"}}},
            "engines.r.python: only an engine with a module takes python",
        ),
        ({"engines": {"t": {"module": "m", "device": "gpu"}}}, 'engines.t.device: must be a device: "cpu", "mps"'),
        ({"engines": {"t": {"module": "m", "device": "cuda:x"}}}, "engines.t.device: must be a device"),
        (
            {"engines": {"r": {"url": "http://h:1", "device": "cpu"}}},
            "engines.r.device: only an engine with a module takes device",
        ),
        ({"install": {"box": "gpu"}}, 'install.box: must be "auto" or "cpu" or "cuda"'),
        (
            {"engines": {"r": {"url": "http://h:1", "env": {"A": "1"}}}},
            "engines.r.env: only an engine with a module takes env",
        ),
        ({"engines": {"r": {"url": "ftp://h/"}}}, "engines.r.url: must be an http or https URL"),
        ({"engines": {"r": {"url": "http:///nohost"}}}, "engines.r.url: must be an http or https URL"),
        ({"engines": {"r": {"url": "http://h:99999"}}}, "engines.r.url: must be an http or https URL"),
        ({"engines": {"r": {"url": "http://h:1/?q=1"}}}, "engines.r.url: must be an http or https URL"),
        ({"engines": {"r": {"url": "unix:run/w.sock"}}}, "engines.r.url: must be an http or https URL"),
        ({"engines": {"r": {"url": 5}}}, "engines.r.url: must be an http or https URL"),
        ({"engines": {"t": {"module": "m", "env": {"A": 1}}}}, "engines.t.env.A: must be a string, not 1"),
        ({"engines": {"t": {"module": "m", "env": {"A=B": "1"}}}}, "engines.t.env.A=B: not a usable"),
        ({"engines": {"t": {"module": "m", "env": ["A"]}}}, "engines.t.env: must be an object of strings"),
        (
            {"engines": {"t": {"module": "m", "keepAliveSeconds": -2}}},
            "engines.t.keepAliveSeconds: must be an integer from -1 to 604800, not -2",
        ),
    ],
)
def test_refusals_name_the_key_path(raw: dict[str, Any], message: str) -> None:
    """
    An unknown key or a bad value, at any depth, is a ConfigError whose message starts
    with the dotted path of the key and says what was wrong.
    """
    assert refusal(raw).startswith(message)


def test_engine_settings() -> None:
    """
    A module engine runs on this interpreter unless it names one; a remote engine takes
    an http(s) URL with a path or a unix: socket path; keepAliveSeconds is optional.
    """
    engines = parse(
        {
            "engines": {
                "tone": {"module": "rhapsode_engine_tone"},
                "kokoro": {"module": "rhapsode_engine_kokoro.worker", "python": "/opt/k/bin/python",
                           "env": {"CUDA_VISIBLE_DEVICES": "1"}, "keepAliveSeconds": "900"},
                "far": {"url": "https://gpu.example:8443/rhapsode"},
                "near": {"url": "unix:/run/rhapsode/near.sock"},
            }
        }
    ).engines
    assert engines["tone"].python == sys.executable
    assert engines["tone"].keep_alive_seconds is None
    assert engines["kokoro"].python == "/opt/k/bin/python"
    assert dict(engines["kokoro"].env) == {"CUDA_VISIBLE_DEVICES": "1"}
    assert engines["kokoro"].keep_alive_seconds == 900
    assert engines["far"].url == "https://gpu.example:8443/rhapsode"
    assert engines["near"].url == "unix:/run/rhapsode/near.sock"
    assert list(engines) == ["tone", "kokoro", "far", "near"]


def test_relative_paths_resolve_against_the_config_directory(tmp_path: Path) -> None:
    """
    socketDir, voiceDir and an engine's python, when relative, are relative to the
    directory holding the config file, not to the working directory; absolute ones stay.
    """
    folder = tmp_path / "conf"
    folder.mkdir()
    path = folder / "rhapsode.json"
    path.write_text(
        json.dumps(
            {
                "workers": {"socketDir": "sockets", "voiceDir": "/srv/voices"},
                "engines": {"tone": {"module": "m", "python": "venvs/tone/bin/python"}},
            }
        )
    )
    config = load_config(path)
    assert config.workers.socket_dir == folder / "sockets"
    assert config.workers.voice_dir == Path("/srv/voices")
    assert config.engine("tone").python == str(folder / "venvs" / "tone" / "bin" / "python")


@pytest.mark.parametrize(
    "text, message",
    [
        ("{", "is not JSON"),
        ('{"server": ' + "[" * 1100 + "]" * 1100 + "}", "is not JSON: it nests deeper"),
        ("[]", "must hold a JSON object"),
        ('{"server": {"port": 1, "port": 2}}', 'key "port" appears twice in one object'),
        ('{"server": {"prot": 1}}', "server.prot: unknown key"),
    ],
)
def test_load_config_refuses_a_bad_file(tmp_path: Path, text: str, message: str) -> None:
    """
    A file that is not JSON (nor JSON nested past the parser's recursion), not an
    object, repeats a key or fails validation is a ConfigError rather than a traceback
    or a silently dropped setting.
    """
    path = tmp_path / "rhapsode.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_load_config_missing_file(tmp_path: Path) -> None:
    """
    A config path that does not exist is a ConfigError naming the path.
    """
    path = tmp_path / "absent.json"
    with pytest.raises(ConfigError, match=f"{path}: cannot be read"):
        load_config(str(path))


def test_importing_the_core_pieces_stays_light() -> None:
    """
    Importing the config and the guard loads no global reactor and no torch,
    onnxruntime or numpy.
    """
    probe = (
        "import sys, rhapsode._config, rhapsode._guard\n"
        "heavy = {'twisted.internet.reactor', 'torch', 'onnxruntime', 'numpy'}\n"
        "print(sorted(heavy & set(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def _documented() -> dict[str, str]:
    """
    docs/configuration.md's tables: each key path to its default cell.
    """
    rows: dict[str, str] = {}
    for line in REFERENCE.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`") and cells[0].endswith("`"):
            key = cells[0].strip("`")
            assert key not in rows, f"{key} is documented twice"
            rows[key] = cells[1]
    return rows


def test_the_configuration_reference_documents_every_key_with_its_default() -> None:
    """
    docs/configuration.md has a row for every key the parser reads and none it does not
    (engine keys as engines.<id>.key), and each plain default it states is the default
    the code has.
    """
    defaults = Config()
    expected: dict[str, Any] = {}
    for section in dataclasses.fields(Config):
        if section.name == "engines":
            for f in dataclasses.fields(EngineConfig):
                if f.name != "id":
                    expected[f"engines.<id>.{_camel(f.name)}"] = None
            continue
        for f in dataclasses.fields(getattr(defaults, section.name)):
            expected[f"{section.name}.{_camel(f.name)}"] = getattr(getattr(defaults, section.name), f.name)
    rows = _documented()
    assert set(rows) == set(expected)
    for key, default in expected.items():
        if isinstance(default, (int, float, str)) and not isinstance(default, bool):
            assert f"`{default:g}`" in rows[key] if isinstance(default, float) else f"`{default}`" in rows[key], key
    # Every documented key is one the parser takes (a value of the right kind is accepted).
    for key in rows:
        if key.startswith("engines."):
            continue
        section, name = key.split(".")
        parse({section: {name: None}})
