"""
Tests for the tone engine's adapter, called directly and under the worker's real routes
and scheduler in memory (rhapsode_worker.testing): what it claims it performs, audibly.

"Audibly" is measured: durations, levels and dominant frequencies of the PCM it yields,
estimated here independently of the engine's own code.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
import struct
import subprocess
import sys
import tracemalloc
import wave
from array import array
from operator import mul
from pathlib import Path
from typing import Callable, Iterable

import pytest
from zope.interface.verify import verifyObject

from rhapsode_protocol import contract

from rhapsode_engine_tone import ToneEngine
from rhapsode_engine_tone._pitch import estimate
from rhapsode_worker import (
    ALL_CUES,
    BadRequest,
    DialogueRequest,
    IEngine,
    Reference,
    SpeakRequest,
    Turn,
    UnknownVoice,
    Unsupported,
    WorkerContext,
)
from rhapsode_worker.testing import WorkerHarness

RATE = 24000
SENTENCE = (
    "Rhapsode reads this sentence aloud as a string of tones, one per syllable,"
    " with pauses after commas."
)


def _engine(tmp_path: Path, variant: str | None = "expressive") -> ToneEngine:
    engine = ToneEngine(WorkerContext(voice_dir=tmp_path / "voices", cache_dir=tmp_path / "cache"))
    if variant is not None:
        engine.load(variant)
    return engine


@pytest.fixture
def expressive(tmp_path: Path) -> ToneEngine:
    return _engine(tmp_path, "expressive")


@pytest.fixture
def classic(tmp_path: Path) -> ToneEngine:
    return _engine(tmp_path, "classic")


def _speak(engine: ToneEngine, variant: str, text: str, **fields: object) -> bytes:
    """
    Everything C{speak} yields, with the dials filled in as the SDK fills them.
    """
    if variant == "classic":
        dials = {"pitch": 1.0, "rate": 1.0}
        dials.update(fields.get("params", {}))  # type: ignore[call-overload]
        fields["params"] = dials
    request = SpeakRequest(text=text, variant=variant, **fields)  # type: ignore[arg-type]
    return b"".join(engine.speak(request))


def _samples(pcm: bytes) -> array[int]:
    values = array("h")
    values.frombytes(pcm)
    if sys.byteorder == "big":
        values.byteswap()
    return values


def _seconds(pcm: bytes) -> float:
    return len(pcm) / (2 * RATE)


def _rms(pcm: bytes) -> float:
    values = _samples(pcm)
    return math.sqrt(sum(v * v for v in values) / max(1, len(values)))


def _dominant_hz(pcm: bytes) -> float:
    """
    The median, over the louder 40 ms frames, of the frequency of the first
    autocorrelation peak close to the best, on the signal decimated to 8 kHz.
    """
    values = _samples(pcm)
    x = [a + b + c for a, b, c in zip(values[0::3], values[1::3], values[2::3])]
    rate, width = RATE / 3, 320
    lags = range(8, 161)  # 50 .. 1000 Hz
    starts = range(0, len(x) - width - lags[-1], width)
    energies = [sum(v * v for v in x[s : s + width]) for s in starts]
    loud = max(energies)
    estimates = []
    for start, energy in zip(starts, energies):
        if energy < 0.3 * loud:
            continue
        frame = x[start : start + width]
        scores = []
        for lag in lags:
            other = x[start + lag : start + lag + width]
            norm = math.sqrt(energy * sum(v * v for v in other)) or 1.0
            scores.append(sum(map(mul, frame, other)) / norm)
        best = max(scores)
        peaks = [
            i
            for i in range(1, len(scores) - 1)
            if scores[i] >= 0.9 * best and scores[i - 1] <= scores[i] >= scores[i + 1]
        ]
        # A frame straddling two syllables has no clear period; it is left out.
        if best > 0.6 and peaks:
            estimates.append(rate / lags[peaks[0]])
    estimates.sort()
    return estimates[len(estimates) // 2]


def _turns(pcm: bytes, gap_seconds: float = 0.2) -> list[bytes]:
    """
    The stretches of sound between runs of digital silence at least C{gap_seconds} long.
    """
    values = _samples(pcm)
    gap = round(gap_seconds * RATE)
    parts: list[bytes] = []
    start = zeros = 0
    for i, v in enumerate(values):
        if v:
            if zeros >= gap and i - zeros > start:
                parts.append(values[start : i - zeros].tobytes())
                start = i
            elif zeros >= gap:
                start = i
            zeros = 0
        else:
            zeros += 1
    parts.append(values[start : len(values) - zeros].tobytes())
    return [p for p in parts if p]


def _clip(
    pitch: float, rate: int = 16000, channels: int = 1, seconds: float = 2.0, width: int = 2
) -> bytes:
    """
    A synthetic voiced WAV: five harmonics falling as 1/h, pulsing three times a second.
    """
    frames = array("h")
    for i in range(int(rate * seconds)):
        t = i / rate
        pulse = 0.5 + 0.5 * math.sin(2 * math.pi * 3 * t)
        voiced = sum(math.sin(2 * math.pi * pitch * h * t) / h for h in range(1, 6))
        value = int(9000 * pulse * voiced)
        frames.extend([value] * channels)
    if sys.byteorder == "big":
        frames.byteswap()
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(frames.tobytes() if width == 2 else bytes(len(frames)))
    return out.getvalue()


def _wav(name: str, data: bytes) -> Reference:
    return Reference(filename=name, extension=name.rsplit(".", 1)[-1], data=data)


def _pairwise_distinct(renderings: Iterable[bytes]) -> bool:
    digests = [hashlib.sha256(r).digest() for r in renderings]
    return len(set(digests)) == len(digests)


# -- the adapter's declarations ------------------------------------------------------------


def test_implements_the_engine_interface(tmp_path: Path) -> None:
    """ToneEngine provides IEngine, with the identity and limits the brief fixes."""
    engine = ToneEngine()
    assert verifyObject(IEngine, engine)
    assert (engine.id, engine.display_name) == ("tone", "Tone")
    # No weights: it names the licence of what it speaks from, its own MIT tables.
    assert engine.license.code == "MIT" and engine.license.weights == "MIT"
    assert engine.license.weights_commercial_use is True
    assert "no weights" in engine.license.notes
    assert engine.native_format.sample_rate == RATE and engine.native_format.channels == 1
    assert (engine.adapter_version, engine.upstream_version) == ("0.1.0", None)
    assert engine.max_characters == 4096
    assert (engine.segment_characters, engine.first_segment_characters) == (200, 60)
    assert engine.joint_silence_ms == 120
    assert tuple(engine.reference_formats) == ("wav",)


def test_variants_split_cues_from_deliveries_and_dials() -> None:
    """expressive performs the eight cues only; classic has deliveries, dials and dialogue."""
    variants = ToneEngine().variants()
    assert ToneEngine.default_variant == "expressive"
    expressive, classic = variants["expressive"], variants["classic"]
    assert expressive.cues == ALL_CUES and not expressive.deliveries and not expressive.dials
    assert expressive.max_speakers == 0 and expressive.seed_reproducible
    assert classic.cues == () and classic.deliveries == ("hushed", "frantic")
    assert {k: (d.min, d.max, d.default) for k, d in classic.dials.items()} == {
        "pitch": (0.5, 2.0, 1.0),
        "rate": (0.5, 2.0, 1.0),
    }
    assert classic.max_speakers == 2 and classic.seed_reproducible
    for variant in (expressive, classic):
        assert variant.languages == ("en", "fr", "de", "es", "ja")


def test_private_tags_match_the_engines_own_syntax() -> None:
    """The declared private tag pattern catches <beep>, so the SDK strips it before speak."""
    assert any(re.fullmatch(p, "<beep>") for p in ToneEngine.private_tag_patterns)


def test_builtin_voices_are_listed(tmp_path: Path) -> None:
    """voices() lists alto, bass, tenor and soprano: built-in, labelled, tagged, own specs."""
    voices = {v.id: v for v in _engine(tmp_path, None).voices()}
    assert {"alto", "bass", "tenor", "soprano"} <= set(voices)
    for voice in voices.values():
        assert voice.builtin and voice.label and voice.tags and voice.spec.startswith(voice.id)
    assert len({v.spec for v in voices.values()}) == len(voices)


# -- speaking -------------------------------------------------------------------------------


def test_duration_is_plausible_and_not_silent(expressive: ToneEngine) -> None:
    """A 140-character sentence lasts 6 to 15 seconds, and is loud enough to hear."""
    text = SENTENCE + " Then it stops, and waits for the other."
    assert len(text) == 140
    pcm = _speak(expressive, "expressive", text, seed=1)
    assert 6.0 <= _seconds(pcm) <= 15.0
    assert _rms(pcm) > 1000
    assert len(pcm) % 2 == 0


def test_speak_yields_pcm_in_pieces_of_several_kilobytes(expressive: ToneEngine) -> None:
    """speak streams: several chunks, each but the last at least 4 KB, each whole samples."""
    chunks = list(expressive.speak(SpeakRequest(text=SENTENCE, variant="expressive", seed=3)))
    assert len(chunks) > 3
    assert all(len(c) >= 4096 for c in chunks[:-1])
    assert all(len(c) % 2 == 0 for c in chunks)


def test_same_seed_same_bytes_other_seed_other_bytes(expressive: ToneEngine) -> None:
    """Under a seed the output is byte-identical; another seed, or no seed, gives other audio."""
    first = _speak(expressive, "expressive", SENTENCE, seed=42)
    assert _speak(expressive, "expressive", SENTENCE, seed=42) == first
    assert _speak(expressive, "expressive", SENTENCE, seed=43) != first
    assert _speak(expressive, "expressive", SENTENCE) != _speak(expressive, "expressive", SENTENCE)


def test_seeded_output_is_identical_in_another_process(expressive: ToneEngine, tmp_path: Path) -> None:
    """A seed fixes the bytes across processes too: nothing depends on Python's salted hash()."""
    pcm = _speak(expressive, "expressive", SENTENCE + " [laugh] Yes?", seed=7)
    here = hashlib.sha256(pcm).hexdigest()
    script = (
        "import hashlib\n"
        "from rhapsode_engine_tone import ToneEngine\n"
        "from pathlib import Path\n"
        "from rhapsode_worker import SpeakRequest, WorkerContext\n"
        f"e = ToneEngine(WorkerContext(voice_dir=Path({str(tmp_path)!r}), cache_dir=Path({str(tmp_path)!r})))\n"
        "e.load('expressive')\n"
        f"r = SpeakRequest(text={SENTENCE + ' [laugh] Yes?'!r}, variant='expressive', seed=7)\n"
        "print(hashlib.sha256(b''.join(e.speak(r))).hexdigest())\n"
    )
    there = subprocess.run(
        [sys.executable, "-c", script],
        check=True,
        capture_output=True,
        text=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
    ).stdout.strip()
    assert there == here


