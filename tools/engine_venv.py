"""
Install an engine into a virtualenv by its catalog record's recipe for this kind of box:
the Makefile's engine virtualenvs (.venvs/<id>) are built with it, so the tests run the
recipe a user's install runs.

An engine's catalog.json may carry C{install}: for each kind of box (C{cuda}, C{cpu}) a
list of pip install argument lists, run in order with the virtualenv's pip.  Two
placeholders stand for what the installer supplies: C{{sdk}}, the SDK's sources (the
protocol's and the SDK's folders of a checkout, editable here), and C{{adapter}}, the
adapter (its folder here).  A record without C{install} gets one step, the SDK and the
adapter together, as the installer has always done.

    python tools/engine_venv.py ENGINE VENV [--box cpu|cuda]

The box defaults to C{cuda} where the kernel lists an NVIDIA card
(C{/proc/driver/nvidia/gpus}) and C{cpu} otherwise.  Prints each step and its time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent


def detect_box() -> str:
    gpus = Path("/proc/driver/nvidia/gpus")
    return "cuda" if gpus.is_dir() and any(gpus.iterdir()) else "cpu"


def steps(record: dict[str, Any], box: str, sdk: Sequence[str], adapter: Sequence[str]) -> list[list[str]]:
    """
    The pip argument lists of C{record}'s recipe for C{box}, placeholders expanded.

    @raise ValueError: the record has a recipe, but none for this box.
    """
    recipes = record.get("install")
    if recipes is None:
        return [[*sdk, *adapter]]
    if box not in recipes:
        raise ValueError(f"{record['id']} has no install recipe for a {box} box (it has {', '.join(recipes)})")
    expanded = []
    for step in recipes[box]:
        args: list[str] = []
        for arg in step:
            args.extend(sdk if arg == "{sdk}" else adapter if arg == "{adapter}" else [arg])
        expanded.append(args)
    return expanded


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="engine_venv.py")
    parser.add_argument("engine")
    parser.add_argument("venv", type=Path)
    parser.add_argument("--box", choices=("cpu", "cuda"), default=None)
    args = parser.parse_args(argv)
    record = json.loads((ROOT / "engines" / args.engine / "catalog.json").read_text())
    box = args.box or detect_box()
    python = str(args.venv / "bin" / "python")
    sdk = ["-e", str(ROOT / "protocol"), "-e", str(ROOT / "sdk")]
    adapter = ["-e", str(ROOT / "engines" / args.engine)]
    began = time.monotonic()
    for number, step in enumerate(steps(record, box, sdk, adapter), start=1):
        started = time.monotonic()
        command = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *step]
        print(f"[{args.engine} {box} step {number}] pip install {' '.join(step)}", flush=True)
        result = subprocess.run(command)
        if result.returncode != 0:
            print(f"[{args.engine}] step {number} failed (exit {result.returncode})", file=sys.stderr)
            return result.returncode
        print(f"[{args.engine} {box} step {number}] {time.monotonic() - started:.1f} s", flush=True)
    print(f"[{args.engine}] installed for a {box} box in {time.monotonic() - began:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
