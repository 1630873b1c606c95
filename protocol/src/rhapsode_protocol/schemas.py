"""
The request and response shapes of Rhapsode (protocol.md sections 3 to 9), one copy of
each, as JSON Schema (the 2020-12 subset OpenAPI 3.1 uses) held in plain dicts.

The public request shapes extend the worker's rather than repeating them.  The SDK and
the core check bodies against these with L{rhapsode_protocol.validation}, and
L{rhapsode_protocol.openapi} builds both OpenAPI documents from the same dicts, so what is
documented is what is enforced.  Standard library only: the core imports it.
"""

from __future__ import annotations

from typing import Any, Sequence

from .errors import ERROR_TABLE
from .vocab import ALL_CUES, ALL_DELIVERIES

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
    # AAC in ADTS frames, which stream and which OpenAI's aac is.
    "aac": "audio/aac",
}

#: The sample rates a request may ask for (C{sampleRate}), and those each format can
#: carry where it cannot carry every one: MPEG's for mp3 and AAC's own table (both
#: within the bounds), libopus's five.  pcm, wav and flac carry any rate in the bounds.
MIN_SAMPLE_RATE = 8000
MAX_SAMPLE_RATE = 48000
_MPEG_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)
FORMAT_RATES: dict[str, tuple[int, ...]] = {
    "mp3": _MPEG_RATES,
    "aac": _MPEG_RATES,
    "opus": (8000, 12000, 16000, 24000, 48000),
}

#: How OpenAI's C{speed} reaches a variant's dial (a variant's C{speed}): the dial's
#: default times the speed (a rate: words a minute, a multiplier), or divided by it
#: (a length: Piper's lengthScale).
SPEED_SCALES = ("proportional", "inverse")
#: The speeds a request may ask for: OpenAI's range.
MIN_SPEED = 0.25
MAX_SPEED = 4.0

#: A voice id (protocol.md section 7): letters, digits, - and _, starting with a letter
#: or digit, at most 64 characters.  Anything else could name a path or a pattern.
VOICE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"
#: An engine id (the config's, the catalog's, every engine-scoped path's) follows the same rule.
ENGINE_ID_PATTERN = VOICE_ID_PATTERN

#: A language tag as BCP 47 writes one (language, then subtags), compared without case.
LANGUAGE_PATTERN = r"^[A-Za-z]{2,8}(-[A-Za-z0-9]{1,8})*$"

#: The upper bounds on what a request may carry, each checked before any work is done.
#: Text: the most any variant's maxCharacters may be (each variant's own ceiling is
#: checked after); an engine's own is usually near 4096.
MAX_TEXT_CHARACTERS = 100_000
#: keepAliveSeconds: a week.  -1 already means "until the room is needed".
MAX_KEEP_ALIVE_SECONDS = 7 * 24 * 3600
#: A seed: what every engine's generator can take (numpy's is 32-bit).
MAX_SEED = 2**32 - 1
#: Names: a variant, a speaker label, a dial.
MAX_NAME_CHARACTERS = 64
#: Instructions (section 4): the most any variant's instructions.maxCharacters may be.
MAX_INSTRUCTION_CHARACTERS = 4096
#: What an instructions capability says its words are: how the voice reads (style), or
#: the voice itself (design).
INSTRUCTION_KINDS: tuple[str, ...] = ("style", "design")
#: Dials one request may set, and turns and speakers one dialogue may carry.
MAX_PARAMS = 32
MAX_TURNS = 256

#: What a request may ask to have timed (protocol.md section 4, "timestamps"): words,
#: or phonemes (with the words they make up, where the variant times words too).
TIMESTAMP_UNITS: tuple[str, ...] = ("word", "phoneme")
#: Where a variant's timings come from: the synthesizer's own events (eSpeak NG, the
#: tone engine's arithmetic), or the durations the model predicted (Piper).  Nothing
#: estimates timings on an engine's behalf, so there is no third source.
TIMESTAMP_SOURCES: tuple[str, ...] = ("synthesizer", "model")
#: The media type a buffered answer with timings is asked for by, and a streamed one.
TIMED_JSON = "application/json"
TIMED_EVENTS = "text/event-stream"

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
    return _string(
        "Absent means whatever is loaded, or the engine's default if nothing is. An "
        "unknown variant is unsupported.",
        minLength=1,
        maxLength=MAX_NAME_CHARACTERS,
    )


def _format_field() -> Schema:
    # A string rather than an enum: a format outside the six is unsupported (422),
    # as one the engine does not produce is, not a malformed request (400).
    return _string(
        "One of capabilities.formats (wav, mp3, opus, flac, pcm, aac); any other is "
        "unsupported. The response's Content-Type is authoritative.",
        minLength=1,
        maxLength=16,
    )


