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


#: The core's modules that import Ray: they run in a cluster's Ray processes only.
RAY_MODULES = {"rhapsode._cluster.router", "rhapsode._cluster.deployment", "rhapsode._cluster.directory"}


def test_only_the_cluster_modules_import_ray() -> None:
    """
    Ray is the cluster extra, never the core's dependency: no module but the cluster
    deployment, its directory and its router imports it, in any form (the cluster commands import it
    when they run, inside a function).
    """
    hits = []
    for path in _modules(CORE):
        module = _core_module(path)
        if module in RAY_MODULES:
            continue
        for line, name in imported(path, _package_of(path, CORE, "rhapsode")):
            if name.split(".")[0] == "ray" and not _inside_function(path, line):
                hits.append(f"{module}:{line} {name}")
    assert hits == []


def _inside_function(path: Path, line: int) -> bool:
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.lineno <= line <= (node.end_lineno or 0):
            return True
    return False


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
        name = ".".join(parts)
        if name in RAY_MODULES:
            continue  # Ray's, which run only in a cluster's processes (the cluster extra)
        names.append(name)
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


# -- inside the core: its wings, floor by floor ---------------------------------------------

#: Each part of the core and its floor; a module belongs to the longest prefix that
#: names it.  A wing may import its own modules and the floors below its own, never one
#: above, and never a sibling on its floor (the faces and the composition root, on the
#: top floor, may use one another).
FLOORS: dict[str, int] = {
    "rhapsode._interfaces": 0,
    "rhapsode._guard": 1,
    "rhapsode._ports": 1,
    "rhapsode._upstream": 1,
    "rhapsode._client": 1,
    "rhapsode._config": 2,
    "rhapsode._fleet": 3,
    "rhapsode._speech": 4,
    "rhapsode._manage": 4,
    "rhapsode._http": 5,
    # The doors: the native routes, the translations, and management's routes.
    "rhapsode._http.router": 6,
    "rhapsode._doors": 6,
    "rhapsode._manage.routes": 6,
    # The faces, the roots and the other programs.
    "rhapsode._service": 7,
    "rhapsode._tap": 7,
    "rhapsode._cli": 7,
    "rhapsode._cluster": 7,
    "rhapsode._web": 7,
    "rhapsode.client": 7,
    "rhapsode.service": 7,
    "rhapsode.testing": 7,
    "rhapsode": 7,
}
TOP = max(FLOORS.values())
DOORS = ("rhapsode._http.router", "rhapsode._doors", "rhapsode._manage.routes")


def part_of(module: str) -> str:
    """
    The part (a key of L{FLOORS}) that C{module} belongs to.
    """
    found = [part for part in FLOORS if module == part or module.startswith(part + ".")]
    assert found, f"{module} is in no part of the core: add it to FLOORS"
    return max(found, key=len)


