"""
The worker's routes on an in-memory reactor (StubTreq): health and capabilities, what an
adapter can claim, validation before the adapter sees anything, and draining.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest
from _worker_fakes import MemoryWorkerReactor, SynchronousPool
from treq.testing import StubTreq
from twisted.internet.defer import maybeDeferred
from zope.interface.verify import verifyObject

from rhapsode_protocol import contract
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
    WorkerContext,
)
from rhapsode_worker._model import ModelState
from rhapsode_worker._routes import WorkerApp
from rhapsode_worker._runtime import ContractRefused, Spawn, SpawnError, negotiate
from rhapsode_worker._schedule import Scheduler


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
    reactor = MemoryWorkerReactor()
    pool = SynchronousPool(reactor)
    model = ModelState(engine, reactor, pool)
    scheduler = Scheduler(reactor, pool, model)
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
        ({"text": "hi", "variant": "v3"}, 422, "unsupported", "variant"),
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
    app.lifecycle.drain()
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
    reactor = MemoryWorkerReactor()
    pool = SynchronousPool(reactor)
    model = ModelState(engine, reactor, pool)
    asked: list[bool] = []
    app = WorkerApp(
        engine,
        reactor=reactor,
        scheduler=Scheduler(reactor, pool, model),
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
    The three spawn variables are read, and the context the engine is made with takes
    the voice folder, the cores and a cache named after the engine's own id; a bad
    listen string or contract is refused, and a bad core budget only when it is read
    (a load that needs it fails, naming the variable).
    """
    env = {
        "RHAPSODE_WORKER_LISTEN": "unix:/tmp/x.sock",
        "RHAPSODE_WORKER_ENGINE": "second-tone",
        "RHAPSODE_WORKER_CONTRACT": "3",
        "RHAPSODE_WORKER_VOICE_DIR": "/tmp/v",
        "RHAPSODE_WORKER_CORES": "3",
        "XDG_CACHE_HOME": "/tmp/cache",
    }
    spawn = Spawn.from_environ(env, "plain")
    assert (spawn.listen, spawn.engine, spawn.contract) == ("unix:/tmp/x.sock", "second-tone", 1)
    assert spawn.context == WorkerContext(
        voice_dir=Path("/tmp/v"), cache_dir=Path("/tmp/cache/rhapsode/plain"), environ=env
    )
    assert dict(spawn.context.environ) == env and spawn.context.cores == 3
    with pytest.raises(SpawnError):
        Spawn.from_environ(dict(env, RHAPSODE_WORKER_LISTEN="udp:1"), "plain")
    with pytest.raises(SpawnError):
        Spawn.from_environ(dict(env, RHAPSODE_WORKER_CONTRACT="one"), "plain")
    unbudgeted = Spawn.from_environ(dict(env, RHAPSODE_WORKER_CORES="0"), "plain")
    with pytest.raises(ValueError, match="RHAPSODE_WORKER_CORES must be a positive integer"):
        unbudgeted.context.cores


def test_the_context_defaults_follow_the_xdg_folders(tmp_path: Path) -> None:
    """
    Without the core's variables, voices go under XDG_DATA_HOME (or ~/.local/share) by
    the id the worker runs as, and the cache under XDG_CACHE_HOME (or ~/.cache) by the
    engine's own id.
    """
    home = Path.home()
    bare = WorkerContext.from_environ({"RHAPSODE_WORKER_CORES": "2"}, "plain")
    assert (bare.voice_dir, bare.cache_dir, bare.cores) == (
        home / ".local" / "share" / "rhapsode" / "voices" / "plain",
        home / ".cache" / "rhapsode" / "plain",
        2,
    )
    named = WorkerContext.from_environ(
        {"RHAPSODE_WORKER_ENGINE": "plain-b", "XDG_DATA_HOME": str(tmp_path)}, "plain"
    )
    assert named.voice_dir == tmp_path / "rhapsode" / "voices" / "plain-b"
    assert named.cache_dir == home / ".cache" / "rhapsode" / "plain"


