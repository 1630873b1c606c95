"""
The core's own Python on one /speak, with no sockets and no other process: run by hand
(`.venv/bin/python bench/core_path.py [--profile]`).

A client connection and a worker connection are in-memory transports on a memory
reactor; each round feeds a kept-alive client's request into the core's site, answers
the request the core sends to the worker with a canned streamed response (head, one
chunk of audio, the duration trailer), and checks what reached the client.  Prints the
time per request, which is the interpreter's share of the core's overhead: on a live
box the same code runs slower (cold caches after the other processes ran) and the
sends and wake-ups come on top.  With --profile, prints the functions it spends the
most time in.  Asserts nothing beyond each answer being whole.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from twisted.internet.address import IPv4Address
from twisted.internet.testing import MemoryReactorClock

from rhapsode._config import Config, ConfigSettings
from rhapsode._fleet.registry import EngineHandle, Registry
from rhapsode._service import build_core
from rhapsode._upstream.pool import WorkerClient

from _in_memory import MemorySocket, best_of, print_profile

CAPABILITIES = {
    "contract": 1,
    "engine": {"id": "tone", "displayName": "Tone", "adapterVersion": "0.1.0"},
    "license": {"code": "MIT", "weights": None, "weightsCommercialUse": None, "notes": ""},
    "device": {"type": "cpu"},
    "defaultVariant": "v1",
    "variants": {
        "v1": {"cues": [], "deliveries": [], "dials": {}, "languages": ["en"], "maxCharacters": 4096,
               "segmentation": {"supported": False}, "streaming": {"supported": True, "granularity": "chunk"}},
    },
    "formats": ["pcm", "wav"],
    "nativeFormat": {"encoding": "pcm_s16le", "sampleRate": 24000, "channels": 1},
}
SENTENCE = "The quick brown fox jumps over the lazy dog, then rests."
AUDIO = bytes(10_000)


def main() -> None:
    reactor = MemoryReactorClock()
    worker = WorkerClient(reactor, "unix:/nowhere/tone.sock")
    handle = EngineHandle("tone", worker, None)
    handle._capabilities = {k: v for k, v in CAPABILITIES.items() if k != "current"}
    config = Config()
    # As the service does: settings read from the config it loaded.
    app = build_core(Registry({"tone": handle}), reactor=reactor, settings=ConfigSettings(lambda: config))
    site = app.site(access_log=False)
    client = MemorySocket(reactor, IPv4Address("TCP", "127.0.0.1", 50000), IPv4Address("TCP", "127.0.0.1", 8080))
    channel = site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 50000))
    channel.makeConnection(client)
    body = json.dumps({"engine": "tone", "text": SENTENCE, "format": "pcm", "seed": 1}).encode()
    request = (
        b"POST /speak HTTP/1.1\r\nHost: localhost:8080\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    answer = (
        b"HTTP/1.1 200 OK\r\nContent-Type: audio/pcm\r\nTrailer: X-Rhapsode-Duration-Ms\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\nX-Rhapsode-Duration-Ms: 208\r\n\r\n" % (len(AUDIO), AUDIO)
    )
    upstream: list[Any] = []

    def one() -> None:
        channel.dataReceived(request)
        if not upstream:
            factory = reactor.unixClients[-1][1]
            protocol = factory.buildProtocol(None)
            protocol.makeConnection(MemorySocket(reactor, None, None))
            upstream.append(protocol)
        upstream[0].dataReceived(answer)
        if not client.last.endswith(b"X-Rhapsode-Duration-Ms: 208\r\n\r\n"):
            raise RuntimeError(f"the answer did not end as it should: {client.last!r}")

    for _ in range(500):
        one()
    rounds = 20_000
    best = best_of(rounds, one)
    print(f"core Python per kept-alive /speak (in memory, no syscalls): {best * 1e6:.1f} us (best of 5 x {rounds // 5})")
    if "--profile" in sys.argv:
        print_profile(one, 5000, 30)

if __name__ == "__main__":
    main()
