"""
Checking a request against its shape (L{rhapsode_protocol.schemas}): a small JSON Schema
validator whose refusals are C{bad_request} envelopes naming the field, the JSON body
reader that refuses what JSON does not allow, and the voice id rule.

Written here rather than taken from C{jsonschema} because each refusal must name the
field in the taxonomy's words, and because the core imports it and should pull in
nothing but the standard library.  It enforces exactly the keywords the shapes use and
refuses a schema with any other, since a half-enforced shape is worse than an error.
"""

from __future__ import annotations

import functools
import json
import math
import re
from typing import Any, Callable, Mapping, Sequence

from .errors import BadRequest, Unsupported
from .schemas import _COMPONENTS, _REF_PREFIX, FORMAT_RATES, VOICE_ID_PATTERN, Schema

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
        "maxProperties",
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
_ANNOTATIONS = frozenset({"description", "default", "contentMediaType", "contentEncoding"})
_KEYWORDS = _VALIDATION_KEYWORDS | _ANNOTATIONS


def _is_number(value: object) -> bool:
    # bool is an int to Python and never a number to JSON; NaN and the infinities are
    # not JSON at all.
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, int) and not isinstance(value, bool)


def _is_integer(value: object) -> bool:
    if isinstance(value, float):
        return math.isfinite(value) and value.is_integer()
    return isinstance(value, int) and not isinstance(value, bool)


def _integral(schema: Schema, value: Any) -> Any:
    """
    C{value}, already valid against C{schema}, as an int where it is a float that the
    schema takes only as an integer (C{58539.0} for a seed): what reads it after
    (a worker, an engine's random generator) is handed the integer it asked for.
    """
    if not isinstance(value, float):
        return value
    while "$ref" in schema:
        schema = _resolve(schema["$ref"])
    types = schema.get("type")
    types = types if isinstance(types, list) else [types]
    if "integer" in types and "number" not in types:
        return int(value)
    return value