def test_default_voice_is_alto(expressive: ToneEngine) -> None:
    """A request naming no voice is read in alto."""
    unnamed = _speak(expressive, "expressive", SENTENCE, seed=5)
    assert unnamed == _speak(expressive, "expressive", SENTENCE, seed=5, voice="alto")


def test_unknown_voice_is_refused_never_substituted(expressive: ToneEngine) -> None:
    """A voice id the engine does not have raises UnknownVoice naming the voice field."""
    with pytest.raises(UnknownVoice) as caught:
        _speak(expressive, "expressive", "hello", voice="narrator_99")
    assert caught.value.field == "voice"


def test_languages_render_differently(expressive: ToneEngine) -> None:
    """The same text and seed sound different per language; an undeclared one is refused."""
    languages = ("en", "fr", "de", "es", "ja")
    assert _pairwise_distinct(
        _speak(expressive, "expressive", SENTENCE, seed=9, language=lang) for lang in languages
    )
    with pytest.raises(Unsupported):
        _speak(expressive, "expressive", SENTENCE, language="pt")


def test_each_cue_is_its_own_sound(expressive: ToneEngine) -> None:
    """Every cue changes the audio, and no two cues sound the same, under one seed."""
    plain = _speak(expressive, "expressive", "hello there", seed=11)
    cued = [_speak(expressive, "expressive", f"hello [{cue}] there", seed=11) for cue in ALL_CUES]
    assert _pairwise_distinct([plain, *cued])
    for rendering in cued:
        assert _seconds(rendering) > _seconds(plain) + 0.1


