"""
The shape of a C{PATCH /settings} body, as C{/openapi.json} describes it: every section
and key the settings API takes (L{rhapsode._config.SECTIONS}, L{ENGINE_SETTINGS}), each
with its type and range, and nothing else, since the API refuses a key it does not have
(C{additionalProperties: false} wherever that is so).

The checks themselves stay in L{rhapsode._config}, which a PATCH runs; this table says
in JSON Schema what they take, and a unit test holds it to them (every key described,
every bound where the check puts it).  Some rules cannot be said in JSON Schema (a host
this machine can bind, an origin whose port is a port): those keys are typed, and the
check has the last word.
"""

from __future__ import annotations

import copy
from typing import Any

from rhapsode_protocol.schemas import (
    ENGINE_ID_PATTERN,
    MAX_KEEP_ALIVE_SECONDS,
    MAX_SAMPLE_RATE,
    MIN_SAMPLE_RATE,
    VOICE_ID_PATTERN,
)

from .._config import LOG_LEVELS, MAX_ALIASES, ROLES

__all__ = ["ENGINE_SETTING_SCHEMAS", "SETTING_SCHEMAS", "settings_patch_schema"]

Schema = dict[str, Any]


def _integer(minimum: int, maximum: int) -> Schema:
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


def _number(minimum: float, maximum: float, *, inclusive: bool) -> Schema:
    bound = "minimum" if inclusive else "exclusiveMinimum"
    return {"type": "number", bound: minimum, "maximum": maximum}


_TEXT: Schema = {"type": "string", "minLength": 1, "pattern": r"\S"}
_FLAG: Schema = {"type": "boolean"}
_ORIGIN: Schema = {
    "type": "string",
    "pattern": r"^https?://[^/?#@\s]+$",
    "description": "An absolute http or https origin with nothing after the host and port.",
}

#: Each setting of a section, by its dotted key: what its check in _config takes.
SETTING_SCHEMAS: dict[str, Schema] = {
    "server.port": _integer(1, 65535),
    "server.host": {**_TEXT, "description": "An address this machine can bind; applies at the next start."},
    "server.shutdownGraceMs": _integer(0, 600_000),
    "server.headTimeoutSeconds": _number(0, 600, inclusive=False),
    "server.idleTimeoutSeconds": _number(0, 3600, inclusive=False),
    "server.role": {"type": "string", "enum": list(ROLES), "description": "core, or node of a cluster; applies at the next start."},
    "server.node": {
        "type": "string",
        "pattern": r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
        "description": "This node's name in its cluster; by default the host's name.",
    },
    "log.level": {"type": "string", "enum": list(LOG_LEVELS)},
    "residency.maxResidentModels": _integer(1, 64),
    "residency.evictionWaitSeconds": _number(0, 3600, inclusive=True),
    "residency.keepAliveSeconds": _integer(-1, MAX_KEEP_ALIVE_SECONDS),
    "workers.socketDir": {**_TEXT, "description": "A directory; relative to the config file's."},
    "workers.voiceDir": {**_TEXT, "description": "A directory; relative to the config file's."},
    "workers.startupTimeoutSeconds": _number(0, 3600, inclusive=False),
    "workers.drainGraceMs": _integer(0, 600_000),
    "workers.maxRestarts": _integer(0, 1000),
    "workers.restartDecaySeconds": _number(0, 86_400, inclusive=False),
    "workers.healthCheckSeconds": _number(0, 300, inclusive=False),
    "workers.unresponsiveSeconds": _number(0, 600, inclusive=False),
    "workers.stallSeconds": _number(0, 3600, inclusive=False),
    "workers.cores": _integer(1, 4096),
    "workers.prestart": _FLAG,
    "management.token": {
        "type": "string",
        "minLength": 16,
        "pattern": r"^[!-~]([ -~]*[!-~])?$",
        "description": "At least 16 characters of printable ASCII (it travels in an Authorization header), "
        "without surrounding spaces; never shown once written.",
    },
    "management.origins": {"type": "array", "items": _ORIGIN},
    "cors.origins": {
        "type": "array",
        "items": {"anyOf": [_ORIGIN, {"const": "*"}]},
        "description": 'Origins whose pages may call the public routes, or ["*"] for any.',
    },
    "metrics.public": _FLAG,
    "limits.concurrentPerEngine": _integer(1, 10_000),
    "limits.queuedPerEngine": _integer(0, 10_000),
    "limits.queueWaitSeconds": _number(0, 3600, inclusive=True),
    "limits.bufferedBytes": _integer(1024 * 1024, 16 * 1024**3),
    "install.sourceDir": {**_TEXT, "description": "A directory; relative to the config file's."},
    "install.venvDir": {**_TEXT, "description": "A directory; relative to the config file's."},
    "install.python": _TEXT,
    "install.box": {"type": "string", "enum": ["auto", "cpu", "cuda"], "description": "The box torch engines install for."},
    "update.check": _FLAG,
    "update.url": {
        "type": "string",
        "pattern": r"^https?://[^/?#@\s]+(/[^#\s]*)?$",
        "description": "An http or https URL answering as GitHub's latest-release API does.",
    },
    "voices.aliases": {
        "type": "object",
        "maxProperties": MAX_ALIASES,
        "propertyNames": {"pattern": VOICE_ID_PATTERN},
        "additionalProperties": {"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}:[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"},
        "description": 'Voice names the OpenAI shim takes for "engine:voice" (e.g. {"alloy": "piper:joe"}).',
    },
    "wyoming.port": _integer(1, 65535),
    "wyoming.host": _TEXT,
    "wyoming.zeroconf": _FLAG,
    "wyoming.zeroconfName": {"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"},
    "wyoming.idleSeconds": _number(0, 3600, inclusive=False),
    "wyoming.maxEvents": _integer(1, 1_000_000),
    "wyoming.maxConnections": _integer(1, 10_000),
}

