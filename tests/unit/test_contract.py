"""
Tests for L{rhapsode_protocol.contract}: the shapes, the validator, the voice id rule, the
YAML emitter and the generated worker OpenAPI document.
"""

from __future__ import annotations

import ast
import copy
import importlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

import rhapsode_worker
from rhapsode_protocol import schemas, validation
from rhapsode_protocol._yaml import dump_yaml
from rhapsode_protocol.contract import (
    CAPABILITIES,
    DIALOGUE_REQUEST,
    ERROR,
    FETCH_REQUEST,
    HEALTH,
    LOAD_REQUEST,
    PUBLIC_DIALOGUE_REQUEST,
    PUBLIC_SPEAK_REQUEST,
    SPEAK_REQUEST,
    VOICE,
    VOICE_ID_PATTERN,
    check_voice_id,
    parse_json_body,
    validate,
    worker_openapi,
)
from rhapsode_protocol.errors import ERROR_TABLE, BadRequest, Unsupported

ROOT = Path(__file__).resolve().parents[2]
COMMITTED_DOCUMENT = ROOT / "docs" / "openapi.worker.yaml"

FULL_SPEAK = {
    "text": "Right, that was The Verve Pipe. [laugh] Nobody warned me about that intro.",
    "voice": "narrator_02",
    "variant": "turbo",
    "format": "opus",
    "language": "en",
    "delivery": "hushed",
    "params": {"exaggeration": 0.7, "cfgWeight": 1},
    "seed": 20260917,
    "stream": True,
}

FULL_DIALOGUE = {
    "turns": [
        {"speaker": "a", "text": "Did you hear that? [gasp]"},
        {"speaker": "b", "text": "[laugh] It's only the cat."},
        {"speaker": "a", "text": "It is never only the cat."},
    ],
    "voices": {"a": "narrator_02"},
    "variant": "1.6b",
    "format": "wav",
    "language": "en",
    "params": {},
    "seed": 7,
    "stream": False,
}


def _turns(*speakers: str) -> list[dict[str, str]]:
    return [{"speaker": s, "text": "hello"} for s in speakers]


@pytest.mark.parametrize(
    "schema, body",
    [
        (SPEAK_REQUEST, FULL_SPEAK),
        (SPEAK_REQUEST, {"text": "x"}),
        (DIALOGUE_REQUEST, FULL_DIALOGUE),
        (DIALOGUE_REQUEST, {"turns": _turns("a")}),
        (PUBLIC_SPEAK_REQUEST, {**FULL_SPEAK, "engine": "chatterbox", "keepAliveSeconds": -1}),
        (PUBLIC_DIALOGUE_REQUEST, {**FULL_DIALOGUE, "keepAliveSeconds": 0}),
        (LOAD_REQUEST, {}),
        (LOAD_REQUEST, {"variant": "turbo"}),
        (FETCH_REQUEST, {"variant": "turbo"}),
    ],
)
def test_accepts_good_bodies(schema: dict[str, Any], body: dict[str, Any]) -> None:
    """
    Well-formed request bodies, full and minimal, pass their shape.
    """
    validate(schema, body)


