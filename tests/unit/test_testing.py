"""
rhapsode.testing: the stub core answers the public routes with the real router over a
fake engine, through the real client, in memory; the fake engine answers what a test
sets, fails as told, and records what the core forwarded.
"""

from __future__ import annotations

import inspect
import json
from typing import Any, Coroutine

import pytest
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Protocol
from twisted.internet.testing import MemoryReactorClock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import ResponseDone, ResponseFailed
from zope.interface.verify import verifyObject

import rhapsode.testing
from rhapsode._upstream import WorkerClient, WorkerResponse
from rhapsode.client import (
    BadRequest,
    Conflict,
    Forbidden,
    Internal,
    ModelUnavailable,
    OutOfMemory,
    Overloaded,
    RhapsodeClient,
    SpeechError,
    TruncatedResponse,
    UnknownEngine,
    UnknownVoice,
    Unsupported,
)
from rhapsode.testing import FakeEngine, StubRhapsode, default_capabilities, fake_voice
from rhapsode_protocol import contract

CASE = SynchronousTestCase()


def result(coroutine: Coroutine[Any, Any, Any]) -> Any:
    return CASE.successResultOf(Deferred.fromCoroutine(coroutine))


def failure(coroutine: Coroutine[Any, Any, Any], *kinds: type[BaseException]) -> Any:
    return CASE.failureResultOf(Deferred.fromCoroutine(coroutine), *kinds).value


def stub_of(**engines: FakeEngine) -> StubRhapsode:
    return StubRhapsode(engines or {"tone": FakeEngine()})


def test_the_public_surface_is_pinned() -> None:
    """
    The module exports exactly its four public names, each of which exists.
    """
    assert sorted(rhapsode.testing.__all__) == ["FakeEngine", "StubRhapsode", "default_capabilities", "fake_voice"]
    for name in rhapsode.testing.__all__:
        assert getattr(rhapsode.testing, name) is not None


def test_the_default_documents_satisfy_the_contract() -> None:
    """
    The default capability document and a fake voice are valid against the contract's
    own schemas, and the document carries the engine id it is made for.
    """
    caps = default_capabilities("tone")
    contract.validate(contract.CAPABILITIES, caps)
    assert caps["engine"]["id"] == "tone"
    contract.validate(contract.VOICE, fake_voice("alto"))
    assert default_capabilities() is not default_capabilities()


def test_discovery_answers_without_starting_a_process() -> None:
    """
    /engines and /health list the engines in the order given, from the core's own state:
    no fake process is started to answer them.
    """
    first, second = FakeEngine(), FakeEngine()
    stub = StubRhapsode({"tone": first, "other": second})
    client = stub.client()
    engines = result(client.engines())
    assert [e["id"] for e in engines] == ["tone", "other"]
    contract.validate(contract.ENGINE_LIST, engines)
    health = result(client.health())
    contract.validate(contract.PUBLIC_HEALTH, health)
    assert health["status"] == "ok" and first.starts == second.starts == 0


def test_capabilities_and_voices_come_from_the_fake_through_the_router() -> None:
    """
    GET capabilities answers the fake's document under its engine id; GET voices its
    voices, with previewUrl rewritten under the engine as the core does.
    """
    stub = stub_of(tone=FakeEngine(voices=["alto", fake_voice("bass", "Basso")]))
    client = stub.client()
    assert result(client.capabilities("tone")) == default_capabilities("tone")
    voices = result(client.voices("tone"))
    assert [(v["id"], v["label"], v["previewUrl"]) for v in voices] == [
        ("alto", "alto", "/engines/tone/voices/alto/preview"),
        ("bass", "Basso", "/engines/tone/voices/bass/preview"),
    ]


