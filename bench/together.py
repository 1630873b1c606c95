"""
Four requests at once on one engine: when each caller has its audio, and what each
listener hears.  Run by hand after `make test` has built the engine's virtualenv:

    .venv/bin/python bench/together.py [--engine piper] [--against DIR] [--rounds N]

Each round starts a fresh core (`rhapsode serve`) with the engine alone, warms it, then
sends the same ~400-character text four times at once, streamed (raw pcm), and again
buffered (a whole WAV each).  Streamed, a listener is a player that starts at the first
audio and waits whenever the next has not come.  Printed per side: medians over every
request of the time to the first audio, to the end of the answer, and (streamed) to the
end of what the listener hears; and the listener's waits mid-speech, added up.

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

import engines
from _common import SETTLE_SECONDS, request_bytes, tcp, timed
from engines import PARAGRAPH

#: What each streamed request gives: seconds to first audio, to the answer's end, to the
#: end of what its listener hears, and the listener's waits after the first audio.
Streamed = tuple[float, float, float, float]


def streamed(port: int, engine: str, text: str) -> Streamed:
    """
    One streamed pcm request, read as it comes.
    """
    sock = tcp(port)()
    start = time.perf_counter()
    sock.sendall(request_bytes("/speak", {"engine": engine, "text": text, "format": "pcm"}))
    buffer = b""
    rate = 0
    first = playing = stalled = 0.0
    # Body bytes not yet counted as audio: chunked framing is parsed as it comes.
    pending = b""
    left_in_chunk = 0
    ended = False
    while True:
        data = sock.recv(262144)
        now = time.perf_counter() - start
        if not data:
            break
        if not rate:
            buffer += data
            if b"\r\n\r\n" not in buffer:
                continue
            head, pending = buffer.split(b"\r\n\r\n", 1)
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(head.decode(errors="replace"))
            rate = int(head.split(b"rate=", 1)[1].split(b";")[0].split(b"\r")[0])
        else:
            pending += data
        audio = 0
        while pending and not ended:
            if left_in_chunk:
                take = min(left_in_chunk, len(pending))
                audio += take
                left_in_chunk -= take
                pending = pending[take:]
                if not left_in_chunk:
                    pending = pending[2:] if len(pending) >= 2 else pending
                continue
            if b"\r\n" not in pending:
                break
            size_line, pending = pending.split(b"\r\n", 1)
            if not size_line:
                continue
            left_in_chunk = int(size_line.split(b";")[0], 16)
            ended = not left_in_chunk
        if audio:
            if first:
                stalled += max(0.0, now - playing)
            else:
                first = now
            playing = max(playing, now) + audio / 2 / rate
    end = time.perf_counter() - start
    sock.close()
    return first, end, playing, stalled


def at_once(n: int, call: "object") -> list:
    results: list = [None] * n

    def one(i: int) -> None:
        results[i] = call()  # type: ignore[operator]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


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
