"""
A socket transport for unit tests: Twisted's own write buffering and producer handling
(L{FileDescriptor}) over a pretend kernel that takes only as many bytes as it has room;
and a push producer that counts what was asked of it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from twisted.internet.abstract import FileDescriptor
from twisted.internet.address import IPv4Address
from twisted.internet.interfaces import IPushProducer
from twisted.internet.testing import MemoryReactor
from zope.interface import implementer


@implementer(IPushProducer)
class Producer:
    """
    A push producer that counts how often it was paused, resumed and stopped.
    """

    def __init__(self) -> None:
        self.paused = 0
        self.resumed = 0
        self.stopped = 0

    def pauseProducing(self) -> None:
        self.paused += 1

    def resumeProducing(self) -> None:
        self.resumed += 1

    def stopProducing(self) -> None:
        self.stopped += 1


class FakeSocket(FileDescriptor):
    """
    C{sent} lists what each send handed to the kernel; C{room} is how many more bytes
    the kernel will take (None: any number) and C{cap} the most one send takes (as
    Twisted's sockets send at most 128 KiB at a time); C{fail} makes every send fail
    as a lost connection does.  The reactor's C{getWriters()} says whether the socket asked to
    be polled for writability.  C{abortConnection} tells the protocol set as C{protocol}
    that the connection is gone, and notes C{aborted}.
    """

    def __init__(self, room: int | None = None) -> None:
        self.memory_reactor = MemoryReactor()
        super().__init__(self.memory_reactor)
        self.connected = 1
        self.room = room
        self.cap: int | None = None
        self.sent: list[bytes] = []
        self.fail: BaseException | None = None
        self.host = IPv4Address("TCP", "127.0.0.1", 8080)
        self.host_asked = 0
        self.aborted = False

    def writeSomeData(self, data: Any) -> int | BaseException:
        if self.fail is not None:
            return self.fail
        size = len(data) if self.room is None else min(len(data), self.room)
        if self.cap is not None:
            size = min(size, self.cap)
        if size:
            self.sent.append(bytes(data[:size]))
        if self.room is not None:
            self.room -= size
        return size

    @property
    def polled_for_writing(self) -> bool:
        return self in self.memory_reactor.getWriters()

    def queued(self) -> int:
        return len(self.dataBuffer) - self.offset + self._tempDataLen

    def abortConnection(self) -> None:
        # As a TCP connection aborts: its protocol is told at once that it is gone.
        from twisted.internet.error import ConnectionAborted
        from twisted.python.failure import Failure

        self.aborted = True
        self.connected = 0
        protocol = getattr(self, "protocol", None)
        if protocol is not None:
            protocol.connectionLost(Failure(ConnectionAborted()))

    def getPeer(self) -> IPv4Address:
        return IPv4Address("TCP", "127.0.0.1", 50000)

    def getHost(self) -> IPv4Address:
        self.host_asked += 1
        return self.host


@contextmanager
def recorded(events: list[Any]) -> Iterator[None]:
    """
    A gathering (a job's C{gather}, a reader's C{gathered}) that notes in C{events}
    where it begins ("gather") and where what it held would leave ("sent").
    """
    events.append("gather")
    try:
        yield
    finally:
        events.append("sent")
