"""
Voice aliases (voices.aliases) on fakes: an alias speaks the voice it names on its own
engine through every door, is listed as an alias (never as a voice) by the OpenAI voice
list and the capability document, and an unknown name, an alias of another engine
included, is refused naming the engine's voices and aliases.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from treq.testing import StubTreq
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer
from zope.interface.verify import verifyObject

from rhapsode._fleet.registry import EngineHandle, Registry
from rhapsode._interfaces import IClientSettings
from rhapsode._service import build_core

from _fakes import FakeClient, FakeSupervisor
from test_router import CAPABILITIES

VOICES = [
    {"id": "joe", "label": "Joe", "spec": "joe@1", "tags": ["en-US"], "previewUrl": "/voices/joe/preview", "builtin": True},
]


@implementer(IClientSettings)
class Clients:
    def __init__(self, aliases: Mapping[str, tuple[str, str]], rates: Mapping[str, int] | None = None) -> None:
        self.aliases = dict(aliases)
        self.rates = dict(rates or {})

    def voice_aliases(self) -> Mapping[str, tuple[str, str]]:
        return self.aliases

    def openai_sample_rate(self, engine: str) -> int | None:
        return self.rates.get(engine)


def make(clients: Clients) -> tuple[StubTreq, dict[str, FakeClient]]:
    workers = {}
    handles = {}
    for engine in ("piper", "tone"):
        caps = {**CAPABILITIES, "engine": {**CAPABILITIES["engine"], "id": engine}, "formats": ["wav", "mp3", "pcm"]}
        workers[engine] = FakeClient({(b"GET", "/capabilities"): (200, caps), (b"GET", "/voices"): (200, VOICES)})
        handles[engine] = EngineHandle(engine, workers[engine], FakeSupervisor())
    core = build_core(Registry(handles), reactor=MemoryReactorClock(), clients=clients)
    return StubTreq(core.resource()), workers


def call(stub: StubTreq, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    case = SynchronousTestCase()
    kwargs = {"data": json.dumps(body).encode()} if body is not None else {}
    response = case.successResultOf(stub.request(method, "http://core" + path, **kwargs))
    return response.code, json.loads(case.successResultOf(stub.content(response)))


def sent(worker: FakeClient) -> list[Any]:
    """The bodies of the /speak requests the worker was sent (each a BytesProducer of JSON)."""
    return [json.loads(body.data) for method, path, body in worker.requests if path == "/speak"]


def test_the_fake_is_the_seam() -> None:
    """The test's settings provide the seam the core reads."""
    assert verifyObject(IClientSettings, Clients({}))


def test_an_alias_speaks_its_voice_on_its_engine_by_every_door() -> None:
    """
    alloy means piper's joe: the OpenAI shim and /speak both send the worker joe.
    """
    stub, workers = make(Clients({"alloy": ("piper", "joe")}))
    stub.request("POST", "http://core/v1/audio/speech", data=json.dumps(
        {"model": "piper", "input": "Hello.", "voice": "alloy"}).encode())
    stub.request("POST", "http://core/speak", data=json.dumps({"engine": "piper", "text": "Hi.", "voice": "alloy"}).encode())
    assert [body["voice"] for body in sent(workers["piper"])] == ["joe", "joe"]


def test_an_alias_of_another_engine_is_still_an_unknown_voice() -> None:
    """
    Asked of tone, alloy (piper's) is unknown_voice: the message names tone's voices,
    and says which engine the alias belongs to. Nothing is spoken.
    """
    stub, workers = make(Clients({"alloy": ("piper", "joe")}))
    code, answer = call(stub, "POST", "/v1/audio/speech", {"model": "tone", "input": "Hello.", "voice": "alloy"})
    error = answer["error"]
    assert (code, error["code"], error["param"]) == (404, "unknown_voice", "voice")
    assert "its voices: joe" in error["message"] and 'alias of piper:joe' in error["message"]
    assert sent(workers["tone"]) == []


