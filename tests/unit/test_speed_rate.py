"""
A request's speed and sample rate before anything is spoken (the core's preflight, on a
capability document): speed becomes the dial a variant names for it, proportionally or
inversely, and is refused only where no dial maps or the value leaves the dial's range;
a sample rate a format cannot carry is refused naming the rates it can.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from rhapsode._speech.preflight import forward_speak
from rhapsode_protocol.errors import BadRequest, Unsupported
from rhapsode_protocol.validation import check_sample_rate, speed_dial
from rhapsode_worker import Speed, Variant

ESPEAK = {"dials": {"rate": {"min": 80, "max": 450, "default": 175}}, "speed": {"dial": "rate", "scale": "proportional"}}
PIPER = {"dials": {"lengthScale": {"min": 0.5, "max": 2.0, "default": 1.0}},
         "speed": {"dial": "lengthScale", "scale": "inverse"}}
OLD_WORKER = {"dials": {"speed": {"min": 0.5, "max": 2.0, "default": 1.0}}}


def test_speed_is_the_dials_default_times_or_divided_by_it() -> None:
    """
    eSpeak's words a minute go up with speed, Piper's length scale down; a worker from
    before the declaration whose dial is named speed is taken proportionally.
    """
    assert speed_dial(ESPEAK, 2.0, "default") == ("rate", 350.0)
    assert speed_dial(PIPER, 2.0, "medium") == ("lengthScale", 0.5)
    assert speed_dial(PIPER, 0.5, "medium") == ("lengthScale", 2.0)
    assert speed_dial(OLD_WORKER, 1.5, "v1") == ("speed", 1.5)


def test_speed_outside_the_dial_says_what_fits() -> None:
    """
    A speed that would set the dial out of its range is bad_request naming speed and the
    range of speeds the variant takes.
    """
    with pytest.raises(BadRequest) as caught:
        speed_dial(ESPEAK, 3.0, "default")
    assert caught.value.field == "speed" and "0.457 to 2.57" in caught.value.message
    with pytest.raises(BadRequest):
        speed_dial(PIPER, 4.0, "medium")


def test_speed_where_nothing_maps_is_unsupported() -> None:
    """
    A variant with no rate dial refuses a speed as unsupported, listing its dials.
    """
    with pytest.raises(Unsupported) as caught:
        speed_dial({"dials": {"pitch": {"min": 0, "max": 1, "default": 0.5}}}, 1.5, "expressive")
    assert caught.value.field == "speed" and "pitch" in caught.value.message


CAPS: dict[str, Any] = {
    "formats": ["wav", "mp3", "opus", "pcm", "aac"],
    "variants": {"default": {"cues": [], "deliveries": [], "languages": ["en"], "maxCharacters": 100, **ESPEAK}},
}


def test_preflight_sends_the_dial_never_the_speed() -> None:
    """
    The worker is told the dial speed set, not the speed; speed 1 sends nothing; speed
    beside params setting the same dial is refused rather than one silently winning.
    """
    forwarded = forward_speak({"engine": "espeak", "text": "Hi.", "speed": 1.5}, CAPS, "default")
    assert forwarded["params"] == {"rate": 262.5} and "speed" not in forwarded and "engine" not in forwarded
    assert "params" not in forward_speak({"engine": "espeak", "text": "Hi.", "speed": 1}, CAPS, "default")
    with pytest.raises(BadRequest) as caught:
        forward_speak({"engine": "espeak", "text": "Hi.", "speed": 1.5, "params": {"rate": 200}}, CAPS, "default")
    assert caught.value.field == "speed"


@pytest.mark.parametrize("fmt, rate, fits", [
    ("pcm", 24000, True), ("wav", 11111, True), ("flac", 44100, True),
    ("mp3", 22050, True), ("mp3", 23000, False), ("aac", 48000, True),
    ("opus", 24000, True), ("opus", 22050, False),
])
def test_a_sample_rate_the_format_cannot_carry_is_unsupported(fmt: str, rate: int, fits: bool) -> None:
    """
    pcm, wav and flac carry any rate; mp3 and aac MPEG's, opus libopus's five: another
    is unsupported naming sampleRate and the rates there are, before any worker.
    """
    body = {"engine": "espeak", "text": "Hi.", "format": fmt, "sampleRate": rate}
    if fits:
        check_sample_rate(fmt, rate)
        if fmt in CAPS["formats"]:
            assert forward_speak(body, CAPS, "default")["sampleRate"] == rate
        return
    with pytest.raises(Unsupported) as caught:
        forward_speak(body, CAPS, "default")
    assert caught.value.field == "sampleRate" and "24000" in caught.value.message


def test_a_variant_declares_its_rate_dial() -> None:
    """
    The SDK's Variant takes the dial by name (proportional) or as a Speed; a dial named
    speed is the rate dial by default; a Speed naming no dial of the variant is refused.
    """
    assert Variant(dials={"rate": (80, 450, 175)}, speed="rate").speed == Speed("rate")
    assert Variant(dials={"speed": (0.5, 2, 1)}).speed == Speed("speed")
    assert Variant(dials={"pitch": (0, 1, 0.5)}).speed is None
    with pytest.raises(ValueError):
        Variant(dials={"pitch": (0, 1, 0.5)}, speed=Speed("lengthScale", inverse=True))
    assert copy.copy(Speed("lengthScale", inverse=True)).scale == "inverse"
