"""
Tests for the incremental cutter (rhapsode_protocol.text): text that arrives in chunks is
cut where its whole text would be, on the long-text splitter's rules, and each piece is
given out as soon as what follows it settles it, not later.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rhapsode_protocol._split import _clauses, _sentences
from rhapsode_protocol.text import GRANULARITIES, TextCutter, cut_text

# The splitter's own fragments (tests/unit/test_split.py), and a few that arrive mid-word.
FRAGMENTS = [
    "alpha", "Beta", "gamma", "Dr.", "Mr.", "e.g.", "etc.", "U.S.", "J.", "No.", "3.14",
    "1,000", "1.000.000", "12:30", "https://example.com/a.b?c=d", "a@b.org", "你好", "今天",
    "。", "！", "？", "，", "、", "।", "؟", "։", "።", "．", "３", ".", "..", "...", "…",
    ",", ";", ":", "?", "!", "?!", "—", "–", '"', "'", "”", "’", "»", "«", ")", "(", "]",
    " ", " ", " ", "  ", "\n", "\n\n", "\n \n", "\t", "\u3000", "\u00a0", "\u2029",
    "x" * 30, "Ünïcödé", "ok", "」", "「", "w", "W",
]

texts = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=3)), max_size=40).map("".join)


def fed(text: str, cuts: list[int], granularity: str) -> tuple[list[str], list[list[str]]]:
    """
    Feed C{text} to a fresh cutter in the chunks that C{cuts} (offsets) make, then flush;
    the pieces in order, and what each feed gave.
    """
    cutter = TextCutter(granularity)
    bounds = sorted({min(max(c, 0), len(text)) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)])]
    each = [cutter.feed(chunk) for chunk in chunks]
    pieces = [piece for given_ in each for piece in given_] + cutter.flush()
    assert cutter.held == 0
    return pieces, each


@settings(max_examples=1500, deadline=None)
@given(text=texts, cuts=st.lists(st.integers(0, 200), max_size=12), granularity=st.sampled_from(GRANULARITIES))
def test_any_chunking_gives_the_pieces_of_the_whole_text(text: str, cuts: list[int], granularity: str) -> None:
    """
    Fed in any chunks and then flushed, a text gives exactly the pieces its whole text
    gives, in order, none repeated or lost.
    """
    assert fed(text, cuts, granularity)[0] == cut_text(text, granularity)


@settings(max_examples=800, deadline=None)
@given(text=texts)
def test_character_by_character_gives_the_pieces_of_the_whole_text(text: str) -> None:
    """
    The finest chunking, one character at a time, agrees with the whole text too, at
    both granularities that cut.
    """
    for granularity in ("sentence", "clause"):
        assert fed(text, list(range(len(text))), granularity)[0] == cut_text(text, granularity)


@settings(max_examples=500, deadline=None)
@given(text=texts)
def test_the_whole_text_is_cut_as_the_splitter_cuts_it(text: str) -> None:
    """
    A whole text's sentences are the splitter's sentences, its clauses the splitter's
    clauses of each, and without cutting it is the text stripped.
    """
    spans = list(_sentences(text))
    assert cut_text(text, "sentence") == [text[s:e] for s, e in spans]
    assert cut_text(text, "clause") == [text[a:b] for s, e in spans for a, b in _clauses(text, s, e)]
    assert cut_text(text, "none") == ([text.strip()] if text.strip() else [])


@pytest.mark.parametrize(
    ("chunks", "expected"),
    [
        # The sentence is given out with the next word's first letter, not before.
        (["Hello there.", " ", "W"], [[], [], ["Hello there."]]),
        (["Hello there. ", "how"], [[], []]),
        (["Hi. ", '"', "Yes"], [[], [], ["Hi."]]),
        (["Dr.", " Smith", " came. ", "Then"], [[], [], [], ["Dr. Smith came."]]),
        (["Wait...", " what?", " No"], [[], [], ["Wait... what?"]]),
        (["He said \"Go.\"", " She"], [[], ['He said "Go."']]),
        (["Pi is 3", ".14 or so. ", "Ok"], [[], [], ["Pi is 3.14 or so."]]),
        # Marks that need no space end a sentence as soon as anything follows them.
        (["你好。", "今天", "很好！", "是"], [[], ["你好。"], [], ["今天很好！"]]),
        (["Line one\n\n", "line two"], [[], ["Line one"]]),
    ],
)
def test_a_sentence_is_given_out_as_soon_as_it_is_settled(chunks: list[str], expected: list[list[str]]) -> None:
    """
    Each feed gives exactly the sentences that the text so far settles: a terminator
    waits for the next word's first letter (lower case continues the sentence), an
    abbreviation or decimal never ends one, and a CJK mark or a blank line needs only
    something after it.
    """
    cutter = TextCutter("sentence")
    assert [cutter.feed(chunk) for chunk in chunks] == expected


def test_clauses_are_given_out_at_commas_as_the_next_word_begins() -> None:
    """
    At clause granularity a comma, semicolon or colon cuts once the next word begins,
    1,000 and 12:30 are not cut, and a CJK comma cuts as soon as anything follows it.
    """
    cutter = TextCutter("clause")
    assert cutter.feed("Well,") == []
    assert cutter.feed(" then") == ["Well,"]
    assert cutter.feed(" it cost 1,000 at 12:30; ") == []
    assert cutter.feed("and") == ["then it cost 1,000 at 12:30;"]
    assert cutter.feed(" so.") == []
    assert cutter.flush() == ["and so."]
    assert cutter.feed("你好，") == []
    assert cutter.feed("世") == ["你好，"]
    assert cutter.flush() == ["世"]


def test_flush_gives_what_is_held_and_the_cutter_starts_again() -> None:
    """
    A flush gives the unfinished sentence as it stands, then the cutter is empty and
    cuts the next text afresh; a flush of nothing gives nothing.
    """
    cutter = TextCutter()
    assert cutter.feed("One. Two") == ["One."]
    assert cutter.held == len("Two")
    assert cutter.feed(" and") == []
    assert cutter.flush() == ["Two and"]
    assert cutter.held == 0 and cutter.flush() == []
    assert cutter.feed("three") == [] and cutter.flush() == ["three"]


def test_without_cutting_everything_waits_for_the_flush() -> None:
    """
    Granularity "none" gives nothing as text arrives and the whole text, stripped, at a
    flush, holding every character meanwhile.
    """
    cutter = TextCutter("none")
    assert cutter.feed(" One. Two. ") == [] and cutter.feed("Three") == []
    assert cutter.held == 16
    assert cutter.flush() == ["One. Two. Three"]


def test_held_counts_only_what_no_piece_gave() -> None:
    """
    At clause granularity a sentence is kept from its start to read its words whole, but
    what its given clauses covered is not counted as held.
    """
    cutter = TextCutter("clause")
    assert cutter.feed("First, second") == ["First,"]
    assert cutter.held == len(" second")


def test_an_unknown_granularity_is_refused() -> None:
    """
    Only none, sentence and clause are granularities.
    """
    with pytest.raises(ValueError):
        TextCutter("word")
    with pytest.raises(ValueError):
        cut_text("Text.", "paragraph")


def test_a_long_stream_a_word_at_a_time_stays_cheap() -> None:
    """
    Text fed a word at a time keeps only the open sentence, so the held text stays
    small however long the stream runs, and every sentence comes out.
    """
    cutter = TextCutter()
    sentence = "The river ran past the mill and the old stone bridge. "
    words = (sentence * 2000).split(" ")
    out: list[str] = []
    most = 0
    for word in words:
        out += cutter.feed(word + " ")
        most = max(most, cutter.held)
    out += cutter.flush()
    assert out == [sentence.strip()] * 2000
    assert most <= len(sentence) + 1
