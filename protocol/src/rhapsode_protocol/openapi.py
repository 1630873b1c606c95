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
    BATCH_ITEMS,
    MAX_NAME_CHARACTERS,
    OPENAI_BATCH_REQUEST,
    OPENAI_SPEECH_REQUEST,
    OPENAI_VOICE_OBJECT,
    _REF_PREFIX,
    MEDIA_TYPES,
    ENGINE_ID_PATTERN,
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


#: One frame of a job's event stream, as a reader of server-sent events parses it: its
#: id, its kind, and its data, a JSON text holding a FeedEvent (a resync frame's is {}).
_EVENT_FRAME: Schema = {
    "type": "object",
    "description": "One server-sent frame: id, event and data lines.",
    "properties": {
        "id": _string("The FeedEvent's id, for Last-Event-ID (absent on resync)."),
        "event": {"type": "string", "enum": ["progress", "log", "status", "error", "resync"]},
        "data": {
            "type": "string",
            "contentMediaType": "application/json",
            "contentSchema": {"anyOf": [_ref("FeedEvent"), {"type": "object", "maxProperties": 0}]},
        },
    },
    "required": ["event", "data"],
}


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
                        "A text/event-stream whose every frame's data is a FeedEvent (a resync "
                        "frame's is {}).",
                        {"text/event-stream": {"schema": _EVENT_FRAME}},
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
        **_openai_paths(),
        "/openapi.json": {
            "get": _operation(
                "getOpenApi",
                "This document, describing this server's version.",
                (200, _ok("The OpenAPI 3.1 document.", _json_content_of({"type": "object"}))),
            )
        },
    }


# -- the OpenAI shim and its discovery (protocol.md section 11; docs/openai.md) -------------

#: OpenAI's error envelope: the taxonomy's code and retryable flag, the field as OpenAI's
#: request names it.
_OPENAI_ERROR_DETAIL: Schema = {
    "type": "object",
    "properties": {
        "message": _string(),
        "type": {"type": "string", "enum": ["invalid_request_error", "server_error"]},
        "param": {"type": ["string", "null"], "description": "The request field at fault, by OpenAI's name."},
        "code": _string("The taxonomy's code (bad_request, unknown_engine, unsupported, ...)."),
        "retryable": {"type": "boolean"},
    },
    "required": ["message", "type", "param", "code", "retryable"],
}
_OPENAI_ERROR: Schema = {
    "type": "object",
    "description": "OpenAI's error envelope, which its clients parse; x-should-retry says whether to retry.",
    "properties": {"error": {"$ref": "#/components/schemas/OpenAIErrorDetail"}},
    "required": ["error"],
}


def _openai_request(base: Schema) -> Schema:
    """
    A shim request as the document says it, which the validator's shape cannot: a voice
    is a name or C{{"id": ...}}, and a format one of those the server encodes.
    """
    schema = copy.deepcopy(base)
    properties = schema["properties"]
    if "voice" in properties:
        properties["voice"] = {
            "description": "A voice id, or {\"id\": ...} as the current OpenAI SDK sends it; absent: "
            "the engine's default.",
            "anyOf": [_string(minLength=1, maxLength=MAX_NAME_CHARACTERS), copy.deepcopy(OPENAI_VOICE_OBJECT)],
        }
    if "response_format" in properties:
        properties["response_format"] = {
            "type": "string",
            "enum": list(MEDIA_TYPES),
            "description": "Absent: mp3 (OpenAI's default; wav in a batch). aac is unsupported.",
        }
    if "items" in properties:
        properties["items"]["items"] = _openai_request(properties["items"]["items"])
    return schema