REFUSALS = [
    # (schema, body, field, message)
    (SPEAK_REQUEST, {}, "text", '"text" is required'),
    (SPEAK_REQUEST, {"text": ""}, "text", '"text" must not be empty'),
    (SPEAK_REQUEST, {"text": 5}, "text", '"text" must be a string'),
    (SPEAK_REQUEST, {"text": "x", "foo": 1}, "foo", 'unknown field "foo"'),
    (SPEAK_REQUEST, {"text": "x", "seed": True}, "seed", '"seed" must be an integer'),
    (SPEAK_REQUEST, {"text": "x", "seed": 3.5}, "seed", '"seed" must be an integer'),
    (SPEAK_REQUEST, {"text": "x", "seed": 4294967296.0}, "seed", '"seed" must be at most 4294967295'),
    (SPEAK_REQUEST, {"text": "x", "seed": "7"}, "seed", '"seed" must be an integer'),
    (SPEAK_REQUEST, {"text": "x", "seed": -1}, "seed", '"seed" must be at least 0'),
    (SPEAK_REQUEST, {"text": "x", "seed": 2**32}, "seed", '"seed" must be at most 4294967295'),
    (SPEAK_REQUEST, {"text": "x", "format": ""}, "format", '"format" must not be empty'),
    (
        SPEAK_REQUEST,
        {"text": "x" * 100_001},
        "text",
        '"text" must be at most 100000 characters',
    ),
    (
        SPEAK_REQUEST,
        {"text": "x", "language": "en_US"},
        "language",
        '"language" must match ^[A-Za-z]{2,8}(-[A-Za-z0-9]{1,8})*$',
    ),
    (
        SPEAK_REQUEST,
        {"text": "x", "params": {f"d{i}": 1 for i in range(33)}},
        "params",
        '"params" must have at most 32 entries',
    ),
    (
        SPEAK_REQUEST,
        {"text": "x", "variant": "v" * 65},
        "variant",
        '"variant" must be at most 64 characters',
    ),
    (
        SPEAK_REQUEST,
        {"text": "x", "delivery": "ordinary"},
        "delivery",
        '"delivery" must be one of hushed, frantic',
    ),
    (
        SPEAK_REQUEST,
        {"text": "x", "params": {"speed": "fast"}},
        "params.speed",
        '"params.speed" must be a number',
    ),
    (
        SPEAK_REQUEST,
        {"text": "x", "params": {"speed": False}},
        "params.speed",
        '"params.speed" must be a number',
    ),
    (SPEAK_REQUEST, {"text": "x", "params": [1]}, "params", '"params" must be an object'),
    (SPEAK_REQUEST, {"text": "x", "stream": "yes"}, "stream", '"stream" must be a boolean'),
    (SPEAK_REQUEST, {"text": "x", "voice": None}, "voice", '"voice" must be a string'),
    (
        SPEAK_REQUEST,
        {"text": "x", "keepAliveSeconds": 0},
        "keepAliveSeconds",
        'unknown field "keepAliveSeconds"',
    ),
    (PUBLIC_SPEAK_REQUEST, {"text": "x"}, "engine", '"engine" is required'),
    (
        PUBLIC_SPEAK_REQUEST,
        {"text": "x", "engine": "e", "keepAliveSeconds": -2},
        "keepAliveSeconds",
        '"keepAliveSeconds" must be at least -1',
    ),
    (
        PUBLIC_SPEAK_REQUEST,
        {"text": "x", "engine": "e", "keepAliveSeconds": 10**18},
        "keepAliveSeconds",
        '"keepAliveSeconds" must be at most 604800',
    ),
    (
        PUBLIC_SPEAK_REQUEST,
        {"text": "x", "engine": "e", "keepAliveSeconds": 1.5},
        "keepAliveSeconds",
        '"keepAliveSeconds" must be an integer',
    ),
    (DIALOGUE_REQUEST, {}, "turns", '"turns" is required'),
    (DIALOGUE_REQUEST, {"turns": []}, "turns", '"turns" must not be empty'),
    (DIALOGUE_REQUEST, {"turns": {"a": "x"}}, "turns", '"turns" must be an array'),
    (
        DIALOGUE_REQUEST,
        {"turns": _turns("a", "b", "")},
        "turns[2].speaker",
        '"turns[2].speaker" must not be empty',
    ),
    (
        DIALOGUE_REQUEST,
        {"turns": [{"speaker": "a", "text": "x"}, {"speaker": "b"}]},
        "turns[1].text",
        '"turns[1].text" is required',
    ),
    (
        DIALOGUE_REQUEST,
        {"turns": [{"speaker": "a", "text": "x", "voice": "v"}]},
        "turns[0].voice",
        'unknown field "turns[0].voice"',
    ),
    (DIALOGUE_REQUEST, {"turns": ["hello"]}, "turns[0]", '"turns[0]" must be an object'),
    (
        DIALOGUE_REQUEST,
        {"turns": _turns("a"), "voices": {"a": 2}},
        "voices.a",
        '"voices.a" must be a string',
    ),
    (
        DIALOGUE_REQUEST,
        {"turns": _turns("a"), "delivery": "hushed"},
        "delivery",
        'unknown field "delivery"',
    ),
    (LOAD_REQUEST, {"variant": 1}, "variant", '"variant" must be a string'),
    (FETCH_REQUEST, {"variants": "x"}, "variants", 'unknown field "variants"'),
]


@pytest.mark.parametrize("schema, body, field, message", REFUSALS)
def test_refuses_violations(
    schema: dict[str, Any], body: dict[str, Any], field: str, message: str
) -> None:
    """
    Each kind of violation is a BadRequest whose field is the dotted path of the
    offending value and whose message names that path and what was wrong.
    """
    with pytest.raises(BadRequest) as caught:
        validate(schema, body)
    assert caught.value.field == field
    assert caught.value.message == message
    assert caught.value.status == 400


