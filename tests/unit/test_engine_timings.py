"""
The engines' own timing code, without their libraries: eSpeak NG's events made into
timings with only as much audio held back as the order needs
(engines/espeak/.../_timings.py), and Piper's alignments grouped into phonemes and
words (engines/piper/.../_aligned.py).  Loaded by path: the packages import libraries
that live only in the engines' own virtualenvs.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

from rhapsode_worker import Timing

ENGINES = Path(__file__).resolve().parents[2] / "engines"


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


espeak = _load("espeak_timings_under_test", ENGINES / "espeak/src/rhapsode_engine_espeak/_timings.py")
piper = _load("piper_aligned_under_test", ENGINES / "piper/src/rhapsode_engine_piper/_aligned.py")

RATE = 1000  # one sample a millisecond, so the numbers below read as times
W, P, END = espeak.WORD, espeak.PHONEME, espeak.END


def ev(kind: int, position: int, sample: int, length: int = 0, name: str = "") -> Any:
    return espeak.Event(kind, position, length, sample, name)


# "It was 3:45 pm." as espeak reported it (positions 0-based), in three buffers of 600.
BUFFERS = [
    [ev(W, 0, 0, 2), ev(P, 0, 10, name="ɪ"), ev(P, 0, 100, name="t"), ev(W, 3, 150, 3), ev(P, 3, 150, name="w"),
     ev(P, 3, 220, name="ʌ"), ev(P, 3, 260, name="z"), ev(W, 7, 350, 1), ev(P, 7, 360, name="θ"),
     ev(P, 7, 440, name="ɹ"), ev(P, 7, 500, name="ˈiː")],
    [ev(W, 9, 580, 2), ev(P, 9, 590, name="f"), ev(P, 9, 660, name="ˈɔːɹ"), ev(P, 9, 810, name="ɾ"),
     ev(P, 9, 850, name="i"), ev(W, 10, 910, 2), ev(P, 10, 920, name="f"), ev(P, 10, 1000, name="ˈaɪ"),
     ev(P, 10, 1150, name="v")],
    [ev(W, 12, 1230, 2), ev(P, 12, 1270, name="p"), ev(P, 12, 1300, name="ˌiː"), ev(P, 12, 1360, name=""),
     ev(P, 12, 1420, name="ˈɛ"), ev(P, 12, 1570, name="m"), ev(P, 15, 1700, name=""), ev(P, 15, 1710, name=""),
     ev(END, 14, 1710)],
]


def run(unit: str) -> tuple[list[Any], list[int]]:
    aligner = espeak.Aligner(RATE, unit)
    out: list[Any] = []
    after_first: list[int] = []
    for index, events in enumerate(BUFFERS):
        out.extend(aligner.feed(bytes(2 * 600 if index < 2 else 2 * 510), espeak.raw_events(events)))
        if index == 0:
            after_first = [len(item) // 2 for item in out if isinstance(item, bytes)]
    out.extend(aligner.close())
    return out, after_first


def test_espeak_words_end_at_their_last_sound_and_an_expansion_goes_together() -> None:
    """
    A word ends where its last sound does: before the pauses after it, not at one
    inside it (p.m.); 45 and 5, which share the 5, are handed over one after the other
    with no audio between, so the SDK makes them one entry.
    """
    out, _ = run("word")
    words = [item for item in out if isinstance(item, Timing)]
    assert [(w.text_start, w.text_end, w.start, w.end) for w in words] == [
        (0, 2, 0.0, 0.15), (3, 6, 0.15, 0.35), (7, 8, 0.35, 0.58), (9, 11, 0.58, 0.91),
        (10, 12, 0.91, 1.23), (12, 14, 1.23, 1.7),
    ]
    forty, five = out.index(words[3]), out.index(words[4])
    assert five == forty + 1


def test_espeak_timings_go_before_the_audio_of_their_first_sample_and_first_audio_is_not_held() -> None:
    """
    Each timing comes before the audio holding its first sample; all the audio comes
    out, in order; the first buffer already gives out the audio before the word still
    open (so first audio leaves with it).
    """
    for unit in ("word", "phoneme"):
        out, first = run(unit)
        released = 0
        for item in out:
            if isinstance(item, bytes):
                released += len(item) // 2
            else:
                assert released <= round(item.start * RATE), (unit, item, released)
        assert released == 600 + 600 + 510
        assert sum(first) >= 350  # up to the open word "3", at the least


def test_espeak_phonemes_leave_out_pauses_and_end_where_the_next_sound_begins() -> None:
    """
    Phoneme entries are the named phonemes, each ending where the next event begins;
    the pauses (espeak's unnamed phonemes) are none.
    """
    out, _ = run("phoneme")
    phonemes = [item for item in out if isinstance(item, Timing) and item.unit == "phoneme"]
    assert [p.text for p in phonemes][:3] == ["ɪ", "t", "w"]
    assert "" not in [p.text for p in phonemes]
    iy = next(p for p in phonemes if p.text == "ˌiː")
    assert (iy.start, iy.end) == (1.3, 1.36)
    m = phonemes[-1]
    assert (m.text, m.start, m.end) == ("m", 1.57, 1.7)


def alignments(*pairs: tuple[str, int]) -> list[Any]:
    return [SimpleNamespace(phoneme=symbol, num_samples=samples) for symbol, samples in pairs]


def test_piper_alignments_group_into_words_with_marks_joined() -> None:
    """
    Piper's per-phoneme counts give phonemes (stress joined to the sound after it,
    length to the one before) and words (runs between spaces and punctuation), with no
    offsets, the sentence's first sample where this call's audio had got to.
    """
    sentence = alignments(("^", 1000), ("ð", 500), ("ə", 500), (" ", 300), ("k", 200), ("ˈ", 50), ("ɪ", 450),
                          ("k", 300), (",", 200), ("d", 100), ("ɔ", 100), ("ː", 100), ("ɡ", 200), ("$", 1000))
    made = piper.timings(sentence, 22050, 22050, "phoneme")
    words = [t for t in made if t.unit == "word"]
    assert [(w.text, w.start, w.end) for w in words] == [
        ("ðə", (22050 + 1000) / 22050, (22050 + 2000) / 22050),
        ("kˈɪk", (22050 + 2300) / 22050, (22050 + 3300) / 22050),
        ("dɔːɡ", (22050 + 3500) / 22050, (22050 + 4000) / 22050),
    ]
    assert all(w.text_start is None and w.text_end is None for w in made)
    assert [t.text for t in made if t.unit == "phoneme"] == ["ð", "ə", "k", "ˈɪ", "k", "d", "ɔː", "ɡ"]
    assert [t.unit for t in piper.timings(sentence, 0, 22050, "word")] == ["word"] * 3