def _language_field() -> Schema:
    return _string(
        "A BCP 47 tag, compared without case, among the effective variant's languages; "
        "absent means the first it lists. A variant with one language ignores it.",
        pattern=LANGUAGE_PATTERN,
        maxLength=35,
    )


def _sample_rate_field() -> Schema:
    return _integer(
        "The sample rate to answer in, resampled from the engine's own by the worker's "
        "encoder; absent is the engine's native rate. mp3 and aac carry 8000, 11025, "
        "12000, 16000, 22050, 24000, 32000, 44100 or 48000 Hz, opus 8000, 12000, 16000, "
        "24000 or 48000; any other rate for them is unsupported.",
        minimum=MIN_SAMPLE_RATE,
        maximum=MAX_SAMPLE_RATE,
    )


def _speed_field() -> Schema:
    return _number(
        "Speaking rate, 1 the voice's own: mapped onto the dial the effective variant's "
        "speed names (its default times the speed, or divided by it); unsupported on a "
        "variant that names none. Not with params setting that same dial.",
        minimum=MIN_SPEED,
        maximum=MAX_SPEED,
    )


def _params_field() -> Schema:
    return _map(
        _number(),
        "Dial values, against the effective variant's dials. Unknown keys are refused.",
        maxProperties=MAX_PARAMS,
    )


def _seed_field() -> Schema:
    return _integer(
        "Reproducibility, for variants whose seeding says so.", minimum=0, maximum=MAX_SEED
    )


def _stream_field() -> Schema:
    return _boolean(
        "true streams chunked; false buffers and sets Content-Length and the duration header.",
        default=True,
    )


def _timestamps_field() -> Schema:
    return _enum(
        TIMESTAMP_UNITS,
        "Time the audio: word, or phoneme (phonemes, with the words they make up where the "
        "variant times words). Only a unit the effective variant's timestamps.units lists; "
        "any other is unsupported. The answer is then a JSON document (stream false, "
        "Accept: application/json) or server-sent events (stream true, Accept: "
        "text/event-stream); raw audio cannot carry timings, so without that Accept the "
        "request is bad_request.",
    )


def _keep_alive_field() -> Schema:
    return _integer(
        "Seconds to keep the model this request loads once it is done: -1 until the room "
        "is needed, 0 frees it at once, at most a week. Request, then engine, then "
        "server. Never sent to a worker.",
        minimum=-1,
        maximum=MAX_KEEP_ALIVE_SECONDS,
    )


#: The rule on words that JSON Schema cannot state (Unicode classes, the variant's cues).
NOTHING_TO_SPEAK = (
    "A text with no letter or digit of any script once unclaimed cues, other bracketed "
    "tags and control characters are removed has nothing to speak: bad_request."
)

SPEAK_REQUEST: Schema = _object(
    {
        "text": _string(
            "What to say. Cues are written [laugh]; the core strips those the variant does "
            "not claim. At most the variant's maxCharacters. " + NOTHING_TO_SPEAK,
            minLength=1,
            maxLength=MAX_TEXT_CHARACTERS,
        ),
        "voice": _string(
            "Engine-scoped id from GET /voices; absent means the engine default.",
            maxLength=MAX_NAME_CHARACTERS,
        ),
        "variant": _variant_field(),
        "format": _format_field(),
        "language": _language_field(),
        "delivery": _enum(
            ALL_DELIVERIES, "How the whole line is read; absent is the voice's ordinary reading."
        ),
        "params": _params_field(),
        "seed": _seed_field(),
        "instructions": _string(
            "Words for the model: how to read the text on a variant whose instructions are "
            "style, the voice to read it in on one whose instructions are design. Only where "
            "the effective variant declares instructions; anywhere else unsupported.",
            minLength=1,
            maxLength=MAX_INSTRUCTION_CHARACTERS,
        ),
        "stream": _stream_field(),
        "sampleRate": _sample_rate_field(),
        "timestamps": _timestamps_field(),
    },
    required=["text"],
    closed=True,
    description="POST /speak on a worker.",
)

PUBLIC_SPEAK_REQUEST: Schema = _extend(
    SPEAK_REQUEST,
    {
        "engine": _string("Engine id, from GET /engines."),
        "keepAliveSeconds": _keep_alive_field(),
        "speed": _speed_field(),
    },
    required=["engine"],
    description="POST /speak on the public API.",
)

