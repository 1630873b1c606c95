"""
The worker's routes on an in-memory reactor (StubTreq): health and capabilities, what an
adapter can claim, validation before the adapter sees anything, and draining.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import pytest
from treq.testing import StubTreq
from twisted.internet.defer import maybeDeferred
from twisted.internet.testing import MemoryReactorClock
from zope.interface.verify import verifyObject

from rhapsode_worker import (
    DialogueRequest,
    Engine,
    IEngine,
    License,
    NativeFormat,
    Reference,
    SpeakRequest,
    Variant,
    Voice,
    contract,
)
from rhapsode_worker._model import ModelState
from rhapsode_worker._runtime import ContractRefused, Spawn, SpawnError, negotiate
from rhapsode_worker._schedule import Scheduler
from rhapsode_worker._routes import WorkerApp


class PlainEngine(Engine):
    """
    Speaks, and writes nothing optional.
    """

    id = "plain"
    display_name = "Plain"
    license = License(code="Apache-2.0", weights="CC-BY-4.0", weights_commercial_use=True)
    native_format = NativeFormat(sample_rate=16000)
    default_variant = "v1"

    def variants(self) -> dict[str, Variant]:
        return {
            "v1": Variant(cues=("laugh",), dials={"speed": (0.5, 2.0, 1.0)}, languages=("en", "de")),
            "v2": Variant(deliveries=("hushed",), max_characters=100),
        }

    def speak(self, request: SpeakRequest) -> Iterator[bytes]:
        yield b"\x00\x00" * 16000


class RichEngine(PlainEngine):
    """
    Writes every optional part, so every variant may claim them.
    """

    reference_formats = ("wav",)

    def create_voice(self, voice_id: str, label: str, reference: Reference) -> Voice:
        raise NotImplementedError

    def blend_voice(self, voice_id: str, label: str, components: Any) -> Voice:
        raise NotImplementedError

    def dialogue(self, request: DialogueRequest) -> Iterator[bytes]:
        yield b""

    def variants(self) -> dict[str, Variant]:
        return {"v1": Variant(max_speakers=3), "v2": Variant(max_speakers=0, clones=False)}


def make_app(engine: Engine, formats: tuple[str, ...] = ("wav", "pcm")) -> tuple[WorkerApp, StubTreq]:
    reactor = MemoryReactorClock()
    model = ModelState(engine, reactor, None)  # type: ignore[arg-type]
    scheduler = Scheduler(reactor, None, model)  # type: ignore[arg-type]
    app = WorkerApp(
        engine,
        reactor=reactor,
        scheduler=scheduler,
        model=model,
        formats=formats,
        ffmpeg=None,
        contract_version=1,
        on_terminate=lambda: None,
        blocking=run_here,
    )
    return app, StubTreq(app.app.resource())


#: What every blocking call ran, in order (the routes' thread pool, made synchronous).
blocked: list[str] = []


def run_here(f: Any, *args: Any, **kwargs: Any) -> Any:
    """
    The worker's blocking-call runner, run at once on this thread: a unit test's stand-in
    for the thread pool the runtime injects.
    """
    blocked.append(getattr(f, "__name__", repr(f)))
    return maybeDeferred(f, *args, **kwargs)


def call(stub: StubTreq, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    from twisted.trial.unittest import SynchronousTestCase

    case = SynchronousTestCase()
    kwargs = {"data": json.dumps(body).encode()} if body is not None else {}
    response = case.successResultOf(stub.request(method, "http://worker" + path, **kwargs))
    content = case.successResultOf(stub.content(response))
    return response.code, json.loads(content)


def test_engines_provide_the_interface() -> None:
    """
    The base class and adapters built on it satisfy IEngine.
    """
    assert verifyObject(IEngine, PlainEngine())
    assert verifyObject(IEngine, RichEngine())


def test_voice_routes_run_their_file_work_through_the_injected_runner() -> None:
    """
    Listing voices and checking one before a delete call the adapter through the runner
    the worker was given (in the runtime, a thread pool of its own), never Twisted's
    global one, so these routes answer on a memory reactor.
    """
    _, stub = make_app(PlainEngine())
    blocked.clear()
    code, voices = call(stub, "GET", "/voices")
    assert (code, voices) == (200, [])
    code, answer = call(stub, "DELETE", "/voices/nobody")
    assert (code, answer["error"]["code"]) == (404, "unknown_voice")
    assert blocked == ["voices", "voices"]


def test_health_while_unloaded() -> None:
    """
    /health answers with the process up, the model unloaded and no variant.
    """
    _, stub = make_app(PlainEngine())
    code, health = call(stub, "GET", "/health")
    assert code == 200
    contract.validate(contract.HEALTH, health)
    assert health["model"] == "unloaded" and "variant" not in health and "modelBytes" not in health


def test_capabilities_document_without_current() -> None:
    """
    The document validates, names both licences, lists every variant with its own
    ceiling and dials, and has no C{current} while nothing is loaded.
    """
    _, stub = make_app(PlainEngine())
    code, caps = call(stub, "GET", "/capabilities")
    assert code == 200
    contract.validate(contract.CAPABILITIES, caps)
    assert "current" not in caps
    assert caps["license"] == {
        "code": "Apache-2.0",
        "weights": "CC-BY-4.0",
        "weightsCommercialUse": True,
        "notes": "",
    }
    assert caps["variants"]["v1"]["dials"] == {"speed": {"min": 0.5, "max": 2.0, "default": 1.0}}
    assert caps["variants"]["v2"]["maxCharacters"] == 100
    assert caps["variants"]["v1"]["maxCharacters"] == 4096
    assert caps["formats"] == ["wav", "pcm"]
    assert caps["nativeFormat"] == {"encoding": "pcm_s16le", "sampleRate": 16000, "channels": 1}


def test_cannot_claim_what_was_not_written() -> None:
    """
    Cloning, blending and dialogue are declared only where the adapter overrides them,
    and per variant only where that variant allows it.
    """
    _, plain = make_app(PlainEngine())
    _, caps = call(plain, "GET", "/capabilities")
    for variant in caps["variants"].values():
        assert variant["cloning"] == {"supported": False}
        assert variant["blending"] == {"supported": False}
        assert "dialogue" not in variant
    _, rich = make_app(RichEngine())
    _, caps = call(rich, "GET", "/capabilities")
    assert caps["variants"]["v1"]["cloning"] == {"supported": True, "formats": ["wav"]}
    assert caps["variants"]["v1"]["dialogue"] == {"maxSpeakers": 3}
    assert caps["variants"]["v2"]["cloning"] == {"supported": False}
    assert "dialogue" not in caps["variants"]["v2"]
    assert caps["variants"]["v2"]["blending"] == {"supported": True}


@pytest.mark.parametrize(
    ("body", "status", "code", "field"),
    [
        ({"text": "hi", "format": "mp3"}, 422, "unsupported", "format"),
        ({"text": "hi", "language": "fr"}, 422, "unsupported", "language"),
        ({"text": "hi", "params": {"pitch": 1}}, 400, "bad_request", "params.pitch"),
        ({"text": "hi", "params": {"speed": 3}}, 400, "bad_request", "params.speed"),
        ({"text": "hi", "delivery": "hushed"}, 422, "unsupported", "delivery"),
        ({"text": "hi", "delivery": "frantic", "variant": "v2"}, 422, "unsupported", "delivery"),
        ({"text": "x" * 101, "variant": "v2"}, 400, "bad_request", "text"),
        ({"text": "hi", "variant": "v3"}, 400, "bad_request", "variant"),
        ({"text": "[sigh] [cough]"}, 400, "bad_request", "text"),
        ({"text": "hi", "stream": "yes"}, 400, "bad_request", "stream"),
        ({"text": "hi", "engine": "plain"}, 400, "bad_request", "engine"),
    ],
)
def test_speak_validated_before_the_adapter(body: dict[str, Any], status: int, code: str, field: str) -> None:
    """
    Every refusal happens before anything is scheduled, with the field named.
    """
    app, stub = make_app(PlainEngine())
    got, answer = call(stub, "POST", "/speak", body)
    assert (got, answer["error"]["code"], answer["error"]["field"]) == (status, code, field)
    contract.validate(contract.ERROR, answer)
    assert not app.scheduler.busy and app.model.state == "unloaded"


def test_undeclared_format_message_names_it() -> None:
    """
    A format the box cannot produce is refused naming the format and what is produced.
    """
    _, stub = make_app(PlainEngine(), formats=("wav", "pcm"))
    _, answer = call(stub, "POST", "/speak", {"text": "hi", "format": "opus"})
    assert '"opus"' in answer["error"]["message"] and "wav, pcm" in answer["error"]["message"]


def test_dialogue_on_engine_without_it_is_unsupported() -> None:
    """
    An adapter that did not write dialogue answers /dialogue with unsupported.
    """
    _, stub = make_app(PlainEngine())
    code, answer = call(stub, "POST", "/dialogue", {"turns": [{"speaker": "a", "text": "hi"}]})
    assert code == 422 and answer["error"]["code"] == "unsupported"


def test_draining_worker_refuses_with_429() -> None:
    """
    Once draining, new work is refused as overloaded and retryable; health still answers.
    """
    app, stub = make_app(PlainEngine())
    app.draining = True
    code, answer = call(stub, "POST", "/speak", {"text": "hi"})
    assert code == 429 and answer["error"] == {
        "code": "overloaded",
        "message": "the worker is draining and takes no new requests",
        "retryable": True,
    }
    code, health = call(stub, "GET", "/health")
    assert code == 200 and health["draining"] is True


def test_terminate_answers_then_asks_to_drain() -> None:
    """
    POST /terminate answers 202 and schedules the drain on the reactor.
    """
    engine = PlainEngine()
    reactor = MemoryReactorClock()
    model = ModelState(engine, reactor, None)  # type: ignore[arg-type]
    asked: list[bool] = []
    app = WorkerApp(
        engine,
        reactor=reactor,
        scheduler=Scheduler(reactor, None, model),  # type: ignore[arg-type]
        model=model,
        formats=("wav",),
        ffmpeg=None,
        contract_version=1,
        on_terminate=lambda: asked.append(True),
        blocking=run_here,
    )
    code, answer = call(StubTreq(app.app.resource()), "POST", "/terminate")
    assert (code, answer) == (202, {"terminating": True})
    assert not asked
    reactor.advance(0)
    assert asked == [True]


def test_negotiation_picks_highest_not_above_offer() -> None:
    """
    The worker answers at the highest contract it speaks not above the offer, and
    refuses an offer below all of them naming both numbers.
    """
    assert negotiate(1) == 1
    assert negotiate(9) == 1
    with pytest.raises(ContractRefused) as refused:
        negotiate(0)
    assert "contract 0" in str(refused.value) and "contract 1" in str(refused.value)


def test_spawn_environment_parsed() -> None:
    """
    The three spawn variables are read; a bad listen string or contract is refused.
    """
    env = {
        "RHAPSODE_WORKER_LISTEN": "unix:/tmp/x.sock",
        "RHAPSODE_WORKER_ENGINE": "second-tone",
        "RHAPSODE_WORKER_CONTRACT": "3",
        "RHAPSODE_WORKER_VOICE_DIR": "/tmp/v",
    }
    spawn = Spawn.from_environ(env, PlainEngine())
    assert (spawn.listen, spawn.engine, spawn.contract, str(spawn.voice_dir)) == (
        "unix:/tmp/x.sock",
        "second-tone",
        1,
        "/tmp/v",
    )
    with pytest.raises(SpawnError):
        Spawn.from_environ(dict(env, RHAPSODE_WORKER_LISTEN="udp:1"), PlainEngine())
    with pytest.raises(SpawnError):
        Spawn.from_environ(dict(env, RHAPSODE_WORKER_CONTRACT="one"), PlainEngine())


def test_first_streamed_audio_leaves_with_the_headers_in_one_send() -> None:
    """
    On the worker's own site a streamed answer's headers and first audio reach the
    socket in one send as they are written, and each later piece in one more; a
    buffered answer writes nothing until it is complete.
    """
    from _sockets import FakeSocket
    from twisted.internet.address import IPv4Address

    from rhapsode_worker._routes import _AudioResponse, _BoundedRequest
    from rhapsode_worker._schedule import Job

    app, _ = make_app(PlainEngine())
    for stream in (True, False):
        sock = FakeSocket()
        site = app.site(access_log=False)
        channel = site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 1))
        channel.makeConnection(sock)
        request: Any = _BoundedRequest(channel)
        request.method, request.clientproto, request.uri = b"POST", b"HTTP/1.1", b"/speak"
        answer = _AudioResponse(app, request, "pcm", stream, Job("v1", [], lambda pcm: None))  # type: ignore[arg-type]
        answer.pcm(b"\x01\x00" * 100)
        answer.pcm(b"\x02\x00" * 100)
        if stream:
            assert len(sock.sent) == 2 and not sock.polled_for_writing
            head, _, first = sock.sent[0].partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 OK") and first == b"c8\r\n" + b"\x01\x00" * 100 + b"\r\n"
            assert sock.sent[1] == b"c8\r\n" + b"\x02\x00" * 100 + b"\r\n"
        else:
            assert sock.sent == [] and sock.queued() == 0


def test_the_workers_site_formats_no_access_line_above_info() -> None:
    """
    The worker's site, made for a log level above info, formats no access line for a
    request (twisted.web would format one per request and the filter would drop it);
    made for info, it formats and writes each once.
    """
    from twisted.web.test.requesthelper import DummyRequest

    app, _ = make_app(RichEngine())
    for enabled in (False, True):
        site = app.site(access_log=enabled)
        formatted: list[Any] = []
        lines: list[str] = []
        site._logFormatter = lambda when, request: formatted.append(request) or "line"  # type: ignore[attr-defined]
        site._logFile = type("Sink", (), {"write": lambda self, line: lines.append(line)})()  # type: ignore[attr-defined]
        site.log(DummyRequest([b"speak"]))  # type: ignore[no-untyped-call]
        assert (len(formatted), lines) == ((1, ["line\n"]) if enabled else (0, []))


def test_the_workers_site_asks_for_a_send_buffer_that_holds_a_batch() -> None:
    """
    The worker's site has its Unix connections ask for a send buffer larger than one
    batch of audio, so a batch never has to wait on the reader to be written.
    """
    from rhapsode_worker._schedule import _BATCH_BYTES, SEND_BUFFER_BYTES

    app, _ = make_app(PlainEngine())
    assert app.site().send_buffer == SEND_BUFFER_BYTES and SEND_BUFFER_BYTES > _BATCH_BYTES
