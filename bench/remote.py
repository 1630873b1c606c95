"""
Benchmark of the remote engine, run by hand (`.venv/bin/python bench/remote.py [N]`).

One fake vLLM-Omni server (tests/integration/fake_vllm_omni.py, serving Qwen3-TTS
CustomVoice), one remote-engine worker in front of it (.venvs/remote), and a core
(`rhapsode serve`) with that worker configured by its socket.  The same one-sentence
utterance is asked for three ways, interleaved, each on a kept-alive connection: of the
fake server directly (the request the adapter itself sends: SSE of PCM deltas), of the
worker, and of the core; and once more of the fake as raw PCM (stream_format audio), for
reference.  Prints the time to the first body byte, p50 and p99 over N requests each
(300 by default), and what the worker and the core add to the direct call: the figure
issue 26 sets a goal for (<= 1 ms p50 added).  For scale, the fake is also asked through
a bare hop, a process that relays bytes and parses nothing: the core and the worker are
two such hops before any of their own work.  Asserts nothing.

Everything runs on this one machine: clients, core, worker and fake share its cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import KeptAlive, free_port, percentile, request_bytes, start_bare_hop, start_worker, tcp, unix, wait_listening

ROOT = Path(__file__).resolve().parent.parent
FAKE = ROOT / "tests" / "integration" / "fake_vllm_omni.py"
MODEL = "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice"
TEXT = "Hello there, and welcome back."


def start_fake() -> tuple[subprocess.Popen[bytes], int]:
    proc = subprocess.Popen([sys.executable, str(FAKE), "--model", MODEL], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    return proc, int(json.loads(proc.stdout.readline())["port"])


def start_core(tmp: Path, worker: str) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    config = {
        "server": {"port": port, "host": "127.0.0.1"},
        "log": {"level": "error"},
        "workers": {"socketDir": str(tmp / "sock"), "voiceDir": str(tmp / "voices")},
        "engines": {"qwen": {"url": f"unix:{worker}"}},
    }
    (tmp / "core.json").write_text(json.dumps(config))
    rhapsode = str(Path(sys.executable).parent / "rhapsode")
    proc = subprocess.Popen([rhapsode, "serve", "--config", str(tmp / "core.json")], stdout=subprocess.DEVNULL)
    wait_listening(port)
    return proc, port


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    python = str(ROOT / ".venvs" / "remote" / "bin" / "python")
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        fake, fake_port = start_fake()
        import os

        os.environ["RHAPSODE_REMOTE_URL"] = f"http://127.0.0.1:{fake_port}"
        worker, socket_path = start_worker(tmp, module="rhapsode_engine_remote", engine="qwen", python=python)
        core, core_port = start_core(tmp, socket_path)
        hop, hop_port = start_bare_hop(fake_port)
        try:
            sse = {"model": MODEL, "input": TEXT, "response_format": "pcm", "task_type": "CustomVoice",
                   "language": "Auto", "stream": True, "stream_format": "sse"}
            raw_pcm = dict(sse, stream_format="audio", stream=False)
            native = {"text": TEXT, "format": "pcm"}
            ways = {
                "fake, SSE (what the adapter asks)": (tcp(fake_port), request_bytes("/v1/audio/speech", sse)),
                "fake, raw PCM": (tcp(fake_port), request_bytes("/v1/audio/speech", raw_pcm)),
                "fake, SSE, through a bare hop": (tcp(hop_port), request_bytes("/v1/audio/speech", sse)),
                "worker (Unix socket)": (unix(socket_path), request_bytes("/speak", native)),
                "core (TCP)": (tcp(core_port), request_bytes("/speak", dict(native, engine="qwen"))),
            }
            clients = {name: KeptAlive(connect) for name, (connect, _) in ways.items()}
            firsts: dict[str, list[float]] = {name: [] for name in ways}
            for _ in range(20):  # warm: connections, the worker's pool, the core's
                for name, (_, raw) in ways.items():
                    clients[name].timed(raw)
            for _ in range(count):
                for name, (_, raw) in ways.items():
                    first, _, _ = clients[name].timed(raw)
                    firsts[name].append(first * 1000)
            for client in clients.values():
                client.close()
        finally:
            for proc in (core, worker, hop, fake):
                proc.terminate()
            for proc in (core, worker, hop, fake):
                proc.wait(10)
    print(f"time to the first body byte, ms, over {count} requests each (one sentence, kept-alive):")
    direct = percentile(firsts["fake, SSE (what the adapter asks)"], 0.5)
    for name, values in firsts.items():
        p50, p99 = percentile(values, 0.5), percentile(values, 0.99)
        added = f"   added over the fake's SSE: {p50 - direct:+.3f} ms p50" if name.startswith(("worker", "core", "fake, SSE, through")) else ""
        print(f"  {name:36s} p50 {p50:7.3f}  p99 {p99:7.3f}{added}")
    time.sleep(0)


if __name__ == "__main__":
    main()
