"""
Reading an engine's catalog facts from its installation, with nothing started.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rhapsode._fleet.catalog import read_catalog

FACTS = {
    "id": "fake",
    "displayName": "Fake",
    "module": "rhapsode_engine_fake",
    "license": {"code": "MIT", "weights": "CC0-1.0", "weightsCommercialUse": True, "notes": ""},
    "defaultVariant": "base",
}


def fake_venv(tmp_path: Path, editable: bool = True, facts: dict = FACTS) -> Path:
    """
    A virtualenv's files as pip leaves them for an editable install of an engine.
    """
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    info = venv / "lib" / "python3.11" / "site-packages" / "rhapsode_engine_fake-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rhapsode-engine-fake\nVersion: 0.1.0\n")
    source = tmp_path / "engines" / "fake"
    source.mkdir(parents=True)
    (source / "catalog.json").write_text(json.dumps(facts))
    if editable:
        (info / "direct_url.json").write_text(
            json.dumps({"url": source.as_uri(), "dir_info": {"editable": True}})
        )
    return venv / "bin" / "python"


def test_catalog_read_from_an_engine_virtualenv(tmp_path: Path) -> None:
    """
    The engine's own virtualenv says where it was installed from, and the catalog is
    read from there.
    """
    assert read_catalog("rhapsode_engine_fake", str(fake_venv(tmp_path))) == FACTS


def test_catalog_beside_the_core() -> None:
    """
    An engine installed in the core's own environment (tone, in the test venv) is found
    through the core's metadata.
    """
    facts = read_catalog("rhapsode_engine_tone", sys.executable)
    assert facts is not None and facts["license"]["code"] == "MIT"


def test_unknown_or_unreadable_is_absent_never_guessed(tmp_path: Path) -> None:
    """
    No distribution, no source location, or a catalog for another module: nothing.
    """
    python = fake_venv(tmp_path, editable=False)
    assert read_catalog("rhapsode_engine_fake", str(python)) is None
    assert read_catalog("rhapsode_engine_missing", str(python)) is None
    other = tmp_path / "other"
    other.mkdir()
    assert read_catalog("rhapsode_engine_fake", str(fake_venv(other, facts={**FACTS, "module": "x"}))) is None
    assert read_catalog("rhapsode_engine_fake", "/usr/bin/python3-not-a-venv") is None


def test_catalog_read_from_the_package_a_wheel_installed(tmp_path: Path) -> None:
    """
    An engine installed from a wheel (an index's, with no folder to point back to) is
    found by the catalog.json its package ships, as its RECORD lists it; one whose
    package ships none is still absent.
    """
    python = fake_venv(tmp_path, editable=False)
    site = python.parents[1] / "lib" / "python3.11" / "site-packages"
    (site / "rhapsode_engine_fake").mkdir()
    (site / "rhapsode_engine_fake" / "catalog.json").write_text(json.dumps(FACTS))
    record = site / "rhapsode_engine_fake-0.1.0.dist-info" / "RECORD"
    record.write_text("rhapsode_engine_fake/__init__.py,,\nrhapsode_engine_fake/catalog.json,,\n")
    assert read_catalog("rhapsode_engine_fake", str(python)) == FACTS
    record.write_text("rhapsode_engine_fake/__init__.py,,\n")
    assert read_catalog("rhapsode_engine_fake", str(python)) is None