def test_cue_renders_where_it_is_written(expressive: ToneEngine) -> None:
    """A cue sounds at its place in the text: moving it changes the audio, not the length."""
    early = _speak(expressive, "expressive", "[sigh] hello there", seed=12)
    late = _speak(expressive, "expressive", "hello there [sigh]", seed=12)
    assert early != late
    assert abs(_seconds(early) - _seconds(late)) < 0.05


def test_other_bracketed_text_and_private_tags_are_never_read(
    expressive: ToneEngine, classic: ToneEngine
) -> None:
    """Brackets that are not claimed cues, and <tags>, are skipped, not spoken as words."""
    plain = _speak(expressive, "expressive", "hello there", seed=13)
    assert _speak(expressive, "expressive", "hello [banana split] there", seed=13) == plain
    assert _speak(expressive, "expressive", "hello <beep> there", seed=13) == plain
    classic_plain = _speak(classic, "classic", "hello there", seed=13)
    assert _speak(classic, "classic", "hello [laugh] there", seed=13) == classic_plain


def test_deliveries_are_audibly_different(classic: ToneEngine) -> None:
    """hushed is quieter and slower than plain, frantic shorter and higher; all three differ."""
    plain = _speak(classic, "classic", SENTENCE, seed=21)
    hushed = _speak(classic, "classic", SENTENCE, seed=21, delivery="hushed")
    frantic = _speak(classic, "classic", SENTENCE, seed=21, delivery="frantic")
    assert _pairwise_distinct([plain, hushed, frantic])
    assert _rms(hushed) < 0.5 * _rms(plain)
    assert _seconds(hushed) > _seconds(plain)
    assert _seconds(frantic) < 0.8 * _seconds(plain)
    assert _dominant_hz(frantic) > 1.1 * _dominant_hz(plain)


