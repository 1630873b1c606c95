"""
The worker's own Python on one /speak, with no sockets and no other process: run by hand
(`.venv/bin/python bench/worker_path.py [--profile]`).

The worker (rhapsode_worker.testing's harness: the real routes, scheduler and model
state on a memory reactor whose pools run each call on the reactor's thread) answers a
kept-alive connection's /speak of one sentence as streamed pcm, as the core asks it;
each round feeds the request in, runs the reactor until the answer has ended, and checks
its end.  Prints the time per request, and beside it the time the tone engine takes to
synthesise the same sentence when called directly, so the difference is the worker's
share: parsing, checking, cleaning, scheduling, framing and writing.  As with
bench/core_path.py, a live worker runs the same code slower and its sends and wake-ups
come on top.  With --profile, prints the functions it spends the most time in.  Asserts
nothing beyond each answer being whole.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from twisted.internet.address import UNIXAddress

from rhapsode_engine_tone import ToneEngine
from rhapsode_worker import SpeakRequest, _schedule
from rhapsode_worker.testing import WorkerHarness

from _in_memory import MemorySocket, best_of, print_profile

SENTENCE = "The quick brown fox jumps over the lazy dog, then rests."


def main() -> None:
    # A job's first batch waits (5 ms at most) for the reactor to write it before synthesis
    # goes on; here synthesis runs on the reactor's own thread, so the wait could only
    # run out.
    _schedule._FIRST_AUDIO_WAIT = 0
    with tempfile.TemporaryDirectory() as folder:
        harness = WorkerHarness(ToneEngine, Path(folder))
        reactor = harness.reactor
        site = harness.worker.site(access_log=False)
        client = MemorySocket(reactor, UNIXAddress(None), UNIXAddress("/nowhere/tone.sock"))
        channel = site.buildProtocol(UNIXAddress(None))
        channel.makeConnection(client)
        body = json.dumps({"text": SENTENCE, "format": "pcm", "seed": 1}).encode()
        request = (
            b"POST /speak HTTP/1.1\r\nHost: worker\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )

        def one() -> None:
            client.last = b""
            channel.dataReceived(request)
            for _ in range(1000):
                if client.last.endswith(b"\r\n\r\n") and b"X-Rhapsode-Duration-Ms" in client.last:
                    return
                reactor.advance(0)
            raise RuntimeError(f"the answer did not end as it should: {client.last!r}")

        engine = harness.engine
        variant = next(iter(engine.variants()))
        engine.load(variant)  # the worker's own engine: loaded here for the direct calls, which need no route
        alone = SpeakRequest(text=SENTENCE, variant=variant, seed=1)

        def synthesis() -> None:
            for _ in engine.speak(alone):
                pass

        for _ in range(300):
            one()
            synthesis()
        rounds = 5000
        whole = best_of(rounds, one)
        engine_only = best_of(rounds, synthesis)
        print(f"worker per kept-alive streamed /speak (in memory, no syscalls): {whole * 1e6:.1f} us (best of 5 x {rounds // 5})")
        print(f"  the tone engine's synthesis of it, called directly:            {engine_only * 1e6:.1f} us")
        print(f"  the worker's share:                                             {(whole - engine_only) * 1e6:.1f} us")
        if "--profile" in sys.argv:
            print_profile(one, 2000, 35)


if __name__ == "__main__":
    main()
