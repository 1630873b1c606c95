"""
docs/writing-an-engine.md, run as written: its adapter, __main__.py and catalog.json (in
the package, where the guide puts it), with a stand-in for the author's library, serve as
a real worker and declare what the catalog says; the catalog is found the way the core
finds one, through the engine folder's link, and is what the adapter took its facts from;
its config entry is a valid config naming the same module.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
import pytest_twisted

from rhapsode._fleet.catalog import read_catalog
from rhapsode.service import parse_config

from _worker import ROOT, Worker, spawn_worker

GUIDE = ROOT / "docs" / "writing-an-engine.md"
MODULE = "rhapsode_engine_mine"
SOURCES = "# engines/mine/src/"
TESTS = "# engines/mine/tests/"

#: What the guide calls my_tts: a model that hums for a twentieth of a second a character.
STAND_IN = '''
import math
import random
import struct
from typing import Iterator


class Model:
    def generate(self, text: str, voice: str, seed: int | None, speed: float) -> Iterator[bytes]:
        pitch = 180 + random.Random(seed).randrange(60)
        frames = int(24000 * 0.05 * len(text) / speed)
        yield b"".join(
            struct.pack("<h", int(8000 * math.sin(2 * math.pi * pitch * i / 24000))) for i in range(frames)
        )


def load(variant: str) -> Model:
    return Model()
'''


def blocks(language: str) -> list[str]:
    """The guide's fenced code blocks in C{language}, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```", GUIDE.read_text(), re.S | re.M)


def json_block(holding: str) -> Any:
    (found,) = [json.loads(b) for b in blocks("json") if f'"{holding}"' in b]
    return found


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """
    The guide's Python files where their first lines say, and its catalog.json in the
    package, under a folder that also holds the stand-in library and the metadata an
    install of rhapsode-engine-mine leaves (the adapter's version comes from it).
    """
    root = tmp_path_factory.mktemp("guide")
    written = []
    for block in blocks("python"):
        first = block.splitlines()[0]
        for prefix, folder in ((SOURCES, root), (TESTS, root / "tests")):
            if first.startswith(prefix):
                path = folder / first[len(prefix):]
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(block)
                written.append(path.relative_to(root).as_posix())
    assert written == [f"{MODULE}/__init__.py", f"{MODULE}/__main__.py", "tests/test_mine.py"]
    (root / MODULE / "catalog.json").write_text(json.dumps(json_block("displayName")))
    info = root / "rhapsode_engine_mine-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rhapsode-engine-mine\nVersion: 0.1.0\n")
    (root / "my_tts.py").write_text(STAND_IN)
    return root


@pytest_twisted.async_yield_fixture(scope="module")
async def mine(package: Path) -> AsyncIterator[Worker]:
    from twisted.internet import reactor

    worker = await spawn_worker(
        reactor, package, module=MODULE, engine="mine", extra_env={"PYTHONPATH": str(package)}
    )
    yield worker
    await worker.stop()


def adapter(package: Path) -> Any:
    sys.path.insert(0, str(package))
    try:
        import rhapsode_engine_mine

        return rhapsode_engine_mine.MyEngine()
    finally:
        sys.path.remove(str(package))
        for name in [MODULE, "my_tts"]:
            sys.modules.pop(name, None)


@pytest_twisted.ensureDeferred
async def test_the_guides_engine_serves_what_it_declares(mine: Worker) -> None:
    """
    The guide's adapter, run by its __main__.py, shakes hands as engine "mine" and
    declares its name, both licences and adapter version (from its catalog.json and its
    distribution), its variant's cues, dial, language, segmenting and seeding, and the
    native format.
    """
    assert mine.handshake["engine"] == "mine"
    code, caps = await mine.json("GET", "/capabilities")
    assert code == 200
    assert caps["engine"]["id"] == "mine" and caps["engine"]["adapterVersion"] == "0.1.0"
    assert caps["engine"]["displayName"] == "My Engine" and caps["defaultVariant"] == "base"
    assert caps["license"] == {
        "code": "MIT",
        "weights": "Apache-2.0",
        "weightsCommercialUse": True,
        "notes": "phonemes via espeak-ng would make this GPL-3.0-or-later",
    }
    base = caps["variants"]["base"]
    assert base["cues"] == ["laugh", "sigh"] and base["languages"] == ["en"]
    assert base["dials"] == {"speed": {"min": 0.5, "max": 2.0, "default": 1.0}}
    assert base["segmentation"]["segmentCharacters"] == 200
    assert base["segmentation"]["firstSegmentCharacters"] == 60
    assert base["seeding"] == {"reproducible": True}
    assert caps["nativeFormat"]["sampleRate"] == 24000


