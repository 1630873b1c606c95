"""
The Piper adapter's pure decisions (engines/piper/src/rhapsode_engine_piper/_tuning.py):
reading a voice config, the dials, deliveries relative to the request's settings, and
the bracket guard (threads are the SDK's: tests/unit/test_threads.py).  Loaded by path,
because the package itself imports piper, which this virtualenv does not have.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

PATH = Path(__file__).resolve().parents[2] / "engines/piper/src/rhapsode_engine_piper/_tuning.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("piper_tuning_under_test", PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


tuning = _load()
DEFAULTS = {"lengthScale": 1.0, "noiseScale": 0.667, "noiseW": 0.8}


def _config(tmp_path: Path, inference: dict[str, float]) -> Path:
    path = tmp_path / "voice.onnx.json"
    path.write_text(
        json.dumps(
            {
                "audio": {"sample_rate": 16000, "quality": "low"},
                "language": {"code": "de_DE"},
                "inference": inference,
                "phoneme_id_map": {"_": [0]},
            }
        )
    )
    return path


def test_voice_config_is_read_with_its_own_settings(tmp_path: Path) -> None:
    """
    The rate, quality, language (as a BCP 47 tag) and inference settings come from the
    config, and the dials default to those settings.
    """
    voice = tuning.VoiceFile.read(_config(tmp_path, {"length_scale": 1.1, "noise_scale": 0.5, "noise_w": 0.6}))
    assert (voice.sample_rate, voice.quality, voice.language) == (16000, "low", "de-DE")
    assert voice.dials() == {
        "lengthScale": (0.5, 2.0, 1.1),
        "noiseScale": (0.0, 1.2, 0.5),
        "noiseW": (0.0, 1.2, 0.6),
    }


def test_voice_config_without_inference_takes_pipers_fallbacks(tmp_path: Path) -> None:
    """
    A config that leaves the inference settings out gets Piper's own defaults.
    """
    voice = tuning.VoiceFile.read(_config(tmp_path, {}))
    assert (voice.length_scale, voice.noise_scale, voice.noise_w) == (1.0, 0.667, 0.8)


def test_no_delivery_passes_the_dials_through_at_full_gain() -> None:
    """
    Without a delivery the settings are the dials as given.
    """
    assert tuning.settings_for({**DEFAULTS, "lengthScale": 1.4}, None) == tuning.Settings(1.4, 0.667, 0.8, 1.0)


def test_deliveries_scale_the_requests_own_settings() -> None:
    """
    Hushed is slower, steadier and quieter than whatever the dials asked for; frantic is
    faster and noisier at full gain.  Both move from the request's values, not to fixed
    points.
    """
    for length in (0.8, 1.0, 1.5):
        plain = tuning.settings_for({**DEFAULTS, "lengthScale": length}, None)
        hushed = tuning.settings_for({**DEFAULTS, "lengthScale": length}, "hushed")
        frantic = tuning.settings_for({**DEFAULTS, "lengthScale": length}, "frantic")
        assert hushed.length_scale > plain.length_scale > frantic.length_scale
        assert hushed.noise_scale < plain.noise_scale < frantic.noise_scale
        assert hushed.noise_w < plain.noise_w < frantic.noise_w
        assert hushed.gain < 0.5 and frantic.gain == 1.0
    assert set(tuning.DELIVERIES) == {"hushed", "frantic"}


def test_deliveries_stay_inside_the_dial_ranges() -> None:
    """
    A delivery on a dial already at its limit is held at the limit, and zero noise stays
    zero.
    """
    hushed = tuning.settings_for({"lengthScale": 2.0, "noiseScale": 0.0, "noiseW": 0.0}, "hushed")
    assert (hushed.length_scale, hushed.noise_scale, hushed.noise_w) == (2.0, 0.0, 0.0)
    frantic = tuning.settings_for({"lengthScale": 0.5, "noiseScale": 1.2, "noiseW": 1.0}, "frantic")
    assert (frantic.length_scale, frantic.noise_scale, frantic.noise_w) == (0.5, 1.2, 1.2)


def test_raw_phoneme_pattern_matches_pipers_syntax() -> None:
    """
    The private tag pattern takes a [[ ... ]] block whole, and only that.
    """
    pattern = re.compile(tuning.RAW_PHONEMES)
    assert pattern.findall("a [[ h ə l oʊ ]] b [x] c") == ["[[ h ə l oʊ ]]"]


@pytest.mark.parametrize(
    ("text", "last", "expected"),
    [
        ("The hallway smelt of boiled cabbage and", False, "The hallway smelt of boiled cabbage and,"),
        ("The hallway smelt of boiled cabbage and", True, "The hallway smelt of boiled cabbage and"),
        ("It was a bright cold day in April,", False, "It was a bright cold day in April,"),
        ("It was thirteen.", False, "It was thirteen."),
        ("Really?", False, "Really?"),
        ("Born in 1984", False, "Born in 1984,"),
    ],
)
def test_a_segment_cut_between_words_reads_as_going_on(text: str, last: bool, expected: str) -> None:
    """
    A segment that is not the last and stops on a word gains a comma; one that ends in
    punctuation, or ends the text, is left as it is.
    """
    assert tuning.continued(text, last) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Hello there.", "Hello there."),
        ("[[ a ]]", "a"),
        ("Say [] now", "Say   now"),
        ("x]] y [[z", "x  y  z"),
    ],
)
def test_no_bracket_reaches_piper(text: str, expected: str) -> None:
    """
    Whatever brackets cleaning left become spaces, so Piper never sees a [[ ... ]] block.
    """
    assert tuning.unbracketed(text) == expected