def test_buffered_speech_is_the_audio_set_with_its_type_and_duration() -> None:
    """
    speak() gets the fake's pieces joined, the Content-Type of the format asked for and
    the duration the engine reports.
    """
    audio = [b"\x01" * 300, b"\x02" * 300]
    stub = stub_of(tone=FakeEngine(audio=audio, duration_ms=1234))
    answer = result(stub.client().speak("tone", "Hello.", format="pcm"))
    assert answer.data == b"".join(audio)
    assert answer.content_type == "audio/L16; rate=24000; channels=1"
    assert answer.duration_ms == 1234


def test_default_audio_is_a_quarter_second_of_the_format_asked() -> None:
    """
    Without audio set, a wav answer is a 44-byte header and 250 ms of silence at the
    native rate, and its duration is counted from those bytes.
    """
    answer = result(stub_of().client().speak("tone", "Hello."))
    assert answer.content_type == "audio/wav"
    assert answer.data[:4] == b"RIFF" and len(answer.data) == 44 + 24000 * 2 // 4
    assert answer.duration_ms == 250


def test_a_stream_arrives_piece_by_piece_on_the_clock() -> None:
    """
    With a chunk interval, the first piece reaches the sink at once and each next one
    only when the stub's clock has moved that far; speak_to ends with the byte count.
    """
    pieces = [b"a" * 300, b"b" * 300, b"c" * 300]
    stub = stub_of(tone=FakeEngine(audio=pieces, chunk_interval=0.5))
    received: list[bytes] = []
    done = Deferred.fromCoroutine(stub.client().speak_to(received.append, "tone", "Hello."))
    assert received == pieces[:1]
    stub.advance(0.4)
    assert received == pieces[:1]
    stub.advance(0.1)
    assert received == pieces[:2]
    CASE.assertNoResult(done)
    stub.advance(0.5)
    assert received == pieces and CASE.successResultOf(done) == 900


def test_the_engine_records_what_the_core_forwarded() -> None:
    """
    spoken holds each /speak body as the worker receives it: no engine or keep-alive,
    the variant resolved, a cue the variant does not claim stripped.
    """
    engine = FakeEngine()
    stub = stub_of(tone=engine)
    result(stub.client().speak("tone", "Hi [laugh] [sigh]", voice="alto", keepAliveSeconds=5, params={"speed": 1.5}))
    assert engine.spoken == [
        {"text": "Hi [laugh]", "voice": "alto", "params": {"speed": 1.5}, "stream": False, "variant": "default"}
    ]


def test_a_dialogue_is_answered_and_recorded() -> None:
    """
    dialogue() reaches the fake's /dialogue, is answered with its audio and recorded
    with its turns and voices.
    """
    engine = FakeEngine(audio=b"\x03" * 400, voices=["alto", "bass"])
    stub = stub_of(tone=engine)
    turns = [{"speaker": "A", "text": "Hello."}, {"speaker": "B", "text": "Hi."}]
    answer = result(stub.client().dialogue("tone", turns, voices={"A": "alto", "B": "bass"}))
    assert answer.data == b"\x03" * 400
    assert [(d["turns"], d["voices"]) for d in engine.dialogues] == [(turns, {"A": "alto", "B": "bass"})]
    assert engine.spoken == []


@pytest.mark.parametrize(
    "error",
    [
        BadRequest("no", field="params.speed"),
        UnknownVoice("no voice", field="voice"),
        Unsupported("no", field="format"),
        ModelUnavailable("loading"),
        OutOfMemory("full"),
        Overloaded("busy"),
        Internal("broke"),
        Conflict("not now"),
    ],
)
def test_a_failure_set_on_the_engine_reaches_the_client_as_its_own_class(error: SpeechError) -> None:
    """
    fail_next answers the next speech with the error's envelope and status; the client
    raises the same class with the same message, field and retryability.
    """
    engine = FakeEngine()
    engine.fail_next(error)
    raised = failure(stub_of(tone=engine).client().speak("tone", "Hello."), SpeechError)
    assert type(raised) is type(error)
    assert (raised.message, raised.field, raised.retryable) == (error.message, error.field, error.retryable)


