"""
The OpenAPI 3.1 documents generated from the shapes in L{rhapsode_worker.schemas}: the
worker protocol's (C{make openapi} writes it to C{docs/openapi.worker.yaml}) and the
public API's, which the core serves as C{GET /openapi.json} and which holds no worker
route.  Each takes the version to describe, so nothing here reaches up to a package.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

from .errors import ERROR_TABLE
from .schemas import (
    _COMPONENTS,
    _REF_PREFIX,
    MEDIA_TYPES,
    VOICE_ID_PATTERN,
    Schema,
    _integer,
    _ref,
    _string,
)

# The OpenAPI documents: the worker protocol's, and the public API's.  The operations both
# have (capabilities, voices, speaking) are built once and placed under each one's paths.

# Statuses answered with an error, as reusable responses; each document holds those its
# operations use.
_ERROR_RESPONSES: dict[int, str] = {
    400: "BadRequest",
    403: "Forbidden",
    404: "NotFound",
    409: "Conflict",
    422: "Unsupported",
    429: "Overloaded",
    500: "Internal",
    503: "Unavailable",
}
# unknown_engine is the core's alone: a worker is one engine.
_CORE_ONLY_CODES = frozenset({"unknown_engine"})


def _error_response(status: int, excluded: frozenset[str]) -> dict[str, Any]:
    meanings = [
        f"{code}: {meaning}."
        for code, (code_status, _, meaning) in ERROR_TABLE.items()
        if code_status == status and code not in excluded
    ]
    return {
        "description": " ".join(meanings),
        "content": {"application/json": {"schema": _ref("Error")}},
    }


def _json_body(name: str, description: str) -> dict[str, Any]:
    return {"description": description, "required": True, "content": _json_content(name)}


def _json_content(name: str) -> dict[str, Any]:
    return _json_content_of(_ref(name))


def _json_content_of(schema: Schema) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _ok(description: str, content: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": content}


def _operation(
    operation_id: str,
    summary: str,
    success: tuple[int, dict[str, Any]],
    errors: Sequence[int] = (),
    **extra: Any,
) -> dict[str, Any]:
    status, response = success
    responses = {str(status): response}
    for error in errors:
        responses[str(error)] = {"$ref": f"#/components/responses/{_ERROR_RESPONSES[error]}"}
    return {"operationId": operation_id, "summary": summary, **extra, "responses": responses}


def _audio_response() -> dict[str, Any]:
    return {
        "description": (
            "The audio, in the Content-Type format asked for (authoritative; opus is "
            "Ogg-encapsulated, audio/L16 carries rate and channels parameters). Chunked "
            "when stream is true; with Content-Length when false. A failure after the "
            "headers aborts the connection rather than closing it, so a truncated body is "
            "never a short successful one."
        ),
        "headers": {
            "X-Rhapsode-Duration-Ms": {
                "description": (
                    "Duration of the audio. A header when stream is false; a streamed "
                    "response ends with it as an HTTP trailer instead, best effort."
                ),
                "schema": _integer(minimum=0),
            },
            "Trailer": {
                "description": "Names X-Rhapsode-Duration-Ms on a streamed response.",
                "schema": _string(),
            },
        },
        "content": {media_type: {} for media_type in MEDIA_TYPES.values()},
    }


_SPEAKING_ERRORS = (400, 404, 422, 429, 500, 503)
_VOICE_WRITE_ERRORS = (400, 404, 409, 422, 429, 500)
_VOICE_ID = {"$ref": "#/components/parameters/VoiceId"}


def _capabilities_operation(errors: Sequence[int]) -> dict[str, Any]:
    return _operation(
        "getCapabilities",
        "What this engine's variants perform, and what is loaded now.",
        (200, _ok("The capability document.", _json_content("Capabilities"))),
        errors,
    )


def _voice_paths(
    collection: str,
    item: str,
    scope: list[dict[str, Any]],
    *,
    listed: str,
    read_errors: Sequence[int],
    write_errors: Sequence[int],
    **write_extra: Any,
) -> dict[str, Any]:
    """
    The voice routes under C{collection}, one voice at C{item}; C{scope} is the path
    parameters every one of them takes before the voice id.
    """
    listing: dict[str, Any] = {"parameters": scope} if scope else {}
    return {
        collection: {
            **listing,
            "get": _operation(
                "listVoices",
                "Built-in and created voices; needs no model.",
                (200, _ok(listed, _json_content("VoiceList"))),
                read_errors,
            ),
            "post": _operation(
                "createVoice",
                "Make a voice from a reference or a blend, replacing one of the same id.",
                (201, _ok("The new voice, as GET /voices lists it.", _json_content("Voice"))),
                write_errors,
                **write_extra,
                requestBody={
                    "required": True,
                    "content": {"multipart/form-data": {"schema": _ref("VoiceCreate")}},
                },
            ),
        },
        item: {
            "parameters": [*scope, _VOICE_ID],
            "delete": _operation(
                "deleteVoice",
                "Remove a created voice.",
                (204, {"description": "The voice is gone; no body."}),
                write_errors,
                **write_extra,
            ),
        },
        f"{item}/preview": {
            "parameters": [*scope, _VOICE_ID],
            "get": _operation(
                "getVoicePreview",
                "A short sample of the voice, as WAV.",
                (200, _ok("The sample.", {"audio/wav": {}})),
                _SPEAKING_ERRORS,
            ),
        },
    }


def _speak_operation(request: str) -> dict[str, Any]:
    return _operation(
        "speak",
        "Speak text in one voice, loading the model on demand.",
        (200, _audio_response()),
        _SPEAKING_ERRORS,
        requestBody=_json_body(request, "What to say and how."),
    )


def _dialogue_operation(request: str) -> dict[str, Any]:
    return _operation(
        "dialogue",
        "Speak a conversation in one take, where the variant declares dialogue.",
        (200, _audio_response()),
        _SPEAKING_ERRORS,
        requestBody=_json_body(request, "The turns and who speaks them."),
    )


def _voice_id_parameter(name: str, description: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "path",
        "required": True,
        "description": description,
        "schema": _string(pattern=VOICE_ID_PATTERN),
    }


def _worker_paths() -> dict[str, Any]:
    return {
        "/health": {
            "get": _operation(
                "getHealth",
                "Process and model state; never loads a model or blocks.",
                (200, _ok("The worker's state.", _json_content("Health"))),
            )
        },
        "/capabilities": {"get": _capabilities_operation((500,))},
        **_voice_paths(
            "/voices",
            "/voices/{id}",
            [],
            listed="Every voice.",
            read_errors=(500,),
            write_errors=_VOICE_WRITE_ERRORS,
        ),
        "/load": {
            "post": _operation(
                "load",
                "Put a variant on the device, unloading and retrying once if the load fails.",
                (200, _ok("The state once loaded.", _json_content("Health"))),
                (400, 422, 429, 500, 503),
                requestBody=_json_body("LoadRequest", "Which variant; {} loads the default."),
            )
        },
        "/unload": {
            "post": _operation(
                "unload",
                "Release the model but keep the process; idempotent.",
                (200, _ok("The state once unloaded.", _json_content("Health"))),
                (500,),
            )
        },
        "/terminate": {
            "post": _operation(
                "terminate",
                "Drain and exit 0, giving back everything the process holds.",
                (202, _ok("Draining has begun.", _json_content("TerminateResponse"))),
            )
        },
        "/fetch": {
            "post": _operation(
                "fetch",
                "Download a variant's weights without loading them.",
                (204, {"description": "The weights are on this machine; no body."}),
                (400, 422, 429, 500),
                requestBody=_json_body("FetchRequest", "Which variant; {} fetches the default."),
            )
        },
        "/speak": {"post": _speak_operation("SpeakRequest")},
        "/dialogue": {"post": _dialogue_operation("DialogueRequest")},
    }


# The public API reaches an engine through the core, so an engine-scoped read can also
# find the engine unknown (404) or its process not starting (503).
_ENGINE_READ_ERRORS = (404, 500, 503)
_MANAGEMENT_ERRORS = (400, 403, 404, 409, 422, 429, 500, 503)
_ENGINE_ID = {"$ref": "#/components/parameters/EngineId"}
_MANAGEMENT_NOTE = (
    "A management route: it answers loopback callers, and from anywhere a caller "
    "presenting the management token as Authorization: Bearer <token>; anyone else is "
    "forbidden."
)


def _public_paths() -> dict[str, Any]:
    return {
        "/engines": {
            "get": _operation(
                "listEngines",
                "Every engine this server has, with its licences and state; starts nothing.",
                (200, _ok("One summary per configured engine.", _json_content("EngineList"))),
            )
        },
        "/health": {
            "get": _operation(
                "getHealth",
                "This server's version, contract and every engine's state; starts nothing.",
                (200, _ok("The server's state.", _json_content("PublicHealth"))),
            )
        },
        "/engines/{engine}/capabilities": {
            "parameters": [_ENGINE_ID],
            "get": _capabilities_operation(_ENGINE_READ_ERRORS),
        },
        **_voice_paths(
            "/engines/{engine}/voices",
            "/engines/{engine}/voices/{voice}",
            [_ENGINE_ID],
            listed="Every voice, each previewUrl under /engines/{engine}/voices/{voice}/preview.",
            read_errors=_ENGINE_READ_ERRORS,
            write_errors=_MANAGEMENT_ERRORS,
            description=_MANAGEMENT_NOTE,
        ),
        "/speak": {"post": _speak_operation("PublicSpeakRequest")},
        "/engines/{engine}/dialogue": {
            "parameters": [_ENGINE_ID],
            "post": _dialogue_operation("PublicDialogueRequest"),
        },
        "/residency": {
            "get": _operation(
                "getResidency",
                "Which models are on the device, for how long, and what waits for room; "
                "read from the core's own state, starting and loading nothing (section 3).",
                (200, _ok("The models in eviction order, the next to go first.", _json_content("Residency"))),
            )
        },
        "/engines/{engine}/unload": {
            "parameters": [_ENGINE_ID],
            "post": _operation(
                "unloadEngine",
                "Give the engine's memory back now: terminate its process (the default), or "
                "unload its model and keep the process. Idempotent; refused while it speaks "
                "or receives a voice upload.",
                (200, _ok("The engine's summary, after.", _json_content("EngineSummary"))),
                (400, 403, 404, 409, 503),
                description=_MANAGEMENT_NOTE,
                parameters=[
                    {
                        "name": "mode",
                        "in": "query",
                        "required": False,
                        "description": "terminate (the default) or unload.",
                        "schema": {"type": "string", "enum": ["terminate", "unload"]},
                    }
                ],
            ),
        },
        "/openapi.json": {
            "get": _operation(
                "getOpenApi",
                "This document, describing this server's version.",
                (200, _ok("The OpenAPI 3.1 document.", _json_content_of({"type": "object"}))),
            )
        },
    }


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        for child in node.values():
            found.extend(_refs(child))
        return found
    if isinstance(node, list):
        return [ref for child in node for ref in _refs(child)]
    return []


def _reachable(roots: Any) -> list[str]:
    """The component schemas C{roots} reach, directly or through other components."""
    seen: set[str] = set()
    pending = [ref for ref in _refs(roots) if ref.startswith(_REF_PREFIX)]
    while pending:
        name = pending.pop()[len(_REF_PREFIX) :]
        if name not in seen:
            seen.add(name)
            pending.extend(_refs(_COMPONENTS[name]))
    return [name for name in _COMPONENTS if name in seen]


def _document(
    title: str,
    version: str,
    description: str,
    paths: dict[str, Any],
    parameters: dict[str, Any],
    excluded_codes: frozenset[str],
) -> dict[str, Any]:
    """
    An OpenAPI 3.1.0 document of C{paths}, holding the error responses and schemas they
    reach; a fresh structure each call, so a caller may edit it freely.
    """
    used = set(_refs(paths))
    responses = {
        name: _error_response(status, excluded_codes)
        for status, name in _ERROR_RESPONSES.items()
        if f"#/components/responses/{name}" in used
    }
    components = {
        "schemas": {name: _COMPONENTS[name] for name in _reachable([paths, responses])},
        "responses": responses,
        "parameters": parameters,
    }
    return copy.deepcopy(
        {
            "openapi": "3.1.0",
            "info": {
                "title": title,
                "version": version,
                "description": description,
                "license": {"name": "MIT", "identifier": "MIT"},
            },
            "paths": paths,
            "components": components,
        }
    )


_WORKER_DESCRIPTION = """\
The protocol between the Rhapsode core and one engine's worker process, contract 1 \
(protocol.md sections 1 to 9). Engine authors read it; a client of the public API never \
needs it.

