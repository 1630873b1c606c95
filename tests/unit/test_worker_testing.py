"""
rhapsode_worker.testing: an adapter under the worker's real routes, scheduler and model
state, on a memory reactor with a synchronous pool; what an engine author's own tests
see through it is what a worker process would answer.
"""

from __future__ import annotations

import struct
import threading
from pathlib import Path
from typing import Iterator

import pytest

from rhapsode_protocol import contract
from rhapsode_worker import (
    DialogueRequest,
    Engine,
    License,
    NativeFormat,
    Reference,
    SpeakRequest,
    Variant,
    Voice,
    VoiceStore,
    WorkerContext,
)
from rhapsode_worker.testing import MemoryWorkerReactor, SynchronousPool, WorkerHarness, WorkerResponse

RATE = 16000


class Recorder(Engine):
    """
    Says what it was asked, in order; speaks a tenth of a second per character; keeps
    its voices in the SDK's store under its context's voice folder.
    """

    id = "recorder"
    display_name = "Recorder"
    license = License(code="MIT", weights="CC0-1.0", weights_commercial_use=True, notes="a test's")
    native_format = NativeFormat(sample_rate=RATE)
    default_variant = "a"
    reference_formats = ("wav",)
    segment_characters = 20

    def __init__(self, context: WorkerContext) -> None:
        super().__init__(context)
        self.events: list[str] = []
        self.loaded: str | None = None
        self.store = VoiceStore(context.voice_dir)
        self.threads: set[int] = set()

    def variants(self) -> dict[str, Variant]:
        return {"a": Variant(), "b": Variant(max_speakers=2)}

    def load(self, variant: str) -> None:
        self.threads.add(threading.get_ident())
        self.events.append(f"load {variant}")
        self.loaded = variant

    def unload(self) -> None:
        self.events.append("unload")
        self.loaded = None

    def voices(self) -> list[Voice]:
        made = [Voice(id=i, label=r["label"], spec=f"{i}@1", builtin=False) for i, r in self.store.records()]
        return [Voice(id="plain", label="Plain", spec="plain@1"), *made]

    def speak(self, request: SpeakRequest) -> Iterator[bytes]:
        self.threads.add(threading.get_ident())
        self.events.append(f"speak {request.variant} with {self.loaded} loaded: {request.text}")
        if "fall" in request.text and request.segment_index:
            raise RuntimeError("fell over mid-stream")
        yield struct.pack("<h", 1000) * (RATE // 10 * len(request.text))

    def dialogue(self, request: DialogueRequest) -> Iterator[bytes]:
        self.events.append(f"dialogue {request.variant} with {self.loaded} loaded")
        yield b"\x00\x00" * RATE

    def create_voice(self, voice_id: str, label: str, reference: Reference) -> Voice:
        self.store.save(voice_id, {"label": label, "bytes": len(reference.data)})
        return Voice(id=voice_id, label=label, spec=f"{voice_id}@1", builtin=False)

    def delete_voice(self, voice_id: str) -> None:
        self.store.delete(voice_id)


@pytest.fixture()
def harness(tmp_path: Path) -> WorkerHarness:
    return WorkerHarness(Recorder, tmp_path)


def engine_of(harness: WorkerHarness) -> Recorder:
    assert isinstance(harness.engine, Recorder)
    return harness.engine


def test_the_documents_are_the_workers_own(harness: WorkerHarness) -> None:
    """
    /health and /capabilities answer as a worker does, valid against the contract, the
    engine named as the harness made it; an unknown route is the taxonomy's 404.
    """
    health = harness.get("/health")
    assert health.code == 200 and health.headers["content-type"] == "application/json"
    contract.validate(contract.HEALTH, health.json())
    caps = harness.get("/capabilities").json()
    contract.validate(contract.CAPABILITIES, caps)
    assert caps["engine"]["id"] == "recorder" and caps["formats"] == ["wav", "pcm"]
    assert caps["license"]["notes"] == "a test's"
    missing = harness.get("/nowhere")
    assert missing.code == 404 and missing.json()["error"]["field"] == "path"


def test_a_buffered_wav_is_read_whole_with_its_duration(harness: WorkerHarness) -> None:
    """
    /speak loads the default variant and answers the whole WAV, Content-Length and
    the duration header included; the engine spoke each segment the SDK cut.
    """
    response = harness.post("/speak", {"text": "Hello there, this is a test.", "format": "wav", "stream": False})
    assert response.code == 200 and response.complete
    assert response.body[:4] == b"RIFF" and int(response.headers["content-length"]) == len(response.body)
    (rate,) = struct.unpack("<I", response.body[24:28])
    assert rate == RATE
    assert response.duration_ms == (len(response.body) - 44) * 1000 // (2 * RATE)
    events = engine_of(harness).events
    assert events[0] == "load a" and len(events) == 3
    assert all(e.startswith("speak a with a loaded: ") for e in events[1:])


def test_a_streamed_answer_is_dechunked_with_its_trailer(harness: WorkerHarness) -> None:
    """
    A streamed pcm answer is chunked; the harness gives its body and the duration
    trailer.
    """
    response = harness.post("/speak", {"text": "Stream me.", "format": "pcm"})
    assert response.code == 200 and response.headers["transfer-encoding"] == "chunked"
    assert response.body == struct.pack("<h", 1000) * (RATE // 10 * len("Stream me."))
    assert response.duration_ms == 1000 and "x-rhapsode-duration-ms" in response.trailers


def test_refusals_come_back_as_envelopes_before_the_engine_is_called(harness: WorkerHarness) -> None:
    """
    Validation refuses before the adapter runs, with the taxonomy's envelope.
    """
    for body, field in [({"text": "hi", "variant": "c"}, "variant"), ({"text": "hi", "format": "mp3"}, "format")]:
        response = harness.post("/speak", body)
        assert response.code == 422 and response.json()["error"]["field"] == field
        contract.validate(contract.ERROR, response.json())
    assert engine_of(harness).events == []


def test_a_failure_after_the_first_audio_cuts_the_body(harness: WorkerHarness) -> None:
    """
    A generation that fails once audio has gone out aborts the connection: the harness
    says the body is incomplete, as a client would find it.
    """
    response = harness.post("/speak", {"text": "First part is fine. Then it will fall.", "format": "pcm"})
    assert response.code == 200 and not response.complete
    assert response.body and response.duration_ms is None


def test_the_sdk_loads_the_requested_variant_before_it_speaks(harness: WorkerHarness) -> None:
    """
    Whatever is loaded, a request for another variant unloads it and loads its own
    before a word is spoken, for speech and dialogue alike: the adapter never has to
    ask whether its model is the right one.
    """
    assert harness.post("/load", {"variant": "a"}).code == 200
    assert harness.post("/speak", {"text": "In b.", "variant": "b", "stream": False}).code == 200
    assert harness.post("/unload").code == 200
    dialogue = harness.post("/dialogue", {"variant": "b", "turns": [{"speaker": "x", "text": "hi"}], "stream": False})
    assert dialogue.code == 200
    assert engine_of(harness).events == [
        "load a",
        "unload",
        "load b",
        "speak b with b loaded: In b.",
        "unload",
        "load b",
        "dialogue b with b loaded",
    ]


def test_voices_are_made_through_the_form_into_the_contexts_folder(harness: WorkerHarness, tmp_path: Path) -> None:
    """
    create_voice sends the multipart form a client sends; the voice lands in the
    context's voice folder, is listed, and is deleted through the route.
    """
    made = harness.create_voice("mine", "Mine", reference=("me.wav", b"RIFF...."))
    assert made.code == 201 and made.json()["id"] == "mine"
    assert harness.context.voice_dir == tmp_path / "voices"
    assert (tmp_path / "voices" / "mine.json").is_file()
    assert [v["id"] for v in harness.get("/voices").json()] == ["plain", "mine"]
    wrong = harness.create_voice("other", reference=("me.mp3", b"ID3"))
    assert wrong.code == 422 and wrong.json()["error"]["field"] == "reference"
    assert harness.request("DELETE", "/voices/mine").code == 204
    assert [v["id"] for v in harness.get("/voices").json()] == ["plain"]


def test_everything_runs_on_the_tests_thread_through_the_pools(harness: WorkerHarness) -> None:
    """
    The adapter's model calls run on the harness's synthesis pool and its voice calls on
    its file pool, all on the test's own thread, and nothing is left waiting on the
    reactor once an answer is read.
    """
    harness.post("/speak", {"text": "Hello.", "stream": False})
    harness.get("/voices")
    assert engine_of(harness).threads == {threading.get_ident()}
    assert "_load_measured" in harness.pool.ran and "_drain_step" in harness.pool.ran
    assert harness.files.ran == ["voices"]
    now = harness.reactor.seconds()
    assert not [c for c in harness.reactor.getDelayedCalls() if c.getTime() <= now]


def test_the_context_environment_is_the_tests_alone(tmp_path: Path) -> None:
    """
    The engine's context carries the environment the test gives, and nothing of the
    test process's own; /health names the id it was given.
    """
    harness = WorkerHarness(Recorder, tmp_path, environ={"RHAPSODE_WORKER_CORES": "2"}, name="recorder-b")
    assert dict(harness.context.environ) == {"RHAPSODE_WORKER_CORES": "2"} and harness.context.cores == 2
    assert harness.get("/health").json()["engine"] == "recorder-b"


def test_the_pool_runs_calls_in_order_on_the_next_turn() -> None:
    """
    SynchronousPool runs nothing at once: each call runs when the reactor next turns,
    in the order given, and its result (or failure) reaches the callback.
    """
    reactor = MemoryWorkerReactor()
    pool = SynchronousPool(reactor)
    results: list[tuple[bool, object]] = []

    def boom() -> None:
        raise ValueError("no")

    pool.callInThreadWithCallback(lambda ok, r: results.append((ok, r)), lambda: 1)
    pool.callInThreadWithCallback(lambda ok, r: results.append((ok, r)), boom)
    assert results == []
    reactor.advance(0)
    assert results[0] == (True, 1) and results[1][0] is False and pool.ran == ["<lambda>", "boom"]


def test_a_response_reports_what_arrived() -> None:
    """
    A response's JSON and duration are read from its body, header or trailer.
    """
    assert WorkerResponse(200, {}, b'{"a": 1}').json() == {"a": 1}
    assert WorkerResponse(200, {"x-rhapsode-duration-ms": "5"}, b"").duration_ms == 5
    assert WorkerResponse(200, {}, b"", {"x-rhapsode-duration-ms": "7"}).duration_ms == 7
    assert WorkerResponse(200, {}, b"").duration_ms is None
