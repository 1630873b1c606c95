"""
What the operator says about the servers this engine fronts, read from the worker's
environment (the config file's C{engines.<id>.env}, on top of the core's own).

Two forms.  One server, one variant: C{RHAPSODE_REMOTE_URL} (and C{RHAPSODE_REMOTE_KEY},
C{RHAPSODE_REMOTE_MODEL}, C{RHAPSODE_REMOTE_VARIANT}, all optional).  Several: a JSON
document in C{RHAPSODE_REMOTE_CONFIG}, either the document itself (starting with C{{})
or the path of a file holding it::

    {"defaultVariant": "custom",
     "concurrency": 8,
     "variants": {
        "custom": {"url": "http://gpu1:8091", "model": "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice"},
        "base":   {"url": "http://gpu2:8091", "keyEnv": "GPU2_KEY", "consent": "studio-release-7"}}}

Everything is checked here, before the worker binds: a key this does not know, a URL that
is not http(s) with a host, a value of the wrong type, each ends the start naming where.
A key is read from the environment (C{keyEnv}) or given (C{key}); it is never logged,
never shown, and sent only as C{Authorization: Bearer} to the server it belongs to.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlsplit

#: The variables read.
CONFIG_VARIABLE = "RHAPSODE_REMOTE_CONFIG"
URL_VARIABLE = "RHAPSODE_REMOTE_URL"
KEY_VARIABLE = "RHAPSODE_REMOTE_KEY"
MODEL_VARIABLE = "RHAPSODE_REMOTE_MODEL"
VARIANT_VARIABLE = "RHAPSODE_REMOTE_VARIANT"

#: What the speech servers are spoken to as: vLLM-Omni's extensions (task_type, language,
#: instructions, SSE with an explicit end, the voices API), or OpenAI's request alone.
APIS = ("vllm-omni", "openai")
_VARIANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_KINDS = ("style", "design")
_CLONING = ("upload", "reference", "none")


class RemoteConfigError(Exception):
    """
    The configuration cannot be used; the message says where and why.
    """


@dataclass(frozen=True)
class ServerConfig:
    """
    One variant: the server that serves its model, and what the operator says about it
    where the server cannot.  None means "ask the server, then the catalog".
    """

    url: str
    key: str | None = field(default=None, repr=False)
    model: str | None = None
    api: str | None = None
    sample_rate: int | None = None
    languages: tuple[str, ...] | None = None
    voices: tuple[str, ...] | None = None
    instructions: str | None = None
    cloning: str | None = None
    consent: str | None = None
    speed: bool | None = None
    license: Mapping[str, Any] | None = None
    max_characters: int = 4096
    head_seconds: float = 60.0
    stall_seconds: float = 30.0
    probe_seconds: float = 5.0

    @property
    def origin(self) -> str:
        """The server's scheme, host and port: what may be shown (never a path or key)."""
        parts = urlsplit(self.url)
        return f"{parts.scheme}://{parts.netloc}"


@dataclass(frozen=True)
class RemoteConfig:
    variants: Mapping[str, ServerConfig]
    default_variant: str
    concurrency: int = 8


def _fail(where: str, must: str, value: Any) -> RemoteConfigError:
    shown = json.dumps(value, default=repr)
    return RemoteConfigError(f"{where}: must be {must}, not {shown[:80]}")


def _url(value: Any, where: str) -> str:
    must = "an http or https URL of a speech server (without /v1)"
    if not isinstance(value, str):
        raise _fail(where, must, value)
    try:
        parts = urlsplit(value)
        parts.port
    except ValueError:
        raise _fail(where, must, value) from None
    if parts.scheme not in ("http", "https") or not parts.hostname or "@" in parts.netloc or parts.query:
        raise _fail(where, must, value)
    return value.rstrip("/").removesuffix("/v1")


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _fail(where, "a non-empty string", value)
    return value


def _number(value: Any, where: str, lowest: float, integer: bool = False) -> Any:
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or value < lowest:
        raise _fail(where, f"{'an integer' if integer else 'a number'} >= {lowest:g}", value)
    return value


