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

import cProfile
import gc
import json
import pstats
import sys
import time
from typing import Any

from twisted.internet.abstract import FileDescriptor
from twisted.internet.address import IPv4Address
from twisted.internet.testing import MemoryReactorClock

from rhapsode._config import Config, ConfigSettings
from rhapsode._fleet.registry import EngineHandle, Registry
from rhapsode._service import build_core
from rhapsode._upstream.pool import WorkerClient

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


class Socket(FileDescriptor):
    """
    A connected socket whose kernel takes every send (and forgets it, keeping a count).
    """

    def __init__(self, reactor: Any) -> None:
        super().__init__(reactor)
        self.connected = 1
        self.bytes_sent = 0
        self.last = b""

    def writeSomeData(self, data: Any) -> int:
        self.bytes_sent += len(data)
        self.last = bytes(data[-64:])
        return len(data)

    def getPeer(self) -> IPv4Address:
        return IPv4Address("TCP", "127.0.0.1", 50000)

    def getHost(self) -> IPv4Address:
        return IPv4Address("TCP", "127.0.0.1", 8080)


def main() -> None:
    reactor = MemoryReactorClock()
    worker = WorkerClient(reactor, "unix:/nowhere/tone.sock")
    handle = EngineHandle("tone", worker, None)
    handle._capabilities = {k: v for k, v in CAPABILITIES.items() if k != "current"}
    config = Config()
    # As the service does: settings read from the config it loaded.
    app = build_core(Registry({"tone": handle}), reactor=reactor, settings=ConfigSettings(lambda: config))
    site = app.site(access_log=False)
    client = Socket(reactor)
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
            protocol.makeConnection(Socket(reactor))
            upstream.append(protocol)
        upstream[0].dataReceived(answer)
        if not client.last.endswith(b"X-Rhapsode-Duration-Ms: 208\r\n\r\n"):
            raise RuntimeError(f"the answer did not end as it should: {client.last!r}")

    for _ in range(500):
        one()
    rounds = 20_000
    gc.collect()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(rounds // 5):
            one()
        best = min(best, (time.perf_counter() - start) / (rounds // 5))
    print(f"core Python per kept-alive /speak (in memory, no syscalls): {best * 1e6:.1f} us (best of 5 x {rounds // 5})")
    if "--profile" in sys.argv:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(5000):
            one()
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