def test_deliveries_are_relative_to_the_voice(classic: ToneEngine) -> None:
    """A hushed soprano is still far above a hushed bass, and so is a frantic one."""
    for way in ("hushed", "frantic"):
        low, high = (
            _dominant_hz(_speak(classic, "classic", "aaaaaaaa", seed=22, voice=v, delivery=way))
            for v in ("bass", "soprano")
        )
        assert high > 2.5 * low


def test_expressive_refuses_a_delivery_it_did_not_claim(expressive: ToneEngine) -> None:
    """A delivery reaching a variant that does not claim it is refused, not silently ignored."""
    with pytest.raises(Unsupported):
        _speak(expressive, "expressive", "hello", delivery="hushed")


def test_pitch_dial_moves_the_dominant_frequency(classic: ToneEngine) -> None:
    """pitch multiplies the voice's pitch: 2.0 doubles the dominant frequency, 0.5 halves it."""
    base = _dominant_hz(_speak(classic, "classic", "aaaaaaaaa", seed=31))
    high = _dominant_hz(_speak(classic, "classic", "aaaaaaaaa", seed=31, params={"pitch": 2.0}))
    low = _dominant_hz(_speak(classic, "classic", "aaaaaaaaa", seed=31, params={"pitch": 0.5}))
    assert 150 < base < 320
    assert 1.85 < high / base < 2.15
    assert 0.45 < low / base < 0.55


def test_rate_dial_scales_duration(classic: ToneEngine) -> None:
    """rate 2.0 takes about half the time of 1.0, and 0.5 about twice."""
    normal = _seconds(_speak(classic, "classic", SENTENCE, seed=32))
    fast = _seconds(_speak(classic, "classic", SENTENCE, seed=32, params={"rate": 2.0}))
    slow = _seconds(_speak(classic, "classic", SENTENCE, seed=32, params={"rate": 0.5}))
    assert 0.45 < fast / normal < 0.55
    assert 1.9 < slow / normal < 2.1