_TYPES: dict[str, tuple[str, Callable[[object], bool]]] = {
    "string": ("a string", lambda v: isinstance(v, str)),
    # JSON Schema's integer is a number with no fraction, so 3.0 is one (and is handed
    # on as 3, L{_integral}); 3.5 is not.
    "integer": ("an integer", lambda v: _is_integer(v)),
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
    if count == 1:
        return f"{count} {noun}"
    return f"{count} {noun[:-1]}ies" if noun.endswith("y") else f"{count} {noun}s"


def _child(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _clip(key: str) -> str:
    # A client's key is echoed in a message; a megabyte of one is not.
    return key if len(key) <= 64 else key[:61] + "..."


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
                child = _child(path, _clip(key))
                raise BadRequest(f'unknown field "{child}"', field=child)
    for key in schema.get("required", ()):
        if key not in value:
            raise _fail(_child(path, key), "is required")
    if "minProperties" in schema and len(value) < schema["minProperties"]:
        if schema["minProperties"] == 1:
            raise _fail(path, "must not be empty")
        raise _fail(path, f"must have at least {_plural(schema['minProperties'], 'entry')}")
    if "maxProperties" in schema and len(value) > schema["maxProperties"]:
        raise _fail(path, f"must have at most {_plural(schema['maxProperties'], 'entry')}")
    for key, subschema in properties.items():
        if key in value:
            validate(subschema, value[key], path=_child(path, key))
            value[key] = _integral(subschema, value[key])
    if isinstance(additional, dict):
        for key, item in value.items():
            if key not in properties:
                validate(additional, item, path=_child(path, key))
                value[key] = _integral(additional, item)


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
            value[index] = _integral(subschema, item)


def _refuse_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


#: One decoder for every body (json.loads with options builds a decoder per call).
_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)

#: The deepest a JSON body may nest: every shape here is a handful of levels deep, and
#: Python's parser and every walk over what it parsed recurse once per level, so a body
#: nested a thousand deep in two kilobytes once reached the interpreter's limit.
MAX_JSON_DEPTH = 64
# A JSON string, escapes and all (its brackets are text, not structure).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_A_BRACKET = re.compile(rb"[^\[\]{}]+")
_EMPTY_PAIR = re.compile(rb"\[\]|\{\}")


class TooDeep(BadRequest):
    """
    A JSON body nested deeper than L{MAX_JSON_DEPTH}, or with brackets that do not
    pair: refused before it is parsed.
    """


def check_json_depth(raw: bytes | str, most: int = MAX_JSON_DEPTH) -> None:
    """
    Refuse a JSON document nested deeper than C{most} levels, before any parser
    recurses into it.  Linear work done by the regular expression engine: the strings
    are cut out, and the innermost empty pairs of what is left peeled away once per
    level; a document with no more than C{most} brackets in all is passed at once.

    @raise TooDeep: naming the body.
    """
    text = raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass")
    if text.count(b"[") + text.count(b"{") <= most:
        return
    brackets = _NOT_A_BRACKET.sub(b"", _JSON_STRING.sub(b"", text))
    for _ in range(most):
        if not brackets:
            return
        brackets, peeled = _EMPTY_PAIR.subn(b"", brackets)
        if not peeled:
            raise TooDeep("body is not valid JSON", field="body")  # its brackets do not pair
    if brackets:
        raise TooDeep(f"body nests deeper than {most} levels", field="body")


def loads_json(raw: bytes | str) -> Any:
    """
    C{json.loads} of a body or a message from outside, its depth held to
    L{MAX_JSON_DEPTH} first.

    @raise TooDeep: too deep, or brackets that do not pair.
    @raise ValueError: not JSON.
    """
    check_json_depth(raw)
    return json.loads(raw)


def parse_json_body(raw: bytes, schema: Schema) -> dict[str, Any]:
    """
    Decode a UTF-8 JSON request body, require an object, and validate it.

    @raise BadRequest: for anything that is not valid JSON (NaN and Infinity included),
        one nested deeper than L{MAX_JSON_DEPTH}, a body that is not an object, or the
        first violation of C{schema}.
    """
    check_json_depth(raw)
    try:
        value = _DECODER.decode(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise BadRequest("body is not valid JSON") from None
    if not isinstance(value, dict):
        raise BadRequest("body must be a JSON object")
    if b"\\u" in raw:
        # Only an escape can carry a lone surrogate: UTF-8 itself cannot encode one.
        where = _surrogate_at(value, "")
        if where is not None:
            raise _fail(where, "holds a lone surrogate (\\ud800 to \\udfff), which is not text")
    validate(schema, value)
    return value


def _surrogate_at(value: object, path: str) -> str | None:
    """
    The path of the first string (or object key) holding a lone surrogate, else None.
    """
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            # Named with U+FFFD where the surrogate was, so the answer is itself text.
            child = _child(path, _SURROGATE.sub("\ufffd", _clip(key)))
            if _SURROGATE.search(key):
                return child
            found = _surrogate_at(item, child)
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = _surrogate_at(item, f"{path}[{index}]")
            if found is not None:
                return found
    return None


_SURROGATE = re.compile("[\ud800-\udfff]")


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


def choose_language(requested: str | None, languages: Sequence[str], variant: str) -> str:
    """
    The language a request speaks in, spelt as the variant lists it (protocol.md
    section 6).  Tags compare without case, as BCP 47 says ("fr-FR" is "fr-fr"); a
    variant that lists one language ignores the field; absent means the first listed.

    @raise Unsupported: a language the variant does not list, naming those it does.
    """
    if requested is None or len(languages) == 1:
        return languages[0]
    wanted = requested.lower()
    for language in languages:
        if language.lower() == wanted:
            return language
    raise Unsupported(
        f'language "{requested[:35]}" is not spoken by variant "{variant}" ({", ".join(languages)})',
        field="language",
    )


def check_sample_rate(fmt: str, rate: int, field: str = "sampleRate") -> int:
    """
    Return C{rate} if C{fmt} can carry it (L{FORMAT_RATES}; the schema holds it within
    the contract's bounds), else refuse it naming the rates the format takes.

    @raise Unsupported: naming C{field}.
    """
    rates = FORMAT_RATES.get(fmt)
    if rates is not None and rate not in rates:
        listed = ", ".join(str(r) for r in rates)
        raise Unsupported(f"{fmt} carries {listed} Hz, not {rate}", field=field)
    return rate


def speed_dial(performs: Mapping[str, Any], speed: float, variant: str, field: str = "speed") -> tuple[str, float]:
    """
    The dial and the value a request's C{speed} sets on a variant (the capability
    document's C{variants.<name>}): the dial its C{speed} names, at its default times
    the speed (C{proportional}) or divided by it (C{inverse}).  A variant of an older
    worker that declares no C{speed} but has a dial named C{speed} has it set
    proportionally, as the shim always did.

    @raise Unsupported: the variant names no dial for speed (C{field}).
    @raise BadRequest: the value falls outside the dial's range, naming the speeds
        that fit (C{field}).
    """
    dials: Mapping[str, Mapping[str, float]] = performs.get("dials") or {}
    declared = performs.get("speed")
    if not isinstance(declared, Mapping) and "speed" in dials:
        declared = {"dial": "speed", "scale": "proportional"}
    dial = dials.get(declared.get("dial", "")) if isinstance(declared, Mapping) else None
    if dial is None or not isinstance(declared, Mapping):
        known = ", ".join(dials) or "none"
        raise Unsupported(f'variant "{variant}" has no dial that speed sets (dials: {known})', field=field)
    name = str(declared["dial"])
    default, low, high = float(dial["default"]), float(dial["min"]), float(dial["max"])
    inverse = declared.get("scale") == "inverse"
    value = default / speed if inverse else default * speed
    if not (math.isfinite(value) and low <= value <= high):
        slowest, fastest = (default / high, default / low) if inverse else (low / default, high / default)
        raise BadRequest(
            f'speed {speed:g} sets {name} to {value:g}, outside [{low:g}, {high:g}]: variant '
            f'"{variant}" speaks from {slowest:.3g} to {fastest:.3g} times its own rate',
            field=field,
        )
    return name, value


def check_instructions(given: str | None, declared: Mapping[str, Any] | None, variant: str) -> str | None:
    """
    A request's instructions against what its variant declares (protocol.md section 4),
    the same on both sides of the worker socket: absent where the variant does not
    require them, at most its C{maxCharacters}, and refused by every variant that
    declares none rather than dropped (the client believes it asked for something).

    @param declared: the variant's C{instructions} capability, None where it has none.
    @raise Unsupported: instructions for a variant that takes none.
    @raise BadRequest: too long, or missing where the variant requires them.
    """
    if given is None:
        if declared is not None and declared.get("required"):
            raise BadRequest(
                f'variant "{variant}" speaks in the voice its instructions describe: give instructions',
                field="instructions",
            )
        return None
    if declared is None:
        raise Unsupported(
            f'variant "{variant}" takes no instructions: it reads in its voices as they are',
            field="instructions",
        )
    most = declared.get("maxCharacters")
    if isinstance(most, int) and len(given) > most:
        raise BadRequest(
            f"instructions are {len(given)} characters; variant \"{variant}\" takes at most {most}",
            field="instructions",
        )
    return given