#: Each per-engine setting, by name.
ENGINE_SETTING_SCHEMAS: dict[str, Schema] = {
    "keepAliveSeconds": _integer(-1, MAX_KEEP_ALIVE_SECONDS),
    "maxConcurrent": _integer(1, 10_000),
    "maxQueued": _integer(0, 10_000),
    "openaiSampleRate": _integer(MIN_SAMPLE_RATE, MAX_SAMPLE_RATE),
}


def _nullable(schema: Schema) -> Schema:
    out = copy.deepcopy(schema)
    kind = out.pop("type")
    out["type"] = [kind, "null"] if isinstance(kind, str) else [*kind, "null"]
    if "enum" in out:
        out["enum"] = [*out["enum"], None]
    return out


def _closed(properties: dict[str, Schema], description: str) -> Schema:
    return {
        "type": ["object", "null"],
        "description": description,
        "properties": properties,
        "additionalProperties": False,
    }


def settings_patch_schema() -> Schema:
    """
    The JSON Schema of a C{PATCH /settings} body: any part of the settings document's
    C{values}, each value or C{null} (clear it back to the config file's, then the
    default), a section or engine C{null} to clear all of it; every object closed.
    """
    sections: dict[str, dict[str, Schema]] = {}
    for key, schema in SETTING_SCHEMAS.items():
        section, name = key.split(".", 1)
        sections.setdefault(section, {})[name] = _nullable(schema)
    properties = {
        section: _closed(keys, f"The {section} section: any of its settings, each a value or null.")
        for section, keys in sections.items()
    }
    engine = _closed(
        {name: _nullable(schema) for name, schema in ENGINE_SETTING_SCHEMAS.items()},
        "One engine's settings, each a value or null; null clears them all.",
    )
    properties["engines"] = {
        "type": ["object", "null"],
        "description": "Per-engine settings by engine id (an engine in the registry, else "
        "unknown_engine); null clears every one.",
        "propertyNames": {"pattern": ENGINE_ID_PATTERN},
        "additionalProperties": engine,
    }
    return {
        "type": "object",
        "description": "PATCH /settings: any part of values, written to the state database in one "
        "transaction. null clears a setting, or a whole section or engine, back to the config "
        "file's value and then the default. management.token is written as a string and "
        "management.tokenSet never; an array replaces the one below it. A key values does not "
        "have is bad_request, and a per-engine setting of an engine not in the registry "
        "unknown_engine. A value is checked as strictly as it will be used, beyond what this "
        "shape can say (a host this machine can bind).",
        "properties": properties,
        "additionalProperties": False,
    }
