"""
HTTP/1.1 to a worker, one connection at a time (protocol.md section 1).

The core talks to workers it spawned, or to workers named by URL, on the hot path of
every request: a general-purpose client spends more time building header objects and
chaining Deferreds than the worker spends answering a sentence.  This is the narrow
client the core needs and nothing more: one request per connection at a time, bodies
framed by Content-Length, chunked encoding (trailers kept, which twisted.web's client
discards) or the connection's end, and a response whose body is delivered to a
protocol as it arrives, with the connection itself as that protocol's push producer so
that a slow reader pauses the worker's socket.

It parses responses from a peer the core trusts (a worker it spawned or was configured
with), never a client's request, and it is strict where that costs nothing: a chunk size
is hex digits only, trailers are bounded, and a transfer-encoding other than exactly
chunked is refused.  It can go back to twisted.web's Agent the day Agent hands a client
the trailers (twisted/twisted#12014, "Parse and make the trailing headers available to
HTTP Agent"): the worker's duration trailer is why it exists.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, cast

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IConsumer, IPushProducer
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone, ResponseFailed
from twisted.web.iweb import UNKNOWN_LENGTH
from zope.interface import implementer

from rhapsode_protocol.http.site import send_now

__all__ = ["Connection", "Headers", "ProtocolError", "WorkerResponse", "encode_request"]

#: A response head larger than this is not a worker's.
MAX_HEAD = 64 * 1024
#: Nor is a chunk-size or trailer line longer than this.
_MAX_LINE = 8 * 1024
#: Nor does a worker end a body with more trailer fields than this.
MAX_TRAILERS = 16
#: A chunk size: hex digits only (int(x, 16) also takes "0x10", "1_0" and " +a ").
_HEX = frozenset(b"0123456789abcdefABCDEF")
#: How much one read from a worker's socket may take: about twice Twisted's 64 KiB.
#: Audio comes in batches of up to 256 KiB, and each read becomes a chunk relayed to the
#: client, with its write, send and wake-up.  Measured with interleaved runs: streamed
#: throughput through the core 0.80-0.83 -> 0.87-0.88 of direct, core CPU for 2000
#: realtime streams 24.7-26.0 % -> 22.6-23.2 % of a core; the cost is memory, since a
#: slow listener can hold one larger read in the core: peak RSS for those 2000 streams
#: 93-94 -> 105-122 MB (the target is 150), and 84-90 MB since writes to clients go to
#: the kernel as they are made (rhapsode_protocol.http.site.send_now).  It is 64 bytes short of 128 KiB so that a
#: read relayed with its chunk framing still fits one send (Twisted sends at most 128
#: KiB at a time; a full 128 KiB read went as a send and then a 2-byte one).  Twisted
#: also pauses a producer writing to the socket at this size, so a voice upload queues
#: up to this much for the worker.
READ_SIZE = 128 * 1024 - 64


#: How every body that ends as framed ends, made once: a Failure works out its
#: exception's class names when made, and this is the one made for every request.
_ENDED = Failure(ResponseDone("the body ended as framed"))


class ProtocolError(Exception):
    """
    The worker's bytes are not HTTP/1.1 this client can read.
    """


class Headers:
    """
    Response header fields by lower-cased name; read-only after parsing.
    """

    __slots__ = ("_fields",)

    def __init__(self, fields: dict[bytes, list[bytes]] | None = None) -> None:
        self._fields = fields or {}

    def getRawHeaders(self, name: bytes, default: Any = None) -> Any:
        return self._fields.get(name.lower(), default)


class WorkerResponse:
    """
    A worker's answer once its head is in: C{code}, C{phrase}, C{headers}; the body is
    read with L{deliverBody}, and C{trailers} holds the chunked body's trailer fields
    (lower-cased names) once it has ended.
    """

    def __init__(self, connection: "Connection", code: int, phrase: bytes, headers: Headers) -> None:
        self.code = code
        self.phrase = phrase
        self.headers = headers
        self.trailers: dict[bytes, bytes] = {}
        self._connection = connection

    def deliverBody(self, protocol: Protocol) -> None:
        """
        Give the body to C{protocol} as it arrives: C{makeConnection} with a transport
        that pauses, resumes and stops the worker's socket, C{dataReceived} per piece,
        then C{connectionLost} with L{ResponseDone} when the body ended as framed, or
        with L{ResponseFailed} when it did not.
        """
        self._connection.deliver(protocol)


def encode_request(
    method: bytes, target: bytes, host: bytes, headers: dict[bytes, list[bytes]], length: Any
) -> bytes:
    """
    A request head; C{length} is a byte count, L{UNKNOWN_LENGTH} for a chunked body, or
    None for no body.
    """
    lines = [b"%s %s HTTP/1.1\r\nHost: %s\r\n" % (method, target, host)]
    for name, values in headers.items():
        for value in values:
            if b"\r" in value or b"\n" in value or b"\r" in name or b"\n" in name:
                raise ValueError(f"header {name!r} carries a line break")
            lines.append(b"%s: %s\r\n" % (name, value))
    if length is UNKNOWN_LENGTH:
        lines.append(b"Transfer-Encoding: chunked\r\n")
    elif length is not None:
        lines.append(b"Content-Length: %d\r\n" % length)
    lines.append(b"\r\n")
    return b"".join(lines)


@implementer(IConsumer)
class _ChunkedConsumer:
    """
    What a streamed request body is written to: each write becomes one chunk.
    """

    def __init__(self, transport: Any) -> None:
        self._transport = transport

    def write(self, data: bytes) -> None:
        if data:
            self._transport.writeSequence([b"%x\r\n" % len(data), data, b"\r\n"])

    def registerProducer(self, producer: Any, streaming: bool) -> None:
        self._transport.registerProducer(producer, streaming)

    def unregisterProducer(self) -> None:
        self._transport.unregisterProducer()


@implementer(IPushProducer)
class _BodyTransport:
    """
    The transport a body protocol sees: the worker's socket as a push producer.
    Stopping it gives up on the body and closes the connection.  Once its body has
    ended it does nothing, so a stale reader cannot touch the connection's next request.
    """

    def __init__(self, connection: "Connection", response: WorkerResponse | None) -> None:
        self._connection = connection
        self._response = response

    def _current(self) -> bool:
        return self._connection._response is self._response

    def pauseProducing(self) -> None:
        if self._current():
            self._connection.pause("reader")

    def resumeProducing(self) -> None:
        if self._current():
            self._connection.resume("reader")

    def stopProducing(self) -> None:
        if self._current():
            self._connection.abandon()

    def loseConnection(self) -> None:
        self.stopProducing()


# Parser states.
_IDLE, _HEAD, _BODY_LENGTH, _BODY_CLOSE, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILER, _DONE, _GONE = range(10)


class Connection(Protocol):
    """
    One connection to a worker, carrying one request at a time.

    C{on_idle(connection)} is called when a response has been read to its end and the
    connection may carry another request; C{on_lost(connection)} when it has closed.
    """

    def __init__(self, on_idle: Callable[["Connection"], None], on_lost: Callable[["Connection"], None]) -> None:
        self._on_idle = on_idle
        self._on_lost = on_lost
        self._state = _IDLE
        self._buffer = b""
        self._waiting: Deferred[WorkerResponse] | None = None
        self._response: WorkerResponse | None = None
        self._reader: Protocol | None = None
        self._held: list[bytes] = []
        self._ending: Failure | None = None
        self._pauses: set[str] = set()
        self._remaining = 0
        self._keep = True
        self._method = b""
        self._sending = False
        self._producer: Any = None
        self._parsing = False
        self.lost: Deferred[None] = Deferred()

    def connectionMade(self) -> None:
        if self.transport is not None and hasattr(self.transport, "bufferSize"):
            self.transport.bufferSize = READ_SIZE

    @property
    def busy(self) -> bool:
        return self._state != _IDLE or self._sending

    # -- sending ---------------------------------------------------------------------

    def request(self, method: bytes, head: bytes, body: Any) -> "Deferred[WorkerResponse]":
        """
        Write one request (its encoded C{head}, then C{body}: None, bytes, or an
        C{IBodyProducer}) and wait for the response head.
        """
        if self.busy:
            raise RuntimeError("a worker connection carries one request at a time")
        self._method = method
        self._state = _HEAD
        self._keep = True
        self._waiting = Deferred(self._cancel)
        waiting = self._waiting
        transport = self.transport
        assert transport is not None
        if body is None or isinstance(body, bytes):
            # The whole request in one send, now: the worker starts on it this turn.
            send_now(transport, head if body is None else head + body)
        else:
            transport.write(head)
            self._send_streamed(body)
        return waiting

    def _send_streamed(self, producer: Any) -> None:
        transport = self.transport
        chunked = producer.length is UNKNOWN_LENGTH
        consumer: Any = _ChunkedConsumer(transport) if chunked else transport
        self._sending = True
        self._producer = producer
        transport.registerProducer(producer, True)  # type: ignore[union-attr]

        def sent(_: Any) -> None:
            if self._producer is not producer:
                return
            self._producer = None
            self._sending = False
            if self._state == _GONE:
                return
            transport.unregisterProducer()  # type: ignore[union-attr]
            if chunked:
                transport.write(b"0\r\n\r\n")  # type: ignore[union-attr]
            if self._state == _IDLE:
                # The response ended before the body did: the worker gave up on it, so
                # this connection's framing cannot be trusted for another request.
                self._close()

        def failed(failure: Failure) -> None:
            if self._producer is not producer:
                return
            self._producer = None
            self._sending = False
            if self._state != _GONE:
                transport.unregisterProducer()  # type: ignore[union-attr]
            # A body cut short leaves the request unframed: the connection goes with it,
            # so the worker lets go of the request now rather than at its idle timeout.
            self._drop(failure)

        producer.startProducing(consumer).addCallbacks(sent, failed)

    def _cancel(self, waiting: Deferred[WorkerResponse]) -> None:
        # Cancelled before the head came: the request is abandoned with the connection.
        self._waiting = None
        self._drop(Failure(CancelledError()))

    # -- receiving -------------------------------------------------------------------

    def dataReceived(self, data: bytes) -> None:
        if self._state == _DONE:
            # After the body, before its reader came: kept, so the connection is not reused.
            self._buffer += data
            return
        if self._state in (_IDLE, _GONE):
            if self._state == _IDLE and data:
                # Bytes nobody asked for: this connection is out of step.
                self._drop(Failure(ProtocolError("the worker sent bytes with no request outstanding")))
            return
        if self._buffer:
            self._buffer += data
        else:
            self._buffer = data
        if self._reader is None and self._state == _HEAD:
            # The head first: answering it is what gives the body its reader (most often
            # at once), whose gathering then takes in the pieces this read carries after it.
            self._parse(head_only=True)
        # A reader that can gather its writes (a relay: WatchedBody.gathered) has what
        # this read brings, the body's end among it, leave for its client in one send.
        gathered = getattr(self._reader, "gathered", None)
        if gathered is None:
            self._parse()
            return
        with gathered():
            self._parse()

    def _parse(self, head_only: bool = False) -> None:
        if self._parsing:
            return
        self._parsing = True
        try:
            while self._buffer and self._state not in (_IDLE, _DONE, _GONE):
                if head_only and self._state != _HEAD:
                    break
                if not self._step():
                    break
        except ProtocolError as error:
            self._drop(Failure(error))
        finally:
            self._parsing = False

    def _step(self) -> bool:
        """
        Consume what the current state can from the buffer; False when it needs more.
        """
        state = self._state
        buffer = self._buffer
        if state == _CHUNK_DATA or state == _BODY_LENGTH:
            size = len(buffer)
            if size <= self._remaining:
                self._buffer = b""
                self._remaining -= size
                piece = buffer
            else:
                piece = buffer[: self._remaining]
                self._buffer = buffer[self._remaining :]
                self._remaining = 0
            self._body(piece)
            if self._remaining == 0 and self._state == state:
                if state == _CHUNK_DATA:
                    self._state = _CHUNK_END
                else:
                    self._end_body()
            return True
        if state == _BODY_CLOSE:
            self._buffer = b""
            self._body(buffer)
            return True
        if state == _CHUNK_END:
            if len(buffer) < 2:
                return False
            if buffer[:2] != b"\r\n":
                raise ProtocolError("a chunk did not end with CRLF")
            self._buffer = buffer[2:]
            self._state = _CHUNK_SIZE
            return True
        if state == _CHUNK_SIZE:
            line = self._line("chunk-size")
            if line is None:
                return False
            line = line.split(b";", 1)[0].rstrip(b" \t")
            if not line or not _HEX.issuperset(line) or len(line) > 15:
                raise ProtocolError(f"bad chunk size {line[:20]!r}")
            size = int(line, 16)
            if size == 0:
                self._state = _TRAILER
            else:
                self._remaining = size
                self._state = _CHUNK_DATA
            return True
        if state == _TRAILER:
            line = self._line("trailer")
            if line is None:
                return False
            if not line:
                self._end_body()
                return True
            name, colon, value = line.partition(b":")
            if not colon or not name or name != name.strip():
                raise ProtocolError(f"bad trailer line {line[:60]!r}")
            if self._response is not None:
                trailers = self._response.trailers
                if len(trailers) >= MAX_TRAILERS:
                    raise ProtocolError(f"more than {MAX_TRAILERS} trailer fields")
                trailers[name.lower()] = value.strip()
            return True
        # _HEAD
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(buffer) > MAX_HEAD:
                raise ProtocolError(f"a response head over {MAX_HEAD} bytes")
            return False
        self._buffer = buffer[end + 4 :]
        self._head(buffer[:end])
        return True

    def _line(self, what: str) -> bytes | None:
        """
        The next CRLF-ended line taken from the buffer, or None until it is all in.
        """
        end = self._buffer.find(b"\r\n")
        if end < 0:
            if len(self._buffer) > _MAX_LINE:
                raise ProtocolError(f"a {what} line is too long")
            return None
        line = self._buffer[:end]
        self._buffer = self._buffer[end + 2 :]
        return line

    def _head(self, raw: bytes) -> None:
        lines = raw.split(b"\r\n")
        status = lines[0].split(b" ", 2)
        if len(status) < 2 or not status[0].startswith(b"HTTP/1.") or not status[1].isdigit():
            raise ProtocolError(f"bad status line {lines[0][:60]!r}")
        code = int(status[1])
        if 100 <= code < 200:
            return  # informational: the real answer follows
        fields: dict[bytes, list[bytes]] = {}
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon or not name or name != name.strip():
                raise ProtocolError(f"bad header line {line[:60]!r}")
            fields.setdefault(name.lower(), []).append(value.strip())
        connection = b",".join(fields.get(b"connection", [])).lower()
        if status[0] == b"HTTP/1.0":
            self._keep = b"keep-alive" in connection
        elif b"close" in connection:
            self._keep = False
        response = WorkerResponse(self, code, status[2] if len(status) > 2 else b"", Headers(fields))
        self._response = response
        encoding = b",".join(fields.get(b"transfer-encoding", [])).lower()
        length = fields.get(b"content-length")
        if self._method == b"HEAD" or code in (204, 304):
            self._state = _DONE
        elif encoding:
            # Exactly chunked: "gzip, chunked" would relay gzip bytes as audio.
            if encoding.strip() != b"chunked":
                raise ProtocolError(f"unsupported transfer-encoding {encoding!r}")
            self._state = _CHUNK_SIZE
        elif length is not None:
            if len(set(length)) != 1 or not length[0].isdigit():
                raise ProtocolError(f"bad content-length {length!r}")
            self._remaining = int(length[0])
            self._state = _BODY_LENGTH if self._remaining else _DONE
        else:
            self._keep = False
            self._state = _BODY_CLOSE
        if self._state == _DONE:
            self._end_body()
        waiting, self._waiting = self._waiting, None
        if waiting is not None:
            waiting.callback(response)
        if self._reader is None and self._response is response and self._state not in (_DONE, _GONE):
            # Nobody reads the body yet: hold what came and stop reading the socket.
            self.pause("unread")

    def _body(self, piece: bytes) -> None:
        if self._reader is not None:
            self._reader.dataReceived(piece)
        else:
            self._held.append(piece)

    def _end_body(self) -> None:
        self._state = _DONE
        self._finish(_ENDED)

    def _finish(self, ending: Failure) -> None:
        """
        The body has ended (well or badly): tell its reader, or keep the ending for the
        reader still to come.
        """
        if self._reader is None:
            self._ending = ending
            return
        reader, self._reader = self._reader, None
        reuse = isinstance(ending.value, ResponseDone) and self._state == _DONE
        if reuse:
            self._recycle()
        reader.connectionLost(ending)

    def _recycle(self) -> None:
        self._response = None
        self._pauses.discard("reader")
        self._pauses.discard("unread")
        if self._keep and not self._buffer and not self._sending and self._producer is None:
            self._state = _IDLE
            if self.transport is not None:
                cast(IPushProducer, self.transport).resumeProducing()
            self._on_idle(self)
        elif self._sending:
            # The rest of a request body is still going out; close once it has.
            self._state = _IDLE
            self._keep = False
            if self.transport is not None:
                cast(IPushProducer, self.transport).resumeProducing()
        else:
            self._close()

    def deliver(self, reader: Protocol) -> None:
        if self._reader is not None:
            raise RuntimeError("a body is delivered once")
        reader.makeConnection(_BodyTransport(self, self._response))
        held, self._held = self._held, []
        ending, self._ending = self._ending, None
        self._reader = reader
        if held or ending is not None:
            # What came before the reader leaves as one send too, its end among it.
            gathered = getattr(reader, "gathered", None)
            with gathered() if gathered is not None else nullcontext():
                for piece in held:
                    reader.dataReceived(piece)
                if ending is not None:
                    self._finish(ending)
            if ending is not None:
                return
        self.resume("unread")
        if self._buffer and not self._parsing:
            self._parse()

    # -- flow and ending ---------------------------------------------------------------

    def pause(self, why: str) -> None:
        if not self._pauses and self.transport is not None and self._state != _GONE:
            cast(IPushProducer, self.transport).pauseProducing()
        self._pauses.add(why)

    def resume(self, why: str) -> None:
        if why not in self._pauses:
            return
        self._pauses.discard(why)
        if not self._pauses and self.transport is not None and self._state != _GONE:
            cast(IPushProducer, self.transport).resumeProducing()

    def abandon(self) -> None:
        """
        The reader wants no more of this body: drop the connection.
        """
        if self._state in (_GONE, _IDLE):
            return
        self._drop(Failure(ResponseFailed([Failure(ConnectionDone("the reader stopped the body"))])))

    def _close(self) -> None:
        self._state = _GONE
        if self.transport is not None:
            self.transport.loseConnection()

    def _drop(self, reason: Failure) -> None:
        """
        Give up on the connection now and fail whatever is outstanding on it.
        """
        self._fail(reason)
        if self.transport is not None:
            abort = getattr(self.transport, "abortConnection", None)
            (abort or self.transport.loseConnection)()

    def _fail(self, reason: Failure) -> None:
        state, self._state = self._state, _GONE
        waiting, self._waiting = self._waiting, None
        producer, self._producer = self._producer, None
        self._sending = False
        if producer is not None:
            producer.stopProducing()
        if waiting is not None:
            waiting.errback(reason)
        elif state not in (_IDLE, _DONE, _GONE) and self._response is not None:
            if reason.check(ResponseFailed) is None:
                reason = Failure(ResponseFailed([reason]))
            self._finish(reason)

    def connectionLost(self, reason: Failure = Failure(ConnectionDone())) -> None:
        state = self._state
        if state == _BODY_CLOSE:
            # A body framed by the connection's end has ended.
            self._state = _DONE
            self._finish(Failure(ResponseDone("the body ended with the connection")))
        elif state not in (_IDLE, _DONE, _GONE):
            self._fail(reason)
        else:
            producer, self._producer = self._producer, None
            if producer is not None:
                producer.stopProducing()
        self._state = _GONE
        self._on_lost(self)
        self.lost.callback(None)
