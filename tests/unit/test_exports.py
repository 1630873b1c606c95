"""
The core's public surface, pinned as klein's test_exports pins its own: each public
module's C{__all__} is exactly the names below, and each name is the very object its
implementation module defines (a re-export, never a copy).
"""

from __future__ import annotations

import importlib

import pytest

import rhapsode_protocol.errors as errors
from rhapsode import _client, _config, _service, client, service, testing

SURFACE = {
    "rhapsode.client": {
        "Audio": _client.Audio,
        "AudioSink": _client.AudioSink,
        "RhapsodeClient": _client.RhapsodeClient,
        "TruncatedResponse": _client.TruncatedResponse,
        **{name: getattr(errors, name) for name in (
            "BadRequest", "Conflict", "Forbidden", "Internal", "ModelUnavailable", "OutOfMemory",
            "Overloaded", "SpeechError", "UnknownEngine", "UnknownVoice", "Unsupported",
        )},
    },
    "rhapsode.service": {
        "Config": _config.Config,
        "ConfigError": _config.ConfigError,
        "EngineConfig": _config.EngineConfig,
        "RhapsodeService": _service.RhapsodeService,
        "load_config": _config.load_config,
        "parse_config": _config.parse_config,
    },
    "rhapsode.testing": {
        "FakeEngine": testing.FakeEngine,
        "StubRhapsode": testing.StubRhapsode,
        "default_capabilities": testing.default_capabilities,
        "fake_voice": testing.fake_voice,
    },
}


@pytest.mark.parametrize("name", sorted(SURFACE))
def test_each_public_module_exports_exactly_its_names_as_the_same_objects(name: str) -> None:
    """
    The module's __all__ is its surface, and every name in it is the implementation's
    own object.
    """
    module = importlib.import_module(name)
    expected = SURFACE[name]
    assert sorted(module.__all__) == sorted(expected)
    for attribute, value in expected.items():
        assert getattr(module, attribute) is value, attribute


def test_the_surface_table_names_the_modules_themselves() -> None:
    """
    The table above is keyed by the modules this test imports, so a renamed module
    fails here rather than being skipped.
    """
    assert {client.__name__, service.__name__, testing.__name__} == set(SURFACE)
