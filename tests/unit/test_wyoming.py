"""
The Wyoming door (rhapsode._doors.wyoming) over a stub core's fake engines, on in-memory
connections and a fake clock: describe, synthesize and its streaming form answered as
wyoming-piper answers them, refusals as error events on a connection that goes on, and
every bound on what a peer sends enforced before it costs anything.
"""

from __future__ import annotations

import gc
import json
from typing import Any, Iterator

import pytest
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, succeed
from twisted.internet.protocol import Protocol
from twisted.logger import formatEvent, globalLogPublisher
from twisted.python.failure import Failure
from twisted.test import iosim

from rhapsode._doors.wyoming import MAX_DATA, MAX_LINE, Advertisement, WyomingDoor, WyomingLimits, encode_event
from rhapsode.testing import FakeEngine, StubRhapsode, default_capabilities, fake_voice

SERVER = IPv4Address("TCP", "127.0.0.1", 10200)
PIECE = b"\x01\x00" * 2400  # 100 ms of 24 kHz PCM


class Peer(Protocol):
    """
    A Wyoming peer: the events it was sent, parsed as the wyoming library reads them.
    """

    def __init__(self) -> None:
        self.buffer = b""
        self.events: list[tuple[str, dict[str, Any], bytes]] = []
        self.closed = False

    def dataReceived(self, data: bytes) -> None:
        self.buffer += data
        while b"\n" in self.buffer:
            line, _, rest = self.buffer.partition(b"\n")
            header = json.loads(line)
            size, payload = header.get("data_length", 0), header.get("payload_length", 0)
            if len(rest) < size + payload:
                return
            data_ = dict(header.get("data") or {})
            if size:
                data_.update(json.loads(rest[:size]))
            self.events.append((header["type"], data_, rest[size : size + payload]))
            self.buffer = rest[size + payload :]

    def connectionLost(self, reason: Failure = Failure(Exception())) -> None:
        self.closed = True

    def send(self, kind: str, data: dict[str, Any] | None = None) -> None:
        assert self.transport is not None
        self.transport.write(encode_event(kind, data))

    def kinds(self) -> list[str]:
        return [kind for kind, _, _ in self.events]


class Harness:
    def __init__(self, *, limits: WyomingLimits | None = None, **engines: FakeEngine) -> None:
        self.engines = engines or {"fake": FakeEngine(audio=[PIECE, PIECE])}
        self.stub = StubRhapsode(self.engines)
        self.clock = self.stub.clock
        core = self.stub.core
        self.door = WyomingDoor(
            speech=core.speech, routes=core.router, registry=core.registry, clock=self.clock,
            limits=limits or WyomingLimits(), version="0.1.0",
        )
        self.pumps: list[iosim.IOPump] = []

    def connect(self) -> Peer:
        peer = Peer()
        address = IPv4Address("TCP", "127.0.0.1", 40000 + len(self.pumps))
        server = self.door.buildProtocol(address)
        pump = iosim.connect(
            server, iosim.FakeTransport(server, isServer=True, hostAddress=SERVER, peerAddress=address),
            peer, iosim.FakeTransport(peer, isServer=False, hostAddress=address, peerAddress=SERVER),
            greet=False, clock=self.clock,
        )
        self.pumps.append(pump)
        self.flush()
        return peer

    def flush(self) -> None:
        for _ in range(1000):
            self.stub.flush()
            if not any([pump.flush() for pump in self.pumps]):
                return
        raise RuntimeError("the connections never went quiet")

    def say(self, peer: Peer, kind: str, data: dict[str, Any] | None = None) -> None:
        peer.send(kind, data)
        self.flush()


@pytest.fixture(autouse=True)
def no_failure_logged() -> Iterator[None]:
    """
    Every test here also fails if anything logged a failure or left one unhandled.
    """
    failures: list[dict[str, Any]] = []

    def observe(event: dict[str, Any]) -> None:
        if "log_failure" in event or event.get("isError"):
            failures.append(event)

    globalLogPublisher.addObserver(observe)
    try:
        yield
        gc.collect()
    finally:
        globalLogPublisher.removeObserver(observe)
    assert [formatEvent(e) + str(e.get("log_failure", "")) for e in failures] == []


