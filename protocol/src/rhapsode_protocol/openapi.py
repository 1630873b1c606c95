"""
The OpenAPI 3.1 documents generated from the shapes in L{rhapsode_protocol.schemas}: the
worker protocol's (C{make openapi} writes it to C{docs/openapi.worker.yaml}) and the
public API's, which the core serves as C{GET /openapi.json} and which holds no worker
route.  Each takes the version to describe, so nothing here reaches up to a package.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

from .errors import ERROR_TABLE
from .frames import FRAMES
from .schemas import (
    _COMPONENTS,
    _REF_PREFIX,
    MEDIA_TYPES,
    VARIANT_NAME_PATTERN,
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


def _audio_response(worker: bool = False) -> dict[str, Any]:
    framed = {
        # The core's own framing of a timed answer (rhapsode_protocol.frames).
        FRAMES: {
            "schema": {
                "description": "With timestamps, asked for by the core: frames of one byte naming "
                "each (a: audio, t: a JSON array of Timing, d: the end, a JSON object with "
                "durationMs, and for a buffered answer format, contentType, sampleRate and "
                "channels), four bytes of big-endian length, and that many bytes. Timings come "
                "before the audio holding their first samples.",
                "type": "string",
                "contentMediaType": FRAMES,
            }
        }
    } if worker else {}
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
        "content": {
            **{media_type: {} for media_type in MEDIA_TYPES.values()},
            # With timestamps (protocol.md section 4, "timestamps"), asked for by Accept.
            "application/json": {"schema": _ref("TimedAudio")},
            "text/event-stream": {
                "schema": {
                    "description": "With timestamps and stream true: one server-sent event per "
                    "frame, named by its type, whose data is one of these; every "
                    "speech.timestamps.delta comes before the speech.audio.delta holding the "
                    "first sample of each of its entries. X-Rhapsode-Audio-Type says what the "
                    "audio's Content-Type would have been.",
                    "oneOf": [_ref("AudioDeltaEvent"), _ref("TimestampsEvent"), _ref("AudioDoneEvent")],
                }
            },
            **framed,
        },
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


def _speak_operation(request: str, worker: bool = False) -> dict[str, Any]:
    return _operation(
        "speak",
        "Speak text in one voice, loading the model on demand.",
        (200, _audio_response(worker)),
        _SPEAKING_ERRORS,
        requestBody=_json_body(request, "What to say and how."),
    )


def _dialogue_operation(request: str, worker: bool = False) -> dict[str, Any]:
    return _operation(
        "dialogue",
        "Speak a conversation in one take, where the variant declares dialogue.",
        (200, _audio_response(worker)),
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
        "/speak": {"post": _speak_operation("SpeakRequest", worker=True)},
        "/dialogue": {"post": _dialogue_operation("DialogueRequest", worker=True)},
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


_UPDATE_NOTE = (
    "Open to every caller. The server asks GitHub for the latest release at most once a day, "
    "and only when asked: a request finding no answer, or one older than a day, starts one check "
    "and is answered at once (a first call reads pending). A failed check is retried after six "
    "hours. update.check: false, or RHAPSODE_UPDATE_CHECK=0 in the server's environment, turns it "
    "off."
)

# Managing engines (protocol.md section 10).
_JOB_ID = {"$ref": "#/components/parameters/JobId"}
_CATALOG_NOTE = (
    "Open to every caller, unlike the other routes of section 10: it only reads, and its "
    "licences are what an install is to be read against."
)
_NO_DATABASE = (
    " A server started without a state database (no config file) answers unsupported: it "
    "has nowhere to record the result."
)
_JOB_START_ERRORS = (400, 403, 404, 409, 422, 429)


def _job_started(description: str) -> tuple[int, dict[str, Any]]:
    return (
        202,
        {
            "description": description,
            "headers": {
                "Location": {
                    "description": "/installs/{job}, where the job is read.",
                    "schema": _string(),
                }
            },
            "content": _json_content("InstallJob"),
        },
    )


def _accept_parameter() -> dict[str, Any]:
    return {
        "name": "accept",
        "in": "query",
        "required": False,
        "description": (
            "The weights licence accepted, exactly as the catalog's license.weights names it. "
            "Required where the catalog says weightsCommercialUse: false (a reinstall needs it "
            "only where the licence recorded at install no longer covers it); where sent, it "
            "must name the licence, so a client may send it on every install. Empty, repeated "
            "or naming anything else is bad_request."
        ),
        "schema": _string(minLength=1),
    }


_EVENTS_NOTE = """\
A stream of server-sent events (ServerKit's server feed): step changes as progress, \
each line a command prints as log, and the outcome as status or error. Each frame is

id: <event id>
event: <kind>
data: <FeedEvent as JSON>

A comment line (": following <job>") opens the stream, and ": ping" is sent after 15 s \
without an event, so that a proxy does not take the stream for dead. A client resumes \
after the last event it saw with the Last-Event-ID header, or with ?lastEventId= where it \
cannot set a header (a page opening a new EventSource); one whose resume point has \
already left the replay buffer (the last 1000 events) is sent a frame "event: resync" \
with data {}, and should re-read the job with GET /installs/{job}. The stream stays open \
after the job ends; close it at the first progress whose status is not running (done or \
failed, the job's last event). Ending it from the server would make a browser's \
EventSource reconnect to a finished job over and over. The stream follows the job in the \
path only."""


def _job_event_parameters() -> list[dict[str, Any]]:
    return [
        {
            "name": "Last-Event-ID",
            "in": "header",
            "required": False,
            "description": "Resume after this event id; a whole number.",
            "schema": _integer(minimum=0),
        },
        {
            "name": "lastEventId",
            "in": "query",
            "required": False,
            "description": "Last-Event-ID for a client that cannot set the header; the header wins.",
            "schema": _integer(minimum=0),
        },
    ]


def _management_paths() -> dict[str, Any]:
    """
    The routes of section 10 besides unloading: the catalog, settings, installs and
    their jobs.  Every one but GET /catalog is a management route.
    """
    return {
        "/catalog": {
            "get": _operation(
                "getCatalog",
                "Every engine that exists, installed or not, with both licences.",
                (200, _ok("One entry per engine, in id order.", _json_content("Catalog"))),
                description=_CATALOG_NOTE,
            )
        },
        "/settings": {
            "get": _operation(
                "getSettings",
                "Every setting: the value in use, where it came from, and when a change to it applies.",
                (200, _ok("The settings document; the token itself is never in it.", _json_content("Settings"))),
                (403, 422),
                description=_MANAGEMENT_NOTE
                + " Reading is guarded too: the document names directories on the box and "
                "the origins it trusts."
                + " A server started without a state database answers unsupported.",
            ),
            "patch": _operation(
                "patchSettings",
                "Change some settings; those that apply live do now, the rest at the next start.",
                (200, _ok("The whole document as it stands after the write.", _json_content("Settings"))),
                (400, 403, 404, 409, 422),
                description=_MANAGEMENT_NOTE
                + " Written to the state database in one transaction, so a refused patch "
                "changes nothing. A value out of range or a key the document does not have "
                "is bad_request naming the setting; a per-engine setting of an engine not in "
                "the registry is unknown_engine. A change that would lock its caller out is "
                "conflict: a caller not on this machine clearing or emptying the token, or a "
                "page whose origin is not this machine's leaving it out of "
                "management.origins. A server started without a state database answers "
                "unsupported.",
                requestBody=_json_body("SettingsPatch", "Any part of values; null clears."),
            ),
        },
        "/engines/{engine}": {
            "parameters": [_ENGINE_ID],
            "delete": _operation(
                "uninstallEngine",
                "Stop and remove an engine this API installed, and its virtualenv; never its weights.",
                (204, {"description": "The engine is gone; no body."}),
                (400, 403, 404, 409, 422, 500),
                description=_MANAGEMENT_NOTE
                + " An engine the operator configured is conflict (it is theirs to remove), "
                "and so is one that is speaking or has a job queued or running; an engine "
                "not installed is unknown_engine." + _NO_DATABASE,
            ),
        },
        "/engines/{engine}/install": {
            "parameters": [_ENGINE_ID],
            "post": _operation(
                "installEngine",
                "Start a job that installs a catalog engine, and with ?pull= fetches a variant too.",
                _job_started("The job, queued or running."),
                _JOB_START_ERRORS,
                description=_MANAGEMENT_NOTE
                + " Takes no body. Every refusal comes before a job exists: an id not in the "
                "catalog is unknown_engine; an engine installed, installing, or named by the "
                "operator's config (even disabled) is conflict; weights not for commercial "
                "use without ?accept= naming their licence, a pull or accept that is empty "
                "or repeated, or any other query parameter, is bad_request. Too many jobs "
                "waiting is overloaded." + _NO_DATABASE,
                parameters=[
                    {
                        "name": "pull",
                        "in": "query",
                        "required": False,
                        "description": (
                            "A variant to fetch once registered, as a fifth step, weights; the "
                            "catalog's defaultVariant names the default. Without it the install "
                            "stops at register."
                        ),
                        "schema": _string(pattern=VARIANT_NAME_PATTERN),
                    },
                    _accept_parameter(),
                ],
            ),
        },
        "/engines/{engine}/reinstall": {
            "parameters": [_ENGINE_ID],
            "post": _operation(
                "reinstallEngine",
                "Start a job that rebuilds an engine this API installed beside itself and swaps it in.",
                _job_started("The job, queued or running; its steps are an install's first four."),
                _JOB_START_ERRORS,
                description=_MANAGEMENT_NOTE
                + " Takes no body. The engine keeps working until the new virtualenv is "
                "verified; the swap costs a cold load, and anything installed into the old "
                "virtualenv by hand. An engine not installed, or not in the catalog, is "
                "unknown_engine; one the operator configured, or with a job queued or "
                "running, is conflict; ?accept= as for an install." + _NO_DATABASE,
                parameters=[_accept_parameter()],
            ),
        },
        "/engines/{engine}/pull": {
            "parameters": [_ENGINE_ID],
            "post": _operation(
                "pullWeights",
                "Start a job that downloads a variant's weights without loading them.",
                _job_started("The job, queued or running; its one step is weights."),
                _JOB_START_ERRORS,
                description=_MANAGEMENT_NOTE
                + " The worker is started if it is not running, and no model is loaded, so it "
                "evicts nothing. An engine not installed is unknown_engine, one with a job "
                "queued or running conflict. An engine that cannot fetch says so in the job's "
                "output, and its weights arrive on first load.",
                requestBody=_json_body("PullRequest", "Which variant to fetch."),
            ),
        },
        "/installs": {
            "get": _operation(
                "listInstalls",
                "Every job this process knows of, newest first.",
                (200, _ok("The jobs; a restart forgets them.", _json_content("InstallJobList"))),
                (403,),
                description=_MANAGEMENT_NOTE,
            )
        },
        "/installs/outdated": {
            "post": _operation(
                "reinstallOutdated",
                "Start a reinstall for every outdated engine this API installed.",
                (202, _ok("The jobs started, and the engines skipped with why.", _json_content("OutdatedReinstalls"))),
                (400, 403, 422, 429),
                description=_MANAGEMENT_NOTE
                + " Takes no body and no query parameter. Never refused as a whole: an engine "
                "it cannot reinstall without asking somebody is skipped, and nothing behind "
                "is jobs: [], a success, so it can end an unattended upgrade." + _NO_DATABASE,
            )
        },
        "/installs/{job}": {
            "parameters": [_JOB_ID],
            "get": _operation(
                "getInstall",
                "One job.",
                (200, _ok("The job.", _json_content("InstallJob"))),
                (403, 404),
                description=_MANAGEMENT_NOTE
                + " An id it does not know is bad_request with a 404, as an unknown route "
                "is: a finished job is kept only until 50 newer ones have finished.",
            ),
        },
        "/installs/{job}/events": {
            "parameters": [_JOB_ID],
            "get": _operation(
                "followInstall",
                "The job's events, as server-sent events; the stream stays open after the job ends.",
                (
                    200,
                    _ok(
                        "A text/event-stream whose every frame's data is a FeedEvent.",
                        {"text/event-stream": {"schema": _ref("FeedEvent")}},
                    ),
                ),
                (400, 403, 404, 429),
                description=_MANAGEMENT_NOTE + "\n\n" + _EVENTS_NOTE + " An unknown job is "
                "bad_request with a 404, a Last-Event-ID that is not a whole number "
                "bad_request, and too many streams open overloaded.",
                parameters=_job_event_parameters(),
            ),
        },
    }


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
        "/update": {
            "get": _operation(
                "getUpdate",
                "Whether a newer release exists; never waits, at most starting one check in the background.",
                (200, _ok("What this server knows now.", _json_content("UpdateStatus"))),
                description=_UPDATE_NOTE,
            )
        },
        "/update/check": {
            "post": _operation(
                "checkUpdate",
                "Ask now, waiting at most the check's 10 s timeout; takes no body.",
                (200, _ok("The same document as GET /update; a failed check is check: failed.", _json_content("UpdateStatus"))),
                (400,),
                description=(
                    "Open to every caller. An answer under five minutes old is returned as it is, and a "
                    "request arriving while a check is in flight waits for that one, so the server asks "
                    "at most once in five minutes. With the check off it answers check: off without asking."
                ),
            )
        },
        **_management_paths(),
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
(protocol.md sections 4, 6, 7, 9 and 10). GET /engines lists the engines this server has; every \
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
is never logged. Management routes (creating and deleting a voice, unloading an \
engine, the settings, and installing, reinstalling, pulling, uninstalling and their \
jobs) answer loopback callers, and from anywhere a holder of the management token \
presenting Authorization: Bearer <token>; a request carrying an Origin is refused unless \
that origin is this machine's own or listed in management.origins. Everyone else is \
forbidden. Speaking, listing, previews, GET /catalog and the update check are open to \
every caller."""


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
            "JobId": {
                "name": "job",
                "in": "path",
                "required": True,
                "description": "A job id, as a job start or GET /installs answers it.",
                "schema": _string(),
            },
        },
        frozenset(),
    )
