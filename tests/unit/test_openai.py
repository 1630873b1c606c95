"""
The OpenAI shim's translation into /speak (protocol.md section 11) on fakes: which
engine a model names, what each field becomes, what is refused rather than dropped, and
OpenAI's envelope with the retry header the SDKs read.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from twisted.internet.defer import Deferred
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase

from rhapsode._fleet.registry import EngineHandle, Registry
from rhapsode._http.envelopes import openai_envelope, should_retry
from rhapsode._service import build_core
from rhapsode_protocol.errors import (
    BadRequest,
    Internal,
    ModelUnavailable,
    Overloaded,
    SpeechError,
    UnknownEngine,
    Unsupported,
)

from _fakes import FakeClient, FakeSupervisor
from test_router import CAPABILITIES

SPEEDY = copy.deepcopy(CAPABILITIES)
SPEEDY["variants"]["fast"] = {**SPEEDY["variants"]["expressive"], "dials": {"speed": {"min": 0.5, "max": 2.0, "default": 1.0}}}


def shim(*engines: str, caps: dict[str, Any] = SPEEDY) -> Any:
    handles = {
        engine: EngineHandle(engine, FakeClient({(b"GET", "/capabilities"): (200, caps)}), FakeSupervisor())
        for engine in engines
    }
    return build_core(Registry(handles), reactor=MemoryReactorClock()).openai.translation


def native(target: Any, **body: Any) -> dict[str, Any]:
    case = SynchronousTestCase()
    result: dict[str, Any] = case.successResultOf(Deferred.fromCoroutine(target.native(body, stream=True)))
    return result


def refused(target: Any, kind: type[SpeechError], **body: Any) -> SpeechError:
    case = SynchronousTestCase()
    error: SpeechError = case.failureResultOf(Deferred.fromCoroutine(target.native(body, stream=True)), kind).value
    return error


def test_an_exact_engine_id_is_tried_before_a_variant() -> None:
    """
    A model that is an engine's id names that engine even with a colon in it; otherwise
    engine:variant splits at the last colon that leaves a known engine.
    """
    target = shim("kokoro", "kokoro:v1")
    assert target.resolve_model("kokoro:v1") == ("kokoro:v1", None)
    assert target.resolve_model("kokoro:v1:int8") == ("kokoro:v1", "int8")
    assert target.resolve_model("kokoro:v2") == ("kokoro", "v2")
    assert target.resolve_model("kokoro") == ("kokoro", None)


def test_tts_1_is_not_an_engine() -> None:
    """
    tts-1 is unknown_engine about the model, and the message lists the engines there are:
    no alias maps it to a default engine.
    """
    with pytest.raises(UnknownEngine) as caught:
        shim("tone").resolve_model("tts-1")
    assert caught.value.field == "model" and "engines: tone" in caught.value.message


def test_the_fields_become_a_native_request() -> None:
    """
    input is text, mp3 when no format is asked for, the voice (a string or the SDK's
    object), a variant from the model, the stream flag; a speed of 1 sends nothing.
    """
    target = shim("tone")
    assert native(target, model="tone", input="Hi.") == {"engine": "tone", "text": "Hi.", "format": "mp3", "stream": True}
    assert native(target, model="tone:fast", input="Hi.", voice={"id": "alto"}, response_format="wav", speed=1) == {
        "engine": "tone", "text": "Hi.", "format": "wav", "stream": True, "variant": "fast", "voice": "alto"}
    assert native(target, model="tone:fast", input="Hi.", voice="alto", speed=1.5)["params"] == {"speed": 1.5}
    assert "instructions" not in native(target, model="tone", input="Hi.", instructions="")
    # Passed on as the native field: the preflight refuses it for a variant that takes none.
    assert native(target, model="tone", input="Hi.", instructions="Slowly.")["instructions"] == "Slowly."


@pytest.mark.parametrize("body, kind, field", [
    ({"response_format": "aac"}, Unsupported, "response_format"),
    ({"speed": 1.5}, Unsupported, "speed"),
    ({"voice": {"id": "alto", "name": "x"}}, BadRequest, "voice.name"),
    ({"voice": {"id": ""}}, BadRequest, "voice.id"),
])
def test_what_has_no_equivalent_is_refused_not_dropped(body: dict[str, Any], kind: type[SpeechError], field: str) -> None:
    """
    aac, a speed on a variant with no speed dial (the default variant here has none),
    and a malformed voice object are refused naming the field.
    """
    error = refused(shim("tone"), kind, model="tone", input="Hi.", **body)
    assert error.field == field


@pytest.mark.parametrize("error, status, kind, retry", [
    (BadRequest('"text" must not be empty', field="text"), 400, "invalid_request_error", b"false"),
    (UnknownEngine("no engine", field="engine"), 404, "invalid_request_error", b"false"),
    (Overloaded("busy"), 429, "server_error", b"true"),
    (ModelUnavailable("loading"), 503, "server_error", b"true"),
    (Internal("the adapter threw at /home/x/y.py"), 500, "server_error", b"false"),
])
def test_openais_envelope_keeps_the_taxonomy(error: SpeechError, status: int, kind: str, retry: bytes) -> None:
    """
    The envelope carries the taxonomy's code and retryable flag, the type OpenAI's
    clients sort by, the OpenAI name of the field (in the message too), no paths of the
    box, and x-should-retry from retryable, whatever the status.
    """
    body = openai_envelope(error)["error"]
    assert error.status == status and body["type"] == kind and body["code"] == error.code
    assert body["retryable"] is error.retryable and should_retry(error) == (b"x-should-retry", retry)
    if error.field == "text":
        assert body["param"] == "input" and body["message"] == '"input" must not be empty'
    if error.field == "engine":
        assert body["param"] == "model"
    assert "/home" not in body["message"]
