"""
The speech request on the reactor thread: Twisted's HTTP client (an C{Agent} over a
persistent C{HTTPConnectionPool} per server, so one utterance's first byte does not pay
a TCP handshake), and the answer's body read as it arrives into an asynchronous puller.

The engine's C{speak()} is an asynchronous generator the SDK pulls on the reactor, a
chunk at a time as its reader takes them: L{Relay.request} waits for the response's head
(within C{head_seconds}, else the server is L{Unreachable}), and L{Reader} hands the
body's audio over as it is pulled.  A reader that stops pulling stops this one reading:
once more than L{HOLD} bytes of audio wait here, the connection's transport is paused,
and with its receive buffer kept at L{RECEIVE_BUFFER} the pause reaches the server.
Only silence while the SDK waits for audio counts against C{stall_seconds}.  A body not
read to its end is never pooled: its connection is closed when the reader lets it go.

Nothing here blocks; the blocking client (L{rhapsode_engine_remote._client.Server}) still
serves the calls the SDK runs on threads (the prober, C{load()}, voices, uploads).
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING, Any, Callable
from urllib.parse import urlsplit

from twisted.internet.abstract import isIPAddress, isIPv6Address
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.endpoints import HostnameEndpoint, TCP4ClientEndpoint, TCP6ClientEndpoint, wrapClientTLS
from twisted.internet.error import ConnectError, ConnectionDone, ConnectionLost, DNSLookupError
from twisted.internet.interfaces import IDelayedCall, IProtocol, IProtocolFactory, IStreamClientEndpoint
from twisted.internet.protocol import Protocol, connectionDone
from twisted.python.failure import Failure
from twisted.web.client import Agent, HTTPConnectionPool, ResponseDone, ResponseFailed
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgentEndpointFactory, IBodyProducer, IResponse
from zope.interface import implementer

from rhapsode_worker import ModelUnavailable, SpeechError

from ._client import _IDLE, ANSWER_LIMIT, RECEIVE_BUFFER, ServerError, Unreachable, _message
from ._config import ServerConfig
from ._stream import Events

if TYPE_CHECKING:
    from twisted.internet.interfaces import IConsumer

#: Audio held for the puller before the server's transport is paused.  What one read of
#: the socket brings (64 KiB) may still arrive after the pause, so a reader holds at most
#: this and one read, besides an SSE event not yet whole (L{_stream._LINE_LIMIT}).
HOLD = 128 * 1024
#: What may follow C{speech.audio.done} before the body's end: more is not waited for.
_AFTER_DONE = 64 * 1024


def _why(reason: Failure) -> str:
    """A connection failure in a few words: the system's, or the error's name."""
    error = reason.value
    if isinstance(error, ConnectError) and error.args and error.args[0]:
        return str(error.args[0])
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return type(error).__name__


def _inner(reason: Failure) -> list[Failure]:
    """The failures a Twisted HTTP client error wraps (C{reasons}), or the one it is."""
    reasons = getattr(reason.value, "reasons", None)
    return list(reasons) if reasons else [reason]


@implementer(IBodyProducer)
class _Bytes:
    """
    A request body already in memory, written at once: Twisted's C{FileBodyProducer}
    would write it a reactor turn later, through a cooperator.
    """

    def __init__(self, data: bytes) -> None:
        self._data = data
        self.length = len(data)

    def startProducing(self, consumer: "IConsumer") -> "Deferred[None]":
        consumer.write(self._data)
        return succeed(None)

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass


def _buffered(protocol: Any) -> Any:
    # A socket's receive buffer set small, so that a paused reader's pause reaches the
    # server (see _client.RECEIVE_BUFFER); on the TCP transport, under any TLS layer.
    protocol.transport.getHandle().setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
    return protocol


@implementer(IStreamClientEndpoint)
class _Counted:
    """
    A TCP endpoint whose connections get the small receive buffer, counted as they are
    opened (L{Relay.request} tells a reused connection from a new one by the count).
    """

    def __init__(self, endpoint: IStreamClientEndpoint, endpoints: "_Endpoints") -> None:
        self._endpoint = endpoint
        self._endpoints = endpoints

    def connect(self, protocolFactory: IProtocolFactory) -> "Deferred[IProtocol]":
        self._endpoints.opened += 1
        return self._endpoint.connect(protocolFactory).addCallback(_buffered)


@implementer(IAgentEndpointFactory)
class _Endpoints:
    """
    Where one server's connections go, whatever the request's URI: its host (an address
    is connected to without asking a resolver, whose lookups run on threads), its port,
    and TLS when its URL is https.

    @ivar opened: how many connections it was asked to open.
    """

    def __init__(self, reactor: Any, config: ServerConfig, tls: Callable[[str], Any] | None) -> None:
        parts = urlsplit(config.url)
        host = parts.hostname or ""
        https = parts.scheme == "https"
        port = parts.port or (443 if https else 80)
        self.opened = 0
        endpoint: IStreamClientEndpoint
        if isIPAddress(host):
            endpoint = TCP4ClientEndpoint(reactor, host, port, timeout=config.head_seconds)
        elif isIPv6Address(host):
            endpoint = TCP6ClientEndpoint(reactor, host, port, timeout=config.head_seconds)
        else:
            endpoint = HostnameEndpoint(reactor, host, port, timeout=config.head_seconds)
        endpoint = _Counted(endpoint, self)
        if https:
            if tls is None:
                # Imported only for a server that needs it: it is pyOpenSSL's.
                from twisted.internet.ssl import optionsForClientTLS

                tls = optionsForClientTLS
            endpoint = wrapClientTLS(tls(host), endpoint)
        self._endpoint = endpoint

    def endpointForURI(self, uri: Any) -> IStreamClientEndpoint:
        # The Agent asks for every request, pooled connection or not: made once.
        return self._endpoint


class Relay:
    """
    One speech server, asked on the reactor thread: its kept-alive connections, and its
    speech requests.

    @param reactor: the reactor to connect and time with.
    @param tls: makes the client TLS options for a host name (an https server); by
        default Twisted's C{optionsForClientTLS}, which trusts the platform's roots.
    """

    def __init__(self, config: ServerConfig, reactor: Any, tls: Callable[[str], Any] | None = None) -> None:
        self.config = config
        self._reactor = reactor
        self._endpoints = _Endpoints(reactor, config, tls)
        self._pool = HTTPConnectionPool(reactor, persistent=True)
        self._pool.maxPersistentPerHost = _IDLE
        # Twisted retries only idempotent methods; a speech POST is retried here, once,
        # where a kept-alive connection turned out closed (L{request}).
        self._pool.retryAutomatically = False
        self._agent = Agent.usingEndpointFactory(reactor, self._endpoints, pool=self._pool)
        self._url = config.url.encode()
        parts = urlsplit(config.url)
        host = parts.hostname or ""
        if isIPv6Address(host):
            host = f"[{host}]"
        if parts.port not in (None, 443 if parts.scheme == "https" else 80):
            host += f":{parts.port}"
        raw = {b"Host": [host.encode("idna")], b"Accept": [b"*/*"], b"User-Agent": [b"rhapsode-worker"]}
        if config.key:
            raw[b"Authorization"] = [f"Bearer {config.key}".encode()]
        # Made once, with the Host header the Agent would otherwise copy them to add.
        self._headers = Headers({**raw, b"Content-Type": [b"application/json"]})

    @property
    def origin(self) -> str:
        return self.config.origin

    @property
    def opened(self) -> int:
        """How many connections were opened to the server."""
        return self._endpoints.opened

    def close(self) -> "Deferred[None]":
        """Close the idle connections (on the reactor thread)."""
        closed: Deferred[None] = self._pool.closeCachedConnections()
        return closed

    async def request(self, method: bytes, path: str, body: bytes) -> IResponse:
        """
        Send a request with a JSON body and answer its response once the head is in,
        whatever its status.  The caller reads the body with L{read} or L{error_of},
        which let the connection go.  A kept-alive connection the server closed before
        answering is replaced by a new one, once.

        @raise Unreachable: refused, reset, unresolvable, or no head within the
            variant's C{head_seconds}.
        @raise CancelledError: the caller's wait was cancelled (the connection is closed).
        """
        url = self._url + path.encode()
        head = self.config.head_seconds
        for attempt in (0, 1):
            opened = self._endpoints.opened
            answer = self._agent.request(method, url, self._headers, _Bytes(body))
            reused = self._endpoints.opened == opened
            late: list[bool] = []

            def give_up(answer: "Deferred[IResponse]" = answer) -> None:
                late.append(True)
                answer.cancel()

            timer = self._reactor.callLater(head, give_up)
            try:
                return await answer
            except Exception:
                reason = Failure()
            finally:
                if timer.active():
                    timer.cancel()
            if late:
                raise Unreachable(f"{self.origin} did not answer within {head:g} s") from None
            inner = _inner(reason)
            if reason.check(CancelledError) or any(r.check(CancelledError) for r in inner):
                raise CancelledError()
            if reason.check(ConnectError, DNSLookupError):
                raise Unreachable(f"{self.origin} could not be reached ({_why(reason)})") from None
            if all(r.check(ConnectionDone, ConnectionLost) for r in inner):
                if reused and attempt == 0:
                    continue  # the server closed an idle connection: once more, on a new one
                raise Unreachable(f"{self.origin} dropped the connection ({_why(inner[0])})") from None
            if reason.check(ResponseFailed):
                raise Unreachable(f"{self.origin} answered with no usable head ({_why(inner[0])})") from None
            raise Unreachable(f"{self.origin} could not be reached ({_why(inner[0])})") from None
        raise AssertionError("unreachable: the second attempt returns or raises")

    def read(self, response: IResponse, sse: bool, where: str) -> "Reader":
        """
        The response's body as audio (vLLM-Omni's SSE when C{sse}, else raw PCM), to be
        pulled with L{Reader.next} and let go with L{Reader.release}.
        """
        reader = Reader(self._reactor, where, self.config.stall_seconds, Events(where) if sse else None)
        response.deliverBody(reader)
        reader.started()
        return reader

    async def error_of(self, response: IResponse) -> ServerError:
        """
        The error a response that is not the audio carries, its body read to the cap
        (what came before a stall or a cut, if one comes).
        """
        reader = self.read(response, sse=False, where=self.origin)
        raw = bytearray()
        try:
            while len(raw) < ANSWER_LIMIT:
                piece = await reader.next()
                if piece is None:
                    break
                raw += piece
        except SpeechError:
            pass
        finally:
            reader.release()
        message, param = _message(bytes(raw[:ANSWER_LIMIT]))
        return ServerError(response.code, message, param)


class Reader(Protocol):
    """
    A response body as audio, delivered by Twisted and pulled by the engine: L{next}
    answers what is held (waiting for more if nothing is), and L{release} lets the
    connection go.  More than L{HOLD} bytes held pauses the transport; a pull that takes
    them resumes it.

    @param events: vLLM-Omni's events, for an SSE body; None for raw PCM.
    """

    def __init__(self, reactor: Any, where: str, stall_seconds: float, events: Events | None) -> None:
        self._reactor = reactor
        self._where = where
        self._stall_seconds = stall_seconds
        self._events = events
        self._held: list[bytes] = []
        self._size = 0
        self._paused = False
        self._waiter: Deferred[None] | None = None
        self._timer: IDelayedCall | None = None
        self._failure: SpeechError | None = None
        #: No more audio comes: speech.audio.done, or a raw body's clean end.
        self._ended = False
        #: The body ended or broke off (Twisted told connectionLost).
        self._closed = False
        self._released = False
        #: next() waited for the body's end after speech.audio.done.
        self._settled = False
        self._closer: IDelayedCall | None = None
        self._after_done = 0
        #: Audio has been pulled: later audio wakes the puller at the end of the turn.
        self._pulled = False
        self._soon: IDelayedCall | None = None

    @property
    def held(self) -> int:
        """The bytes of audio waiting to be pulled."""
        return self._size

    @property
    def paused(self) -> bool:
        """Whether this reader paused the connection's transport."""
        return self._paused

    # -- what Twisted delivers ---------------------------------------------------------

    def connectionMade(self) -> None:
        # The body's transport: Twisted's proxy of the connection's, a push producer
        # (pause, resume) that can also lose the connection.
        self._transport: Any = self.transport

    def started(self) -> None:
        # Response.deliverBody resumes the transport after handing over what it held,
        # which may have been enough to pause it.
        if self._paused and not self._closed:
            self._transport.pauseProducing()

    def dataReceived(self, data: bytes) -> None:
        if self._ended or self._released or self._failure is not None:
            self._after(len(data))
            return
        if self._events is None:
            self._hold(data)
        else:
            try:
                for pcm in self._events.feed(data):
                    self._hold(pcm)
            except SpeechError as error:
                self._fail(error)
            if self._events.done:
                self._ended = True
        if self._size > HOLD and not (self._paused or self._ended or self._closed):
            self._paused = True
            self._transport.pauseProducing()
        if self._held or self._ended or self._failure is not None:
            if self._pulled:
                self._wake_soon()
            else:
                self._wake()  # the first audio: at once
        elif self._waiter is not None and self._timer is not None:
            self._timer.reset(self._stall_seconds)  # part of an event: the server is not silent

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._closed = True
        self._stop_timer()
        if self._closer is not None:
            self._closer.cancel()
            self._closer = None
        if not (self._ended or self._released or self._failure is not None):
            if reason.check(ResponseDone) or (self._events is None and reason.check(PotentialDataLoss)):
                # A raw body whose end is the connection's close (neither a length nor
                # chunks) is whole when it closes.
                if self._events is None:
                    self._ended = True
                else:
                    try:
                        self._events.end()
                    except SpeechError as error:
                        self._failure = error
            else:
                self._failure = ModelUnavailable(f"{self._where} broke off its audio ({_why(_inner(reason)[0])})")
        self._wake()

    # -- what the engine pulls -----------------------------------------------------------

    async def next(self) -> bytes | None:
        """
        The audio held (all of it, in one piece), waiting for some while none is; None
        once the body has ended whole.

        @raise ModelUnavailable: the body failed (after the audio before the failure was
            taken), broke off, or stalled past C{stall_seconds} while this waited.
        """
        while True:
            if self._held:
                pcm = self._held[0] if len(self._held) == 1 else b"".join(self._held)
                self._held = []
                self._size = 0
                self._pulled = True
                if self._paused:
                    self._paused = False
                    if not self._closed:
                        self._transport.resumeProducing()
                return pcm
            if self._failure is not None:
                raise self._failure
            if self._ended:
                if not self._closed and not self._settled:
                    # speech.audio.done came, and the body's end is most often in the
                    # read Twisted is still parsing: wait for it, a reactor turn at most,
                    # so that the connection is back in the pool before the end is told
                    # (a request made at once then reuses it).
                    self._settled = True
                    await self._wait(0, self._wake)
                return None
            await self._wait(self._stall_seconds, self._stalled)

    def _wait(self, seconds: float, then: Callable[[], None]) -> "Deferred[None]":
        self._waiter = Deferred(self._cancelled)
        self._timer = self._reactor.callLater(seconds, then)
        return self._waiter

    def release(self) -> None:
        """
        Let the connection go: a body read to its end has gone back to the pool; one
        whose speech.audio.done came is read to its end (briefly: L{_AFTER_DONE} bytes,
        C{stall_seconds}) so that it can; any other is closed.
        """
        if self._released:
            return
        self._released = True
        self._held = []
        self._size = 0
        self._waiter = None
        self._stop_timer()
        if self._soon is not None:
            self._soon.cancel()
            self._soon = None
        if self._closed:
            return
        if self._ended and self._failure is None:
            if self._paused:
                self._paused = False
                self._transport.resumeProducing()
            self._timer = self._reactor.callLater(self._stall_seconds, self._close)
            return
        self._close()

    # -- inside ----------------------------------------------------------------------------

    def _hold(self, pcm: bytes) -> None:
        if pcm:
            self._held.append(pcm)
            self._size += len(pcm)

    def _after(self, size: int) -> None:
        # What comes after the audio ended, failed or was let go: read away, not kept.
        self._after_done += size
        if self._after_done > _AFTER_DONE or self._failure is not None:
            self._close()

    def _fail(self, error: SpeechError) -> None:
        self._failure = error
        self._close()

    def _close(self) -> None:
        # A reactor turn later: this runs inside Twisted's parsing of a read (or inside
        # the engine's, woken by it), and a body whose end is in that read goes back to
        # the pool whole; closed under the parser, it would be pooled closed.
        self._stop_timer()
        if not self._closed and self._closer is None:
            self._closer = self._reactor.callLater(0, self._close_now)

    def _close_now(self) -> None:
        self._closer = None
        if not self._closed:
            self._closed = True
            self._transport.loseConnection()

    def _stalled(self) -> None:
        self._timer = None
        self._fail(ModelUnavailable(f"{self._where} stopped sending audio past its stall time"))
        self._wake()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            if self._timer.active():
                self._timer.cancel()
            self._timer = None

    def _cancelled(self, waiter: "Deferred[None]") -> None:
        # The puller's wait was cancelled (its client went away): the Deferred fails
        # with CancelledError into next(), and the engine's finally releases this.
        if self._waiter is waiter:
            self._waiter = None
            self._stop_timer()

    def _wake_soon(self) -> None:
        # Twisted hands over a read's chunks one at a time, each an event or two: woken
        # at the end of the turn, the puller takes all that the read brought in one
        # piece, which leaves the worker in one send rather than one per event.
        if self._waiter is not None and self._soon is None:
            self._soon = self._reactor.callLater(0, self._woken)

    def _woken(self) -> None:
        self._soon = None
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            self._stop_timer()
            waiter.callback(None)