_OPENAI_SCHEMAS: dict[str, Schema] = {
    "OpenAIError": _OPENAI_ERROR,
    "OpenAIErrorDetail": _OPENAI_ERROR_DETAIL,
    "OpenAISpeechRequest": {
        **_openai_request(OPENAI_SPEECH_REQUEST),
        "description": "OpenAI's speech request: model is an engine id or engine:variant; instructions "
        "are unsupported unless empty; speed is the variant's speed dial.",
    },
    "OpenAIBatchRequest": {
        **_openai_request(OPENAI_BATCH_REQUEST),
        "description": f"Up to {BATCH_ITEMS} items, each spoken as a buffered request; an item's fields "
        "override the batch's.",
    },
    "OpenAIBatchResponse": {
        "type": "object",
        "properties": {
            "id": _string(),
            "total": _integer(minimum=0),
            "succeeded": _integer(minimum=0),
            "failed": _integer(minimum=0),
            "results": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "index": _integer(minimum=0),
                        "status": {"type": "string", "enum": ["success", "error"]},
                        "audio_data": _string("Base64 of the item's audio (success)."),
                        "media_type": _string("The audio's type (success)."),
                        "error": {"$ref": "#/components/schemas/OpenAIErrorDetail"},
                    },
                    "required": ["index", "status"],
                },
            },
        },
        "required": ["id", "total", "succeeded", "failed", "results"],
    },
    "OpenAIModel": {
        "type": "object",
        "properties": {
            "id": _string("An engine id, or engine:variant."),
            "object": {"type": "string", "const": "model"},
            "created": _integer(minimum=0),
            "owned_by": _string(),
        },
        "required": ["id", "object", "created", "owned_by"],
    },
    "OpenAIModelList": {
        "type": "object",
        "properties": {
            "object": {"type": "string", "const": "list"},
            "data": {"type": "array", "items": {"$ref": "#/components/schemas/OpenAIModel"}},
            "models": {"type": "array", "items": {"$ref": "#/components/schemas/OpenAIModel"},
                       "description": "GET /v1/audio/models only: the same list, where Open WebUI reads it."},
        },
        "required": ["object", "data"],
    },
    "OpenAIVoiceList": {
        "type": "object",
        "properties": {
            "object": {"type": "string", "const": "list"},
            "voices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"id": _string(), "name": _string(), "engine": _string(),
                                   "tags": {"type": "array", "items": _string()}},
                    "required": ["id", "name", "engine"],
                },
            },
            "data": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "model": _string(),
                        "voices": {"type": "array", "items": {
                            "type": "object", "properties": {"id": _string(), "name": _string()},
                            "required": ["id", "name"]}},
                    },
                    "required": ["model", "voices"],
                },
            },
        },
        "required": ["object", "voices", "data"],
    },
}

_OPENAI_STATUS = {
    400: "bad_request: the body or a field is malformed (param names it).",
    403: "forbidden: a browser page from an origin that may not call it.",
    404: "unknown_engine: no engine or variant by that model (the message names those there are).",
    409: "conflict.",
    422: "unsupported: the variant cannot do what was asked (a format, a voice, instructions).",
    426: "bad_request: not a WebSocket upgrade.",
    429: "overloaded: past the engine's turns and queue, or the buffered-audio budget; Retry-After says when.",
    500: "internal.",
    503: "model_unavailable: the engine's worker cannot start or went away.",
}


def _openai_operation(
    operation_id: str, summary: str, success: tuple[int, dict[str, Any]], errors: Sequence[int], **extra: Any
) -> dict[str, Any]:
    status, response = success
    responses: dict[str, Any] = {str(status): response}
    for error in errors:
        responses[str(error)] = {
            "description": _OPENAI_STATUS[error],
            "headers": {"x-should-retry": {"description": "true exactly where the error is retryable.",
                                           "schema": {"type": "string", "enum": ["true", "false"]}}},
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/OpenAIError"}}},
        }
    return {"operationId": operation_id, "summary": summary, "tags": ["openai"], **extra, "responses": responses}


_OPENAI_SPEAKING = (400, 404, 422, 429, 500, 503)
_STREAM_NOTE = """A WebSocket (RFC 6455), which OpenAPI can only name: connect with GET and Upgrade: websocket. The client sends JSON text messages: one session.config (model, voice, response_format, speed as for POST /v1/audio/speech, plus split_granularity), then input.text pieces as they arrive, input.done to end an utterance, and session.close. The server speaks each sentence (or clause) as soon as it is complete: audio.start (a JSON text message naming the sentence, its format and sample rate), then the audio as binary messages, then audio.done; session.done once every utterance is spoken. A browser page from an origin neither this machine's nor in management.origins (or cors.origins) is refused 403 before the upgrade. Limits close the session with a code: 1003 a binary message from the client, 1007 text that is not a JSON object with a type, 1008 a broken rule (no config within 10 s, a message after session.close), 1009 a message over 64 KiB or too much text held, 1000 after 60 s idle, 1001 at shutdown, 1011 a failure in the server. docs/streaming.md has the whole protocol."""


