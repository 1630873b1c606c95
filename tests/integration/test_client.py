"""
Tests for L{rhapsode.client}: each method's request against an in-memory fake of the
public API (StubTreq over a twisted.web resource that records what it is sent), the
mapping of every error envelope onto the taxonomy, truncated streams, and speaking
through a real core in front of a real tone worker.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Coroutine, TypeVar

import pytest
import pytest_twisted
from test_core_proxy import Core, start_core, wav_clip
from treq.testing import StubTreq
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IConsumer, IPushProducer
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET
from zope.interface import implementer
from zope.interface.verify import verifyObject

import rhapsode.client
from rhapsode.client import (
    Audio,
    BadRequest,
    Internal,
    RhapsodeClient,
    SpeechError,
    TruncatedResponse,
    UnknownEngine,
    UnknownVoice,
)
from rhapsode_protocol.contract import ENGINE_LIST, PUBLIC_HEALTH, VOICE, validate
from rhapsode_protocol.errors import ERROR_TABLE
from rhapsode_protocol.http.form import read_form

T = TypeVar("T")
BASE = "http://rhapsode.test:8080"
AUDIO = bytes(range(256)) * 8


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Answer:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    pieces: list[bytes] = field(default_factory=list)
    abort: bool = False


def json_answer(body: Any, status: int = 200) -> Answer:
    raw = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "Content-Length": str(len(raw))}
    return Answer(status, headers, [raw])


def audio_answer(data: bytes, *, duration: int | None = None, streamed: bool = False) -> Answer:
    headers = {"Content-Type": "audio/wav"}
    if duration is not None:
        headers["X-Rhapsode-Duration-Ms"] = str(duration)
    if streamed:
        third = len(data) // 3
        return Answer(200, headers, [data[:third], data[third : 2 * third], data[2 * third :]])
    headers["Content-Length"] = str(len(data))
    return Answer(200, headers, [data])


class FakeCore(Resource):
    """
    The public API as canned answers by (method, path), recording every request.
    """

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.answers: dict[tuple[str, str], Answer] = {}
        self.seen: list[Seen] = []

    def render(self, request: IRequest) -> Any:
        request.content.seek(0)
        method, path = request.method.decode(), request.uri.decode()
        headers = {
            name.decode().lower(): values[0].decode()
            for name, values in request.requestHeaders.getAllRawHeaders()
        }
        self.seen.append(Seen(method, path, headers, request.content.read()))
        answer = self.answers.get((method, path), json_answer({"unexpected": path}, 599))
        request.setResponseCode(answer.status)
        for name, value in answer.headers.items():
            request.setHeader(name, value)
        for piece in answer.pieces:
            request.write(piece)
        if answer.abort:
            request.channel.transport.abortConnection()  # type: ignore[attr-defined]
        else:
            request.finish()
        return NOT_DONE_YET


@dataclass
class Fixture:
    fake: FakeCore
    stub: StubTreq
    client: RhapsodeClient

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """
        Drive one client call to its end over the in-memory connection.
        """
        done = Deferred.fromCoroutine(coroutine)
        self.stub.flush()
        outcome: list[Any] = []
        done.addBoth(outcome.append)
        assert outcome, "the call never finished"
        if isinstance(outcome[0], Failure):
            outcome[0].raiseException()
        result: T = outcome[0]
        return result

    @property
    def last(self) -> Seen:
        return self.fake.seen[-1]


def _fixture(token: str | None = None) -> Fixture:
    fake = FakeCore()
    stub = StubTreq(fake)
    return Fixture(fake, stub, RhapsodeClient(BASE + "/", http=stub, token=token))


@pytest.fixture()
def api() -> Fixture:
    return _fixture()


def test_engines_and_health_are_plain_gets_passing_unknown_fields(api: Fixture) -> None:
    """
    engines() and health() GET their routes with no body and no Authorization, and hand
    back what the server said, fields the client does not know included (section 9).
    """
    engines = [{"id": "tone", "process": "down", "model": "unloaded", "later": {"x": 1}}]
    health = {"status": "ok", "version": "0.1.0", "contract": 1, "engines": {}, "gpu": "?"}
    api.fake.answers[("GET", "/engines")] = json_answer(engines)
    api.fake.answers[("GET", "/health")] = json_answer(health)

    assert api.run(api.client.engines()) == engines
    assert (api.last.method, api.last.path, api.last.body) == ("GET", "/engines", b"")
    assert "authorization" not in api.last.headers
    assert api.run(api.client.health()) == health
    assert (api.last.method, api.last.path) == ("GET", "/health")


def test_engine_scoped_reads_name_the_engine_in_the_path(api: Fixture) -> None:
    """
    capabilities() and voices() GET under /engines/{engine}/, and an engine id is one
    path segment however it is spelt: it cannot reach another route.
    """
    caps = {"contract": 1, "engine": {"id": "tone"}}
    voices = [{"id": "a", "previewUrl": "/engines/tone/voices/a/preview"}]
    api.fake.answers[("GET", "/engines/tone/capabilities")] = json_answer(caps)
    api.fake.answers[("GET", "/engines/tone/voices")] = json_answer(voices)
    api.fake.answers[("GET", "/engines/..%2Fhealth/voices")] = json_answer([])

    assert api.run(api.client.capabilities("tone")) == caps
    assert api.run(api.client.voices("tone")) == voices
    assert api.run(api.client.voices("../health")) == []
    assert [s.path for s in api.fake.seen] == [
        "/engines/tone/capabilities",
        "/engines/tone/voices",
        "/engines/..%2Fhealth/voices",
    ]


def test_token_is_sent_as_bearer_on_every_request() -> None:
    """
    A client given a token sends Authorization: Bearer <token> on every request, reads
    and management alike.
    """
    api = _fixture(token="s3cret")
    api.fake.answers[("GET", "/engines")] = json_answer([])
    api.fake.answers[("POST", "/speak")] = audio_answer(AUDIO)
    api.fake.answers[("DELETE", "/engines/tone/voices/v")] = json_answer({"deleted": "v"})
    api.run(api.client.engines())
    api.run(api.client.speak("tone", "hi"))
    api.run(api.client.delete_voice("tone", "v"))
    assert [s.headers["authorization"] for s in api.fake.seen] == ["Bearer s3cret"] * 3


def test_speak_buffers_with_engine_text_and_fields(api: Fixture) -> None:
    """
    speak() POSTs JSON to /speak with engine, text, the caller's fields as spelt and
    stream false, and returns the audio with its Content-Type and duration header.
    """
    api.fake.answers[("POST", "/speak")] = audio_answer(AUDIO, duration=1234)
    audio = api.run(
        api.client.speak("tone", "Hello [laugh].", voice="narrator_02", seed=7, keepAliveSeconds=0)
    )
    assert audio == Audio(content_type="audio/wav", data=AUDIO, duration_ms=1234)
    assert api.last.method == "POST" and api.last.path == "/speak"
    assert api.last.headers["content-type"].startswith("application/json")
    assert api.last.json() == {
        "engine": "tone",
        "text": "Hello [laugh].",
        "voice": "narrator_02",
        "seed": 7,
        "keepAliveSeconds": 0,
        "stream": False,
    }


def test_speak_without_a_duration_header_has_none(api: Fixture) -> None:
    """
    A buffered answer without X-Rhapsode-Duration-Ms has duration_ms None, not 0.
    """
    api.fake.answers[("POST", "/speak")] = audio_answer(AUDIO)
    assert api.run(api.client.speak("tone", "hi")).duration_ms is None


def test_stream_is_not_a_field(api: Fixture) -> None:
    """
    stream is chosen by the method: passing it is a TypeError, and nothing is sent.
    """
    with pytest.raises(TypeError):
        api.run(api.client.speak("tone", "hi", stream=True))
    with pytest.raises(TypeError):
        api.run(api.client.speak_to(lambda piece: None, "tone", "hi", stream=False))
    assert api.fake.seen == []


def test_speak_to_a_callable_streams_every_byte(api: Fixture) -> None:
    """
    speak_to() POSTs /speak with stream true, hands the body to the callable, and returns
    the bytes received, which are exactly the body.
    """
    api.fake.answers[("POST", "/speak")] = audio_answer(AUDIO, streamed=True)
    pieces: list[bytes] = []
    received = api.run(api.client.speak_to(pieces.append, "tone", "hi", format="pcm"))
    assert received == len(AUDIO) and b"".join(pieces) == AUDIO
    assert api.last.json() == {"engine": "tone", "text": "hi", "format": "pcm", "stream": True}


@implementer(IConsumer)
class RecordingConsumer:
    def __init__(self) -> None:
        self.events: list[Any] = []
        self.data = b""

    def registerProducer(self, producer: Any, streaming: bool) -> None:
        self.events.append(("register", IPushProducer.providedBy(producer), streaming))

    def unregisterProducer(self) -> None:
        self.events.append("unregister")

    def write(self, data: bytes) -> None:
        self.events.append("write")
        self.data += data


def test_speak_to_a_consumer_registers_the_connection_as_producer(api: Fixture) -> None:
    """
    An IConsumer gets the connection as its streaming push producer before the first
    piece and loses it after the last, so a slow consumer pauses the socket.
    """
    api.fake.answers[("POST", "/speak")] = audio_answer(AUDIO, streamed=True)
    consumer = RecordingConsumer()
    verifyObject(IConsumer, consumer)
    assert api.run(api.client.speak_to(consumer, "tone", "hi")) == len(AUDIO)
    assert consumer.data == AUDIO
    assert consumer.events[0] == ("register", True, True)
    assert consumer.events[-1] == "unregister"
    assert set(consumer.events[1:-1]) == {"write"}


def test_speak_to_refuses_what_is_not_a_sink(api: Fixture) -> None:
    """
    A sink that is neither an IConsumer nor callable is a TypeError before any request.
    """
    with pytest.raises(TypeError):
        api.run(api.client.speak_to(b"not a sink", "tone", "hi"))  # type: ignore[arg-type]
    assert api.fake.seen == []


def test_a_truncated_stream_raises_never_returns_short(api: Fixture) -> None:
    """
    A stream the server aborts after its headers raises TruncatedResponse carrying the
    bytes that did arrive, for speak_to and for a buffered speak alike.
    """
    half = AUDIO[: len(AUDIO) // 2]
    api.fake.answers[("POST", "/speak")] = Answer(
        200, {"Content-Type": "audio/wav"}, [half], abort=True
    )
    pieces: list[bytes] = []
    with pytest.raises(TruncatedResponse) as caught:
        api.run(api.client.speak_to(pieces.append, "tone", "hi"))
    assert caught.value.received == len(half) == len(b"".join(pieces))

    api.fake.answers[("POST", "/speak")] = Answer(
        200, {"Content-Type": "audio/wav", "Content-Length": str(len(AUDIO))}, [half], abort=True
    )
    with pytest.raises(TruncatedResponse):
        api.run(api.client.speak("tone", "hi"))


def test_a_failing_sink_reports_its_own_error(api: Fixture) -> None:
    """
    When the caller's sink raises, speak_to stops reading and raises that exception, not
    a truncation.
    """
    api.fake.answers[("POST", "/speak")] = audio_answer(AUDIO, streamed=True)

    def full(piece: bytes) -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        api.run(api.client.speak_to(full, "tone", "hi"))


def test_dialogue_posts_turns_under_the_engine(api: Fixture) -> None:
    """
    dialogue() POSTs to /engines/{engine}/dialogue with turns, the caller's fields and
    stream false, and no engine in the body.
    """
    api.fake.answers[("POST", "/engines/tone/dialogue")] = audio_answer(AUDIO, duration=900)
    turns = [{"speaker": "a", "text": "Hi."}, {"speaker": "b", "text": "Hello."}]
    audio = api.run(api.client.dialogue("tone", turns, voices={"a": "narrator_02"}, seed=3))
    assert audio.data == AUDIO and audio.duration_ms == 900
    assert api.last.json() == {
        "turns": turns,
        "voices": {"a": "narrator_02"},
        "seed": 3,
        "stream": False,
    }


def _form(seen: Seen) -> dict[str, tuple[str | None, bytes]]:
    # The worker's own parser: what the core relays is what the worker will read.
    return read_form(seen.headers["content-type"].encode(), io.BytesIO(seen.body))


def test_create_voice_from_a_reference_is_multipart(api: Fixture) -> None:
    """
    create_voice() with a reference POSTs multipart/form-data to /engines/{engine}/voices
    carrying id, label, transcript and the file under its name, bytes intact (line
    breaks, NULs and boundary-like runs included), and returns the new voice.
    """
    voice = {
        "id": "narrator_03",
        "label": "Narrator 03",
        "spec": "s1",
        "tags": ["cloned"],
        "previewUrl": "/engines/tone/voices/narrator_03/preview",
        "builtin": False,
    }
    api.fake.answers[("POST", "/engines/tone/voices")] = json_answer(voice)
    clip = b"RIFF\r\n--\r\n\x00\n\r" + AUDIO
    created = api.run(
        api.client.create_voice(
            "tone",
            "narrator_03",
            label="Narrator 03",
            reference=('clip "one".wav', clip),
            transcript="What the clip says.",
        )
    )
    assert created == voice
    validate(VOICE, created)
    assert api.last.headers["content-type"].startswith("multipart/form-data; boundary=")
    assert _form(api.last) == {
        "id": (None, b"narrator_03"),
        "label": (None, b"Narrator 03"),
        "transcript": (None, b"What the clip says."),
        # The client escapes the quotes as a browser does; the worker reads them back.
        "reference": ('clip "one".wav', clip),
    }


def test_create_voice_from_a_blend_sends_only_what_was_given(api: Fixture) -> None:
    """
    A blend create carries id and blend and nothing the caller left out.
    """
    api.fake.answers[("POST", "/engines/tone/voices")] = json_answer({"id": "host"})
    api.run(api.client.create_voice("tone", "host", blend="af_bella(2)+af_sky(1)"))
    assert _form(api.last) == {
        "id": (None, b"host"),
        "blend": (None, b"af_bella(2)+af_sky(1)"),
    }


def test_delete_voice(api: Fixture) -> None:
    """
    delete_voice() sends DELETE /engines/{engine}/voices/{voice} and returns None.
    """
    api.fake.answers[("DELETE", "/engines/tone/voices/host")] = json_answer({"deleted": "host"})
    assert api.run(api.client.delete_voice("tone", "host")) is None
    assert (api.last.method, api.last.path, api.last.body) == (
        "DELETE",
        "/engines/tone/voices/host",
        b"",
    )


_EXPORTED = [getattr(rhapsode.client, name) for name in rhapsode.client.__all__]
_TAXONOMY = {
    cls.code: cls
    for cls in _EXPORTED
    if isinstance(cls, type) and issubclass(cls, SpeechError) and cls is not SpeechError
}


@pytest.mark.parametrize("code", sorted(ERROR_TABLE))
def test_every_error_code_raises_its_exception(api: Fixture, code: str) -> None:
    """
    Each envelope code comes back as its exception, with the status's retryable flag, the
    message and the field, so a caller branches on .retryable and .field.
    """
    status, retryable, _ = ERROR_TABLE[code]
    body = {"code": code, "message": f"it was {code}", "retryable": retryable, "field": "voice"}
    envelope = {"error": body}
    api.fake.answers[("POST", "/speak")] = json_answer(envelope, status)
    with pytest.raises(SpeechError) as caught:
        api.run(api.client.speak("tone", "hi"))
    error = caught.value
    assert type(error) is _TAXONOMY[code]
    assert (error.code, error.retryable, error.field, error.message) == (
        code, retryable, "voice", f"it was {code}",
    )


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.engines(),
        lambda c: c.health(),
        lambda c: c.capabilities("nope"),
        lambda c: c.voices("nope"),
        lambda c: c.speak("nope", "hi"),
        lambda c: c.speak_to(lambda piece: None, "nope", "hi"),
        lambda c: c.dialogue("nope", [{"speaker": "a", "text": "hi"}]),
        lambda c: c.create_voice("nope", "v", blend="a"),
        lambda c: c.delete_voice("nope", "v"),
    ],
)
def test_every_method_raises_on_an_error_answer(api: Fixture, call: Any) -> None:
    """
    No method returns on a non-2xx answer: each raises the envelope's exception.
    """
    envelope = UnknownEngine('no engine "nope" (engines: tone)', field="engine").envelope()
    for key in [
        ("GET", "/engines"),
        ("GET", "/health"),
        ("GET", "/engines/nope/capabilities"),
        ("GET", "/engines/nope/voices"),
        ("POST", "/speak"),
        ("POST", "/engines/nope/dialogue"),
        ("POST", "/engines/nope/voices"),
        ("DELETE", "/engines/nope/voices/v"),
    ]:
        api.fake.answers[key] = json_answer(envelope, 404)
    with pytest.raises(UnknownEngine) as caught:
        api.run(call(api.client))
    assert caught.value.field == "engine" and not caught.value.retryable


def test_an_answer_without_an_envelope_is_internal(api: Fixture) -> None:
    """
    A non-2xx answer that is not an error envelope (a proxy's HTML page) raises Internal
    naming the status.
    """
    api.fake.answers[("GET", "/engines")] = Answer(502, {"Content-Type": "text/html"}, [b"<h1>"])
    with pytest.raises(Internal, match="502"):
        api.run(api.client.engines())


def test_public_surface() -> None:
    """
    rhapsode.client exports the client, the audio, the truncation and every taxonomy
    exception, and each name in __all__ exists.
    """
    assert set(rhapsode.client.__all__) == {
        "Audio", "AudioSink", "RhapsodeClient", "TruncatedResponse", "SpeechError",
        "BadRequest", "Conflict", "Forbidden", "Internal", "ModelUnavailable", "OutOfMemory",
        "Overloaded", "UnknownEngine", "UnknownVoice", "Unsupported",
    }
    for name in rhapsode.client.__all__:
        assert getattr(rhapsode.client, name) is not None
    assert set(_TAXONOMY) == set(ERROR_TABLE)


# Against the real core in front of a real tone worker.

TEXT = " ".join(f"This is sentence {i}, spoken through the client." for i in range(6))
RATE = 24000


@pytest_twisted.async_yield_fixture()
async def real(tmp_path: Path) -> AsyncIterator[tuple[Core, RhapsodeClient]]:
    """
    A core on a loopback port with one real tone worker, and a client of it with its
    own connection pool on the running reactor.
    """
    from twisted.internet import reactor

    async for core in start_core(tmp_path):
        host, port = core.address
        client = RhapsodeClient(f"http://{host}:{port}", reactor=reactor)
        yield core, client
        await client.close()


@implementer(IConsumer)
class PausingConsumer:
    """
    Pauses its producer at the first piece and resumes it a moment later, as a slow
    consumer would.
    """

    def __init__(self, reactor: Any) -> None:
        self.reactor = reactor
        self.producer: Any = None
        self.data = b""
        self.paused = 0

    def registerProducer(self, producer: Any, streaming: bool) -> None:
        self.producer = producer

    def unregisterProducer(self) -> None:
        self.producer = None

    def write(self, data: bytes) -> None:
        if not self.data:
            self.paused += 1
            self.producer.pauseProducing()
            self.reactor.callLater(0.2, self.producer.resumeProducing)
        self.data += data


@pytest_twisted.ensureDeferred
async def test_speaks_through_the_real_core(real: tuple[Core, RhapsodeClient]) -> None:
    """
    Through a real core, a buffered speak is audio of the length its duration says, the
    same again for the same seed; and the same request streamed (to a callable, and to
    a consumer that pauses the socket) delivers the same bytes both times.
    """
    from twisted.internet import reactor

    _, client = real
    buffered = await client.speak("tone", TEXT, format="pcm", seed=5)
    assert buffered.content_type.startswith("audio/L16")
    assert len(buffered.data) > RATE  # over half a second of 16-bit mono
    assert len(set(buffered.data)) > 16
    assert buffered.duration_ms == round(len(buffered.data) // 2 * 1000 / RATE)

    assert (await client.speak("tone", TEXT, format="pcm", seed=5)).data == buffered.data

    pieces: list[bytes] = []
    received = await client.speak_to(pieces.append, "tone", TEXT, format="pcm", seed=5)
    streamed = b"".join(pieces)
    assert received == len(streamed) > RATE and len(set(streamed)) > 16

    consumer = PausingConsumer(reactor)
    verifyObject(IConsumer, consumer)
    assert await client.speak_to(consumer, "tone", TEXT, format="pcm", seed=5) == received
    assert consumer.data == streamed and consumer.paused == 1
    assert consumer.producer is None


@pytest_twisted.ensureDeferred
async def test_real_core_errors_and_reads(real: tuple[Core, RhapsodeClient]) -> None:
    """
    An unknown engine raises UnknownEngine naming the engine field and listing "tone"; a
    bad field raises BadRequest naming it; /engines and /health match the public shapes.
    """
    _, client = real
    with pytest.raises(UnknownEngine) as unknown:
        await client.speak("nope", "hi")
    assert "tone" in unknown.value.message and unknown.value.field == "engine"
    assert not unknown.value.retryable
    with pytest.raises(UnknownEngine):
        await client.voices("nope")
    with pytest.raises(BadRequest) as bad:
        await client.speak("tone", "hi", colour="red")
    assert bad.value.field == "colour"

    engines = await client.engines()
    validate(ENGINE_LIST, engines)
    assert [e["id"] for e in engines] == ["tone"]
    health = await client.health()
    validate(PUBLIC_HEALTH, health)
    caps = await client.capabilities("tone")
    assert caps["engine"]["id"] == "tone"


@pytest_twisted.ensureDeferred
async def test_voices_round_trip_through_the_real_core(real: tuple[Core, RhapsodeClient]) -> None:
    """
    From loopback, a voice cloned from a WAV reference and one blended from it are
    created through the core as the worker's own (previewUrl under the engine), listed,
    spoken in, and deleted; a second delete is unknown_voice.
    """
    _, client = real
    cloned = await client.create_voice(
        "tone", "viaclient", label="Via client", reference=("clip.wav", wav_clip())
    )
    validate(VOICE, cloned)
    assert cloned["previewUrl"] == "/engines/tone/voices/viaclient/preview"
    mixed = await client.create_voice("tone", "mixed", blend="viaclient(1)")
    assert mixed["id"] == "mixed"
    listed = [v["id"] for v in await client.voices("tone")]
    assert {"viaclient", "mixed"} <= set(listed)
    spoken = await client.speak("tone", "hello", voice="mixed")
    assert len(spoken.data) > 256

    await client.delete_voice("tone", "mixed")
    await client.delete_voice("tone", "viaclient")
    assert not {"viaclient", "mixed"} & {v["id"] for v in await client.voices("tone")}
    with pytest.raises(UnknownVoice):
        await client.delete_voice("tone", "viaclient")
