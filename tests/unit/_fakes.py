"""
Fakes of the core's own seams (rhapsode._interfaces), each written once and checked
against the interface it stands in for, so a change to a seam breaks its fake here
rather than letting the tests drift from the code.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Mapping, Sequence

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IPushProducer
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http_headers import Headers
from zope.interface import implementer
from zope.interface.verify import verifyObject

from rhapsode._interfaces import IAudioSink, ISupervisor, ITimedSink, IWorkerClient
from rhapsode_protocol.errors import SpeechError

Answer = tuple[int, Any]


class FakeResponse:
    """
    A worker's HTTP response, its body delivered at once when a reader asks for it.
    """

    def __init__(self, code: int, body: bytes, headers: dict[bytes, bytes]) -> None:
        self.code = code
        self.headers = Headers({name: [value] for name, value in headers.items()})
        self._body = body

    def deliverBody(self, protocol: Any) -> None:
        protocol.makeConnection(StringTransport())
        protocol.dataReceived(self._body)
        protocol.connectionLost(Failure(ResponseDone()))


@implementer(IWorkerClient)
class FakeClient:
    """
    A worker's client that answers small JSON exchanges from a table (or its
    C{fallback}) and leaves every streamed request in flight, recording all of them.

    @ivar calls: every (method, path) asked, JSON or not, in order.
    @ivar requests: every request's (method, path, body), JSON or not, in order.
    @ivar pending: the streamed requests' Deferreds, for a test to fire or watch being
        cancelled.
    """

    address = "unix:/fake/worker.sock"

    def __init__(
        self,
        answers: dict[tuple[bytes, str], Answer] | None = None,
        fallback: Callable[[bytes, str], Answer] | None = None,
        *,
        hold: bool = False,
    ) -> None:
        self.answers = dict(answers or {})
        self.fallback = fallback
        #: With C{hold}, every JSON exchange waits on a Deferred of L{asked} that the
        #: test fires (or leaves unanswered) instead of answering at once.
        self.hold = hold
        self.asked: list[Deferred[Answer]] = []
        self.calls: list[tuple[bytes, str]] = []
        self.requests: list[tuple[bytes, str, Any]] = []
        #: The headers each streamed request was sent with, in order.
        self.sent_headers: list[Any] = []
        self.pending: list[Deferred[Any]] = []
        self.aborted = 0

    def request(self, method: bytes, path: str, body: Any = None, headers: Any = None) -> "Deferred[Any]":
        self.calls.append((method, path))
        self.requests.append((method, path, body))
        self.sent_headers.append(dict(headers or {}))
        d: Deferred[Any] = Deferred()
        self.pending.append(d)
        return d

    async def json(self, method: bytes, path: str, body: Any = None) -> tuple[int, Any]:
        self.calls.append((method, path))
        self.requests.append((method, path, body))
        if self.hold:
            answer: Deferred[Answer] = Deferred()
            self.asked.append(answer)
            return await answer
        if (method, path) in self.answers or self.fallback is None:
            return self.answers[(method, path)]
        return self.fallback(method, path)

    def abort_all(self) -> None:
        self.aborted += 1

    def close(self) -> "Deferred[None]":
        return succeed(None)


@implementer(ISupervisor)
class FakeSupervisor:
    """
    A worker's supervisor whose process starts at once (pid 4242 when it was down) and
    stops when told; it counts its starts.
    """

    def __init__(self, state: str = "down", pid: int | None = None, *, startable: bool = True) -> None:
        self.state = state
        self.pid = pid
        #: Whether the test lets the process be started or stopped at all.
        self.startable = startable
        self.starts = 0
        self.stops: list[bool] = []
        self.listeners: list[Callable[[str], None]] = []
        self.hangs: list[str] = []

    def start(self) -> "Deferred[str]":
        assert self.startable, "nothing may be spawned"
        self.starts += 1
        if self.state != "up":
            self.state, self.pid = "up", 4242
        return succeed("unix:/x")

    def stop(self, ask: bool = True) -> "Deferred[None]":
        assert self.startable, "nothing may be stopped"
        self.stops.append(ask)
        return succeed(None)

    def health(self) -> dict[str, Any]:
        return {"process": self.state, "restarts": 0}

    def hung(self, why: str) -> None:
        self.hangs.append(why)


@implementer(IAudioSink)
class RecordingSink:
    """
    An audio sink that records what the relay does to it: the head, every write, the
    producer it was given, and how it ended.
    """

    def __init__(self) -> None:
        self.finished: Deferred[None] = Deferred()
        self.started = False
        self.code: int | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.written: list[bytes] = []
        self.producer: IPushProducer | None = None
        self.ended: int | None | bool = False
        self.aborted: SpeechError | None | bool = False

    def gathered(self) -> AbstractContextManager[None]:
        return nullcontext()

    def begin(self, code: int, headers: Sequence[tuple[bytes, bytes]]) -> None:
        self.started = True
        self.code = code
        self.headers = list(headers)

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def room(self) -> "Deferred[None]":
        return succeed(None)

    def registerProducer(self, producer: IPushProducer) -> None:
        self.producer = producer

    def unregisterProducer(self) -> None:
        self.producer = None

    def end(self, duration_ms: int | None) -> None:
        self.ended = duration_ms

    def abort(self, error: SpeechError | None) -> "Deferred[None]":
        self.aborted = error
        return succeed(None)


@implementer(ITimedSink)
class TimedRecordingSink(RecordingSink):
    """
    A sink that can carry timings: it records, in one list beside the writes, what came
    in order (("audio", bytes) and ("timestamps", entries)).
    """

    def __init__(self) -> None:
        super().__init__()
        self.order: list[tuple[str, Any]] = []

    def write(self, data: bytes) -> None:
        super().write(data)
        self.order.append(("audio", data))

    def timestamps(self, alignment: Sequence[Mapping[str, Any]]) -> None:
        self.order.append(("timestamps", list(alignment)))


def _check(*fakes: Any) -> None:
    for fake, interface in fakes:
        verifyObject(interface, fake)


_check((RecordingSink(), IAudioSink), (TimedRecordingSink(), ITimedSink), (FakeClient(), IWorkerClient), (FakeSupervisor(), ISupervisor))
