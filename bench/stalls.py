"""
What a listener hears of a long streamed answer, run by hand after `make test` has built
the engines' virtualenvs (`.venv/bin/python bench/stalls.py [--engine kokoro] [--rounds 2]`).

A core serving one engine; each round streams bench/engines.py's ~2000-character text as
pcm and replays its arrival into a player that starts at the first audio and, whenever
its buffer runs dry, waits for the next bytes: it prints the first audio, the end, the
audio's length, and every wait the player made (a stall is silence the listener hears
that the text did not ask for).  Then the same text buffered: its whole time and the
worker's CPU for it.  Each line also gives the worker's resident memory and its peak so
far (VmHWM).  Kokoro's weights are fetched into `.venvs/kokoro-cache` the first time, as
bench/side_by_side.py does.  Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
import urllib.request
from pathlib import Path

import engines as engines_bench
from _common import arrivals, cpu_seconds, played

ROOT = Path(__file__).resolve().parents[1]
TEXT = engines_bench.LONG


def memory(pid: int) -> str:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return f"worker {fields['VmRSS']:.0f} MiB, peak so far {fields['VmHWM']:.0f} MiB"


def buffered(port: int, engine: str, pid: int, text: str) -> tuple[float, float]:
    body = json.dumps({"engine": engine, "text": text, "format": "pcm", "stream": False}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/speak", data=body,
                                     headers={"Content-Type": "application/json"})
    cpu, started = cpu_seconds(pid), time.perf_counter()
    with urllib.request.urlopen(request, timeout=900) as answer:
        answer.read()
    return time.perf_counter() - started, cpu_seconds(pid) - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", default="kokoro", choices=["kokoro", "piper"])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    environ = dict(os.environ, RHAPSODE_KOKORO_CACHE=str(ROOT / ".venvs" / "kokoro-cache"))
    core, port = engines_bench.start_core(tmp / "core", [args.engine], environ)
    try:
        engines_bench.through_core(port, args.engine, "Warm up.", 1, False)
        pid = engines_bench.worker_pid(port, args.engine)
        print(f"{args.engine}, {len(TEXT)} characters; {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}")
        for round_ in range(1, args.rounds + 1):
            got, per_second = arrivals(port, args.engine, TEXT)
            waits = played([(at, size / per_second) for at, size in got])[1]
            audio = sum(size for _, size in got) / per_second
            print(f"round {round_} streamed: first audio {got[0][0]:.2f} s, last {got[-1][0]:.2f} s, "
                  f"{audio:.1f} s of audio; {len(waits)} stalls, {sum(waits):.2f} s in all "
                  f"[{', '.join(f'{w:.2f}' for w in waits)}]; {memory(pid)}")
            whole, cpu = buffered(port, args.engine, pid, TEXT)
            print(f"round {round_} buffered: {whole:.1f} s whole, the worker's CPU {cpu:.1f} s; {memory(pid)}")
    finally:
        core.terminate()
        core.wait()


if __name__ == "__main__":
    socket.setdefaulttimeout(900)
    main()
