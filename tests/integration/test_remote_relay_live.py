"""
The remote engine's speech request (engines/remote, _relay: Twisted's HTTP client, as the
engine's speak() uses it on the reactor) against a real twisted.web server on loopback in
this process (pytest-twisted's reactor): SSE and raw PCM read as they stream, a slow
puller pausing the server, a reader let go mid-stream closing its connection, an error
event, an end without done, a stall, no head in time, a refused connection, a kept-alive
connection reused (and replaced once when the server dropped it), refusals read to a cap,
and HTTPS.  The parser and the body reader alone are tests/unit/test_remote_relay.py.
No test bounds time but as a hang guard.
"""

from __future__ import annotations

import datetime
import json
import socket
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import pytest
import pytest_twisted
from _remote_adapter import DONE, delta, event, load, pcm_of
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IPushProducer
from twisted.internet.task import deferLater
from twisted.web import resource, server
from zope.interface import implementer

from rhapsode_worker import ModelUnavailable

config, client, stream, relay_module = load("_config", "_client", "_stream", "_relay")
Relay, Reader, HOLD = relay_module.Relay, relay_module.Reader, relay_module.HOLD
Unreachable = client.Unreachable

#: A hang guard, never a bound on how fast anything is.
GUARD = 30.0


# -- a real server on loopback -----------------------------------------------------------

@pytest.fixture
def reactor() -> Any:
    """The global reactor, which pytest-twisted runs (imported here, never at module level)."""
    from twisted.internet import reactor as running

    return running


@implementer(IPushProducer)
class Endless:
    """An SSE answer that never ends, written as fast as its transport takes it."""

    def __init__(self, reactor: Any, request: Any) -> None:
        self.reactor, self.request = reactor, request
        self.sent = self.pauses = 0
        self.paused = self.gone = False
        self._call: Any = None
        request.registerProducer(self, True)
        request.notifyFinish().addBoth(lambda _: self.stopProducing())
        self._schedule()

    def _schedule(self) -> None:
        if self._call is None and not (self.paused or self.gone):
            self._call = self.reactor.callLater(0, self._write)

    def _write(self) -> None:
        self._call = None
        piece = pcm_of(self.sent, 12288)
        self.request.write(delta(piece))
        self.sent += len(piece)
        self._schedule()

    def pauseProducing(self) -> None:
        self.paused = True
        self.pauses += 1

    def resumeProducing(self) -> None:
        self.paused = False
        self._schedule()

    def stopProducing(self) -> None:
        self.gone = True
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None