def test_failures_are_used_up_in_order() -> None:
    """
    fail_next with times fails that many requests, then the engine answers again.
    """
    engine = FakeEngine()
    engine.fail_next(Overloaded("busy"), times=2)
    client = stub_of(tone=engine).client()
    failure(client.speak("tone", "One."), Overloaded)
    failure(client.speak("tone", "Two."), Overloaded)
    assert result(client.speak("tone", "Three.")).duration_ms == 250
    assert [body["text"] for body in engine.spoken] == ["One.", "Two.", "Three."]


def test_a_cut_stream_raises_truncated_with_what_arrived() -> None:
    """
    cut_next stops a streamed answer after that many bytes: the client has them and
    raises TruncatedResponse, never a short success.
    """
    engine = FakeEngine(audio=[b"\x01" * 512, b"\x02" * 512])
    engine.cut_next(after=700)
    received: list[bytes] = []
    raised = failure(stub_of(tone=engine).client().speak_to(received.append, "tone", "Hello."), TruncatedResponse)
    assert raised.received == 700 and b"".join(received) == b"\x01" * 512 + b"\x02" * 188


def test_a_cut_buffered_answer_is_internal() -> None:
    """
    A buffered answer cut short is refused before its headers, as internal.
    """
    engine = FakeEngine(audio=b"\x01" * 1024)
    engine.cut_next(after=100)
    failure(stub_of(tone=engine).client().speak("tone", "Hello."), Internal)


def test_audio_under_the_floor_is_not_audio_to_the_core() -> None:
    """
    The core's floor applies to the fake as to any worker: a 10-byte buffered answer is
    internal, a 10-byte stream is aborted.
    """
    client = stub_of(tone=FakeEngine(audio=b"x" * 10)).client()
    failure(client.speak("tone", "Hello."), Internal)
    failure(client.speak_to(lambda piece: None, "tone", "Hello."), TruncatedResponse)


@pytest.mark.parametrize(
    ("engine_id", "fields", "kind", "field"),
    [
        ("nope", {}, UnknownEngine, "engine"),
        ("tone", {"params": {"pitch": 1}}, BadRequest, "params.pitch"),
        ("tone", {"format": "mp3"}, Unsupported, "format"),
        ("tone", {"voice": "nobody"}, UnknownVoice, "voice"),
    ],
)
def test_the_cores_own_refusals_never_reach_the_engine(
    engine_id: str, fields: dict[str, Any], kind: type[SpeechError], field: str
) -> None:
    """
    A request the core refuses itself (unknown engine, unknown dial, a format the
    capabilities lack, an unknown voice) is refused as the server refuses it, naming
    the field, and the engine is never asked to speak.
    """
    engine = FakeEngine()
    raised = failure(stub_of(tone=engine).client().speak(engine_id, "Hello.", **fields), kind)
    assert raised.field == field and engine.spoken == []


def test_an_unknown_voice_is_refused_by_the_engine_once_it_is_loaded() -> None:
    """
    With the model resident the core leaves the voice to the worker, and the fake
    refuses it as a worker does: unknown_voice on the field.
    """
    engine = FakeEngine()
    client = stub_of(tone=engine).client()
    result(client.speak("tone", "Warm up."))
    raised = failure(client.speak("tone", "Hello.", voice="nobody"), UnknownVoice)
    assert raised.field == "voice" and len(engine.spoken) == 2


def test_new_capabilities_are_checked_and_read_again() -> None:
    """
    A document that is not one is refused naming the field; a valid one replaces the
    old at the core, which asks again: mp3, refused before, is answered after.
    """
    engine = FakeEngine()
    client = stub_of(tone=engine).client()
    failure(client.speak("tone", "Hello.", format="mp3"), Unsupported)
    broken = default_capabilities()
    del broken["formats"]
    with pytest.raises(ValueError, match="formats"):
        engine.capabilities = broken
    caps = default_capabilities("tone")
    caps["formats"].append("mp3")
    engine.capabilities = caps
    engine.audio = [b"\xff\xfb" * 200]
    answer = result(client.speak("tone", "Hello.", format="mp3"))
    assert (answer.content_type, answer.data, answer.duration_ms) == ("audio/mpeg", b"\xff\xfb" * 200, None)