def _openai_paths() -> dict[str, Any]:
    model_list = _ok("One model per engine and one per engine:variant.",
                     _json_content_of({"$ref": "#/components/schemas/OpenAIModelList"}))
    return {
        "/v1/audio/speech": {
            "post": _openai_operation(
                "openaiSpeech",
                "OpenAI's speech route, translated into POST /speak: the same limits, lease and failures.",
                (200, {
                    "description": (
                        "The audio, streamed, in response_format; with stream_format sse (pcm and wav "
                        "only), server-sent events speech.audio.delta (base64 audio), then "
                        "speech.audio.done, or speech.audio.error after the first event. A failure "
                        "after the headers of raw audio aborts the connection."
                    ),
                    "content": {**{media_type: {} for media_type in MEDIA_TYPES.values()},
                                "text/event-stream": {}},
                }),
                _OPENAI_SPEAKING,
                requestBody={"required": True, "content": _json_content_of(
                    {"$ref": "#/components/schemas/OpenAISpeechRequest"})},
            )
        },
        "/v1/audio/speech/batch": {
            "post": _openai_operation(
                "openaiSpeechBatch",
                f"Up to {BATCH_ITEMS} utterances, each a buffered request, answered together (the peer API's).",
                (200, _ok("Each item's audio or its own error, in order.",
                          _json_content_of({"$ref": "#/components/schemas/OpenAIBatchResponse"}))),
                (400, 404, 422, 429, 500),
                description="An item's failure is its own; an unknown model or a malformed body refuses "
                "the whole batch. Every item's audio stays counted against limits.bufferedBytes until the "
                "answer is written.",
                requestBody={"required": True, "content": _json_content_of(
                    {"$ref": "#/components/schemas/OpenAIBatchRequest"})},
            )
        },
        "/v1/audio/speech/stream": {
            "get": _openai_operation(
                "openaiSpeechStream",
                "Text in as it arrives, speech out a sentence at a time, over a WebSocket.",
                (101, {"description": "Switching Protocols: the WebSocket session begins."}),
                (403, 426),
                description=_STREAM_NOTE,
            )
        },
        "/v1/models": {
            "get": _openai_operation(
                "openaiModels",
                "The models: every engine, and every engine:variant. May start a worker, never loads a model.",
                (200, model_list),
                (),
            )
        },
        "/v1/models/{model}": {
            "parameters": [{
                "name": "model", "in": "path", "required": True,
                "description": "An engine id or engine:variant, as GET /v1/models lists it.",
                "schema": _string(minLength=1, maxLength=2 * MAX_NAME_CHARACTERS + 1),
            }],
            "get": _openai_operation(
                "openaiModel",
                "One model.",
                (200, _ok("The model.", _json_content_of({"$ref": "#/components/schemas/OpenAIModel"}))),
                (404, 503),
            ),
        },
        "/v1/audio/models": {
            "get": _openai_operation(
                "openaiAudioModels",
                "The models again, as data and as models (Open WebUI reads models).",
                (200, model_list),
                (),
            )
        },
        "/v1/audio/voices": {
            "get": _openai_operation(
                "openaiVoices",
                "Every engine's voices, or one model's, in the shape OpenAI-style readers parse.",
                (200, _ok("The voices, flat and by model.",
                          _json_content_of({"$ref": "#/components/schemas/OpenAIVoiceList"}))),
                (404, 503),
                parameters=[{
                    "name": "model", "in": "query", "required": False,
                    "description": "An engine id or engine:variant: only its voices. Without it, an engine "
                    "whose worker cannot start is left out.",
                    "schema": _string(minLength=1, maxLength=2 * MAX_NAME_CHARACTERS + 1),
                }],
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
        if name not in seen and name in _COMPONENTS:
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
    extra_schemas: dict[str, Any] | None = None,
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
    extra = extra_schemas or {}
    components = {
        "schemas": {
            **{name: _COMPONENTS[name] for name in _reachable([paths, responses, list(extra.values())])},
            **extra,
        },
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
(protocol.md sections 4, 6, 7, 9, 10 and 11). GET /engines lists the engines this server has; every \
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
    document = _document(
        "Rhapsode",
        version,
        _PUBLIC_DESCRIPTION,
        _public_paths(),
        {
            "EngineId": {
                "name": "engine",
                "in": "path",
                "required": True,
                "description": "An engine id, as GET /engines lists it: 1 to 64 ASCII letters, digits, _ or -, "
                "starting with a letter or digit.",
                "schema": _string(pattern=ENGINE_ID_PATTERN),
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
        _OPENAI_SCHEMAS,
    )
    # Said to the reader and to a fuzzer; the multipart form is not checked by the
    # validator, so the shape may use what the validator does not read.
    document["components"]["schemas"]["VoiceCreate"]["oneOf"] = [
        {"required": ["reference"]},
        {"required": ["blend"]},
    ]
    return document