def test_an_integral_float_is_an_integer_and_is_handed_on_as_one() -> None:
    """
    JSON Schema's integer is a number without a fraction: a seed of 58539.0, which a
    client's JSON library may write for 58539, is taken, and the body handed on holds
    the int 58539 (a worker's random generator takes no float); a number field keeps
    its float, and one nested in an array or a map is made an int too.
    """
    from rhapsode_protocol.validation import parse_json_body

    raw = b'{"engine": "e", "text": "x", "seed": 58539.0, "keepAliveSeconds": 409.0, "params": {"speed": 1.0}}'
    body = parse_json_body(raw, PUBLIC_SPEAK_REQUEST)
    assert body["seed"] == 58539 and type(body["seed"]) is int
    assert body["keepAliveSeconds"] == 409 and type(body["keepAliveSeconds"]) is int
    assert type(body["params"]["speed"]) is float
    listed = {"type": "object", "properties": {"n": {"type": "array", "items": {"type": "integer"}},
                                               "m": {"type": "object", "additionalProperties": {"type": "integer"}}}}
    nested = parse_json_body(b'{"n": [1.0, 2], "m": {"a": 3.0}}', listed)
    assert nested == {"n": [1, 2], "m": {"a": 3}} and type(nested["n"][0]) is int and type(nested["m"]["a"]) is int


def test_bool_is_neither_integer_nor_number() -> None:
    """
    JSON's true is not 1: a boolean fails integer and number, though Python calls it an
    int, while real integers and finite floats pass number.
    """
    for schema in ({"type": "integer"}, {"type": "number"}):
        for value in (True, False):
            with pytest.raises(BadRequest):
                validate(schema, value, path="x")
    validate({"type": "number"}, 1)
    validate({"type": "number"}, 1.5)
    validate({"type": "number"}, 10**400)
    validate({"type": "integer"}, -7)
    with pytest.raises(BadRequest, match="must be a number"):
        validate({"type": "number"}, float("nan"), path="x")


def test_violation_order_is_fixed() -> None:
    """
    With several faults the first reported is deterministic: unknown keys before
    required ones, required before property values, and properties in the schema's order
    rather than the body's.
    """
    with pytest.raises(BadRequest) as caught:
        validate(SPEAK_REQUEST, {"seed": "x", "foo": 1})
    assert caught.value.field == "foo"
    with pytest.raises(BadRequest) as caught:
        validate(SPEAK_REQUEST, {"seed": "x"})
    assert caught.value.field == "text"
    with pytest.raises(BadRequest) as caught:
        validate(SPEAK_REQUEST, {"stream": "x", "seed": "y", "text": "t"})
    assert caught.value.field == "seed"


KEYWORD_CASES = [
    # (schema, value, message) with the value at path "v"
    ({"type": "string", "maxLength": 3}, "abcd", '"v" must be at most 3 characters'),
    ({"type": "string", "minLength": 2}, "a", '"v" must be at least 2 characters'),
    ({"type": "string", "pattern": "^a+$"}, "ab", '"v" must match ^a+$'),
    ({"type": "integer", "maximum": 5}, 6, '"v" must be at most 5'),
    ({"type": "number", "minimum": 0.5}, 0.25, '"v" must be at least 0.5'),
    ({"type": ["string", "null"]}, 3, '"v" must be a string or null'),
    ({"type": "boolean", "const": True}, False, '"v" must be true'),
    ({"type": "array", "items": {"type": "string"}, "maxItems": 1}, ["a", "b"],
     '"v" must have at most 1 item'),
    ({"type": "array", "items": {"type": "string"}, "minItems": 2}, ["a"],
     '"v" must have at least 2 items'),
    ({"type": "object", "additionalProperties": {"type": "number"}, "minProperties": 1}, {},
     '"v" must not be empty'),
    ({"type": "array", "prefixItems": [{"type": "number"}, {"type": "string"}]}, [1, 2],
     '"v[1]" must be a string'),
    ({"$ref": "#/components/schemas/Dial"}, {"min": 0, "max": 1},
     '"v.default" is required'),
]


@pytest.mark.parametrize("schema, value, message", KEYWORD_CASES)
def test_each_keyword_is_enforced(schema: dict[str, Any], value: object, message: str) -> None:
    """
    Every keyword the shapes use is enforced, $ref included, with a message naming the
    path.
    """
    with pytest.raises(BadRequest) as caught:
        validate(schema, value, path="v")
    assert caught.value.message == message


