"""
Benchmark of one tone worker, run by hand (`make bench`): realtime factor in-process and
through the worker, time to first byte, and streamed throughput per format.

Spawns a real worker on a Unix socket under the spawn contract and talks raw HTTP/1.1 to
it with blocking sockets, so the client adds as little as possible.  Prints figures;
asserts nothing.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from _common import request_bytes, start_worker, timed, unix

RATE = 24000
SENTENCE = "The quick brown fox jumps over the lazy dog, and then it rests for a while."
LONG = " ".join([SENTENCE] * 53)[:4000]


def request(path: str, payload: dict[str, object]) -> tuple[float, float, int]:
    return timed(unix(path), request_bytes("/speak", payload))


def in_process_rtf() -> float:
    from rhapsode_engine_tone import ToneEngine

    from rhapsode_protocol._split import split_text
    from rhapsode_worker import SpeakRequest, WorkerContext

    scratch = Path(tempfile.mkdtemp())
    engine = ToneEngine(WorkerContext(voice_dir=scratch / "voices", cache_dir=scratch / "cache"))
    engine.load("expressive")
    start = time.perf_counter()
    pcm = 0
    for piece in split_text(LONG, engine.segment_characters, engine.first_segment_characters, engine.segment_growth):
        for chunk in engine.speak(SpeakRequest(text=piece, variant="expressive", seed=1)):
            pcm += len(chunk)
    elapsed = time.perf_counter() - start
    return pcm / 2 / RATE / elapsed


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    worker, path = start_worker(tmp)
    try:
        request(path, {"text": "warm up", "format": "pcm", "stream": False})
        print(f"tone, {len(LONG)} characters of text (about {len(LONG) / 14:.0f} s of audio)")
        print(f"  realtime factor in-process:        {in_process_rtf():8.0f}x")
        runs = [request(path, {"text": LONG, "format": "pcm", "stream": False, "seed": 1}) for _ in range(3)]
        best = min(runs, key=lambda r: r[1])
        seconds = best[2] / 2 / RATE
        print(f"  realtime factor through worker:    {seconds / best[1]:8.0f}x  (buffered pcm, best of 3)")
        ttfb = [request(path, {"text": SENTENCE, "format": "pcm", "seed": 1})[0] for _ in range(50)]
        ttfb.sort()
        print(
            f"  time to first byte, one sentence:  p50 {statistics.median(ttfb) * 1000:6.2f} ms"
            f"  p99 {ttfb[int(len(ttfb) * 0.99) - 1] * 1000:6.2f} ms  (50 streamed requests)"
        )
        long_first = [request(path, {"text": LONG, "format": "pcm", "seed": 1})[0] for _ in range(5)]
        print(f"  time to first byte, {len(LONG)} chars:  p50 {statistics.median(long_first) * 1000:6.2f} ms")
        for fmt in ("pcm", "wav", "flac", "opus", "mp3"):
            first, total, size = request(path, {"text": LONG, "format": fmt, "seed": 1})
            print(
                f"  stream {fmt:4s}: first byte {first * 1000:7.1f} ms, whole {total:6.2f} s, "
                f"{size / total / 1e6:7.2f} MB/s, {size / 1e6:6.2f} MB"
            )
    finally:
        worker.terminate()
        worker.wait(10)


if __name__ == "__main__":
    main()
