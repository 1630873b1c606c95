"""
Where random-weight checkpoints are kept once built: outside the tree, under
C{$XDG_CACHE_HOME/rhapsode/test-weights} (else C{~/.cache/...}), in a folder named by a
digest of everything the checkpoint depends on (the builder's source, the libraries'
versions, the size asked for), so a change to any of them builds anew and a rerun reuses.

Standard library only: the builders run in an engine's virtualenv, the tests in the core's.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Mapping, Sequence

#: The commit a built checkpoint is served at by the test hub: fixed per folder.
COMMIT_FILE = "commit"


def cache_root(environ: Mapping[str, str] | None = None) -> Path:
    environ = os.environ if environ is None else environ
    if environ.get("RHAPSODE_TEST_WEIGHTS"):
        return Path(environ["RHAPSODE_TEST_WEIGHTS"])
    base = Path(environ["XDG_CACHE_HOME"]) if environ.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "rhapsode" / "test-weights"


def key(name: str, builder: Path, distributions: Sequence[str], size: str) -> str:
    digest = hashlib.sha256(builder.read_bytes())
    for dist in distributions:
        try:
            digest.update(f"{dist}=={version(dist)}\n".encode())
        except PackageNotFoundError:
            digest.update(f"{dist} absent\n".encode())
    digest.update(size.encode())
    return f"{name}-{size}-{digest.hexdigest()[:16]}"


def done(folder: Path) -> bool:
    return (folder / COMMIT_FILE).is_file()


def finish(scratch: Path, folder: Path, info: dict[str, object]) -> None:
    """
    Give a built folder its commit and manifest, and move it into place whole.
    """
    commit = hashlib.sha1(folder.name.encode()).hexdigest()
    (scratch / COMMIT_FILE).write_text(commit)
    (scratch / "build.json").write_text(json.dumps(info, indent=1))
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(scratch, folder)
    # Older builds of the same engine and size (another builder, other versions) are
    # gigabytes each and never read again.
    stem = folder.name.rsplit("-", 1)[0]
    for old in folder.parent.glob(f"{stem}-*"):
        if old != folder and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
