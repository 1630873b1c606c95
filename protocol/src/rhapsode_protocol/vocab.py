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

__all__ = [
    "ALL_CUES",
    "ALL_DELIVERIES",
    "TextMap",
    "canonical_cue",
    "clean_text",
    "clean_text_mapped",
    "is_speakable",
]

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


def _joint(left: str, right: str) -> tuple[int, int, bool]:
    """
    How the text on either side of a removed tag is glued: how much of C{left} is kept,
    where C{right} is taken from, and whether one space goes between (at most one is
    left, and none beside an opener, a closer or a line break).
    """
    trimmed_left = left.rstrip(" \t")
    trimmed_right = right.lstrip(" \t")
    keep, skip = len(trimmed_left), len(right) - len(trimmed_right)
    had_space = keep != len(left) or skip != 0
    if not trimmed_left or trimmed_left.endswith("\n") or trimmed_left[-1] in _OPENERS:
        return keep, skip, False
    if not trimmed_right or trimmed_right[0] == "\n" or trimmed_right[0] in _CLOSERS:
        return keep, skip, False
    return keep, skip, had_space


def _join(left: str, right: str) -> str:
    """
    Glue the text on either side of a removed tag, leaving at most one space.
    """
    keep, skip, space = _joint(left, right)
    return left[:keep] + (" " if space else "") + right[skip:]


def _removals(
    text: str, keep: frozenset[str], private_patterns: Sequence[str | re.Pattern[str]]
) -> list[tuple[int, int, str]]:
    """
    What cleaning replaces in C{text} (control characters already translated), in
    order and without overlaps: each span with the canonical C{[cue]} it becomes, or
    the removal mark.
    """
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
    chosen: list[tuple[int, int, str]] = []
    position = 0
    for start, end, replacement in spans:
        if start < position:  # overlapping matches: the earlier one already took it
            continue
        chosen.append((start, end, replacement))
        position = end
    return chosen


def clean_text(
    text: str, claimed: Iterable[str], private_patterns: Sequence[str | re.Pattern[str]] = ()
) -> str:
    """
    Keep claimed cues (rewritten canonically as C{[cue]}), remove every other bracketed
    tag and every match of the engine's private tag patterns, and close the gaps.

    The result is stripped; it may be empty when the text was nothing but tags.
    """
    # Removals are marked with NUL (never meaningful in text, so dropped from the input
    # first, with every other control character) and closed in one pass, so adjacent
    # removals ("a [x] [y] b") make one joint.
    text = text.translate(_SPACING)
    out: list[str] = []
    position = 0
    for start, end, replacement in _removals(text, frozenset(claimed), private_patterns):
        out.append(text[position:start])
        out.append(replacement)
        position = end
    out.append(text[position:])
    pieces = "".join(out).split(_MARK)
    joined = pieces[0]
    for piece in pieces[1:]:
        joined = _join(joined, piece)
    return joined.strip()


class TextMap:
    """
    Where each character of a cleaned text came from in the text it was cleaned from
    (L{clean_text_mapped}): a kept character from itself, a canonical cue from the
    whole tag it was written as, a space left at a joint from the whitespace it stands
    for.
    """

    __slots__ = ("_starts", "_ends", "_length")

    def __init__(self, starts: Sequence[int], ends: Sequence[int], length: int) -> None:
        self._starts = starts
        self._ends = ends
        self._length = length

    def __len__(self) -> int:
        return len(self._starts)

    def span(self, start: int, end: int) -> tuple[int, int]:
        """
        The source span of the cleaned text's C{[start, end)}, as code-point offsets.
        An empty span maps to the point before the character at C{start}.
        """
        # Clamped with comparisons, not min() and max(): a timed answer maps every word.
        size = len(self._starts)
        start = 0 if start < 0 else size if start > size else start
        end = start if end < start else size if end > size else end
        if start == size:
            point = self._ends[-1] if size else self._length
            return point, point
        if end == start:
            return self._starts[start], self._starts[start]
        return self._starts[start], max(self._ends[end - 1], self._starts[start])


def clean_text_mapped(
    text: str, claimed: Iterable[str], private_patterns: Sequence[str | re.Pattern[str]] = ()
) -> tuple[str, TextMap]:
    """
    L{clean_text}, and where each character of its result came from in C{text}: what a
    worker uses to give timings offsets into the text it was sent, not the text it spoke.
    The cleaned text is always exactly L{clean_text}'s.
    """
    translated = text.translate(_SPACING)
    removals = _removals(translated, frozenset(claimed), private_patterns)
    if not removals and "\x00" not in text:
        # Nothing removed and nothing dropped (the usual text): each character of the
        # result stands where it stood, so the map is two ranges, made in no time.
        cleaned = translated.strip()
        head = len(translated) - len(translated.lstrip())
        return cleaned, TextMap(range(head, head + len(cleaned)), range(head + 1, head + len(cleaned) + 1), len(text))
    # Where each character left by the translation stood (it drops only NUL).
    kept: Sequence[int] = [i for i, ch in enumerate(text) if ch != "\x00"] if "\x00" in text else range(len(text))
    # Each piece between two removals: its text, and each character's source span.
    pieces: list[tuple[list[str], list[int], list[int]]] = [([], [], [])]

    def add(fragment: str, starts: list[int], ends: list[int]) -> None:
        piece = pieces[-1]
        piece[0].append(fragment)
        piece[1].extend(starts)
        piece[2].extend(ends)

    def add_source(start: int, end: int) -> None:
        if end > start:
            origins = kept[start:end]
            if isinstance(origins, range):
                add(translated[start:end], list(origins), list(range(origins.start + 1, origins.stop + 1)))
            else:
                add(translated[start:end], list(origins), [k + 1 for k in origins])

    position = 0
    for start, end, replacement in removals:
        add_source(position, start)
        if replacement == _MARK:
            pieces.append(([], [], []))
        else:
            count = len(replacement)
            add(replacement, [kept[start]] * count, [kept[end - 1] + 1] * count)
        position = end
    add_source(position, len(translated))

    joined = "".join(pieces[0][0])
    starts, ends = pieces[0][1], pieces[0][2]
    for fragments, piece_starts, piece_ends in pieces[1:]:
        right = "".join(fragments)
        keep, skip, space = _joint(joined, right)
        # A space left at a joint stands for the first whitespace it replaced.
        if space:
            origin = (starts[keep], ends[keep]) if keep < len(joined) else (piece_starts[0], piece_ends[0])
        joined = joined[:keep] + (" " if space else "") + right[skip:]
        del starts[keep:], ends[keep:]
        if space:
            starts.append(origin[0])
            ends.append(origin[1])
        starts.extend(piece_starts[skip:])
        ends.extend(piece_ends[skip:])
    head = len(joined) - len(joined.lstrip())
    cleaned = joined.strip()
    tail = head + len(cleaned)
    return cleaned, TextMap(starts[head:tail], ends[head:tail], len(text))


def is_speakable(text: str) -> bool:
    """
    Whether C{text} has anything a reader could say: a letter or a digit of any script.

    Text of nothing but punctuation, symbols, emoji, spaces, zero-width or direction
    marks has no words to read, and is refused as the client's mistake rather than
    handed to an engine that may fail on it.
    """
    return any(unicodedata.category(ch)[0] in "LN" for ch in text)
