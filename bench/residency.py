"""
Benchmark of residency, run by hand (`.venv/bin/python bench/residency.py`): what a
switch between two engines costs against a warm request, side by side.

A core (`rhapsode serve`) with maxResidentModels 1 and two engines: tone under two ids by
default, or any two configured engines given as arguments with their interpreters
(`bench/residency.py tone:.venv/bin/python espeak:.venvs/espeak/bin/python`).  Alternating
between them makes every request a switch: the other engine's worker is terminated and
this one's is spawned and loaded.  Repeating one engine is the warm case.  Prints time
to first byte for each; asserts nothing.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import free_port, request_bytes, tcp, timed, wait_listening

SENTENCE = "The quick brown fox jumps over the lazy dog."




def first_byte(port: int, engine: str) -> float:
    return timed(tcp(port), request_bytes("/speak", {"engine": engine, "text": SENTENCE, "format": "pcm"}))[0]


def main(argv: list[str]) -> None:
    pairs = [a.split(":", 1) for a in argv] or [["tone", sys.executable], ["tone", sys.executable]]
    engines = {}
    for i, (engine, python) in enumerate(pairs):
        engines[f"{engine}{i}"] = {"module": f"rhapsode_engine_{engine}", "python": str(Path(python).absolute())}
    a, b = list(engines)
    tmp = Path(tempfile.mkdtemp())
    port = free_port()
    config = {
        "server": {"port": port},
        "log": {"level": "error"},
        "residency": {"maxResidentModels": 1},
        "workers": {"socketDir": str(tmp / "sock"), "voiceDir": str(tmp / "voices")},
        "engines": engines,
    }
    (tmp / "core.json").write_text(json.dumps(config))
    rhapsode = str(Path(sys.executable).parent / "rhapsode")
    core = subprocess.Popen([rhapsode, "serve", "--config", str(tmp / "core.json")], stdout=subprocess.DEVNULL)
    try:
        wait_listening(port)
        first_byte(port, a)
        warm = [first_byte(port, a) for _ in range(20)]
        switches = []
        for i in range(10):
            switches.append(first_byte(port, b if i % 2 == 0 else a))
        print(f"engines {a} and {b}, maxResidentModels 1, one sentence, pcm, streamed")
        print(f"  warm request      TTFB p50 {statistics.median(warm) * 1e3:8.1f} ms  max {max(warm) * 1e3:8.1f} ms  (20)")
        print(
            f"  after a switch    TTFB p50 {statistics.median(switches) * 1e3:8.1f} ms  max {max(switches) * 1e3:8.1f} ms  (10)"
            "  (terminate the other worker, spawn, handshake, load, speak)"
        )
    finally:
        core.terminate()
        core.wait(30)


if __name__ == "__main__":
    main(sys.argv[1:])
