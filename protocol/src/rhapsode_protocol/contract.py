"""
The contract of Rhapsode in one place (protocol.md sections 3 to 9): the request and
response shapes (L{rhapsode_protocol.schemas}), the validator that holds requests to them
(L{rhapsode_protocol.validation}) and the OpenAPI documents built from them
(L{rhapsode_protocol.openapi}).  The spec makes the SDK the owner of the contract; the
core reads it through this module and its three parts.

C{python -m rhapsode_protocol.contract} prints the worker protocol's document; C{make
openapi} writes it to C{docs/openapi.worker.yaml}.
"""

from __future__ import annotations

import sys

from ._yaml import dump_yaml
from .openapi import public_openapi, worker_openapi
from .schemas import (
    AUDIO_DELTA_EVENT,
    AUDIO_DONE_EVENT,
    CAPABILITIES,
    CATALOG,
    CATALOG_ENTRY,
    CONTRACT_VERSIONS,
    CURRENT_VARIANT_CAPS,
    DIAL,
    DIALOGUE_REQUEST,
    ENGINE_LIST,
    ENGINE_STATE,
    ENGINE_SUMMARY,
    ERROR,
    FEED_EVENT,
    FETCH_REQUEST,
    FETCH_RESPONSE,
    HEALTH,
    INSTRUCTION_KINDS,
    INSTALL_JOB,
    INSTALL_JOB_LIST,
    JOB_STEPS,
    LANGUAGE_PATTERN,
    LICENSE,
    LOAD_REQUEST,
    MAX_INSTRUCTION_CHARACTERS,
    MAX_KEEP_ALIVE_SECONDS,
    MAX_NAME_CHARACTERS,
    MAX_PARAMS,
    MAX_SEED,
    MAX_TEXT_CHARACTERS,
    MAX_TURNS,
    MEDIA_TYPES,
    NATIVE_FORMAT,
    OUTDATED_REINSTALLS,
    PUBLIC_DIALOGUE_REQUEST,
    PUBLIC_HEALTH,
    PUBLIC_SPEAK_REQUEST,
    PULL_REQUEST,
    RESIDENCY,
    RESIDENCY_SUMMARY,
    RESIDENT_MODEL,
    SETTING_FIELD,
    SETTINGS,
    SETTINGS_PATCH,
    SPEAK_REQUEST,
    TERMINATE_RESPONSE,
    TIMED_AUDIO,
    TIMED_EVENTS,
    TIMED_JSON,
    TIMESTAMP_SOURCES,
    TIMESTAMP_UNITS,
    TIMESTAMPS_EVENT,
    TIMING,
    UPDATE_STATUS,
    VARIANT_CAPS,
    VARIANT_NAME_PATTERN,
    VOICE,
    VOICE_CREATE,
    VOICE_DELETED,
    VOICE_ID_PATTERN,
    VOICE_LIST,
    Schema,
)
from .validation import check_instructions, check_voice_id, choose_language, parse_json_body, validate

__all__ = [
    "AUDIO_DELTA_EVENT",
    "AUDIO_DONE_EVENT",
    "INSTRUCTION_KINDS",
    "LANGUAGE_PATTERN",
    "MAX_INSTRUCTION_CHARACTERS",
    "MAX_KEEP_ALIVE_SECONDS",
    "MAX_NAME_CHARACTERS",
    "MAX_PARAMS",
    "MAX_SEED",
    "MAX_TEXT_CHARACTERS",
    "MAX_TURNS",
    "CAPABILITIES",
    "CATALOG",
    "CATALOG_ENTRY",
    "CONTRACT_VERSIONS",
    "CURRENT_VARIANT_CAPS",
    "DIAL",
    "DIALOGUE_REQUEST",
    "ENGINE_LIST",
    "ENGINE_STATE",
    "ENGINE_SUMMARY",
    "ERROR",
    "FEED_EVENT",
    "FETCH_REQUEST",
    "FETCH_RESPONSE",
    "HEALTH",
    "INSTALL_JOB",
    "INSTALL_JOB_LIST",
    "JOB_STEPS",
    "LICENSE",
    "LOAD_REQUEST",
    "MEDIA_TYPES",
    "NATIVE_FORMAT",
    "OUTDATED_REINSTALLS",
    "PUBLIC_DIALOGUE_REQUEST",
    "PUBLIC_HEALTH",
    "PUBLIC_SPEAK_REQUEST",
    "PULL_REQUEST",
    "RESIDENCY",
    "UPDATE_STATUS",
    "RESIDENCY_SUMMARY",
    "RESIDENT_MODEL",
    "SETTING_FIELD",
    "SETTINGS",
    "SETTINGS_PATCH",
    "SPEAK_REQUEST",
    "Schema",
    "TERMINATE_RESPONSE",
    "TIMED_AUDIO",
    "TIMED_EVENTS",
    "TIMED_JSON",
    "TIMESTAMP_SOURCES",
    "TIMESTAMP_UNITS",
    "TIMESTAMPS_EVENT",
    "TIMING",
    "VARIANT_CAPS",
    "VARIANT_NAME_PATTERN",
    "VOICE",
    "VOICE_CREATE",
    "VOICE_DELETED",
    "VOICE_ID_PATTERN",
    "VOICE_LIST",
    "check_instructions",
    "check_voice_id",
    "choose_language",
    "main",
    "parse_json_body",
    "public_openapi",
    "validate",
    "worker_openapi",
]


def main() -> None:
    """Print the worker protocol's OpenAPI document as YAML."""
    from . import __version__

    sys.stdout.write(dump_yaml(worker_openapi(__version__)))


if __name__ == "__main__":
    main()
