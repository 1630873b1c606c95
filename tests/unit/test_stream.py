"""
The WebSocket speech stream (rhapsode._doors.stream) in memory: the core's real site, router,
relay and preflight over a fake engine (rhapsode.testing), a wsproto client on an
in-memory connection (twisted.test.iosim), and time moved only by the test's clock.

The server side's socket takes one producer at a time, as a real socket does, so the
HTTP channel left registered after the upgrade would fail these tests as it fails a real
server; the client is plain wsproto, so every close code and reason can be read.
"""

from __future__ import annotations

import gc
import json
from typing import Any, Iterator

import pytest
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Protocol
from twisted.logger import formatEvent, globalLogPublisher
from twisted.python.failure import Failure
from twisted.test import iosim
from twisted.web.websocket import WebSocketClientEndpoint
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from zope.interface import implementer

from rhapsode._doors import stream as _stream
from rhapsode._speech.relay import StreamRelay
from rhapsode.testing import FakeEngine, StubRhapsode, default_capabilities
from rhapsode_protocol.errors import Overloaded

PATH = "/v1/audio/speech/stream"
SERVER = IPv4Address("TCP", "127.0.0.1", 8080)
PIECE = b"\x01\x00" * 2400  # 100 ms of 24 kHz PCM


@implementer(IPushProducer)
class Socket(iosim.FakeTransport):
    """
    The server's end of an in-memory connection that, like a real socket, takes one
    producer at a time (twisted.internet.abstract.FileDescriptor raises the same way).
    """

    def registerProducer(self, producer: Any, streaming: bool) -> None:
        if self.producer is not None:
            raise RuntimeError(
                f"Cannot register producer {producer}, because producer {self.producer} was never unregistered."
            )
        super().registerProducer(producer, streaming)


