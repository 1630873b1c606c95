"""
The eSpeak NG adapter's pure mapping (rhapsode_engine_espeak._catalogue): espeak voices
to Rhapsode voices and languages, and dials and deliveries to espeak parameters.

The module is loaded from its file: the adapter's package imports espeakng_loader, which
lives only in the engine's own virtualenv, and this one does not need it.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from rhapsode_worker import clean_text

SOURCE = Path(__file__).resolve().parents[2] / "engines" / "espeak" / "src" / "rhapsode_engine_espeak" / "_catalogue.py"
VOICE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("espeak_catalogue", SOURCE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # dataclasses look their module up in sys.modules while building the classes.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


catalogue = _load()
Record = catalogue.VoiceRecord
DEFAULTS = {name: dial.default for name, dial in catalogue.DIALS.items()}


@pytest.mark.parametrize(
    "name, expected",
    [
        ("female3", "female3"),
        ("Mr_Serious", "mr_serious"),
        ("Half-LifeAnnouncementSystem", "half-lifeannouncementsystem"),
        ("Chinese (Mandarin, latin as English)", "chinese-mandarin-latin-as-english"),
        ("Māori", "maori"),
        ("  --odd  name!? ", "odd-name"),
        ("???", "voice"),
        ("x" * 80, "x" * 64),
    ],
)
def test_voice_id_fits_the_rule(name: str, expected: str) -> None:
    """An espeak name becomes a lower-case id within the voice-id rule."""
    made = catalogue.voice_id(name, set())
    assert made == expected
    assert VOICE_ID.match(made)


def test_voice_id_numbers_a_name_already_taken() -> None:
    """Two names that make the same id get distinct ids, each still within the rule."""
    assert catalogue.voice_id("Mike", {"mike"}) == "mike-2"
    assert catalogue.voice_id("Mike", {"mike", "mike-2"}) == "mike-3"
    long = catalogue.voice_id("y" * 70, {"y" * 64})
    assert long == "y" * 62 + "-2" and VOICE_ID.match(long)


def test_timbres_keep_espeaks_order_name_and_variant_file() -> None:
    """Each variant record becomes a voice labelled with its name, selecting its file."""
    records = [
        Record("female3", "!v/f3", 2, 0, ((5, "variant"),)),
        Record("Mr_Serious", "!v/Mr serious", 1, 0, ((5, "variant"),)),
        Record("mr serious", "!v/other", 1, 0, ((5, "variant"),)),
    ]
    made = catalogue.timbres(records)
    assert [(t.id, t.label, t.variant, t.gender) for t in made] == [
        ("female3", "female3", "f3", 2),
        ("mr_serious", "Mr_Serious", "Mr serious", 1),
        ("mr-serious", "mr serious", "other", 1),
    ]


def test_each_language_goes_to_the_voice_that_speaks_it_best() -> None:
    """
    A code goes to the voice listing it with the lowest priority number, the first of
    equals; the default comes first and the rest in order of code.
    """
    records = [
        Record("English (Caribbean)", "gmw/en-029", 1, 0, ((5, "en-029"), (10, "en"))),
        Record("English (Great Britain)", "gmw/en", 1, 0, ((2, "en-gb"), (2, "en"))),
        Record("English (America)", "gmw/en-US", 1, 0, ((2, "en-us"), (3, "en"))),
        Record("Chinese (Mandarin)", "sit/cmn", 1, 0, ((5, "cmn"), (5, "zh"))),
        Record("Chinese (Cantonese)", "sit/yue", 1, 0, ((5, "yue"), (8, "zh"))),
        Record("Chinese (Mandarin, Pinyin)", "sit/cmn-pinyin", 1, 0, ((5, "zh"),)),
    ]
    voices = catalogue.language_voices(records)
    assert list(voices) == ["en", "cmn", "en-029", "en-gb", "en-us", "yue", "zh"]
    assert voices["en"] == "gmw/en"
    assert voices["zh"] == "sit/cmn"
    assert voices["en-us"] == "gmw/en-US"


def test_without_the_default_language_the_order_is_by_code() -> None:
    """A default no voice speaks is not invented."""
    records = [Record("German", "gmw/de", 1, 0, ((5, "de"),)), Record("Afrikaans", "gmw/af", 1, 0, ((5, "af"),))]
    assert list(catalogue.language_voices(records)) == ["af", "de"]


def test_plain_settings_are_the_dials_as_they_are() -> None:
    """No delivery: espeak gets the request's dials and its normal pitch range."""
    params = {"rate": 230.4, "pitch": 61, "volume": 80, "wordGap": 3}
    assert catalogue.espeak_settings(params, None) == {
        catalogue.RATE: 230,
        catalogue.PITCH: 61,
        catalogue.VOLUME: 80,
        catalogue.RANGE: 50,
        catalogue.WORDGAP: 3,
    }


