"""
What a segment joint sounds like, run by hand after `make test` has built the engines'
virtualenvs: `.venv/bin/python bench/joins.py [kokoro] [piper] [--text TEXT]`.

A streamed answer's first segment is cut short for a quicker first audio, often inside a
sentence; a buffered answer of the same short text is one generation.  For each engine
(a worker of its own on a Unix socket) this asks for the same text both ways as pcm and
prints every run of quiet (below -40 dBFS, at least 60 ms) with where it starts: the
streamed answer's run at the join against the buffered one's pauses show what the cut
adds.  Asserts nothing.
"""

from __future__ import annotations

import argparse
import array
import os
import socket
import tempfile
from pathlib import Path

from _common import request_bytes, start_worker, unix

ROOT = Path(__file__).resolve().parent.parent
SENTENCE = "The harbour lights came on one by one as the evening ferry pulled away."
RATES = {"kokoro": 24000, "piper": 22050}
#: -40 dBFS of 16-bit full scale.
QUIET = 328
SHORTEST_MS = 60


def pcm_body(raw: bytes) -> bytes:
    """The body of one HTTP/1.1 answer, chunked or not."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    if b"chunked" not in head.lower():
        return rest
    body = bytearray()
    while True:
        line, _, rest = rest.partition(b"\r\n")
        size = int(line.split(b";")[0], 16)
        if size == 0:
            return bytes(body)
        body += rest[:size]
        rest = rest[size + 2:]


def speak(sock: socket.socket, payload: dict[str, object]) -> bytes:
    """One request on its own connection (closed by the worker), its audio."""
    with sock:
        sock.sendall(request_bytes("/speak", payload))
        raw = bytearray()
        while chunk := sock.recv(1 << 20):
            raw += chunk
    return pcm_body(bytes(raw))


def quiet_runs(pcm: bytes, rate: int) -> tuple[list[tuple[int, int]], int]:
    """The runs of quiet in 16-bit C{pcm} as (start, length) in ms, and its length in ms."""
    samples = array.array("h")
    samples.frombytes(pcm[: len(pcm) // 2 * 2])
    runs: list[tuple[int, int]] = []
    start = None
    for index, value in enumerate(samples):
        if -QUIET < value < QUIET:
            if start is None:
                start = index
            continue
        if start is not None and (index - start) * 1000 >= SHORTEST_MS * rate:
            runs.append((start * 1000 // rate, (index - start) * 1000 // rate))
        start = None
    return runs, len(samples) * 1000 // rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engines", nargs="*", default=list(RATES), help="of kokoro and piper")
    parser.add_argument("--text", default=SENTENCE)
    args = parser.parse_args()
    unknown = set(args.engines) - set(RATES)
    if unknown:
        parser.error(f"no such engine here: {', '.join(sorted(unknown))}")
    os.environ.setdefault("RHAPSODE_KOKORO_CACHE", str(ROOT / ".venvs" / "kokoro-cache"))
    with tempfile.TemporaryDirectory() as folder:
        for engine in args.engines:
            python = str(ROOT / ".venvs" / engine / "bin" / "python")
            worker, path = start_worker(Path(folder), module=f"rhapsode_engine_{engine}", engine=engine, python=python)
            try:
                for stream in (True, False):
                    pcm = speak(unix(path)(), {"text": args.text, "format": "pcm", "stream": stream})
                    runs, length = quiet_runs(pcm, RATES[engine])
                    shown = ", ".join(f"{span} ms at {start}" for start, span in runs) or "none"
                    print(f"{engine:7} {'streamed' if stream else 'buffered'}: {length} ms of audio;"
                          f" quiet runs of {SHORTEST_MS} ms or more: {shown}")
            finally:
                worker.terminate()
                worker.wait(10)


if __name__ == "__main__":
    main()
