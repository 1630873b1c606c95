"""
The latencies the tests used to bound, measured here instead (a timing depends on the
box, so it is a figure, never a test's assertion): run by hand after `make engines`,

    .venv/bin/python bench/latency.py [--rounds N]

- Piper, a worker on a Unix socket, the 2000-character text streamed as pcm: time to
  the first audio (tests/integration/test_engine_piper.py bounded it at 0.6 s; about
  0.15 s on an idle two-core box) and to the end.
- espeak-ng, the same way, 2000 characters (about two minutes of speech): time to the
  first chunk and to the end (test_engine_espeak.py bounded them at 0.5 s and 2 s).
- tone, likewise, as the floor: the SDK and the socket with next to no synthesis.

Each is measured --rounds times after a warm-up request and printed as best, median
and worst.  Asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from _common import request_bytes, start_worker, timed, unix

ROOT = Path(__file__).resolve().parents[1]
PARAGRAPH = (
    "It was a bright cold day in April, and the clocks were striking thirteen. The hallway "
    "smelt of boiled cabbage and old rag mats. At one end of it a coloured poster, too large "
    "for indoor display, had been tacked to the wall. It depicted simply an enormous face, "
    "more than a metre wide: the face of a man of about forty-five, with a heavy black "
    "moustache and ruggedly handsome features. "
)
LONG = (PARAGRAPH * 6)[:2000]
ENGINES = (("piper", "rhapsode_engine_piper"), ("espeak", "rhapsode_engine_espeak"), ("tone", "rhapsode_engine_tone"))


def measure(engine: str, module: str, rounds: int) -> tuple[list[float], list[float]] | None:
    python = ROOT / ".venvs" / engine / "bin" / "python"
    if not python.exists():
        print(f"{engine}: {python} is missing (`make engines` builds it); skipped")
        return None
    with tempfile.TemporaryDirectory(prefix=f"latency-{engine}-") as folder:
        process, path = start_worker(Path(folder), module=module, engine=engine, python=str(python))
        try:
            raw = request_bytes("/speak", {"text": LONG, "format": "pcm", "stream": True})
            timed(unix(path), request_bytes("/speak", {"text": "Warm up.", "format": "pcm"}))
            firsts, totals = [], []
            for _ in range(rounds):
                first, total, _ = timed(unix(path), raw)
                firsts.append(first)
                totals.append(total)
            return firsts, totals
        finally:
            process.kill()
            process.wait()


def shown(values: list[float]) -> str:
    return (
        f"best {1000 * min(values):.0f} ms, median {1000 * statistics.median(values):.0f} ms, "
        f"worst {1000 * max(values):.0f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"{len(LONG)} characters streamed as pcm, {args.rounds} rounds after a warm-up")
    for engine, module in ENGINES:
        measured = measure(engine, module, args.rounds)
        if measured is not None:
            firsts, totals = measured
            print(f"{engine:7} first audio: {shown(firsts)}")
            print(f"{engine:7} whole text:  {shown(totals)}")


if __name__ == "__main__":
    main()
