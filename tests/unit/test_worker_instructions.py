"""
What the SDK gives an adapter that fronts a model served elsewhere, or takes words for
its model: the instructions capability (declared, checked, handed on, refused by every
other variant), the remote declaration (in the capability document, and no memory
measured across its load), the variants /health reports unreachable, and a relaying
step that stops drawing from its adapter while the reader is paused.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Iterator, Mapping

import pytest
from _worker_fakes import FakePool, ImmediateReactor
from test_routes import call, make_app
from twisted.internet.defer import Deferred
from twisted.trial.unittest import SynchronousTestCase

from rhapsode_protocol import contract
from rhapsode_worker import Engine, Instructions, License, NativeFormat, Remote, SpeakRequest, Variant
from rhapsode_worker._model import ModelState
from rhapsode_worker._schedule import Job, Scheduler
from rhapsode_worker.testing import WorkerHarness


class WordedEngine(Engine):
    """
    Three builds: one that reads in styles it is told, one whose voice is described,
    and one that takes no words at all; the first two served elsewhere.
    """

    id = "worded"
    display_name = "Worded"
    license = License(code="MIT", weights="Apache-2.0", weights_commercial_use=True)
    native_format = NativeFormat(sample_rate=16000)
    default_variant = "styled"

    def __init__(self) -> None:
        super().__init__()
        self.heard: list[SpeakRequest] = []
        self.down: dict[str, str] = {}

    def variants(self) -> dict[str, Variant]:
        return {
            "styled": Variant(instructions=Instructions("style", max_characters=40),
                              remote=Remote("http://127.0.0.1:9", "Some/Model-CustomVoice")),
            "designed": Variant(instructions=Instructions("design", required=True),
                                remote=Remote("http://127.0.0.1:9")),
            "plain": Variant(),
        }

    def speak(self, request: SpeakRequest) -> Iterator[bytes]:
        self.heard.append(request)
        yield b"\x01\x00" * 8000

    def unreachable(self) -> Mapping[str, str]:
        return dict(self.down)


def post(stub: Any, body: dict[str, Any]) -> tuple[int, bytes]:
    case = SynchronousTestCase()
    response = case.successResultOf(stub.request("POST", "http://worker/speak", data=json.dumps(body).encode()))
    return response.code, case.successResultOf(stub.content(response))


def test_the_document_declares_instructions_and_remotes_per_variant() -> None:
    """
    A variant with instructions says their kind, ceiling and whether they are required;
    one served elsewhere names its server and model; one with neither says nothing, and
    the document still matches the contract.
    """
    _, stub = make_app(WordedEngine())
    code, caps = call(stub, "GET", "/capabilities")
    assert code == 200
    contract.validate(contract.CAPABILITIES, caps)
    variants = caps["variants"]
    assert variants["styled"]["instructions"] == {"kind": "style", "maxCharacters": 40, "required": False}
    assert variants["styled"]["remote"] == {"server": "http://127.0.0.1:9", "model": "Some/Model-CustomVoice"}
    assert variants["designed"]["instructions"] == {"kind": "design", "maxCharacters": 1000, "required": True}
    assert variants["designed"]["remote"] == {"server": "http://127.0.0.1:9"}
    assert "instructions" not in variants["plain"] and "remote" not in variants["plain"]


def test_instructions_reach_the_adapter_only_where_declared(tmp_path: Path) -> None:
    """
    A style variant hands the instructions on with the text; the variant that declares
    none refuses them as unsupported naming the field, before the adapter runs.
    """
    engine = WordedEngine()
    worker = WorkerHarness(lambda context: engine, tmp_path)
    spoken = worker.post("/speak", {"text": "Hello.", "variant": "styled", "instructions": "Cheerfully.",
                                    "format": "pcm", "stream": False})
    assert spoken.code == 200 and spoken.complete
    assert [r.instructions for r in engine.heard] == ["Cheerfully."]
    refused = worker.post("/speak", {"text": "Hello.", "variant": "plain", "instructions": "Cheerfully."})
    error = refused.json()["error"]
    assert (refused.code, error["code"], error["field"]) == (422, "unsupported", "instructions")
    assert len(engine.heard) == 1


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"text": "Hello.", "variant": "styled", "instructions": "x" * 41}, 400, "bad_request"),
        ({"text": "Hello.", "variant": "styled", "instructions": ""}, 400, "bad_request"),
        ({"text": "Hello.", "variant": "designed"}, 400, "bad_request"),
    ],
)
def test_instructions_are_held_to_the_variant(body: dict[str, Any], status: int, code: str) -> None:
    """
    Over the variant's ceiling, empty, or missing where the variant requires them: each
    refused naming instructions, and nothing is spoken.
    """
    engine = WordedEngine()
    _, stub = make_app(engine)
    answered, raw = post(stub, body)
    error = json.loads(raw)["error"]
    assert (answered, error["code"], error["field"]) == (status, code, "instructions")
    assert engine.heard == []


def test_health_names_the_variants_that_cannot_be_reached() -> None:
    """
    What the adapter says it cannot reach is on /health, by variant (a name it does not
    serve is left out), and absent once it can reach them all.
    """
    engine = WordedEngine()
    _, stub = make_app(engine)
    engine.down = {"designed": "http://127.0.0.1:9 refused the connection", "gone": "x"}
    code, health = call(stub, "GET", "/health")
    contract.validate(contract.HEALTH, health)
    assert health["unreachable"] == {"designed": "http://127.0.0.1:9 refused the connection"}
    engine.down = {}
    assert "unreachable" not in call(stub, "GET", "/health")[1]


def test_remote_variants_load_beside_each_other_and_measure_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """
    A variant served elsewhere loads without unloading what is resident and without a
    memory measurement (what this process grew by is not the model), so two of them
    are resident at once and switching between them waits on nothing; an unload lets
    go of both.
    """
    from rhapsode_worker import _memory

    monkeypatch.setattr(_memory, "device_bytes", lambda: pytest.fail("a remote load measured memory"))
    events: list[str] = []

    class Probed(WordedEngine):
        def load(self, variant: str) -> None:
            events.append(f"load {variant}")

        def unload(self) -> None:
            events.append("unload")

    pool = FakePool()
    model = ModelState(Probed(), ImmediateReactor(), pool)
    for variant in ("styled", "designed"):
        loading = Deferred.fromCoroutine(model.ensure(variant))
        pool.run_next()
        assert loading.called
    assert events == ["load styled", "load designed"]
    assert model.resident("styled") and model.resident("designed")
    assert (model.state, model.variant, model.model_bytes) == ("loaded", "designed", None)
    Deferred.fromCoroutine(model.ensure("styled"))
    assert pool.calls == [], "a remote variant loaded already is not loaded again"
    unloading = Deferred.fromCoroutine(model.unload())
    pool.run_next()
    assert unloading.called and events[-1] == "unload"
    assert not model.resident("styled") and not model.resident("designed")


def _drawing(drawn: list[int], chunks: int) -> Any:
    def speak() -> Iterator[bytes]:
        for index in range(chunks):
            drawn.append(index)
            yield b"\x00" * 300_000  # over a batch: each chunk is handed over at once

    return speak


def test_a_relaying_step_draws_nothing_more_while_its_reader_is_paused() -> None:
    """
    Relaying, a paused job's step stops drawing chunks from the adapter (so nothing more
    is read from the server that makes them) until the reader resumes; a cancel lets it
    go at once.  A computing engine's step runs on regardless.
    """
    model = ModelState(WordedEngine(), ImmediateReactor(), FakePool())
    for relays, expected in ((False, [0, 1, 2]), (True, [0])):
        drawn: list[int] = []
        speak = _drawing(drawn, 3)
        job = Job("styled", [speak], lambda pcm: None)
        job.pauseProducing()
        scheduler = Scheduler(ImmediateReactor(), FakePool(), model, relays=relays)
        running = threading.Thread(target=scheduler._drain_step, args=(job, speak, False), daemon=True)
        running.start()
        running.join(0.5 if relays else 30)
        assert drawn == expected
        assert running.is_alive() is relays
        job.resumeProducing()
        running.join(30)
        assert not running.is_alive() and drawn == [0, 1, 2]

    drawn = []
    speak = _drawing(drawn, 3)
    job = Job("styled", [speak], lambda pcm: None)
    job.pauseProducing()
    scheduler = Scheduler(ImmediateReactor(), FakePool(), model, relays=True)
    running = threading.Thread(target=scheduler._drain_step, args=(job, speak, False), daemon=True)
    running.start()
    running.join(0.5)
    job.cancel()
    running.join(30)
    assert not running.is_alive() and drawn == [0]
