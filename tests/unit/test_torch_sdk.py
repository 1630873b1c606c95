"""
The SDK's pieces for torch engines that need no torch: the device the spawn contract
names, the test hub's routes and headers (what huggingface_hub reads), the clip store,
and the install recipes the engines' catalog records carry.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from array import array
from pathlib import Path

import pytest
from treq.testing import StubTreq

from rhapsode_worker import UnknownVoice, Unsupported
from rhapsode_worker.audioref import Clip
from rhapsode_worker.clips import ClipStore
from rhapsode_worker.devices import DEVICE_VARIABLE, Released, configured_device
from rhapsode_worker.fakehub import FakeHub, FakeRepo, write_manifest

from _deferreds import result_of

ROOT = Path(__file__).resolve().parents[2]
COMMIT = "ab" * 20


def _engine_venv():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("engine_venv", ROOT / "tools" / "engine_venv.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["engine_venv"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("raw, device", [("", None), ("auto", None), ("cpu", "cpu"), ("MPS", "mps"),
                                          ("cuda", "cuda"), ("cuda:3", "cuda:3")])
def test_the_device_the_spawn_contract_names(raw: str, device: str | None) -> None:
    """cpu, mps, cuda and cuda:N are read as given; unset or auto leaves it to the worker."""
    assert configured_device({DEVICE_VARIABLE: raw}) == device


@pytest.mark.parametrize("raw", ["gpu", "cuda:", "cuda:x", "cuda:0:1", "rocm"])
def test_a_malformed_device_is_refused(raw: str) -> None:
    """Anything else is an error naming the variable, never a silent CPU."""
    with pytest.raises(ValueError, match=DEVICE_VARIABLE):
        configured_device({DEVICE_VARIABLE: raw})


def test_released_counts_what_stayed_beyond_the_baseline() -> None:
    """An unload's figure is what is in use beyond the load's baseline, never negative."""
    assert Released(before=900, after=120, baseline=100).left == 20
    assert Released(before=900, after=80, baseline=100).left == 0
    assert Released(before=None, after=None, baseline=100).left is None


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    folder = tmp_path / "repo"
    folder.mkdir()
    (folder / "config.json").write_text('{"a": 1}')
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 40)
    return folder


def hub_client(repo: Path, token: str | None = None) -> tuple[FakeHub, StubTreq]:
    hub = FakeHub(token=token)
    hub.add(FakeRepo.from_folder("owner/name", COMMIT, repo))
    return hub, StubTreq(hub.resource())


def test_the_hub_resolves_a_branch_and_lists_its_tree(repo: Path) -> None:
    """
    The revision route answers the commit a branch names and its files; the tree gives
    each file's git blob id and size, and a weights file its LFS SHA-256.
    """
    hub, client = hub_client(repo)
    response = result_of(client.get("http://hub/api/models/owner/name/revision/main"))
    doc = json.loads(result_of(response.content()))
    assert doc["sha"] == COMMIT and sorted(s["rfilename"] for s in doc["siblings"]) == ["config.json", "model.safetensors"]
    tree = json.loads(result_of((result_of(client.get(f"http://hub/api/models/owner/name/tree/{COMMIT}?recursive=true"))).content()))
    entries = {e["path"]: e for e in tree}
    data = (repo / "model.safetensors").read_bytes()
    assert entries["model.safetensors"]["lfs"]["oid"] == hashlib.sha256(data).hexdigest()
    config = (repo / "config.json").read_bytes()
    assert entries["config.json"]["oid"] == hashlib.sha1(b"blob %d\0" % len(config) + config).hexdigest()
    assert "lfs" not in entries["config.json"]


def test_the_hub_serves_files_with_the_headers_the_client_reads(repo: Path) -> None:
    """
    HEAD and GET carry the commit, the etag (the LFS SHA-256 for weights), the size;
    a Range is answered 206 from its offset, and recorded.
    """
    hub, client = hub_client(repo)
    url = f"http://hub/owner/name/resolve/{COMMIT}/model.safetensors"
    head = result_of(client.head(url))
    data = (repo / "model.safetensors").read_bytes()
    assert head.code == 200
    assert head.headers.getRawHeaders("x-repo-commit") == [COMMIT]
    assert head.headers.getRawHeaders("x-linked-etag") == [f'"{hashlib.sha256(data).hexdigest()}"']
    assert head.headers.getRawHeaders("x-linked-size") == [str(len(data))]
    part = result_of(client.get(url, headers={"Range": "bytes=1000-"}))
    assert part.code == 206
    assert result_of(part.content()) == data[1000:]
    assert part.headers.getRawHeaders("content-range") == [f"bytes 1000-{len(data) - 1}/{len(data)}"]
    assert hub.ranges[-1] == ("model.safetensors", "bytes=1000-")


def test_the_hub_refuses_as_the_hub_does(repo: Path) -> None:
    """
    An unknown repository, revision or file is 404 with the hub's error code, and a hub
    with a token refuses a request without it.
    """
    hub, client = hub_client(repo)
    for url, code in [("http://hub/api/models/owner/other/revision/main", "RepoNotFound"),
                      ("http://hub/api/models/owner/name/revision/nope", "RevisionNotFound"),
                      (f"http://hub/owner/name/resolve/{COMMIT}/missing.bin", "EntryNotFound")]:
        response = result_of(client.get(url))
        assert (response.code, response.headers.getRawHeaders("x-error-code")) == (404, [code])
    _, guarded = hub_client(repo, token="secret")
    assert result_of(guarded.get("http://hub/api/models/owner/name/revision/main")).code == 401
    ok = result_of(guarded.get("http://hub/api/models/owner/name/revision/main",
                               headers={"Authorization": "Bearer secret"}))
    assert ok.code == 200


def test_the_manifest_spares_hashing_again(repo: Path) -> None:
    """A manifest that matches the files is what the hub reads its hashes from."""
    manifest = write_manifest(repo)
    entry = manifest["files"]["model.safetensors"]
    again = FakeRepo.from_folder("owner/name", COMMIT, repo)
    assert again.files["model.safetensors"].sha256 == entry["sha256"]
    assert ".hub-manifest.json" not in again.files


def test_a_clip_store_keeps_clips_and_transcripts(tmp_path: Path) -> None:
    """
    A clone is its clip and transcript; re-recording changes its spec; built-in ids are
    refused; a deleted or unknown voice is unknown_voice.
    """
    store = ClipStore(tmp_path / "voices", frozenset({"default"}))
    voice = store.save("host", "Host", Clip(array("f", [0.1, -0.2, 0.3]), 24000), "host.wav", "Hi.")
    assert voice.id == "host" and not voice.builtin and "cloned" in voice.tags
    stored = store.get("host")
    assert list(stored.samples()) == pytest.approx([0.1, -0.2, 0.3]) and stored.transcript == "Hi."
    other = store.save("host", "Host", Clip(array("f", [0.1, -0.2, 0.3]), 24000), "host.wav", "Hello.")
    assert other.spec != voice.spec
    assert [v.id for v in store.created()] == ["host"]
    with pytest.raises(Unsupported):
        store.save("default", "D", Clip(array("f", [0.1]), 24000), "d.wav", None)
    store.delete("host")
    with pytest.raises(UnknownVoice):
        store.get("host")


def test_the_cpu_recipes_never_name_a_torch_a_pin_would_replace() -> None:
    """
    Each torch engine's CPU recipe installs torch 2.13.0 first, and every step after it
    that could resolve torch runs --no-deps or names no package that pins torch; the
    placeholders expand to the SDK and the adapter.
    """
    engine_venv = _engine_venv()
    for engine in ("chatterbox", "dia"):
        record = json.loads((ROOT / "engines" / engine / "catalog.json").read_text())
        steps = engine_venv.steps(record, "cpu", ["SDK"], ["ADAPTER"])
        assert steps[0] == ["torch==2.13.0"]
        assert any("SDK" in s for s in steps)
        assert any("ADAPTER" in s for s in steps)
        for step in steps[1:]:
            assert not any(arg.startswith("torch") and arg != "torchaudio==2.11.1" for arg in step), step
            if "chatterbox-tts==0.1.7" in step or "torchaudio==2.11.1" in step or (engine == "chatterbox" and "ADAPTER" in step):
                assert "--no-deps" in step, step
    plain = engine_venv.steps({"id": "tone"}, "cpu", ["SDK"], ["ADAPTER"])
    assert plain == [["SDK", "ADAPTER"]]
    with pytest.raises(ValueError, match="no install recipe"):
        engine_venv.steps({"id": "x", "install": {"cuda": []}}, "cpu", [], [])
