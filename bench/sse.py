"""
Benchmark of mp3 over server-sent events against the raw mp3 stream, side by side in one
run, run by hand after `make engines`:

    .venv/bin/python bench/sse.py

One `rhapsode serve` with Piper (and tone); the same OpenAI speech request is sent
with and without C{stream_format: "sse"}, taking turns, each on a fresh connection.
Printed, per engine: the median time from the request's last byte to the raw stream's
first body byte, and to the first whole C{speech.audio.delta} event (what a client can
decode first), and the difference; the goal (issue 24) is within 5 ms.  Asserts
nothing.  Everything runs on this machine.
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import free_port, wait_listening

ROOT = Path(__file__).resolve().parents[1]
PIPER = ROOT / ".venvs" / "piper" / "bin" / "python"
TEXT = "The first delta should leave as soon as the first mp3 frame does. Then the rest follows."
ROUNDS = 25


def start_core(tmp: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    config = {
        "server": {"port": port, "host": "127.0.0.1"},
        "workers": {"socketDir": str(tmp / "sock"), "voiceDir": str(tmp / "voices")},
        "log": {"level": "warn"},
        "engines": {
            "piper": {"module": "rhapsode_engine_piper", "python": str(PIPER)},
            "tone": {"module": "rhapsode_engine_tone"},
        },
    }
    (tmp / "rhapsode.json").write_text(json.dumps(config))
    rhapsode = str(Path(sys.executable).parent / "rhapsode")
    process = subprocess.Popen([rhapsode, "serve", "--config", str(tmp / "rhapsode.json")],
                               stdout=open(tmp / "core.log", "wb"), stderr=subprocess.STDOUT)
    wait_listening(port, 30)
    return process, port


def first(port: int, body: dict[str, object], sse: bool) -> float:
    """
    Seconds from sending the request to the first audio a client can use: the first
    body byte of a raw stream, or the end of the first delta event.
    """
    payload = json.dumps(body).encode()
    raw = (b"POST /v1/audio/speech HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
           b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(payload)) + payload
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(raw)
        started = time.perf_counter()
        seen = b""
        while True:
            data = sock.recv(65536)
            if not data:
                raise RuntimeError(f"no audio: {seen[:300]!r}")
            seen += data
            head, found, rest = seen.partition(b"\r\n\r\n")
            if not found:
                continue
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(head.decode())
            if not sse and rest:
                at = time.perf_counter()
                break
            if sse and b"speech.audio.delta" in rest and b"\n\n" in rest.split(b"speech.audio.delta", 1)[1]:
                at = time.perf_counter()
                break
        while sock.recv(65536):
            pass  # the rest of the answer, so the next request finds the engine idle
    return at - started


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        core, port = start_core(Path(folder))
        try:
            for model in ("piper", "tone"):
                body = {"model": model, "input": TEXT}
                for _ in range(3):
                    first(port, body, False)  # the load, and the first run's costs
                raw, sse = [], []
                for _ in range(ROUNDS):
                    raw.append(first(port, body, False))
                    sse.append(first(port, {**body, "stream_format": "sse"}, True))
                r, s = statistics.median(raw), statistics.median(sse)
                diffs = sorted(b - a for a, b in zip(raw, sse))
                print(f"{model:6} mp3: raw first byte {r * 1000:7.1f} ms, SSE first delta {s * 1000:7.1f} ms, "
                      f"difference median {statistics.median(diffs) * 1000:+.1f} ms "
                      f"(p10 {diffs[len(diffs) // 10] * 1000:+.1f}, p90 {diffs[len(diffs) * 9 // 10] * 1000:+.1f}) "
                      f"over {ROUNDS} pairs")
        finally:
            core.terminate()
            core.wait(20)


if __name__ == "__main__":
    main()
