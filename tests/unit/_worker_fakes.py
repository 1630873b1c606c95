"""
The worker SDK's test fakes, each written once and checked, as this module is imported,
against the interface it stands in for (zope's verifyObject, or the SDK's own protocol for
a thread pool): a fake process and the reactor that spawns it (the encoder's ffmpeg), a
pool that runs its calls when the test says, a reactor whose callFromThread runs at once,
and a PCM source that records what its consumer asked of it.

The core's fakes (its supervisor's process reactor, its worker client) are the core's
tests'; nothing here stands in for a seam of the core.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

from twisted.internet.error import ProcessExitedAlready
from twisted.internet.testing import MemoryReactorClock
from twisted.internet.interfaces import (
    IConsumer,
    IProcessProtocol,
    IProcessTransport,
    IProducer,
    IPushProducer,
    IReactorFromThreads,
    IReactorProcess,
)
from twisted.python.failure import Failure
from zope.interface import implementer
from zope.interface.verify import verifyObject

from rhapsode_worker._pool import WorkerPool
from rhapsode_worker.testing import MemoryWorkerReactor, SynchronousPool

__all__ = [
    "FakePool",
    "FakeProcess",
    "FakeProcessReactor",
    "ImmediateReactor",
    "MemoryWorkerReactor",
    "RecordingProducer",
    "SynchronousPool",
]


@implementer(IProcessTransport, IConsumer)
class FakeProcess:
    """
    A process transport that records what the encoder asks of it.
    """

    def __init__(self) -> None:
        self.pid: int | None = 4242
        self.stdin = b""
        self.calls: list[str] = []
        self.producer: IProducer | None = None

    def write(self, data: bytes) -> None:
        self.stdin += data

    def writeSequence(self, seq: Iterable[bytes]) -> None:
        self.stdin += b"".join(seq)

    def writeToChild(self, childFD: int, data: bytes) -> None:
        raise NotImplementedError

    def closeStdin(self) -> None:
        self.calls.append("closeStdin")

    def closeStdout(self) -> None:
        self.calls.append("closeStdout")

    def closeStderr(self) -> None:
        self.calls.append("closeStderr")

    def closeChildFD(self, descriptor: int) -> None:
        self.calls.append(f"closeChildFD {descriptor}")

    def loseConnection(self) -> None:
        self.calls.append("loseConnection")

    def signalProcess(self, signalID: str | int) -> None:
        if self.pid is None:
            raise ProcessExitedAlready()
        self.calls.append(f"signal {signalID}")

    def getPeer(self) -> Any:
        raise NotImplementedError

    def getHost(self) -> Any:
        raise NotImplementedError

    def registerProducer(self, producer: IProducer, streaming: bool) -> None:
        self.producer = producer

    def unregisterProducer(self) -> None:
        self.producer = None

    def pauseProducing(self) -> None:
        self.calls.append("pause")

    def resumeProducing(self) -> None:
        self.calls.append("resume")


class Spawned(NamedTuple):
    """One process a L{FakeProcessReactor} spawned, with what it was spawned with."""

    executable: str
    argv: list[str]
    env: dict[str, str]
    protocol: IProcessProtocol
    process: Any


@implementer(IReactorProcess)
class FakeProcessReactor(MemoryReactorClock):
    """
    A clock and memory reactor whose spawnProcess makes a fake process (a L{FakeProcess}
    by default, or what C{make_process(pid, protocol)} makes), connects its protocol, and
    records it; it raises C{spawn_error} instead where the test set one.  The one fake
    process reactor of the suite: the encoder's tests and the supervisor's use it.
    """

    def __init__(self, make_process: Callable[[int, IProcessProtocol], Any] | None = None) -> None:
        super().__init__()
        self._make = make_process or (lambda pid, protocol: FakeProcess())
        self.spawned: list[Spawned] = []
        self.spawn_error: OSError | None = None

    def spawnProcess(
        self,
        processProtocol: IProcessProtocol,
        executable: bytes | str,
        args: Sequence[bytes | str],
        env: Mapping[Any, Any] | None = None,
        path: None | bytes | str = None,
        uid: int | None = None,
        gid: int | None = None,
        usePTY: bool = False,
        childFDs: Mapping[int, int | str] | None = None,
    ) -> IProcessTransport:
        if self.spawn_error is not None:
            raise self.spawn_error
        process = self._make(1000 + len(self.spawned), processProtocol)
        processProtocol.makeConnection(process)
        self.spawned.append(Spawned(str(executable), [str(a) for a in args], dict(env or {}), processProtocol, process))
        process_transport: IProcessTransport = process
        return process_transport


@implementer(IPushProducer)
class RecordingProducer:
    """
    A PCM source that records the producer calls it receives.
    """

    def __init__(self) -> None:
        self.calls: list[str] = []

    def pauseProducing(self) -> None:
        self.calls.append("pause")

    def resumeProducing(self) -> None:
        self.calls.append("resume")

    def stopProducing(self) -> None:
        self.calls.append("stop")


class FakePool:
    """
    Holds calls made "in a thread" until L{run_next} runs the oldest one.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[Callable[[bool, Any], object], Callable[..., Any], tuple[Any, ...]]] = []

    def callInThreadWithCallback(
        self, on_result: Callable[[bool, Any], object], f: Callable[..., Any], /, *args: Any, **kw: Any
    ) -> None:
        self.calls.append((on_result, f, args))

    def run_next(self) -> None:
        on_result, f, args = self.calls.pop(0)
        try:
            result = f(*args)
        except BaseException:
            on_result(False, Failure())
        else:
            on_result(True, result)

    def run_all(self) -> None:
        while self.calls:
            self.run_next()

    def run_any(self, pick: Callable[[int], int]) -> None:
        """
        Run one waiting call, the one C{pick(len(calls))} chooses: threads finish in
        whatever order they do.
        """
        self.calls.insert(0, self.calls.pop(pick(len(self.calls))))
        self.run_next()


@implementer(IReactorFromThreads)
class ImmediateReactor:
    """
    Runs what a thread hands it at once, on the calling thread; its clock reads C{now},
    which only the test moves.
    """

    def __init__(self) -> None:
        self.now = 0.0

    def seconds(self) -> float:
        return self.now

    def callFromThread(self, callable: Callable[..., Any], *args: object, **kwargs: object) -> None:
        callable(*args, **kwargs)


verifyObject(IProcessTransport, FakeProcess())
verifyObject(IReactorProcess, FakeProcessReactor())
verifyObject(IPushProducer, RecordingProducer())
verifyObject(IReactorFromThreads, ImmediateReactor())
verifyObject(IReactorFromThreads, MemoryWorkerReactor())
for _pool in (FakePool(), SynchronousPool(MemoryWorkerReactor())):
    assert isinstance(_pool, WorkerPool), _pool
