"""
The standard vocabulary (protocol.md section 5): the closed sets of cues and deliveries,
and, in text, keeping the cues a variant claims and removing every other bracketed tag
and the engine's own private syntax, closing the space each removal leaves.

Shared by the SDK (which cleans every request before an adapter sees it) and the core
(which strips before dispatch), so both apply one rule.  Public, and standard library
only, because the core imports it.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Iterable, Sequence

__all__ = ["ALL_CUES", "ALL_DELIVERIES", "canonical_cue", "clean_text", "is_speakable"]

#: The closed vocabulary of cues (protocol.md section 5), in the spec's order.
ALL_CUES: tuple[str, ...] = (
    "laugh",
    "chuckle",
    "sigh",
    "gasp",
    "cough",
    "clear throat",
    "sniff",
    "groan",
)

#: The two deliveries; deliberately no word for "ordinary".
ALL_DELIVERIES: tuple[str, ...] = ("hushed", "frantic")


# A bracketed tag: short, one line, no nested brackets.  Anything that looks like one is
# either a cue the variant claims or something no reader should say out loud.
_BRACKET = re.compile(r"\[([^\[\]\n]{1,40})\]")
_SPACE = re.compile(r"\s+")
_MARK = "\x00"
# Characters that hug the word before them, so a removal in front of one leaves no space.
_CLOSERS = frozenset(".,!?;:)]}\u00bb\"'\u2019\u201d\u2026\u3002\uff01\uff1f\u3001\uff0c")
_OPENERS = frozenset("([{\u00ab\"'\u2018\u201c")
# Control characters are never read aloud, and some engines' C libraries act on them.
# Those that separate like whitespace (CR, VT, FF, the information separators, NEL)
# become a space; NUL, the removal mark, goes first; the rest are removed like a tag
# the variant does not claim, after the engine's private patterns (which may begin with
# one) have had their turn.
_SPACING: dict[int, str | None] = {code: " " for code in (0x0B, 0x0C, 0x0D, 0x1C, 0x1D, 0x1E, 0x1F, 0x85)}
_SPACING[0x00] = None
_CONTROL = re.compile("[\x01-\x08\x0e-\x1b\x7f-\x84\x86-\x9f]+")


def canonical_cue(inner: str) -> str | None:
    """
    The vocabulary word a tag's inside names (case and spacing forgiven), else None.
    """
    word = _SPACE.sub(" ", inner.strip().lower())
    return word if word in ALL_CUES else None


def _join(left: str, right: str) -> str:
    """
    Glue the text on either side of a removed tag, leaving at most one space.
    """
    trimmed_left = left.rstrip(" \t")
    trimmed_right = right.lstrip(" \t")
    had_space = len(trimmed_left) != len(left) or len(trimmed_right) != len(right)
    if not trimmed_left or trimmed_left.endswith("\n") or trimmed_left[-1] in _OPENERS:
        return trimmed_left + trimmed_right
    if not trimmed_right or trimmed_right[0] == "\n" or trimmed_right[0] in _CLOSERS:
        return trimmed_left + trimmed_right
    return trimmed_left + (" " if had_space else "") + trimmed_right


def clean_text(
    text: str, claimed: Iterable[str], private_patterns: Sequence[str | re.Pattern[str]] = ()
) -> str:
    """
    Keep claimed cues (rewritten canonically as C{[cue]}), remove every other bracketed
    tag and every match of the engine's private tag patterns, and close the gaps.

    The result is stripped; it may be empty when the text was nothing but tags.
    """
    keep = frozenset(claimed)
    # Removals are marked with NUL (never meaningful in text, so dropped from the input
    # first, with every other control character) and closed in one pass, so adjacent
    # removals ("a [x] [y] b") make one joint.
    text = text.translate(_SPACING)
    spans: list[tuple[int, int, str]] = []
    for pattern in private_patterns:
        regex = re.compile(pattern) if isinstance(pattern, str) else pattern
        spans.extend((m.start(), m.end(), _MARK) for m in regex.finditer(text) if m.end() > m.start())
    for m in _BRACKET.finditer(text):
        cue = canonical_cue(m.group(1))
        spans.append((m.start(), m.end(), f"[{cue}]" if cue in keep else _MARK))
    spans.extend((m.start(), m.end(), _MARK) for m in _CONTROL.finditer(text))
    # Where two start together the longer wins: a private pattern that begins with a
    # control character takes the whole command, not just its first character.
    spans.sort(key=lambda span: (span[0], -span[1]))
    out: list[str] = []
    position = 0
    for start, end, replacement in spans:
        if start < position:  # overlapping matches: the earlier one already took it
            continue
        out.append(text[position:start])
        out.append(replacement)
        position = end
    out.append(text[position:])
    pieces = "".join(out).split(_MARK)
    joined = pieces[0]
    for piece in pieces[1:]:
        joined = _join(joined, piece)
    return joined.strip()


def is_speakable(text: str) -> bool:
    """
    Whether C{text} has anything a reader could say: a letter or a digit of any script.

    Text of nothing but punctuation, symbols, emoji, spaces, zero-width or direction
    marks has no words to read, and is refused as the client's mistake rather than
    handed to an engine that may fail on it.
    """
    return any(unicodedata.category(ch)[0] in "LN" for ch in text)