DIALOGUE_REQUEST: Schema = _object(
    {
        "turns": _array(
            _object(
                {
                    "speaker": _string(
                        "A label the request makes up.", minLength=1, maxLength=MAX_NAME_CHARACTERS
                    ),
                    "text": _string(
                        "This turn's words, cues written [laugh]. " + NOTHING_TO_SPEAK,
                        maxLength=MAX_TEXT_CHARACTERS,
                    ),
                },
                required=["speaker", "text"],
                closed=True,
            ),
            "The conversation, in order. Its texts share one maxCharacters budget.",
            minItems=1,
            maxItems=MAX_TURNS,
        ),
        "voices": _map(
            _string(maxLength=MAX_NAME_CHARACTERS),
            "Speaker label to voice id; a speaker absent from it is read in a voice the "
            "model picks. A label no turn uses is bad_request.",
            maxProperties=MAX_TURNS,
        ),
        "variant": _variant_field(),
        "format": _format_field(),
        "language": _language_field(),
        "params": _params_field(),
        "seed": _seed_field(),
        "stream": _stream_field(),
        "sampleRate": _sample_rate_field(),
        "timestamps": _timestamps_field(),
    },
    required=["turns"],
    closed=True,
    description="POST /dialogue on a worker. There is no delivery: a dialogue has more "
    "than one reader.",
)

PUBLIC_DIALOGUE_REQUEST: Schema = _extend(
    DIALOGUE_REQUEST,
    {"keepAliveSeconds": _keep_alive_field(), "speed": _speed_field()},
    description="POST /engines/{engine}/dialogue on the public API.",
)

LOAD_REQUEST: Schema = _object(
    {
        "variant": _string(
            "The variant to load; absent means the engine's default.",
            maxLength=MAX_NAME_CHARACTERS,
        )
    },
    closed=True,
)