def test_an_unknown_voice_names_the_models_voices_and_aliases() -> None:
    """
    A voice the engine lacks (a pick from another engine in Open WebUI's list) is 404
    naming that engine's voices and its aliases.
    """
    stub, _ = make(Clients({"alloy": ("piper", "joe")}))
    code, answer = call(stub, "POST", "/v1/audio/speech", {"model": "piper", "input": "Hello.", "voice": "af_bella"})
    assert code == 404
    assert answer["error"]["message"] == 'no voice "af_bella" on piper (its voices: joe; aliases: alloy (joe))'


def test_aliases_are_listed_as_aliases() -> None:
    """
    GET /v1/audio/voices lists an alias beside its engine's voices, marked as one and
    naming what it means, each voice named with its engine when several are listed;
    the capability document carries the engine's aliases; /voices does not.
    """
    stub, _ = make(Clients({"alloy": ("piper", "joe")}))
    code, listing = call(stub, "GET", "/v1/audio/voices")
    assert code == 200
    flat = {v["id"]: v for v in listing["voices"]}
    assert flat["alloy"] == {"id": "alloy", "name": "alloy: alias of piper:joe", "alias_of": "joe", "engine": "piper",
                             "tags": ["alias"]}
    assert flat["joe"]["name"] == "Joe (piper)"
    piper = next(group for group in listing["data"] if group["model"] == "piper")
    assert [v["id"] for v in piper["voices"]] == ["joe", "alloy"]
    tone = next(group for group in listing["data"] if group["model"] == "tone")
    assert [v["id"] for v in tone["voices"]] == ["joe"]
    _, one = call(stub, "GET", "/v1/audio/voices?model=piper")
    assert [v["name"] for v in one["data"][0]["voices"]] == ["Joe", "alloy: alias of piper:joe"]
    _, caps = call(stub, "GET", "/engines/piper/capabilities")
    assert caps["aliases"] == {"alloy": "joe"}
    _, caps = call(stub, "GET", "/engines/tone/capabilities")
    assert "aliases" not in caps
    _, voices = call(stub, "GET", "/engines/piper/voices")
    assert [v["id"] for v in voices] == ["joe"]


def test_the_operators_rate_is_asked_for_where_the_request_names_none() -> None:
    """
    engines.<id>.openaiSampleRate: the shim asks piper for 24 kHz when the request names
    no sample_rate; a request's own wins; a format that cannot carry it is left alone.
    """
    stub, workers = make(Clients({}, {"piper": 24000}))
    for body in ({"response_format": "pcm"}, {"response_format": "pcm", "sample_rate": 16000}, {"response_format": "mp3"}):
        stub.request("POST", "http://core/v1/audio/speech", data=json.dumps(
            {"model": "piper", "input": "Hello.", **body}).encode())
    assert [body.get("sampleRate") for body in sent(workers["piper"])] == [24000, 16000, 24000]
    stub.request("POST", "http://core/speak", data=json.dumps({"engine": "piper", "text": "Hi.", "format": "pcm"}).encode())
    assert "sampleRate" not in sent(workers["piper"])[-1]


def test_the_config_file_takes_aliases_as_engine_colon_voice() -> None:
    """
    voices.aliases reads "engine:voice" for each alias; anything else is refused naming
    the alias; the settings API applies it live and shows it as the file writes it.
    """
    from pathlib import Path

    import pytest

    from rhapsode._config import ConfigError, ConfigSettings, parse_config
    from rhapsode._manage.settings import _json, applies

    config = parse_config({"voices": {"aliases": {"alloy": "piper:joe", "nova": "espeak:f3"}}}, Path("."))
    assert dict(config.voices.aliases) == {"alloy": ("piper", "joe"), "nova": ("espeak", "f3")}
    assert ConfigSettings(lambda: config).voice_aliases() == config.voices.aliases
    assert _json(config.voices.aliases) == {"alloy": "piper:joe", "nova": "espeak:f3"}
    assert applies("voices.aliases") == "live"
    for bad, where in (({"alloy": "joe"}, "voices.aliases.alloy"), ({"al loy": "piper:joe"}, "voices.aliases.al loy"),
                       ({"alloy": 3}, "voices.aliases.alloy"), (["alloy"], "voices.aliases")):
        with pytest.raises(ConfigError) as caught:
            parse_config({"voices": {"aliases": bad}}, Path("."))
        assert str(caught.value).startswith(where)