def test_type_lists_accept_each_member() -> None:
    """
    A list of types accepts a value of any of them.
    """
    validate({"type": ["string", "null"]}, None)
    validate({"type": ["string", "null"]}, "x")


def test_pattern_dollar_means_end_of_string() -> None:
    """
    A pattern's $ matches only at the very end, as JSON Schema (ECMA-262) means it, so a
    trailing newline does not slip through an anchored pattern as it would in Python.
    """
    with pytest.raises(BadRequest):
        validate({"type": "string", "pattern": "^a$"}, "a\n", path="v")
    validate({"type": "string", "pattern": "^a[$]b$"}, "a$b")


def test_root_violation_names_the_body() -> None:
    """
    A violation at the top level names the body and carries no field.
    """
    with pytest.raises(BadRequest) as caught:
        validate(SPEAK_REQUEST, ["text"])
    assert caught.value.message == "the body must be an object"
    assert caught.value.field is None


def test_unsupported_schema_keywords_are_refused() -> None:
    """
    A schema using a keyword the validator does not enforce is a programming error, not
    a silently half-checked shape; so is a $ref that resolves nowhere.
    """
    with pytest.raises(ValueError, match="oneOf"):
        validate({"oneOf": [{"type": "string"}]}, "x")
    with pytest.raises(ValueError, match="unresolvable"):
        validate({"$ref": "#/components/schemas/Nope"}, "x")


def _schema_nodes(schema: Any) -> list[dict[str, Any]]:
    """Every subschema of C{schema}, itself included."""
    nodes = [schema]
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            nodes.extend(_schema_nodes(schema[key]))
    for sub in schema.get("properties", {}).values():
        nodes.extend(_schema_nodes(sub))
    for sub in schema.get("prefixItems", []):
        nodes.extend(_schema_nodes(sub))
    return nodes


def test_shapes_use_only_enforced_keywords() -> None:
    """
    No shape, nested or not, uses a keyword the validator would refuse.
    """
    for name, shape in schemas._COMPONENTS.items():
        for node in _schema_nodes(shape):
            assert set(node) <= validation._KEYWORDS, (name, node)


@pytest.mark.parametrize(
    "raw",
    [b"", b"{", b"\xff\xfe", b"NaN", b'{"text": "x", "seed": Infinity}', b"[" * 100_000],
)
def test_parse_json_body_refuses_what_is_not_json(raw: bytes) -> None:
    """
    Undecodable bytes, malformed or non-standard JSON (NaN, Infinity) and nesting too
    deep to parse are all "body is not valid JSON".
    """
    with pytest.raises(BadRequest) as caught:
        parse_json_body(raw, SPEAK_REQUEST)
    assert caught.value.message == "body is not valid JSON"


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (b'{"text": "a\\ud800b"}', "text"),
        (b'{"text": "\\udfff"}', "text"),
        (b'{"text": "x", "voice": "\\udc00"}', "voice"),
        (b'{"text": "x", "params": {"\\udc00": 1}}', "params.\ufffd"),
    ],
)
def test_a_lone_surrogate_is_refused_naming_its_field(raw: bytes, field: str) -> None:
    """
    JSON can escape half of a surrogate pair, which Python decodes to a string that is
    not text and cannot be encoded; it is refused at the body as bad_request naming
    where it was (a key named with U+FFFD in its place), never left to fail later.
    """
    with pytest.raises(BadRequest) as caught:
        parse_json_body(raw, SPEAK_REQUEST)
    assert caught.value.field == field
    assert "lone surrogate" in caught.value.message
    caught.value.message.encode("utf-8")


def test_a_surrogate_pair_is_text() -> None:
    """
    An escaped pair (an emoji) is one character, and passes.
    """
    body = parse_json_body(b'{"text": "hi \\ud83d\\ude00"}', SPEAK_REQUEST)
    assert body["text"] == "hi \U0001f600"


def test_parse_json_body_requires_an_object_and_validates() -> None:
    """
    A JSON value that is not an object is refused; an object is validated against the
    shape and returned.
    """
    with pytest.raises(BadRequest, match="must be a JSON object"):
        parse_json_body(b'["text"]', SPEAK_REQUEST)
    with pytest.raises(BadRequest) as caught:
        parse_json_body(b'{"text": ""}', SPEAK_REQUEST)
    assert caught.value.field == "text"
    body = parse_json_body('{"text": "caf\u00e9", "seed": 1}'.encode(), SPEAK_REQUEST)
    assert body == {"text": "caf\u00e9", "seed": 1}


