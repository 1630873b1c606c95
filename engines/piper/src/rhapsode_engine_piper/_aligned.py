"""
Piper's alignments as timings: how many samples of a sentence's audio each of its
phonemes took, which the voice's graph computes anyway (its ceiled durations, the
C{Ceil} tensor) and which piper-tts 1.8 reads once the graph names that tensor an output
(C{piper.patch_voice_with_alignment}, with the C{onnx} package).

The graph is patched once per voice file and kept in the worker's cache folder, so a
load reads a graph as it would the shipped one (patching it in memory at every load
would parse and write 60 MB each time), and every run returns the counts: a request that
asks for no timings simply leaves them unread.

The counts come per phoneme id, times the hop (256 samples), and add up to the
sentence's audio.  Words are runs of phonemes between Piper's spaces and punctuation:
Piper knows their phonemes, not where they stand in the text, so a word's text is its
phonemes and it carries no offsets.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from importlib.metadata import version
from pathlib import Path
from typing import Any, Iterable, Sequence

from rhapsode_worker import Timing

#: Whether the graph can be patched here: the onnx package is installed.
ALIGNABLE = importlib.util.find_spec("onnx") is not None

#: Piper's sentence markers and the pad (piper.const), which time nothing of a word.
_MARKERS = frozenset("^$_")
#: Marks that lean on a neighbour: stress on the sound after it, length and the
#: syllabic and non-syllabic diacritics on the sound before.
_BEFORE = frozenset("ˈˌ")
_AFTER = frozenset("ːˑʲʰʷ\u0329\u032f\u0303")


def aligned_model(model: Path, cache: Path) -> Path:
    """
    The voice's graph with its alignments exposed, made in C{cache} the first time
    (whole or not at all) and named after the file it was made from.

    Blocking (a load calls it, on the synthesis thread).
    """
    stat = model.stat()
    # The installed version, not the module's: importing onnx takes about a second,
    # which a load from a made graph (every load but the first) need not pay.
    key = f"{model.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0{version('onnx')}"
    target = cache / "aligned" / f"{model.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.onnx"
    if target.is_file():
        return target
    import onnx
    from piper.patch_voice_with_alignment import add_alignment_output

    target.parent.mkdir(parents=True, exist_ok=True)
    graph = onnx.load(str(model))
    add_alignment_output(graph)
    partial = target.with_name(f".{target.name}.{os.getpid()}")
    try:
        onnx.save(graph, str(partial))
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def _sounds(alignments: Iterable[Any]) -> list[tuple[str, int, int]]:
    """
    Each alignment as (symbol, its first sample, its samples), from the sentence's start.
    """
    found = []
    at = 0
    for alignment in alignments:
        samples = int(alignment.num_samples)
        found.append((str(alignment.phoneme), at, samples))
        at += samples
    return found


def _segments(sounds: Sequence[tuple[str, int, int]]) -> list[list[tuple[str, int, int]]]:
    """
    The sounds grouped into words (lists of phonemes), stress and length marks joined
    to the phoneme they mark.
    """
    words: list[list[tuple[str, int, int]]] = []
    current: list[tuple[str, int, int]] = []
    leaning: tuple[str, int, int] | None = None  # a stress mark waiting for its sound
    for symbol, start, samples in sounds:
        if symbol in _MARKERS or not symbol.strip() or not (symbol.isalpha() or symbol in _BEFORE or symbol in _AFTER):
            # A space, a marker or punctuation: the word, if any, is over.
            if current:
                words.append(current)
            current, leaning = [], None
            continue
        if symbol in _BEFORE:
            leaning = (symbol, start, samples) if leaning is None else (leaning[0] + symbol, leaning[1], leaning[2] + samples)
            continue
        if symbol in _AFTER and current:
            last = current[-1]
            current[-1] = (last[0] + symbol, last[1], last[2] + samples)
            continue
        if leaning is not None:
            symbol, start, samples = leaning[0] + symbol, leaning[1], leaning[2] + samples
            leaning = None
        current.append((symbol, start, samples))
    if current:
        words.append(current)
    return words


def timings(alignments: Iterable[Any], offset: int, rate: int, unit: str) -> list[Timing]:
    """
    One sentence's timings, its first sample C{offset} samples into this call's audio:
    its words, and for C{unit} phoneme each word's phonemes after it.
    """
    made: list[Timing] = []
    for word in _segments(_sounds(alignments)):
        start = offset + word[0][1]
        end = offset + word[-1][1] + word[-1][2]
        made.append(Timing("word", start / rate, end / rate, text="".join(symbol for symbol, _, _ in word)))
        if unit == "phoneme":
            made.extend(
                Timing("phoneme", (offset + at) / rate, (offset + at + samples) / rate, text=symbol)
                for symbol, at, samples in word
            )
    return made
