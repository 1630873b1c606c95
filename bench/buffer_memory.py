"""
The core's peak memory under the two answers a caller can pin (issue 23, section 1): a
32-item batch of 4,096-character items on tone, and forty concurrent C{"stream": false}
4,096-character C{/speak} requests whose clients read nothing for a while.

Run by hand once `make venv` has built the core's virtualenv:

    .venv/bin/python bench/buffer_memory.py [--budget BYTES] [--idle SECONDS] [--count N] [batch|speak ...]

Each scenario starts a fresh core (`rhapsode serve`) serving tone alone, warms it with one
short request, then runs; it prints the core's resident set before and its peak (the
kernel's VmHWM, which no sampling can miss) after, with what the clients were answered.
Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from _common import free_port, wait_listening

TEXT = ("The quick brown fox jumps over the lazy dog while the band plays on. " * 80)[:4096]


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise LookupError(field)


def start_core(tmp: Path, budget: int | None) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    config: dict[str, Any] = {
        "server": {"port": port, "host": "127.0.0.1", "shutdownGraceMs": 1000},
        "workers": {"socketDir": str(tmp / "sock"), "voiceDir": str(tmp / "voices")},
        "engines": {"tone": {"module": "rhapsode_engine_tone"}},
    }
    if budget is not None:
        config["limits"] = {"bufferedBytes": budget}
    path = tmp / "rhapsode.json"
    path.write_text(json.dumps(config))
    rhapsode = str(Path(sys.executable).parent / "rhapsode")
    log = open(tmp / "core.log", "wb")
    core = subprocess.Popen([rhapsode, "serve", "--config", str(path)], cwd=tmp, stdout=log, stderr=subprocess.STDOUT)
    wait_listening(port)
    return core, port


def post(port: int, path: str, payload: dict[str, Any]) -> socket.socket:
    body = json.dumps(payload).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        b"POST %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(body), body)
    )
    return sock


def read_all(sock: socket.socket) -> bytes:
    sock.settimeout(600)
    pieces = []
    while True:
        piece = sock.recv(1 << 20)
        if not piece:
            return b"".join(pieces)
        pieces.append(piece)


def body_of(answer: bytes) -> bytes:
    head, _, body = answer.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" not in head.lower():
        return body
    pieces = []
    while True:
        size, _, body = body.partition(b"\r\n")
        length = int(size, 16)
        if not length:
            return b"".join(pieces)
        pieces.append(body[:length])
        body = body[length + 2 :]


def status_of(answer: bytes) -> str:
    line = answer.split(b"\r\n", 1)[0]
    return line.decode("latin-1", "replace")[9:12] or "none"


def warm(port: int) -> None:
    answer = read_all(post(port, "/speak", {"engine": "tone", "text": "Warm up.", "stream": False}))
    assert status_of(answer) == "200", answer[:200]


def batch(port: int, idle: float, items: int = 32) -> str:
    items = [{"input": TEXT} for _ in range(items)]
    sock = post(port, "/v1/audio/speech/batch", {"model": "tone", "items": items, "response_format": "wav"})
    answer = read_all(sock)
    body = body_of(answer)
    outcome = f"HTTP {status_of(answer)}, {len(body) / 1e6:.1f} MB of JSON"
    if status_of(answer) == "200":
        document = json.loads(body)
        outcome += f", {document['succeeded']} of {document['total']} items spoken"
    else:
        outcome += f": {body[:160].decode('utf-8', 'replace')}"
    return outcome


def speak(port: int, idle: float, items: int = 40) -> str:
    socks = [post(port, "/speak", {"engine": "tone", "text": TEXT, "stream": False}) for _ in range(items)]
    time.sleep(idle)  # nobody reads
    answers: list[bytes] = [b""] * len(socks)

    def drain(i: int) -> None:
        answers[i] = read_all(socks[i])

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(len(socks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    statuses = Counter(status_of(a) for a in answers)
    sizes = sorted({len(body_of(a)) for a in answers if status_of(a) == "200"})
    return f"statuses {dict(statuses)}, 200 bodies {sizes[:1]} B" if sizes else f"statuses {dict(statuses)}"


SCENARIOS = {"batch": batch, "speak": speak}


def run(name: str, budget: int | None, idle: float, count: int | None) -> None:
    with tempfile.TemporaryDirectory() as folder:
        core, port = start_core(Path(folder), budget)
        try:
            warm(port)
            before = status_kib(core.pid, "VmRSS")
            outcome = SCENARIOS[name](port, idle) if count is None else SCENARIOS[name](port, idle, count)
            peak = status_kib(core.pid, "VmHWM")
            print(f"{name}: core {before / 1024:.0f} MB before, peak {peak / 1024:.0f} MB; {outcome}", flush=True)
        finally:
            core.terminate()
            core.wait(30)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenarios", nargs="*", help="batch, speak (default: both)")
    parser.add_argument("--budget", type=int, default=None, help="limits.bufferedBytes (default: the core's)")
    parser.add_argument("--idle", type=float, default=20.0, help="how long the /speak clients read nothing")
    parser.add_argument("--count", type=int, default=None, help="items in the batch (32), or /speak clients (40)")
    args = parser.parse_args(argv)
    for name in args.scenarios or list(SCENARIOS):
        if name not in SCENARIOS:
            parser.error(f"no scenario {name!r}")
        run(name, args.budget, args.idle, args.count)


if __name__ == "__main__":
    main()
