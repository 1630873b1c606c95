"""
Cue stripping (protocol.md section 5) and blend recipes (section 7).
"""

from __future__ import annotations

import pytest

from rhapsode_protocol.vocab import clean_text, is_speakable
from rhapsode_worker import ALL_CUES, BadRequest
from rhapsode_worker._blend import parse_blend


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("word [laugh] word", "word word"),
        ("word [laugh]. Next", "word. Next"),
        ("[sigh] Hello", "Hello"),
        ("Hello [cough]", "Hello"),
        ("a [sigh] [cough] b", "a b"),
        ("a [yawn] b", "a b"),
        ("say [  Clear   Throat ] now", "say now"),
        ("(hi [gasp]) there", "(hi) there"),
        ("line one [sigh]\nline two", "line one\nline two"),
        ("[laugh]", ""),
        ("no tags at all ", "no tags at all"),
    ],
)
def test_unclaimed_cues_removed_with_space_closed(text: str, expected: str) -> None:
    """
    A variant that claims no cues gets every bracketed tag removed, leaving one space
    (or none before punctuation, a line end or the text's edge).
    """
    assert clean_text(text, ()) == expected


def test_claimed_cues_kept_canonically() -> None:
    """
    Claimed cues stay, rewritten as the vocabulary spells them; others go.
    """
    text = "Oh [LAUGH] really [ clear  throat ] fine [groan]."
    assert clean_text(text, ("laugh", "clear throat")) == "Oh [laugh] really [clear throat] fine."


def test_private_tag_syntax_removed() -> None:
    """
    An engine's own tag syntax is removed even when it is not bracketed, so a client
    cannot reach engine-private features around the vocabulary.
    """
    assert clean_text("hi <yawn> there <laugh>!", ALL_CUES, [r"<[a-z]+>"]) == "hi there!"


def test_nul_in_input_is_not_a_removal_marker() -> None:
    """
    A NUL in the request is dropped, not mistaken for a removal.
    """
    assert clean_text("a\x00b [x] c", ()) == "ab c"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a\x01\x02b", "ab"),
        ("line\x07 two", "line two"),
        ("one\rtwo\x0bthree\x0cfour", "one two three four"),
        ("keep\ttabs\nand lines", "keep\ttabs\nand lines"),
        ("c1\x85next \x9bend", "c1 next end"),
    ],
)
def test_control_characters_never_reach_an_engine(text: str, expected: str) -> None:
    """
    Control characters are removed like unclaimed tags, and those that separate like
    whitespace (CR, VT, FF, NEL) become a space; tabs and newlines are kept.
    """
    assert clean_text(text, ()) == expected


def test_a_private_pattern_starting_with_a_control_character_still_matches_whole() -> None:
    """
    An engine's private syntax that begins with a control character (eSpeak's ^A
    commands) is removed whole, not just its first character.
    """
    assert clean_text("Hello \x0120A world", (), [r"\x01[0-9]*[A-Z]?"]) == "Hello world"


@pytest.mark.parametrize(
    "text",
    ["\x01\x02", "\u200b\u200c\u200d", "\u200f\u202e\u2066", "\U0001f600\U0001f389", "... !?", " \t\n"],
)
def test_text_without_a_letter_or_digit_is_not_speakable(text: str) -> None:
    """
    Controls, zero-width and direction marks, emoji and punctuation alone have nothing
    a reader could say.
    """
    assert not is_speakable(clean_text(text, ()))


@pytest.mark.parametrize("text", ["a", "7", "\u0663", "\u6f22", "\U0001f600 hi", "\u200bok"])
def test_any_letter_or_digit_of_any_script_is_speakable(text: str) -> None:
    """
    One letter or digit, of any script, is enough.
    """
    assert is_speakable(text)


def test_blend_recipe_normalised() -> None:
    """
    Weights default to 1, repeat names add up, and the result sums to 1 in first-seen order.
    """
    assert parse_blend("af_bella(2)+af_sky(1)") == [("af_bella", 2 / 3), ("af_sky", 1 / 3)]
    assert parse_blend("a + a + b") == [("a", 2 / 3), ("b", 1 / 3)]
    assert parse_blend("solo") == [("solo", 1.0)]


@pytest.mark.parametrize("recipe", ["", "a(0)", "a(-1)", "a(x)", "../x+a", "a()+b", "a(inf)", "a+(2)", "*"])
def test_bad_blend_recipes_refused(recipe: str) -> None:
    """
    Malformed terms, bad ids and non-positive weights are bad_request naming "blend".
    """
    with pytest.raises(BadRequest) as caught:
        parse_blend(recipe)
    assert caught.value.field == "blend"
