"""
The boundaries between the distributions of this repository, as import rules: the
protocol imports neither side, the worker SDK never imports the core, the conformance
checker builds on the protocol alone, the core never imports the SDK (not even at run
time, through the protocol), and an engine adapter imports only the SDK.

Each rule is an AST scan of every module of the distribution, so a function-level or
C{TYPE_CHECKING} import counts as much as one at the top; the core's rule is checked in a
fresh interpreter too, since what matters there is what the core process loads.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Iterable

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL = ROOT / "protocol" / "src" / "rhapsode_protocol"
SDK = ROOT / "sdk" / "src" / "rhapsode_worker"
CONFORM = ROOT / "conform" / "src" / "rhapsode_conform"
CORE = ROOT / "src" / "rhapsode"
DROPINS = ROOT / "twisted" / "plugins"
ENGINES = sorted(ROOT.glob("engines/*/src"))

#: The top-level packages of this repository's distributions.
OURS = ("rhapsode", "rhapsode_protocol", "rhapsode_worker", "rhapsode_conform")


def imported(path: Path, package: str | None = None) -> list[tuple[int, str]]:
    """
    Every module C{path} imports, wherever the import stands, as (line, dotted name);
    a relative import resolved against C{package} (the module's own package).
    """
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if package is None:
                    continue
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def _package_of(path: Path, root: Path, name: str) -> str:
    relative = path.relative_to(root).with_suffix("")
    parts = [name, *relative.parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts[:-1]) if path.name != "__init__.py" else ".".join(parts)


def reaching(files: Iterable[Path], root: Path, name: str, forbidden: Iterable[str]) -> list[str]:
    """
    Every import in C{files} (modules of package C{name} under C{root}) of a module whose
    top-level package is one of C{forbidden}.
    """
    banned = set(forbidden)
    hits = []
    for path in files:
        for line, module in imported(path, _package_of(path, root, name)):
            if module.split(".")[0] in banned:
                hits.append(f"{_shown(path)}:{line} {module}")
    return sorted(set(hits), key=lambda hit: (hit.split(":")[0], int(hit.split(":")[1].split(" ")[0]), hit))


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def _modules(folder: Path) -> list[Path]:
    files = sorted(folder.rglob("*.py"))
    assert len(files) >= 3, f"no modules found under {folder}"
    return files


def test_the_protocol_imports_neither_side() -> None:
    """
    rhapsode_protocol imports nothing of the core, the SDK or the checker: both sides
    depend on it, never it on them.
    """
    assert reaching(_modules(PROTOCOL), PROTOCOL, "rhapsode_protocol", set(OURS) - {"rhapsode_protocol"}) == []


def test_the_protocol_outside_its_http_server_needs_only_the_standard_library() -> None:
    """
    Everything in the protocol but its HTTP server (http/) imports only the standard
    library and the protocol itself, so the contract can be read where nothing else is
    installed.
    """
    files = [p for p in _modules(PROTOCOL) if "http" not in p.relative_to(PROTOCOL).parts]
    allowed = set(sys.stdlib_module_names) | {"rhapsode_protocol"}
    hits = []
    for path in files:
        for line, module in imported(path, _package_of(path, PROTOCOL, "rhapsode_protocol")):
            if module.split(".")[0] not in allowed:
                hits.append(f"{path.relative_to(ROOT)}:{line} {module}")
    assert hits == []


def test_the_sdk_never_imports_the_core_or_the_checker() -> None:
    """
    rhapsode_worker builds on the protocol alone: an engine's virtualenv has no core.
    """
    assert reaching(_modules(SDK), SDK, "rhapsode_worker", {"rhapsode", "rhapsode_conform"}) == []


def test_the_checker_builds_on_the_protocol_alone() -> None:
    """
    The conformance checker is an independent client of the contract: it imports
    neither the SDK it checks nor the core.
    """
    assert reaching(_modules(CONFORM), CONFORM, "rhapsode_conform", {"rhapsode", "rhapsode_worker"}) == []


def test_the_core_never_imports_the_sdk_or_the_checker() -> None:
    """
    No module of the core, nor its twistd dropin, imports rhapsode_worker or
    rhapsode_conform, in any form.
    """
    forbidden = {"rhapsode_worker", "rhapsode_conform"}
    assert reaching(_modules(CORE), CORE, "rhapsode", forbidden) == []
    dropins = sorted(DROPINS.glob("*.py"))
    assert dropins and reaching(dropins, DROPINS, "twisted.plugins", forbidden) == []


def test_the_core_process_loads_no_module_of_the_sdk() -> None:
    """
    In a fresh interpreter, importing every module of the core (its command line and
    web page included) leaves no rhapsode_worker module loaded: what the core shares
    with its workers reaches it through the protocol alone.
    """
    names = []
    for path in _modules(CORE):
        relative = path.relative_to(CORE.parent).with_suffix("")
        parts = list(relative.parts)
        if parts[-1] == "__init__":
            parts.pop()
        names.append(".".join(parts))
    probe = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('rhapsode_worker', 'rhapsode_conform')))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("src", ENGINES, ids=[p.parent.name for p in ENGINES])
def test_an_engine_imports_only_the_sdk(src: Path) -> None:
    """
    An engine adapter reaches the project through the SDK alone (its face or its public
    modules), never the protocol underneath, the core or the checker, nor a private
    module of the SDK.
    """
    package = next(p for p in src.iterdir() if (p / "__init__.py").is_file() and p.name.startswith("rhapsode_engine_"))
    files = _modules(package)
    assert reaching(files, package, package.name, {"rhapsode", "rhapsode_protocol", "rhapsode_conform"}) == []
    private = []
    for path in files:
        for line, module in imported(path, _package_of(path, package, package.name)):
            parts = module.split(".")
            if parts[0] == "rhapsode_worker" and any(part.startswith("_") for part in parts[1:]):
                private.append(f"{path.relative_to(ROOT)}:{line} {module}")
    assert private == []


def test_the_scan_finds_each_form_of_import(tmp_path: Path) -> None:
    """
    The scans above see a plain import, a from-import, a name imported from a package,
    a relative import resolved against its package, and imports inside a function or a
    TYPE_CHECKING block, so their empty answers mean something.
    """
    package = tmp_path / "rhapsode"
    package.mkdir()
    sample = package / "_sample.py"
    sample.write_text(
        "from typing import TYPE_CHECKING\n"
        "import rhapsode_worker._encode\n"
        "from rhapsode_worker import _memory\n"
        "from .._x import y\n"
        "from ._router import CoreApp\n"
        "if TYPE_CHECKING:\n"
        "    from rhapsode_conform import run_checks\n"
        "def f():\n"
        "    from rhapsode_worker.errors import BadRequest\n"
    )
    modules = [name for _, name in imported(sample, "rhapsode")]
    assert "rhapsode_worker._encode" in modules
    assert "rhapsode_worker._memory" in modules
    assert "rhapsode._router.CoreApp" in modules
    assert "rhapsode_conform.run_checks" in modules
    assert "rhapsode_worker.errors.BadRequest" in modules
    hits = reaching([sample], package, "rhapsode", {"rhapsode_worker", "rhapsode_conform"})
    assert [hit.split(":")[1].split(" ")[0] for hit in hits] == ["2", "3", "3", "7", "7", "9", "9"]
