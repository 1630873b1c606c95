"""
Benchmark of the core as a proxy, run by hand (`.venv/bin/python bench/proxy.py`).

One tone worker, reached two ways in the same run: directly over its Unix socket, and
through a core (`rhapsode serve`, a separate process) that has it configured by URL.
Prints, side by side: time to first byte over 500 requests each (p50/p99 and the core's
overhead; then again with a second worker on TCP behind a second core, so that the
client's leg is TCP on both sides and the difference is the core alone), the core's
CPU time per one-sentence request, streamed throughput through the core as a ratio
of direct, and N concurrent realtime streams
(24 kHz 16-bit, read at 48 KB/s by paced clients) with the core's CPU, peak RSS and
failures.  Asserts nothing.

Everything runs on this one machine: the clients, the core and the worker share its
cores, so the figures are what this box does, not what the core alone would.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from _common import KeptAlive, cpu_seconds, free_port, percentile, request_bytes, start_worker, tcp, timed, unix, wait_listening

RATE_BYTES = 48_000  # 24 kHz, 16-bit mono: one second of audio
SENTENCE = "The quick brown fox jumps over the lazy dog, then rests."
LONG = " ".join([SENTENCE] * 80)[:4000]
STREAM_TEXT = "A ten second sentence of speech, long enough to read at realtime for a while."


def start_core(tmp: Path, worker_url: str) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    config = {
        "server": {"port": port, "host": "127.0.0.1"},
        "log": {"level": "error"},
        "workers": {"socketDir": str(tmp / "sock"), "voiceDir": str(tmp / "voices")},
        # Thousands of realtime streams at once on one engine: far past the defaults,
        # which are sized for a small box's real engines, not the arithmetic one.
        "limits": {"concurrentPerEngine": 4096, "queuedPerEngine": 4096},
        "engines": {"tone": {"url": worker_url}},
    }
    (tmp / "core.json").write_text(json.dumps(config))
    rhapsode = str(Path(sys.executable).parent / "rhapsode")
    proc = subprocess.Popen([rhapsode, "serve", "--config", str(tmp / "core.json")], stdout=subprocess.DEVNULL)
    wait_listening(port)
    return proc, port


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def one_stream(port: int, results: list[str], started: list[float]) -> None:
    """
    A realtime listener: reads at 48 KB/s, as a player would, and checks the ending.
    """
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request_bytes("/speak", {"engine": "tone", "text": STREAM_TEXT, "format": "pcm"}))
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            results.append("status")
            return
        started.append(time.monotonic())
        got = b""
        begin = time.monotonic()
        budget = 0
        while True:
            data = await reader.read(8192)
            if not data:
                break
            got = (got + data)[-16:]
            budget += len(data)
            ahead = budget / RATE_BYTES - (time.monotonic() - begin)
            if ahead > 0:
                await asyncio.sleep(ahead)
        writer.close()
        results.append("ok" if got.endswith(b"\r\n\r\n") else "truncated")
    except (OSError, asyncio.IncompleteReadError) as error:
        results.append(type(error).__name__)


async def concurrent(port: int, n: int) -> tuple[list[str], list[float]]:
    results: list[str] = []
    started: list[float] = []
    tasks = []
    for i in range(n):
        tasks.append(asyncio.create_task(one_stream(port, results, started)))
        if i % 100 == 99:
            await asyncio.sleep(0.05)  # a burst, not a single instant: accept queues are finite
    await asyncio.gather(*tasks)
    return results, started


def report(title: str, direct: list[float], proxied: list[float]) -> None:
    print(title)
    print(f"  direct   p50 {percentile(direct, 0.5) * 1e3:6.2f}  p99 {percentile(direct, 0.99) * 1e3:6.2f}")
    print(f"  proxied  p50 {percentile(proxied, 0.5) * 1e3:6.2f}  p99 {percentile(proxied, 0.99) * 1e3:6.2f}")
    print(
        f"  overhead p50 {(percentile(proxied, 0.5) - percentile(direct, 0.5)) * 1e3:6.2f}"
        f"  p99 {(percentile(proxied, 0.99) - percentile(direct, 0.99)) * 1e3:6.2f}"
    )


def ttfb(direct: Callable[[], socket.socket], proxied: Callable[[], socket.socket], how: str) -> None:
    """
    Time to first byte of one sentence, direct and through the core: a new connection
    each, then one kept-alive connection each.  The sides alternate in blocks of 25, so
    the box's drift falls on both alike while each request still follows one of its
    own kind.  (Alternating request by request instead put each side's request right
    after the other side's, on a worker still finishing that one: which side gained
    depended on how long each took to wind down, not on the core.)
    """
    small = {"text": SENTENCE, "format": "pcm", "seed": 1}
    to_worker, to_core = request_bytes("/speak", small), request_bytes("/speak", {"engine": "tone", **small})
    for _ in range(20):  # warm both paths
        timed(direct, to_worker)
        timed(proxied, to_core)
    d_first: list[float] = []
    p_first: list[float] = []
    for _ in range(20):
        d_first.extend(timed(direct, to_worker)[0] for _ in range(25))
        p_first.extend(timed(proxied, to_core)[0] for _ in range(25))
    report(f"time to first byte, one sentence, 500 requests each, a new connection each, {how} (ms)", d_first, p_first)
    kept_direct, kept_proxied = KeptAlive(direct), KeptAlive(proxied)
    d_first, p_first = [], []
    for _ in range(20):
        d_first.extend(kept_direct.timed(to_worker)[0] for _ in range(25))
        p_first.extend(kept_proxied.timed(to_core)[0] for _ in range(25))
    kept_direct.close()
    kept_proxied.close()
    report(f"time to first byte, one sentence, 500 requests each, one kept-alive connection, {how} (ms)", d_first, p_first)


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    worker, path = start_worker(tmp)
    core, port = start_core(tmp, f"unix:{path}")
    direct, proxied = unix(path), tcp(port)
    try:
        ttfb(direct, proxied, "worker on its Unix socket (as the core spawns it)")
        # The same comparison with the worker on TCP, as a remote worker is: the client's
        # leg is TCP on both sides, so what differs is only the core.
        tcp_tmp = Path(tempfile.mkdtemp())
        tcp_worker, address = start_worker(tcp_tmp, listen="tcp:127.0.0.1:0")
        host, _, worker_port = address[len("tcp:"):].rpartition(":")
        tcp_core, tcp_core_port = start_core(tcp_tmp, f"http://{host}:{worker_port}")
        try:
            ttfb(tcp(int(worker_port)), tcp(tcp_core_port), "worker on TCP (as a remote worker is)")
        finally:
            for proc in (tcp_core, tcp_worker):
                proc.terminate()
                proc.wait(20)
        # What one request costs the core in CPU (user and system, all of it: parsing,
        # relaying ~190 KB, ending): the core's own work apart from waiting to be
        # scheduled (it still grows when the box is slow: each instruction costs more).
        kept = KeptAlive(proxied)
        small = request_bytes("/speak", {"engine": "tone", "text": SENTENCE, "format": "pcm", "seed": 1})
        for _ in range(50):
            kept.timed(small)
        cpu_before = cpu_seconds(core.pid)
        for _ in range(1000):
            kept.timed(small)
        kept.close()
        print(f"core CPU per one-sentence request, kept-alive: {(cpu_seconds(core.pid) - cpu_before) * 1e3:.0f} us (1000 requests)")
        big = {"text": LONG, "format": "pcm", "seed": 1}
        d_rate = p_rate = 0.0
        for _ in range(5):  # interleaved, so a slow minute falls on both sides
            d_bytes, d_seconds = timed(direct, request_bytes("/speak", big))[2:0:-1]
            p_bytes, p_seconds = timed(proxied, request_bytes("/speak", {"engine": "tone", **big}))[2:0:-1]
            d_rate, p_rate = max(d_rate, d_bytes / d_seconds), max(p_rate, p_bytes / p_seconds)
        print(f"streamed throughput, {len(LONG)} chars of pcm (best of 5 each, interleaved)")
        print(f"  direct {d_rate / 1e6:7.1f} MB/s   proxied {p_rate / 1e6:7.1f} MB/s   ratio {p_rate / d_rate:4.2f}")
        print("concurrent realtime streams through the core (~5 s of audio each, read at 48 KB/s)")
        for n in (500, 1000, 2000):
            cpu_before = cpu_seconds(core.pid)
            wall_before = time.monotonic()
            peak = [rss_mb(core.pid)]

            async def run(n: int = n) -> tuple[list[str], list[float]]:
                async def sample() -> None:
                    while True:
                        peak.append(rss_mb(core.pid))
                        await asyncio.sleep(0.25)

                sampler = asyncio.create_task(sample())
                try:
                    return await concurrent(port, n)
                finally:
                    sampler.cancel()

            results, started = asyncio.run(run())
            wall = time.monotonic() - wall_before
            cpu = cpu_seconds(core.pid) - cpu_before
            failed = sum(1 for r in results if r != "ok")
            print(
                f"  N={n:5d}: core CPU {100 * cpu / wall:5.1f}% of one core over {wall:5.1f} s, "
                f"peak RSS {max(peak):6.1f} MB, failed {failed}"
                + (f" ({', '.join(sorted(set(r for r in results if r != 'ok')))})" if failed else "")
            )
    finally:
        core.terminate()
        worker.terminate()
        core.wait(20)
        worker.wait(20)


if __name__ == "__main__":
    main()