def test_describe_answers_one_tts_program_per_engine() -> None:
    """
    info has a TTS program per engine, each voice named engine:voice with its languages
    (the default variant's) and the engine's licences in its attribution, and says the
    streaming form is served.
    """
    other = default_capabilities("other")
    other["license"] = {"code": "GPL-3.0-or-later", "weights": "CC-BY-NC-4.0", "weightsCommercialUse": False,
                      "notes": ""}
    other["variants"]["default"]["languages"] = ["en-US", "de"]
    h = Harness(fake=FakeEngine(), other=FakeEngine(capabilities=other, voices=[fake_voice("joe", "Joe")]))
    peer = h.connect()
    h.say(peer, "describe")
    [(kind, info, _)] = peer.events
    assert kind == "info" and info["asr"] == []
    assert [p["name"] for p in info["tts"]] == ["fake", "other"]
    program = info["tts"][1]
    assert program["supports_synthesize_streaming"] is True and program["installed"] is True
    [voice] = program["voices"]
    assert voice["name"] == "other:joe" and voice["languages"] == ["en-US", "de"]
    assert voice["description"] == "Joe (Fake engine)"
    assert voice["attribution"]["name"] == "Fake engine (code GPL-3.0-or-later; weights CC-BY-NC-4.0, not for commercial use)"
    assert info["tts"][0]["voices"][0]["name"] == "fake:alto"


def test_synthesize_answers_audio_start_chunks_and_stop() -> None:
    """
    synthesize: audio-start with the pcm's rate, width and channels, the worker's audio
    as audio-chunks as it comes, then audio-stop; the first sentence is one /speak (for
    the first audio), the rest another, in pcm with the voice the name picks.
    """
    h = Harness()
    peer = h.connect()
    h.say(peer, "synthesize", {"text": "Hello there. How are you? I am fine.", "voice": {"name": "fake:alto"}})
    assert peer.kinds() == ["audio-start"] + ["audio-chunk"] * 4 + ["audio-stop"]
    assert peer.events[0][1] == {"rate": 24000, "width": 2, "channels": 1}
    assert b"".join(payload for _, _, payload in peer.events[1:5]) == PIECE * 4
    first, rest = h.engines["fake"].spoken
    assert (first["text"], first["format"], first["voice"]) == ("Hello there.", "pcm", "alto")
    assert rest["text"] == "How are you? I am fine."


def test_a_bare_voice_name_finds_its_engine_and_a_language_its_voice() -> None:
    """
    A voice named without its engine goes to the engine that has it; a language alone
    to the first engine that speaks it, in that engine's spelling of the tag.
    """
    other = default_capabilities("other")
    other["variants"]["default"]["languages"] = ["de-DE"]
    h = Harness(fake=FakeEngine(), other=FakeEngine(capabilities=other, voices=["joe"]))
    peer = h.connect()
    h.say(peer, "synthesize", {"text": "Hallo.", "voice": {"name": "joe"}})
    h.say(peer, "synthesize", {"text": "Hallo.", "voice": {"language": "de"}})
    assert [s.get("voice") for s in h.engines["other"].spoken] == ["joe", None]
    assert h.engines["other"].spoken[1]["language"] == "de-DE"


def test_an_event_is_read_whatever_reads_it_arrives_in() -> None:
    """
    A header, its data and its payload arriving a byte at a time, or several events in
    one read, are the same events.
    """
    h = Harness()
    peer = h.connect()
    assert peer.transport is not None
    raw = encode_event("ping", {"text": "one"}, b"\x00\x01") + encode_event("ping", {"text": "two"})
    for at in range(len(raw)):
        peer.transport.write(raw[at : at + 1])
        h.flush()
    peer.transport.write(raw)
    h.flush()
    assert [data["text"] for _, data, _ in peer.events] == ["one", "two", "one", "two"]


def test_the_streaming_form_speaks_each_sentence_as_it_is_whole() -> None:
    """
    synthesize-start, chunks, synthesize-stop: each sentence is spoken once the next word
    begins, in an audio cycle of its own, and synthesize-stopped ends the stream; the
    synthesize a client sends inside the stream for older servers is not spoken.
    """
    h = Harness()
    peer = h.connect()
    h.say(peer, "synthesize-start", {"voice": {"name": "fake:alto"}})
    h.say(peer, "synthesize-chunk", {"text": "Hello there. How"})
    assert [s["text"] for s in h.engines["fake"].spoken] == ["Hello there."]
    assert peer.kinds() == ["audio-start", "audio-chunk", "audio-chunk", "audio-stop"]
    h.say(peer, "synthesize-chunk", {"text": " are you?"})
    h.say(peer, "synthesize", {"text": "Hello there. How are you?"})
    h.say(peer, "synthesize-stop")
    assert [s["text"] for s in h.engines["fake"].spoken] == ["Hello there.", "How are you?"]
    assert peer.kinds()[4:] == ["audio-start", "audio-chunk", "audio-chunk", "audio-stop", "synthesize-stopped"]


