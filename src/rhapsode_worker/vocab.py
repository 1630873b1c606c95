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
from typing import Iterable, Sequence

__all__ = ["ALL_CUES", "ALL_DELIVERIES", "canonical_cue", "clean_text"]

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
    # first) and closed in one pass, so adjacent removals ("a [x] [y] b") make one joint.
    text = text.replace(_MARK, "")
    spans: list[tuple[int, int, str]] = []
    for pattern in private_patterns:
        regex = re.compile(pattern) if isinstance(pattern, str) else pattern
        spans.extend((m.start(), m.end(), _MARK) for m in regex.finditer(text) if m.end() > m.start())
    for m in _BRACKET.finditer(text):
        cue = canonical_cue(m.group(1))
        spans.append((m.start(), m.end(), f"[{cue}]" if cue in keep else _MARK))
    spans.sort()
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