A worker speaks HTTP over a Unix domain socket by default, or over TCP when configured: \
the core spawns it with RHAPSODE_WORKER_LISTEN (unix:PATH or tcp:HOST:PORT), \
RHAPSODE_WORKER_ENGINE and RHAPSODE_WORKER_CONTRACT, the highest contract the core \
speaks. Once bound and ready the worker prints exactly one JSON line to stdout, the \
handshake, and nothing else there ever:

{"ready":true,"contract":1,"engine":"<id>","listen":"<address>"}

Logs go to stderr as JSON lines. A worker that exits before the line has failed to start. \
Every error is the Error envelope, whose retryable flag, not the status, says whether to \
try again."""


def worker_openapi(version: str) -> dict[str, Any]:
    """
    The OpenAPI 3.1.0 document of the worker protocol, C{info.version} set to C{version}.

    A fresh structure each call, so a caller may edit it freely.
    """
    return _document(
        "Rhapsode worker protocol",
        version,
        _WORKER_DESCRIPTION,
        _worker_paths(),
        {"VoiceId": _voice_id_parameter("id", "A voice id, as GET /voices lists it.")},
        _CORE_ONLY_CODES,
    )


_PUBLIC_DESCRIPTION = """\
Rhapsode's public API: one HTTP contract in front of many text-to-speech engines \
(protocol.md sections 4, 6, 7 and 9). GET /engines lists the engines this server has; every \
engine-scoped route and POST /speak name one, and an id not in that list is \
unknown_engine.