@pytest_twisted.ensureDeferred
async def test_the_guides_voice_is_listed_with_every_field(mine: Worker) -> None:
    """
    The guide's complete Voice comes out of GET /voices with each field it set.
    """
    code, voices = await mine.json("GET", "/voices")
    assert code == 200
    (ada,) = voices
    assert {k: ada[k] for k in ("id", "label", "spec", "description", "tags", "builtin")} == {
        "id": "ada",
        "label": "Ada",
        "spec": "ada@base-1",
        "description": "A calm narrator, recorded for this engine.",
        "tags": ["female", "en"],
        "builtin": True,
    }


@pytest_twisted.ensureDeferred
async def test_the_guides_engine_speaks(mine: Worker) -> None:
    """
    /speak loads the guide's variant and returns its PCM as a wav of the stated length.
    """
    response = await mine.http.request(
        "POST",
        mine.url("/speak"),
        json={"text": "Hello from the guide.", "voice": "ada", "format": "wav", "stream": False},
    )
    body = await response.content()
    assert response.code == 200, body[:300]
    assert body[:4] == b"RIFF"
    (rate,) = struct.unpack("<I", body[24:28])
    assert rate == 24000 and len(body) > 44 + 2 * 24000 // 2


def test_the_guides_own_test_passes_under_the_harness(package: Path, tmp_path: Path) -> None:
    """
    The test the guide shows for the adapter, run by pytest as the author would run it,
    passes: the guide's engine under rhapsode_worker.testing answers what that test says.
    """
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(package),
         "--basetemp", str(tmp_path / "pytest"), str(package / "tests" / "test_mine.py")],
        cwd=package, env={**os.environ, "PYTHONPATH": str(package)}, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "1 passed" in run.stdout


def test_the_guides_catalog_is_found_as_the_core_finds_one(package: Path, tmp_path: Path) -> None:
    """
    The guide's catalog.json, in the package with a link to it beside the engine's
    setup.cfg, is what read_catalog finds for an engine installed from that folder into
    its own virtualenv; the adapter's name, licences and default variant are the
    catalog's.
    """
    project = tmp_path / "engines" / "mine"
    (project / "src" / MODULE).mkdir(parents=True)
    catalog = json_block("displayName")
    (project / "src" / MODULE / "catalog.json").write_text(json.dumps(catalog))
    (project / "catalog.json").symlink_to(Path("src") / MODULE / "catalog.json")
    # What `pip install -e engines/mine` leaves in .venvs/mine.
    venv = tmp_path / ".venvs" / "mine"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    info = venv / "lib" / "python3.11" / "site-packages" / "rhapsode_engine_mine-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rhapsode-engine-mine\nVersion: 0.1.0\n")
    (info / "direct_url.json").write_text(json.dumps({"url": project.as_uri(), "dir_info": {"editable": True}}))
    assert read_catalog(MODULE, str(venv / "bin" / "python")) == catalog
    engine = adapter(package)
    assert catalog["displayName"] == engine.display_name and catalog["defaultVariant"] == engine.default_variant
    assert catalog["license"] == {
        "code": engine.license.code,
        "weights": engine.license.weights,
        "weightsCommercialUse": engine.license.weights_commercial_use,
        "notes": engine.license.notes,
    }


def test_the_guides_config_entry_is_a_config(tmp_path: Path) -> None:
    """
    The guide's config is accepted as it stands and names the catalog's module, with
    its interpreter taken from the config file's folder.
    """
    config = parse_config(json_block("engines"), tmp_path)
    engine = config.engines["mine"]
    assert engine.module == json_block("displayName")["module"] == MODULE
    assert engine.python == str(tmp_path / ".venvs" / "mine" / "bin" / "python")
