"""
The core's router on an in-memory reactor (StubTreq) with fake workers: what it answers
without spawning, what it refuses before dispatch, and the one field it edits.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from treq.testing import StubTreq
from twisted.internet.defer import succeed
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase

from rhapsode._router import CoreApp
from rhapsode._registry import EngineHandle, Registry
from rhapsode_worker import contract

CAPABILITIES = {
    "contract": 1,
    "engine": {"id": "tone", "displayName": "Tone", "adapterVersion": "0.1.0"},
    "license": {"code": "MIT", "weights": "MIT", "weightsCommercialUse": True, "notes": ""},
    "device": {"type": "cpu"},
    "defaultVariant": "expressive",
    "variants": {
        "expressive": {"cues": ["laugh"], "deliveries": [], "dials": {}, "languages": ["en"], "maxCharacters": 4096,
                       "segmentation": {"supported": False}, "streaming": {"supported": True, "granularity": "chunk"}},
    },
    "formats": ["wav"],
    "nativeFormat": {"encoding": "pcm_s16le", "sampleRate": 24000, "channels": 1},
}


class FakeClient:
    """
    Answers small JSON exchanges from a table and records them.
    """

    def __init__(self, answers: dict[tuple[bytes, str], tuple[int, Any]]) -> None:
        self.answers = answers
        self.calls: list[tuple[bytes, str]] = []

    async def json(self, method: bytes, path: str, body: Any = None) -> tuple[int, Any]:
        self.calls.append((method, path))
        return self.answers[(method, path)]


class FakeSupervisor:
    def __init__(self) -> None:
        self.state = "down"
        self.pid: int | None = None
        self.starts = 0

    def start(self) -> Any:
        self.starts += 1
        self.state, self.pid = "up", 4242
        return succeed("unix:/x")

    def stop(self, ask: bool = True) -> Any:
        return succeed(None)

    def health(self) -> dict[str, Any]:
        return {"process": self.state, "restarts": 0}


def make(answers: dict[tuple[bytes, str], tuple[int, Any]] | None = None) -> tuple[StubTreq, FakeClient, FakeSupervisor]:
    client = FakeClient(answers or {(b"GET", "/capabilities"): (200, CAPABILITIES)})
    supervisor = FakeSupervisor()
    handle = EngineHandle("tone", client, supervisor)  # type: ignore[arg-type]
    app = CoreApp(Registry({"tone": handle}), reactor=MemoryReactorClock())
    return StubTreq(app.resource()), client, supervisor


def call(stub: StubTreq, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    case = SynchronousTestCase()
    kwargs = {"data": json.dumps(body).encode()} if body is not None else {}
    response = case.successResultOf(stub.request(method, "http://core" + path, **kwargs))
    return response.code, json.loads(case.successResultOf(stub.content(response)))


def test_engines_and_health_never_spawn() -> None:
    """
    /engines and /health answer from the core's own state: no worker is started.
    """
    stub, client, supervisor = make()
    code, engines = call(stub, "GET", "/engines")
    assert code == 200 and engines == [{"id": "tone", "process": "down", "restarts": 0, "model": "unloaded"}]
    contract.validate(contract.ENGINE_LIST, engines)
    code, health = call(stub, "GET", "/health")
    assert code == 200
    contract.validate(contract.PUBLIC_HEALTH, health)
    assert health["engines"]["tone"]["process"] == "down"
    assert supervisor.starts == 0 and client.calls == []


def test_unknown_engine_lists_the_engines() -> None:
    """
    An engine the registry does not have is unknown_engine, naming the ones there are.
    """
    stub, _, supervisor = make()
    code, answer = call(stub, "POST", "/speak", {"engine": "nope", "text": "hi"})
    assert code == 404 and answer["error"]["code"] == "unknown_engine"
    assert "tone" in answer["error"]["message"]
    assert supervisor.starts == 0


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"engine": "tone"}, "text"),
        ({"engine": "tone", "text": "hi", "speed": 2}, "speed"),
        ({"engine": "tone", "text": "hi", "keepAliveSeconds": "soon"}, "keepAliveSeconds"),
    ],
)
def test_public_shape_refused_before_any_worker(body: dict[str, Any], field: str) -> None:
    """
    The public request shape is checked before any worker is touched, naming the field.
    """
    stub, client, supervisor = make()
    code, answer = call(stub, "POST", "/speak", body)
    assert code == 400 and answer["error"]["field"] == field
    assert supervisor.starts == 0 and client.calls == []


def test_unknown_variant_read_from_variants_not_current() -> None:
    """
    The effective variant is checked against the remembered variants.
    """
    stub, _, _ = make()
    code, answer = call(stub, "POST", "/speak", {"engine": "tone", "text": "hi", "variant": "turbo"})
    assert code == 400 and answer["error"]["field"] == "variant"
    assert "expressive" in answer["error"]["message"]


def test_licences_known_once_seen() -> None:
    """
    After the worker has been asked once, /engines carries both licences and the default
    variant without asking it again.
    """
    stub, client, _ = make()
    call(stub, "POST", "/speak", {"engine": "tone", "text": "hi", "variant": "turbo"})
    calls = len(client.calls)
    _, engines = call(stub, "GET", "/engines")
    assert engines[0]["license"] == CAPABILITIES["license"]
    assert engines[0]["defaultVariant"] == "expressive"
    assert len(client.calls) == calls


def test_preview_urls_rewritten_under_the_engine() -> None:
    """
    previewUrl is the one field the core edits on the way out.
    """
    voices = [{"id": "alto", "label": "Alto", "spec": "a@1", "tags": [], "previewUrl": "/voices/alto/preview", "builtin": True}]
    stub, _, _ = make({(b"GET", "/voices"): (200, voices)})
    code, listed = call(stub, "GET", "/engines/tone/voices")
    assert code == 200 and listed[0]["previewUrl"] == "/engines/tone/voices/alto/preview"
    assert {k: v for k, v in listed[0].items() if k != "previewUrl"} == {k: v for k, v in voices[0].items() if k != "previewUrl"}


@pytest.mark.parametrize(
    ("method", "path"),
    [("DELETE", "/engines/tone/voices/alto"), ("POST", "/engines/tone/unload"), ("POST", "/engines/tone/voices")],
)
def test_management_routes_refuse_without_the_guard(method: str, path: str) -> None:
    """
    A management route reached without the gate having admitted the request (here: a
    plain site, not CoreSite) refuses as forbidden instead of running unguarded.
    """
    stub, client, supervisor = make()
    code, answer = call(stub, method, path)
    assert code == 403 and answer["error"]["code"] == "forbidden"
    assert client.calls == [] and supervisor.starts == 0