def test_keep_alive_ends_on_the_stubs_clock() -> None:
    """
    keepAliveSeconds keeps the fake's model loaded until the clock passes it, then the
    core ends the worker, as on a real box; closing the stub leaves no timer behind.
    """
    engine = FakeEngine()
    stub = stub_of(tone=engine)
    client = stub.client()
    result(client.speak("tone", "Hello.", keepAliveSeconds=5))
    assert engine.loaded == "default" and result(client.engines())[0]["model"] == "loaded"
    stub.advance(4.9)
    assert engine.loaded == "default"
    stub.advance(0.2)
    assert engine.loaded is None and result(client.engines())[0]["process"] == "down"
    stub.close()
    assert stub.clock.getDelayedCalls() == []


def test_voices_are_managed_from_loopback() -> None:
    """
    From loopback, as on a real core, create_voice streams its form to the engine,
    which records it and lists the voice; delete_voice removes one.
    """
    engine = FakeEngine()
    client = stub_of(tone=engine).client()
    made = result(client.create_voice("tone", "mine", label="Mine", reference=("clip.wav", b"RIFF-bytes")))
    assert (made["id"], made["label"], made["builtin"]) == ("mine", "Mine", False)
    assert engine.created == [{"id": "mine", "label": "Mine", "reference": ("clip.wav", b"RIFF-bytes")}]
    result(client.delete_voice("tone", "alto"))
    assert [v["id"] for v in result(client.voices("tone"))] == ["mine"]
    failure(client.delete_voice("tone", "alto"), UnknownVoice)


def test_a_remote_caller_needs_the_management_token() -> None:
    """
    From a remote peer a management route is forbidden without the token and done
    with it; the public routes need none.
    """
    engine = FakeEngine()
    stub = StubRhapsode({"tone": engine}, management_token="s3cret", peer="203.0.113.9")
    failure(stub.client().delete_voice("tone", "alto"), Forbidden)
    assert [v["id"] for v in engine.voices] == ["alto"]
    result(stub.client(token="s3cret").delete_voice("tone", "alto"))
    assert engine.voices == []
    assert result(stub.client().speak("tone", "Hello.")).duration_ms == 250


def test_the_treq_client_reaches_routes_the_client_lacks() -> None:
    """
    stub.http is a treq client of the same core: a voice's preview answers wav.
    """
    stub = stub_of()
    response = CASE.successResultOf(stub.http.get(stub.base_url + "/engines/tone/voices/alto/preview"))
    body = CASE.successResultOf(response.content())
    assert response.code == 200 and response.headers.getRawHeaders("content-type") == ["audio/wav"]
    assert body[:4] == b"RIFF"
    missing = CASE.successResultOf(stub.http.get(stub.base_url + "/engines/tone/voices/nobody/preview"))
    assert missing.code == 404
    assert json.loads(CASE.successResultOf(missing.content()))["error"]["code"] == "unknown_voice"


def test_a_client_built_by_the_program_works_the_same() -> None:
    """
    A RhapsodeClient the program makes itself from base_url and http is as good as
    client().
    """
    stub = stub_of()
    client = RhapsodeClient(stub.base_url, http=stub.http)
    assert [e["id"] for e in result(client.engines())] == ["tone"]


class Reader(Protocol):
    def __init__(self) -> None:
        self.pieces: list[bytes] = []
        self.ended: Failure | None = None

    def dataReceived(self, data: bytes) -> None:
        self.pieces.append(data)

    def connectionLost(self, reason: Failure = Failure(ResponseDone())) -> None:
        self.ended = reason


def paced(clock: MemoryReactorClock) -> tuple[Any, Reader]:
    response = rhapsode.testing._Response(
        clock, 200, {b"Content-Type": b"audio/wav"}, [b"a", b"b", b"c"], interval=1.0, trailers={b"x-t": b"1"}
    )
    reader = Reader()
    response.deliverBody(reader)
    return response, reader