def test_a_refusal_is_an_error_event_and_the_connection_goes_on() -> None:
    """
    An unknown voice is an error event carrying the taxonomy's code and naming the
    engine's voices; an unknown program, SSML and speakers are refused too; describe
    still answers after.
    """
    h = Harness()
    peer = h.connect()
    h.say(peer, "synthesize", {"text": "Hi.", "voice": {"name": "fake:nobody"}})
    [(kind, error, _)] = peer.events
    assert kind == "error" and error["code"] == "unknown_voice" and "its voices: alto" in error["text"]
    for kind, data, code in (
        ("select-program", {"name": "piper"}, "unknown_engine"),
        ("synthesize", {"text": "<speak>Hi</speak>", "text_format": "ssml"}, "unsupported"),
        ("synthesize", {"text": "Hi.", "voice": {"name": "fake:alto", "speaker": "2"}}, "unsupported"),
        ("synthesize", {"text": "Hi.", "voice": {"name": "nope:alto"}}, "unknown_engine"),
        ("synthesize-chunk", {"text": "Hi."}, "bad_request"),
    ):
        peer.events.clear()
        h.say(peer, kind, data)
        assert [(k, e["code"]) for k, e, _ in peer.events] == [("error", code)], kind
    peer.events.clear()
    h.say(peer, "describe")
    assert peer.kinds() == ["info"] and not peer.closed
    assert h.engines["fake"].spoken == []


def test_a_failure_after_audio_began_ends_the_cycle_with_an_error() -> None:
    """
    A worker that stops mid-answer: its audio so far, an error event, then audio-stop,
    so a reader waiting for the end is not left waiting; the next request speaks.
    """
    engine = FakeEngine(audio=[PIECE, PIECE])
    h = Harness(fake=engine)
    peer = h.connect()
    engine.cut_next(1000)
    h.say(peer, "synthesize", {"text": "Hi there."})
    assert peer.kinds() == ["audio-start", "audio-chunk", "error", "audio-stop"]
    assert len(peer.events[1][2]) == 1000 and peer.events[2][1]["code"] == "internal"
    peer.events.clear()
    h.say(peer, "synthesize", {"text": "Again."})
    assert peer.kinds() == ["audio-start", "audio-chunk", "audio-chunk", "audio-stop"]


def test_select_program_and_ping() -> None:
    """
    select-program sends the connection's requests without a voice to that engine;
    ping answers pong with its text.
    """
    h = Harness(fake=FakeEngine(), other=FakeEngine(capabilities=default_capabilities("other")))
    peer = h.connect()
    h.say(peer, "select-program", {"name": "other"})
    h.say(peer, "synthesize", {"text": "Hi."})
    assert len(h.engines["other"].spoken) == 1 and h.engines["fake"].spoken == []
    peer.events.clear()
    h.say(peer, "ping", {"text": "x"})
    assert peer.events == [("pong", {"text": "x"}, b"")]


@pytest.mark.parametrize("raw, why", [
    (b"x" * (MAX_LINE + 10), "header line is over"),
    (b'{"type": "synthesize", "data_length": %d}\n' % (MAX_DATA + 1), "data_length"),
    (b'{"type": "synthesize", "payload_length": -1}\n', "not a length"),
    (b"not json\n", "not JSON"),
    (b'{"data": {}}\n', '"type"'),
    (b'{"type": "synthesize", "data_length": 3}\n[1]', "not a JSON object"),
])
def test_what_a_peer_sends_is_bounded_before_it_is_read(raw: bytes, why: str) -> None:
    """
    A line with no end within the bound, a data or payload length over its bound or
    not a length, a header or data that is not a JSON object: an error event, then the
    connection is closed, before the body it announces is waited for.
    """
    h = Harness()
    peer = h.connect()
    assert peer.transport is not None
    peer.transport.write(raw)
    h.flush()
    [(kind, error, _)] = peer.events
    assert kind == "error" and why in error["text"] and peer.closed


def test_events_connections_and_idle_time_are_bounded() -> None:
    """
    Past wyoming.maxEvents the connection closes with an error; one connection over
    maxConnections is refused; a connection that sends nothing for idleSeconds while
    nothing is spoken is closed, and never while it speaks.
    """
    h = Harness(limits=WyomingLimits(idle_seconds=5, max_events=3, max_connections=2),
                fake=FakeEngine(audio=[PIECE] * 5, chunk_interval=2.0))
    chatty = h.connect()
    for _ in range(4):
        h.say(chatty, "ping")
    assert chatty.kinds() == ["pong", "pong", "pong", "error"] and chatty.closed
    first, second = h.connect(), h.connect()
    third = h.connect()
    assert third.kinds() == ["error"] and third.closed and not first.closed
    h.say(first, "synthesize", {"text": "A long one."})
    for _ in range(10):
        h.clock.advance(1)
        h.flush()
    assert not first.closed and first.kinds()[-1] == "audio-stop"
    for _ in range(6):
        h.clock.advance(1)
        h.flush()
    assert first.closed and second.closed and first.events[-1][1]["text"].startswith("nothing arrived")