# -- voices ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pitch", "rate", "channels"),
    [(150.0, 16000, 1), (300.0, 16000, 1), (150.0, 44100, 2), (300.0, 22050, 2)],
)
def test_clone_estimates_the_speakers_pitch(
    tmp_path: Path, pitch: float, rate: int, channels: int
) -> None:
    """A clone of a synthetic harmonic clip stores its fundamental within 5%, at any rate."""
    engine = _engine(tmp_path, None)
    voice = engine.create_voice("clip", "Clip", _wav("clip.wav", _clip(pitch, rate, channels)))
    assert voice.id == "clip" and not voice.builtin and "cloned" in voice.tags
    stored = json.loads((tmp_path / "voices" / "clip.json").read_text())
    assert abs(stored["pitch"] / pitch - 1) < 0.05
    assert voice in engine.voices()


def test_cloned_voice_speaks_at_its_pitch(classic: ToneEngine) -> None:
    """A voice cloned from a 300 Hz clip reads an octave above one cloned from 150 Hz."""
    classic.create_voice("low", "Low", _wav("low.wav", _clip(150.0)))
    classic.create_voice("high", "High", _wav("high.wav", _clip(300.0)))
    low = _dominant_hz(_speak(classic, "classic", "aaaaaaaaa", seed=41, voice="low"))
    high = _dominant_hz(_speak(classic, "classic", "aaaaaaaaa", seed=41, voice="high"))
    assert 1.85 < high / low < 2.15


@pytest.mark.parametrize(
    "payload",
    [b"", b"this is not audio at all" * 40, _clip(150.0, width=1), _clip(150.0)[:60], _clip(0.0)],
    ids=["empty", "garbage", "8-bit", "truncated", "silent"],
)
def test_clone_refuses_unusable_references(tmp_path: Path, payload: bytes) -> None:
    """Anything but a voiced 16-bit PCM WAV is bad_request on the reference; nothing is stored."""
    engine = _engine(tmp_path, None)
    with pytest.raises(BadRequest) as caught:
        engine.create_voice("bad", "Bad", _wav("bad.wav", payload))
    assert caught.value.field == "reference"
    assert [v.id for v in engine.voices() if not v.builtin] == []


def _claiming(rate: int, channels: int, data_bytes: int) -> bytes:
    """
    A 16-bit WAV of silence whose header claims C{rate} and C{channels}, whatever the
    wave module would let a writer say.
    """
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(bytes(data_bytes))
    clip = bytearray(out.getvalue())
    struct.pack_into("<HI", clip, 22, channels, rate)
    struct.pack_into("<HH", clip, 32, 2 * channels, 16)
    return bytes(clip)


def _peak_allocation(call: Callable[[], object]) -> int:
    """The most memory C{call} had allocated at once, in bytes, whether or not it raised."""
    tracemalloc.start()
    try:
        call()
    except BadRequest:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


@pytest.mark.parametrize(
    ("rate", "channels", "complaint"),
    [(4_294_967_295, 1, "4294967295 Hz"), (192_001, 1, "192001 Hz"), (999, 1, "999 Hz"), (16000, 9, "9 channels")],
)
def test_clone_refuses_an_absurd_header_before_reading_the_clip(
    tmp_path: Path, rate: int, channels: int, complaint: str
) -> None:
    """
    A WAV claiming a sample rate outside 1 to 192 kHz, or more than 8 channels, is
    bad_request on the reference, refused from its header with next to nothing
    allocated: a 4 GB/s claim over 2 MB once cost half a million list slices.
    """
    engine = _engine(tmp_path, None)
    clip = _wav("x.wav", _claiming(rate, channels, 2_000_000))
    with pytest.raises(BadRequest) as caught:
        engine.create_voice("x", "X", clip)
    assert caught.value.field == "reference" and complaint in caught.value.message
    assert _peak_allocation(lambda: estimate(clip.data)) < 1_000_000


