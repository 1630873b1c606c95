"""
What timings are mapped back through (protocol.md section 4, "timestamps"): the cleaning
that strips tags (rhapsode_protocol.vocab.clean_text_mapped) and the splitting into
segments (rhapsode_protocol.text.split_pieces), and the SDK's Timeline, which offsets an
adapter's timings by the segments and pauses before them, takes their offsets back to
the caller's text, merges the words of one stretch of text and keeps each unit in order.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rhapsode_protocol.text import split_pieces, split_text
from rhapsode_protocol.vocab import clean_text, clean_text_mapped
from rhapsode_worker import Timing
from rhapsode_worker._timing import Source, Timeline

PRIVATE = (r"<[a-z]+>",)
CUES = ("laugh", "sigh")

_ATOMS = st.sampled_from(
    ["a", "b", "word", " ", "  ", "\t", "\n", ".", ",", "(", ")", '"', "'", "[laugh]", "[Sigh ]", "[x]",
     "[not a cue]", "<tag>", "\x00", "\x01", "\x0d", "é", "你好", "3:45"]
)
_TEXTS = st.lists(_ATOMS, max_size=40).map("".join)


@settings(max_examples=400, deadline=None)
@given(_TEXTS)
def test_mapped_cleaning_is_the_cleaning_and_each_character_knows_its_source(text: str) -> None:
    """
    clean_text_mapped gives exactly clean_text's result, and each character of it comes
    from the caller's text: a kept character from itself, a cue from the whole tag it
    was written as, a joint's space from whitespace.
    """
    cleaned, origins = clean_text_mapped(text, CUES, PRIVATE)
    assert cleaned == clean_text(text, CUES, PRIVATE)
    assert len(origins) == len(cleaned)
    for index, character in enumerate(cleaned):
        start, end = origins.span(index, index + 1)
        source = text[start:end]
        if end - start == 1 and source == character:
            continue
        if character == " " or character.isspace():
            assert source.isspace(), (text, index, source)
        else:
            assert source.startswith("[") and source.endswith("]"), (text, index, source)


def test_a_text_with_nothing_to_remove_maps_each_character_to_where_it_stood() -> None:
    """
    A text with no tag and no dropped character (the usual one) keeps every character
    where it was, less the whitespace stripped from its start: each character's span is
    itself in the caller's text, and the spans at and past the end point after the last
    character kept.
    """
    text = "\n  Hello there,\tworld.\nBye!  \n"
    cleaned, origins = clean_text_mapped(text, CUES, PRIVATE)
    assert cleaned == text.strip()
    assert len(origins) == len(cleaned)
    head = text.index("H")
    for index in range(len(cleaned)):
        assert origins.span(index, index + 1) == (head + index, head + index + 1)
    at = cleaned.index("world.")
    assert text[slice(*origins.span(at, at + 6))] == "world."
    last = text.index("!") + 1
    assert origins.span(len(cleaned), len(cleaned) + 3) == (last, last)
    assert origins.span(3, 3) == (head + 3, head + 3)
    assert origins.span(5, 2) == (head + 5, head + 5)


def test_a_word_after_removed_tags_maps_to_where_the_caller_wrote_it() -> None:
    """
    Offsets past stripped tags, control characters and collapsed spaces land on the
    caller's own characters.
    """
    text = "  Hello [x] [y]\x01 there [laugh] friend."
    cleaned, origins = clean_text_mapped(text, CUES)
    assert cleaned == "Hello there [laugh] friend."
    start = cleaned.index("friend")
    s, e = origins.span(start, start + len("friend"))
    assert text[s:e] == "friend"
    cue = cleaned.index("[laugh]")
    assert text[slice(*origins.span(cue, cue + 7))] == "[laugh]"


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(["The ferry.", "It was late!", "3:45 pm,", "  ", "\n\n", "Mr. Smith", "你好。", "word"]),
             min_size=1, max_size=30).map(" ".join),
    st.integers(min_value=1, max_value=60),
    st.one_of(st.none(), st.integers(min_value=1, max_value=30)),
)
def test_pieces_are_the_splitters_and_map_back_to_the_text(text: str, limit: int, first: int | None) -> None:
    """
    split_pieces gives split_text's pieces, and each character of a piece but a joining
    space maps back to the same character of the text it was split from.
    """
    pieces = split_pieces(text, limit, first)
    assert [piece.text for piece in pieces] == split_text(text, limit, first)
    for piece in pieces:
        for index, character in enumerate(piece.text):
            start, end = piece.source(index, index + 1)
            if text[start:end] != character:
                assert character == " ", (text, piece, index)


def _source(text: str, limit: int | None = None) -> list[Source]:
    cleaned, origins = clean_text_mapped(text, CUES)
    return [Source(text, origins, piece) for piece in split_pieces(cleaned, limit)]


def test_timings_are_offset_by_the_steps_before_and_mapped_to_the_callers_text() -> None:
    """
    A second segment's timings start where the answer's audio had got to when it began
    (its segments and joints), and its offsets, into the segment, become offsets into
    the caller's text; each word's text is then the caller's at them.
    """
    text = "First part here.  [x] Second  part there."
    sources = _source(text, 20)
    assert [source.piece.text for source in sources if source.piece] == ["First part here.", "Second  part there."]
    timeline = Timeline("word", 1000, True, steps=sources)
    first = timeline.take([Timing("word", 0.0, 0.2, text_start=0, text_end=5)])
    timeline.step(1, 2500)  # 2.5 s of audio (the first segment and a joint) before it
    second = timeline.take([Timing("word", 0.1, 0.4, text_start=8, text_end=12)])
    assert first == [{"unit": "word", "text": "First", "start": 0.0, "end": 0.2, "textStart": 0, "textEnd": 5}]
    (entry,) = second
    assert (entry["start"], entry["end"]) == (2.6, 2.9)
    assert text[entry["textStart"]:entry["textEnd"]] == entry["text"] == "part"
    assert entry["textStart"] == text.index("part there")


def test_words_spoken_for_one_stretch_of_text_are_merged() -> None:
    """
    eSpeak reads "3:45" as words at 3, 45 and "5 ": those overlapping are one entry from
    the first's start to the last's end, whitespace trimmed, phonemes between or not.
    """
    text = "It was 3:45 pm."
    timeline = Timeline("phoneme", 1000, True, steps=_source(text))
    made = timeline.take([
        Timing("word", 1.0, 1.2, text_start=7, text_end=8),
        Timing("word", 1.2, 1.5, text_start=9, text_end=11),
        Timing("phoneme", 1.2, 1.5, text="fɔːɹɾi"),
        Timing("word", 1.5, 1.8, text_start=10, text_end=12),
        Timing("phoneme", 1.5, 1.8, text="faɪv"),
    ])
    words = [entry for entry in made if entry["unit"] == "word"]
    assert words == [
        {"unit": "word", "text": "3", "start": 1.0, "end": 1.2, "textStart": 7, "textEnd": 8},
        {"unit": "word", "text": "45", "start": 1.2, "end": 1.8, "textStart": 9, "textEnd": 11},
    ]
    assert [entry["text"] for entry in made if entry["unit"] == "phoneme"] == ["fɔːɹɾi", "faɪv"]


def test_a_word_overlapping_one_already_sent_is_dropped_and_units_stay_in_order() -> None:
    """
    An expansion handed over apart cannot change what went out: the late word is left
    out.  Entries of one unit never overlap in time.
    """
    timeline = Timeline("word", 1000, True, steps=_source("It was 3:45 pm."))
    timeline.take([Timing("word", 1.2, 1.5, text_start=9, text_end=11)])
    assert timeline.take([Timing("word", 1.5, 1.8, text_start=10, text_end=12)]) == []
    (late,) = timeline.take([Timing("word", 1.4, 2.0, text_start=12, text_end=14)])
    assert (late["start"], late["end"], late["text"]) == (1.5, 2.0, "pm")


def test_word_timings_keep_words_and_drop_phonemes_and_offsets_are_only_claimed_ones() -> None:
    """
    A request for words gets no phonemes; a variant that claims no offsets writes none,
    whatever its adapter says, and a word's text is then what the adapter read.
    """
    timeline = Timeline("word", 1000, False, steps=_source("Hi there."))
    made = timeline.take([
        Timing("word", 0.0, 0.1, text="haɪ", text_start=0, text_end=2),
        Timing("phoneme", 0.0, 0.05, text="h"),
    ])
    assert made == [{"unit": "word", "text": "haɪ", "start": 0.0, "end": 0.1}]


def test_a_dialogues_timings_name_their_turn_and_speaker() -> None:
    """
    In a dialogue each timing's offsets are into its own turn's text, and it carries the
    turn's index and speaker; one that names no turn is left out.
    """
    turns = []
    for speaker, text in (("ann", "Hello there."), ("bob", "[x] Hi.")):
        cleaned, origins = clean_text_mapped(text, ())
        turns.append(Source(text, origins, speaker=speaker))
    timeline = Timeline("word", 1000, True, turns=turns)
    made = timeline.take([
        Timing("word", 0.0, 0.3, text_start=0, text_end=5, turn=0),
        Timing("word", 0.8, 1.0, text_start=0, text_end=2, turn=1),
        Timing("word", 1.0, 1.1, text_start=0, text_end=2),
    ])
    assert made == [
        {"unit": "word", "text": "Hello", "start": 0.0, "end": 0.3, "turn": 0, "speaker": "ann",
         "textStart": 0, "textEnd": 5},
        {"unit": "word", "text": "Hi", "start": 0.8, "end": 1.0, "turn": 1, "speaker": "bob",
         "textStart": 4, "textEnd": 6},
    ]
