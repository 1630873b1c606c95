"""
Four ~400-character Kokoro requests at once, measured in turns against another build.

Run by hand after `make test` has built the Kokoro virtualenv and fetched its weights:

    .venv/bin/python bench/burst.py [--against DIR] [--rounds N]

Each round starts a fresh core (`rhapsode serve`) with Kokoro alone, warms it, sends the
same four streamed requests at once and prints every first byte and the time until all
four ended.  With `--against DIR` (a source tree of another commit, e.g. made with
`git worktree add DIR COMMIT`), every round is run twice, once by this checkout and once
by that tree's core, worker SDK, shared protocol and Kokoro adapter (put first on
PYTHONPATH, so the same virtualenvs run the other code), taking turns, so that a box
whose speed drifts slows both alike.  `--sequential` also times the four one after another.  Asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

import engines
from _common import request_bytes, tcp, timed
from engines import PARAGRAPH, concurrent_firsts


def start_core(tmp: Path, source: Path | None) -> tuple[subprocess.Popen[bytes], int]:
    """
    A core serving Kokoro only, from this checkout or from C{source}.
    """
    environ = dict(os.environ)
    if source is not None:
        # The worker inherits the core's environment, so both run the other tree's code.
        environ["PYTHONPATH"] = os.pathsep.join(
            str(source / part) for part in ("src", "sdk/src", "protocol/src", "engines/kokoro/src")
        )
    return engines.start_core(tmp, ["kokoro"], environ)


def burst(label: str, source: Path | None, sequential: bool) -> None:
    core, port = start_core(Path(tempfile.mkdtemp()), source)
    try:
        timed(tcp(port), request_bytes("/speak", {"engine": "kokoro", "text": "Warm up.", "format": "pcm"}))
        firsts, together = concurrent_firsts(port, "kokoro", PARAGRAPH, 4)
        line = f"{label:8s} first bytes {', '.join(f'{f:.2f}' for f in firsts)} s; all four {together:.1f} s"
        if sequential:
            serial = sum(
                timed(tcp(port), request_bytes("/speak", {"engine": "kokoro", "text": PARAGRAPH, "format": "pcm"}))[1]
                for _ in range(4)
            )
            line += f"; one after another {serial:.1f} s"
        print(line, flush=True)
    finally:
        core.terminate()
        core.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--against", type=Path, metavar="DIR", help="another source tree to take turns with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sequential", action="store_true", help="also the four one after another")
    args = parser.parse_args()
    for i in range(args.rounds):
        sides: list[tuple[str, Path | None]] = [("this", None)]
        if args.against is not None:
            sides.append(("against", args.against.resolve()))
        for label, source in sides if i % 2 == 0 else reversed(sides):
            burst(label, source, args.sequential)
            time.sleep(1.0)


if __name__ == "__main__":
    main()
