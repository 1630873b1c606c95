"""
What an extra process hop costs on this machine before any HTTP is parsed, run by hand
(`.venv/bin/python bench/floor.py`): the floor under bench/proxy.py's overhead.

One tone worker; in front of it two byte forwarders that parse nothing, each a process
of its own as the core is (each client connection gets its own connection to the
worker, bytes copied both ways): one on a plain selectors loop, one as a Twisted
protocol on the reactor.  Prints time to first byte of a one-sentence /speak direct and
through each, 800 requests a side, interleaved.  Asserts nothing.
"""

from __future__ import annotations

import selectors
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import free_port, percentile, request_bytes, start_worker, tcp, timed, unix, wait_listening

SENTENCE = "The quick brown fox jumps over the lazy dog, then rests."


def selectors_forwarder(port: int, worker_path: str) -> None:
    loop = selectors.DefaultSelector()
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(128)
    listener.setblocking(False)
    loop.register(listener, selectors.EVENT_READ, None)
    while True:
        for key, _ in loop.select():
            if key.data is None:
                client, _ = listener.accept()
                upstream = socket.socket(socket.AF_UNIX)
                upstream.connect(worker_path)
                loop.register(client, selectors.EVENT_READ, upstream)
                loop.register(upstream, selectors.EVENT_READ, client)
                continue
            source, sink = key.fileobj, key.data
            try:
                data = source.recv(262144)  # type: ignore[union-attr]
            except OSError:
                data = b""
            if data:
                sink.sendall(data)
                continue
            for end in (source, sink):
                try:
                    loop.unregister(end)
                except (KeyError, ValueError):
                    pass
                end.close()  # type: ignore[union-attr]


def twisted_forwarder(port: int, worker_path: str) -> None:
    from twisted.internet import protocol, reactor
    from twisted.internet.endpoints import TCP4ServerEndpoint, UNIXClientEndpoint

    class Upstream(protocol.Protocol):
        front: "Front"

        def dataReceived(self, data: bytes) -> None:
            self.front.transport.write(data)  # type: ignore[union-attr]

        def connectionLost(self, reason: object = None) -> None:
            self.front.transport.loseConnection()  # type: ignore[union-attr]

    class Front(protocol.Protocol):
        upstream: Upstream | None = None

        def connectionMade(self) -> None:
            self.pending: list[bytes] = []
            self.transport.pauseProducing()  # type: ignore[union-attr]

            def connected(upstream: Upstream) -> None:
                upstream.front = self
                self.upstream = upstream
                for data in self.pending:
                    upstream.transport.write(data)  # type: ignore[union-attr]
                self.transport.resumeProducing()  # type: ignore[union-attr]

            endpoint = UNIXClientEndpoint(reactor, worker_path)
            endpoint.connect(protocol.Factory.forProtocol(Upstream)).addCallback(connected)

        def dataReceived(self, data: bytes) -> None:
            if self.upstream is None:
                self.pending.append(data)
            else:
                self.upstream.transport.write(data)  # type: ignore[union-attr]

        def connectionLost(self, reason: object = None) -> None:
            if self.upstream is not None:
                self.upstream.transport.loseConnection()  # type: ignore[union-attr]

    TCP4ServerEndpoint(reactor, port, interface="127.0.0.1").listen(protocol.Factory.forProtocol(Front))
    reactor.run()  # type: ignore[attr-defined]


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--serve":
        serve = {"selectors": selectors_forwarder, "twisted": twisted_forwarder}[sys.argv[2]]
        serve(int(sys.argv[3]), sys.argv[4])
        return
    tmp = Path(tempfile.mkdtemp())
    worker, path = start_worker(tmp)
    ports = {"selectors": free_port(), "twisted": free_port()}
    forwarders = [
        subprocess.Popen([sys.executable, __file__, "--serve", name, str(port), path])
        for name, port in ports.items()
    ]
    raw = request_bytes("/speak", {"text": SENTENCE, "format": "pcm", "seed": 1})
    try:
        for port in ports.values():
            wait_listening(port)
        for _ in range(50):
            timed(unix(path), raw)
            for port in ports.values():
                timed(tcp(port), raw)
        direct: list[float] = []
        through: dict[str, list[float]] = {name: [] for name in ports}
        for _ in range(800):
            direct.append(timed(unix(path), raw)[0])
            for name, port in ports.items():
                through[name].append(timed(tcp(port), raw)[0])
        base = percentile(direct, 0.5)
        print(f"time to first byte, one sentence, 800 requests a side (ms); direct p50 {base * 1e3:.2f}")
        for name, values in through.items():
            p50 = percentile(values, 0.5)
            print(f"  through a {name:9s} forwarder: p50 {p50 * 1e3:.2f}, overhead p50 {(p50 - base) * 1e3:.2f}")
    finally:
        for proc in [*forwarders, worker]:
            proc.terminate()
            proc.wait(20)


if __name__ == "__main__":
    main()
