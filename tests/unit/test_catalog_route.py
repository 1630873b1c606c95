"""
GET /catalog and section 9's workerVersion and outdated: the records under
install.sourceDir joined with the engines this box has, each engine's version read from
its virtualenv's metadata once, when it is declared, and shown on /engines, /health and
the catalog; GET /catalog answers everybody, the management guard notwithstanding.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from treq.testing import StubTreq
from twisted.internet.address import IPv4Address
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.trial.unittest import SynchronousTestCase

import rhapsode
from rhapsode._config import Config, default_source_dir, parse_config
from rhapsode._fleet.catalog import Catalog, read_source, worker_version
from rhapsode._fleet.registry import EngineHandle, Registry
from rhapsode._http.table import MANAGEMENT
from rhapsode._service import Core, RhapsodeService, build_core

from _fakes import FakeClient, FakeSupervisor

CHECKOUT = Path(__file__).resolve().parents[2]


def record(engine_id: str, commercial: bool = True) -> dict[str, Any]:
    return {
        "id": engine_id,
        "displayName": engine_id.title(),
        "module": f"rhapsode_engine_{engine_id}",
        "distribution": f"rhapsode-engine-{engine_id}",
        "license": {"code": "MIT", "weights": "CC-BY-NC-4.0", "weightsCommercialUse": commercial, "notes": ""},
        "defaultVariant": "base",
        "python": ">=3.11",
    }


def source(tmp_path: Path, *records: dict[str, Any]) -> Path:
    """
    An engines folder as a checkout has it: <id>/catalog.json.
    """
    folder = tmp_path / "engines"
    for facts in records:
        (folder / facts["id"]).mkdir(parents=True)
        (folder / facts["id"] / "catalog.json").write_text(json.dumps(facts))
    return folder


def venv(tmp_path: Path, sdk_version: str | None) -> str:
    """
    A virtualenv's files with the rhapsode distribution's metadata at C{sdk_version}
    (none when None); its python, which is never run.
    """
    root = tmp_path / f"venv-{sdk_version}"
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "python").write_text("")
    (root / "pyvenv.cfg").write_text("home = /usr/bin\n")
    site = root / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    if sdk_version is not None:
        info = site / f"rhapsode_worker-{sdk_version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: rhapsode-worker\nVersion: {sdk_version}\n")
    return str(root / "bin" / "python")


def refuse(method: bytes, path: str) -> tuple[int, Any]:
    raise AssertionError("the catalog and summaries must not ask a worker")


def app_with(catalog: Catalog, *engine_ids: str) -> tuple[Core, FakeClient]:
    # A worker client nobody may call and a process nobody may start: these routes
    # answer from the core's own state.
    worker = FakeClient(fallback=refuse)
    handles = {e: EngineHandle(e, worker, FakeSupervisor(startable=False)) for e in engine_ids}
    return build_core(Registry(handles), reactor=MemoryReactorClock(), catalog=catalog), worker


def get(app: Core, path: str) -> tuple[int, Any]:
    case = SynchronousTestCase()
    stub = StubTreq(app.resource())
    response = case.successResultOf(stub.get("http://core" + path))
    return response.code, json.loads(case.successResultOf(stub.content(response)))


def test_worker_version_is_read_from_the_virtualenvs_metadata(tmp_path: Path) -> None:
    """
    workerVersion is the rhapsode distribution's version in the engine's virtualenv;
    absent for a virtualenv without it, an interpreter outside one, or a remote engine.
    """
    assert worker_version(venv(tmp_path, "0.2.0")) == "0.2.0"
    assert worker_version(venv(tmp_path, None)) is None
    assert worker_version("/usr/bin/python3-not-a-venv") is None
    assert worker_version(None) is None


def test_outdated_is_differs_not_older_and_absent_without_a_version(tmp_path: Path) -> None:
    """
    outdated is true for a version other than the core's, older or newer (a rollback
    breaks the pin too), false for the same, and both fields are absent where the
    version is.
    """
    catalog = Catalog([], "0.2.0")
    catalog.declare("same", "m", venv(tmp_path, "0.2.0"))
    catalog.declare("older", "m", venv(tmp_path, "0.1.0"))
    catalog.declare("newer", "m", venv(tmp_path, "0.3.0"))
    catalog.declare("bare", "m", venv(tmp_path, None))
    catalog.declare("remote", None, None)
    assert catalog.versions("same") == {"workerVersion": "0.2.0", "outdated": False}
    assert catalog.versions("older") == {"workerVersion": "0.1.0", "outdated": True}
    assert catalog.versions("newer") == {"workerVersion": "0.3.0", "outdated": True}
    assert catalog.versions("bare") == {} and catalog.versions("remote") == {}
    assert catalog.versions("undeclared") == {}


def test_the_version_is_read_at_declaration_never_per_request(tmp_path: Path) -> None:
    """
    A virtualenv upgraded under a running core changes nothing until the engine is
    declared again (section 9: computed when declared, nothing on a healthcheck's path).
    """
    python = venv(tmp_path, "0.1.0")
    catalog = Catalog([], "0.1.0")
    catalog.declare("tone", "rhapsode_engine_tone", python)
    info = Path(python).parents[1] / "lib" / "python3.11" / "site-packages" / "rhapsode_worker-0.1.0.dist-info"
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rhapsode-worker\nVersion: 9.9.9\n")
    assert catalog.versions("tone")["workerVersion"] == "0.1.0"
    catalog.declare("tone", "rhapsode_engine_tone", python)
    assert catalog.versions("tone") == {"workerVersion": "9.9.9", "outdated": True}


def test_read_source_lists_every_record_in_id_order_and_skips_what_is_not_one(tmp_path: Path) -> None:
    """
    Every <id>/catalog.json under the folder, sorted by id; a file that is not JSON, or
    a record without an id and a module, is left out; no folder is no records.
    """
    folder = source(tmp_path, record("zeta"), record("alpha"))
    (folder / "broken").mkdir()
    (folder / "broken" / "catalog.json").write_text("{not json")
    (folder / "partial").mkdir()
    (folder / "partial" / "catalog.json").write_text(json.dumps({"id": "partial"}))
    assert [r["id"] for r in read_source(folder)] == ["alpha", "zeta"]
    assert read_source(None) == []
    assert read_source(tmp_path / "missing") == []


def test_the_default_source_is_the_checkouts_engines_folder() -> None:
    """
    A core installed from a checkout (the test venv's editable install) finds the
    checkout's engines folder, with every engine in the tree; the config's default is it.
    """
    assert default_source_dir() == CHECKOUT / "engines"
    assert {r["id"] for r in read_source(default_source_dir())} >= {"tone", "espeak", "piper", "kokoro"}
    assert Config().install.source_dir == CHECKOUT / "engines"


def test_install_source_dir_resolves_against_the_config_file(tmp_path: Path) -> None:
    """
    install.sourceDir is a path like the others: relative to the config's folder, and
    null is the default.
    """
    assert parse_config({"install": {"sourceDir": "src/engines"}}, tmp_path).install.source_dir == (
        tmp_path / "src" / "engines"
    )
    assert parse_config({"install": {"sourceDir": None}}, tmp_path).install.source_dir == default_source_dir()


def test_catalog_lists_installed_and_not_installed_with_both_licences(tmp_path: Path) -> None:
    """
    Each record is an entry with its licences, name, default variant, Python range and
    package; installed is yes for an engine the registry has (by id, or by another id
    running its module) and no otherwise; managed is false (no API installs yet); only
    installed entries carry workerVersion and outdated.
    """
    catalog = Catalog(read_source(source(tmp_path, record("tone"), record("piper", commercial=False), record("espeak"))), "0.1.0")
    catalog.declare("tone", "rhapsode_engine_tone", venv(tmp_path, "0.1.0"))
    catalog.declare("espeak-fr", "rhapsode_engine_espeak", venv(tmp_path, "0.0.9"))
    app, worker = app_with(catalog, "tone", "espeak-fr")
    code, entries = get(app, "/catalog")
    assert code == 200
    by_id = {entry["id"]: entry for entry in entries}
    assert [entry["id"] for entry in entries] == ["espeak", "piper", "tone"]
    assert by_id["piper"] == {
        "id": "piper",
        "displayName": "Piper",
        "license": record("piper", commercial=False)["license"],
        "defaultVariant": "base",
        "python": ">=3.11",
        "package": "rhapsode-engine-piper",
        "installed": "no",
        "managed": False,
    }
    assert (by_id["tone"]["installed"], by_id["tone"]["managed"]) == ("yes", False)
    assert (by_id["tone"]["workerVersion"], by_id["tone"]["outdated"]) == ("0.1.0", False)
    assert (by_id["espeak"]["installed"], by_id["espeak"]["workerVersion"], by_id["espeak"]["outdated"]) == (
        "yes",
        "0.0.9",
        True,
    )
    assert worker.requests == []


def test_engine_summaries_carry_the_declared_version(tmp_path: Path) -> None:
    """
    GET /engines and /health show workerVersion and outdated on an engine whose
    version was read, and neither on one without, without asking any worker.
    """
    catalog = Catalog([], "0.1.0")
    catalog.declare("tone", "rhapsode_engine_tone", venv(tmp_path, "0.0.1"))
    catalog.declare("bare", "rhapsode_engine_tone", venv(tmp_path, None))
    app, worker = app_with(catalog, "tone", "bare")
    engines = {e["id"]: e for e in get(app, "/engines")[1]}
    assert (engines["tone"]["workerVersion"], engines["tone"]["outdated"]) == ("0.0.1", True)
    assert "workerVersion" not in engines["bare"] and "outdated" not in engines["bare"]
    health = {e["id"]: e for e in get(app, "/health")[1]["engines"]}
    assert health["tone"]["outdated"] is True and "outdated" not in health["bare"]
    assert worker.requests == []


def test_a_core_without_a_catalog_lists_nothing() -> None:
    """
    A Core built without one (an embedder's) answers GET /catalog with [] and adds
    no version to its summaries.
    """
    app, _ = app_with(Catalog([], "0.1.0"), "tone")
    bare = build_core(app.registry, reactor=MemoryReactorClock())
    assert get(bare, "/catalog") == (200, [])
    [summary] = get(bare, "/engines")[1]
    assert "workerVersion" not in summary


def test_the_catalog_answers_a_caller_the_guard_would_refuse() -> None:
    """
    GET /catalog is no management route: a caller on another machine without a token
    gets the catalog, where it would get 403 on a management route.
    """
    assert not any(path == "/catalog" for _, path in MANAGEMENT)
    catalog = Catalog([record("tone")], rhapsode.__version__)
    app = build_core(Registry({}), reactor=MemoryReactorClock(), catalog=catalog, management_token="t" * 32)
    channel = app.site().buildProtocol(IPv4Address("TCP", "127.0.0.1", 8080))
    transport = StringTransport(peerAddress=IPv4Address("TCP", "203.0.113.9", 40000))
    channel.makeConnection(transport)
    channel.dataReceived(b"GET /catalog HTTP/1.1\r\nHost: box.example\r\nOrigin: https://elsewhere.example\r\n\r\n")
    head, _, body = transport.value().partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b'"id": "tone"' in body and b'"installed": "no"' in body


def test_the_service_declares_each_engine_with_its_version(tmp_path: Path) -> None:
    """
    The service reads install.sourceDir's records and declares every configured engine
    as it builds: a local one's version from its python's virtualenv, a remote one's
    absent; the app's catalog and summaries show them.
    """
    config = parse_config(
        {
            "workers": {"socketDir": "sock", "voiceDir": "voices"},
            "install": {"sourceDir": str(source(tmp_path, record("tone"), record("kokoro")))},
            "engines": {
                "tone": {"module": "rhapsode_engine_tone", "python": venv(tmp_path, "0.0.1")},
                "far": {"url": "http://127.0.0.1:9"},
            },
        },
        tmp_path,
    )
    app = RhapsodeService(config, MemoryReactorClock()).build()
    assert app.catalog.versions("tone") == {"workerVersion": "0.0.1", "outdated": rhapsode.__version__ != "0.0.1"}
    assert app.catalog.versions("far") == {}
    entries = {e["id"]: e for e in app.catalog.entries()}
    assert (entries["tone"]["installed"], entries["kokoro"]["installed"]) == ("yes", "no")