def test_deliveries_move_the_requests_own_settings() -> None:
    """
    Hushed is slower, lower, quieter and flatter than the request asked; frantic faster,
    higher, louder and wider; each relative to the request, so a fast high request
    stays faster and higher when hushed than a slow low one does.
    """
    slow = {**DEFAULTS, "rate": 120, "pitch": 30}
    fast = {**DEFAULTS, "rate": 300, "pitch": 70}
    for params in (slow, fast, DEFAULTS):
        plain = catalogue.espeak_settings(params, None)
        hushed = catalogue.espeak_settings(params, "hushed")
        frantic = catalogue.espeak_settings(params, "frantic")
        for key in (catalogue.RATE, catalogue.PITCH, catalogue.VOLUME, catalogue.RANGE):
            assert hushed[key] < plain[key] < frantic[key], key
        assert hushed[catalogue.WORDGAP] == plain[catalogue.WORDGAP] == frantic[catalogue.WORDGAP]
    for delivery in ("hushed", "frantic"):
        low = catalogue.espeak_settings(slow, delivery)
        high = catalogue.espeak_settings(fast, delivery)
        assert low[catalogue.RATE] < high[catalogue.RATE]
        assert low[catalogue.PITCH] < high[catalogue.PITCH]


def test_deliveries_stay_within_espeaks_ranges() -> None:
    """At the dials' ends a delivery clamps to espeak's range rather than leave it."""
    top = {name: dial.max for name, dial in catalogue.DIALS.items()}
    bottom = {name: dial.min for name, dial in catalogue.DIALS.items()}
    frantic = catalogue.espeak_settings(top, "frantic")
    hushed = catalogue.espeak_settings(bottom, "hushed")
    assert (frantic[catalogue.RATE], frantic[catalogue.PITCH], frantic[catalogue.VOLUME]) == (450, 100, 200)
    assert (hushed[catalogue.RATE], hushed[catalogue.PITCH], hushed[catalogue.VOLUME]) == (80, 0, 0)
    assert 0 <= hushed[catalogue.RANGE] < 50 < frantic[catalogue.RANGE] <= 100


@pytest.mark.parametrize(
    "text",
    ["Hello \x0120A world", "Hello \x01+10S world", "Hello \x01-5P world", "Hello \x01 world", "Hello \x0199 world"],
)
def test_embedded_commands_are_removed_as_private_tags(text: str) -> None:
    """espeak's control-A commands, with or without number and letter, never reach it."""
    assert clean_text(text, (), (catalogue.EMBEDDED_COMMAND,)) == "Hello world"


@pytest.mark.parametrize(
    ("voice_file", "dictionary"),
    [
        ("name Faroese\nlanguage fo\nmaintainer x\n", "fo"),
        ("name English (America)\nlanguage en-us 2\nlanguage en 3\n", "en"),
        ("name Chinese\nlanguage cmn\nlanguage zh 4\ndictionary cmn // comment\n", "cmn"),
        ("name Latgalian\nlanguage ltg\n\ndictionary lv\n", "lv"),
        ("dictionary lv\nlanguage ltg\n", "ltg"),
        ("name xextan-test\nlanguage xex\n\nphonemes pt-br\n", "xex"),
        ("name klatt\nlanguage variant\ngender male\n", None),
        ("// language fr\nname none\n", None),
    ],
)
def test_a_voice_files_dictionary_is_named_as_espeak_names_it(voice_file: str, dictionary: str | None) -> None:
    """
    The dictionary a voice file loads is its first language up to a hyphen, unless a
    later dictionary line names another (espeak reads the lines in order, and the first
    language line sets the dictionary too); a variant's file names none.  (The adapter probes only
    voices whose dictionary the wheel ships, so espeak never prints that it cannot
    read one.)
    """
    assert catalogue.dictionary_name(voice_file) == dictionary