def test_the_widest_clip_read_is_analysed_within_bounded_memory(tmp_path: Path) -> None:
    """
    A long clip at the widest the engine reads (192 kHz, 8 channels, 8 s: 25 MB) has
    its pitch found from its first seconds in a process whose peak resident memory
    grows by under 30 MB, about two copies of the seconds analysed (the mix-down to a
    list of samples grew it by 47 MB).  Measured in a process of its own, since
    tracemalloc slows the pure-Python mix-down tenfold.
    """
    rate, channels, pitch = 192_000, 8, 150.0
    period = array("h")
    for i in range(rate // round(pitch)):  # exactly one period: 1280 frames
        t = i / rate
        value = int(9000 * sum(math.sin(2 * math.pi * pitch * h * t) / h for h in range(1, 6)))
        period.extend([value] * channels)
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((period * round(pitch * 8)).tobytes())
    path = tmp_path / "wide.wav"
    path.write_bytes(out.getvalue())
    script = (
        "import resource, sys\n"
        "from rhapsode_engine_tone._pitch import estimate\n"
        "data = open(sys.argv[1], 'rb').read()\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "found = estimate(data).pitch\n"
        "print(found, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n"
    )
    run = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, check=True)
    found, grown_kib = run.stdout.split()
    assert abs(float(found) / pitch - 1) < 0.02
    assert int(grown_kib) < 30 * 1024


def test_clone_refuses_a_type_it_does_not_read(tmp_path: Path) -> None:
    """A reference whose filename names a type other than wav is unsupported."""
    with pytest.raises(Unsupported):
        _engine(tmp_path, None).create_voice("x", "X", _wav("clip.mp3", _clip(150.0)))


def test_recreating_a_voice_replaces_it_and_changes_its_spec(tmp_path: Path) -> None:
    """Creating an existing id replaces the voice; its spec changes because its sound did."""
    engine = _engine(tmp_path, None)
    before = engine.create_voice("host", "Host", _wav("a.wav", _clip(150.0)))
    after = engine.create_voice("host", "Host", _wav("b.wav", _clip(300.0)))
    assert before.spec != after.spec
    assert [v for v in engine.voices() if v.id == "host"] == [after]


def test_builtin_ids_cannot_be_created_or_deleted(tmp_path: Path) -> None:
    """A built-in voice is neither replaced by a create nor removed by a delete."""
    engine = _engine(tmp_path, None)
    with pytest.raises(Unsupported) as caught:
        engine.delete_voice("alto")
    assert caught.value.field == "id"
    with pytest.raises(Unsupported):
        engine.create_voice("alto", "Alto", _wav("a.wav", _clip(150.0)))
    with pytest.raises(Unsupported):
        engine.blend_voice("bass", "Bass", [("alto", 0.5), ("soprano", 0.5)])


def test_delete_removes_a_created_voice(expressive: ToneEngine) -> None:
    """A deleted voice leaves the listing and is unknown to speak and to a second delete."""
    expressive.create_voice("gone", "Gone", _wav("g.wav", _clip(200.0)))
    expressive.delete_voice("gone")
    assert "gone" not in {v.id for v in expressive.voices()}
    with pytest.raises(UnknownVoice):
        _speak(expressive, "expressive", "hello", voice="gone")
    with pytest.raises(UnknownVoice):
        expressive.delete_voice("gone")


def test_blend_is_resolved_when_made_and_survives_its_components(classic: ToneEngine) -> None:
    """A blend sits between its components and sounds the same after they are deleted or redone."""
    classic.create_voice("low", "Low", _wav("low.wav", _clip(150.0)))
    classic.create_voice("high", "High", _wav("high.wav", _clip(300.0)))
    blend = classic.blend_voice("mid", "Mid", [("low", 0.5), ("high", 0.5)])
    assert "blend" in blend.tags and not blend.builtin and blend in classic.voices()
    sound = _speak(classic, "classic", "aaaaaaaaa", seed=51, voice="mid")
    low = _dominant_hz(_speak(classic, "classic", "aaaaaaaaa", seed=51, voice="low"))
    assert 1.3 < _dominant_hz(sound) / low < 1.55  # sqrt(2), the geometric middle
    classic.delete_voice("low")
    classic.create_voice("high", "High", _wav("high.wav", _clip(400.0)))
    assert _speak(classic, "classic", "aaaaaaaaa", seed=51, voice="mid") == sound
    assert blend in classic.voices()


def test_blend_of_builtins(expressive: ToneEngine) -> None:
    """Built-in voices blend too, and the blend's spec is its own."""
    blend = expressive.blend_voice("duet", "Duet", [("bass", 0.25), ("soprano", 0.75)])
    specs = {v.spec for v in expressive.voices() if v.id != "duet"}
    assert blend.spec not in specs
    assert _rms(_speak(expressive, "expressive", "hello", seed=52, voice="duet")) > 1000