POST /speak and POST /engines/{engine}/dialogue load a model on demand; nothing needs \
loading first. Read contract from GET /health to decide what to send, and ignore \
response fields you do not know. Every error is the Error envelope, whose retryable \
flag, not the status, says whether to try again. stream: false reports every failure as \
an envelope; a streamed response that fails after its headers is aborted, never ended \
short.

Every route refuses, as a bad_request envelope before any body is read: an unknown path \
with 404, a method the path does not take with 405 and Allow, a request line over 8 KiB \
with 414, a head over 100 header lines or 16 KiB with 431, a head not complete 10 s \
after its first byte (server.headTimeoutSeconds) or a body idle past \
server.idleTimeoutSeconds with 408, and a body over its route's limit with 413 (64 KiB; \
1 MiB for /speak and dialogue; 25 MB for a voice upload). A speech request past its \
engine's turns and queue is overloaded, 429 with Retry-After.

A request's Authorization header is stripped before any handler sees the request and \
is never logged. Management routes (creating and deleting a voice) answer loopback \
callers (and unloading an engine), and from anywhere a holder of the management token presenting \
Authorization: Bearer <token>; a request carrying an Origin is refused unless that \
origin is this machine's own or listed in management.origins. Everyone else is \
forbidden. Speaking, listing and previews are open to every caller."""


def public_openapi(version: str) -> dict[str, Any]:
    """
    The OpenAPI 3.1.0 document of the public API (protocol.md section 9, "The core
    describes its own API"), C{info.version} set to C{version}: the running core's
    package version, set when the document is served.

    Public routes only, never a worker's.  A fresh structure each call.
    """
    return _document(
        "Rhapsode",
        version,
        _PUBLIC_DESCRIPTION,
        _public_paths(),
        {
            "EngineId": {
                "name": "engine",
                "in": "path",
                "required": True,
                "description": "An engine id, as GET /engines lists it.",
                "schema": _string(),
            },
            "VoiceId": _voice_id_parameter(
                "voice", "A voice id, as GET /engines/{engine}/voices lists it."
            ),
        },
        frozenset(),
    )
