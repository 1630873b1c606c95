"""
The code type-checks: mypy, strict as configured in setup.cfg, with the zope plugin,
over the core, the worker SDK, every engine adapter and the twistd dropin.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mypy_finds_no_errors(tmp_path: Path) -> None:
    """
    mypy reports no error in src/, engines/*/src and twisted/plugins (strict, except
    calls into untyped third-party code), so an annotation that lies fails the suite.
    """
    targets = ["src/rhapsode", "protocol/src/rhapsode_protocol", "sdk/src/rhapsode_worker"]
    targets += ["conform/src/rhapsode_conform", "twisted/plugins"]
    targets += sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("engines/*/src"))
    assert len(targets) > 3, "no engine adapters found"
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"), *targets],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no issues found" in result.stdout