def test_a_paused_body_holds_its_pieces_until_resumed() -> None:
    """
    The fake body is a push producer: paused, it sends nothing however far the clock
    moves; resumed, it goes on; at its end the trailers are there.
    """
    clock = MemoryReactorClock()
    response, reader = paced(clock)
    delivery = reader.transport
    assert verifyObject(IPushProducer, delivery)
    assert reader.pieces == [b"a"]
    delivery.pauseProducing()
    clock.advance(5)
    assert reader.pieces == [b"a"]
    delivery.resumeProducing()
    assert reader.pieces == [b"a", b"b"]
    clock.advance(1)
    assert reader.pieces == [b"a", b"b", b"c"] and reader.ended is not None and reader.ended.check(ResponseDone)
    assert response.trailers == {b"x-t": b"1"}


def test_a_stopped_body_ends_as_failed_and_sends_no_more() -> None:
    """
    stopProducing ends the body at once as a failed response and cancels the next piece.
    """
    clock = MemoryReactorClock()
    response, reader = paced(clock)
    reader.transport.stopProducing()  # type: ignore[union-attr]
    assert reader.ended is not None and reader.ended.check(ResponseFailed)
    clock.advance(10)
    assert reader.pieces == [b"a"] and clock.getDelayedCalls() == [] and response.trailers == {}


@pytest.mark.parametrize("name", ["json", "request", "abort_all", "close"])
def test_the_fake_worker_takes_what_the_real_client_takes(name: str) -> None:
    """
    The fake worker stands in for the core's WorkerClient: each method the core calls
    has the same parameters, in the same order.
    """
    fake = inspect.signature(getattr(rhapsode.testing._Worker, name))
    real = inspect.signature(getattr(WorkerClient, name))
    assert list(fake.parameters) == list(real.parameters)


def test_the_fake_answer_has_what_the_real_answer_has() -> None:
    """
    The fake's answer has every attribute of the core's WorkerResponse that the core
    reads: code, phrase, headers, trailers and deliverBody.
    """
    real = WorkerResponse(None, 200, b"OK", None)  # type: ignore[arg-type]
    fake = rhapsode.testing._Response(MemoryReactorClock(), 200, {}, [])
    for name in ("code", "phrase", "headers", "trailers", "deliverBody"):
        assert hasattr(real, name) and hasattr(fake, name), name
    assert fake.phrase == b"OK"


def deliveries(stub: StubRhapsode) -> list[Any]:
    return [call for call in stub.clock.getDelayedCalls() if "_Delivery" in repr(call.func)]


def test_a_client_that_hangs_up_stops_the_engines_answer() -> None:
    """
    A program whose sink fails mid-stream closes its connection; the core hears it,
    stops the fake's answer (nothing more is scheduled) and lets go of the model.
    """
    stub = stub_of(tone=FakeEngine(audio=[b"\x01" * 512] * 3, chunk_interval=1.0))

    def speaker(piece: bytes) -> None:
        raise OSError("the speaker is unplugged")

    done = Deferred.fromCoroutine(stub.client().speak_to(speaker, "tone", "Hello."))
    stub.flush()
    assert str(CASE.failureResultOf(done, OSError).value) == "the speaker is unplugged"
    assert deliveries(stub) == []
    assert result(stub.client().engines())[0]["leases"] == 0


def test_closing_the_stub_abandons_a_stream_in_flight() -> None:
    """
    close() drops the connections still open: the program's stream ends truncated,
    and neither the fake's pacing nor any core timer is left on the clock.
    """
    stub = stub_of(tone=FakeEngine(audio=[b"\x01" * 512] * 3, chunk_interval=1.0))
    done = Deferred.fromCoroutine(stub.client().speak_to(lambda piece: None, "tone", "Hello."))
    assert deliveries(stub) != []
    stub.close()
    assert CASE.failureResultOf(done, TruncatedResponse).value.received == 512
    assert stub.clock.getDelayedCalls() == []
