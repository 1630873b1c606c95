"""
Four requests at once on one engine: when each caller has its audio, and what each
listener hears.  Run by hand after `make test` has built the engine's virtualenv:

    .venv/bin/python bench/together.py [--engine piper] [--against DIR] [--rounds N]

Each round starts a fresh core (`rhapsode serve`) with the engine alone, warms it, then
sends the same ~400-character text four times at once, streamed (raw pcm), and again
buffered (a whole WAV each).  Streamed, a listener is a player that starts at the first
audio and waits whenever the next has not come.  Printed per side: medians over every
request of the time to the first audio, to the end of the answer (streamed: its last
audio), and (streamed) to the end of what the listener hears; and the listener's waits
mid-speech, added up.

With `--against DIR` (a source tree of another commit, e.g. made with `git worktree add
DIR COMMIT`), every round is run twice, by this checkout and by that tree's core, worker
SDK, shared protocol and adapter (first on PYTHONPATH, so the same virtualenvs run the
other code), taking turns, so that a box whose speed drifts slows both alike.
Asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, TypeVar

import engines
from _common import SETTLE_SECONDS, arrivals, played, request_bytes, tcp, timed
from engines import PARAGRAPH

_T = TypeVar("_T")
#: What each streamed request gives: seconds to first audio, to its last audio, to the
#: end of what its listener hears, and the listener's waits after the first audio.
Streamed = tuple[float, float, float, float]


def streamed(port: int, engine: str, text: str) -> Streamed:
    """
    One streamed pcm request, read as it comes, and what its listener hears.
    """
    got, per_second = arrivals(port, engine, text)
    heard, waits = played([(at, size / per_second) for at, size in got])
    return got[0][0], got[-1][0], heard, sum(waits)


def at_once(n: int, call: Callable[[], _T]) -> list[_T]:
    """
    C{call} made C{n} times at once, each on a thread of its own: their results.
    """
    results: list[_T | None] = [None] * n

    def one(i: int) -> None:
        results[i] = call()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [result for result in results if result is not None]


def side(engine: str, source: Path | None, text: str) -> tuple[list[Streamed], list[tuple[float, float, int]]]:
    environ = dict(os.environ)
    if source is not None:
        # The worker inherits the core's environment, so both run the other tree's code.
        environ["PYTHONPATH"] = os.pathsep.join(
            str(source / part) for part in ("src", "sdk/src", "protocol/src", f"engines/{engine}/src")
        )
    core, port = engines.start_core(Path(tempfile.mkdtemp()), [engine], environ)
    try:
        for _ in range(2):
            timed(tcp(port), request_bytes("/speak", {"engine": engine, "text": text, "format": "pcm"}))
        time.sleep(SETTLE_SECONDS)
        live = at_once(4, lambda: streamed(port, engine, text))
        time.sleep(SETTLE_SECONDS)
        whole = at_once(4, lambda: timed(tcp(port), request_bytes(
            "/speak", {"engine": engine, "text": text, "format": "wav", "stream": False})))
        return live, whole
    finally:
        core.terminate()
        core.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", default="piper")
    parser.add_argument("--against", type=Path, metavar="DIR", help="another source tree to take turns with")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sides: list[tuple[str, Path | None]] = [("this", None)]
    if args.against is not None:
        sides.append(("against", args.against.resolve()))
    results: dict[str, tuple[list[Streamed], list[tuple[float, float, int]]]] = {name: ([], []) for name, _ in sides}
    for i in range(args.rounds):
        for name, source in sides if i % 2 == 0 else list(reversed(sides)):
            live, whole = side(args.engine, source, PARAGRAPH)
            results[name][0].extend(live)
            results[name][1].extend(whole)
            print(f"round {i + 1} {name:8s} streamed ends "
                  f"{', '.join(f'{r[1]:.2f}' for r in sorted(live, key=lambda r: r[1]))} s; "
                  f"buffered ends {', '.join(f'{r[1]:.2f}' for r in sorted(whole, key=lambda r: r[1]))} s",
                  flush=True)
            time.sleep(1.0)
    print(f"\n{args.engine}, four ~400-character requests at once, {args.rounds} rounds, medians over every request;"
          f" {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}")
    print(f"{'side':8s} | streamed: first audio   end   heard to the end   waits (sum) | buffered: end")
    for name, (live, whole) in results.items():
        print(f"{name:8s} | {statistics.median(r[0] for r in live):20.2f} {statistics.median(r[1] for r in live):5.2f}"
              f" {statistics.median(r[2] for r in live):18.2f} {sum(r[3] for r in live):13.2f} |"
              f" {statistics.median(r[1] for r in whole):13.2f}")


if __name__ == "__main__":
    main()
