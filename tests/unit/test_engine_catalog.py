"""
An engine's catalog.json is package data its Engine reads: one file per engine, inside
its package (the engine folder's catalog.json, which the core reads from a checkout, is
a link to it, so the two cannot drift), built into the distribution, and the source of
the adapter's id, display name, licences, default variant and adapter version.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Iterator

import pytest

from rhapsode_worker import Engine, License
from rhapsode_worker._engine import CATALOGUED, CatalogError, catalog_facts

ROOT = Path(__file__).resolve().parents[2]
ENGINES = sorted(p.parent.name for p in ROOT.glob("engines/*/setup.cfg"))


def package_of(engine: str) -> Path:
    return ROOT / "engines" / engine / "src" / f"rhapsode_engine_{engine}"


@pytest.mark.parametrize("engine", ENGINES)
def test_the_engine_folder_record_is_a_link_to_the_package_one(engine: str) -> None:
    """
    engines/<id>/catalog.json, where the core reads an engine's record from a checkout,
    is a relative link to the one file in the package: there is no second copy to keep
    in step.
    """
    folder_record = ROOT / "engines" / engine / "catalog.json"
    packaged = package_of(engine) / "catalog.json"
    assert folder_record.is_symlink() and not packaged.is_symlink()
    assert not os.path.isabs(os.readlink(folder_record))
    assert folder_record.resolve() == packaged.resolve()
    record = json.loads(packaged.read_text(encoding="utf-8"))
    assert record["id"] == engine and record["module"] == f"rhapsode_engine_{engine}"


@pytest.mark.parametrize("engine", ENGINES)
def test_the_built_distribution_ships_the_record(engine: str, tmp_path: Path) -> None:
    """
    setuptools' build of the engine (what goes into its wheel) puts catalog.json in the
    package, byte for byte the record the core reads from the checkout; built from a
    copy, so nothing is written into the tree.
    """
    source = tmp_path / "source"
    shutil.copytree(ROOT / "engines" / engine, source, symlinks=True,
                    ignore=shutil.ignore_patterns("*.egg-info", "build", "__pycache__"))
    built = tmp_path / "built"
    result = subprocess.run(
        [sys.executable, "-c", "from setuptools import setup; setup()", "-q", "build_py", "--build-lib", str(built)],
        cwd=source, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    shipped = built / f"rhapsode_engine_{engine}" / "catalog.json"
    assert shipped.read_bytes() == (ROOT / "engines" / engine / "catalog.json").read_bytes()


def test_the_tone_engine_takes_its_facts_from_its_record() -> None:
    """
    ToneEngine has each catalogued fact as its record says, its adapter version being
    its installed distribution's.
    """
    from importlib.metadata import version

    from rhapsode_engine_tone import ToneEngine

    record = json.loads((package_of("tone") / "catalog.json").read_text(encoding="utf-8"))
    assert (ToneEngine.id, ToneEngine.display_name, ToneEngine.default_variant) == (
        record["id"], record["displayName"], record["defaultVariant"],
    )
    assert ToneEngine.license == License(
        code=record["license"]["code"],
        weights=record["license"]["weights"],
        weights_commercial_use=record["license"]["weightsCommercialUse"],
        notes=record["license"]["notes"],
    )
    assert ToneEngine.adapter_version == version(record["distribution"])


@pytest.mark.parametrize("engine", ENGINES)
def test_no_adapter_restates_its_record(engine: str) -> None:
    """
    No adapter module assigns a catalogued fact, builds a License or looks its own
    version up: the record says them once (read without importing the engine, whose
    libraries this interpreter lacks).
    """
    hits = []
    for path in sorted(package_of(engine).glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(isinstance(b, ast.Name) and b.id == "Engine" for b in node.bases):
                for statement in node.body:
                    targets = statement.targets if isinstance(statement, ast.Assign) else (
                        [statement.target] if isinstance(statement, ast.AnnAssign) else []
                    )
                    hits += [f"{path.name}:{statement.lineno} {t.id}" for t in targets
                             if isinstance(t, ast.Name) and t.id in CATALOGUED]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "License":
                hits.append(f"{path.name}:{node.lineno} License(...)")
            if isinstance(node, ast.Constant) and node.value == f"rhapsode-engine-{engine}":
                hits.append(f"{path.name}:{node.lineno} its own distribution's name")
    assert hits == []


# -- the reading itself, on packages written here -----------------------------------------


RECORD: dict[str, Any] = {
    "id": "scratch",
    "displayName": "Scratch",
    "module": "rhapsode_engine_scratch",
    "distribution": "rhapsode-engine-scratch",
    "license": {"code": "MIT", "weights": "CC0-1.0", "weightsCommercialUse": True, "notes": "made here"},
    "defaultVariant": "only",
    "python": ">=3.11",
}


@pytest.fixture()
def scratch(tmp_path: Path) -> Iterator[Path]:
    """
    A folder on sys.path for an adapter package, with the distribution's metadata as an
    install leaves it (version 2.3.4); the package and its modules are forgotten after.
    """
    info = tmp_path / "rhapsode_engine_scratch-2.3.4.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rhapsode-engine-scratch\nVersion: 2.3.4\n")
    sys.path.insert(0, str(tmp_path))
    try:
        yield tmp_path
    finally:
        sys.path.remove(str(tmp_path))
        for name in [n for n in sys.modules if n.split(".")[0] == "rhapsode_engine_scratch"]:
            del sys.modules[name]


def write_package(root: Path, record: Any, body: str = "") -> None:
    package = root / "rhapsode_engine_scratch"
    package.mkdir()
    if record is not None:
        text = record if isinstance(record, str) else json.dumps(record)
        (package / "catalog.json").write_text(text)
    (package / "__init__.py").write_text("from ._engine import ScratchEngine\n")
    (package / "_engine.py").write_text(
        "from rhapsode_worker import Engine, License\n\n\n"
        "class ScratchEngine(Engine):\n"
        + (textwrap.indent(textwrap.dedent(body), "    ") if body.strip() else "    pass\n")
    )


def load_scratch() -> Any:
    import importlib

    return importlib.import_module("rhapsode_engine_scratch").ScratchEngine


def test_an_engine_in_a_package_with_a_record_takes_every_fact_from_it(scratch: Path) -> None:
    """
    id, display name, licences, default variant and the adapter version (the named
    distribution's installed one) come from the package's catalog.json.
    """
    write_package(scratch, RECORD)
    engine = load_scratch()
    assert engine.id == "scratch" and engine.display_name == "Scratch" and engine.default_variant == "only"
    assert engine.license == License(code="MIT", weights="CC0-1.0", weights_commercial_use=True, notes="made here")
    assert engine.adapter_version == "2.3.4"
    assert catalog_facts("rhapsode_engine_scratch") == {
        "id": "scratch",
        "display_name": "Scratch",
        "license": engine.license,
        "default_variant": "only",
        "adapter_version": "2.3.4",
    }


def test_notes_may_be_left_out(scratch: Path) -> None:
    """
    A record without licence notes gives empty notes, as License's default.
    """
    record = json.loads(json.dumps(RECORD))
    del record["license"]["notes"]
    write_package(scratch, record)
    assert load_scratch().license.notes == ""


@pytest.mark.parametrize("name", CATALOGUED)
def test_a_fact_said_twice_is_refused(scratch: Path, name: str) -> None:
    """
    A class in a package with a record may not set a catalogued fact itself: it is
    refused as the class is made, naming the fact, so the two can never disagree.
    """
    values = {
        "id": '"other"',
        "display_name": '"Other"',
        "license": 'License(code="MIT", weights="MIT", weights_commercial_use=True)',
        "default_variant": '"other"',
        "adapter_version": '"9.9.9"',
    }
    write_package(scratch, RECORD, f"{name} = {values[name]}\n")
    with pytest.raises(CatalogError, match=f"ScratchEngine sets {name}, which its package's catalog.json gives"):
        load_scratch()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r.pop("displayName"), '"displayName", a non-empty string'),
        (lambda r: r.update(id=""), '"id", a non-empty string'),
        (lambda r: r["license"].pop("weights"), '"license.weights", a non-empty string'),
        (lambda r: r["license"].update(weightsCommercialUse="yes"), '"license.weightsCommercialUse", true or false'),
        (lambda r: r["license"].update(notes=3), '"license.notes" that is not a string'),
        (lambda r: r.update(license="MIT"), '"license.weightsCommercialUse", true or false'),
        (lambda r: r.update(module="rhapsode_engine_other"), 'names module "rhapsode_engine_other"'),
        (lambda r: r.update(distribution="rhapsode-engine-absent"), '"rhapsode-engine-absent", which is not installed'),
    ],
)
def test_a_record_that_cannot_give_the_facts_is_refused_naming_the_field(
    scratch: Path, change: Any, message: str
) -> None:
    """
    A record missing a fact, with one of the wrong type, naming another module, or
    naming a distribution that is not installed is refused as the class is made, with
    the file and the field in the message.
    """
    record = json.loads(json.dumps(RECORD))
    change(record)
    write_package(scratch, record)
    with pytest.raises(CatalogError, match="rhapsode_engine_scratch/catalog.json") as raised:
        load_scratch()
    assert message in str(raised.value)


def test_a_record_that_is_not_json_is_refused(scratch: Path) -> None:
    """
    A catalog.json that does not parse is refused naming the file.
    """
    write_package(scratch, "{not json")
    with pytest.raises(CatalogError, match="rhapsode_engine_scratch/catalog.json cannot be read"):
        load_scratch()


def test_an_engine_without_a_record_keeps_what_it_says(scratch: Path) -> None:
    """
    A package that ships no catalog.json (or a class outside any package, as a test's)
    keeps the facts its class sets and the defaults for the rest.
    """
    write_package(scratch, None, 'id = "bare"\n')
    engine = load_scratch()
    assert engine.id == "bare" and engine.default_variant == Engine.default_variant
    assert engine.license == Engine.license
    assert catalog_facts("rhapsode_engine_scratch") is None

    class Local(Engine):
        display_name = "Local"

    assert Local.display_name == "Local" and Local.id == ""


def test_a_subclass_of_an_adapter_inherits_its_facts(scratch: Path) -> None:
    """
    A subclass in the same package (a variant of the adapter) takes the same facts and
    may not restate them either; one elsewhere inherits them and may override them.
    """
    write_package(scratch, RECORD)
    (scratch / "rhapsode_engine_scratch" / "_more.py").write_text(
        "from ._engine import ScratchEngine\n\n\nclass Louder(ScratchEngine):\n    joint_silence_ms = 5\n"
    )
    import importlib

    louder = importlib.import_module("rhapsode_engine_scratch._more").Louder
    assert louder.id == "scratch" and louder.adapter_version == "2.3.4"
    parent = load_scratch()

    class Renamed(parent):  # type: ignore[misc, valid-type]
        display_name = "Renamed"

    assert Renamed.display_name == "Renamed" and Renamed.license == parent.license


def test_an_upstream_distribution_gives_the_upstream_version(scratch: Path) -> None:
    """
    upstream_distribution names the upstream library's distribution; its installed
    version becomes upstream_version, and one not installed is refused by name.
    """
    write_package(scratch, RECORD, 'upstream_distribution = "rhapsode-engine-scratch"\n')
    assert load_scratch().upstream_version == "2.3.4"

    with pytest.raises(CatalogError, match='upstream "rhapsode-engine-absent" is not installed'):

        class Missing(Engine):
            upstream_distribution = "rhapsode-engine-absent"