# -- dialogue -------------------------------------------------------------------------------


def _dialogue(engine: ToneEngine, turns: list[tuple[str, str]], **fields: object) -> bytes:
    request = DialogueRequest(
        turns=[Turn(s, t) for s, t in turns],
        variant="classic",
        params={"pitch": 1.0, "rate": 1.0},
        **fields,  # type: ignore[arg-type]
    )
    return b"".join(engine.dialogue(request))


def test_dialogue_reads_each_speaker_in_its_voice(classic: ToneEngine) -> None:
    """Each turn sounds in its speaker's mapped voice, turns in order, a pause between them."""
    pcm = _dialogue(
        classic,
        [("a", "aaaaaaaa"), ("b", "aaaaaaaa"), ("a", "aaaaaaaa")],
        voices={"a": "bass", "b": "soprano"},
        seed=61,
    )
    turns = _turns(pcm)
    assert len(turns) == 3
    pitches = [_dominant_hz(t) for t in turns]
    assert pitches[1] > 2.5 * pitches[0] and pitches[1] > 2.5 * pitches[2]


def test_dialogue_is_reproducible_under_a_seed(classic: ToneEngine) -> None:
    """The same dialogue and seed give the same bytes; another seed does not."""
    turns = [("host", "Welcome back to the show"), ("guest", "Thanks for having me")]
    first = _dialogue(classic, turns, seed=62)
    assert _dialogue(classic, turns, seed=62) == first
    assert _dialogue(classic, turns, seed=63) != first


def test_dialogue_gives_unvoiced_speakers_distinct_builtin_voices(classic: ToneEngine) -> None:
    """Unvoiced speakers get distinct built-in voices, the same ones every time for a seed."""
    for seed in range(5):
        pcm = _dialogue(classic, [("x", "aaaaaaaa"), ("y", "aaaaaaaa")], seed=seed)
        first, second = (_dominant_hz(t) for t in _turns(pcm))
        assert abs(math.log(first / second)) > math.log(1.15)
        assert _dialogue(classic, [("x", "aaaaaaaa"), ("y", "aaaaaaaa")], seed=seed) == pcm


def test_dialogue_refuses_what_it_cannot_do(tmp_path: Path) -> None:
    """expressive performs no dialogue; a mapped voice the engine lacks is unknown_voice."""
    expressive = _engine(tmp_path, "expressive")
    with pytest.raises(Unsupported):
        request = DialogueRequest(turns=[Turn("a", "hi")], variant="expressive")
        b"".join(expressive.dialogue(request))
    classic = _engine(tmp_path, "classic")
    with pytest.raises(UnknownVoice):
        _dialogue(classic, [("a", "hi")], voices={"a": "nobody"})


# -- under the worker (rhapsode_worker.testing) ------------------------------------------


@pytest.fixture
def worker(tmp_path: Path) -> WorkerHarness:
    return WorkerHarness(ToneEngine, tmp_path)


def test_the_worker_declares_what_the_catalog_and_variants_say(worker: WorkerHarness) -> None:
    """
    Served by the real worker, tone's capabilities are valid, name the licences its
    catalog.json gives and both variants with their claims, and its voices are the four
    built-ins.
    """
    caps = worker.get("/capabilities").json()
    contract.validate(contract.CAPABILITIES, caps)
    catalog = json.loads((Path(sys.modules["rhapsode_engine_tone"].__file__).parent / "catalog.json").read_text())
    assert caps["license"] == catalog["license"] and caps["defaultVariant"] == catalog["defaultVariant"]
    assert caps["engine"] == {"id": "tone", "displayName": "Tone", "adapterVersion": "0.1.0"}
    assert caps["variants"]["expressive"]["cues"] == list(ALL_CUES)
    assert caps["variants"]["classic"]["dialogue"] == {"maxSpeakers": 2}
    assert caps["variants"]["classic"]["cloning"] == {"supported": True, "formats": ["wav"]}
    assert [v["id"] for v in worker.get("/voices").json()] == ["alto", "bass", "tenor", "soprano"]