def test_an_engine_made_without_a_context_says_so_when_asked() -> None:
    """
    An engine a test makes without a context works until it reads its context, which
    then names the engine and what gives one.
    """
    with pytest.raises(RuntimeError, match="PlainEngine was made without a WorkerContext"):
        PlainEngine().context
    context = WorkerContext(voice_dir=Path("/v"), cache_dir=Path("/c"))
    assert PlainEngine(context).context is context


def test_first_streamed_audio_leaves_with_the_headers_in_one_send() -> None:
    """
    On the worker's own site a streamed answer's headers and first audio reach the
    socket in one send as they are written, and each later piece in one more; a
    buffered answer writes nothing until it is complete.
    """
    from _sockets import FakeSocket
    from twisted.internet.address import IPv4Address

    from rhapsode_protocol.http.site import EagerRequest
    from rhapsode_worker._routes import _AudioResponse
    from rhapsode_worker._schedule import Job

    app, _ = make_app(PlainEngine())
    for stream in (True, False):
        sock = FakeSocket()
        site = app.site(access_log=False)
        channel = site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 1))
        channel.makeConnection(sock)
        request: Any = EagerRequest(channel)
        request.method, request.clientproto, request.uri = b"POST", b"HTTP/1.1", b"/speak"
        answer = _AudioResponse(app, request, "pcm", stream, Job("v1", [], lambda pcm: None))
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
    The worker's site, made for a log level above info, emits no access event for a
    request (the filter would only drop it); made for info, it emits each once, however
    often it is asked.
    """
    from twisted.logger import globalLogPublisher
    from twisted.web.test.requesthelper import DummyRequest

    app, _ = make_app(RichEngine())
    for enabled in (False, True):
        site = app.site(access_log=enabled)
        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        try:
            request = DummyRequest([b"speak"])  # type: ignore[no-untyped-call]
            request.code, request.uri = 200, b"/speak"
            site.log(request)
            site.log(request)
        finally:
            globalLogPublisher.removeObserver(events.append)
        access = [e for e in events if e.get("log_namespace") == "rhapsode.access"]
        assert len(access) == (1 if enabled else 0)


def test_the_workers_site_asks_for_a_send_buffer_that_holds_a_batch() -> None:
    """
    The worker's site has its Unix connections ask for a send buffer larger than one
    batch of audio, so a batch never has to wait on the reader to be written.
    """
    from rhapsode_worker._schedule import _BATCH_BYTES, SEND_BUFFER_BYTES

    app, _ = make_app(PlainEngine())
    assert app.site().send_buffer == SEND_BUFFER_BYTES and SEND_BUFFER_BYTES > _BATCH_BYTES


# -- voices, fetch, text and language ------------------------------------------------------


class VoiceEngine(PlainEngine):
    """
    Makes voices from a reference in memory, keeping each reference it was given, and
    fetches by noting the variant.
    """

    reference_formats = ("wav",)

    def __init__(self) -> None:
        self.made: dict[str, Reference] = {}
        self.fetched: list[str] = []

    def voices(self) -> list[Voice]:
        return [Voice(id=i, label=i, spec=f"{i}@1", builtin=False) for i in self.made]

    def create_voice(self, voice_id: str, label: str, reference: Reference) -> Voice:
        self.made[voice_id] = reference
        return Voice(id=voice_id, label=label, spec=f"{voice_id}@1", tags=("cloned",), builtin=False)

    def delete_voice(self, voice_id: str) -> None:
        del self.made[voice_id]

    def fetch(self, variant: str) -> None:
        self.fetched.append(variant)


class HeardEngine(RichEngine):
    """
    Keeps every request its speak and dialogue are given.
    """

    def __init__(self) -> None:
        self.heard: list[Any] = []

    def variants(self) -> dict[str, Variant]:
        return {"v1": Variant(languages=("en", "de-DE")), "v2": Variant(languages=("en-US",))}

    def speak(self, request: SpeakRequest) -> Iterator[bytes]:
        self.heard.append(request)
        yield b""

    def dialogue(self, request: DialogueRequest) -> Iterator[bytes]:
        self.heard.append(request)
        yield b""


def exchange(
    stub: StubTreq, method: str, path: str, data: bytes | None = None, content_type: bytes | None = None
) -> tuple[int, bytes]:
    from twisted.trial.unittest import SynchronousTestCase

    case = SynchronousTestCase()
    headers = {b"Content-Type": [content_type]} if content_type else {}
    response = case.successResultOf(stub.request(method, "http://worker" + path, data=data, headers=headers))
    return response.code, case.successResultOf(stub.content(response))


def form(*fields: tuple[str, bytes, str | None]) -> bytes:
    """
    A multipart/form-data body of (name, value, filename) with the boundary "xyz".
    """
    out = []
    for name, value, filename in fields:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out.append(f"--xyz\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + value + b"\r\n")
    return b"".join(out) + b"--xyz--\r\n"


FORM = b"multipart/form-data; boundary=xyz"


def heard_app(monkeypatch: pytest.MonkeyPatch) -> tuple[HeardEngine, StubTreq]:
    """
    A worker whose synthesis runs at once on this thread, answering 200 with no audio:
    what a request reached the adapter as is in the engine's C{heard}.
    """
    engine = HeardEngine()
    app, stub = make_app(engine)

    async def respond(request: Any, variant: str, segments: Any, fmt: str, stream: bool, rate: Any = None) -> bytes:
        for step in segments.steps:
            list(step())
        request.setResponseCode(200)
        return b"{}"

    monkeypatch.setattr(app, "_respond", respond)
    return engine, stub


def test_a_voice_is_created_with_201_and_deleted_with_204() -> None:
    """
    Creating a voice answers 201 with the voice as GET /voices lists it, the adapter
    given the form's fields and the reference's bytes intact (read off the reactor
    thread); deleting it answers 204 with no body.
    """
    engine = VoiceEngine()
    _, stub = make_app(engine)
    clip = b"RIFF\r\n--xyz-\r\n\x00\xff" * 500
    blocked.clear()
    code, body = exchange(
        stub,
        "POST",
        "/voices",
        form(("id", b"v1x", None), ("label", b"V1", None), ("reference", clip, "clip.wav"), ("transcript", b"Hi.", None)),
        FORM,
    )
    assert code == 201, body
    assert json.loads(body) == {
        "id": "v1x",
        "label": "V1",
        "spec": "v1x@1",
        "tags": ["cloned"],
        "previewUrl": "/voices/v1x/preview",
        "builtin": False,
    }
    made = engine.made["v1x"]
    assert (made.filename, made.extension, made.data, made.transcript) == ("clip.wav", "wav", clip, "Hi.")
    assert "read_form" in blocked
    assert exchange(stub, "DELETE", "/voices/v1x") == (204, b"")
    assert engine.made == {}


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ((("id", b"a", None), ("colour", b"red", None), ("reference", b"x", "a.wav")), "colour"),
        ((("id", b"a", None), ("id", b"b", None), ("reference", b"x", "a.wav")), "id"),
        ((("id", b"a", None), ("reference", b"x", "a.wav"), ("blend", b"b", None)), "reference"),
        ((("id", b"a", None),), "reference"),
        ((("reference", b"x", "a.wav"),), "id"),
        ((("id", b"../x", None), ("reference", b"x", "a.wav")), "id"),
    ],
    ids=["unknown", "twice", "both", "neither", "no-id", "bad-id"],
)
def test_a_create_keeps_the_field_rules(fields: tuple[tuple[str, bytes, str | None], ...], field: str) -> None:
    """
    An unknown field, a field twice, both or neither of reference and blend, and a
    missing or malformed id are each bad_request naming the field; nothing is made.
    """
    engine = VoiceEngine()
    _, stub = make_app(engine)
    code, body = exchange(stub, "POST", "/voices", form(*fields), FORM)
    assert (code, json.loads(body)["error"]["field"]) == (400, field)
    assert engine.made == {}


def test_a_form_of_many_parts_is_refused_naming_body() -> None:
    """
    A create of thousands of empty parts is bad_request naming "body" for its parts,
    and the adapter is never called.  (test_form reads 200,000 of them; an in-memory
    client takes seconds only to deliver that many here.)
    """
    engine = VoiceEngine()
    _, stub = make_app(engine)
    body = form(*((f"p{i}", b"", None) for i in range(5_000)))
    code, answer = exchange(stub, "POST", "/voices", body, FORM)
    error = json.loads(answer)["error"]
    assert (code, error["code"], error["field"]) == (400, "bad_request", "body")
    assert "parts" in error["message"] and engine.made == {}


def test_a_part_with_many_header_lines_is_refused_naming_body() -> None:
    """
    A create whose part carries a hundred header lines is bad_request naming "body".
    """
    engine = VoiceEngine()
    _, stub = make_app(engine)
    padding = b"".join(b"X-Pad-%d: y\r\n" % i for i in range(100))
    body = b'--xyz\r\nContent-Disposition: form-data; name="id"\r\n' + padding + b"\r\nv1\r\n--xyz--\r\n"
    code, answer = exchange(stub, "POST", "/voices", body, FORM)
    assert (code, json.loads(answer)["error"]["field"]) == (400, "body")


def test_fetch_answers_204_and_an_engine_without_it_422() -> None:
    """
    POST /fetch answers 204 with no body once the adapter has fetched; an engine
    without fetch answers 422 unsupported, and an unknown variant is unsupported
    naming the variants there are.
    """
    engine = VoiceEngine()
    _, stub = make_app(engine)
    assert exchange(stub, "POST", "/fetch", b'{"variant": "v2"}') == (204, b"")
    assert engine.fetched == ["v2"]
    code, answer = call(stub, "POST", "/fetch", {"variant": "v9"})
    assert (code, answer["error"]["code"], answer["error"]["field"]) == (422, "unsupported", "variant")
    assert "v1, v2" in answer["error"]["message"] and engine.fetched == ["v2"]
    _, plain = make_app(PlainEngine())
    code, answer = call(plain, "POST", "/fetch", {})
    assert (code, answer["error"]["code"]) == (422, "unsupported")


def test_an_unknown_variant_is_unsupported_on_every_route() -> None:
    """
    A variant the worker cannot load is 422 unsupported naming the field and the
    variants it has, on /speak, /dialogue and /load alike.
    """
    _, stub = make_app(RichEngine())
    for path, body in [
        ("/speak", {"text": "hi", "variant": "v9"}),
        ("/dialogue", {"turns": [{"speaker": "a", "text": "hi"}], "variant": "v9"}),
        ("/load", {"variant": "v9"}),
    ]:
        code, answer = call(stub, "POST", path, body)
        error = answer["error"]
        assert (code, error["code"], error["field"]) == (422, "unsupported", "variant"), path
        assert '"v9"' in error["message"] and "v1, v2" in error["message"]


@pytest.mark.parametrize(
    "text",
    ["\x01\x02\x07\x1b", "\u200b\u200f\u2066\u2069\ufeff", "\U0001f600\U0001f389 \u2764\ufe0f", "  \t ", "!?\u2026", "[sigh] \x07"],
    ids=["control", "invisible", "emoji", "spaces", "punctuation", "unclaimed-tag"],
)
def test_text_with_nothing_to_say_is_bad_request_naming_text(text: str) -> None:
    """
    Text with no letter or digit once cleaned (control characters, zero-width and
    direction marks, emoji, punctuation, unclaimed tags) is bad_request naming "text"
    on /speak and "turns[i].text" on /dialogue, never an adapter's failure.
    """
    app, stub = make_app(RichEngine())
    code, answer = call(stub, "POST", "/speak", {"text": text})
    assert (code, answer["error"]["code"], answer["error"]["field"]) == (400, "bad_request", "text")
    turns = [{"speaker": "a", "text": "Hello."}, {"speaker": "b", "text": text}]
    code, answer = call(stub, "POST", "/dialogue", {"turns": turns})
    assert (code, answer["error"]["code"], answer["error"]["field"]) == (400, "bad_request", "turns[1].text")
    assert not app.scheduler.busy and app.model.state == "unloaded"


def test_letters_among_control_characters_are_spoken_without_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """
    Text with letters among control and invisible characters is spoken, and the adapter
    is given it without the control characters.
    """
    engine, stub = heard_app(monkeypatch)
    code, _ = call(stub, "POST", "/speak", {"text": "Hello\x07 there,\x1b world\u200b."})
    assert code == 200
    (request,) = engine.heard
    assert "Hello" in request.text and "world" in request.text
    assert not any(ord(ch) < 32 or ch in "\x7f\x1b" for ch in request.text)


@pytest.mark.parametrize(
    ("variant", "asked", "given"),
    [
        ("v1", "DE-de", "de-DE"),
        ("v1", "EN", "en"),
        ("v1", None, "en"),
        ("v2", "fr", "en-US"),
        ("v2", "en", "en-US"),
    ],
)
def test_languages_compare_without_case_and_one_language_ignores_the_request(
    monkeypatch: pytest.MonkeyPatch, variant: str, asked: str | None, given: str
) -> None:
    """
    A language is matched without case and the adapter receives the variant's own
    spelling of it; a variant that lists one language ignores the request's.
    """
    engine, stub = heard_app(monkeypatch)
    body: dict[str, Any] = {"text": "hi", "variant": variant}
    if asked is not None:
        body["language"] = asked
    assert call(stub, "POST", "/speak", body)[0] == 200
    del body["text"]
    assert call(stub, "POST", "/dialogue", {**body, "turns": [{"speaker": "a", "text": "hi"}]})[0] == 200
    assert [r.language for r in engine.heard] == [given, given]


def test_a_language_a_variant_of_several_does_not_list_is_unsupported() -> None:
    """
    A variant that lists several languages refuses one it does not list, naming it.
    """
    _, stub = make_app(HeardEngine())
    code, answer = call(stub, "POST", "/speak", {"text": "hi", "language": "fr"})
    assert (code, answer["error"]["code"], answer["error"]["field"]) == (422, "unsupported", "language")
    assert '"fr"' in answer["error"]["message"]


class LeakyEngine(VoiceEngine):
    """
    Fails the way a library does, naming the box's paths in what it raises.
    """

    def create_voice(self, voice_id: str, label: str, reference: Reference) -> Voice:
        raise FileNotFoundError(2, "No such file or directory", "/srv/box/.venvs/leaky/voices/v1.json")

    def fetch(self, variant: str) -> None:
        from rhapsode_worker import ModelUnavailable

        raise ModelUnavailable("cannot reach the weights from unix:/run/box/workers/leaky.sock")


def test_no_path_of_the_box_reaches_a_client_and_the_log_keeps_it() -> None:
    """
    An adapter's failure that names absolute paths (a voice file, a socket) answers
    with each cut to its last component, while the log keeps the whole exception.
    """
    from twisted.logger import Logger

    app, stub = make_app(LeakyEngine())
    events: list[dict[str, Any]] = []
    app.log = Logger(observer=events.append)
    code, body = exchange(stub, "POST", "/voices", form(("id", b"v1", None), ("reference", b"x", "a.wav")), FORM)
    error = json.loads(body)["error"]
    assert (code, error["code"]) == (500, "internal")
    assert "v1.json" in error["message"] and "/srv" not in error["message"]
    logged = [e["log_failure"].value for e in events if "log_failure" in e]
    assert [exc.filename for exc in logged] == ["/srv/box/.venvs/leaky/voices/v1.json"]
    code, answer = call(stub, "POST", "/fetch", {})
    assert (code, answer["error"]["code"]) == (503, "model_unavailable")
    assert answer["error"]["message"] == "cannot reach the weights from unix:leaky.sock"


@pytest.mark.parametrize(
    ("message", "seen"),
    [
        ("ffmpeg exited with status 1: /tmp/tmpab12/out.mp3: No space left on device",
         "ffmpeg exited with status 1: out.mp3: No space left on device"),
        ("Load model from C:\\Users\\bob\\kokoro\\model.onnx failed", "Load model from model.onnx failed"),
        ("https://weights.example/a/b/c answered 404", "https://weights.example/a/b/c answered 404"),
        ("voices/a/b and 3/4/5", "voices/a/b and 3/4/5"),
    ],
)
def test_internal_envelopes_cut_absolute_paths_and_leave_urls(message: str, seen: str) -> None:
    """
    An internal failure's envelope cuts absolute paths (POSIX and Windows) to their
    last component and leaves URLs, relative paths and fractions as they are; the
    exception keeps its own message for the log.
    """
    from rhapsode_worker import Internal

    error = Internal(message)
    assert error.envelope()["error"]["message"] == seen and error.message == message


def test_audio_arriving_after_the_client_went_is_dropped_not_a_crash() -> None:
    """
    A piece of PCM that reaches a streamed answer whose client has already gone (the
    core cancelled the request as the job yielded) is dropped: no header is set, no
    producer registered on the gone connection, nothing raised.
    """
    from twisted.web.test.requesthelper import DummyRequest

    from rhapsode_worker._routes import _AudioResponse
    from rhapsode_worker._schedule import Job

    request: Any = DummyRequest([b"speak"])
    request._disconnected = True
    request.channel = None
    worker, _ = make_app(PlainEngine())
    answer = _AudioResponse(worker, request, "pcm", True, Job("v1", [], lambda pcm: None))
    answer.pcm(b"\x00\x01" * 100)
    assert request.responseCode is None and request.written == [] and answer.pcm_bytes == 0


class FloatEngine(PlainEngine):
    """
    Yields 32-bit float PCM, a tenth of a second a character, in chunks that split
    samples, with 100 ms of silence at each joint.
    """

    native_format = NativeFormat(sample_rate=16000, encoding="pcm_f32le")
    segment_characters = 10
    joint_silence_ms = 100

    def speak(self, request: SpeakRequest) -> Iterator[bytes]:
        import struct

        data = struct.pack("<f", 0.5) * (1600 * len(request.text))
        for start in range(0, len(data), 1001):
            yield data[start:start + 1001]


def test_float_pcm_reaches_the_client_as_16_bit(tmp_path: Path) -> None:
    """
    An adapter that yields pcm_f32le is served as 16-bit PCM: capabilities name
    pcm_s16le, the body is the converted samples with 16-bit silence at the joint, and
    the duration and the WAV header count 16-bit frames.
    """
    import struct

    from rhapsode_worker.testing import WorkerHarness

    worker = WorkerHarness(FloatEngine, tmp_path)
    caps = worker.get("/capabilities").json()
    assert caps["nativeFormat"] == {"encoding": "pcm_s16le", "sampleRate": 16000, "channels": 1}
    pcm = worker.post("/speak", {"text": "First one. Second.", "format": "pcm", "stream": False})
    half = struct.pack("<h", 16383)
    assert pcm.code == 200
    assert pcm.body == half * 1600 * len("First one.") + b"\x00\x00" * 1600 + half * 1600 * len("Second.")
    assert pcm.duration_ms == 1800
    wav = worker.post("/speak", {"text": "First one. Second.", "format": "wav", "stream": False})
    assert wav.body[44:] == pcm.body
    assert struct.unpack("<HHIIHH", wav.body[20:36]) == (1, 1, 16000, 32000, 2, 16)


def test_the_joint_silence_stands_between_sentences_and_not_inside_one(tmp_path: Path) -> None:
    """
    The adapter's joint silence is a pause between sentences: where the splitter cuts
    inside a sentence (here between words, the sentence being longer than a segment),
    the two pieces follow each other with none, and where a piece ends a sentence the
    next one starts after the declared silence.
    """
    import struct

    from rhapsode_protocol.text import split_pieces
    from rhapsode_worker.testing import WorkerHarness

    worker = WorkerHarness(FloatEngine, tmp_path)
    text = "Red fox runs far. Go."
    pieces = split_pieces(text, 10)
    assert [(p.text, p.ends_sentence) for p in pieces] == [("Red fox", False), ("runs far.", True), ("Go.", True)]
    half = struct.pack("<h", 16383)
    silence = b"\x00\x00" * 1600
    for stream in (True, False):
        pcm = worker.post("/speak", {"text": text, "format": "pcm", "stream": stream})
        assert pcm.code == 200, stream
        assert pcm.body == (
            half * 1600 * len("Red fox") + half * 1600 * len("runs far.") + silence + half * 1600 * len("Go.")
        ), stream
        assert pcm.duration_ms == 100 * len("Red foxruns far.Go.") + 100, stream


class FirstCutEngine(PlainEngine):
    """
    Records every piece it is asked to speak; a 10-character first segment.
    """

    segment_characters = 40
    first_segment_characters = 10
    spoken: list[str] = []

    def speak(self, request: SpeakRequest) -> Iterator[bytes]:
        type(self).spoken.append(request.text)
        yield b"\x00\x01" * 160 * len(request.text)


def test_only_a_streamed_answer_is_cut_with_a_short_first_segment(tmp_path: Path) -> None:
    """
    The short first segment buys first audio with one more generation, so a streamed
    answer is cut that way and a buffered one only at the segment size,
    which for a short text is the whole text in one generation.
    """
    from rhapsode_protocol.text import split_text
    from rhapsode_worker.testing import WorkerHarness

    worker = WorkerHarness(FirstCutEngine, tmp_path)
    text = "one two three four five six."
    assert split_text(text, 40, 10) == ["one two", "three four five six."]
    for stream, pieces in ((True, ["one two", "three four five six."]), (False, [text])):
        FirstCutEngine.spoken.clear()
        answer = worker.post("/speak", {"text": text, "format": "pcm", "stream": stream})
        assert answer.code == 200 and FirstCutEngine.spoken == pieces, stream
        assert len(answer.body) == 320 * len("".join(pieces))  # no joint silence declared


class GrowingEngine(FirstCutEngine):
    """
    A 10-character first segment, each later one up to twice the one before.
    """

    segment_growth = 2
    spoken: list[str] = []


def test_a_streamed_answer_grows_its_segments_where_the_engine_says(tmp_path: Path) -> None:
    """
    An engine that declares a growth gets a streamed answer's segments growing from the
    short first one (10, then at most 20, then 40 characters), and declares it in its
    capabilities; a buffered answer is cut at the segment size alone.
    """
    from rhapsode_protocol.text import split_text
    from rhapsode_worker.testing import WorkerHarness

    worker = WorkerHarness(GrowingEngine, tmp_path)
    text = "one two three four five six seven eight nine ten eleven twelve."
    growing = ["one two", "three four five six", "seven eight nine ten eleven twelve."]
    whole = ["one two three four five six seven eight", "nine ten eleven twelve."]
    assert split_text(text, 40) == whole
    for stream, pieces in ((True, growing), (False, whole)):
        GrowingEngine.spoken.clear()
        answer = worker.post("/speak", {"text": text, "format": "pcm", "stream": stream})
        assert answer.code == 200 and GrowingEngine.spoken == pieces, stream
    segmentation = worker.get("/capabilities").json()["variants"]["v1"]["segmentation"]
    assert segmentation == {"supported": True, "segmentCharacters": 40, "firstSegmentCharacters": 10,
                            "segmentGrowth": 2, "jointSilenceMs": 0}
    plain = WorkerHarness(FirstCutEngine, tmp_path / "plain").get("/capabilities").json()
    assert "segmentGrowth" not in plain["variants"]["v1"]["segmentation"]


def test_float_pcm_is_converted_inside_the_step_the_synthesis_pool_runs() -> None:
    """
    The conversion is part of each step the scheduler hands to the synthesis pool: a
    step, called, already yields 16-bit PCM, so none of the arithmetic is the reactor's.
    """
    app, _ = make_app(FloatEngine())
    request = SpeakRequest(text="abc", variant="v1")
    (step,) = app._segments(request).steps
    assert b"".join(step()) == b"\xff\x3f" * 1600 * 3
