"""
The catalog (protocol.md sections 4, 9 and 10): every engine that exists, from the
records the core ships, and what this box has of each.

Each engine distribution carries a C{catalog.json} at its root: display name, both
licences, default variant, distribution name and the Python range it installs on.
L{read_catalog} finds an installed engine's record through its distribution's metadata;
L{read_source} reads every record under C{install.sourceDir}, installed or not, which is
what C{GET /catalog} lists.  L{worker_version} reads the C{rhapsode-worker} distribution's
version from an engine's virtualenv (section 9's C{workerVersion}).  Nothing is imported
and no process is spawned, so all of it answers for an engine that is down.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable, Mapping

from .._config import source_of

#: The distribution an engine's virtualenv gets the worker SDK from; its version there
#: is the engine's workerVersion (protocol.md section 9).
SDK_DISTRIBUTION = "rhapsode-worker"


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


def _in_venv(name: str, sites: list[Path]) -> Any:
    # A lookup by name reads only the matching metadata folders: about 0.2 ms against
    # 4 ms for scanning every distribution in an engine's virtualenv.
    wanted = _normalise(name)
    for dist in metadata.distributions(name=name, path=[str(s) for s in sites]):
        # An email.message.Message underneath; its get() takes a default, which a
        # distribution with broken metadata needs (the protocol type does not say so).
        if _normalise(dist.metadata.get("Name", "")) == wanted:  # type: ignore[attr-defined]
            return dist
    return None


def _distribution(module: str, python: str) -> Any:
    sites = _site_packages(python)
    if sites:
        return _in_venv(module, sites)
    if Path(python).absolute() == Path(sys.executable).absolute():
        try:
            return metadata.distribution(_normalise(module))
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
    # The package's own file, as a wheel installs it (from an index or a folder); an
    # editable install lists no package files, and its folder holds the record.
    shipped = f"{module}/catalog.json"
    places = [dist.locate_file(f) for f in dist.files or () if str(f).replace("\\", "/") == shipped]
    source = source_of(dist)
    if source is not None:
        places.append(source / "catalog.json")
    for place in places:
        facts = _record(Path(str(place)))
        if facts is not None and facts.get("module") == module:
            return facts
    return None


def _record(path: Path) -> dict[str, Any] | None:
    try:
        facts = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return facts if isinstance(facts, dict) else None


def worker_version(python: str | None) -> str | None:
    """
    The version of the worker SDK's distribution installed in the virtualenv of
    C{python}, read from its metadata; None where there is no virtualenv to read (a
    remote engine, an interpreter outside one) or the metadata says nothing.
    """
    if python is None:
        return None
    sites = _site_packages(python)
    if not sites:
        return None
    dist = _in_venv(SDK_DISTRIBUTION, sites)
    version = dist.version if dist is not None else None
    return version if isinstance(version, str) and version else None


def read_source(source_dir: Path | None) -> list[dict[str, Any]]:
    """
    Every catalog record under C{source_dir} (C{<id>/catalog.json}), in id order; a
    file that is not a record with an id and a module is skipped.
    """
    if source_dir is None:
        return []
    records = []
    for path in sorted(source_dir.glob("*/catalog.json")):
        record = _record(path)
        if record is not None and isinstance(record.get("id"), str) and isinstance(record.get("module"), str):
            records.append(record)
    return sorted(records, key=lambda record: str(record["id"]))


@dataclass(frozen=True)
class Declared:
    """
    What the core learned of one configured engine when it was declared.

    @ivar module: the worker module it spawns; None for a remote engine.
    @ivar worker_version: section 9's C{workerVersion}; None where absent.
    """

    engine_id: str
    module: str | None
    worker_version: str | None


class Catalog:
    """
    The records the core ships and the engines this box has, joined as C{GET /catalog}
    and section 9's fields show them.  Versions are read once, as each engine is
    declared (L{declare}), never per request.

    @param records: the catalog records (L{read_source}).
    @param core_version: this core's own version, which each C{workerVersion} is
        compared with.
    """

    def __init__(self, records: Iterable[Mapping[str, Any]], core_version: str) -> None:
        self.records = [dict(record) for record in records]
        self.core_version = core_version
        self._declared: dict[str, Declared] = {}
        #: The engines an install through the API recorded (section 10's C{managed}).
        self.managed: set[str] = set()
        #: The engines an install job is queued or running for.
        self.installing: set[str] = set()

    def declare(self, engine_id: str, module: str | None, python: str | None) -> Declared:
        """
        Record a configured engine: a local one's C{workerVersion} is read from the
        virtualenv of its C{python} now.
        """
        declared = Declared(engine_id, module, worker_version(python) if module is not None else None)
        self._declared[engine_id] = declared
        return declared

    def forget(self, engine_id: str) -> None:
        """
        The engine has left the registry (an uninstall, or a reinstall about to declare
        it again).
        """
        self._declared.pop(engine_id, None)

    def versions(self, engine_id: str) -> dict[str, Any]:
        """
        An engine summary's C{workerVersion} and C{outdated}, or nothing where the
        version is absent (protocol.md section 9: absent, never guessed).
        """
        declared = self._declared.get(engine_id)
        if declared is None or declared.worker_version is None:
            return {}
        return {
            "workerVersion": declared.worker_version,
            "outdated": declared.worker_version != self.core_version,
        }

    def _installed_as(self, record: Mapping[str, Any]) -> Declared | None:
        # The configured engine of the record's id, else the first that runs its module
        # (an operator may name an engine otherwise, e.g. two "tone-a" and "tone-b").
        by_id = self._declared.get(record["id"])
        if by_id is not None:
            return by_id
        for declared in self._declared.values():
            if declared.module == record["module"]:
                return declared
        return None

    def entries(self) -> list[dict[str, Any]]:
        """
        The C{GET /catalog} document: one entry per record, installed or not.
        """
        entries = []
        for record in self.records:
            entry: dict[str, Any] = {"id": record["id"]}
            for key in ("displayName", "license", "defaultVariant", "python"):
                if key in record:
                    entry[key] = record[key]
            if "distribution" in record:
                entry["package"] = record["distribution"]
            installed = self._installed_as(record)
            if installed is not None:
                entry["installed"] = "yes"
            elif record["id"] in self.installing:
                entry["installed"] = "installing"
            else:
                entry["installed"] = "no"
            # Only engines an install through the API recorded are managed; one the
            # operator configured is installed, and theirs.
            entry["managed"] = installed is not None and installed.engine_id in self.managed
            if installed is not None:
                entry.update(self.versions(installed.engine_id))
            entries.append(entry)
        return entries
