"""
The shared long-text splitter: where a request's text is broken into segments, one generation each.

protocol.md section 8 ("Long text, and who splits it") fixes the algorithm and leaves the
size to the adapter: split into sentences, a sentence over the limit into clauses, a
clause still over it into words, then pack the pieces back greedily so that a run of short
sentences is one generation.  A word longer than the limit stays whole, because a model
reading two halves of a word is worse than one long generation.

Boundaries, in brief:
  - Latin-style terminators (. ! ? ... and their Unicode kin) end a sentence only when
    followed by whitespace and a word that does not start with a lower-case letter, and a
    single "." not after a known abbreviation or an upper-case initial (J. R. R., U.S.).
    So "Wait... what?" is one sentence, "Wait... What?" two, and decimals, thousands,
    URLs and e-mail addresses, having no whitespace after their dots, are never cut.
  - CJK, Devanagari, Arabic, Armenian, Ethiopic and similar marks end a sentence with or
    without whitespace after them.  A blank line always does.
  - Closing quotes and brackets stay with the sentence or clause they close, also when
    set apart by a space as French sets its guillemets.
  - Clause marks: , ; : and their Arabic forms and the en dash before whitespace; an
    ellipsis or ?/! that did not end a sentence; the em dash and CJK 、，；： anywhere.

Pure Python and free of state: the same text and limits always give the same pieces.  The
incremental cutter of text that arrives in pieces (L{rhapsode_protocol.text}) reads the same
rules through L{_sentence_spans}, L{_clauses} and L{_undecided_from}, so a stream is cut
where its whole text would have been.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from dataclasses import dataclass
from functools import cached_property
from itertools import chain
from typing import Iterable, Iterator

#: Marks that only ever close, and then the straight quotes, which close or open.
_SHUTTERS = "\u201d\u2019\u00bb\u203a)\\]}\u300d\u300f\uff09\u3011\u3015\u3009\u300b"
_CLOSERS = _SHUTTERS + "\"'"
_OPENERS = (
    "\"'\u201c\u2018\u201e\u00ab\u2039([{\u00bf\u00a1\u300c\u300e\uff08\u3010\u3014\u3008\u300a"
)

#: A blank line, possibly holding spaces, or the Unicode paragraph separator.
_PARAGRAPH = re.compile(r"\n[^\S\n]*\n|\u2029")

#: Sentence marks of scripts that need no space after them: CJK (with fullwidth forms;
#: a fullwidth full stop before a digit is a decimal point), Devanagari dandas, Arabic
#: and Urdu, Armenian, Ethiopic, Myanmar, Khmer.
_SCRIPT_END = re.compile(
    "(?:[\u3002\uff01\uff1f\uff61\u0964\u0965\u061f\u06d4\u0589\u1362\u1367\u1368"
    "\u104b\u17d4]|\uff0e(?!\\d))+[" + _CLOSERS + "]*"
)

#: A word with any quotes or brackets that close it standing apart, as French spaces them.
_TOKEN = re.compile(r"\S+(?:\s+[" + _CLOSERS + r"]+(?!\S))*")

#: A character that may end a Latin-style sentence (L{_TERMINAL}'s marks).
_TERMINATOR = re.compile("[.!?\u2026\u203c\u2047\u2048\u2049]")

#: The end of such a token when it may end a Latin-style sentence.
_TERMINAL = re.compile(r"(?P<marks>[.!?\u2026\u203c\u2047\u2048\u2049]+)[\s" + _CLOSERS + "]*$")

#: Clause marks; the first group must be followed by whitespace so that 1,000, 12:30,
#: 1990-2000 ranges and URLs stay whole, the second splits wherever it stands, and there a
#: straight quote is as likely to open the next clause as to close this one.
_CLAUSE = re.compile(
    r"(?:[,;:\u060c\u061b\u2013]|\.{2,}|\u2026|[!?]+)(?:\s*[" + _CLOSERS + r"])*(?=\s)"
    "|[\u2014\u2015\u3001\uff0c\uff1b\uff1a\uff64\ufe50\ufe51\ufe54\ufe55][" + _SHUTTERS + "]*"
)

_WORD = re.compile(r"\S+")

#: Upper-case initials, alone or run together with dots: J, U.S, A.B.C.
_INITIALS = re.compile(r"(?:[^\W\d_]\.)*[^\W\d_]")

#: Abbreviations matched in any case: titles, Latin, references, units of time.
_ABBREVIATIONS = frozenset(
    """mr mrs ms mx dr prof st jr sr rev hon gen col capt lt sgt mt ave blvd vs etc
    e.g i.e a.m p.m approx ca cf al fig figs p pp ed eds esp incl dept est viz
    z.b d.h usw bzw sra srta mme mlle""".split()
)

#: Abbreviations that are also ordinary words in lower case ("no", "mar"), matched exactly.
_ABBREVIATIONS_EXACT = frozenset(
    "No Nos Vol Vols Art Ch Sec Eq Ref Jan Feb Mar Apr Jun Jul Aug Sep Sept Oct Nov Dec".split()
)

Span = tuple[int, int]


def split_text(
    text: str, limit: int | None, first_limit: int | None = None, growth: int | None = None
) -> list[str]:
    """
    Split text where a reader would pause, packing pieces greedily up to C{limit} characters.

    @param limit: the most characters one piece may hold, unless it is a single word;
        L{None} means the adapter declared no size and gets the whole text as one piece.
    @param first_limit: when smaller than C{limit}, the limit for the first piece only, so
        that first audio leaves sooner on slow engines.
    @param growth: with C{first_limit}, each later piece's limit is at most this many
        times the one before it (up to C{limit}) rather than C{limit} at once, so that on
        an engine slower than a few times realtime each piece is made while the one
        before it plays.  L{None}: C{limit} from the second piece.
    @return: the pieces in order, each stripped and non-empty.  Pieces that were separated
        by whitespace in C{text} are joined by one space when packed, and ones that were
        not (CJK sentences) are joined directly.
    @raise ValueError: if a limit is given that is less than one, or a growth less than two.
    """
    if limit is None:
        whole = text.strip()
        return [whole] if whole else []
    _check(limit, first_limit, growth)
    first = limit if first_limit is None else min(first_limit, limit)
    whole = text.strip()
    if len(whole) <= first and _plainly_spaced(whole):
        # The common request, one short utterance: packing would give it back whole,
        # because every gap it could cut at is already a single space.
        return [whole] if whole else []
    return _pack(text, limit, first, growth)


def _check(limit: int, first_limit: int | None, growth: int | None) -> None:
    if limit < 1 or (first_limit is not None and first_limit < 1):
        raise ValueError(f"limits must be at least 1, not {limit!r} and {first_limit!r}")
    if growth is not None and growth < 2:
        raise ValueError(f"growth must be at least 2, not {growth!r}")


def piece_limits(limit: int, first: int, growth: int | None = None) -> Iterator[int]:
    """
    The limit of each piece in turn: C{first}, then C{limit}, or with C{growth} each
    at most C{growth} times the one before until C{limit}.
    """
    cap = min(first, limit)
    while True:
        yield cap
        cap = limit if growth is None else min(limit, cap * growth)


@dataclass(frozen=True)
class Piece:
    """
    One piece of L{split_pieces}: its text, and the spans of the source text it was
    packed from, in order; where two were apart in the source one space joins them.
    C{ends_sentence} is false where the piece stops inside a sentence: one cut at a
    clause or between words, to fit the limit or the shorter first one.
    """

    text: str
    atoms: tuple[Span, ...]
    ends_sentence: bool = True

    def source(self, start: int, end: int) -> Span:
        """
        The span of the source text that the piece's C{[start, end)} was taken from; a
        span that begins or ends on a joining space is taken to the atom beside it.
        """
        begin = self._at(start, False)
        return begin, max(self._at(end, True), begin)

    @cached_property
    def _layout(self) -> tuple[list[int], list[int], list[int]]:
        """
        Where each atom begins in the piece, and its span in the source.
        """
        offsets: list[int] = []
        position = 0
        previous_end = self.atoms[0][0]
        for index, (a_start, a_end) in enumerate(self.atoms):
            if index and a_start > previous_end:
                position += 1  # the joining space
            offsets.append(position)
            position += a_end - a_start
            previous_end = a_end
        return offsets, [a for a, _ in self.atoms], [b for _, b in self.atoms]

    def _at(self, offset: int, closing: bool) -> int:
        offsets, starts, ends = self._layout
        # The atom holding the offset (an end offset is held by the atom it closes).
        index = bisect_right(offsets, offset - 1 if closing else offset) - 1
        if index < 0:
            index = 0
        inside = offset - offsets[index]
        size = ends[index] - starts[index]
        if inside <= size if closing else inside < size:
            return starts[index] + inside
        if index + 1 < len(offsets):
            # On the space joining this atom to the next.
            return ends[index] if closing else starts[index + 1]
        return ends[index]


def split_pieces(
    text: str, limit: int | None, first_limit: int | None = None, growth: int | None = None
) -> list[Piece]:
    """
    L{split_text}'s pieces, each with the spans of C{text} it holds, so that an offset
    into a piece can be taken back to C{text} (L{Piece.source}).

    @raise ValueError: if a limit is given that is less than one, or a growth less than two.
    """
    if limit is not None:
        _check(limit, first_limit, growth)
    whole = text.strip()
    if not whole:
        return []
    if limit is None or (len(whole) <= (limit if first_limit is None else min(first_limit, limit))
                         and _plainly_spaced(whole)):
        # The short path, as split_text takes it.
        start = len(text) - len(text.lstrip())
        return [Piece(whole, ((start, start + len(whole)),))]
    first = limit if first_limit is None else min(first_limit, limit)
    return _pack_pieces(text, limit, first, growth)


def _plainly_spaced(text: str) -> bool:
    """
    Whether every whitespace character in C{text} is a lone ASCII space (packing turns
    any other gap between sentences into one).
    """
    return text.isprintable() and "  " not in text


def _pack(text: str, limit: int, first: int, growth: int | None = None) -> list[str]:
    """
    L{split_text} in general: the sentences, refined to fit, packed greedily.
    """
    return [piece.text for piece in _pack_pieces(text, limit, first, growth)]


def _pack_pieces(text: str, limit: int, first: int, growth: int | None = None) -> list[Piece]:
    """
    L{_pack}, each piece with the spans it was packed from.
    """
    caps = piece_limits(limit, first, growth)
    cap = next(caps)
    pieces: list[Piece] = []
    parts: list[str] = []
    atoms: list[Span] = []
    size = 0
    last_end = 0
    closed = True  # whether the last atom packed ended its sentence
    for sentence in _sentences(text):
        spans = list(_refine(text, sentence, cap))
        index = 0
        while index < len(spans):
            start, end = spans[index]
            atom = text[start:end]
            joint = " " if parts and start > last_end else ""
            if parts and size + len(joint) + len(atom) > cap:
                pieces.append(Piece("".join(parts), tuple(atoms), closed))
                parts, atoms, size, joint = [], [], 0, ""
                smaller, cap = cap, next(caps)
                if cap > smaller:
                    # The rest of the sentence, refined for the smaller cap, refined afresh
                    # for this one: whole clauses where the smaller had cut it into words.
                    spans[index:] = _refine(text, (start, sentence[1]), cap)
                    start, end = spans[index]
                    atom = text[start:end]
            parts.append(joint + atom)
            atoms.append((start, end))
            size += len(joint) + len(atom)
            last_end = end
            closed = end == sentence[1]
            index += 1
    if parts:
        pieces.append(Piece("".join(parts), tuple(atoms), closed))
    return pieces


def _refine(text: str, sentence: Span, cap: int) -> Iterator[Span]:
    """
    The sentence whole if it fits in C{cap}, otherwise its clauses, and the words of any
    clause that still does not fit.
    """
    start, end = sentence
    if end - start <= cap:
        yield sentence
        return
    for c_start, c_end in _clauses(text, start, end):
        if c_end - c_start <= cap:
            yield c_start, c_end
        else:
            yield from (m.span() for m in _WORD.finditer(text, c_start, c_end))


def _sentences(text: str) -> Iterator[Span]:
    """
    Sentence spans of C{text}, stripped and in order: paragraphs, then the marks that need
    no space, then Latin-style terminators.
    """
    for start, end, _ in _sentence_spans(text):
        yield start, end


def _sentence_spans(text: str) -> Iterator[tuple[int, int, bool]]:
    """
    L{_sentences}, each span with whether a blank line or a mark that needs no space ends
    it (true also of the last), rather than a Latin-style terminator.  Such an end is
    settled as soon as anything follows it; a terminator's waits on the next word.
    """
    paragraphs = (m.end() for m in _PARAGRAPH.finditer(text))
    for p_start, p_end in _spans(text, 0, len(text), paragraphs):
        marks = (m.end() for m in _SCRIPT_END.finditer(text, p_start, p_end))
        for s_start, s_end in _spans(text, p_start, p_end, marks):
            cuts = _terminator_cuts(text, s_start, s_end)
            last: Span | None = None
            for span in _spans(text, s_start, s_end, cuts):
                if last is not None:
                    yield last[0], last[1], False
                last = span
            if last is not None:
                yield last[0], last[1], True


def _terminator_cuts(text: str, start: int, end: int) -> list[int]:
    """
    Where Latin-style terminators end sentences in C{text[start:end]}: after each token
    that L{_ends_sentence} says ends one, given the token after it.  Only a token that
    holds a terminator can, so only those are asked: a few in a sentence, where asking
    every token cost most of the time a long text took to split.
    """
    marks = [m.start() for m in _TERMINATOR.finditer(text, start, end)]
    if not marks:
        return []
    tokens = list(_TOKEN.finditer(text, start, end))
    ends = [token.end() for token in tokens]
    cuts: list[int] = []
    last = -1
    for mark in marks:
        # Every character but whitespace is in a token: the first one ending after it.
        index = bisect_right(ends, mark)
        if index == last or index + 1 >= len(tokens):
            continue
        last = index
        if _ends_sentence(tokens[index].group(), tokens[index + 1].group()):
            cuts.append(ends[index])
    return cuts


def _clauses(text: str, start: int, end: int) -> Iterator[Span]:
    """
    The clause spans of the sentence C{text[start:end]}, stripped and in order.
    """
    cuts = (m.end() for m in _CLAUSE.finditer(text, start, end))
    return _spans(text, start, end, cuts)


#: Quotes and brackets: a word made only of them does not yet say how a sentence ends.
_FRAMING = frozenset(_OPENERS + _CLOSERS)


def _undecided_from(text: str) -> int:
    """
    Where text that may still grow stops deciding its own boundaries: the start of its
    last whitespace-delimited word holding something besides quotes and brackets, or -1
    when it holds no such word.

    A boundary before that word is settled whatever is appended: a terminator's cut
    depends on the word that follows it, and that word has already begun with its
    first letter (or is complete), so neither a lower-case start nor a lone closing
    quote, which would join the sentence before, can still arrive in its place.
    """
    at = len(text) - 1
    while at >= 0 and (text[at].isspace() or text[at] in _FRAMING):
        at -= 1
    if at < 0:
        return -1
    while at > 0 and not text[at - 1].isspace():
        at -= 1
    return at


def _ends_sentence(token: str, following: str) -> bool:
    """
    Whether a sentence ends after C{token}, given the whitespace-delimited C{following} one.
    """
    match = _TERMINAL.search(token)
    if match is None:
        return False
    start = following.lstrip(_OPENERS)[:1]
    if start.islower():
        return False
    if match.group("marks") != ".":
        return True
    word = token[: match.start()].lstrip(_OPENERS)
    if word in _ABBREVIATIONS_EXACT or word.lower() in _ABBREVIATIONS:
        return False
    return not (_INITIALS.fullmatch(word) and word.isupper())


def _spans(text: str, start: int, end: int, cuts: Iterable[int]) -> Iterator[Span]:
    """
    The stripped, non-empty spans of C{text[start:end]} between ascending cut offsets.
    """
    for cut in chain(cuts, (end,)):
        left, right = start, cut
        while left < right and text[left].isspace():
            left += 1
        while right > left and text[right - 1].isspace():
            right -= 1
        if left < right:
            yield left, right
        start = cut