def test_the_worker_loads_the_variant_tone_speaks(worker: WorkerHarness) -> None:
    """
    tone keeps no guard of its own: with expressive loaded, a request for classic's
    dials is spoken once the worker has loaded classic, and health then says so.
    """
    assert worker.post("/load", {"variant": "expressive"}).json()["variant"] == "expressive"
    spoken = worker.post("/speak", {"text": "aaaaaaaaa", "variant": "classic", "params": {"pitch": 2.0},
                                    "seed": 3, "format": "pcm", "stream": False})
    assert spoken.code == 200 and spoken.headers["content-type"] == f"audio/L16; rate={RATE}; channels=1"
    assert worker.get("/health").json()["variant"] == "classic"
    classic = _engine(worker.context.voice_dir.parent / "direct", "classic")
    assert spoken.body == _speak(classic, "classic", "aaaaaaaaa", seed=3, params={"pitch": 2.0})


def test_a_request_through_the_worker_is_the_segments_the_sdk_cut(worker: WorkerHarness) -> None:
    """
    A long text comes back as its segments joined with tone's joint silence, and the
    stated duration is the audio's: a buffered WAV and a buffered pcm agree, and a
    streamed pcm (its first segment cut shorter, one segment more) states its own.
    """
    text = " ".join([SENTENCE] * 4)
    wav = worker.post("/speak", {"text": text, "seed": 5, "stream": False})
    whole = worker.post("/speak", {"text": text, "seed": 5, "format": "pcm", "stream": False})
    pcm = worker.post("/speak", {"text": text, "seed": 5, "format": "pcm"})
    assert wav.code == whole.code == pcm.code == 200 and wav.body[44:] == whole.body
    assert wav.duration_ms == whole.duration_ms == round(len(whole.body) // 2 * 1000 / RATE)
    assert pcm.duration_ms == round(len(pcm.body) // 2 * 1000 / RATE)
    assert 20 < _seconds(pcm.body) < 60 and 20 < _seconds(whole.body) < 60


def test_a_voice_cloned_through_the_worker_speaks_at_its_pitch(worker: WorkerHarness) -> None:
    """
    A clip uploaded as a client uploads it becomes a voice in the worker's voice folder,
    listed, and speaking an octave above the same engine's clone of a clip half its pitch.
    """
    for name, pitch in (("low", 150.0), ("high", 300.0)):
        made = worker.create_voice(name, name.title(), reference=(f"{name}.wav", _clip(pitch)))
        assert made.code == 201 and made.json()["builtin"] is False
        assert (worker.context.voice_dir / f"{name}.json").is_file()
    heard = [
        _dominant_hz(worker.post("/speak", {"text": "aaaaaaaaa", "variant": "classic", "voice": name,
                                            "seed": 41, "format": "pcm", "stream": False}).body)
        for name in ("low", "high")
    ]
    assert 1.85 < heard[1] / heard[0] < 2.15
    refused = worker.post("/speak", {"text": "hi", "voice": "nobody"})
    assert refused.code == 404 and refused.json()["error"]["code"] == "unknown_voice"


def test_a_paced_tone_sleeps_each_chunks_length_in_audio_times_the_pace(monkeypatch: pytest.MonkeyPatch) -> None:
    """
    RHAPSODE_TONE_PACE makes tone a fixed-cost engine: before each chunk it sleeps the
    chunk's length in audio times the pace; unset or 0, it never sleeps; a pace that is
    not a number from 0 to 10 is refused naming the variable.
    """
    from rhapsode_engine_tone import _engine

    slept: list[float] = []
    monkeypatch.setattr(_engine.time, "sleep", slept.append)
    chunks = [b"\x00" * 9600, b"\x00" * 4800]
    assert list(_engine._paced(iter(chunks), 0.5)) == chunks
    assert slept == [pytest.approx(0.1), pytest.approx(0.05)]
    assert _engine.pace_of({}) == 0.0 and _engine.pace_of({"RHAPSODE_TONE_PACE": "1.5"}) == 1.5
    for bad in ("fast", "-1", "11"):
        with pytest.raises(ValueError, match="RHAPSODE_TONE_PACE"):
            _engine.pace_of({"RHAPSODE_TONE_PACE": bad})