class Speaker(resource.Resource):
    """
    POST answers as C{answer} says (one of the methods below, set by the test); records
    what each request carried, and which requests lost their connection.
    """

    isLeaf = True

    def __init__(self, reactor: Any) -> None:
        super().__init__()
        self.reactor = reactor
        self.answer: Callable[[Any], Any] = self.sse
        self.bodies: list[bytes] = []
        self.keys: list[str | None] = []
        self.types: list[str | None] = []
        self.lost: list[Any] = []
        self.open: list[Any] = []
        #: Each connection a request came on, to be closed after the test.
        self.transports: list[Any] = []
        self.streams: list[Endless] = []
        self.drops = 0

    def render_POST(self, request: Any) -> Any:
        self.bodies.append(request.content.read())
        self.keys.append(request.getHeader("authorization"))
        self.types.append(request.getHeader("content-type"))
        if request.channel.transport not in self.transports:
            self.transports.append(request.channel.transport)
        self.open.append(request)
        request.notifyFinish().addCallbacks(lambda _: self.open.remove(request),
                                            lambda _: (self.open.remove(request), self.lost.append(request)))
        return self.answer(request)

    def sse(self, request: Any) -> Any:
        for n in range(3):
            request.write(delta(pcm_of(n)))
        request.write(DONE)
        request.finish()
        return server.NOT_DONE_YET

    def endless(self, request: Any) -> Any:
        self.streams.append(Endless(self.reactor, request))
        return server.NOT_DONE_YET

    def error_event(self, request: Any) -> Any:
        request.write(delta(pcm_of(1)))
        request.write(event("speech.audio.error", error={"message": "CUDA out of memory"}))
        request.finish()
        return server.NOT_DONE_YET

    def no_done(self, request: Any) -> Any:
        request.write(delta(pcm_of(1)))
        request.finish()
        return server.NOT_DONE_YET

    def one_then_silence(self, request: Any) -> Any:
        request.write(delta(pcm_of(1)))
        return server.NOT_DONE_YET

    def silence(self, request: Any) -> Any:
        return server.NOT_DONE_YET

    def raw(self, request: Any) -> Any:
        return pcm_of(7, 10000)  # with its Content-Length

    def raw_cut_short(self, request: Any) -> Any:
        request.setHeader("Content-Length", "10000")
        request.write(pcm_of(7, 1000))
        self.reactor.callLater(0, request.transport.loseConnection)  # what was written goes first
        return server.NOT_DONE_YET

    def refuse(self, request: Any) -> Any:
        request.setResponseCode(400)
        return json.dumps({"error": {"message": "Unknown speaker 'nobody'", "param": "voice"}}).encode()

    def refuse_at_length(self, request: Any) -> Any:
        request.setResponseCode(503)
        return b"overloaded " * (client.ANSWER_LIMIT // 5)

    def drop_once(self, request: Any) -> Any:
        # A kept-alive connection the server closes as the request arrives: what the
        # client finds when the server dropped an idle connection just as it was reused.
        self.answer = self.sse
        self.drops += 1
        request.transport.abortConnection()
        return server.NOT_DONE_YET

    def drop(self, request: Any) -> Any:
        self.drops += 1
        request.transport.abortConnection()
        return server.NOT_DONE_YET


class Counted(server.Site):
    """A site that counts the connections it accepted."""

    def __init__(self, root: Any) -> None:
        super().__init__(root)
        self.channels: list[Any] = []

    def buildProtocol(self, addr: Any) -> Any:
        channel = super().buildProtocol(addr)
        self.channels.append(channel)
        return channel


@dataclass
class Served:
    reactor: Any
    speaker: Speaker
    site: Counted
    url: str
    relays: list[Any] = field(default_factory=list)

    def relay(self, url: str | None = None, tls: Any = None, **settings: Any) -> Any:
        made = Relay(config.ServerConfig(url=url or self.url, key="sk-test", **settings), self.reactor, tls=tls)
        self.relays.append(made)
        return made


async def until(reactor: Any, check: Callable[[], bool], what: str) -> None:
    """Poll C{check} on the reactor until it holds; fail past the hang guard."""
    waited = 0.0
    while not check():
        assert waited < GUARD, f"waited past the hang guard for {what}"
        await deferLater(reactor, 0.01, lambda: None)
        waited += 0.01


async def cleaned(reactor: Any, served: Served, listening: Any) -> None:
    # A turn first: what the test did last may have run inside the parsing of a read,
    # which pools its connection once it is parsed.
    await deferLater(reactor, 0, lambda: None)
    for made in served.relays:
        await made.close()
    for transport in served.speaker.transports:
        if transport.connected:
            transport.abortConnection()
    await listening.stopListening()
    await until(reactor, lambda: not any(t.connected for t in served.speaker.transports),
                "the server's connections to close")
    await deferLater(reactor, 0, lambda: None)
    # Nothing of the relay's left timed on the reactor: no reader's timer, no pool's.
    from twisted.web.client import HTTPConnectionPool

    left = [call for call in reactor.getDelayedCalls()
            if isinstance(getattr(call.func, "__self__", None), (Reader, HTTPConnectionPool))]
    assert left == []


@pytest_twisted.async_yield_fixture
async def served(reactor: Any) -> AsyncIterator[Served]:
    """A speech server on a loopback port in this process, closed after the test."""
    speaker = Speaker(reactor)
    site = Counted(speaker)
    listening = reactor.listenTCP(0, site, interface="127.0.0.1")
    done = Served(reactor, speaker, site, f"http://127.0.0.1:{listening.getHost().port}")
    yield done
    await cleaned(reactor, done, listening)


async def speech(relay: Any, sse: bool = True) -> AsyncIterator[bytes]:
    """What the engine's speak() does with a relay: the request, then the audio as pulled."""
    response = await relay.request(b"POST", "/v1/audio/speech", b'{"input": "Hello."}')
    assert response.code == 200
    reader = relay.read(response, sse=sse, where=relay.origin)
    try:
        while (pcm := await reader.next()) is not None:
            yield pcm
    finally:
        reader.release()


async def collected(chunks: AsyncIterator[bytes]) -> bytes:
    return b"".join([pcm async for pcm in chunks])


@pytest_twisted.ensureDeferred
async def test_an_sse_answer_is_read_as_it_streams_with_the_key_and_body_sent(served: Served) -> None:
    """
    The deltas' PCM in order, the request carrying its JSON body and the bearer key.
    """
    relay = served.relay()
    assert await collected(speech(relay)) == pcm_of(0) + pcm_of(1) + pcm_of(2)
    assert served.speaker.bodies == [b'{"input": "Hello."}'] and served.speaker.keys == ["Bearer sk-test"]
    assert served.speaker.types == ["application/json"]


@pytest_twisted.ensureDeferred
async def test_a_kept_alive_connection_serves_the_next_request(served: Served) -> None:
    """
    Two answers read to their end, one after the other, over one connection: the
    server accepted one, and the relay opened one.
    """
    relay = served.relay()
    for _ in range(2):
        assert len(await collected(speech(relay))) == 3 * 4800
    assert len(served.site.channels) == 1 and relay.opened == 1
    served.speaker.answer = served.speaker.raw
    assert await collected(speech(relay, sse=False)) == pcm_of(7, 10000)
    assert len(served.site.channels) == 1


@pytest_twisted.ensureDeferred
async def test_a_slow_puller_pauses_the_server_holding_a_bounded_amount(served: Served) -> None:
    """
    A server that writes as fast as it may, to a puller that takes one piece and stops:
    the reader pauses its transport, holds no more than its bound and one read, and the
    server is paused and stops sending; a pull resumes it all; letting go mid-stream
    closes the connection.
    """
    reactor, speaker = served.reactor, served.speaker
    speaker.answer = speaker.endless
    relay = served.relay()
    response = await relay.request(b"POST", "/v1/audio/speech", b"{}")
    reader = relay.read(response, sse=True, where=relay.origin)
    try:
        assert await reader.next()
        most = 0
        quiet = 0
        last = -1

        def settled() -> bool:
            # Paused, and nothing more sent for a while: the kernel's buffers on the way
            # (the server's send buffer grows on its own) are full.
            nonlocal most, quiet, last
            most = max(most, reader.held)
            if not speaker.streams:
                return False
            endless = speaker.streams[0]
            quiet = quiet + 1 if endless.paused and endless.sent == last else 0
            last = endless.sent
            return quiet >= 30

        await until(reactor, settled, "the server to be paused for good")
        endless = speaker.streams[0]
        assert reader.paused and endless.pauses > 0
        assert most <= HOLD + 65536, f"held {most} bytes"
        sent = endless.sent
        assert sent < 64 * 1024 * 1024  # the kernel's buffers, not an endless stream
        assert await reader.next()
        assert not reader.paused
        await until(reactor, lambda: endless.sent > sent, "the server to send again")
    finally:
        reader.release()
    await until(reactor, lambda: speaker.lost != [], "the server to see the connection closed")
    assert speaker.streams[0].gone


@pytest_twisted.ensureDeferred
async def test_closing_the_speech_mid_stream_closes_its_connection(served: Served) -> None:
    """
    aclose() on the audio mid-stream (the client went away) closes the connection: the
    server sees it lost, and the next request opens another rather than reuse half a body.
    """
    served.speaker.answer = served.speaker.endless
    relay = served.relay()
    chunks = speech(relay)
    assert await chunks.__anext__()
    await chunks.aclose()
    await until(served.reactor, lambda: served.speaker.lost != [], "the server to see the connection closed")
    served.speaker.answer = served.speaker.sse
    assert len(await collected(speech(relay))) == 3 * 4800
    assert len(served.site.channels) == 2 and relay.opened == 2


@pytest_twisted.ensureDeferred
async def test_an_error_event_fails_after_the_audio_before_it(served: Served) -> None:
    """speech.audio.error: the audio before it, then model_unavailable with the server's message."""
    served.speaker.answer = served.speaker.error_event
    got: list[bytes] = []
    with pytest.raises(ModelUnavailable, match="CUDA out of memory"):
        async for pcm in speech(served.relay()):
            got.append(pcm)
    assert got == [pcm_of(1)]


@pytest_twisted.ensureDeferred
async def test_an_sse_answer_that_ends_without_done_fails(served: Served) -> None:
    """A body that ends whole but without speech.audio.done is a failure, not a short answer."""
    served.speaker.answer = served.speaker.no_done
    with pytest.raises(ModelUnavailable, match="without speech.audio.done"):
        await collected(speech(served.relay()))


@pytest_twisted.ensureDeferred
async def test_a_raw_body_cut_short_fails(served: Served) -> None:
    """A PCM body that breaks off before its Content-Length is model_unavailable."""
    served.speaker.answer = served.speaker.raw_cut_short
    with pytest.raises(ModelUnavailable, match="broke off"):
        await collected(speech(served.relay(), sse=False))


@pytest_twisted.ensureDeferred
async def test_a_server_silent_mid_stream_stalls_and_is_let_go(served: Served) -> None:
    """
    Silence past stall_seconds while audio is awaited: model_unavailable, and the
    connection closed.
    """
    served.speaker.answer = served.speaker.one_then_silence
    chunks = speech(served.relay(stall_seconds=0.2))
    assert await chunks.__anext__() == pcm_of(1)
    with pytest.raises(ModelUnavailable, match="stall"):
        await chunks.__anext__()
    await until(served.reactor, lambda: served.speaker.lost != [], "the server to see the connection closed")


@pytest_twisted.ensureDeferred
async def test_no_head_in_time_is_unreachable_and_the_connection_closed(served: Served) -> None:
    """
    A server that takes the request and answers nothing: Unreachable past head_seconds,
    saying so, and its connection closed.
    """
    served.speaker.answer = served.speaker.silence
    relay = served.relay(head_seconds=0.2)
    with pytest.raises(Unreachable, match="did not answer within 0.2 s"):
        await relay.request(b"POST", "/v1/audio/speech", b"{}")
    await until(served.reactor, lambda: served.speaker.lost != [], "the server to see the connection closed")


@pytest_twisted.ensureDeferred
async def test_a_cancelled_wait_for_the_head_is_cancelled_not_unreachable(served: Served) -> None:
    """
    The SDK cancelling the pull that waits for the head (its client went away) ends it
    with CancelledError, never as a server that cannot be reached, and closes the
    connection.
    """
    served.speaker.answer = served.speaker.silence
    relay = served.relay()
    waiting = Deferred.fromCoroutine(relay.request(b"POST", "/v1/audio/speech", b"{}"))
    await until(served.reactor, lambda: served.speaker.open != [], "the request to arrive")
    waiting.cancel()
    with pytest.raises(CancelledError):
        await waiting
    await until(served.reactor, lambda: served.speaker.lost != [], "the server to see the connection closed")


@pytest_twisted.ensureDeferred
async def test_a_refused_connection_is_unreachable(reactor: Any) -> None:
    """Nothing listening: Unreachable, saying the connection was refused."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    relay = Relay(config.ServerConfig(url=f"http://127.0.0.1:{port}"), reactor)
    with pytest.raises(Unreachable, match="could not be reached .*refused"):
        await relay.request(b"POST", "/v1/audio/speech", b"{}")
    await relay.close()


@pytest_twisted.ensureDeferred
async def test_a_kept_alive_connection_the_server_dropped_is_replaced_once(served: Served) -> None:
    """
    A reused connection the server closes as the request arrives: the request goes once
    more, on a new connection, and is answered.  A new connection dropped is not tried
    again: Unreachable.
    """
    relay = served.relay()
    await collected(speech(relay))
    served.speaker.answer = served.speaker.drop_once
    assert len(await collected(speech(relay))) == 3 * 4800
    assert served.speaker.drops == 1 and len(served.site.channels) == 2
    served.speaker.answer = served.speaker.drop
    fresh = served.relay()
    with pytest.raises(Unreachable, match="dropped the connection"):
        await fresh.request(b"POST", "/v1/audio/speech", b"{}")
    assert served.speaker.drops == 2


@pytest_twisted.ensureDeferred
async def test_a_refusal_is_read_to_the_cap(served: Served) -> None:
    """
    An error status's body is read for the server's message and param (its connection
    then serves the next request), and one longer than ANSWER_LIMIT is read no further
    (its connection closed, not pooled).
    """
    relay = served.relay()
    served.speaker.answer = served.speaker.refuse
    response = await relay.request(b"POST", "/v1/audio/speech", b"{}")
    error = await relay.error_of(response)
    assert (error.status, error.message, error.param) == (400, "Unknown speaker 'nobody'", "voice")
    refused = stream.refusal(error, relay.origin, "nobody")
    assert refused.code == "unknown_voice"
    served.speaker.answer = served.speaker.refuse_at_length
    response = await relay.request(b"POST", "/v1/audio/speech", b"{}")
    error = await relay.error_of(response)
    assert error.status == 503 and error.message.startswith("overloaded")
    await until(served.reactor, lambda: not served.speaker.transports[-1].connected,
                "the long answer's connection to close")
    assert len(served.speaker.transports) == 1  # the refusal, read whole, left its connection for the next


def self_signed() -> tuple[bytes, bytes]:
    """A certificate for localhost and its key, PEM."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


@pytest.mark.filterwarnings("ignore:Passing pyOpenSSL:DeprecationWarning")  # the test server's own certificate
@pytest_twisted.ensureDeferred
async def test_an_https_server_is_spoken_to_over_tls(reactor: Any) -> None:
    """
    A URL that says https: TLS to the server (verified against the roots given), the
    SSE read as over plain HTTP, the connection kept alive for the next request.
    """
    ssl = pytest.importorskip("twisted.internet.ssl")
    cert_pem, key_pem = self_signed()
    certificate = ssl.PrivateCertificate.loadPEM(cert_pem + key_pem)
    speaker = Speaker(reactor)
    site = Counted(speaker)
    listening = reactor.listenSSL(0, site, certificate.options(), interface="127.0.0.1")
    url = f"https://localhost:{listening.getHost().port}"
    served = Served(reactor, speaker, site, url)
    try:
        trusted = ssl.Certificate.loadPEM(cert_pem)
        relay = served.relay(tls=lambda host: ssl.optionsForClientTLS(host, trustRoot=trusted))
        for _ in range(2):
            assert await collected(speech(relay)) == pcm_of(0) + pcm_of(1) + pcm_of(2)
        assert len(site.channels) == 1
    finally:
        await cleaned(reactor, served, listening)
