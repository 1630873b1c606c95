"""
The boundary between the core and the SDK: the core reads only what the SDK makes
public for both sides (the taxonomy, the vocabulary, the contract, the shared HTTP
helpers), never one of its private modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "src" / "rhapsode"


def _private_imports(path: Path, root: Path = ROOT) -> list[str]:
    """
    Every import in C{path} that reaches a private module of rhapsode_worker.
    """
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "rhapsode_worker" and any(part.startswith("_") for part in parts[1:]):
                found.append(f"{path.relative_to(root)}:{node.lineno} {name}")
    return found


def test_the_core_imports_no_private_module_of_the_sdk() -> None:
    """
    No module of the core imports rhapsode_worker._anything, or a private name from a
    public one (as `from rhapsode_worker import _memory` would).
    """
    files = sorted(CORE.rglob("*.py"))
    assert len(files) > 10
    found = [hit for path in files for hit in _private_imports(path)]
    assert found == []


def test_the_check_finds_a_private_import(tmp_path: Path) -> None:
    """
    The scan above sees each form of reaching into the SDK's privates, so its empty
    answer means something.
    """
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import rhapsode_worker._encode\n"
        "from rhapsode_worker._errors import BadRequest\n"
        "from rhapsode_worker import _memory\n"
        "from rhapsode_worker.errors import BadRequest\n"
        "from rhapsode_worker import contract\n"
    )
    found = _private_imports(sample, tmp_path)
    assert [hit.split(" ", 1)[1] for hit in found] == [
        "rhapsode_worker._encode",
        "rhapsode_worker._errors",
        "rhapsode_worker._errors.BadRequest",
        "rhapsode_worker._memory",
    ]
