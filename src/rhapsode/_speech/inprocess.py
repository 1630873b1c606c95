"""
An utterance answered in memory, for the doors that hand audio back inside a document of
their own (MCP's speak tools, the batch): a L{MemorySink} the relay writes a buffered
answer to, as it writes one to an HTTP response, so the ceiling, the residency lease, the
buffer budget and the error taxonomy are the ones C{POST /speak} applies.

A buffered answer only: a streamed one needs a reader to push back on, and none of these
callers asks for one.  The answer's bytes stay counted against the core's buffer budget
until the caller has used them and said so (L{MemorySink.release}); they are kept in the
pieces they arrived in, and L{base64_pieces} encodes them piece by piece, so no copy of
the whole answer is ever made that the budget does not count.
"""

from __future__ import annotations

import base64
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IPushProducer
from zope.interface import implementer

from rhapsode_protocol.errors import SpeechError

from .._interfaces import ITimedSink

__all__ = ["Answer", "MemorySink", "base64_pieces", "base64_size"]


@dataclass
class Answer:
    """
    What an utterance answered: its status, its headers, and its bytes in the pieces
    they came in.
    """

    code: int = 200
    headers: dict[bytes, bytes] = field(default_factory=dict)
    pieces: list[bytes] = field(default_factory=list)
    #: The timings of an utterance that asked for timestamps, else None.
    alignment: list[Mapping[str, Any]] | None = None

    @property
    def size(self) -> int:
        return sum(map(len, self.pieces))

    @property
    def body(self) -> bytes:
        """
        The bytes joined: a copy, which the buffer budget does not count.
        """
        return b"".join(self.pieces)

    @property
    def content_type(self) -> str:
        return self.headers.get(b"content-type", b"").decode("latin-1")

    def header(self, name: bytes) -> str | None:
        value = self.headers.get(name.lower())
        return value.decode("latin-1") if value is not None else None


@implementer(ITimedSink)
class MemorySink:
    """
    Collects one buffered answer in memory.

    @ivar answer: what was written, once L{end} has been called.
    @ivar broken: the reason the answer could not be whole, if it could not.
    """

    def __init__(self) -> None:
        self.finished: Deferred[None] = Deferred()
        self.started = False
        self.answer = Answer()
        self.broken: SpeechError | None = None
        self._parts: list[bytes] = []
        self.whole = False

    def gathered(self) -> AbstractContextManager[None]:
        return nullcontext()

    def begin(self, code: int, headers: Sequence[tuple[bytes, bytes]]) -> None:
        self.started = True
        self.answer.code = code
        self.answer.headers = {name.lower(): value for name, value in headers}

    def write(self, data: bytes) -> None:
        self._parts.append(data)

    def timestamps(self, alignment: Sequence[Mapping[str, Any]]) -> None:
        if self.answer.alignment is None:
            self.answer.alignment = []
        self.answer.alignment.extend(alignment)

    def room(self) -> "Deferred[None]":
        return succeed(None)  # the pieces are the answer: nothing holds them twice

    def registerProducer(self, producer: IPushProducer) -> None:
        pass  # memory never pushes back

    def unregisterProducer(self) -> None:
        pass

    def end(self, duration_ms: int | None) -> None:
        self.answer.pieces, self._parts = self._parts, []
        self.whole = True

    def abort(self, error: SpeechError | None) -> "Deferred[None]":
        self.broken = error or SpeechError("the answer broke off")
        return succeed(None)

    def release(self) -> None:
        """
        The caller is done with the answer: what it held of the core's buffer budget is
        given back.  Releasing twice is harmless.
        """
        if not self.finished.called:
            self.finished.callback(None)


def base64_size(size: int) -> int:
    """
    How many bytes C{size} bytes take in base64 (padded).
    """
    return 4 * -(-size // 3)


def base64_pieces(pieces: Iterable[bytes]) -> list[bytes]:
    """
    C{pieces} in base64, one encoded piece per piece (a piece's last one or two bytes
    carried into the next, so that they join into the encoding of the whole).
    """
    encoded: list[bytes] = []
    carry = b""
    for piece in pieces:
        if carry:
            piece = carry + piece
        cut = len(piece) - len(piece) % 3
        carry = piece[cut:]
        if cut:
            encoded.append(base64.b64encode(piece[:cut] if carry else piece))
    if carry:
        encoded.append(base64.b64encode(carry))
    return encoded
