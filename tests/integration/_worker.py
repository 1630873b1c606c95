"""
Spawning real worker processes for tests, and talking HTTP to them over Unix sockets:
through treq (streaming, as the core will) and through raw blocking sockets (to see the
bytes on the wire: chunking, trailers, aborts).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from treq.client import HTTPClient
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import UNIXClientEndpoint
from twisted.internet.protocol import ProcessProtocol
from twisted.web.client import Agent, HTTPConnectionPool
from twisted.web.iweb import IAgentEndpointFactory
from zope.interface import implementer
from _deferreds import process_alive

STARTUP_TIMEOUT = 60.0
ROOT = Path(__file__).resolve().parent.parent.parent


def engine_python(engine: str) -> str:
    """
    The interpreter of an engine's own virtualenv (built by make: .venvs/<engine>).
    """
    python = ROOT / ".venvs" / engine / "bin" / "python"
    if not python.exists():
        raise RuntimeError(f"{python} is missing: run `make test` (it builds .venvs/{engine})")
    return str(python)


class WorkerProtocol(ProcessProtocol):
    """
    Reads the handshake line from stdout and keeps stderr (JSON log lines).
    """

    def __init__(self) -> None:
        self.ready: Deferred[dict[str, Any]] = Deferred()
        self.ended: Deferred[int | None] = Deferred()
        self.stdout = b""
        self.stderr = b""
        self.exit_code: int | None = None
        self.signal: int | None = None

    def outReceived(self, data: bytes) -> None:
        self.stdout += data
        if not self.ready.called and b"\n" in self.stdout:
            line = self.stdout.split(b"\n", 1)[0]
            self.ready.callback(json.loads(line))

    def errReceived(self, data: bytes) -> None:
        self.stderr += data

    def processEnded(self, reason: Any) -> None:
        self.exit_code = getattr(reason.value, "exitCode", None)
        self.signal = getattr(reason.value, "signal", None)
        if not self.ready.called:
            self.ready.errback(RuntimeError(f"worker exited before its handshake: {self.stderr.decode()}"))
        self.ended.callback(self.exit_code)

    def log_lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.stderr.decode().splitlines() if line.startswith("{")]


@implementer(IAgentEndpointFactory)
class UnixEndpoints:
    def __init__(self, reactor: Any, path: str) -> None:
        self.reactor = reactor
        self.path = path

    def endpointForURI(self, uri: Any) -> UNIXClientEndpoint:
        return UNIXClientEndpoint(self.reactor, self.path)


@dataclass
class Worker:
    """
    A running worker process and clients for it.
    """

    reactor: Any
    protocol: WorkerProtocol
    transport: Any
    socket_path: str
    handshake: dict[str, Any]
    pid: int = field(init=False)
    pool: HTTPConnectionPool = field(init=False)
    http: HTTPClient = field(init=False)

    def __post_init__(self) -> None:
        self.pid = int(self.transport.pid)
        self.pool = HTTPConnectionPool(self.reactor, persistent=True)
        agent = Agent.usingEndpointFactory(self.reactor, UnixEndpoints(self.reactor, self.socket_path), pool=self.pool)
        self.http = HTTPClient(agent)


    def url(self, path: str) -> str:
        return "http://worker" + path

    async def json(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        kwargs: dict[str, Any] = {}
        if body is not None:
            kwargs["json"] = body
        response = await self.http.request(method, self.url(path), **kwargs)
        raw = await response.content()
        # A 204 (a delete, a fetch) has no body at all.
        return response.code, json.loads(raw) if raw else None

    async def stop(self) -> None:
        await self.pool.closeCachedConnections()
        if self.protocol.exit_code is None and self.protocol.signal is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except (ProcessLookupError, TypeError):
                pass
            await self.protocol.ended


def start_process(
    reactor: Any,
    tmp: Path,
    module: str = "rhapsode_engine_tone",
    extra_env: dict[str, str] | None = None,
    engine: str = "tone",
    contract: str = "1",
    python: str = sys.executable,
) -> tuple[WorkerProtocol, Any, str]:
    """
    Spawn a worker under the spawn contract on a Unix socket in C{tmp}.
    """
    socket_path = str(tmp / f"{engine}.sock")
    env = dict(os.environ)
    env.update(
        {
            "RHAPSODE_WORKER_LISTEN": f"unix:{socket_path}",
            "RHAPSODE_WORKER_ENGINE": engine,
            "RHAPSODE_WORKER_CONTRACT": contract,
            "RHAPSODE_WORKER_VOICE_DIR": str(tmp / "voices"),
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update(extra_env or {})
    protocol = WorkerProtocol()
    transport = reactor.spawnProcess(protocol, python, [python, "-m", module], env=env)
    return protocol, transport, socket_path


async def spawn_worker(reactor: Any, tmp: Path, **kwargs: Any) -> Worker:
    """
    Spawn a worker and wait for its handshake.
    """
    protocol, transport, socket_path = start_process(reactor, tmp, **kwargs)
    timeout = reactor.callLater(STARTUP_TIMEOUT, transport.signalProcess, "KILL")
    try:
        handshake = await protocol.ready
    finally:
        if timeout.active():
            timeout.cancel()
    return Worker(reactor, protocol, transport, socket_path, handshake)


# -- raw HTTP over a Unix socket, for what treq hides -------------------------------------


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    chunks: list[bytes]
    trailers: dict[str, str]
    complete: bool
    #: When each read from the socket returned, and how many bytes it brought.
    arrivals: list[float]
    received: list[int]

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)


def raw_request(
    path: str,
    method: str,
    target: str,
    body: bytes = b"",
    content_type: str = "application/json",
    read_delay: float = 0.0,
    recv_size: int = 65536,
    stop_after: int | None = None,
) -> RawResponse:
    """
    Blocking: send one HTTP/1.1 request and parse the response by hand, chunk by chunk.

    C{read_delay} sleeps between reads (a slow reader); C{stop_after} hangs up after that
    many body bytes.  C{complete} is whether the body ended properly (the last chunk or
    Content-Length reached) rather than by the connection dropping.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, max(recv_size, 4096))
    sock.connect(path)
    head = (
        f"{method} {target} HTTP/1.1\r\nHost: worker\r\nConnection: close\r\n"
        f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock.sendall(head + body)
    buffer = b""
    arrivals: list[float] = []
    received_sizes: list[int] = []

    def more() -> bool:
        nonlocal buffer
        if read_delay:
            time.sleep(read_delay)
        try:
            data = sock.recv(recv_size)
        except ConnectionResetError:
            return False
        if data:
            arrivals.append(time.monotonic())
            received_sizes.append(len(data))
        buffer += data
        return bool(data)

    try:
        while b"\r\n\r\n" not in buffer:
            if not more():
                raise ConnectionError("connection closed before headers")
        raw_head, buffer = buffer.split(b"\r\n\r\n", 1)
        lines = raw_head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        chunks: list[bytes] = []
        trailers: dict[str, str] = {}
        complete = False
        received = 0
        if headers.get("transfer-encoding") == "chunked":
            while True:
                while b"\r\n" not in buffer:
                    if not more():
                        return RawResponse(status, headers, chunks, trailers, False, arrivals, received_sizes)
                size_line, buffer = buffer.split(b"\r\n", 1)
                size = int(size_line.split(b";")[0], 16)
                if size == 0:
                    while b"\r\n\r\n" not in b"\r\n" + buffer:
                        if not more():
                            return RawResponse(status, headers, chunks, trailers, False, arrivals, received_sizes)
                    block = (b"\r\n" + buffer).split(b"\r\n\r\n", 1)[0]
                    for line in block.decode("latin-1").split("\r\n"):
                        if ":" in line:
                            k, v = line.split(":", 1)
                            trailers[k.strip().lower()] = v.strip()
                    complete = True
                    break
                while len(buffer) < size + 2:
                    if not more():
                        return RawResponse(status, headers, chunks, trailers, False, arrivals, received_sizes)
                chunks.append(buffer[:size])
                received += size
                buffer = buffer[size + 2:]
                if stop_after is not None and received >= stop_after:
                    return RawResponse(status, headers, chunks, trailers, False, arrivals, received_sizes)
        else:
            length = int(headers.get("content-length", "-1"))
            while length < 0 or len(buffer) < length:
                if not more():
                    break
            chunks.append(buffer if length < 0 else buffer[:length])
            complete = length >= 0 and len(buffer) >= length
        return RawResponse(status, headers, chunks, trailers, complete, arrivals, received_sizes)
    finally:
        sock.close()


def deferred_raw(*args: Any, **kwargs: Any) -> "Deferred[RawResponse]":
    from twisted.internet.threads import deferToThread

    return deferToThread(raw_request, *args, **kwargs)



__all__ = ["Worker", "WorkerProtocol", "start_process", "spawn_worker", "raw_request", "deferred_raw", "process_alive"]


def decode_pcm(data: bytes, fmt: str, rate: int) -> bytes:
    """
    Blocking: decode any of the five formats back to mono s16le at C{rate}, with the
    same ffmpeg the SDK encodes with (pcm is returned as it is).
    """
    import subprocess

    from rhapsode_worker._encode import find_ffmpeg

    if fmt == "pcm":
        return data
    ffmpeg = find_ffmpeg()
    assert ffmpeg is not None
    result = subprocess.run(
        [ffmpeg, "-hide_banner", "-loglevel", "error", "-i", "pipe:0", "-f", "s16le", "-ac", "1", "-ar", str(rate), "pipe:1"],
        input=data,
        capture_output=True,
        check=True,
    )
    return result.stdout


def probed_rate(data: bytes) -> int:
    """
    Blocking: the sample rate ffmpeg reads from an encoded file's own headers.
    """
    import re
    import subprocess

    from rhapsode_worker._encode import find_ffmpeg

    ffmpeg = find_ffmpeg()
    assert ffmpeg is not None
    result = subprocess.run(
        [ffmpeg, "-hide_banner", "-i", "pipe:0", "-f", "null", "-"], input=data, capture_output=True
    )
    found = re.search(rb"Audio: [^\n]*?(\d+) Hz", result.stderr)
    assert found is not None, result.stderr[-500:]
    return int(found.group(1))


def rms(pcm: bytes) -> float:
    from array import array

    samples = array("h")
    samples.frombytes(pcm[: len(pcm) // 2 * 2])
    if not samples:
        return 0.0
    return (sum(s * s for s in samples[::7]) / len(samples[::7])) ** 0.5


def resident_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def engine_of(health: dict[str, Any], engine: str) -> dict[str, Any]:
    """
    One engine's entry in a core's GET /health (a list, in configuration order).
    """
    found: dict[str, Any] = next(e for e in health["engines"] if e["id"] == engine)
    return found


def free_port() -> int:
    """
    A TCP port on loopback nothing listens on now.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def get(port: int, path: str) -> Any:
    """
    GET a JSON answer from a core on loopback.
    """
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
        return json.loads(response.read())


#: The least a wait is given: every wait here is a hang guard, never a timing, and a
#: process that starts in two seconds on an idle box takes twenty on one ten times slower.
HANG_GUARD_FLOOR = 60.0


def wait_for(predicate: Any, seconds: float, what: str) -> Any:
    """
    Poll C{predicate} every tenth of a second until it answers something true, for at
    most C{seconds} (at least L{HANG_GUARD_FLOOR}); an OSError or ValueError on the way
    counts as not yet.
    """
    deadline = time.monotonic() + max(seconds, HANG_GUARD_FLOOR)
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except (OSError, ValueError):
            value = None
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def interruptible() -> None:
    """
    For a child a test interrupts (C{preexec_fn}): SIGINT as a terminal's Ctrl-C gives
    it, even where the test run itself began with SIGINT ignored, as a shell's
    background job does.  A child inherits an ignored SIGINT, and then neither Python
    nor Twisted installs a handler for it, so the Ctrl-C under test would never arrive.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextmanager
def serving_core(tmp_path: Path, engines: dict[str, Any], **sections: Any) -> Iterator[tuple["subprocess.Popen[bytes]", int]]:
    """
    A real `rhapsode serve` on a free loopback port with C{engines} (this folder's test
    adapters importable), its config's other C{sections} merged over the defaults a test
    wants; yields the process and the port once it answers, and stops it after.
    """
    port = free_port()
    config = {
        "server": {"port": port, "host": "127.0.0.1", "shutdownGraceMs": 1000, **sections.pop("server", {})},
        "workers": {"socketDir": str(tmp_path / "sock"), "voiceDir": str(tmp_path / "voices"), **sections.pop("workers", {})},
        "engines": engines,
        **sections,
    }
    path = tmp_path / "rhapsode.json"
    path.write_text(json.dumps(config))
    log = open(tmp_path / "core.log", "wb")
    here = str(Path(__file__).resolve().parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    rhapsode = str(Path(sys.executable).parent / "rhapsode")
    core = subprocess.Popen([rhapsode, "serve", "--config", str(path)], cwd=tmp_path, stdout=log,
                            stderr=subprocess.STDOUT, env=env, preexec_fn=interruptible)
    try:
        wait_for(lambda: get(port, "/health"), 20, "the core to listen")
        yield core, port
    finally:
        if core.poll() is None:
            core.terminate()
            try:
                core.wait(15)
            except subprocess.TimeoutExpired:
                core.kill()
                core.wait()
        log.close()