def test_text_waiting_past_the_bound_closes() -> None:
    """
    A stream that holds more than its ceiling without a sentence's end is closed.
    """
    caps = default_capabilities()
    caps["variants"]["default"]["maxCharacters"] = 50
    h = Harness(fake=FakeEngine(capabilities=caps))
    peer = h.connect()
    h.say(peer, "synthesize-start")
    h.say(peer, "synthesize-chunk", {"text": "word " * 20})
    assert peer.kinds() == ["error"] and peer.closed


def test_a_long_synthesize_is_cut_at_sentences_within_the_ceiling() -> None:
    """
    After the first sentence, the rest is spoken in pieces of whole sentences within the
    variant's ceiling, all in one audio cycle.
    """
    caps = default_capabilities()
    caps["variants"]["default"]["maxCharacters"] = 40
    h = Harness(fake=FakeEngine(capabilities=caps, audio=[PIECE]))
    peer = h.connect()
    h.say(peer, "synthesize", {"text": "One. Two. Three. Four."})
    assert [s["text"] for s in h.engines["fake"].spoken] == ["One.", "Two. Three. Four."]
    h.engines["fake"].spoken.clear()
    peer = h.connect()
    h.say(peer, "synthesize", {"text": "One short sentence. Another short one. And a third one, longer."})
    assert [s["text"] for s in h.engines["fake"].spoken] == [
        "One short sentence.", "Another short one.", "And a third one, longer."]
    assert peer.kinds() == ["audio-start", "audio-chunk", "audio-chunk", "audio-chunk", "audio-stop"]


def test_the_advertisement_registers_and_withdraws_the_service() -> None:
    """
    With wyoming.zeroconf the door is registered as <name>._wyoming._tcp.local. on its
    port and address (python-zeroconf's own ServiceInfo), off the reactor, and withdrawn
    and closed when the door stops.
    """
    from zeroconf import ServiceInfo

    calls: list[Any] = []

    class Zeroconf:
        def register_service(self, info: Any) -> None:
            calls.append(("register", info))

        def unregister_service(self, info: Any) -> None:
            calls.append(("unregister", info))

        def close(self) -> None:
            calls.append(("close",))

    ran: list[Any] = []

    def blocking(f: Any) -> "Deferred[Any]":
        ran.append(f)
        return succeed(f())

    advert = Advertisement(port=10200, name="rhapsode-box", host="192.0.2.7", blocking=blocking,
                           zeroconf=Zeroconf, service_info=ServiceInfo)
    advert.start()
    [(verb, info)] = calls
    assert verb == "register" and info.type == "_wyoming._tcp.local."
    assert info.name == "rhapsode-box._wyoming._tcp.local." and info.port == 10200
    assert info.parsed_addresses() == ["192.0.2.7"]
    advert.stop()
    assert [c[0] for c in calls] == ["register", "unregister", "close"] and len(ran) == 2


def test_a_door_stopped_while_registering_still_withdraws() -> None:
    """
    A stop that comes while the registration still runs off the reactor waits for it,
    then withdraws and closes, rather than leaving the service announced.
    """
    from zeroconf import ServiceInfo

    calls: list[str] = []

    class Zeroconf:
        def register_service(self, info: Any) -> None:
            calls.append("register")

        def unregister_service(self, info: Any) -> None:
            calls.append("unregister")

        def close(self) -> None:
            calls.append("close")

    waiting: list[tuple[Any, "Deferred[Any]"]] = []

    def blocking(f: Any) -> "Deferred[Any]":
        d: Deferred[Any] = Deferred()
        waiting.append((f, d))
        return d

    advert = Advertisement(port=10200, name="rhapsode-box", host="192.0.2.7", blocking=blocking,
                           zeroconf=Zeroconf, service_info=ServiceInfo)
    started = advert.start()
    stopped = advert.stop()
    assert calls == [] and len(waiting) == 1 and not stopped.called
    f, d = waiting.pop()
    d.callback(f())
    assert started.called and calls == ["register"] and not stopped.called
    f, d = waiting.pop()
    d.callback(f())
    assert calls == ["register", "unregister", "close"] and stopped.called
