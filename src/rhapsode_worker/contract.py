"""
The request and response shapes of Rhapsode, one copy of each, and the OpenAPI
documents generated from them.

Every shape is a JSON Schema (the 2020-12 subset OpenAPI 3.1 uses) held as a plain dict.
The SDK and the core check request bodies against them with L{validate}, and the OpenAPI
documents are built from the same dicts, so what is documented is what is enforced.
The public request shapes extend the worker's rather than repeating them.

C{python -m rhapsode_worker.contract} prints the worker protocol's document; C{make
openapi} writes it to C{docs/openapi.worker.yaml}.  L{public_openapi} is the public API's
document, which the core serves as C{GET /openapi.json}; it holds no worker route.

This module imports only the standard library and the SDK's own shapes and errors,
because the core imports it too and must not pull in Twisted or anything heavy.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import re
import sys
from typing import Any, Callable, Sequence

from ._engine import ALL_CUES, ALL_DELIVERIES
from ._errors import ERROR_TABLE, BadRequest
from ._yaml import dump_yaml

Schema = dict[str, Any]

#: The worker protocol contracts this SDK speaks (protocol.md section 9).
CONTRACT_VERSIONS: tuple[int, ...] = (1,)

#: Audio formats a request may ask for, and the Content-Type each is answered with.
MEDIA_TYPES: dict[str, str] = {
    "wav": "audio/wav",
    "mp3": "audio/mpeg",
    "opus": "audio/opus",
    "flac": "audio/flac",
    "pcm": "audio/L16",
}

#: A voice id (protocol.md section 7): letters, digits, - and _, starting with a letter
#: or digit, at most 64 characters.  Anything else could name a path or a pattern.
VOICE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"

_REF_PREFIX = "#/components/schemas/"


# Builders.  A shape that extends another shares its property schemas; nothing mutates
# them, and worker_openapi hands out deep copies.


def _typed(type_: str | list[str], description: str, keywords: dict[str, Any]) -> Schema:
    schema: Schema = {"type": type_}
    if description:
        schema["description"] = description
    schema.update(keywords)
    return schema


def _string(description: str = "", **keywords: Any) -> Schema:
    return _typed("string", description, keywords)


def _integer(description: str = "", **keywords: Any) -> Schema:
    return _typed("integer", description, keywords)


def _number(description: str = "", **keywords: Any) -> Schema:
    return _typed("number", description, keywords)


def _boolean(description: str = "", **keywords: Any) -> Schema:
    return _typed("boolean", description, keywords)


def _enum(values: Sequence[str], description: str = "") -> Schema:
    return _typed("string", description, {"enum": list(values)})


def _array(items: Schema, description: str = "", **keywords: Any) -> Schema:
    return _typed("array", description, {"items": items, **keywords})


def _map(values: Schema, description: str = "", **keywords: Any) -> Schema:
    return _typed("object", description, {"additionalProperties": values, **keywords})


def _object(
    properties: dict[str, Schema],
    required: Sequence[str] = (),
    *,
    closed: bool = False,
    description: str = "",
) -> Schema:
    """
    An object with named properties.  C{closed} refuses unknown keys, which every request
    shape does (protocol.md section 6); responses stay open, because section 9 lets a
    newer worker add fields an older reader must ignore.
    """
    schema = _typed("object", description, {"properties": properties})
    if required:
        schema["required"] = list(required)
    if closed:
        schema["additionalProperties"] = False
    return schema


def _extend(
    base: Schema,
    properties: dict[str, Schema],
    required: Sequence[str] = (),
    *,
    description: str,
) -> Schema:
    extended = dict(base, description=description)
    extended["properties"] = {**base["properties"], **properties}
    if required:
        extended["required"] = [*base.get("required", ()), *required]
    return extended


def _ref(name: str) -> Schema:
    return {"$ref": _REF_PREFIX + name}


# The fields /speak and /dialogue share, built once per shape.


def _variant_field() -> Schema:
    return _string("Absent means whatever is loaded, or the engine's default if nothing is.")


def _format_field() -> Schema:
    return _enum(
        tuple(MEDIA_TYPES),
        "From capabilities.formats. The response's Content-Type is authoritative.",
    )


def _language_field() -> Schema:
    return _string(
        "One of the effective variant's languages; absent means the first it lists."
    )


def _params_field() -> Schema:
    return _map(
        _number(),
        "Dial values, against the effective variant's dials. Unknown keys are refused.",
    )


def _seed_field() -> Schema:
    return _integer("Reproducibility, for variants whose seeding says so.")


def _stream_field() -> Schema:
    return _boolean(
        "true streams chunked; false buffers and sets Content-Length and the duration header.",
        default=True,
    )


def _keep_alive_field() -> Schema:
    return _integer(
        "Seconds to keep the model this request loads once it is done: -1 until the room "
        "is needed, 0 frees it at once. Request, then engine, then server. Never sent to "
        "a worker.",
        minimum=-1,
    )


SPEAK_REQUEST: Schema = _object(
    {
        "text": _string(
            "What to say. Cues are written [laugh]; the core strips those the variant does "
            "not claim.",
            minLength=1,
        ),
        "voice": _string("Engine-scoped id from GET /voices; absent means the engine default."),
        "variant": _variant_field(),
        "format": _format_field(),
        "language": _language_field(),
        "delivery": _enum(
            ALL_DELIVERIES, "How the whole line is read; absent is the voice's ordinary reading."
        ),
        "params": _params_field(),
        "seed": _seed_field(),
        "stream": _stream_field(),
    },
    required=["text"],
    closed=True,
    description="POST /speak on a worker.",
)

PUBLIC_SPEAK_REQUEST: Schema = _extend(
    SPEAK_REQUEST,
    {"engine": _string("Engine id, from GET /engines."), "keepAliveSeconds": _keep_alive_field()},
    required=["engine"],
    description="POST /speak on the public API.",
)

DIALOGUE_REQUEST: Schema = _object(
    {
        "turns": _array(
            _object(
                {
                    "speaker": _string("A label the request makes up.", minLength=1),
                    "text": _string("This turn's words, cues written [laugh]."),
                },
                required=["speaker", "text"],
                closed=True,
            ),
            "The conversation, in order. Its texts share one maxCharacters budget.",
            minItems=1,
        ),
        "voices": _map(
            _string(),
            "Speaker label to voice id; a speaker absent from it is read in a voice the "
            "model picks. A label no turn uses is bad_request.",
        ),
        "variant": _variant_field(),
        "format": _format_field(),
        "language": _language_field(),
        "params": _params_field(),
        "seed": _seed_field(),
        "stream": _stream_field(),
    },
    required=["turns"],
    closed=True,
    description="POST /dialogue on a worker. There is no delivery: a dialogue has more "
    "than one reader.",
)

PUBLIC_DIALOGUE_REQUEST: Schema = _extend(
    DIALOGUE_REQUEST,
    {"keepAliveSeconds": _keep_alive_field()},
    description="POST /engines/{engine}/dialogue on the public API.",
)

LOAD_REQUEST: Schema = _object(
    {"variant": _string("The variant to load; absent means the engine's default.")},
    closed=True,
)

FETCH_REQUEST: Schema = _object(
    {"variant": _string("The variant whose weights to download; absent means the default.")},
    closed=True,
)

ERROR: Schema = _object(
    {
        "error": _object(
            {
                "code": _enum(tuple(ERROR_TABLE)),
                "message": _string(),
                "retryable": _boolean(
                    "Whether the same request may succeed later: the server, not the "
                    "request, was the problem."
                ),
                "field": _string("The request field the failure is about, as a dotted path."),
            },
            required=["code", "message", "retryable"],
        )
    },
    required=["error"],
    description="Every error, from a worker or the core (protocol.md section 6).",
)

HEALTH: Schema = _object(
    {
        "process": _string(const="up"),
        "model": _enum(("unloaded", "loading", "loaded", "unloading")),
        "variant": _string("The variant loaded or loading; absent otherwise."),
        "engine": _string(),
        "contract": _integer(minimum=1),
        "device": _string('Where the model runs, e.g. "cpu" or "cuda:0".'),
        "draining": _boolean("true once a SIGTERM or /terminate arrived: new work is refused."),
        "modelBytes": _integer(
            "Device memory the loaded model took, measured across its load; absent where "
            "nothing measured it, never 0.",
            minimum=1,
        ),
        "vramBytes": _integer("What the device holds in all; absent where unmeasured.", minimum=1),
    },
    required=["process", "model", "engine", "contract", "device", "draining"],
    description="GET /health: process and model state. Never loads, never blocks.",
)

DIAL: Schema = _object(
    {"min": _number(), "max": _number(), "default": _number()},
    required=["min", "max", "default"],
)

VARIANT_CAPS: Schema = _object(
    {
        "cues": _array(_enum(ALL_CUES), "The cues this variant performs; the rest are stripped."),
        "deliveries": _array(_enum(ALL_DELIVERIES)),
        "dials": _map(_ref("Dial"), "Numbers this variant really varies, by name."),
        "languages": _array(_string(), "The first is the default.", minItems=1),
        "maxCharacters": _integer("The most text one request may carry.", minimum=1),
        "segmentation": _object(
            {
                "supported": _boolean("false: text over maxCharacters is refused, not split."),
                "segmentCharacters": _integer("What one generation gets.", minimum=1),
                "firstSegmentCharacters": _integer(
                    "A shorter first segment, for a quicker first byte.", minimum=1
                ),
                "jointSilenceMs": _integer("Silence between segments.", minimum=0),
            },
            required=["supported"],
        ),
        "cloning": _object(
            {
                "supported": _boolean(),
                "formats": _array(_string(), "File types a reference may be."),
                "referenceSeconds": _array(
                    _number(),
                    "Shortest and longest usable reference.",
                    prefixItems=[_number(), _number()],
                    minItems=2,
                    maxItems=2,
                ),
            },
            required=["supported"],
        ),
        "blending": _object({"supported": _boolean()}, required=["supported"]),
        "dialogue": _object(
            {"maxSpeakers": _integer(minimum=1)},
            required=["maxSpeakers"],
            description="Present only where the variant answers POST /dialogue.",
        ),
        "streaming": _object(
            {"supported": _boolean(), "granularity": _string()},
            required=["supported", "granularity"],
        ),
        "seeding": _object({"reproducible": _boolean()}, required=["reproducible"]),
    },
    required=[
        "cues",
        "deliveries",
        "dials",
        "languages",
        "maxCharacters",
        "segmentation",
        "streaming",
    ],
    # cloning, blending and seeding are optional: contract 1 shipped without them, and a
    # reader that finds one absent does not know (section 4), so an older worker is valid.
    description="What one variant performs (protocol.md section 4).",
)

NATIVE_FORMAT: Schema = _object(
    {
        "encoding": _string(const="pcm_s16le"),
        "sampleRate": _integer(minimum=1),
        "channels": _integer(minimum=1),
    },
    required=["encoding", "sampleRate", "channels"],
)

CURRENT_VARIANT_CAPS: Schema = _extend(
    VARIANT_CAPS,
    {"variant": _string(), "nativeFormat": _ref("NativeFormat")},
    required=["variant", "nativeFormat"],
    description="The loaded variant: what it performs, its name and its PCM.",
)

# One shape for an engine's licences, wherever they are reported (protocol.md section 4).
LICENSE: Schema = _object(
    {
        "code": _string("The most restrictive licence among what the worker process runs."),
        "weights": _typed(["string", "null"], "null for an engine with no weights.", {}),
        "weightsCommercialUse": _typed(["boolean", "null"], "", {}),
        "notes": _string("Which dependency is responsible for code."),
    },
    required=["code", "weights", "weightsCommercialUse", "notes"],
)

CAPABILITIES: Schema = _object(
    {
        "contract": _integer("The contract this worker answers at.", minimum=1),
        "engine": _object(
            {
                "id": _string(),
                "displayName": _string(),
                "adapterVersion": _string(),
                "upstreamVersion": _string(),
            },
            required=["id", "displayName", "adapterVersion"],
        ),
        "license": LICENSE,
        "device": _object(
            {"type": _string(), "name": _string(), "vramBytes": _integer(minimum=1)},
            required=["type"],
        ),
        "defaultVariant": _string(),
        "current": _ref("CurrentVariantCaps"),
        "variants": _map(
            _ref("VariantCaps"),
            "Every variant this worker can load on this machine.",
            minProperties=1,
        ),
        "formats": _array(_enum(tuple(MEDIA_TYPES))),
        "nativeFormat": _ref("NativeFormat"),
    },
    required=[
        "contract",
        "engine",
        "license",
        "device",
        "defaultVariant",
        "variants",
        "formats",
        "nativeFormat",
    ],
    description="GET /capabilities. current is absent while nothing is loaded.",
)

VOICE: Schema = _object(
    {
        "id": _string(pattern=VOICE_ID_PATTERN),
        "label": _string(),
        "spec": _string("Opaque; changes whenever the rendering would. Never parse it."),
        "description": _string(),
        "tags": _array(_string()),
        "previewUrl": _string("Follow it; never build one."),
        "builtin": _boolean(),
    },
    required=["id", "label", "spec", "tags", "previewUrl", "builtin"],
)

VOICE_LIST: Schema = _array(_ref("Voice"))

VOICE_CREATE: Schema = _object(
    {
        "id": _string(
            "Replaces the voice of that id where there is one.", pattern=VOICE_ID_PATTERN
        ),
        "label": _string(),
        "reference": _string(
            "A file of a type current.cloning.formats lists.",
            contentMediaType="application/octet-stream",
        ),
        "blend": _string("name(weight)+name(weight), each weight optional and 1 when absent."),
        "transcript": _string(
            "The words the reference speaks; an engine that does not read it ignores it."
        ),
    },
    required=["id"],
    closed=True,
    description="POST /voices (multipart/form-data). Exactly one of reference or blend; "
    "both or neither is bad_request.",
)

VOICE_DELETED: Schema = _object({"deleted": _string()}, required=["deleted"])

TERMINATE_RESPONSE: Schema = _object(
    {"terminating": _boolean(const=True)}, required=["terminating"]
)

FETCH_RESPONSE: Schema = _object(
    {"variant": _string(), "fetched": _boolean()}, required=["variant", "fetched"]
)

# The core's own answers, in the public API only.

ENGINE_STATE: Schema = _object(
    {
        "process": _enum(
            ("down", "starting", "up", "draining", "failed", "remote"),
            "The engine's process; remote is a worker at a URL this server does not run.",
        ),
        "model": _enum(("unloaded", "loaded")),
        "variant": _string("The variant on the device; absent while unloaded."),
        "pid": _integer("The process id, while there is a process.", minimum=1),
        "restarts": _integer(
            "Restarts after crashes, counted against the restart limit.", minimum=0
        ),
        "lastError": _string("Why the process last failed to start or exited unasked."),
    },
    required=["process", "model"],
    description="One engine as this server sees it. Reading it starts nothing and loads "
    "nothing.",
)

ENGINE_SUMMARY: Schema = _object(
    {
        "id": _string("The engine id every engine-scoped route and /speak name."),
        "displayName": _string(),
        "license": LICENSE,
        "defaultVariant": _string(),
        **ENGINE_STATE["properties"],
    },
    required=["id", *ENGINE_STATE["required"]],
    description="One entry of GET /engines. displayName, license and defaultVariant are "
    "absent until the engine has first been asked for its capabilities.",
)

ENGINE_LIST: Schema = _array(_ref("EngineSummary"))

PUBLIC_HEALTH: Schema = _object(
    {
        "status": _string(const="ok"),
        "version": _string(
            "This server's package version, for display; never compare it, read contract."
        ),
        "contract": _integer(
            "The contract this server speaks (protocol.md section 9).", minimum=1
        ),
        "engines": _map(_ref("EngineState"), "Every configured engine, by id."),
    },
    required=["status", "version", "contract", "engines"],
    description="GET /health. Never starts, loads or waits on an engine.",
)

# Every named shape; a generated document holds those its paths reach.
_COMPONENTS: dict[str, Schema] = {
    "SpeakRequest": SPEAK_REQUEST,
    "PublicSpeakRequest": PUBLIC_SPEAK_REQUEST,
    "DialogueRequest": DIALOGUE_REQUEST,
    "PublicDialogueRequest": PUBLIC_DIALOGUE_REQUEST,
    "LoadRequest": LOAD_REQUEST,
    "FetchRequest": FETCH_REQUEST,
    "Error": ERROR,
    "Health": HEALTH,
    "Dial": DIAL,
    "VariantCaps": VARIANT_CAPS,
    "CurrentVariantCaps": CURRENT_VARIANT_CAPS,
    "NativeFormat": NATIVE_FORMAT,
    "Capabilities": CAPABILITIES,
    "Voice": VOICE,
    "VoiceList": VOICE_LIST,
    "VoiceCreate": VOICE_CREATE,
    "VoiceDeleted": VOICE_DELETED,
    "TerminateResponse": TERMINATE_RESPONSE,
    "FetchResponse": FETCH_RESPONSE,
    "EngineState": ENGINE_STATE,
    "EngineSummary": ENGINE_SUMMARY,
    "EngineList": ENGINE_LIST,
    "PublicHealth": PUBLIC_HEALTH,
}


# Validation.

# What the validator enforces; any other keyword in a schema is a mistake it refuses to
# pass over silently, since a half-enforced shape is worse than an error.
_VALIDATION_KEYWORDS = frozenset(
    {
        "$ref",
        "type",
        "enum",
        "const",
        "properties",
        "required",
        "additionalProperties",
        "minProperties",
        "items",
        "prefixItems",
        "minItems",
        "maxItems",
        "minLength",
        "maxLength",
        "pattern",
        "minimum",
        "maximum",
    }
)
_ANNOTATIONS = frozenset({"description", "default", "contentMediaType"})
_KEYWORDS = _VALIDATION_KEYWORDS | _ANNOTATIONS


def _is_number(value: object) -> bool:
    # bool is an int to Python and never a number to JSON; NaN and the infinities are
    # not JSON at all.
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, int) and not isinstance(value, bool)


_TYPES: dict[str, tuple[str, Callable[[object], bool]]] = {
    "string": ("a string", lambda v: isinstance(v, str)),
    # 3.0 is refused too: a seed that arrives as a float is a client bug worth naming.
    "integer": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "number": ("a number", _is_number),
    "boolean": ("a boolean", lambda v: isinstance(v, bool)),
    "object": ("an object", lambda v: isinstance(v, dict)),
    "array": ("an array", lambda v: isinstance(v, list)),
    "null": ("null", lambda v: v is None),
}


@functools.lru_cache(maxsize=None)
def _regex(pattern: str) -> re.Pattern[str]:
    """
    Compile a JSON Schema pattern with ECMA-262's meaning where Python's differs.

    ECMA's C{$} matches only at the very end, Python's also before a final newline (which
    would let C{"a\\n"} through an anchored pattern), so an unescaped C{$} outside a
    character class becomes C{\\Z}; and C{\\d}, C{\\w} are ASCII-only, as in ECMA.
    """
    out: list[str] = []
    escaped = in_class = False
    for ch in pattern:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch == "$":
            out.append(r"\Z")
            continue
        out.append(ch)
    return re.compile("".join(out), re.ASCII)


def _name(path: str) -> str:
    return f'"{path}"' if path else "the body"


def _fail(path: str, problem: str) -> BadRequest:
    return BadRequest(f"{_name(path)} {problem}", field=path or None)


def _show(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _child(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _resolve(ref: str) -> Schema:
    if not ref.startswith(_REF_PREFIX) or ref[len(_REF_PREFIX) :] not in _COMPONENTS:
        raise ValueError(f"unresolvable $ref {ref!r}")
    return _COMPONENTS[ref[len(_REF_PREFIX) :]]


#: Schemas already checked for keywords, by id, each with its type test and the message
#: that names its types (the schema is held, so its id stays its own).  Schemas are
#: constants here: one is never changed after it has been used.
_VETTED: dict[int, tuple[Schema, Callable[[object], bool] | None, str]] = {}


def _vet(schema: Schema) -> tuple[Schema, Callable[[object], bool] | None, str]:
    unknown = schema.keys() - _KEYWORDS
    if unknown:
        raise ValueError(f"schema keywords not supported: {sorted(unknown)}")
    accepts: Callable[[object], bool] | None = None
    message = ""
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        tests = [_TYPES[t][1] for t in types]
        accepts = tests[0] if len(tests) == 1 else (lambda v: any(test(v) for test in tests))
        message = "must be " + " or ".join(_TYPES[t][0] for t in types)
    vetted = (schema, accepts, message)
    if len(_VETTED) < 4096:  # the contract's own schemas, and a bounded few more
        _VETTED[id(schema)] = vetted
    return vetted


def validate(schema: Schema, value: object, *, path: str = "") -> None:
    """
    Check C{value} against C{schema}, raising for the first violation found.

    The order is fixed, so a body with several faults always names the same one: the
    value's type, then enum and const, then for an object its unknown keys, its missing
    required keys, its size, and each property in the schema's order, then the values
    under C{additionalProperties}; for an array its length, then each item in order.

    @param path: where C{value} sits in the body, e.g. C{"turns[2]"}; C{""} is the body.
    @raise BadRequest: naming the offending field as a dotted path (C{"params.speed"},
        C{"turns[2].speaker"}) in both its message and its C{field}.
    @raise ValueError: if C{schema} uses a keyword this validator does not enforce.
    """
    vetted = _VETTED.get(id(schema))
    if vetted is None or vetted[0] is not schema:
        vetted = _vet(schema)
    if "$ref" in schema:
        validate(_resolve(schema["$ref"]), value, path=path)
        return

    accepts = vetted[1]
    if accepts is not None and not accepts(value):
        raise _fail(path, vetted[2])
    if "enum" in schema and value not in schema["enum"]:
        raise _fail(path, "must be one of " + ", ".join(_show(v) for v in schema["enum"]))
    if "const" in schema and value != schema["const"]:
        raise _fail(path, f"must be {json.dumps(schema['const'])}")

    if isinstance(value, str):
        _check_string(schema, value, path)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        _check_number(schema, value, path)
    elif isinstance(value, dict):
        _check_object(schema, value, path)
    elif isinstance(value, list):
        _check_array(schema, value, path)


def _check_string(schema: Schema, value: str, path: str) -> None:
    if "minLength" in schema and len(value) < schema["minLength"]:
        if schema["minLength"] == 1:
            raise _fail(path, "must not be empty")
        raise _fail(path, f"must be at least {_plural(schema['minLength'], 'character')}")
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        raise _fail(path, f"must be at most {_plural(schema['maxLength'], 'character')}")
    if "pattern" in schema and not _regex(schema["pattern"]).search(value):
        raise _fail(path, f"must match {schema['pattern']}")


def _check_number(schema: Schema, value: float, path: str) -> None:
    if "minimum" in schema and value < schema["minimum"]:
        raise _fail(path, f"must be at least {schema['minimum']}")
    if "maximum" in schema and value > schema["maximum"]:
        raise _fail(path, f"must be at most {schema['maximum']}")


def _check_object(schema: Schema, value: dict[str, Any], path: str) -> None:
    properties: dict[str, Schema] = schema.get("properties", {})
    additional = schema.get("additionalProperties", True)
    if additional is False:
        for key in value:
            if key not in properties:
                child = _child(path, key)
                raise BadRequest(f'unknown field "{child}"', field=child)
    for key in schema.get("required", ()):
        if key not in value:
            raise _fail(_child(path, key), "is required")
    if "minProperties" in schema and len(value) < schema["minProperties"]:
        if schema["minProperties"] == 1:
            raise _fail(path, "must not be empty")
        raise _fail(path, f"must have at least {_plural(schema['minProperties'], 'entry')}")
    for key, subschema in properties.items():
        if key in value:
            validate(subschema, value[key], path=_child(path, key))
    if isinstance(additional, dict):
        for key, item in value.items():
            if key not in properties:
                validate(additional, item, path=_child(path, key))


def _check_array(schema: Schema, value: list[Any], path: str) -> None:
    if "minItems" in schema and len(value) < schema["minItems"]:
        if schema["minItems"] == 1:
            raise _fail(path, "must not be empty")
        raise _fail(path, f"must have at least {_plural(schema['minItems'], 'item')}")
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        raise _fail(path, f"must have at most {_plural(schema['maxItems'], 'item')}")
    prefix: list[Schema] = schema.get("prefixItems", [])
    for index, item in enumerate(value):
        subschema = prefix[index] if index < len(prefix) else schema.get("items")
        if subschema is not None:
            validate(subschema, item, path=f"{path}[{index}]")


def _refuse_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


#: One decoder for every body (json.loads with options builds a decoder per call).
_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


def parse_json_body(raw: bytes, schema: Schema) -> dict[str, Any]:
    """
    Decode a UTF-8 JSON request body, require an object, and validate it.

    @raise BadRequest: for anything that is not valid JSON (NaN and Infinity included),
        a body that is not an object, or the first violation of C{schema}.
    """
    try:
        value = _DECODER.decode(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise BadRequest("body is not valid JSON") from None
    if not isinstance(value, dict):
        raise BadRequest("body must be a JSON object")
    validate(schema, value)
    return value


def check_voice_id(value: object, field: str = "id") -> str:
    """
    Return C{value} if it is a voice id (protocol.md section 7), else refuse it.

    Checked before an adapter sees an id, because an adapter makes a file of it: before
    the rule, C{../../x} wrote outside the voice directory and C{*} matched a voice.

    @raise BadRequest: naming C{field}.
    """
    if not isinstance(value, str):
        raise BadRequest(f'"{field}" must be a string', field=field)
    if not _regex(VOICE_ID_PATTERN).search(value):
        raise BadRequest(
            f'"{field}" must be letters, digits, - and _, starting with a letter or digit, '
            f"at most 64 characters",
            field=field,
        )
    return value


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
                (200, _ok("The new voice, as GET /voices lists it.", _json_content("Voice"))),
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
                (200, _ok("The voice is gone.", _json_content("VoiceDeleted"))),
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
                (200, _ok("The weights are on this machine.", _json_content("FetchResponse"))),
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

A request's Authorization header is stripped before any handler sees the request and \
is never logged. Management routes (creating and deleting a voice) answer loopback \
callers, and from anywhere a holder of the management token presenting \
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


def main() -> None:
    """Print the worker protocol's OpenAPI document as YAML."""
    from rhapsode_worker import __version__

    sys.stdout.write(dump_yaml(worker_openapi(__version__)))


if __name__ == "__main__":
    main()
