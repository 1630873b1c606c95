"""
An engine's catalog facts (display name, both licences, default variant), read from
the files of its installation without starting anything (protocol.md sections 4 and 9).

Each engine distribution carries a C{catalog.json} at its root.  For an engine installed
in a virtualenv (the usual case: C{python} names that virtualenv's interpreter) the
distribution's metadata says where it was installed from; for one installed beside the
core, the core's own metadata does.  Nothing is imported and no process is spawned, so
C{GET /engines} can show a down engine's licences.
"""

from __future__ import annotations

import json
import re
import sys
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _site_packages(python: str) -> list[Path]:
    """
    Where an interpreter's virtualenv keeps its packages (empty if it is no virtualenv).
    """
    bin_dir = Path(python).absolute().parent
    root = bin_dir.parent
    if not (root / "pyvenv.cfg").exists():
        return []
    return sorted(root.glob("lib/python3*/site-packages"))


def _distribution(module: str, python: str) -> Any:
    wanted = _normalise(module)
    sites = _site_packages(python)
    if sites:
        for dist in metadata.distributions(path=[str(s) for s in sites]):
            # An email.message.Message underneath; its get() takes a default, which a
            # distribution with broken metadata needs (the protocol type does not say so).
            if _normalise(dist.metadata.get("Name", "")) == wanted:  # type: ignore[attr-defined]
                return dist
        return None
    if Path(python).absolute() == Path(sys.executable).absolute():
        try:
            return metadata.distribution(wanted)
        except metadata.PackageNotFoundError:
            return None
    return None


def read_catalog(module: str, python: str) -> dict[str, Any] | None:
    """
    The catalog facts of the engine whose worker module is C{module}, installed for
    C{python}; None where they cannot be found (never a guess).
    """
    dist = _distribution(module, python)
    if dist is None:
        return None
    candidates: list[Path] = []
    direct = dist.read_text("direct_url.json")
    if direct:
        try:
            url = json.loads(direct).get("url", "")
        except ValueError:
            url = ""
        parsed = urlparse(url)
        if parsed.scheme == "file":
            candidates.append(Path(unquote(parsed.path)) / "catalog.json")
    for path in candidates:
        try:
            facts = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(facts, dict) and facts.get("module") == module:
            return facts
    return None