@pytest.mark.parametrize("voice_id", ["a", "a-b_C9", "9", "Z" * 64, "x_", "0-0"])
def test_check_voice_id_accepts(voice_id: str) -> None:
    """
    Letters, digits, - and _, starting with a letter or digit, up to 64 characters.
    """
    assert check_voice_id(voice_id) == voice_id


@pytest.mark.parametrize(
    "voice_id",
    ["../../x", "*", "", "a" * 65, "-a", "_a", "a b", "a.b", "a/b", "a\n", "\u00e9t\u00e9", "a\x00"],
)
def test_check_voice_id_refuses(voice_id: str) -> None:
    """
    Paths, patterns, the empty string, over-long ids and anything outside the alphabet
    are bad_request naming the field.
    """
    with pytest.raises(BadRequest) as caught:
        check_voice_id(voice_id)
    assert caught.value.field == "id"
    assert caught.value.message.startswith('"id" must be')


def test_check_voice_id_names_the_field_given() -> None:
    """
    The caller's field name is the one reported, and a non-string is refused as such.
    """
    with pytest.raises(BadRequest) as caught:
        check_voice_id("*", "voice")
    assert caught.value.field == "voice"
    assert '"voice"' in caught.value.message
    with pytest.raises(BadRequest, match='"blend" must be a string') as caught:
        check_voice_id(3, "blend")
    assert caught.value.field == "blend"


def test_voice_id_pattern_agrees_with_check_voice_id() -> None:
    """
    The exported pattern, as the validator applies it, draws the same line as
    check_voice_id.
    """
    schema = {"type": "string", "pattern": VOICE_ID_PATTERN}
    for voice_id in ("a-b_C9", "Z" * 64):
        validate(schema, voice_id)
    for voice_id in ("../../x", "*", "a" * 65, "a\n"):
        with pytest.raises(BadRequest):
            validate(schema, voice_id, path="id")


TRICKY_STRINGS = [
    ": ",
    "a: b",
    "#",
    "a #b",
    "yes",
    "No",
    "on",
    "null",
    "~",
    "true",
    "1.0",
    "1e3",
    "0x1f",
    "2026-09-20",
    "  leading spaces",
    "trailing ",
    "two\nlines\n",
    "tab\there",
    "caf\u00e9 \u2603 \U0001f600",
    "line\u2028separator\x85",
    "nul\x00",
    "*",
    "&",
    "!",
    "%",
    "@",
    "`",
    "|",
    ">",
    "- x",
    "-",
    "? q",
    "[a]",
    "{a}",
    "'single'",
    '"double"',
    "back\\slash",
    "",
    "<<",
    "=",
    "/voices/{id}/preview",
    "$ref",
    "plain words, with commas",
]


@pytest.mark.parametrize("text", TRICKY_STRINGS)
def test_yaml_round_trips_tricky_strings(text: str) -> None:
    """
    A string reads back as itself from any position: alone, as a key, as a value and as
    a list item.
    """
    for doc in (text, {text: text}, [text], {"k": [{"a": text, "b": [text, [text]]}]}):
        assert yaml.safe_load(dump_yaml(doc)) == doc


def test_yaml_scalars_and_empty_collections() -> None:
    """
    Numbers (large and small floats included), booleans, null and empty collections
    keep their types.
    """
    doc = {
        "i": -3,
        "f": [0.5, 1e20, 1e-7, -2.0],
        "b": [True, False],
        "n": None,
        "e": {},
        "l": [],
        "nested": [[1, [2]], [], {}],
    }
    text = dump_yaml(doc)
    assert yaml.safe_load(text) == doc
    assert text.endswith("\n")


def test_yaml_refuses_what_it_cannot_write() -> None:
    """
    Types outside the JSON model, and non-string keys, are errors rather than guesses.
    """
    with pytest.raises(TypeError):
        dump_yaml({"s": {1, 2}})
    with pytest.raises(TypeError):
        dump_yaml({1: "x"})


def test_yaml_round_trips_the_worker_document() -> None:
    """
    The whole generated document survives YAML, and dumping it twice gives the same
    text.
    """
    document = worker_openapi("0.1.0")
    text = dump_yaml(document)
    assert yaml.safe_load(text) == document
    assert dump_yaml(worker_openapi("0.1.0")) == text