class Client(Protocol):
    """
    A WebSocket client written on wsproto: what it receives, in order, as JSON objects,
    bytes, ("close", code, reason), ("rejected", status, body) or ("accepted",).
    """

    def __init__(self, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.headers = headers or []
        self.received: list[Any] = []
        self.lost = False
        self._text = ""
        self._bytes = b""
        self._status = 0
        self._body = b""

    def connectionMade(self) -> None:
        handshake = Request(host="127.0.0.1", target=PATH, extra_headers=self.headers)
        self.transport.write(self.ws.send(handshake))  # type: ignore[union-attr]

    def dataReceived(self, data: bytes) -> None:
        self.ws.receive_data(data)
        for event in self.ws.events():
            if isinstance(event, AcceptConnection):
                self.received.append(("accepted",))
            elif isinstance(event, RejectConnection):
                self._status = event.status_code
            elif isinstance(event, RejectData):
                self._body += event.data
                if event.body_finished:
                    self.received.append(("rejected", self._status, json.loads(self._body)))
            elif isinstance(event, TextMessage):
                self._text += event.data
                if event.message_finished:
                    self.received.append(json.loads(self._text))
                    self._text = ""
            elif isinstance(event, BytesMessage):
                self._bytes += event.data
                if event.message_finished:
                    self.received.append(self._bytes)
                    self._bytes = b""
            elif isinstance(event, CloseConnection):
                self.received.append(("close", int(event.code), event.reason))
                if self.ws.state is ConnectionState.REMOTE_CLOSING:  # not an answer to our own
                    self.transport.write(self.ws.send(event.response()))  # type: ignore[union-attr]

    def connectionLost(self, reason: Failure = Failure(Exception())) -> None:
        self.lost = True

    def send(self, message: Any) -> None:
        """
        Send C{message}: a dict as JSON text, a str as it is, bytes as a binary message.
        """
        if isinstance(message, bytes):
            event: Any = BytesMessage(data=message)
        else:
            event = TextMessage(data=message if isinstance(message, str) else json.dumps(message))
        self.transport.write(self.ws.send(event))  # type: ignore[union-attr]

    def frames(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in self.received if isinstance(m, dict) and m.get("type") == kind]

    def audio(self) -> bytes:
        return b"".join(m for m in self.received if isinstance(m, bytes))

    def closed(self) -> tuple[int, str] | None:
        for m in self.received:
            if isinstance(m, tuple) and m[0] == "close":
                return m[1], m[2]
        return None

    def shape(self) -> list[str]:
        """
        What arrived, in order, as words: a message's type, "audio" for bytes, "close".
        """
        shown = []
        for m in self.received:
            if isinstance(m, dict):
                shown.append(m["type"])
            elif isinstance(m, bytes):
                shown.append("audio")
            else:
                shown.append(m[0])
        return shown


class Harness:
    """
    A stub core over one fake engine, C{fake}, and in-memory connections to its site.
    """

    def __init__(self, engine: FakeEngine | None = None, *, idle_timeout: float | None = None) -> None:
        self.engine = engine if engine is not None else FakeEngine(audio=[PIECE, PIECE])
        self.stub = StubRhapsode({"fake": self.engine})
        self.clock = self.stub.clock
        # The stub has no public handle on its core; the tests need the core's site with
        # a chosen idle timeout, and its stream sessions.
        self.core = self.stub.core
        if idle_timeout is not None:
            self.core.idle_timeout = idle_timeout
        self.site = self.core.site(access_log=False)
        self.pumps: list[iosim.IOPump] = []
        self.sockets: list[Socket] = []

    def connect(
        self, client: Protocol | None = None, headers: list[tuple[bytes, bytes]] | None = None, flush: bool = True
    ) -> Any:
        client = client if client is not None else Client(headers)
        peer = IPv4Address("TCP", "127.0.0.1", 40000 + len(self.pumps))
        server = self.site.buildProtocol(peer)
        socket = Socket(server, isServer=True, hostAddress=SERVER, peerAddress=peer)
        pump = iosim.connect(
            server, socket, client, iosim.FakeTransport(client, isServer=False, hostAddress=peer, peerAddress=SERVER),
            greet=False, clock=self.clock,
        )
        self.pumps.append(pump)
        self.sockets.append(socket)
        if flush:
            self.flush()
        return client

    def open(self, **config: Any) -> Client:
        """
        A client connected and configured (model "fake" unless C{config} says).
        """
        client = self.connect()
        assert client.received == [("accepted",)]
        client.send({"type": "session.config", "model": "fake", **config})
        self.flush()
        return client

    def flush(self) -> None:
        for _ in range(1000):
            if not any([pump.flush() for pump in self.pumps]):
                return
        raise RuntimeError("the connections never went quiet")

    def advance(self, seconds: float, step: float = 0.1) -> None:
        """
        Move the clock on C{seconds}, C{step} at a time (a timer set while the clock
        moves runs in a later step, as it would in a running reactor).
        """
        steps = max(round(seconds / step), 1)
        for _ in range(steps):
            self.clock.advance(seconds / steps)
            self.flush()

    def sessions(self) -> set[Any]:
        return self.core.streams.sessions

    def close(self) -> None:
        self.flush()
        self.core.close()


@pytest.fixture(autouse=True)
def no_failure_logged() -> Iterator[None]:
    """
    Every test here also fails if anything logged a failure (an unexpected exception in
    the session, the relay or twisted.web) or an unhandled error in a Deferred.
    """
    failures: list[dict[str, Any]] = []

    def observe(event: dict[str, Any]) -> None:
        if "log_failure" in event or event.get("isError"):
            failures.append(event)

    globalLogPublisher.addObserver(observe)
    try:
        yield
        gc.collect()  # a Deferred's unhandled failure is logged when it is collected
    finally:
        globalLogPublisher.removeObserver(observe)
    assert [formatEvent(e) + str(e.get("log_failure", "")) for e in failures] == []


@pytest.fixture()
def harness() -> Iterator[Harness]:
    made = Harness()
    yield made
    made.close()


def say(harness: Harness, client: Client, *messages: Any) -> None:
    for message in messages:
        client.send(message)
    harness.flush()


def text(words: str) -> dict[str, Any]:
    return {"type": "input.text", "text": words}


DONE = {"type": "input.done"}


# -- speaking -----------------------------------------------------------------------------


def test_each_sentence_is_spoken_as_soon_as_the_next_word_begins(harness: Harness) -> None:
    """
    Text fed a word at a time is spoken a sentence at a time, each once the next word's
    first letter has arrived: its audio.start (the rate from the worker's Content-Type),
    its PCM as binary messages and its audio.done; input.done speaks the rest and ends
    the utterance with session.done.
    """
    client = harness.open()
    for word in ["Hello", " there.", " "]:
        say(harness, client, text(word))
    assert client.shape() == ["accepted"] and harness.engine.spoken == []
    say(harness, client, text("How"))
    assert [s["text"] for s in harness.engine.spoken] == ["Hello there."]
    assert client.shape() == ["accepted", "audio.start", "audio", "audio", "audio.done"]
    start, done = client.frames("audio.start")[0], client.frames("audio.done")[0]
    assert start == {"type": "audio.start", "utterance_index": 0, "sentence_index": 0,
                     "sentence_text": "Hello there.", "format": "pcm", "sample_rate": 24000, "channels": 1}
    assert done == {"type": "audio.done", "utterance_index": 0, "sentence_index": 0,
                    "total_bytes": 2 * len(PIECE), "error": False}
    say(harness, client, text(" are you?"), DONE)
    assert [s["text"] for s in harness.engine.spoken] == ["Hello there.", "How are you?"]
    assert client.frames("session.done") == [{"type": "session.done", "utterance_index": 0, "total_sentences": 2}]
    assert client.audio() == PIECE * 4
    assert all(s["format"] == "pcm" and s["stream"] is True for s in harness.engine.spoken)
    assert client.closed() is None


def test_the_config_becomes_each_piece_s_speak_request(harness: Harness) -> None:
    """
    The session's voice, speed, language and seed reach the worker in every piece's
    /speak, as the OpenAI shim translates them; stream_audio is accepted and changes
    nothing.
    """
    client = harness.open(voice="alto", speed=1.5, language="en", seed=7, stream_audio=False)
    say(harness, client, text("One."), DONE)
    assert harness.engine.spoken == [{
        "text": "One.", "format": "pcm", "stream": True, "voice": "alto", "params": {"speed": 1.5},
        "language": "en", "seed": 7, "variant": "default",
    }]


@pytest.mark.parametrize(
    ("granularity", "pieces"),
    [
        ("sentence", ["Well, then.", "Go on; now!"]),
        ("clause", ["Well,", "then.", "Go on;", "now!"]),
        ("none", ["Well, then. Go on; now!"]),
    ],
)
def test_split_granularity_chooses_the_pieces(harness: Harness, granularity: str, pieces: list[str]) -> None:
    """
    split_granularity cuts at sentences, at clauses too, or not at all (one piece per
    input.done), and total_sentences counts the pieces spoken.
    """
    client = harness.open(split_granularity=granularity)
    say(harness, client, text("Well, then. Go on; now!"), DONE)
    assert [s["text"] for s in harness.engine.spoken] == pieces
    assert client.frames("session.done")[0]["total_sentences"] == len(pieces)


def test_utterances_are_counted_and_the_config_may_change_only_between_them(harness: Harness) -> None:
    """
    Each input.done ends an utterance (utterance_index counts them, sentence_index
    starts again); a session.config in the middle of one is refused with an error and
    the utterance keeps its voice, while one between utterances applies to the next.
    """
    harness.engine.voices.append({**harness.engine.voices[0], "id": "bass", "label": "bass"})
    client = harness.open(voice="alto")
    say(harness, client, text("First one. Sec"), {"type": "session.config", "model": "fake", "voice": "bass"})
    errors = client.frames("error")
    assert len(errors) == 1 and "middle of an utterance" in errors[0]["message"]
    say(harness, client, text("ond one."), DONE, {"type": "session.config", "model": "fake", "voice": "bass"})
    say(harness, client, text("Third."), DONE, DONE)
    assert [(s["text"], s["voice"]) for s in harness.engine.spoken] == [
        ("First one.", "alto"), ("Second one.", "alto"), ("Third.", "bass")
    ]
    done = client.frames("audio.done")
    assert [(m["utterance_index"], m["sentence_index"]) for m in done] == [(0, 0), (0, 1), (1, 0)]
    ends = client.frames("session.done")
    assert [(m["utterance_index"], m["total_sentences"]) for m in ends] == [(0, 2), (1, 1), (2, 0)]


def test_a_piece_with_nothing_to_say_is_not_spoken(harness: Harness) -> None:
    """
    A piece of nothing but punctuation ("..." after a sentence) is neither sent to the
    engine nor counted.
    """
    client = harness.open()
    say(harness, client, text("Right. ... "), DONE)
    assert [s["text"] for s in harness.engine.spoken] == ["Right."]
    assert client.frames("session.done")[0]["total_sentences"] == 1


def test_session_close_speaks_what_was_sent_then_closes_normally(harness: Harness) -> None:
    """
    session.close speaks the text still held, ends its utterance, and closes 1000 once
    everything is spoken; the session is then forgotten.
    """
    client = harness.open()
    say(harness, client, text("Last words"), {"type": "session.close"})
    assert [s["text"] for s in harness.engine.spoken] == ["Last words"]
    assert client.shape()[-3:] == ["audio.done", "session.done", "close"]
    assert client.closed() is not None and client.closed()[0] == 1000  # type: ignore[index]
    assert client.lost and harness.sessions() == set()


# -- failures, told in-band -------------------------------------------------------------------


def test_messages_wait_in_order_while_a_config_is_checked(harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """
    Text sent straight after a session.config waits while the config is checked (which
    may start the engine's worker) and is then spoken under it; past 1 MiB of messages
    waiting the session closes 1009 rather than hold more.
    """
    gate: Deferred[None] = Deferred()
    checking = harness.core.openai.translation.native

    async def slow(fields: dict[str, Any], *, stream: bool) -> dict[str, Any]:
        await gate
        return await checking(fields, stream=stream)

    monkeypatch.setattr(harness.core.openai.translation, "native", slow)
    client = harness.connect()
    say(harness, client, {"type": "session.config", "model": "fake"}, text("Queued up."), DONE)
    assert harness.engine.spoken == [] and client.closed() is None
    monkeypatch.setattr(harness.core.openai.translation, "native", checking)
    gate.callback(None)
    harness.flush()
    assert [s["text"] for s in harness.engine.spoken] == ["Queued up."]
    assert client.frames("session.done")

    monkeypatch.setattr(harness.core.openai.translation, "native", slow)
    gate = Deferred()
    flood = harness.connect()
    say(harness, flood, {"type": "session.config", "model": "fake"})
    for _ in range(17):
        say(harness, flood, text("x " * 32000))
    closed = flood.closed()
    assert closed is not None and closed[0] == 1009 and "waiting" in closed[1]


def test_a_refused_piece_is_an_error_and_the_session_goes_on(harness: Harness) -> None:
    """
    A piece the engine refuses before any audio is an error message (the taxonomy's
    code and retryable, the piece's indexes) and an audio.done with error true, and
    the next piece is spoken as usual.
    """
    harness.engine.fail_next(Overloaded("busy"))
    client = harness.open()
    say(harness, client, text("One. Two."), DONE)
    assert client.shape()[1:] == ["error", "audio.done", "audio.start", "audio", "audio", "audio.done", "session.done"]
    error = client.frames("error")[0]
    assert (error["code"], error["retryable"]) == ("overloaded", True)
    assert (error["utterance_index"], error["sentence_index"]) == (0, 0)
    assert client.frames("audio.done")[0] == {"type": "audio.done", "utterance_index": 0, "sentence_index": 0,
                                              "total_bytes": 0, "error": True}
    assert client.closed() is None


@pytest.mark.parametrize("after", [1000, 100])
def test_a_piece_cut_short_is_an_error_after_its_audio(harness: Harness, after: int) -> None:
    """
    A worker that stops mid-answer (past the 256-byte floor or short of it) fails that
    piece after its audio began, in-band: the WebSocket stays open and the next piece
    is spoken.
    """
    harness.engine.cut_next(after)
    client = harness.open()
    say(harness, client, text("One. Two."), DONE)
    assert client.shape()[1:5] == ["audio.start", "audio", "error", "audio.done"]
    assert client.frames("audio.done")[0]["total_bytes"] == after
    assert client.frames("audio.done")[0]["error"] is True
    assert client.frames("audio.done")[1]["error"] is False
    assert client.closed() is None


def test_a_bad_config_is_an_error_and_text_without_one_closes(harness: Harness) -> None:
    """
    A session.config naming an unknown model, a format other than pcm, a field the
    stream does not know, a speed out of the dial's range or an unknown granularity is
    refused with an error naming the parameter; input.text with no config accepted
    closes 1008.
    """
    client = harness.connect()
    for config, param in [
        ({"model": "nope"}, "model"),
        ({"model": "fake", "response_format": "mp3"}, "response_format"),
        ({"model": "fake", "colour": "blue"}, "colour"),
        ({"model": "fake", "speed": 5}, "speed"),
        ({"model": "fake", "split_granularity": "word"}, "split_granularity"),
    ]:
        say(harness, client, {"type": "session.config", **config})
    assert [e["param"] for e in client.frames("error")] == [
        "model", "response_format", "colour", "speed", "split_granularity"
    ]
    assert client.closed() is None
    say(harness, client, text("Hello."))
    assert client.closed() == (1008, "input.text before an accepted session.config")
    assert harness.engine.spoken == []


# -- what closes a session -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("message", "code", "words"),
    [
        (b"\x00\x01", 1003, "binary"),
        ("not json", 1007, "not JSON"),
        ("[1, 2]", 1007, "JSON object"),
        ({"text": "no type"}, 1007, "JSON object"),
        ({"type": "input.text", "text": 5}, 1007, "string"),
        ("x" * (64 * 1024 + 1), 1009, "over 65536 bytes"),
        ('{"type": "input.text", "text": "' + "\u00e9" * 33000 + '"}', 1009, "over 65536 bytes"),
        ("[" * 1100 + "]" * 1100, 1007, "nests deeper than 64 levels"),
    ],
)
def test_a_message_the_stream_cannot_read_closes_it_with_a_reason(
    harness: Harness, message: Any, code: int, words: str
) -> None:
    """
    A binary message closes 1003, text that is not a JSON object with a type (or an
    input.text whose text is not a string, or one nested too deep to parse) 1007, and a
    message over 64 KiB, counted in UTF-8 bytes, 1009: each with a reason, and the
    session is forgotten.
    """
    client = harness.open()
    say(harness, client, message)
    closed = client.closed()
    assert closed is not None and closed[0] == code and words in closed[1]
    assert client.lost and harness.sessions() == set()


def test_an_unknown_message_type_is_an_error_and_ignored(harness: Harness) -> None:
    """
    A message of a type the stream does not know is answered with an error naming it,
    and the session goes on.
    """
    client = harness.open()
    say(harness, client, {"type": "input.cancel"}, text("Still here."), DONE)
    assert client.frames("error")[0]["message"].startswith('no message type "input.cancel"')
    assert [s["text"] for s in harness.engine.spoken] == ["Still here."]


def test_a_message_after_session_close_closes_1008(harness: Harness) -> None:
    """
    Once session.close has arrived, any further message (text included) closes the
    session 1008 at once, the rest unspoken.
    """
    harness.engine.chunk_interval = 1.0
    client = harness.open()
    say(harness, client, text("One. Two"), {"type": "session.close"}, text("More."))
    assert client.closed() == (1008, "input.text after session.close")


def test_a_message_growing_past_the_bound_is_refused_before_it_completes(harness: Harness) -> None:
    """
    A text message sent in fragments is refused (1009) once its bytes pass the bound,
    while it is still incomplete, rather than buffered on to its end.
    """
    client = harness.open()
    for _ in range(40):
        fragment = TextMessage(data="x" * 4096, message_finished=False)
        client.transport.write(client.ws.send(fragment))  # type: ignore[union-attr]
        harness.flush()
        if client.closed():
            break
    closed = client.closed()
    assert closed is not None and closed[0] == 1009
    assert client.lost


def test_text_held_past_the_engine_s_ceiling_closes_1009() -> None:
    """
    More text held without a boundary than the engine speaks at once (its variant's
    maxCharacters) closes 1009, naming the most.
    """
    capabilities = default_capabilities()
    capabilities["variants"]["default"]["maxCharacters"] = 100
    harness = Harness(FakeEngine(audio=[PIECE], capabilities=capabilities))
    client = harness.open()
    say(harness, client, text("word " * 15), text("word " * 6))
    closed = client.closed()
    assert closed is not None and closed[0] == 1009 and "over 100 characters" in closed[1]
    harness.close()


def test_without_a_config_in_time_the_session_closes_1008(harness: Harness) -> None:
    """
    A client that sends no acceptable session.config within 10 s is closed 1008; a
    refused one gives it 10 s more, and an accepted one ends the deadline.
    """
    client = harness.connect()
    harness.advance(_stream.CONFIG_SECONDS - 0.1)
    assert client.closed() is None
    harness.advance(0.2)
    assert client.closed() == (1008, "no acceptable session.config within 10 s")
    late = harness.connect()
    harness.advance(_stream.CONFIG_SECONDS - 1)
    say(harness, late, {"type": "session.config", "model": "nope"})
    harness.advance(_stream.CONFIG_SECONDS - 1)
    assert late.closed() is None and late.frames("error")
    say(harness, late, {"type": "session.config", "model": "fake"})
    harness.advance(_stream.CONFIG_SECONDS)
    assert late.closed() is None


def test_a_session_idle_for_a_minute_closes_but_never_while_speaking(harness: Harness) -> None:
    """
    With nothing arriving and nothing being spoken for 60 s a session closes 1000; a
    message starts the minute again, and a piece that takes minutes to speak keeps the
    session open.
    """
    harness.engine.audio = [PIECE] * 4
    harness.engine.chunk_interval = 50.0
    client = harness.open()
    harness.advance(59)
    say(harness, client, text("Long one."), DONE)
    harness.advance(120)
    assert client.closed() is None and len(client.frames("audio.done")) == 0
    for _ in range(600):
        if client.frames("session.done"):
            break
        harness.advance(0.1)
    assert client.frames("audio.done")[0]["error"] is False and client.closed() is None
    harness.advance(59)
    assert client.closed() is None
    harness.advance(2)
    assert client.closed() == (1000, "nothing arrived and nothing was spoken for 60 s")


def test_a_quiet_stream_outlives_the_http_idle_timeout() -> None:
    """
    The site's idle timeout (5 s here) does not close an upgraded connection that sends
    nothing: only the session's own timers bound it.
    """
    harness = Harness(idle_timeout=5.0)
    client = harness.open()
    harness.advance(50)
    assert client.closed() is None and not client.lost
    say(harness, client, text("Still open."), DONE)
    assert client.frames("session.done")
    harness.close()


def test_a_closing_handshake_the_client_never_answers_is_aborted(harness: Harness) -> None:
    """
    A client that never reads or answers the server's close has its connection
    aborted after 10 s rather than kept open on unsent bytes.
    """
    client = harness.connect()
    socket = harness.sockets[0]
    # A socket whose unsent bytes never drain never closes on loseConnection.
    socket.loseConnection = lambda: None  # type: ignore[method-assign]
    aborted: list[bool] = []
    socket.abortConnection = lambda: aborted.append(True)  # type: ignore[method-assign]
    harness.advance(_stream.CONFIG_SECONDS + 0.05)
    assert client.closed() is not None and aborted == []
    harness.advance(_stream.CLOSE_SECONDS - 0.5)
    assert aborted == []
    harness.advance(1)
    assert aborted == [True]


def test_shutting_down_closes_every_session_1001(harness: Harness) -> None:
    """
    The core's close at shutdown closes each session 1001, stopping what it was
    speaking and releasing the engine.
    """
    harness.engine.chunk_interval = 1.0
    client = harness.open()
    say(harness, client, text("Being spoken."), DONE)
    harness.core.streams.close()
    harness.flush()
    assert client.closed() == (1001, "the server is shutting down")
    assert harness.core.relay.turnstile.state("fake") == {"speaking": 0, "queued": 0}


# -- backpressure and hanging up -----------------------------------------------------------


def test_a_slow_listener_pauses_the_worker(harness: Harness) -> None:
    """
    While a piece is spoken the relay, not the HTTP channel, is the socket's producer: a
    full socket pausing it holds the worker's audio back until it resumes, and once the
    piece is done the socket has no producer.
    """
    harness.engine.audio = [PIECE] * 4
    harness.engine.chunk_interval = 0.1
    client = harness.open()
    socket = harness.sockets[0]
    say(harness, client, text("Paced."), DONE)
    assert isinstance(socket.producer, StreamRelay)
    assert len(client.audio()) == len(PIECE)
    socket.producer.pauseProducing()
    harness.advance(1.0)
    assert len(client.audio()) == len(PIECE)
    socket.producer.resumeProducing()
    harness.advance(1.0)
    assert client.audio() == PIECE * 4
    assert socket.producer is None
    assert client.frames("session.done")


def test_a_client_that_hangs_up_mid_piece_releases_the_engine(harness: Harness) -> None:
    """
    When the connection is lost mid-piece the piece's request is failed, its audio
    stopped, and the engine's turn and the model's lease are given back; the session
    is forgotten and leaves no timer.
    """
    harness.engine.audio = [PIECE] * 10
    harness.engine.chunk_interval = 1.0
    client = harness.open()
    say(harness, client, text("Interrupted. And more."), DONE)
    assert harness.core.relay.turnstile.state("fake")["speaking"] == 1
    client.transport.loseConnection()  # type: ignore[union-attr]
    harness.flush()
    assert harness.core.relay.turnstile.state("fake") == {"speaking": 0, "queued": 0}
    assert harness.core.residency.state("fake")["leases"] == 0
    assert harness.sessions() == set()
    # The fake worker's body was stopped, not left to play to its end, and the session
    # left none of its timers.
    assert [c for c in harness.clock.getDelayedCalls() if "_Delivery" in repr(c) or "StreamSession" in repr(c)] == []
    harness.advance(20)
    assert len(harness.engine.spoken) == 1


def test_a_client_that_hangs_up_while_waiting_for_a_turn_leaves_the_queue() -> None:
    """
    A piece still waiting for its engine's turn when the connection goes is taken out
    of the queue and never reaches the engine.
    """
    harness = Harness()
    harness.engine.audio = [PIECE] * 10
    harness.engine.chunk_interval = 1.0
    turnstile = harness.core.relay.turnstile
    busy = []
    while turnstile.state("fake")["queued"] == 0:
        client = harness.open()
        say(harness, client, text(f"Busy {len(busy)}."), DONE)
        busy.append(client)
        assert len(busy) < 20
    waiting = busy.pop()
    waiting.transport.loseConnection()  # type: ignore[union-attr]
    harness.flush()
    assert turnstile.state("fake")["queued"] == 0
    harness.advance(30, step=1.0)
    assert f"Busy {len(busy)}." not in [s["text"] for s in harness.engine.spoken]
    assert all(client.frames("session.done") for client in busy)
    harness.close()


def test_a_client_that_closes_mid_piece_is_answered_and_the_piece_stopped(harness: Harness) -> None:
    """
    A client's own close frame mid-piece is answered with its code, the audio still
    arriving from the worker is dropped rather than sent on a closed WebSocket, and
    the engine is released.
    """
    harness.engine.audio = [PIECE] * 10
    harness.engine.chunk_interval = 1.0
    client = harness.open()
    say(harness, client, text("Interrupted."), DONE)
    client.transport.write(client.ws.send(CloseConnection(code=1000, reason="bye")))  # type: ignore[union-attr]
    harness.advance(3)
    assert client.closed() == (1000, "bye")
    assert len(client.audio()) == len(PIECE)
    assert harness.core.relay.turnstile.state("fake") == {"speaking": 0, "queued": 0}
    assert harness.sessions() == set()


# -- the upgrade -----------------------------------------------------------------------------


def test_a_page_from_another_origin_is_refused_before_the_upgrade(harness: Harness) -> None:
    """
    A browser page from an origin that is neither this machine's nor configured is
    refused 403 at the head, in the OpenAI envelope; one from this machine is upgraded.
    """
    client = harness.connect(headers=[(b"origin", b"https://elsewhere.example")])
    assert client.received[0][:2] == ("rejected", 403)
    assert client.received[0][2]["error"]["code"] == "forbidden"
    assert harness.sessions() == set()
    local = harness.connect(headers=[(b"origin", b"http://localhost:3000")])
    assert local.received == [("accepted",)]


def test_a_get_without_the_upgrade_is_told_to_upgrade(harness: Harness) -> None:
    """
    A plain GET of the route answers 426 with Upgrade: websocket and an OpenAI error.
    """
    raw = Raw(b"GET " + PATH.encode() + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    harness.connect(raw)
    head, _, body = raw.data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 426 ")
    assert b"\r\nUpgrade: websocket" in head
    assert json.loads(body)["error"]["code"] == "bad_request"
    assert harness.sessions() == set()


class Raw(Protocol):
    """
    A client that sends bytes and keeps what comes back.
    """

    def __init__(self, request: bytes) -> None:
        self.request = request
        self.data = b""

    def connectionMade(self) -> None:
        self.transport.write(self.request)  # type: ignore[union-attr]

    def dataReceived(self, data: bytes) -> None:
        self.data += data


class Listener:
    """
    A client on Twisted's own WebSocket API (twisted.web.websocket), as docs/streaming.md
    shows one.
    """

    def __init__(self) -> None:
        self.messages: list[Any] = []
        self.transport: Any = None

    def negotiationStarted(self, transport: Any) -> None:
        self.transport = transport

    def negotiationFinished(self) -> None:
        self.transport.sendTextMessage(json.dumps({"type": "session.config", "model": "fake"}))
        self.transport.sendTextMessage(json.dumps({"type": "input.text", "text": "Hello from Twisted."}))
        self.transport.sendTextMessage(json.dumps({"type": "session.close"}))

    def textMessageReceived(self, message: str) -> None:
        self.messages.append(json.loads(message)["type"])

    def bytesMessageReceived(self, data: bytes) -> None:
        self.messages.append(len(data))

    def pongReceived(self, payload: bytes) -> None:
        pass

    def connectionLost(self, reason: Failure) -> None:
        self.messages.append("lost")


class _Endpoints:
    """
    twisted.web's endpoint factory interface over the harness's in-memory connections.
    """

    def __init__(self, harness: Harness) -> None:
        self.harness = harness

    def endpointForURI(self, uri: Any) -> Any:
        return self

    def connect(self, factory: Any) -> "Deferred[Any]":
        protocol = factory.buildProtocol(SERVER)
        self.harness.connect(protocol, flush=False)
        return Deferred.fromCoroutine(_now(protocol))


async def _now(value: Any) -> Any:
    return value


def test_twisted_s_own_websocket_client_is_served(harness: Harness) -> None:
    """
    Twisted's WebSocket client (the one docs/streaming.md uses) connects, speaks a
    sentence and sees the session close.
    """
    listener = Listener()

    class Factory:
        def buildProtocol(self, url: str) -> Listener:
            return listener

    endpoint = WebSocketClientEndpoint(_Endpoints(harness), "ws://127.0.0.1:8080" + PATH)  # type: ignore[arg-type]
    connected = Deferred.fromCoroutine(endpoint.connect(Factory()))
    harness.flush()
    assert connected.called
    assert listener.messages == ["audio.start", len(PIECE), len(PIECE), "audio.done", "session.done", "lost"]
