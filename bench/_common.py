"""
What the benchmarks share: starting a worker under the spawn contract, and timing one
raw HTTP/1.1 request to the first body byte and to the end.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable


#: How long one side of a side-by-side bench is left alone before the other side's turn.
#: onnxruntime's own threads, as the peers build their sessions (its defaults), spin on
#: after each run: a warm piper-tts voice burnt 39-41 ms of CPU in the 50-300 ms after a
#: one-sentence run (8 ms in the first 10 ms), so a request that follows a peer's at
#: once finds a core taken.  Our sessions stop spinning when a run ends, so without a
#: pause the bench charged the peers' spinning to our side (Wyoming door, one short
#: sentence: 1.31-1.42x wyoming-piper back to back, 0.96x with this pause).
SETTLE_SECONDS = 0.3


def installed_bytecode(folder: Path) -> None:
    """
    Let every Python this bench starts (cores, workers, peers: they inherit the
    environment) keep its compiled bytecode in C{folder}, as an installed one does.

    pip compiles what it installs from a wheel, so a user's core, workers and peers all
    start from bytecode; but the checkout's own packages are installed editable, whose
    bytecode Python writes beside the sources on first import, unless
    C{PYTHONDONTWRITEBYTECODE} is set (as on the development box).  Then every worker
    start compiled the protocol, the SDK and the adapter afresh (a cold Piper start here:
    0.75 s against 0.71 s median, five paired starts), which a user never pays.  With C{PYTHONPYCACHEPREFIX} every interpreter
    reads and writes its bytecode under C{folder} instead (the tree is never written),
    so each side compiles once, in its first start, and a bench warms both sides before
    timing.
    """
    folder.mkdir(parents=True, exist_ok=True)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = str(folder)


def cpu_seconds(pid: int) -> float:
    """
    The CPU time every thread of process C{pid} has had so far, to the nanosecond (each
    thread's /proc/PID/task/TID/schedstat); /proc/PID/stat counts whole clock ticks, 10 ms
    here, which over 40 requests read a core's ~1.8 ms a request as 1.5, 1.75 or 2.0.  A thread
    that has ended is no longer counted: measure processes whose threads live on (a core's
    reactor and pools, a worker's synthesis threads).
    """
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended meanwhile
    return total / 1e9


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_listening(port: int, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            socket.create_connection(("127.0.0.1", port)).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def start_worker(
    tmp: Path,
    module: str = "rhapsode_engine_tone",
    engine: str = "tone",
    python: str = sys.executable,
    listen: str | None = None,
    wrapper: tuple[str, ...] = (),
) -> tuple[subprocess.Popen[bytes], str]:
    """
    A worker on a Unix socket in C{tmp} (or on C{listen}, e.g. C{tcp:127.0.0.1:0}), once
    its handshake line has come, started under C{wrapper} (a command and its options,
    valgrind's say) where one is given.  Returns the process and the socket's path, or for TCP
    the address it reported (C{tcp:HOST:PORT}).
    """
    path = str(tmp / f"{engine}.sock")
    env = dict(
        os.environ,
        RHAPSODE_WORKER_LISTEN=listen or f"unix:{path}",
        RHAPSODE_WORKER_ENGINE=engine,
        RHAPSODE_WORKER_CONTRACT="1",
        RHAPSODE_WORKER_VOICE_DIR=str(tmp / "voices"),
        RHAPSODE_WORKER_LOG_LEVEL="error",
    )
    proc = subprocess.Popen([*wrapper, python, "-m", module], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    handshake = json.loads(proc.stdout.readline())
    return proc, (handshake["listen"] if listen else path)


#: One process that relays bytes both ways and parses nothing (Twisted's portforward):
#: what a hop between processes costs on this box before any HTTP or speech work.
BARE_HOP = """
import sys
from twisted.internet import reactor
from twisted.protocols.portforward import ProxyFactory
port = reactor.listenTCP(0, ProxyFactory("127.0.0.1", int(sys.argv[1])), interface="127.0.0.1")
print(port.getHost().port, flush=True)
reactor.run()
"""


def start_bare_hop(target: int) -> tuple[subprocess.Popen[bytes], int]:
    """
    A bare hop (L{BARE_HOP}) in front of the TCP port C{target}, and its own port.
    """
    proc = subprocess.Popen([sys.executable, "-c", BARE_HOP, str(target)], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def unix(path: str) -> Callable[[], socket.socket]:
    def connect() -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        return sock

    return connect


def tcp(port: int) -> Callable[[], socket.socket]:
    return lambda: socket.create_connection(("127.0.0.1", port))


def request_bytes(path: str, payload: dict[str, Any]) -> bytes:
    body = json.dumps(payload).encode()
    return (
        b"POST %s HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(body), body)
    )


def timed(connect: Callable[[], socket.socket], raw: bytes) -> tuple[float, float, int]:
    """
    One request: (seconds to the first body byte, seconds to the end, body bytes).
    """
    sock = connect()
    start = time.perf_counter()
    sock.sendall(raw)
    buffer = b""
    first = None
    total = 0
    while True:
        data = sock.recv(262144)
        if not data:
            break
        if first is None:
            buffer += data
            if b"\r\n\r\n" in buffer:
                head, rest = buffer.split(b"\r\n\r\n", 1)
                if not head.startswith(b"HTTP/1.1 200"):
                    raise RuntimeError(head.decode(errors="replace"))
                if rest:
                    first = time.perf_counter()
                    total += len(rest)
            continue
        total += len(data)
    end = time.perf_counter()
    sock.close()
    return (first or end) - start, end - start, total


class KeptAlive:
    """
    One kept-alive connection carrying request after request, each answered with a
    chunked body (as every /speak is); the way a real client with a session talks.
    """

    def __init__(self, connect: Callable[[], socket.socket]) -> None:
        self._sock = connect()
        self._rest = b""

    def close(self) -> None:
        self._sock.close()

    def _more(self) -> None:
        data = self._sock.recv(262144)
        if not data:
            raise RuntimeError("the server closed a kept-alive connection")
        self._rest += data

    def timed(self, raw: bytes) -> tuple[float, float, int]:
        """
        (seconds to the first body byte, seconds to the end, body bytes).
        """
        sock = self._sock
        start = time.perf_counter()
        sock.sendall(raw.replace(b"Connection: close\r\n", b""))
        while b"\r\n\r\n" not in self._rest:
            self._more()
        head, self._rest = self._rest.split(b"\r\n\r\n", 1)
        if not head.startswith(b"HTTP/1.1 200") or b"chunked" not in head.lower():
            raise RuntimeError(head.decode(errors="replace"))
        first = None
        total = 0
        while True:
            while b"\r\n" not in self._rest:
                self._more()
            line, self._rest = self._rest.split(b"\r\n", 1)
            size = int(line.split(b";")[0], 16)
            if size == 0:
                while not (self._rest.startswith(b"\r\n") or b"\r\n\r\n" in self._rest):
                    self._more()
                self._rest = self._rest[2:] if self._rest.startswith(b"\r\n") else self._rest.split(b"\r\n\r\n", 1)[1]
                break
            if first is None:
                while not self._rest:
                    self._more()
                first = time.perf_counter()
            while len(self._rest) < size + 2:
                self._more()
            total += size
            self._rest = self._rest[size + 2 :]
        return (first or time.perf_counter()) - start, time.perf_counter() - start, total


def arrivals(port: int, engine: str, text: str) -> tuple[list[tuple[float, int]], int]:
    """
    A streamed pcm answer read chunk by chunk: when each chunk of its body arrived
    (seconds from the request, bytes of audio), and the audio's bytes per second.
    """
    connection = tcp(port)()
    connection.sendall(request_bytes("/speak", {"engine": engine, "text": text, "format": "pcm", "stream": True}))
    started = time.perf_counter()
    reader = connection.makefile("rb")
    status = reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(status.decode(errors="replace"))
    rate = 0
    while (line := reader.readline().strip()):
        name, _, value = line.decode().partition(":")
        if name.lower() == "content-type":
            rate = int(value.split("rate=")[1].split(";")[0])
    got: list[tuple[float, int]] = []
    while True:
        size = int(reader.readline().split(b";")[0], 16)
        if size == 0:
            break
        data = reader.read(size)
        reader.readline()
        got.append((time.perf_counter() - started, len(data)))
    connection.close()
    return got, rate * 2


def played(got: list[tuple[float, float]]) -> tuple[float, list[float]]:
    """
    A player that starts at the first audio and plays without pause while it has audio,
    given when each piece arrived and its seconds of audio: when its last audio ends,
    and every wait it made for the next piece (silence the listener hears that the text
    did not ask for).
    """
    waits: list[float] = []
    playing_until = got[0][0] if got else 0.0
    for at, seconds in got:
        if at > playing_until:
            waits.append(at - playing_until)
            playing_until = at
        playing_until += seconds
    return playing_until, waits


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p))]