def test_committed_document_is_current() -> None:
    """
    docs/openapi.worker.yaml is exactly what the shapes generate now.
    """
    expected = dump_yaml(worker_openapi(rhapsode_worker.__version__))
    committed = COMMITTED_DOCUMENT.read_text(encoding="utf-8")
    assert committed == expected, (
        "docs/openapi.worker.yaml is out of date with rhapsode_protocol.contract: "
        "run `make openapi` and commit the result"
    )


def test_main_prints_the_document() -> None:
    """
    python -m rhapsode_protocol.contract prints the YAML of the worker document.
    """
    result = subprocess.run(
        [sys.executable, "-m", "rhapsode_protocol.contract"],
        capture_output=True,
        check=True,
        text=True,
    )
    assert result.stdout == dump_yaml(worker_openapi(rhapsode_worker.__version__))


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


WORKER_ROUTES = {
    "/health": {"get"},
    "/capabilities": {"get"},
    "/voices": {"get", "post"},
    "/voices/{id}": {"delete"},
    "/voices/{id}/preview": {"get"},
    "/load": {"post"},
    "/unload": {"post"},
    "/terminate": {"post"},
    "/fetch": {"post"},
    "/speak": {"post"},
    "/dialogue": {"post"},
}
_METHODS = {"get", "put", "post", "delete", "patch", "head", "options", "trace"}


def test_worker_document_structure() -> None:
    """
    The document is OpenAPI 3.1.0 for the worker protocol, at the version asked for,
    with every route and method of protocol sections 1 to 8, each operation with a unique
    operationId and a one-line summary, and every $ref resolving.
    """
    document = worker_openapi("9.8.7")
    assert document["openapi"] == "3.1.0"
    assert document["info"]["title"] == "Rhapsode worker protocol"
    assert document["info"]["version"] == "9.8.7"
    description = document["info"]["description"]
    assert "Unix domain socket" in description and "TCP" in description
    assert '{"ready":true,"contract":1,' in description
    assert "contract 1" in description

    paths = document["paths"]
    assert {path: set(item) & _METHODS for path, item in paths.items()} == WORKER_ROUTES
    ids = []
    for item in paths.values():
        for method in set(item) & _METHODS:
            operation = item[method]
            ids.append(operation["operationId"])
            assert operation["summary"] and "\n" not in operation["summary"]
    assert len(ids) == len(set(ids))

    refs = _all_refs(document)
    assert refs
    for ref in refs:
        _pointer(document, ref)


def test_worker_document_routes_use_the_shapes() -> None:
    """
    Request bodies and answers reference the named shapes, the audio routes answer every
    format's media type with the duration header, and statuses are as the protocol says.
    """
    document = worker_openapi("0.1.0")
    paths = document["paths"]

    def body_ref(path: str) -> str:
        content = paths[path]["post"]["requestBody"]["content"]
        return next(iter(content.values()))["schema"]["$ref"]

    assert body_ref("/speak").endswith("/SpeakRequest")
    assert body_ref("/dialogue").endswith("/DialogueRequest")
    assert body_ref("/load").endswith("/LoadRequest")
    assert body_ref("/fetch").endswith("/FetchRequest")
    assert "multipart/form-data" in paths["/voices"]["post"]["requestBody"]["content"]
    assert body_ref("/voices").endswith("/VoiceCreate")

    for path in ("/speak", "/dialogue"):
        ok = paths[path]["post"]["responses"]["200"]
        assert set(ok["content"]) == {
            "audio/wav", "audio/mpeg", "audio/opus", "audio/flac", "audio/L16", "audio/aac",
            # With timestamps: the buffered document and the event stream, and the core's frames.
            "application/json", "text/event-stream", "application/vnd.rhapsode.frames",
        }
        assert ok["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/TimedAudio"}
        assert "X-Rhapsode-Duration-Ms" in ok["headers"]
        assert "trailer" in ok["headers"]["X-Rhapsode-Duration-Ms"]["description"]
    assert set(paths["/voices/{id}/preview"]["get"]["responses"]["200"]["content"]) == {
        "audio/wav"
    }
    assert "202" in paths["/terminate"]["post"]["responses"]
    # Created is 201 with the voice; deleted and fetched are 204 with no body.
    assert "201" in paths["/voices"]["post"]["responses"]
    for path, method in (("/voices/{id}", "delete"), ("/fetch", "post")):
        assert set(paths[path][method]["responses"]) & {"200", "204"} == {"204"}
        assert "content" not in paths[path][method]["responses"]["204"]


