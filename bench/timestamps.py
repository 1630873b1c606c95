"""
What asking for timestamps costs (docs/timestamps.md), run by hand after `make test` has
built the engines' virtualenvs: `.venv/bin/python bench/timestamps.py [--rounds N]`.

One core (`rhapsode serve`) with eSpeak NG and Piper, each warm, and for each engine and
text (one sentence, ~400 and ~2000 characters), side by side in interleaved rounds: the
same streamed pcm request without timestamps (raw audio) and with word timestamps (the
contract's events), and buffered the same (a WAV, and the JSON document).

Per request: the CPU time the worker's process spent on it (every thread's, from
/proc/PID/task/*/schedstat, in nanoseconds: the synthesis and what timing it costs,
which a busy box slows but does not inflate), the core's likewise (relaying, and for the
timed side reading the worker's frames and writing events or a document, base64
included), the time to the whole answer and, for streams, to the first audio (the first
audio delta, not the timings before it).  Per side the best round and the median; the
ratios are the timed side's over the untimed.  Asserts nothing.

With --instructions, the worker's cost is counted in instructions instead of seconds:
each engine's worker runs alone under valgrind's callgrind (started with counting off,
so its start-up costs nothing), is spoken to directly as the core speaks to it (the
core's frames for the timed side), and counts every instruction each of its threads
runs over N requests without timestamps and then N with, twice over.  A count does not
move with what else the box is doing, where a CPU time on a busy box moves by a tenth
from minute to minute; it does not see what a cache miss or a wait costs.  Needs
valgrind (`apt-get install valgrind`).  eSpeak's three texts took 14 minutes here with
N = 10; a Piper worker under valgrind had not finished its warm-up requests after 14
minutes of CPU, so Piper's cost is the CPU times' (onnxruntime's run dwarfs the
timing's bookkeeping there).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from rhapsode_protocol import frames

from _common import cpu_seconds, free_port, start_worker, unix, wait_listening

ROOT = Path(__file__).resolve().parent.parent
SENTENCE = "The harbour lights came on one by one as the evening ferry pulled away."
PARAGRAPH = (
    "The old lighthouse keeper kept a careful log. Each night he wrote the weather, the ships "
    "he saw, and the hour the lamp was lit. In winter the entries grew short: fog, cold, "
    "nothing passed. In summer they ran to pages, full of yachts and fishing boats and the "
    "occasional whale. Years later, his granddaughter found the books in a trunk and read "
    "them aloud, one evening at a time."
)
TEXTS = {"sentence": SENTENCE, "400 chars": PARAGRAPH, "2000 chars": " ".join([PARAGRAPH] * 6)[:2000]}
ENGINES = ("espeak", "piper")


Sample = tuple[float, float, float, float]


def measured(port: int, pids: tuple[int, int], body: dict[str, object], accept: str | None) -> Sample:
    """
    (first audio, end, the worker's CPU seconds, the core's), for one request.
    """
    worker, core = pids
    before = cpu_seconds(worker), cpu_seconds(core)
    first, end = request(port, body, accept)
    return first, end, cpu_seconds(worker) - before[0], cpu_seconds(core) - before[1]


def request(port: int, body: dict[str, object], accept: str | None) -> tuple[float, float]:
    """
    One request: (seconds to its first audio, seconds to its end).  The first audio of
    raw audio is its first body byte; of events, the first audio delta's arrival.
    """
    payload = json.dumps(body).encode()
    head = (
        "POST /speak HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\n"
        + (f"Accept: {accept}\r\n" if accept else "")
        + f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    start = time.perf_counter()
    sock.sendall(head + payload)
    buffer = b""
    first = None
    body_at = -1
    events = accept == "text/event-stream"
    while True:
        data = sock.recv(262144)
        if not data:
            break
        if first is None:
            buffer += data
            if body_at < 0 and b"\r\n\r\n" in buffer:
                status = buffer.split(b"\r\n", 1)[0]
                if b" 200 " not in status:
                    raise RuntimeError(buffer[:400].decode(errors="replace"))
                body_at = buffer.index(b"\r\n\r\n") + 4
            if body_at >= 0:
                rest = buffer[body_at:]
                if (events and b"event: speech.audio.delta" in rest) or (not events and len(rest) > 8):
                    first = time.perf_counter()
    end = time.perf_counter()
    sock.close()
    return (first or end) - start, end - start


def serve(tmp: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    venvs = ROOT / ".venvs"
    config = {
        "server": {"port": port, "host": "127.0.0.1"},
        "workers": {"socketDir": str(tmp / "sock"), "voiceDir": str(tmp / "voices")},
        "residency": {"maxResidentModels": 2},
        "engines": {name: {"module": f"rhapsode_engine_{name}", "python": str(venvs / name / "bin" / "python")}
                    for name in ENGINES},
    }
    (tmp / "core.json").write_text(json.dumps(config))
    log = open(tmp / "core.log", "wb")
    core = subprocess.Popen(
        [str(Path(sys.executable).parent / "rhapsode"), "serve", "--config", str(tmp / "core.json")],
        stdout=log, stderr=subprocess.STDOUT,
    )
    wait_listening(port, 30)
    return core, port


def figure(what: str, plain: list[float], timed: list[float]) -> str:
    best = min(plain), min(timed)
    median = statistics.median(plain), statistics.median(timed)
    return (f"{what} {best[0] * 1000:.1f} -> {best[1] * 1000:.1f} ms (x{best[1] / best[0]:.3f}; medians "
            f"{median[0] * 1000:.1f} -> {median[1] * 1000:.1f}, x{median[1] / median[0]:.3f})")


def line(name: str, plain: list[Sample], timed: list[Sample], stream: bool) -> str:
    parts = [
        figure("worker CPU", [s[2] for s in plain], [s[2] for s in timed]),
        figure("core CPU", [s[3] for s in plain], [s[3] for s in timed]),
        figure("whole", [s[1] for s in plain], [s[1] for s in timed]),
    ]
    if stream:
        parts.append(figure("first audio", [s[0] for s in plain], [s[0] for s in timed]))
    return f"  {name}\n" + "".join(f"      {part}\n" for part in parts)


FRAMES = frames.FRAMES  # what the core asks its worker for with timestamps


def worker_request(path: str, body: dict[str, object], accept: str | None) -> None:
    """
    One request to a worker on its Unix socket, read to its end.
    """
    payload = json.dumps(body).encode()
    sock = unix(path)()
    sock.sendall(
        b"POST /speak HTTP/1.1\r\nHost: worker\r\nConnection: close\r\nContent-Type: application/json\r\n"
        + (b"Accept: %s\r\n" % accept.encode() if accept else b"")
        + b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload)
    )
    head = sock.recv(65536)
    if b" 200 " not in head.split(b"\r\n", 1)[0]:
        raise RuntimeError(head[:400].decode(errors="replace"))
    while sock.recv(262144):
        pass
    sock.close()


def counted(folder: Path, engine: str, requests: int, texts: list[str]) -> None:
    """
    The --instructions bench for one engine: its worker under callgrind, each text
    streamed and buffered, C{requests} without timestamps and then with, twice.
    """
    out = folder / f"{engine}.callgrind"
    valgrind = ("valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes",
                f"--callgrind-out-file={out}")
    worker, path = start_worker(folder, f"rhapsode_engine_{engine}", engine,
                                python=str(ROOT / ".venvs" / engine / "bin" / "python"), wrapper=valgrind)
    dumps = 0

    def count(label: str, body: dict[str, object], accept: str | None) -> dict[str, int]:
        nonlocal dumps
        subprocess.run(["callgrind_control", "--zero", str(worker.pid)], check=True, capture_output=True)
        for _ in range(requests):
            worker_request(path, body, accept)
        time.sleep(0.5)  # the last answer's bookkeeping, after its end was sent
        subprocess.run(["callgrind_control", f"--dump={label}", str(worker.pid)], check=True, capture_output=True)
        dumps += 1
        threads: dict[str, int] = {}
        for file in folder.glob(f"{engine}.callgrind.{dumps}-*"):
            found = re.search(r"^summary: (\d+)", file.read_text(errors="replace"), re.M)
            threads[file.name.rpartition("-")[2]] = int(found.group(1)) if found else 0
        return threads

    try:
        for text in (SENTENCE, "Warm up."):
            for stream in (True, False):
                worker_request(path, {"text": text, "stream": stream, "format": "pcm" if stream else "wav"}, None)
                worker_request(path, {"text": text, "stream": stream, "format": "pcm" if stream else "wav",
                                      "timestamps": "word"}, FRAMES)
        subprocess.run(["callgrind_control", "--instr=on", str(worker.pid)], check=True, capture_output=True)
        print(f"{engine}: instructions per request, without -> with word timestamps, {requests} requests a side, twice",
              flush=True)
        for label in texts:
            text = TEXTS[label]
            for stream in (True, False):
                base: dict[str, object] = {"text": text, "stream": stream, "format": "pcm" if stream else "wav"}
                figures = []
                for _ in range(2):
                    plain = count("plain", base, None)
                    timed = count("timed", {**base, "timestamps": "word"}, FRAMES)
                    figures.append((plain, timed))
                how = "streamed pcm" if stream else "buffered wav"
                parts = []
                for plain, timed in figures:
                    a, b = sum(plain.values()) / requests, sum(timed.values()) / requests
                    by_thread = ", ".join(
                        f"{(timed.get(t, 0) - plain.get(t, 0)) / requests / 1e6:+.2f}M"
                        for t in sorted(set(plain) | set(timed))
                    )
                    parts.append(f"{a / 1e6:.2f}M -> {b / 1e6:.2f}M (x{b / a:.4f}; by thread {by_thread})")
                print(f"  {label}, {how}: " + "; ".join(parts), flush=True)
    finally:
        worker.terminate()
        worker.wait(120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--instructions", type=int, metavar="N", default=0,
                        help="count the worker's instructions over N requests a side instead (valgrind)")
    parser.add_argument("--text", action="append", choices=list(TEXTS), dest="texts",
                        help=f"with --instructions, only this one of {', '.join(TEXTS)}, repeatable (every one by"
                             " default; Piper's long ones take hours)")
    parser.add_argument("engines", nargs="*", default=list(ENGINES), help="of espeak and piper")
    args = parser.parse_args()
    if args.instructions:
        if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
            sys.exit("--instructions needs valgrind's callgrind (apt-get install valgrind)")
        with tempfile.TemporaryDirectory() as folder:
            for engine in args.engines:
                counted(Path(folder), engine, args.instructions, args.texts or list(TEXTS))
        return
    with tempfile.TemporaryDirectory() as folder:
        core, port = serve(Path(folder))
        try:
            for engine in args.engines:
                # Warm: the worker up, the model loaded, both paths taken once.
                for accept, extra in ((None, {}), ("text/event-stream", {"timestamps": "word"})):
                    request(port, {"engine": engine, "text": SENTENCE, "format": "pcm", **extra}, accept)
                summaries = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/engines").read())
                pids = (next(e["pid"] for e in summaries if e["id"] == engine), core.pid)
                print(f"{engine}: without -> with word timestamps, {args.rounds} interleaved rounds", flush=True)
                for label, text in TEXTS.items():
                    for stream in (True, False):
                        base = {"engine": engine, "text": text, "stream": stream,
                                "format": "pcm" if stream else "wav"}
                        timed_accept = "text/event-stream" if stream else "application/json"
                        plain: list[Sample] = []
                        timed: list[Sample] = []
                        for round_ in range(args.rounds):
                            # Alternate which goes first, so neither always follows the other.
                            order = [(plain, base, None), (timed, {**base, "timestamps": "word"}, timed_accept)]
                            for into, body, accept in order if round_ % 2 == 0 else order[::-1]:
                                into.append(measured(port, pids, body, accept))
                        how = "streamed pcm" if stream else "buffered wav"
                        print(line(f"{label}, {how}", plain, timed, stream), end="", flush=True)
        finally:
            core.terminate()
            core.wait(30)


if __name__ == "__main__":
    main()