FETCH_REQUEST: Schema = _object(
    {
        "variant": _string(
            "The variant whose weights to download; absent means the default.",
            maxLength=MAX_NAME_CHARACTERS,
        )
    },
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
        "unreachable": _map(
            _string(),
            "Variants whose model, served elsewhere (their remote), cannot be reached now, "
            "each with why; absent while every one can.",
        ),
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
        "speed": _object(
            {
                "dial": _string("The dial that is the speaking rate: one of dials."),
                "scale": _enum(
                    SPEED_SCALES,
                    "proportional: the dial's default times the speed (a rate); inverse: "
                    "divided by it (a length).",
                ),
            },
            required=["dial", "scale"],
            description="Which dial a request's speed sets, and how. Absent: nothing "
            "maps speed on this variant, and a speed other than 1 is unsupported.",
        ),
        "languages": _array(_string(), "The first is the default.", minItems=1),
        "maxCharacters": _integer("The most text one request may carry.", minimum=1),
        "segmentation": _object(
            {
                "supported": _boolean("false: text over maxCharacters is refused, not split."),
                "segmentCharacters": _integer("What one generation gets.", minimum=1),
                "firstSegmentCharacters": _integer(
                    "A shorter first segment of a streamed answer, for a quicker first byte"
                    " (a buffered one is cut at segmentCharacters alone).", minimum=1
                ),
                "segmentGrowth": _integer(
                    "With firstSegmentCharacters: each later segment of a streamed answer holds at"
                    " most this many times the one before it, up to segmentCharacters, so that on"
                    " a slow engine each is made while the one before it plays.  Absent: the second"
                    " segment may hold segmentCharacters.", minimum=2
                ),
                "jointSilenceMs": _integer(
                    "Silence between segments where one ends a sentence; a segment cut inside a"
                    " sentence (the shorter first one, or a sentence over segmentCharacters) runs"
                    " into the next with none.", minimum=0
                ),
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
        "timestamps": _object(
            {
                "units": _array(
                    _enum(TIMESTAMP_UNITS),
                    "What a request's timestamps field may ask for.",
                    minItems=1,
                ),
                "source": _enum(
                    TIMESTAMP_SOURCES,
                    "synthesizer: the synthesizer's own events or arithmetic; model: the "
                    "durations the model predicted. Nothing is estimated.",
                ),
                "textOffsets": _boolean(
                    "Whether word entries carry textStart and textEnd, offsets into the "
                    "request's text."
                ),
            },
            required=["units", "source", "textOffsets"],
            description="Present only where the variant can time its audio.",
        ),
        "instructions": _object(
            {
                "kind": _enum(
                    INSTRUCTION_KINDS,
                    "style: how the voice reads (emotion, pace, emphasis); design: the "
                    "voice itself, described in words, for a variant with no voices of its own.",
                ),
                "maxCharacters": _integer("The most instructions one request may carry.", minimum=1),
                "required": _boolean("Whether a request without instructions is refused (bad_request)."),
            },
            required=["kind", "maxCharacters", "required"],
            description="Present only where the variant takes /speak's instructions; a "
            "request with instructions to any other variant is unsupported.",
        ),
        "remote": _object(
            {
                "server": _string("The origin of the server that holds the model (scheme, host and port)."),
                "model": _string("The model as that server names it."),
            },
            required=["server"],
            description="Present where the variant's model is served by a server this "
            "worker calls rather than loaded in it: it takes no room on this box, never "
            "expires, and cannot be unloaded from here.",
        ),
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
        "weights": _string(
            "The weights' licence; an engine with no weights names the licence of the data "
            "it speaks from, and says so in notes."
        ),
        "weightsCommercialUse": _boolean("Whether the weights may be used commercially."),
        "notes": _string("Which dependency is responsible for code, and what weights covers."),
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
        "aliases": _map(
            _string(pattern=VOICE_ID_PATTERN),
            "Public API only: the operator's voice aliases for this engine (voices.aliases), "
            "each to the voice id it means. A request naming one speaks that voice; they "
            "are not voices, and GET /voices does not list them.",
        ),
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

TIMING: Schema = _object(
    {
        "unit": _enum(TIMESTAMP_UNITS),
        "text": _string(
            "What was timed: for a word with offsets, the request's text at them; for a "
            "word without, what the engine read (Piper's phonemes); for a phoneme, its IPA."
        ),
        "start": _number("Seconds from the start of this answer's audio.", minimum=0),
        "end": _number("Seconds from the start of this answer's audio; at least start.", minimum=0),
        "textStart": _integer(
            "Where the word begins in the request's text (a dialogue turn's text), in "
            "code points; only where the variant's textOffsets is true, and on words.",
            minimum=0,
        ),
        "textEnd": _integer("Where it ends, exclusive.", minimum=0),
        "turn": _integer("In a dialogue, the index of the turn it belongs to.", minimum=0),
        "speaker": _string("In a dialogue, that turn's speaker."),
    },
    required=["unit", "text", "start", "end"],
    description="One timed word or phoneme. Entries of one unit are in order and never "
    "overlap; the words spoken for one stretch of text (an expansion, like 3:45) are one "
    "entry covering that stretch.",
)

TIMED_AUDIO: Schema = _object(
    {
        "audio": _string("The whole audio, base64.", contentEncoding="base64"),
        "format": _string("The format asked for."),
        "contentType": _string("What the audio's Content-Type would have been."),
        "sampleRate": _integer("The audio's sample rate.", minimum=1),
        "channels": _integer(minimum=1),
        "durationMs": _integer("The audio's length.", minimum=0),
        "alignment": _array(_ref("Timing"), "Every entry, in order of start."),
    },
    required=["audio", "format", "contentType", "sampleRate", "channels", "durationMs", "alignment"],
    description="A buffered answer with timestamps (stream false, Accept: application/json).",
)

AUDIO_DELTA_EVENT: Schema = _object(
    {"type": _string(const="speech.audio.delta"), "audio": _string("base64", contentEncoding="base64")},
    required=["type", "audio"],
    description="The next piece of audio, in the format asked for.",
)

TIMESTAMPS_EVENT: Schema = _object(
    {"type": _string(const="speech.timestamps.delta"), "alignment": _array(_ref("Timing"))},
    required=["type", "alignment"],
    description="Entries sent before the speech.audio.delta that holds the first sample of "
    "each of them.",
)

AUDIO_DONE_EVENT: Schema = _object(
    {
        "type": _string(const="speech.audio.done"),
        "durationMs": _integer("The audio's length.", minimum=0),
    },
    required=["type"],
    description="The stream is whole. A stream that ends without it broke off; one whose "
    "speech failed after it began ends with speech.audio.error instead.",
)

# The core's own answers, in the public API only.

ENGINE_STATE: Schema = _object(
    {
        "process": _enum(
            ("down", "starting", "up", "draining", "failed"),
            "The engine's worker process. For a worker at a URL this server does not run, "
            "up or down as its last health check found it.",
        ),
        "model": _enum(
            ("unloaded", "loading", "loaded"),
            "loading from when a request was admitted until the worker first answered it.",
        ),
        "variant": _string("The variant on the device, or loading; absent while unloaded."),
        "leases": _integer("Requests speaking it now.", minimum=0),
        "pid": _integer("The process id, while there is a process.", minimum=1),
        "restarts": _integer(
            "Restarts after crashes, counted against the restart limit.", minimum=0
        ),
        "lastError": _string(
            "Why the process last failed to start, exited unasked or stopped answering. "
            "Names no path on the box; the worker's own words are in the server's log."
        ),
        "remote": _boolean("A worker at a URL: this server does not run its process."),
        "strays": _array(
            _object(
                {
                    "pid": _integer("The stray process's id.", minimum=1),
                    "since": _string("When it was found, ISO 8601 in UTC."),
                },
                required=["pid", "since"],
            ),
            "Processes that outlived a worker of this engine and its process group while "
            "holding its stdout or stderr (a helper its adapter started in a session of its "
            "own): left running for an operator to end, listed until they exit. The server "
            "counts as degraded meanwhile.",
        ),
        "unreachable": _map(
            _string(),
            "Variants whose model is served elsewhere by a server the worker cannot reach "
            "now (its last health check), each with why: refused, 503 and retryable, until "
            "it answers again.",
        ),
        "adapter": _string(
            "The adapter's own engine id, where the server's id for it differs "
            "(two engines on one adapter); known once the worker has answered."
        ),
    },
    required=["process", "model", "restarts"],
    description="One engine as this server sees it. Reading it starts nothing and loads "
    "nothing.",
)

def _version_fields() -> dict[str, Schema]:
    # Section 9's pair, on an engine summary and on a catalog entry of an installed engine.
    return {
        "workerVersion": _string(
            "The version of rhapsode-worker installed in the engine's virtualenv, read "
            "when the engine was declared. For display and diagnosis only: never branch "
            "on it, read contract. Absent where this server cannot say (a remote engine, "
            "a command configured by hand, metadata it cannot read)."
        ),
        "outdated": _boolean(
            "true where workerVersion differs from this server's version (older or "
            "newer): reinstalling the engine brings it level. Absent with workerVersion."
        ),
    }


ENGINE_SUMMARY: Schema = _object(
    {
        "id": _string("The engine id every engine-scoped route and /speak name."),
        "displayName": _string(),
        "license": LICENSE,
        "defaultVariant": _string(),
        **ENGINE_STATE["properties"],
        **_version_fields(),
        "nodes": _array(
            _object(
                {"node": _string(), "variant": _string(), "leases": _integer(minimum=0)},
                required=["node", "variant", "leases"],
            ),
            "At a cluster's front, for an engine its nodes serve: each node holding one of "
            "its models now (docs/cluster.md).",
        ),
    },
    required=["id", *ENGINE_STATE["required"]],
    description="One entry of GET /engines and of GET /health. displayName, license and "
    "defaultVariant come from the engine's catalog record before it first runs, and are "
    "absent for a remote engine until it has been asked for its capabilities.",
)

ENGINE_LIST: Schema = _array(_ref("EngineSummary"))

RESIDENCY_SUMMARY: Schema = _object(
    {
        "resident": _integer(
            "Models on this box now; a model served elsewhere is listed in models but not counted.",
            minimum=0,
        ),
        "max": _integer("residency.maxResidentModels.", minimum=1),
        "waiting": _integer("Requests waiting for room.", minimum=0),
    },
    required=["resident", "max", "waiting"],
    description="GET /residency's counts, without its models.",
)

RESIDENT_MODEL: Schema = _object(
    {
        "engine": _string(),
        "variant": _string(),
        "leases": _integer("Requests speaking it; a model with leases is not evicted.", minimum=0),
        "lastUsedAt": _string("ISO 8601, UTC."),
        "expiresAt": _string("ISO 8601, UTC; absent while it speaks, or when its keep-alive says never."),
        "keepAliveSeconds": _integer("The keep-alive in force: request, then engine, then server.", minimum=-1),
        "sizeBytes": _integer("What the worker measured it taking, where it could.", minimum=1),
        "node": _string("At a cluster's front: the node holding it (docs/cluster.md)."),
        "server": _string(
            "Where a model served elsewhere runs (its variant's remote.server): it takes no "
            "room here and is not counted in resident, never expires (keepAliveSeconds -1) "
            "and cannot be unloaded from here."
        ),
    },
    required=["engine", "variant", "leases", "lastUsedAt", "keepAliveSeconds"],
)

RESIDENCY: Schema = _extend(
    RESIDENCY_SUMMARY,
    {
        "models": _array(_ref("ResidentModel")),
        "nodes": _array(
            _object(
                {
                    "node": _string(),
                    "url": _string(),
                    "answering": _boolean(),
                    "engines": _array(_string()),
                    "resident": _integer(minimum=0),
                    "max": _integer(minimum=0),
                    "waiting": _integer(minimum=0),
                },
                required=["node", "url", "answering", "engines", "resident", "max", "waiting"],
            ),
            "At a cluster's front: each node as it last said; its models are in models, "
            "each with its node, and the counts above add every node's to the front's own.",
        ),
    },
    required=["models"],
    description="GET /residency (protocol.md section 3).",
)

PUBLIC_HEALTH: Schema = _object(
    {
        "status": _enum(
            ("ok", "degraded"),
            "degraded while an engine has failed or stopped answering; the server itself "
            "answers either way.",
        ),
        "version": _string(
            "This server's package version, for display; never compare it, read contract."
        ),
        "contract": _integer(
            "The contract this server speaks (protocol.md section 9).", minimum=1
        ),
        "engines": _array(_ref("EngineSummary"), "Every configured engine, in configuration order."),
        "residency": _ref("ResidencySummary"),
    },
    required=["status", "version", "contract", "engines", "residency"],
    description="GET /health. Never starts, loads or waits on an engine.",
)

UPDATE_STATUS: Schema = _object(
    {
        "version": _string("This server's package version, for display."),
        "check": _enum(
            ("off", "pending", "ok", "failed"),
            "off when the operator turned the check off; pending before the first answer; "
            "ok once one came back; failed when the last attempt got none.",
        ),
        "latest": _string("The latest release, its tag without the v. Only with ok."),
        "updateAvailable": _boolean(
            "Whether latest is a newer x.y.z release than this server. Only with ok."
        ),
        "releaseUrl": _string("The release's page. Only with ok."),
        "checkedAt": _string("When the answer came back, ISO 8601, UTC. Only with ok."),
        "distribution": _enum(
            ("docker", "source"), "Which instructions to show: the published image, or anything else."
        ),
    },
    required=["version", "check", "distribution"],
    description="GET /update and POST /update/check (protocol.md section 9).",
)

# Managing engines (protocol.md section 10): the catalog, settings, installs and their jobs.

#: The steps a job reports, in the order an install takes them; weights is an install's
#: fifth step when it pulls, and a pull's only one.
JOB_STEPS: tuple[str, ...] = ("venv", "packages", "verify", "register", "weights")
#: A variant named by a pull, or by an install's ?pull=.
VARIANT_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"

CATALOG_ENTRY: Schema = _object(
    {
        "id": _string("The engine id an install names, and its id in GET /engines once installed."),
        "displayName": _string(),
        "license": _object(
            LICENSE["properties"],
            required=["code", "weights", "weightsCommercialUse"],
            description="Both licences, read before install. Where weightsCommercialUse is "
            "false an install must carry ?accept= naming weights exactly.",
        ),
        "package": _string("The adapter's Python distribution, e.g. rhapsode-engine-kokoro."),
        "defaultVariant": _string("The variant an install's ?pull= names to fetch the default."),
        "python": _string(
            "The Python versions its dependencies install on, as a version specifier "
            "(e.g. >=3.11,<3.14); the install finds an interpreter inside it."
        ),
        "installed": _enum(("no", "installing", "yes")),
        "managed": _boolean(
            "Whether this API installed it, and so can reinstall and remove it; an engine "
            "the operator configured is installed: yes, managed: false."
        ),
        **_version_fields(),
        "nodes": _array(
            _string(),
            "At a cluster's front, for an engine its nodes serve: the nodes that have it "
            "installed (an install runs on each node, docs/cluster.md).",
        ),
    },
    required=["id", "displayName", "license", "installed", "managed"],
    description="One engine that exists, installed or not (protocol.md section 10). "
    "workerVersion and outdated only on an installed engine, as its summary has them.",
)

CATALOG: Schema = _array(_ref("CatalogEntry"), "GET /catalog: every engine that exists, in id order.")

SETTING_FIELD: Schema = _object(
    {
        "key": _string(
            "The setting's dotted key, as values nests it: residency.keepAliveSeconds, "
            "engines.kokoro.keepAliveSeconds."
        ),
        "source": _enum(
            ("default", "config", "database"),
            "The layer the value in use came from; the database wins over the config "
            "file, and the file over the default.",
        ),
        "applies": _enum(
            ("live", "restart"),
            "live: a change applies as soon as it is written; restart: at the next start.",
        ),
        "saved": {
            "description": "Present only when the database holds a value the process is "
            "not using yet: a change waiting for a restart. For management.token, true "
            "rather than the token."
        },
    },
    required=["key", "source", "applies"],
)

_SETTING_VALUES: Schema = dict(
    _object(
        {
            "management": _object(
                {
                    "tokenSet": _boolean(
                        "Whether a management token is configured; the token itself is never shown."
                    ),
                    "origins": _array(_string(), "Origins whose pages may call management routes."),
                },
                required=["tokenSet"],
            ),
            "engines": _map(
                _typed("object", "", {}),
                "The per-engine settings of each engine in the registry, by engine id.",
            ),
        },
        required=["management", "engines"],
        description="Every setting as the running process uses it, by section as the "
        "config file nests them: a setting waiting for a restart shows its old value.",
    ),
    additionalProperties=_typed("object", "One section's settings, by name.", {}),
)

SETTINGS: Schema = _object(
    {
        "values": _SETTING_VALUES,
        "fields": _array(_ref("SettingField"), "One entry per setting, by dotted key."),
    },
    required=["values", "fields"],
    description="GET /settings, and PATCH /settings's answer (protocol.md section 10).",
)

SETTINGS_PATCH: Schema = _typed(
    "object",
    "PATCH /settings: any part of values, written to the state database in one "
    "transaction. null clears a setting, or a whole section or engine, back to the "
    "config file's value and then the default. management.token is written as a string "
    "and management.tokenSet never; an array replaces the one below it. A key values "
    "does not have is bad_request, and a per-engine setting of an engine not in the "
    "registry unknown_engine.",
    {
        "properties": {
            "engines": _map(
                _typed(["object", "null"], "", {}),
                "Per-engine settings by engine id; null clears every one.",
                type=["object", "null"],
            ),
        },
        "additionalProperties": _typed(
            ["object", "null"], "A section: any of its settings, each a value or null.", {}
        ),
    },
)

PULL_REQUEST: Schema = _object(
    {
        "variant": _string(
            "The variant whose weights to download.",
            pattern=VARIANT_NAME_PATTERN,
        )
    },
    required=["variant"],
    closed=True,
    description="POST /engines/{engine}/pull.",
)

INSTALL_JOB: Schema = _object(
    {
        "id": _string("The job's id; ids sort in the order jobs were made."),
        "engine": _string(),
        "kind": _enum(("install", "reinstall", "pull")),
        "variant": _string(
            "The variant a pull fetches, or an install fetches in its weights step; an "
            "install without it stops at register."
        ),
        "state": _enum(("queued", "running", "succeeded", "failed")),
        "step": _enum(JOB_STEPS, "The step running, or the last reached; absent before the first."),
        "createdAt": _string("ISO 8601, UTC."),
        "startedAt": _string("ISO 8601, UTC; absent while queued."),
        "finishedAt": _string("ISO 8601, UTC; absent until it succeeds or fails."),
        "error": dict(
            ERROR["properties"]["error"],
            description="Why a failed job failed: an error envelope's body, whose message "
            "names the command and the line of its output that says why.",
        ),
    },
    required=["id", "engine", "kind", "state", "createdAt"],
    description="An install, reinstall or pull (protocol.md section 10, Jobs). One runs at "
    "a time and the rest queue; jobs live in memory, and a finished one is kept until 50 "
    "newer ones have finished.",
)

INSTALL_JOB_LIST: Schema = _array(_ref("InstallJob"), "GET /installs: every job known, newest first.")

OUTDATED_REINSTALLS: Schema = _object(
    {
        "jobs": _array(
            _ref("InstallJob"),
            "One reinstall queued for each outdated engine this API installed, in id "
            "order; [] when nothing is behind, which is a success.",
        ),
        "skipped": _array(
            _object(
                {
                    "engine": _string(),
                    "reason": _enum(
                        ("licence", "busy", "uncatalogued"),
                        "licence: a reinstall would need ?accept=; busy: a job for it is "
                        "queued or running; uncatalogued: the catalog no longer has it.",
                    ),
                },
                required=["engine", "reason"],
            ),
            "Outdated engines that could not be reinstalled without asking somebody.",
        ),
    },
    required=["jobs", "skipped"],
    description="POST /installs/outdated (protocol.md section 10): never refused as a whole.",
)

FEED_EVENT: Schema = _object(
    {
        "id": _integer(
            "The event's number within its job, from 1: the frame's id, and what "
            "Last-Event-ID resumes after.",
            minimum=1,
        ),
        "ts": _string("When it happened, ISO 8601, UTC."),
        "source": _string("What emitted it: install, for every job's events."),
        "level": _string("info, or error on an error and on the progress that ends a failed job."),
        "kind": _enum(
            ("status", "progress", "log", "error"),
            "status: queued, started, succeeded; progress: a step begins, or the job ends; "
            "log: a line a command printed; error: why the job failed. The frame's event "
            "names it.",
        ),
        "message": _string(
            "For people; a line over 2000 characters is cut and ends with an ellipsis."
        ),
        "correlationId": _string("The job's id."),
        "progress": _object(
            {
                "phase": _enum(JOB_STEPS, "The step."),
                "index": _integer("The step's place among the job's steps, from 1.", minimum=1),
                "total": _integer("How many steps the job has.", minimum=1),
                "status": _enum(
                    ("running", "done", "failed"),
                    "running as a step begins; done or failed on the job's last event.",
                ),
            },
            required=["phase", "index", "total", "status"],
            description="On a progress event only.",
        ),
        "data": _typed(
            "object",
            'Detail; on an error event {"error": the error envelope\'s body}.',
            {},
        ),
    },
    required=["id", "ts", "source", "level", "kind", "message", "correlationId"],
    description="One event of a job, the JSON data of one server-sent frame of GET "
    "/installs/{job}/events (ServerKit's server feed).",
)

# Every named shape; a generated document holds those its paths reach.

# -- the OpenAI shim (protocol.md section 11) and the peer API's batch ---------------------

#: The most items one batch of the OpenAI shim carries.
BATCH_ITEMS = 32

#: A voice as the current OpenAI SDK types it: {"id": ...}.
OPENAI_VOICE_OBJECT: dict[str, Any] = {
    "type": "object",
    "properties": {"id": {"type": "string", "minLength": 1, "maxLength": MAX_NAME_CHARACTERS}},
    "required": ["id"],
    "additionalProperties": False,
}

#: The fields of OpenAI's speech request that the shim knows; any other is bad_request.
_OPENAI_FIELDS: dict[str, Any] = {
    "input": {"type": "string", "maxLength": MAX_TEXT_CHARACTERS, "description": "What to say. " + NOTHING_TO_SPEAK},
    "voice": {"type": ["string", "object"]},
    "response_format": {"type": "string", "minLength": 1, "maxLength": 16},
    "speed": {"type": "number", "minimum": MIN_SPEED, "maximum": MAX_SPEED},
    "instructions": {"type": "string", "maxLength": MAX_TEXT_CHARACTERS},
    # vLLM-Omni's: the rate to answer in, resampled by the worker's encoder.
    "sample_rate": {"type": "integer", "minimum": MIN_SAMPLE_RATE, "maximum": MAX_SAMPLE_RATE},
    "stream_format": {"type": "string", "enum": ["audio", "sse"]},
}
_OPENAI_MODEL = {"type": "string", "minLength": 1, "maxLength": 2 * MAX_NAME_CHARACTERS + 1}

OPENAI_SPEECH_REQUEST: dict[str, Any] = {
    "type": "object",
    "properties": {"model": _OPENAI_MODEL, **_OPENAI_FIELDS},
    "required": ["model", "input"],
    "additionalProperties": False,
}

_OPENAI_ITEM = {
    "type": "object",
    "properties": {k: v for k, v in _OPENAI_FIELDS.items() if k != "stream_format"},
    "required": ["input"],
    "additionalProperties": False,
}
OPENAI_BATCH_REQUEST: dict[str, Any] = {
    "type": "object",
    "properties": {
        "model": _OPENAI_MODEL,
        "items": {"type": "array", "items": _OPENAI_ITEM, "minItems": 1, "maxItems": BATCH_ITEMS},
        **{k: v for k, v in _OPENAI_FIELDS.items() if k not in ("input", "stream_format")},
    },
    "required": ["model", "items"],
    "additionalProperties": False,
}


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
    "Timing": TIMING,
    "TimedAudio": TIMED_AUDIO,
    "AudioDeltaEvent": AUDIO_DELTA_EVENT,
    "TimestampsEvent": TIMESTAMPS_EVENT,
    "AudioDoneEvent": AUDIO_DONE_EVENT,
    "EngineState": ENGINE_STATE,
    "EngineSummary": ENGINE_SUMMARY,
    "EngineList": ENGINE_LIST,
    "ResidencySummary": RESIDENCY_SUMMARY,
    "ResidentModel": RESIDENT_MODEL,
    "Residency": RESIDENCY,
    "PublicHealth": PUBLIC_HEALTH,
    "UpdateStatus": UPDATE_STATUS,
    "CatalogEntry": CATALOG_ENTRY,
    "Catalog": CATALOG,
    "SettingField": SETTING_FIELD,
    "Settings": SETTINGS,
    "SettingsPatch": SETTINGS_PATCH,
    "PullRequest": PULL_REQUEST,
    "InstallJob": INSTALL_JOB,
    "InstallJobList": INSTALL_JOB_LIST,
    "OutdatedReinstalls": OUTDATED_REINSTALLS,
    "FeedEvent": FEED_EVENT,
}