def test_every_error_response_is_the_error_envelope() -> None:
    """
    Every 4xx and 5xx answer of every route is the Error shape.
    """
    document = worker_openapi("0.1.0")
    seen = set()
    for item in document["paths"].values():
        for method in set(item) & _METHODS:
            for status, response in item[method]["responses"].items():
                if int(status) < 400:
                    continue
                seen.add(status)
                resolved = _pointer(document, response["$ref"]) if "$ref" in response else response
                schema = resolved["content"]["application/json"]["schema"]
                assert schema == {"$ref": "#/components/schemas/Error"}
    assert seen == {"400", "404", "409", "422", "429", "500", "503"}


def test_worker_document_holds_no_public_shapes() -> None:
    """
    The public request variants are defined but not in the worker's document: a worker
    is never told keepAliveSeconds.
    """
    document = worker_openapi("0.1.0")
    assert "PublicSpeakRequest" not in document["components"]["schemas"]
    assert "keepAliveSeconds" not in dump_yaml(document)


def test_public_requests_extend_the_worker_ones() -> None:
    """
    The public shapes are the worker's plus engine, keepAliveSeconds and speed (the
    dial it sets is what the worker is sent), in one copy.
    """
    assert list(PUBLIC_SPEAK_REQUEST["properties"])[: len(SPEAK_REQUEST["properties"])] == list(
        SPEAK_REQUEST["properties"]
    )
    assert PUBLIC_SPEAK_REQUEST["required"] == ["text", "engine"]
    assert set(PUBLIC_DIALOGUE_REQUEST["properties"]) == set(DIALOGUE_REQUEST["properties"]) | {
        "keepAliveSeconds", "speed"
    }
    assert PUBLIC_DIALOGUE_REQUEST["additionalProperties"] is False


def test_error_envelopes_validate() -> None:
    """
    What the error classes put on the wire is the Error shape; a code outside the table
    is not.
    """
    validate(ERROR, BadRequest("x", field="f").envelope())
    validate(ERROR, Unsupported("no dialogue").envelope())
    assert set(ERROR["properties"]["error"]["properties"]["code"]["enum"]) == set(ERROR_TABLE)
    with pytest.raises(BadRequest) as caught:
        validate(ERROR, {"error": {"code": "teapot", "message": "x", "retryable": False}})
    assert caught.value.field == "error.code"


def _capabilities() -> dict[str, Any]:
    turbo = {
        "cues": ["laugh", "clear throat"],
        "deliveries": [],
        "dials": {},
        "languages": ["en"],
        "maxCharacters": 4096,
        "segmentation": {"supported": True, "segmentCharacters": 300},
        "cloning": {"supported": True, "referenceSeconds": [5, 10], "formats": ["wav"]},
        "blending": {"supported": False},
        "streaming": {"supported": True, "granularity": "chunk"},
        "seeding": {"reproducible": False},
    }
    original = {
        **copy.deepcopy(turbo),
        "cues": [],
        "deliveries": ["hushed", "frantic"],
        "dials": {"exaggeration": {"min": 0, "max": 2, "default": 0.5}},
        "dialogue": {"maxSpeakers": 2},
    }
    native = {"encoding": "pcm_s16le", "sampleRate": 24000, "channels": 1}
    return {
        "contract": 1,
        "engine": {"id": "chatterbox", "displayName": "Chatterbox", "adapterVersion": "0.3.1"},
        "license": {"code": "MIT", "weights": "MIT", "weightsCommercialUse": True, "notes": ""},
        "device": {"type": "cuda", "name": "NVIDIA GeForce RTX 4090", "vramBytes": 25757220864},
        "defaultVariant": "turbo",
        "current": {**copy.deepcopy(turbo), "variant": "turbo", "nativeFormat": dict(native)},
        "variants": {"turbo": turbo, "original": original},
        "formats": ["wav", "mp3", "opus", "flac", "pcm"],
        "nativeFormat": native,
    }