def _strings(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise _fail(where, "a non-empty list of strings", value)
    return tuple(value)


def _choice(value: Any, where: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise _fail(where, "one of " + ", ".join(choices), value)
    return str(value)


def _license(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict) or not isinstance(value.get("weights"), str) or not isinstance(
        value.get("weightsCommercialUse"), bool
    ):
        raise _fail(where, 'an object with "weights" (a licence) and "weightsCommercialUse" (true or false)', value)
    if not isinstance(value.get("notes", ""), str):
        raise _fail(f"{where}.notes", "a string", value.get("notes"))
    return dict(value)


def _server(raw: Any, where: str, environ: Mapping[str, str]) -> ServerConfig:
    if not isinstance(raw, dict):
        raise _fail(where, "an object", raw)
    known = {
        "url", "key", "keyEnv", "model", "api", "sampleRate", "languages", "voices", "instructions",
        "cloning", "consent", "speed", "license", "maxCharacters", "headSeconds", "stallSeconds", "probeSeconds",
    }
    for key in raw:
        if key not in known:
            raise RemoteConfigError(f"{where}.{key}: unknown key (keys: {', '.join(sorted(known))})")
    if "url" not in raw:
        raise RemoteConfigError(f"{where}.url: required")
    key = raw.get("key")
    if key is not None:
        key = _text(key, f"{where}.key")
    if "keyEnv" in raw:
        name = _text(raw["keyEnv"], f"{where}.keyEnv")
        if name not in environ:
            raise RemoteConfigError(f"{where}.keyEnv: the environment has no {name}")
        key = environ[name]
    values: dict[str, Any] = {"url": _url(raw["url"], f"{where}.url"), "key": key}
    if "model" in raw:
        values["model"] = _text(raw["model"], f"{where}.model")
    if "api" in raw:
        values["api"] = _choice(raw["api"], f"{where}.api", APIS)
    if "sampleRate" in raw:
        values["sample_rate"] = _number(raw["sampleRate"], f"{where}.sampleRate", 1000, integer=True)
    if "languages" in raw:
        values["languages"] = _strings(raw["languages"], f"{where}.languages")
    if "voices" in raw:
        values["voices"] = _strings(raw["voices"], f"{where}.voices")
    if "instructions" in raw and raw["instructions"] is not None:
        values["instructions"] = _choice(raw["instructions"], f"{where}.instructions", _KINDS)
    if "cloning" in raw:
        values["cloning"] = _choice(raw["cloning"], f"{where}.cloning", _CLONING)
    if "speed" in raw:
        if not isinstance(raw["speed"], bool):
            raise _fail(f"{where}.speed", "true or false", raw["speed"])
        values["speed"] = raw["speed"]
    if "consent" in raw:
        values["consent"] = _text(raw["consent"], f"{where}.consent")
    if "license" in raw:
        values["license"] = _license(raw["license"], f"{where}.license")
    if "maxCharacters" in raw:
        values["max_characters"] = _number(raw["maxCharacters"], f"{where}.maxCharacters", 1, integer=True)
    for name, attribute in (("headSeconds", "head_seconds"), ("stallSeconds", "stall_seconds"),
                            ("probeSeconds", "probe_seconds")):
        if name in raw:
            values[attribute] = float(_number(raw[name], f"{where}.{name}", 0.05))
    return ServerConfig(**values)


def read_config(environ: Mapping[str, str]) -> RemoteConfig:
    """
    The configuration the environment describes.

    @raise RemoteConfigError: naming the variable or key, for anything unusable.
    """
    document = environ.get(CONFIG_VARIABLE)
    url = environ.get(URL_VARIABLE)
    if (document is None) == (url is None):
        raise RemoteConfigError(
            f"set exactly one of {URL_VARIABLE} (one server) or {CONFIG_VARIABLE} (a JSON document "
            "or the path of one, naming each variant's server)"
        )
    if url is not None:
        name = environ.get(VARIANT_VARIABLE, "default")
        if not _VARIANT.match(name):
            raise _fail(VARIANT_VARIABLE, "a variant name (letters, digits, ., _ and -)", name)
        raw: dict[str, Any] = {"url": url}
        if environ.get(KEY_VARIABLE):
            raw["key"] = environ[KEY_VARIABLE]
        if environ.get(MODEL_VARIABLE):
            raw["model"] = environ[MODEL_VARIABLE]
        return RemoteConfig({name: _server(raw, URL_VARIABLE, environ)}, name)
    assert document is not None
    where = CONFIG_VARIABLE
    if not document.lstrip().startswith("{"):
        path = Path(document)
        where = str(path)
        try:
            document = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise RemoteConfigError(f"{CONFIG_VARIABLE}: cannot read {path}: {exc.strerror}") from None
    try:
        parsed = json.loads(document)
    except ValueError as exc:
        raise RemoteConfigError(f"{where}: not JSON ({exc})") from None
    except RecursionError:
        raise RemoteConfigError(f"{where}: not JSON (it nests deeper than can be read)") from None
    if not isinstance(parsed, dict):
        raise _fail(where, "an object", parsed)
    for key in parsed:
        if key not in ("variants", "defaultVariant", "concurrency"):
            raise RemoteConfigError(f"{where}.{key}: unknown key (keys: concurrency, defaultVariant, variants)")
    variants = parsed.get("variants")
    if not isinstance(variants, dict) or not variants:
        raise _fail(f"{where}.variants", "an object naming at least one variant", variants)
    servers = {}
    for name, raw in variants.items():
        if not _VARIANT.match(name):
            raise _fail(f"{where}.variants", "keyed by variant names (letters, digits, ., _ and -)", name)
        servers[name] = _server(raw, f"{where}.variants.{name}", environ)
    default = parsed.get("defaultVariant", next(iter(servers)))
    if default not in servers:
        raise _fail(f"{where}.defaultVariant", "one of the variants (" + ", ".join(servers) + ")", default)
    concurrency = _number(parsed.get("concurrency", 8), f"{where}.concurrency", 1, integer=True)
    return RemoteConfig(servers, default, concurrency)
