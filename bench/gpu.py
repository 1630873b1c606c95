"""
The GPU bench, run by hand on a box with a card (`.venv/bin/python bench/gpu.py`), or on the
CPU with `--dry-run`, which takes every step it takes on a card at a size a CPU can.

What it proves is section 3's promise for torch engines: many heavy models on one card,
loaded on demand, evicted by measured memory, never leaking it.  Chatterbox and Dia at
their real size with random weights (tools/random_weights/, built once into the
test-weights cache) and Kokoro, each in its own virtualenv (.venvs/<id>, built by
`python tools/engine_venv.py <id> .venvs/<id> --box cuda` on the card's box), served by
a core (`rhapsode serve`) with a residency budget of two models; the weights are pulled
through a hub of our own on loopback (python -m rhapsode_worker.fakehub) by each
worker's real fetch.  Then, printing every figure as it goes and a JSON summary last:

 1. pull: each torch engine's POST /engines/{id}/pull, timed;
 2. evict: rounds of /speak to Chatterbox, Dia and Kokoro in turn, so that the budget
    of two evicts the least recently used each time; first audio, the realtime factor
    (compute over audio seconds), each model's sizeBytes from /residency against what
    the device says the load took (nvidia-smi's used memory of the card across it), which
    must agree within 10%;
 3. cycles: load (a /speak), unload (?mode=unload), again, for each torch engine, up to
    50 times within the time left: the card's memory after each unload must be within
    64 MiB of what it was before that load (from the second cycle, once the worker's
    CUDA context exists), and must not grow across the cycles;
 4. terminate: the card after every worker has gone, against before the first.

Everything must fit in ten minutes on one card (`--budget-seconds`, 540 by default);
step 3 stops early when time runs short and says how many cycles it ran.  On the CPU the
device readings are the workers' resident sets; Dia is tiny, and the counts are small.
Asserts nothing: it prints, and exits 1 where a figure breaks the promise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from _common import free_port, request_bytes, tcp, timed, wait_listening

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
RELEASE_SLACK = 64 * MIB
SIZE_TOLERANCE = 0.10
RATES = {"chatterbox": 24_000, "dia": 44_100, "kokoro": 24_000}
TEXT = "The quick brown fox jumps over the lazy dog, and then it sits down for tea."
#: Random weights never stop: every generation is held to this many tokens (frames):
#: two seconds of Chatterbox and 1.4 of Dia on a card, a handful on a dry run's CPU.
CAPS = {"RHAPSODE_CHATTERBOX_MAX_TOKENS": "50", "RHAPSODE_DIA_MAX_TOKENS": "120"}
DRY_CAPS = {"RHAPSODE_CHATTERBOX_MAX_TOKENS": "3", "RHAPSODE_DIA_MAX_TOKENS": "24"}


def say(line: str) -> None:
    print(line, flush=True)


class Device:
    """
    Readings of the card (nvidia-smi), or on a dry run of the workers' resident sets.
    """

    def __init__(self, index: int | None) -> None:
        self.index = index

    @property
    def label(self) -> str:
        return f"cuda:{self.index}" if self.index is not None else "cpu"

    def used(self) -> int:
        if self.index is not None:
            out = subprocess.run(["nvidia-smi", "-i", str(self.index), "--query-gpu=memory.used",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True, check=True)
            return int(out.stdout.strip().splitlines()[0]) * MIB
        return sum(rss(pid) for pid in workers().values())


def workers() -> dict[str, int]:
    """
    Engine id to pid, for every worker of this checkout's virtualenvs alive on the box
    (another checkout's workers, on a shared box, are not this bench's).
    """
    mine = str(ROOT / ".venvs").encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if not argv or not argv[0].startswith(mine):
            continue
        for arg in argv:
            if arg.startswith(b"rhapsode_engine_"):
                found[arg.decode()[len("rhapsode_engine_"):]] = int(entry.name)
    return found


def rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def call(port: int, method: str, path: str, body: Any = None, timeout: float = 900) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        raw = response.read()
    return json.loads(raw) if raw else None


def build(engine: str, size: str | None) -> dict[str, Any]:
    args = ["--size", size] if size else []
    python = ROOT / ".venvs" / engine / "bin" / "python"
    started = time.monotonic()
    run = subprocess.run([str(python), str(ROOT / "tools" / "random_weights" / f"build_{engine}.py"), *args],
                         capture_output=True, text=True, env=dict(os.environ, TRANSFORMERS_VERBOSITY="error"))
    if run.returncode != 0:
        raise SystemExit(f"building {engine}'s weights failed:\n{run.stderr[-2000:]}")
    info = json.loads(run.stdout.strip().splitlines()[-1])
    say(f"weights {engine}: {info['bytes'] / 1e9:.2f} GB in {info['folder']} "
        f"({time.monotonic() - started:.1f} s here, {info.get('built_seconds')} s when built)")
    return info


def pinned(engine: str) -> dict[str, str]:
    record = json.loads((ROOT / "engines" / engine / "catalog.json").read_text())
    found = {}
    for weights in record.get("weights", {}).values():
        for node in (weights, weights.get("codec") or {}):
            if len(str(node.get("revision", ""))) == 40:
                found[node["repo"]] = node["revision"]
    return found


def speak(port: int, engine: str) -> dict[str, float]:
    first, total, size = timed(tcp(port), request_bytes("/speak", {
        "engine": engine, "text": TEXT, "format": "pcm", "stream": False, "keepAliveSeconds": -1}))
    audio = size / 2 / RATES[engine]
    return {"first_audio_s": first, "total_s": total, "audio_s": audio, "rtf": total / audio if audio else float("inf")}


def residency_size(port: int, engine: str) -> int | None:
    for model in call(port, "GET", "/residency").get("models", []):
        if model.get("engine") == engine:
            return model.get("sizeBytes")
    return None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench/gpu.py")
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, at sizes a CPU can")
    parser.add_argument("--device", type=int, default=0, help="the card's index")
    parser.add_argument("--cycles", type=int, default=None, help="load/unload cycles per engine (50; 2 dry)")
    parser.add_argument("--rounds", type=int, default=None, help="evicting rounds of the three (3; 1 dry)")
    parser.add_argument("--budget-seconds", type=float, default=540.0)
    args = parser.parse_args(argv)
    began = time.monotonic()
    dry = args.dry_run
    device = Device(None if dry else args.device)
    cycles = args.cycles if args.cycles is not None else (2 if dry else 50)
    rounds = args.rounds if args.rounds is not None else (1 if dry else 3)
    if not dry and shutil.which("nvidia-smi") is None:
        raise SystemExit("no nvidia-smi: run on a box with a card, or pass --dry-run")
    say(f"bench/gpu.py on {device.label}{' (dry run)' if dry else ''}: {rounds} evicting round(s), "
        f"up to {cycles} cycle(s) per torch engine, {args.budget_seconds:.0f} s in all")
    results: dict[str, Any] = {"device": device.label, "dry_run": dry, "failures": []}
    built = {"chatterbox": build("chatterbox", None), "dia": build("dia", "tiny" if dry else "real")}

    tmp = Path(tempfile.mkdtemp(prefix="rhapsode-gpu-bench-"))
    repos = []
    for engine, info in built.items():
        pins = pinned(engine)
        for repo, rel in info["repos"].items():
            repos += ["--repo", f"{repo}@{pins.get(repo, info['commit'])}={Path(info['folder']) / rel}"]
    hub = subprocess.Popen([sys.executable, "-m", "rhapsode_worker.fakehub", *repos], stdout=subprocess.PIPE, text=True)
    processes: list[subprocess.Popen[Any]] = [hub]
    try:
        assert hub.stdout is not None
        endpoint = json.loads(hub.stdout.readline())["endpoint"]
        say(f"hub on {endpoint}")
        port = free_port()
        common = {"HF_ENDPOINT": endpoint, "HF_HUB_CACHE": str(tmp / "hf"), "HF_HUB_DISABLE_XET": "1",
                  "RHAPSODE_WORKER_DEVICE": device.label, "TRANSFORMERS_VERBOSITY": "error",
                  **(DRY_CAPS if dry else CAPS)}
        engines = {
            engine: {"module": f"rhapsode_engine_{engine}", "python": str(ROOT / ".venvs" / engine / "bin" / "python"),
                     "env": dict(common, **({"RHAPSODE_KOKORO_CACHE": str(ROOT / ".venvs" / "kokoro-cache")}
                                           if engine == "kokoro" else {}))}
            for engine in ("chatterbox", "dia", "kokoro")
        }
        config = {"server": {"port": port}, "log": {"level": "warn"},
                  "residency": {"maxResidentModels": 2, "keepAliveSeconds": -1},
                  # A first load of 6 GB from a cold disk, then a generation, can pass
                  # the core's two minutes of a silent worker.
                  "workers": {"socketDir": str(tmp / "sock"), "voiceDir": str(tmp / "voices"),
                              "stallSeconds": 900, "startupTimeoutSeconds": 300},
                  "engines": engines}
        (tmp / "core.json").write_text(json.dumps(config))
        rhapsode = str(Path(sys.executable).parent / "rhapsode")
        idle = device.used()
        core = subprocess.Popen([rhapsode, "serve", "--config", str(tmp / "core.json")], stdout=subprocess.DEVNULL)
        processes.append(core)
        wait_listening(port, 60)

        # 1. pull
        for engine in ("chatterbox", "dia", "kokoro"):
            started = time.monotonic()
            record = json.loads((ROOT / "engines" / engine / "catalog.json").read_text())
            job = call(port, "POST", f"/engines/{engine}/pull", {"variant": record["defaultVariant"]})
            while job.get("state") not in ("succeeded", "failed"):
                time.sleep(1)
                job = call(port, "GET", f"/installs/{job['id']}")
            say(f"pull {engine}: {job['state']} in {time.monotonic() - started:.1f} s")
            results.setdefault("pull_s", {})[engine] = round(time.monotonic() - started, 1)
            if job["state"] != "succeeded":
                results["failures"].append(f"pull {engine}: {job.get('error')}")

        # 2. evict: three models through a budget of two
        for round_number in range(1, rounds + 1):
            for engine in ("chatterbox", "dia", "kokoro"):
                before = device.used()
                figures = speak(port, engine)
                after = device.used()
                size = residency_size(port, engine)
                delta = after - before
                line = (f"round {round_number} {engine}: first audio {figures['first_audio_s']:.2f} s, "
                        f"RTF {figures['rtf']:.2f} ({figures['audio_s']:.2f} s of audio), sizeBytes {size}, "
                        f"device {before / MIB:.0f} -> {after / MIB:.0f} MiB")
                say(line)
                results.setdefault("speak", []).append({"round": round_number, "engine": engine, **figures,
                                                        "size_bytes": size, "device_delta": delta})
                resident = [m["engine"] for m in call(port, "GET", "/residency")["models"]]
                say(f"  resident now: {', '.join(resident)}")
                if len(resident) > 2:
                    results["failures"].append(f"round {round_number}: {len(resident)} resident over a budget of 2")

        # modelBytes against the device, per torch engine, on a load of its own
        for engine in ("chatterbox", "dia"):
            for other in list(call(port, "GET", "/residency")["models"]):
                call(port, "POST", f"/engines/{other['engine']}/unload?mode=terminate")
            before = device.used()
            speak(port, engine)
            after = device.used()
            size = residency_size(port, engine) or 0
            seen = after - before
            # A fresh worker's delta includes its CUDA context (made before the worker's
            # own first reading, so not in sizeBytes); a second load in the same worker
            # is the like-for-like figure.
            call(port, "POST", f"/engines/{engine}/unload?mode=unload")
            again = device.used()
            speak(port, engine)
            reloaded = device.used() - again
            size_again = residency_size(port, engine) or 0
            off = abs(size_again - reloaded) / reloaded if reloaded > 0 else float("inf")
            say(f"size {engine}: sizeBytes {size / MIB:.0f} MiB on a fresh worker (device {seen / MIB:.0f} MiB with "
                f"its process and context); reloaded in the same worker {size_again / MIB:.0f} MiB against the "
                f"device's {reloaded / MIB:.0f} MiB, {off:.1%} apart")
            results.setdefault("sizes", {})[engine] = {"size_bytes": size_again, "device_delta": reloaded,
                                                       "fresh_size_bytes": size, "fresh_device_delta": seen}
            if not dry and off > SIZE_TOLERANCE:
                results["failures"].append(f"{engine}: sizeBytes {size_again} is {off:.1%} from the device's {reloaded}")

        # 3. cycles: load, unload, again
        deadline = began + args.budget_seconds - 30
        for engine in ("chatterbox", "dia"):
            afters, lefts, ran = [], [], 0
            for other in list(call(port, "GET", "/residency")["models"]):
                if other["engine"] != engine:
                    call(port, "POST", f"/engines/{other['engine']}/unload?mode=terminate")
            for cycle in range(1, cycles + 1):
                # The first cycle always runs, so a dry run takes this step too.
                if cycle > 1 and time.monotonic() > deadline:
                    say(f"cycles {engine}: stopped after {ran} for time")
                    break
                before = device.used()
                figures = speak(port, engine)
                loaded = device.used()
                call(port, "POST", f"/engines/{engine}/unload?mode=unload")
                after = device.used()
                ran += 1
                afters.append(after)
                left = after - before
                lefts.append(left)
                say(f"cycle {cycle} {engine}: {before / MIB:.0f} -> {loaded / MIB:.0f} -> {after / MIB:.0f} MiB "
                    f"(left {left / MIB:+.1f} MiB), first audio {figures['first_audio_s']:.2f} s")
                if cycle >= 2 and not dry and left > RELEASE_SLACK:
                    results["failures"].append(f"{engine} cycle {cycle}: an unload left {left / MIB:.1f} MiB")
            growth = (afters[-1] - afters[1]) if len(afters) > 2 else 0
            say(f"cycles {engine}: {ran} run, growth after unloads from cycle 2 on {growth / MIB:+.1f} MiB")
            results.setdefault("cycles", {})[engine] = {"ran": ran, "left_bytes": lefts, "growth_bytes": growth}
            if not dry and growth > RELEASE_SLACK:
                results["failures"].append(f"{engine}: memory grew {growth / MIB:.1f} MiB over {ran} cycles")

        # 4. terminate everything: the card as it was
        for engine in ("chatterbox", "dia", "kokoro"):
            call(port, "POST", f"/engines/{engine}/unload?mode=terminate")
        time.sleep(2)
        final = device.used()
        say(f"terminated: device {idle / MIB:.0f} MiB before the core, {final / MIB:.0f} MiB after every worker left")
        results["idle_bytes"], results["final_bytes"] = idle, final
        if not dry and final - idle > RELEASE_SLACK:
            results["failures"].append(f"terminate left {(final - idle) / MIB:.1f} MiB on the card")
    finally:
        for process in reversed(processes):
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    results["seconds"] = round(time.monotonic() - began, 1)
    say(json.dumps(results))
    for failure in results["failures"]:
        say(f"FAIL {failure}")
    say(f"bench/gpu.py: {len(results['failures'])} failure(s) in {results['seconds']} s")
    return 1 if results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