def test_capabilities_shape() -> None:
    """
    A capability document like protocol section 4's passes, with or without current;
    missing or malformed parts are named by path.
    """
    document = _capabilities()
    validate(CAPABILITIES, document)
    del document["current"]
    validate(CAPABILITIES, document)
    # A worker from before cloning, blending and seeding existed is still valid.
    for optional in ("cloning", "blending", "seeding"):
        document["variants"]["turbo"].pop(optional, None)
    validate(CAPABILITIES, document)

    cases: list[tuple[Any, str]] = [
        (lambda d: d.pop("variants"), "variants"),
        (lambda d: d["variants"].clear(), "variants"),
        (lambda d: d["variants"]["turbo"].pop("streaming"), "variants.turbo.streaming"),
        (lambda d: d["variants"]["turbo"]["cues"].append("yawn"), "variants.turbo.cues[2]"),
        (
            lambda d: d["variants"]["turbo"].update(
                cloning={"supported": True, "referenceSeconds": [5]}
            ),
            "variants.turbo.cloning.referenceSeconds",
        ),
        (
            lambda d: d["variants"]["original"]["dials"]["exaggeration"].pop("max"),
            "variants.original.dials.exaggeration.max",
        ),
        (lambda d: d["license"].pop("weights"), "license.weights"),
        (lambda d: d["nativeFormat"].update(encoding="f32le"), "nativeFormat.encoding"),
        (lambda d: d.update(current={"variant": "turbo"}), "current.cues"),
    ]
    for mutate, field in cases:
        broken = _capabilities()
        mutate(broken)
        with pytest.raises(BadRequest) as caught:
            validate(CAPABILITIES, broken)
        assert caught.value.field == field


def test_health_and_voice_shapes() -> None:
    """
    /health answers with or without a model and its measurements, never a zero size;
    a voice as GET /voices lists it passes.
    """
    validate(
        HEALTH,
        {
            "process": "up",
            "model": "loaded",
            "variant": "turbo",
            "engine": "chatterbox",
            "contract": 1,
            "device": "cuda:0",
            "draining": False,
            "vramBytes": 4831838208,
            "modelBytes": 3355443200,
        },
    )
    idle = {
        "process": "up",
        "model": "unloaded",
        "engine": "tone",
        "contract": 1,
        "device": "cpu",
        "draining": True,
    }
    validate(HEALTH, idle)
    with pytest.raises(BadRequest) as caught:
        validate(HEALTH, {**idle, "modelBytes": 0})
    assert caught.value.field == "modelBytes"
    with pytest.raises(BadRequest) as caught:
        validate(HEALTH, {**idle, "process": "down"})
    assert caught.value.message == '"process" must be "up"'
    validate(
        VOICE,
        {
            "id": "narrator_02",
            "label": "Narrator 02",
            "spec": "narrator_02@turbo",
            "tags": ["cloned", "en"],
            "previewUrl": "/voices/narrator_02/preview",
            "builtin": False,
        },
    )


def test_contract_module_imports_stay_light() -> None:
    """
    The contract's modules (its face, the shapes, the validator, the OpenAPI builder)
    and the taxonomy and vocabulary they use import only the standard library and each
    other, and importing them loads no Twisted, Klein, treq or Automat, because the core
    imports them.
    """
    light = {"contract", "schemas", "validation", "openapi", "errors", "vocab", "_yaml", "frames"}
    for name in sorted(light):
        module = importlib.import_module(f"rhapsode_protocol.{name}")
        tree = ast.parse(Path(str(module.__file__)).read_text(encoding="utf-8"))
        local = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                local.add(node.module or "rhapsode_protocol")  # `from . import __version__`
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                local.add(node.module)
            elif isinstance(node, ast.Import):
                local.update(alias.name for alias in node.names)
        allowed = set(sys.stdlib_module_names) | light | {"rhapsode_protocol"}
        assert {name.split(".")[0] for name in local} <= allowed, name

    probe = (
        "import sys, rhapsode_protocol.contract, rhapsode_protocol.errors, rhapsode_protocol.vocab; "
        "print(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('twisted', 'klein', 'treq', 'automat')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, check=True, text=True
    )
    assert result.stdout.strip() == "[]"


def test_a_schema_with_an_unsupported_keyword_is_refused_every_time() -> None:
    """
    A keyword the validator does not enforce is a programming error, raised on every
    use of the schema, not only the first (the vetted-schema cache keeps no bad one).
    """
    schema = {"type": "string", "format": "email"}
    for _ in range(2):
        with pytest.raises(ValueError, match="format"):
            validate(schema, "a@b.org")


def test_validating_again_gives_the_same_answers() -> None:
    """
    A schema's type test, worked out once and kept, refuses and admits the same values
    the second time as the first, for one type and for several.
    """
    one: dict[str, Any] = {"type": "integer"}
    several: dict[str, Any] = {"type": ["string", "null"]}
    for _ in range(2):
        validate(one, 3)
        with pytest.raises(BadRequest, match="must be an integer"):
            validate(one, True, path="seed")
        validate(several, None)
        with pytest.raises(BadRequest, match="must be a string or null"):
            validate(several, 3, path="v")
