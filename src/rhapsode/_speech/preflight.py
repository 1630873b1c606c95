"""
What a speech request must pass before it costs anything (protocol.md sections 3 to 7).

A request the worker would refuse must be refused here first: the worker refuses only
once its model is resident, and making it resident may evict another engine's model
(section 3).  So everything the capability document lets the core decide is decided
here, against the effective variant, before a residency lease is taken: the variant
exists, the format is produced, the language is spoken, every dial is known and in
range, the text has something to say and fits the ceiling, instructions go only to a
variant that declares them (section 4), and for a dialogue the variant performs one with
that many speakers.  What the core alone applies happens here
too: cues the variant does not claim are stripped and an unclaimed delivery dropped.

Whether a voice exists is the worker's to say (it owns its voice store); the router asks
it, through L{voices_to_check}, only when the request would otherwise cost a load.

Timestamps (section 4): a unit the variant does not list is refused here, and a timed
request's text goes to the worker as the caller wrote it (the worker strips by the same
rule), so that the offsets it gives are into the caller's text.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from rhapsode_protocol.errors import BadRequest, Unsupported
from rhapsode_protocol.validation import (
    check_instructions,
    check_sample_rate,
    check_voice_id,
    choose_language,
    speed_dial,
)
from rhapsode_protocol.vocab import clean_text, is_speakable

__all__ = ["check_timestamps", "forward_dialogue", "forward_speak", "voices_to_check"]


def _variant(caps: Mapping[str, Any], variant: str) -> dict[str, Any]:
    variants = caps["variants"]
    if variant not in variants:
        known = ", ".join(sorted(variants))
        raise Unsupported(f'no variant "{variant}" (variants: {known})', field="variant")
    performs: dict[str, Any] = variants[variant]
    return performs


def _common(body: Mapping[str, Any], caps: Mapping[str, Any], variant: str, performs: Mapping[str, Any]) -> dict[str, Any]:
    """
    The forwarded body's shared fields, checked: everything but the engine, the
    keep-alive and the speed (the worker is never told them: a speed is the dial it
    sets), with the variant resolved.
    """
    forward = {k: v for k, v in body.items() if k not in ("engine", "keepAliveSeconds", "speed")}
    forward["variant"] = variant
    fmt = body.get("format", "wav")
    if fmt not in caps.get("formats", ()):
        produced = ", ".join(caps.get("formats", ())) or "none"
        raise Unsupported(f'format "{fmt}" is not produced by this engine (formats: {produced})', field="format")
    if "sampleRate" in body:
        check_sample_rate(fmt, body["sampleRate"])
    if "language" in body:
        forward["language"] = choose_language(body["language"], performs.get("languages") or ["en"], variant)
    dials: Mapping[str, Mapping[str, float]] = performs.get("dials", {})
    for name, value in body.get("params", {}).items():
        dial = dials.get(name)
        if dial is None:
            known = ", ".join(dials) or "none"
            raise BadRequest(f'variant "{variant}" has no dial "{name}" (dials: {known})', field=f"params.{name}")
        if not (math.isfinite(value) and dial["min"] <= value <= dial["max"]):
            raise BadRequest(
                f'"params.{name}" must be within [{dial["min"]}, {dial["max"]}]', field=f"params.{name}"
            )
    speed = body.get("speed")
    if speed is not None and speed != 1:
        dial_name, value = speed_dial(performs, speed, variant)
        if dial_name in body.get("params", {}):
            raise BadRequest(
                f'speed and "params.{dial_name}" both set {dial_name}: send one', field="speed"
            )
        forward["params"] = {**body.get("params", {}), dial_name: value}
    if "voice" in body:
        check_voice_id(body["voice"], "voice")
    if "timestamps" in body:
        check_timestamps(performs, variant, body["timestamps"])
    return forward


def check_timestamps(performs: Mapping[str, Any], variant: str, unit: str) -> None:
    """
    @raise Unsupported: C{unit} is not one the variant times, naming C{timestamps}.
    """
    declared = performs.get("timestamps")
    units = declared.get("units", ()) if isinstance(declared, Mapping) else ()
    if unit not in units:
        claimed = ", ".join(units) or "none"
        raise Unsupported(f'variant "{variant}" does not time "{unit}" (timestamps: {claimed})', field="timestamps")


def _spoken(text: str, cues: Any, field: str) -> str:
    cleaned = clean_text(text, cues)
    if not is_speakable(cleaned):
        raise BadRequest(
            "text has nothing to speak: no letter or digit once tags and control characters are removed",
            field=field,
        )
    return cleaned


def forward_speak(body: Mapping[str, Any], caps: Mapping[str, Any], variant: str) -> dict[str, Any]:
    """
    The worker's C{/speak} body for a public one, or the refusal the worker would give.

    @param variant: the effective variant (section 4's total rule).
    @raise BadRequest, Unsupported: naming the field.
    """
    performs = _variant(caps, variant)
    forward = _common(body, caps, variant, performs)
    text = forward["text"] = _spoken(body["text"], performs.get("cues", ()), "text")
    if "timestamps" in body:
        forward["text"] = body["text"]  # offsets into the caller's text
    ceiling = performs.get("maxCharacters")
    if isinstance(ceiling, int) and len(text) > ceiling:
        raise BadRequest(f"text is {len(text)} characters; the most is {ceiling}", field="text")
    if forward.get("delivery") not in performs.get("deliveries", ()):
        forward.pop("delivery", None)
    # Refused, never dropped, where the variant takes none: the client believes it asked.
    check_instructions(body.get("instructions"), performs.get("instructions"), variant)
    return forward


def forward_dialogue(body: Mapping[str, Any], caps: Mapping[str, Any], variant: str) -> dict[str, Any]:
    """
    The worker's C{/dialogue} body for a public one, or the refusal the worker would give.

    @raise BadRequest, Unsupported: naming the field.
    """
    performs = _variant(caps, variant)
    dialogue = performs.get("dialogue")
    if not isinstance(dialogue, Mapping):
        raise Unsupported(f'variant "{variant}" does not perform dialogue', field="turns")
    forward = _common(body, caps, variant, performs)
    cues = performs.get("cues", ())
    turns = [
        {"speaker": turn["speaker"], "text": _spoken(turn["text"], cues, f"turns[{i}].text")}
        for i, turn in enumerate(body["turns"])
    ]
    # Timed, each turn's text as the caller wrote it: offsets into that.
    forward["turns"] = [dict(turn) for turn in body["turns"]] if "timestamps" in body else turns
    speakers = {turn["speaker"] for turn in turns}
    most = dialogue.get("maxSpeakers", 1)
    if len(speakers) > most:
        raise Unsupported(f'{len(speakers)} speakers; variant "{variant}" performs at most {most}', field="turns")
    for label, voice_id in body.get("voices", {}).items():
        if label not in speakers:
            raise BadRequest(f'no turn has speaker "{label[:64]}"', field=f"voices.{label[:64]}")
        check_voice_id(voice_id, f"voices.{label}")
    total = sum(len(turn["text"]) for turn in turns)
    ceiling = performs.get("maxCharacters")
    if isinstance(ceiling, int) and total > ceiling:
        raise BadRequest(f"turns total {total} characters; the most is {ceiling}", field="turns")
    return forward


def voices_to_check(forward: Mapping[str, Any]) -> dict[str, str]:
    """
    The voice ids a forwarded body names, by the field that names each.
    """
    if "voice" in forward:
        return {"voice": forward["voice"]}
    return {f"voices.{label}": voice for label, voice in forward.get("voices", {}).items()}
