"""
Testing an engine adapter in memory: the real worker over it, in one process, in seconds.

    from rhapsode_worker.testing import WorkerHarness

    def test_my_engine_speaks(tmp_path):
        worker = WorkerHarness(MyEngine, tmp_path)
        assert worker.get("/capabilities").json()["defaultVariant"] == "base"
        audio = worker.post("/speak", {"text": "Hello.", "format": "wav", "stream": False})
        assert audio.code == 200 and audio.body[:4] == b"RIFF"

The harness makes the engine with a L{WorkerContext} under the folder it is given (voices
in C{voices/}, the cache in C{cache/}) and serves it with the worker's own routes,
validation, scheduler, model state, encoders and HTTP site, as L{serve} would, on a
L{MemoryReactorClock}.  Requests go in over an in-memory connection
(C{twisted.test.iosim}) as raw HTTP/1.1 and each answer is read whole, chunked bodies and
their trailers included.  The adapter's blocking calls run on the test's thread, one at a
time, in the order the worker queued them (L{SynchronousPool}): a test sees exactly what
a worker with C{concurrency = 1} would do, with no thread and no socket.

What is not modelled: formats that need ffmpeg (only wav and pcm are produced),
backpressure (the in-memory connection never pauses the synthesis), time that passes
(nothing is timed out) and a process (no handshake, signals or drain by SIGTERM).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from twisted.internet.address import IPv4Address
from twisted.internet.interfaces import IReactorFromThreads
from twisted.internet.protocol import Protocol, connectionDone
from twisted.internet.testing import MemoryReactorClock
from twisted.python.failure import Failure
from twisted.test import iosim
from zope.interface import implementer

from rhapsode_protocol.schemas import CONTRACT_VERSIONS

from ._context import WorkerContext
from ._engine import IEngine
from ._lifecycle import WorkerLifecycle
from ._model import ModelState
from ._pool import in_pool
from ._routes import WorkerApp
from ._schedule import Scheduler

__all__ = ["MemoryWorkerReactor", "SynchronousPool", "WorkerHarness", "WorkerResponse"]

#: The duration of the audio, a header of a buffered answer and a trailer of a streamed one.
DURATION = "x-rhapsode-duration-ms"


@implementer(IReactorFromThreads)
class MemoryWorkerReactor(MemoryReactorClock):
    """
    A memory reactor and clock whose C{callFromThread} runs the call on its next turn,
    as a real reactor runs what a thread hands it.
    """

    def callFromThread(self, callable: Callable[..., Any], *args: object, **kwargs: object) -> None:
        self.callLater(0, callable, *args, **kwargs)


class SynchronousPool:
    """
    A thread pool that runs each call on its reactor's thread, on the reactor's next
    turn, in the order the calls came: the worker's synthesis and file pools, made
    deterministic.  The call's result reaches the reactor as a real pool's does.
    """

    def __init__(self, reactor: MemoryReactorClock) -> None:
        self._reactor = reactor
        #: The name of every function run, in order.
        self.ran: list[str] = []

    def callInThreadWithCallback(
        self, onResult: Callable[[bool, Any], object], func: Callable[..., Any], /, *args: Any, **kw: Any
    ) -> None:
        self._reactor.callLater(0, self._run, onResult, func, args, kw)

    def _run(
        self,
        on_result: Callable[[bool, Any], object],
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kw: dict[str, Any],
    ) -> None:
        self.ran.append(getattr(func, "__name__", repr(func)))
        try:
            result = func(*args, **kw)
        except BaseException:
            on_result(False, Failure())
        else:
            on_result(True, result)


@dataclass(frozen=True)
class WorkerResponse:
    """
    One answer of the worker, read whole.

    @ivar headers: each header's last value, by its lower-case name.
    @ivar trailers: a chunked body's trailers, likewise.
    @ivar complete: False when the worker cut the connection before the body's end (a
        failure after the first audio): the body is then what arrived.
    """

    code: int
    headers: Mapping[str, str]
    body: bytes
    trailers: Mapping[str, str] = field(default_factory=dict)
    complete: bool = True

    def json(self) -> Any:
        return json.loads(self.body)

    def events(self) -> list[tuple[str, Any]]:
        """
        A body of server-sent events (a stream with timestamps) as (event, data) pairs
        in order, each data decoded from JSON.
        """
        found: list[tuple[str, Any]] = []
        for frame in self.body.decode("utf-8").split("\n\n"):
            if not frame.strip():
                continue
            name, data = "message", []
            for line in frame.split("\n"):
                field, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                if field == "event":
                    name = value
                elif field == "data":
                    data.append(value)
            found.append((name, json.loads("\n".join(data))))
        return found

    @property
    def duration_ms(self) -> int | None:
        """
        The audio's length the worker stated (header or trailer), if it stated one.
        """
        value = self.trailers.get(DURATION, self.headers.get(DURATION))
        return int(value) if value is not None else None


class _Reader(Protocol):
    """
    The client end: keeps every byte until the worker closes the connection.
    """

    def __init__(self) -> None:
        self.data = bytearray()
        self.closed: Failure | None = None

    def dataReceived(self, data: bytes) -> None:
        self.data += data

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.closed = reason


def _fields(lines: Sequence[bytes]) -> dict[str, str]:
    found: dict[str, str] = {}
    for line in lines:
        name, _, value = line.decode("latin-1").partition(":")
        found[name.strip().lower()] = value.strip()
    return found


def _parse(raw: bytes) -> WorkerResponse:
    head, separator, rest = raw.partition(b"\r\n\r\n")
    if not separator:
        raise ValueError(f"the worker answered no complete head: {raw[:200]!r}")
    status, *lines = head.split(b"\r\n")
    code = int(status.split(b" ")[1])
    headers = _fields(lines)
    if headers.get("transfer-encoding", "").lower() != "chunked":
        length = int(headers.get("content-length", len(rest)))
        return WorkerResponse(code, headers, bytes(rest[:length]), complete=len(rest) >= length)
    body = bytearray()
    while True:
        size_line, found, rest = rest.partition(b"\r\n")
        if not found:
            return WorkerResponse(code, headers, bytes(body), complete=False)
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            trailer, ended, _ = rest.partition(b"\r\n\r\n")
            if not ended and rest != b"\r\n":
                return WorkerResponse(code, headers, bytes(body), complete=False)
            lines = [line for line in trailer.split(b"\r\n") if line] if ended else []
            return WorkerResponse(code, headers, bytes(body), _fields(lines))
        if len(rest) < size + 2:
            body += rest[:size]
            return WorkerResponse(code, headers, bytes(body), complete=False)
        body += rest[:size]
        rest = rest[size + 2:]


def _multipart(parts: Sequence[tuple[str, str | None, bytes]]) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    out = bytearray()
    for name, filename, data in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode()
        out += data + b"\r\n"
    out += f"--{boundary}--\r\n".encode()
    return bytes(out), f"multipart/form-data; boundary={boundary}"


class WorkerHarness:
    """
    The real worker over one adapter, in memory (see the module's description).

    @param factory: what L{serve} would be given: the engine's class, or any callable
        taking its L{WorkerContext}.
    @param root: a folder of the test's own; the context's voice folder is
        C{root/voices} and its cache C{root/cache}.
    @param environ: the context's environment (the spawn contract's variables and the
        engine's own settings); empty by default, so nothing leaks in from the test's.
    @param name: the id the worker is spawned as, which C{/health} names; the engine's
        own id by default.

    @ivar engine: the adapter, as the harness made it.
    @ivar context: the context it was made with.
    @ivar reactor: the L{MemoryWorkerReactor} everything runs on.
    @ivar pool: the L{SynchronousPool} the adapter's model calls run on.
    @ivar files: the L{SynchronousPool} its voice and fetch calls run on.
    @ivar worker: the worker's routes (C{rhapsode_worker._routes.WorkerApp}), for a test
        that looks at its model state or scheduler.
    """

    peer = IPv4Address("TCP", "127.0.0.1", 40000)
    host = IPv4Address("TCP", "127.0.0.1", 8090)

    def __init__(
        self,
        factory: Callable[[WorkerContext], IEngine],
        root: Path,
        *,
        environ: Mapping[str, str] | None = None,
        name: str | None = None,
    ) -> None:
        self.context = WorkerContext(
            voice_dir=root / "voices", cache_dir=root / "cache", environ=dict(environ or {})
        )
        self.engine = factory(self.context)
        self.reactor = MemoryWorkerReactor()
        self.pool = SynchronousPool(self.reactor)
        self.files = SynchronousPool(self.reactor)
        model = ModelState(self.engine, self.reactor, self.pool)
        scheduler = Scheduler(self.reactor, self.pool, model, self.engine.concurrency)
        lifecycle = WorkerLifecycle(idle=scheduler.when_idle)
        reactor, files = self.reactor, self.files
        self.worker = WorkerApp(
            self.engine,
            reactor=self.reactor,
            scheduler=scheduler,
            model=model,
            formats=("wav", "pcm"),
            ffmpeg=None,
            contract_version=max(CONTRACT_VERSIONS),
            on_terminate=lifecycle.drain,
            blocking=lambda f, *args: in_pool(reactor, files, f, *args),
            lifecycle=lifecycle,
            name=name,
        )
        self._site = self.worker.site(access_log=False)

    def request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        content_type: str = "application/json",
        headers: Mapping[str, str] | None = None,
    ) -> WorkerResponse:
        """
        Send one request on a connection of its own and answer what the worker wrote
        once nothing moves any more.

        @param headers: more request headers (an C{Accept} for timestamps), by name.
        """
        head = [
            f"{method} {path} HTTP/1.1",
            "Host: worker",
            "Connection: close",
            f"Content-Length: {len(body)}",
        ]
        if body:
            head.append(f"Content-Type: {content_type}")
        head.extend(f"{name}: {value}" for name, value in (headers or {}).items())
        server = self._site.buildProtocol(self.peer)
        reader = _Reader()
        pump = iosim.connect(
            server,
            iosim.FakeTransport(server, isServer=True, hostAddress=self.host, peerAddress=self.peer),
            reader,
            iosim.FakeTransport(reader, isServer=False, hostAddress=self.peer, peerAddress=self.host),
            greet=False,
            clock=self.reactor,
        )
        assert reader.transport is not None
        reader.transport.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        self.settle(pump)
        if reader.closed is None:
            raise RuntimeError(f"the worker never finished answering {method} {path}")
        return _parse(bytes(reader.data))

    def settle(self, pump: iosim.IOPump | None = None) -> None:
        """
        Run what is due on the reactor and carry bytes until neither moves: what the
        worker can do without time passing has then been done.
        """
        for _ in range(100_000):
            moved = pump.flush() if pump is not None else False
            due = [c for c in self.reactor.getDelayedCalls() if c.getTime() <= self.reactor.seconds()]
            if due:
                self.reactor.advance(0)
            if not (moved or due):
                return
        raise RuntimeError("the worker never went quiet")

    def get(self, path: str) -> WorkerResponse:
        return self.request("GET", path)

    def post(self, path: str, document: Any = None, headers: Mapping[str, str] | None = None) -> WorkerResponse:
        """
        POST C{document} as JSON (no body when it is None).
        """
        body = b"" if document is None else json.dumps(document).encode("utf-8")
        return self.request("POST", path, body, headers=headers)

    def create_voice(
        self,
        voice_id: str,
        label: str | None = None,
        *,
        reference: tuple[str, bytes] | None = None,
        blend: str | None = None,
        transcript: str | None = None,
    ) -> WorkerResponse:
        """
        C{POST /voices} as a client sends it: multipart, with a reference file
        (C{(filename, bytes)}) or a blend recipe (C{"alto:0.5,bass:0.5"}).
        """
        parts: list[tuple[str, str | None, bytes]] = [("id", None, voice_id.encode())]
        if label is not None:
            parts.append(("label", None, label.encode()))
        if reference is not None:
            parts.append(("reference", reference[0], reference[1]))
        if blend is not None:
            parts.append(("blend", None, blend.encode()))
        if transcript is not None:
            parts.append(("transcript", None, transcript.encode()))
        body, content_type = _multipart(parts)
        return self.request("POST", "/voices", body, content_type)