def _core_module(path: Path) -> str:
    relative = path.relative_to(CORE.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def core_imports(root: Path | None = None, package: str = "rhapsode") -> dict[str, set[tuple[int, str]]]:
    """
    Every module of the core (or of C{package} under C{root}) and the modules of the
    same package it imports, wherever the import stands (a name imported from a package
    is taken as the package, unless it is a module of it).
    """
    root = CORE if root is None else root
    modules = {}
    for path in _modules(root):
        relative = path.relative_to(root).with_suffix("")
        parts = [package, *relative.parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    found: dict[str, set[tuple[int, str]]] = {}
    for name, path in modules.items():
        targets = set()
        for line, module in _statement_imports(path, _package_of(path, root, package), set(modules)):
            if module.split(".")[0] != package:
                continue
            while module not in modules and "." in module:
                module = module.rsplit(".", 1)[0]
            if module in modules and module != name:
                targets.add((line, module))
        found[name] = targets
    return found


def _statement_imports(path: Path, package: str, modules: set[str]) -> list[tuple[int, str]]:
    """
    What each import statement of C{path} depends on: for C{from P import X}, the
    submodule P.X where X is one, else P itself (importing P.X runs P's C{__init__} in
    any case, which is no circle of the code's making).
    """
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                found.append((node.lineno, sub if sub in modules else module))
    return found


def upward(graph: dict[str, set[tuple[int, str]]]) -> list[str]:
    """
    Every import that points up a floor, or across to a sibling on the same floor below
    the top.
    """
    hits = []
    for source, targets in graph.items():
        mine = part_of(source)
        for line, target in targets:
            theirs = part_of(target)
            if theirs == mine or mine.startswith(theirs + ".") and FLOORS[theirs] < FLOORS[mine]:
                continue
            if FLOORS[theirs] < FLOORS[mine] or FLOORS[mine] == TOP == FLOORS[theirs]:
                continue
            hits.append(f"{source}:{line} -> {target} (floor {FLOORS[mine]} -> {FLOORS[theirs]})")
    return sorted(hits)


def circles(graph: dict[str, set[tuple[int, str]]]) -> list[list[str]]:
    """
    The import circles among the modules of C{graph} (each strongly connected set of
    more than one module), found by Tarjan's algorithm.
    """
    edges = {source: sorted({target for _, target in targets}) for source, targets in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on.add(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_every_module_of_the_core_belongs_to_a_part() -> None:
    """
    No module of the core stands outside the floor plan: a new one is placed in it.
    """
    for name in core_imports():
        part_of(name)


@pytest.mark.parametrize(
    ("root", "package"),
    [(CORE, "rhapsode"), (PROTOCOL, "rhapsode_protocol"), (SDK, "rhapsode_worker"), (CONFORM, "rhapsode_conform")],
    ids=["core", "protocol", "sdk", "conform"],
)
def test_no_package_has_an_import_circle(root: Path, package: str) -> None:
    """
    No set of a package's modules imports one another round in a circle, counting
    function-level and TYPE_CHECKING imports.
    """
    assert circles(core_imports(root, package)) == []


def test_the_wings_import_downward_only() -> None:
    """
    No module imports a part on a higher floor, or a sibling part on its own floor
    (function-level and TYPE_CHECKING imports included).
    """
    assert upward(core_imports()) == []


def test_no_door_imports_another_door() -> None:
    """
    The native routes, the doors and management's routes never import one another:
    each gets what it needs as an interface from the composition root.
    """
    graph = core_imports()
    hits = []
    for source, targets in graph.items():
        if not source.startswith(DOORS):
            continue
        for line, target in targets:
            if target.startswith(DOORS) and target != source:
                hits.append(f"{source}:{line} -> {target}")
    assert hits == []


def test_the_floor_checks_find_what_they_look_for() -> None:
    """
    The circle finder sees a circle of three, and the floor check an import up a floor
    and one across a floor, so their empty answers mean something.
    """
    graph = {
        "rhapsode._fleet.registry": {(1, "rhapsode._speech.relay")},
        "rhapsode._speech.relay": {(2, "rhapsode._speech.metrics")},
        "rhapsode._speech.metrics": {(3, "rhapsode._fleet.registry")},
        "rhapsode._manage.jobs": {(4, "rhapsode._speech.limits")},
        "rhapsode._speech.limits": set(),
        "rhapsode._doors.mcp": {(5, "rhapsode._http.router")},
        "rhapsode._http.router": set(),
    }
    assert circles(graph) == [["rhapsode._fleet.registry", "rhapsode._speech.metrics", "rhapsode._speech.relay"]]
    assert upward(graph) == [
        "rhapsode._doors.mcp:5 -> rhapsode._http.router (floor 6 -> 6)",
        "rhapsode._fleet.registry:1 -> rhapsode._speech.relay (floor 3 -> 4)",
        "rhapsode._manage.jobs:4 -> rhapsode._speech.limits (floor 4 -> 4)",
    ]


def constructions(path: Path) -> list[str]:
    """
    The classes of another part of the core that the constructors in C{path} build.
    """
    module = _core_module(path)
    mine = part_of(module)
    package = _package_of(path, CORE, "rhapsode")
    tree = ast.parse(path.read_text(encoding="utf-8"))
    foreign: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1])
            source = f"{base}.{node.module}" if node.module else base
            if part_of(source) != mine:
                foreign.update({alias.asname or alias.name: source for alias in node.names})
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            for call in ast.walk(node):
                if (
                    isinstance(call, ast.Call)
                    and isinstance(call.func, ast.Name)
                    and call.func.id in foreign
                    and call.func.id[:1].isupper()
                ):
                    hits.append(f"{module}:{call.lineno} builds {call.func.id} of {foreign[call.func.id]}")
    return hits


def test_only_the_composition_root_builds_another_parts_objects() -> None:
    """
    Below the top floor no constructor builds an object of another part of the core: it
    is given its collaborators, and the composition root (rhapsode._service.build_core)
    builds and wires them.
    """
    files = [p for p in _modules(CORE) if FLOORS[part_of(_core_module(p))] < TOP]
    assert [hit for path in files for hit in constructions(path)] == []


def test_the_construction_check_sees_a_constructor_building_a_collaborator(tmp_path: Path) -> None:
    """
    A constructor in the speech wing that builds the fleet's Registry is found.
    """
    package = tmp_path / "rhapsode" / "_speech"
    package.mkdir(parents=True)
    sample = package / "sample.py"
    sample.write_text(
        "from .._fleet.registry import Registry\n"
        "class Thing:\n"
        "    def __init__(self):\n"
        "        self.registry = Registry({})\n"
    )
    global CORE
    saved, CORE = CORE, tmp_path / "rhapsode"
    try:
        assert constructions(sample) == ["rhapsode._speech.sample:4 builds Registry of rhapsode._fleet.registry"]
    finally:
        CORE = saved
