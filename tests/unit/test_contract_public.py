"""
Tests for the public API's OpenAPI document (protocol.md section 9, "The core describes its
own API") and the shapes only the core answers with: engine state, engine summaries and
the core's /health.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import rhapsode_worker
from rhapsode_protocol.contract import (
    CAPABILITIES,
    ENGINE_LIST,
    ENGINE_STATE,
    ENGINE_SUMMARY,
    PUBLIC_HEALTH,
    VOICE,
    VOICE_LIST,
    public_openapi,
    validate,
    worker_openapi,
)
from rhapsode_protocol.errors import BadRequest

ROOT = Path(__file__).resolve().parents[2]
_METHODS = {"get", "put", "post", "delete", "patch", "head", "options", "trace"}

PUBLIC_ROUTES = {
    "/engines": {"get"},
    "/health": {"get"},
    "/engines/{engine}/capabilities": {"get"},
    "/engines/{engine}/voices": {"get", "post"},
    "/engines/{engine}/voices/{voice}": {"delete"},
    "/engines/{engine}/voices/{voice}/preview": {"get"},
    "/speak": {"post"},
    "/engines/{engine}/dialogue": {"post"},
    "/openapi.json": {"get"},
    "/residency": {"get"},
    "/engines/{engine}/unload": {"post"},
    "/update": {"get"},
    "/update/check": {"post"},
    "/catalog": {"get"},
    "/settings": {"get", "patch"},
    "/engines/{engine}": {"delete"},
    "/engines/{engine}/install": {"post"},
    "/engines/{engine}/reinstall": {"post"},
    "/engines/{engine}/pull": {"post"},
    "/installs": {"get"},
    "/installs/outdated": {"post"},
    "/installs/{job}": {"get"},
    "/installs/{job}/events": {"get"},
    # The OpenAI shim and its discovery (section 11; docs/openai.md); not /mcp (section 12).
    "/v1/audio/speech": {"post"},
    "/v1/audio/speech/batch": {"post"},
    "/v1/audio/speech/stream": {"get"},
    "/v1/models": {"get"},
    "/v1/models/{model}": {"get"},
    "/v1/audio/models": {"get"},
    "/v1/audio/voices": {"get"},
}
#: Open, but a browser page from an origin not allowed is refused (403) before the upgrade.
ORIGIN_CHECKED = {("/v1/audio/speech/stream", "get")}
MANAGEMENT = {
    ("/engines/{engine}/voices", "post"),
    ("/engines/{engine}/voices/{voice}", "delete"),
    ("/engines/{engine}/unload", "post"),
    ("/settings", "get"),
    ("/settings", "patch"),
    ("/engines/{engine}", "delete"),
    ("/engines/{engine}/install", "post"),
    ("/engines/{engine}/reinstall", "post"),
    ("/engines/{engine}/pull", "post"),
    ("/installs", "get"),
    ("/installs/outdated", "post"),
    ("/installs/{job}", "get"),
    ("/installs/{job}/events", "get"),
}


def _pointer(document: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), ref
    node: Any = document
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        assert isinstance(node, dict) and part in node, ref
        node = node[part]
    return node


def _all_refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        refs = [node["$ref"]] if "$ref" in node else []
        return refs + [r for child in node.values() for r in _all_refs(child)]
    if isinstance(node, list):
        return [r for child in node for r in _all_refs(child)]
    return []


def _operations(document: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (path, method, item[method])
        for path, item in document["paths"].items()
        for method in sorted(set(item) & _METHODS)
    ]


def _resolved(document: dict[str, Any], node: dict[str, Any]) -> Any:
    return _pointer(document, node["$ref"]) if "$ref" in node else node


def test_public_document_is_openapi_3_1_at_the_version_given() -> None:
    """
    The document is OpenAPI 3.1.0 titled Rhapsode, and info.version is exactly the version
    it was asked for, the running core's, not the SDK's.
    """
    document = public_openapi("7.6.5-rc.1")
    assert document["openapi"] == "3.1.0"
    assert document["info"]["title"] == "Rhapsode"
    assert document["info"]["version"] == "7.6.5-rc.1"
    assert public_openapi("0.2.0")["info"]["version"] == "0.2.0"


def test_every_public_route_and_method_is_present_and_nothing_else() -> None:
    """
    The paths are exactly the public routes of sections 6, 7, 9 and 10, each operation with a
    unique operationId and a one-line summary.
    """
    document = public_openapi("0.1.0")
    assert {path: set(item) & _METHODS for path, item in document["paths"].items()} == (
        PUBLIC_ROUTES
    )
    ids = [operation["operationId"] for _, _, operation in _operations(document)]
    assert len(ids) == len(set(ids))
    for _, _, operation in _operations(document):
        assert operation["summary"] and "\n" not in operation["summary"]


def test_every_ref_resolves() -> None:
    """
    Every $ref in the document points at something the document holds.
    """
    document = public_openapi("0.1.0")
    refs = _all_refs(document)
    assert refs
    for ref in refs:
        _pointer(document, ref)


@pytest.mark.parametrize(
    "path", ["/load", "/unload", "/terminate", "/fetch", "/dialogue", "/capabilities", "/voices"]
)
def test_no_worker_route_is_public(path: str) -> None:
    """
    A worker-only route never appears, nor does a worker's root-level dialogue,
    capabilities or voices route.
    """
    assert path not in public_openapi("0.1.0")["paths"]


def test_no_worker_shape_is_public() -> None:
    """
    The worker's request bodies and health never reach the public document: its /speak is
    the public shape, which takes an engine.
    """
    schemas = public_openapi("0.1.0")["components"]["schemas"]
    for name in (
        "SpeakRequest",
        "DialogueRequest",
        "Health",
        "LoadRequest",
        "FetchRequest",
        "FetchResponse",
        "TerminateResponse",
    ):
        assert name not in schemas


def test_public_speak_requires_engine_and_allows_keep_alive() -> None:
    """
    POST /speak's body is the public shape: engine is required (with text), and
    keepAliveSeconds is allowed, as it is on the dialogue route.
    """
    document = public_openapi("0.1.0")

    def body(path: str) -> Any:
        content = document["paths"][path]["post"]["requestBody"]["content"]
        return _resolved(document, content["application/json"]["schema"])

    speak = body("/speak")
    assert "engine" in speak["required"] and "text" in speak["required"]
    assert "keepAliveSeconds" in speak["properties"]
    assert speak["additionalProperties"] is False
    dialogue = body("/engines/{engine}/dialogue")
    assert "keepAliveSeconds" in dialogue["properties"]
    assert "engine" not in dialogue["properties"]


def test_audio_routes_document_formats_and_duration() -> None:
    """
    /speak and dialogue answer every format's media type with the duration header, which
    a streamed response sends as a trailer; a preview is WAV.
    """
    document = public_openapi("0.1.0")
    paths = document["paths"]
    for path in ("/speak", "/engines/{engine}/dialogue"):
        ok = paths[path]["post"]["responses"]["200"]
        assert set(ok["content"]) == {
            "audio/wav", "audio/mpeg", "audio/opus", "audio/flac", "audio/aac", "audio/L16",
            # With timestamps: the buffered document and the event stream.
            "application/json", "text/event-stream",
        }
        assert ok["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/TimedAudio"}
        assert "trailer" in ok["headers"]["X-Rhapsode-Duration-Ms"]["description"]
    preview = paths["/engines/{engine}/voices/{voice}/preview"]["get"]["responses"]["200"]
    assert set(preview["content"]) == {"audio/wav"}


def test_answers_reference_the_public_shapes() -> None:
    """
    /engines answers an array of EngineSummary, /health the core's health, capabilities and
    voices their shapes, a create the Voice and a delete {"deleted": id}; a voice is
    created from multipart.
    """
    document = public_openapi("0.1.0")
    paths = document["paths"]

    def answer(path: str, method: str, status: str = "200") -> Any:
        ok = paths[path][method]["responses"][status]["content"]["application/json"]["schema"]
        return _resolved(document, ok)

    engines = answer("/engines", "get")
    assert engines["type"] == "array"
    assert _pointer(document, engines["items"]["$ref"]) == ENGINE_SUMMARY
    assert answer("/health", "get") == PUBLIC_HEALTH
    assert answer("/engines/{engine}/capabilities", "get") == CAPABILITIES
    assert answer("/engines/{engine}/voices", "get") == VOICE_LIST
    assert answer("/engines/{engine}/voices", "post", "201") == VOICE
    assert "content" not in paths["/engines/{engine}/voices/{voice}"]["delete"]["responses"]["204"]
    assert answer("/residency", "get")["required"] == ["resident", "max", "waiting", "models"]
    assert answer("/engines/{engine}/unload", "post") == ENGINE_SUMMARY
    create = paths["/engines/{engine}/voices"]["post"]["requestBody"]["content"]
    assert create["multipart/form-data"]["schema"] == {"$ref": "#/components/schemas/VoiceCreate"}
    listed = paths["/engines/{engine}/voices"]["get"]["responses"]["200"]["description"]
    assert "/engines/{engine}/voices/{voice}/preview" in listed


def test_path_parameters_are_declared_where_used() -> None:
    """
    Every {name} in a path is a declared path parameter of that path, and none is
    declared that the path does not have.
    """
    document = public_openapi("0.1.0")
    for path, item in document["paths"].items():
        declared = {
            _resolved(document, parameter)["name"] for parameter in item.get("parameters", [])
        }
        named = {part[1:-1] for part in path.split("/") if part.startswith("{")}
        assert declared == named, path


def test_errors_are_the_envelope_with_the_statuses_that_apply() -> None:
    """
    Every error answer is the Error envelope (OpenAI's on the /v1 routes, whose clients
    parse only that); unknown_engine (404) is documented on /speak and every
    engine-scoped route, 403 forbidden exactly on the management routes and the
    origin-checked stream, and the speaking routes answer 400, 422, 429, 500 and 503
    (model_unavailable, oom).
    """
    document = public_openapi("0.1.0")
    for path, method, operation in _operations(document):
        statuses = {int(status) for status in operation["responses"]}
        envelope = "OpenAIError" if path.startswith("/v1/") else "Error"
        for status, response in operation["responses"].items():
            if int(status) >= 400:
                resolved = _resolved(document, response)
                assert resolved["content"]["application/json"]["schema"] == {
                    "$ref": f"#/components/schemas/{envelope}"
                }
        if path.startswith("/engines/") or path == "/speak":
            not_found = _resolved(document, operation["responses"]["404"])
            assert "unknown_engine" in not_found["description"], path
        assert (403 in statuses) == ((path, method) in MANAGEMENT | ORIGIN_CHECKED), (path, method)
        if (path, method) in MANAGEMENT:
            assert "loopback" in operation["description"]
            forbidden = _resolved(document, operation["responses"]["403"])
            assert "forbidden" in forbidden["description"]
    for path in ("/speak", "/engines/{engine}/dialogue"):
        statuses = set(document["paths"][path]["post"]["responses"])
        assert statuses == {"200", "400", "404", "422", "429", "500", "503"}
    unavailable = document["components"]["responses"]["Unavailable"]["description"]
    assert "model_unavailable" in unavailable and "oom" in unavailable


def test_description_covers_authorization_and_management() -> None:
    """
    The document says the Authorization header is stripped and never logged, and who the
    management routes answer.
    """
    description = public_openapi("0.1.0")["info"]["description"]
    assert "Authorization header is stripped" in description
    assert "never logged" in description
    assert "loopback" in description and "management token" in description


def test_public_document_is_json_and_fresh_each_call() -> None:
    """
    The document survives JSON (it is served as /openapi.json), and editing one copy
    leaves the next untouched.
    """
    document = public_openapi("0.1.0")
    assert json.loads(json.dumps(document)) == document
    document["paths"]["/speak"]["post"]["requestBody"]["content"].clear()
    document["components"]["schemas"]["PublicSpeakRequest"]["required"].append("x")
    fresh = public_openapi("0.1.0")
    assert fresh["paths"]["/speak"]["post"]["requestBody"]["content"]
    assert "x" not in fresh["components"]["schemas"]["PublicSpeakRequest"]["required"]


def test_worker_document_is_unchanged_by_the_public_one() -> None:
    """
    docs/openapi.worker.yaml still equals python -m rhapsode_protocol.contract, and the worker
    document holds none of the core's shapes.
    """
    result = subprocess.run(
        [sys.executable, "-m", "rhapsode_protocol.contract"],
        capture_output=True,
        check=True,
        text=True,
    )
    committed = (ROOT / "docs" / "openapi.worker.yaml").read_text(encoding="utf-8")
    assert result.stdout == committed
    schemas = worker_openapi(rhapsode_worker.__version__)["components"]["schemas"]
    for name in ("EngineState", "EngineSummary", "EngineList", "PublicHealth"):
        assert name not in schemas
    assert "Forbidden" not in worker_openapi("0.1.0")["components"]["responses"]


LICENSE = {"code": "MIT", "weights": "MIT", "weightsCommercialUse": True, "notes": "pure Python"}


def test_engine_shapes_accept_what_the_core_reports() -> None:
    """
    A summary of an engine never asked for capabilities, one with everything, a remote
    one and the core's /health validate; unknown fields are allowed (section 9).
    """
    validate(ENGINE_LIST, [{"id": "tone", "process": "down", "model": "unloaded", "restarts": 0}])
    validate(
        ENGINE_SUMMARY,
        {
            "id": "tone-a",
            "adapter": "tone",
            "displayName": "Tone",
            "license": LICENSE,
            "defaultVariant": "expressive",
            "process": "up",
            "model": "loading",
            "variant": "expressive",
            "leases": 1,
            "pid": 4242,
            "restarts": 0,
            "lastError": "exited 1",
            "workerVersion": "0.1.0",
            "outdated": False,
        },
    )
    validate(ENGINE_STATE, {"process": "up", "model": "unloaded", "restarts": 0, "remote": True})
    validate(
        PUBLIC_HEALTH,
        {
            "status": "degraded",
            "version": "0.1.0",
            "contract": 1,
            "engines": [{"id": "tone", "process": "failed", "model": "unloaded", "restarts": 5}],
            "residency": {"resident": 0, "max": 1, "waiting": 0},
        },
    )


@pytest.mark.parametrize(
    "schema, value, field",
    [
        (ENGINE_STATE, {"process": "asleep", "model": "unloaded", "restarts": 0}, "process"),
        (ENGINE_STATE, {"process": "remote", "model": "unloaded", "restarts": 0}, "process"),
        (ENGINE_STATE, {"process": "up", "model": "unloading", "restarts": 0}, "model"),
        (ENGINE_STATE, {"process": "up", "restarts": 0}, "model"),
        (ENGINE_STATE, {"process": "up", "model": "loaded"}, "restarts"),
        (ENGINE_STATE, {"process": "up", "model": "loaded", "restarts": 0, "pid": "12"}, "pid"),
        (ENGINE_STATE, {"process": "up", "model": "loaded", "restarts": -1}, "restarts"),
        (ENGINE_SUMMARY, {"process": "up", "model": "loaded", "restarts": 0}, "id"),
        (
            ENGINE_SUMMARY,
            {"id": "t", "process": "up", "model": "loaded", "restarts": 0, "license": {"code": "MIT"}},
            "license.weights",
        ),
        (
            ENGINE_SUMMARY,
            {"id": "t", "process": "up", "model": "loaded", "restarts": 0,
             "license": {"code": "MIT", "weights": None, "weightsCommercialUse": None, "notes": ""}},
            "license.weights",
        ),
        (PUBLIC_HEALTH, {"status": "ok", "version": "0.1.0", "engines": [], "residency": {}}, "contract"),
        (
            PUBLIC_HEALTH,
            {"status": "fine", "version": "0.1.0", "contract": 1, "engines": [], "residency": {}},
            "status",
        ),
        (
            PUBLIC_HEALTH,
            {"status": "ok", "version": "0.1.0", "contract": 1, "engines": {}, "residency": {}},
            "engines",
        ),
        (
            PUBLIC_HEALTH,
            {"status": "ok", "version": "0.1.0", "contract": 1, "engines": [{"model": "x"}],
             "residency": {"resident": 0, "max": 1, "waiting": 0}},
            "engines[0].id",
        ),
        (PUBLIC_HEALTH, {"status": "ok", "version": "0.1.0", "contract": 1, "engines": []}, "residency"),
    ],
)
def test_engine_shapes_refuse(schema: dict[str, Any], value: Any, field: str) -> None:
    """
    Each engine shape refuses a wrong state, a missing required field, a wrongly typed
    one, and a licence without its four fields, naming the field.
    """
    with pytest.raises(BadRequest) as caught:
        validate(schema, value)
    assert caught.value.field == field
