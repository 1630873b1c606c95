"""
Benchmark of the core's metrics, run by hand (`.venv/bin/python bench/metrics.py`).

A core's router over 20 engines (fake workers: nothing is spawned) whose series are
all populated: every speech route, ok and four refusal codes, a load and an eviction
per engine, and timings in every histogram.  Prints the time one scrape of /metrics
takes to render (on this thread, as the reactor thread renders it) and its size, and
what recording one request's metrics costs (begin, first audio, end).  Asserts nothing.
"""

from __future__ import annotations

import time
from typing import Any

from twisted.internet.defer import succeed
from twisted.internet.task import Clock

from rhapsode._fleet.registry import EngineHandle, Registry
from rhapsode._service import build_core
from rhapsode._speech.metrics import ROUTES

ENGINES = 20


class Idle:
    def request(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("nothing is spoken here")

    async def json(self, *args: Any) -> tuple[int, Any]:
        return 200, {}


class Up:
    state, pid = "up", 1

    def start(self) -> Any:
        return succeed("unix:/x")

    def stop(self, ask: bool = True) -> Any:
        return succeed(None)

    def health(self) -> dict[str, Any]:
        return {"process": "up", "restarts": 2}


def populate(routes: Any, codes: Any) -> tuple[Any, Clock]:
    clock = Clock()
    handles = {f"engine{i:02d}": EngineHandle(f"engine{i:02d}", Idle(), Up()) for i in range(ENGINES)}  # type: ignore[arg-type]
    app = build_core(Registry(handles), reactor=clock)
    metrics = app.metrics
    for engine in handles:
        metrics.load_started(engine, "default")
        metrics.load_finished(engine, "default", 1.5)
        metrics.evicted(engine, "room")
        for route in routes:
            for code in codes:
                measured = metrics.begin(route, engine)
                clock.advance(0.2)
                measured.first_audio()
                measured.sent = 48_000
                measured.audio_ms = 1000
                clock.advance(0.3)
                measured.end(code)
    return metrics, clock


def scrape(title: str, metrics: Any) -> None:
    for _ in range(20):
        body = metrics.render()
    rounds = 200
    started = time.perf_counter()
    for _ in range(rounds):
        body = metrics.render()
    took = (time.perf_counter() - started) / rounds
    series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
    print(f"scrape, {title}: {took * 1e3:.2f} ms, {len(body)} bytes, {series} series")


def main() -> None:
    typical, _ = populate(("speak", "openai", "stream"), ("ok", "overloaded"))
    scrape(f"{ENGINES} engines, each with 3 routes x 2 outcomes", typical)
    metrics, _ = populate(sorted(ROUTES), ("ok", "overloaded", "unknown_voice", "aborted", "internal"))
    scrape(f"{ENGINES} engines, each with every route ({len(ROUTES)}) x 5 outcomes", metrics)
    n = 100_000
    started = time.perf_counter()
    for i in range(n):
        measured = metrics.begin("speak", "engine07")
        measured.first_audio()
        measured.sent = 48_000
        measured.audio_ms = 1000
        measured.end("ok")
    per = (time.perf_counter() - started) / n
    print(f"recording one request (begin, first audio, end as ok with bytes and duration): {per * 1e6:.1f} us")
    started = time.perf_counter()
    for i in range(n):
        metrics.begin("speak", "engine07").end("overloaded")
    per = (time.perf_counter() - started) / n
    print(f"recording one refused request: {per * 1e6:.1f} us")


if __name__ == "__main__":
    main()
