"""
Tests for the shared long-text splitter (protocol.md section 8, "Long text, and who splits it").

Sentence boundaries are pinned directly on the private sentence scanner, because packing
hides them whenever neighbouring sentences fit together; everything else goes through
L{split_text}.  The property tests state the contract: nothing lost, duplicated or
reordered, every piece within its limit unless it is one word, and no two neighbouring
pieces that could have been one.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rhapsode_protocol._split import _sentences, split_pieces, split_text


def sentences(text: str) -> list[str]:
    """The sentences the splitter sees in C{text}, before any packing."""
    return [text[start:end] for start, end in _sentences(text)]


def locate(text: str, pieces: list[str]) -> list[tuple[int, int]]:
    """
    Where each piece lies in C{text}, asserting that the pieces tile it.

    Each piece must match C{text} starting where the previous piece ended, after nothing
    but whitespace; inside a piece, whitespace stands for a run of whitespace in the text
    and its absence for none.  Only whitespace may follow the last piece.  Together these
    mean no character was lost, duplicated or reordered, and joints were only ever made
    of whitespace.
    """
    spans = []
    position = 0
    for piece in pieces:
        assert piece and piece == piece.strip(), piece
        body = r"\s+".join(re.escape(word) for word in piece.split())
        match = re.compile(r"\s*(" + body + ")").match(text, position)
        assert match is not None, (piece, text[position : position + 80])
        spans.append(match.span(1))
        position = match.end()
    assert text[position:].strip() == "", text[position:]
    return spans


def check(text: str, limit: int, first_limit: int | None = None, growth: int | None = None) -> list[str]:
    """
    Split C{text} and assert every invariant of the contract on the result.
    """
    pieces = split_text(text, limit, first_limit, growth)
    spans = locate(text, pieces)
    assert "".join("".join(p.split()) for p in pieces) == "".join(text.split())
    caps = [limit] * len(pieces)
    if caps and first_limit is not None:
        caps[0] = min(first_limit, limit)
        for i in range(1, len(caps)):
            caps[i] = limit if growth is None else min(limit, caps[i - 1] * growth)
    for piece, cap in zip(pieces, caps):
        assert len(piece) <= cap or not any(c.isspace() for c in piece), (piece, cap)
    for i in range(len(pieces) - 1):
        joint = 1 if spans[i][1] < spans[i + 1][0] else 0
        assert len(pieces[i]) + joint + len(pieces[i + 1]) > caps[i], (pieces[i], pieces[i + 1])
    return pieces


FRAGMENTS = [
    "alpha", "Beta", "gamma", "Dr.", "Mr.", "e.g.", "etc.", "U.S.", "J.", "No.", "3.14",
    "1,000", "1.000.000", "12:30", "https://example.com/a.b?c=d", "a@b.org", "你好", "今天",
    "。", "！", "？", "，", "、", "।", "؟", "։", "።", "．", "３", ".", "..", "...", "…",
    ",", ";", ":", "?", "!", "?!", "—", "–", '"', "'", "”", "’", "»", "«", ")", "(", "]",
    " ", " ", " ", "  ", "\n", "\n\n", "\n \n", "\t", "\u3000", "\u00a0", "\u2029",
    "x" * 30, "Ünïcödé", "ok",
]

texts = st.lists(
    st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=3)), max_size=60
).map("".join)


@settings(max_examples=1000, deadline=None)
@given(
    text=texts,
    limit=st.integers(1, 60),
    first_limit=st.none() | st.integers(1, 60),
    growth=st.none() | st.integers(2, 4),
)
def test_properties_hold_for_arbitrary_text(
    text: str, limit: int, first_limit: int | None, growth: int | None
) -> None:
    """
    For any text and limits, pieces tile the text in order modulo whitespace, respect their
    limits (the first's, and with a growth each later one's at most that many times the
    one before it) unless they are single words, and no two neighbours could have been joined.
    """
    check(text, limit, first_limit, growth)


@settings(max_examples=500, deadline=None)
@given(text=texts, limit=st.integers(1, 60), first_limit=st.none() | st.integers(1, 60))
def test_a_piece_ends_a_sentence_exactly_where_the_scanner_ends_one(
    text: str, limit: int, first_limit: int | None
) -> None:
    """
    A piece says it ends a sentence exactly when its last span ends where one of the
    sentence scanner's sentences ends; the last piece always does.
    """
    ends = {end for _, end in _sentences(text)}
    pieces = split_pieces(text, limit, first_limit)
    for piece in pieces:
        assert piece.ends_sentence == (piece.atoms[-1][1] in ends), (text, piece)
    if pieces:
        assert pieces[-1].ends_sentence


@pytest.mark.parametrize(
    "text, limit, first_limit, expected",
    [
        # The short first segment cuts a sentence between words, then at a clause mark.
        ("The harbour lights came on one by one as the evening ferry pulled away.", 200, 30,
         [False, True]),
        ("Turn on the kitchen lights, please. And the porch too.", 200, 30, [False, True]),
        # Whole sentences, each its own piece.
        ("One. Two. Three.", 6, None, [True, True, True]),
        # A lower-case word after the full stop keeps one sentence, cut between words.
        ("first one. second.", 10, None, [False, True]),
    ],
)
def test_pieces_say_whether_they_end_a_sentence(
    text: str, limit: int, first_limit: int | None, expected: list[bool]
) -> None:
    """
    Pieces cut inside a sentence (at a clause or between words) say so; pieces that end
    one, and the last piece, say that.
    """
    assert [piece.ends_sentence for piece in split_pieces(text, limit, first_limit)] == expected


@settings(max_examples=200, deadline=None)
@given(text=texts)
def test_text_within_the_limit_is_one_piece(text: str) -> None:
    """
    A limit at least the text's length leaves one piece, since packing never grows text.
    """
    assert len(check(text, max(len(text), 1))) == (1 if text.strip() else 0)


def test_no_limit_gives_the_whole_text() -> None:
    """
    An adapter that declares no size gets the whole text, stripped, as one piece.
    """
    text = "  One. Two.\n\nThree, four   and five.  "
    assert split_text(text, None) == ["One. Two.\n\nThree, four   and five."]
    assert split_text(text, None, first_limit=3) == ["One. Two.\n\nThree, four   and five."]


@pytest.mark.parametrize("limit", [None, 1, 50])
def test_empty_text_gives_no_pieces(limit: int | None) -> None:
    """
    Empty and all-whitespace text produce no pieces at all, with or without a limit.
    """
    assert split_text("", limit) == []
    assert split_text(" \n\n\t\u3000 ", limit) == []


@pytest.mark.parametrize(("limit", "first_limit"), [(0, None), (-5, None), (10, 0)])
def test_limits_below_one_are_refused(limit: int, first_limit: int | None) -> None:
    """
    A limit or first limit below one is a programming error and raises ValueError.
    """
    with pytest.raises(ValueError):
        split_text("Some text.", limit, first_limit)


def test_abbreviation_decimal_and_thousands_stay_in_one_sentence() -> None:
    """
    "Dr.", "$3.14" and "1,000" do not end the sentence, which fits 40 characters whole.
    """
    text = "Dr. Smith paid $3.14 for 1,000 apples. Then he left."
    assert check(text, 40) == ["Dr. Smith paid $3.14 for 1,000 apples.", "Then he left."]


def test_short_sentences_are_packed() -> None:
    """
    A run of short sentences becomes one piece, joined by single spaces, across a blank line.
    """
    text = "It rained.  We stayed in.\n\nThe end. Or was it?"
    assert check(text, 100) == ["It rained. We stayed in. The end. Or was it?"]
    assert check(text, 25) == ["It rained. We stayed in.", "The end. Or was it?"]


def test_packing_counts_the_joining_space() -> None:
    """
    Two sentences of 10 and 13 characters pack at exactly 24, the space included, not at 23.
    """
    text = "It rained. We stayed in."
    assert check(text, 24) == [text]
    assert check(text, 23) == ["It rained.", "We stayed in."]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("J. R. R. Tolkien wrote it.", ["J. R. R. Tolkien wrote it."]),
        ("He moved to the U.S. Then he wrote.", ["He moved to the U.S. Then he wrote."]),
        ("Mrs. Jones met Prof. Lee vs. ST. Louis, approx. Fig. 3.", None),
        ("Use tools, e.g. Hammers, i.e. Heavy ones, etc. Done.", None),
        ("Meet at 5 p.m. Bring food.", None),
        ("See No. 5 and Art. 7 now.", None),
        ("The value is 3.14 and 1.000.000 in total.", None),
        ("Mail a.b@example.com or visit https://example.com/x.y. Thanks.",
         ["Mail a.b@example.com or visit https://example.com/x.y.", "Thanks."]),
        ("I said no. Then I left.", ["I said no.", "Then I left."]),
        ('He said "Stop." Then ran.', ['He said "Stop."', "Then ran."]),
        ("(It worked.) Next one.", ["(It worked.)", "Next one."]),
        ("« C'est fini. » Voilà.", ["« C'est fini. »", "Voilà."]),
        ("« C'est fini ! » dit-il.", ["« C'est fini ! » dit-il."]),
        ('Go. " Wait', ['Go. "', "Wait"]),
        ("Why? Because! Fine?! Yes.", ["Why?", "Because!", "Fine?!", "Yes."]),
        ('"Why?" she asked.', ['"Why?" she asked.']),
        ("It was 5. 6 came later.", ["It was 5.", "6 came later."]),
        ("Wait... what?", ["Wait... what?"]),
        ("Wait... What?", ["Wait...", "What?"]),
        ("Wait\u2026 What?", ["Wait\u2026", "What?"]),
        ("Wait...What?", ["Wait...What?"]),
        ("Intro\n\nbody text", ["Intro", "body text"]),
        ("line one\nline two", ["line one\nline two"]),
        ("你好。今天天气很好！我们走吧？", ["你好。", "今天天气很好！", "我们走吧？"]),
        ("他说：「好。」然后走了。", ["他说：「好。」", "然后走了。"]),
        ("数值是３．１４。好．走", ["数值是３．１４。", "好．", "走"]),
        ("राम घर गया। सीता बाज़ार गई॥ अंत", ["राम घर गया।", "सीता बाज़ार गई॥", "अंत"]),
        ("كيف حالك؟ أنا بخير.", ["كيف حالك؟", "أنا بخير."]),
        ("یہ اچھا ہے۔ شکریہ", ["یہ اچھا ہے۔", "شکریہ"]),
        ("Բարեւ։ Ինչպես ես", ["Բարեւ։", "Ինչպես ես"]),
        ("ሰላም። እንዴት ነህ", ["ሰላም።", "እንዴት ነህ"]),
        ("สวัสดีครับ วันนี้อากาศดี", ["สวัสดีครับ วันนี้อากาศดี"]),
    ],
)
def test_sentence_boundaries(text: str, expected: list[str] | None) -> None:
    """
    Sentences end where a reader stops, and not after abbreviations, initials, decimals,
    thousands, URLs, an ellipsis before lower case, or before a closing quote or bracket;
    marks of other scripts end a sentence with or without a following space.  None means
    the text is one sentence.
    """
    assert sentences(text) == (expected if expected is not None else [text])


def test_chinese_splits_into_three_at_a_small_limit() -> None:
    """
    CJK sentences split without spaces after their marks, and pack back without spaces.
    """
    text = "你好。今天天气很好！我们走吧？"
    assert check(text, 7) == ["你好。", "今天天气很好！", "我们走吧？"]
    assert check(text, 10) == ["你好。今天天气很好！", "我们走吧？"]


def test_hindi_splits_at_danda() -> None:
    """
    Devanagari text splits at the danda, which stays with its sentence.
    """
    text = "राम घर गया। सीता बाज़ार गई। वे शाम को मिले।"
    assert check(text, 16) == ["राम घर गया।", "सीता बाज़ार गई।", "वे शाम को मिले।"]


def test_long_sentence_splits_at_clauses() -> None:
    """
    A 500-character sentence is cut only at its commas, each mark staying with the clause
    before it, and the clauses are packed back up to the limit.
    """
    clause = "the river ran past the mill and the old stone bridge"
    text = ", ".join(f"{clause} {i}" for i in range(9)) + ", and then it was night."
    assert len(text) > 500
    pieces = check(text, 120)
    assert len(pieces) > 4
    assert all(p.endswith(",") for p in pieces[:-1])
    assert pieces[-1].endswith("night.")
    assert len(pieces[0]) > 100


@pytest.mark.parametrize(
    ("text", "limit", "expected"),
    [
        ("He paused, then spoke; slowly: like this.", 12,
         ["He paused,", "then spoke;", "slowly:", "like this."]),
        ('"Go," he said, "now."', 12, ['"Go,"', "he said,", '"now."']),
        ("« Oui, » dit-il, « c'est fini. » Voilà.", 16,
         ["« Oui, » dit-il,", "« c'est fini. »", "Voilà."]),
        ("She left\u2014quickly\u2014and was gone.", 16,
         ["She left\u2014", "quickly\u2014", "and was gone."]),
        ('He said\u2014"go"\u2014and went.', 10, ['He said\u2014', '"go"\u2014', "and went."]),
        ("We counted 1,000 and 1,000,000 twice.", 12, ["We counted", "1,000 and", "1,000,000", "twice."]),
        ("Years 1990\u20132000 \u2013 a decade.", 12, ["Years", "1990\u20132000 \u2013", "a decade."]),
        ("我们去公园，然后去商店、超市；最后回家。", 8, ["我们去公园，", "然后去商店、", "超市；最后回家。"]),
        ("Wait... what is going on here?", 10, ["Wait...", "what is", "going on", "here?"]),
    ],
)
def test_clause_boundaries(text: str, limit: int, expected: list[str]) -> None:
    """
    An over-long sentence is cut after clause marks that end a clause (keeping closing
    quotes with it), never inside thousands or a numeric range, then into words.
    """
    assert check(text, limit) == expected


def test_long_url_stays_whole() -> None:
    """
    A word longer than the limit, such as a long URL, is one piece and never cut.
    """
    url = "https://example.com/" + "/".join(["segment"] * 40) + "?q=1.2,3"
    pieces = check(f"See {url} for details.", 50)
    assert pieces == ["See", url, "for details."]


def test_first_limit_applies_to_the_first_piece_only() -> None:
    """
    A smaller first limit cuts the first piece short, and later pieces use the main limit.
    """
    text = "Hello there. This is a longer second sentence. And a third."
    assert check(text, 100) == [text]
    assert check(text, 100, first_limit=12) == [
        "Hello there.",
        "This is a longer second sentence. And a third.",
    ]
    assert check(text, 100, first_limit=8) == [
        "Hello",
        "there. This is a longer second sentence. And a third.",
    ]
    assert split_text(text, 30, first_limit=300) == split_text(text, 30)


def test_pieces_grow_from_the_first_limit() -> None:
    """
    With a growth, each piece after the short first one may hold at most that many times
    the one before it, until the main limit: a slow engine's second piece is made while
    the first plays, rather than the listener waiting on a whole segment after it.
    """
    sentence = "The ferry left the harbour at nine."  # 35 characters
    text = " ".join([sentence] * 12)
    pieces = check(text, 200, first_limit=40, growth=2)
    assert [len(piece) for piece in pieces] == [35, 71, 143, 179]
    # Without a growth the second piece takes the main limit at once.
    assert [len(piece) for piece in check(text, 200, first_limit=40)] == [35, 179, 179, 35]
    # A buffered answer has no first limit, and so no growth.
    assert split_text(text, 200, None, 2) == split_text(text, 200)


def test_a_sentence_cut_for_the_first_piece_goes_on_in_clauses() -> None:
    """
    The sentence the short first piece cuts into words goes on in the pieces after it as
    whole clauses where they fit the larger limits, never cut between two words of one.
    """
    text = ("It was late. The station had emptied hours before, and the last train was long "
            "gone, so she walked home along the river, counting the lamps.")
    assert check(text, 400, first_limit=30, growth=2) == [
        "It was late. The station had",
        "emptied hours before, and the last train was long gone,",
        "so she walked home along the river, counting the lamps.",
    ]
    assert check(text, 60, first_limit=30) == [
        "It was late. The station had",
        "emptied hours before, and the last train was long gone,",
        "so she walked home along the river, counting the lamps.",
    ]
    # Also a sentence that only begins after the first piece, refined while it was open.
    text = ("Late. The station had emptied hours before, and the last train was long gone, "
            "so she walked home along the river.")
    assert check(text, 60, first_limit=6) == [
        "Late.",
        "The station had emptied hours before,",
        "and the last train was long gone,",
        "so she walked home along the river.",
    ]


@pytest.mark.parametrize("growth", [0, 1, -2])
def test_a_growth_under_two_is_refused(growth: int) -> None:
    """
    A growth that would never let the pieces grow is a mistake in the adapter, refused.
    """
    with pytest.raises(ValueError, match="growth"):
        split_text("One. Two.", 10, 4, growth)
    with pytest.raises(ValueError, match="growth"):
        split_pieces("One. Two.", 10, 4, growth)


def test_hundred_kilobyte_text() -> None:
    """
    A 100 kB mixed text splits with every invariant held and every piece within the limit.
    """
    parts = [
        "Dr. Smith paid $3.14 for 1,000 apples, then he left; nobody knew why.",
        "Wait... what? 你好。今天天气很好！",
        "The river ran past the mill, the old stone bridge, the church, the inn, "
        "and the long row of houses that nobody had painted since the war ended.",
        "\n\nA new paragraph begins here \u2014 quietly.",
    ]
    text = " ".join(parts[i % len(parts)] for i in range(1500))
    assert len(text) > 100_000
    pieces = check(text, 200, first_limit=60)
    assert all(len(p) <= 200 for p in pieces)
    assert len(pieces[0]) <= 60


@settings(max_examples=2000, deadline=None)
@given(
    text=st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=2), max_size=12).map("".join),
    limit=st.integers(1, 80),
    first_limit=st.none() | st.integers(1, 80),
)
def test_the_short_text_path_agrees_with_packing(text: str, limit: int, first_limit: int | None) -> None:
    """
    A text short enough for its first piece, whose only whitespace is lone spaces, is
    answered without the general packer; for any text and limits the answer is the one
    the packer gives.
    """
    from rhapsode_protocol._split import _pack

    first = limit if first_limit is None else min(first_limit, limit)
    assert split_text(text, limit, first_limit) == _pack(text, limit, first)


def test_a_short_sentence_takes_the_short_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """
    The short path is taken for one plain sentence (so the agreement test above covers
    it) and not for text holding a tab or a double space.
    """
    from rhapsode_protocol import _split

    calls: list[str] = []
    original = _split._pack

    def counting(text: str, limit: int, first: int, growth: int | None = None) -> list[str]:
        calls.append(text)
        return original(text, limit, first, growth)

    monkeypatch.setattr(_split, "_pack", counting)
    assert split_text("  The ferry pulled away. It was late!  ", 400) == ["The ferry pulled away. It was late!"]
    assert calls == []
    assert split_text("The ferry.\tIt was late.", 400) == ["The ferry. It was late."]
    assert split_text("The ferry.  It was late.", 400) == ["The ferry. It was late."]
    assert len(calls) == 2


def test_split_text_is_public_on_the_sdk() -> None:
    """
    An adapter that keeps its own loop imports the splitter from rhapsode_worker, as
    docs/writing-an-engine.md says: it is the one the SDK splits with, and in __all__.
    """
    import rhapsode_worker
    from rhapsode_protocol import _split

    assert rhapsode_worker.split_text is _split.split_text
    assert "split_text" in rhapsode_worker.__all__
