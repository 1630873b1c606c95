"""
Tests for the Kokoro adapter's pure parts: fetch's verification and cache rules, the
voice store (voicepacks read as data, blends, listings) and the phoneme clean-up.

And which of its runs give onnxruntime's arena back (L{_session.Shrinking}).

The adapter's package imports numpy and kokoro-onnx, which live only in .venvs/kokoro, so
its pure modules are loaded here under an empty package rather than through it.  (The
file is not test_engine_kokoro.py because tests/integration has that name, and pytest
cannot hold two test modules of one basename.)
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import io
import json
import math
import struct
import sys
import threading
import zipfile
from array import array
from pathlib import Path
from typing import Any, Iterator

import pytest

from rhapsode_worker import BadRequest, Internal, UnknownVoice, Unsupported
from rhapsode_worker.arrays import read_npy

SRC = Path(__file__).resolve().parents[2] / "engines" / "kokoro" / "src" / "rhapsode_engine_kokoro"


def _pure_modules() -> tuple[Any, Any, Any, Any]:
    package_name = "rhapsode_engine_kokoro"
    spec = importlib.machinery.ModuleSpec(package_name, None, is_package=True)
    package = importlib.util.module_from_spec(spec)
    package.__path__ = [str(SRC)]
    sys.modules[package_name] = package
    try:
        from rhapsode_engine_kokoro import _fetch, _phonemes, _session, _voices
    finally:
        # Left registered, the stand-in package would tell find_spec elsewhere in the
        # session (test_conform's installed-engine check) that the engine is installed here.
        for name in [n for n in sys.modules if n == package_name or n.startswith(package_name + ".")]:
            del sys.modules[name]
    return _fetch, _phonemes, _voices, _session


_fetch, _phonemes, _voices, _session = _pure_modules()
Artifact = _fetch.Artifact

DATA = b"kokoro weights, or a small stand-in for them" * 100
FAKE = Artifact("fake.onnx", len(DATA), hashlib.sha256(DATA).hexdigest())


def pieces(data: bytes, size: int = 1000) -> Iterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_matching_bytes_are_renamed_into_place(tmp_path: Path) -> None:
    """Bytes of the recorded size and SHA-256 end up under the artifact's name, verified."""
    path = _fetch.write_verified(tmp_path, FAKE, pieces(DATA))
    assert path == tmp_path / "fake.onnx"
    assert path.read_bytes() == DATA
    assert _fetch.verified(path, FAKE)
    assert leftovers(tmp_path) == ["fake.onnx"]


def test_a_wrong_hash_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    """Same size, one byte changed: refused naming both hashes; no file, no temporary."""
    tampered = DATA[:-1] + b"!"
    with pytest.raises(Internal) as caught:
        _fetch.write_verified(tmp_path, FAKE, pieces(tampered))
    assert FAKE.sha256 in caught.value.message
    assert hashlib.sha256(tampered).hexdigest() in caught.value.message
    assert leftovers(tmp_path) == []


def test_a_short_download_is_refused(tmp_path: Path) -> None:
    """A download that stops early, cleanly, is the wrong size and is not accepted."""
    with pytest.raises(Internal, match=f"{len(DATA) - 10} bytes"):
        _fetch.write_verified(tmp_path, FAKE, pieces(DATA[:-10]))
    assert leftovers(tmp_path) == []


def test_an_interrupted_download_leaves_no_file(tmp_path: Path) -> None:
    """A source that fails halfway leaves neither the artifact nor a temporary file."""

    def broken() -> Iterator[bytes]:
        yield DATA[:500]
        raise ConnectionError("registry went away")

    with pytest.raises(ConnectionError):
        _fetch.write_verified(tmp_path, FAKE, broken())
    assert leftovers(tmp_path) == []


def test_an_interrupted_replacement_keeps_the_good_file(tmp_path: Path) -> None:
    """A failed refetch does not disturb a verified file already in place."""
    _fetch.write_verified(tmp_path, FAKE, pieces(DATA))
    with pytest.raises(Internal):
        _fetch.write_verified(tmp_path, FAKE, pieces(b"nonsense"))
    assert _fetch.verified(tmp_path / "fake.onnx", FAKE)


def test_a_partial_or_damaged_file_in_place_does_not_pass(tmp_path: Path) -> None:
    """verified() needs the exact bytes: a truncated or same-size corrupt file fails."""
    path = tmp_path / "fake.onnx"
    assert not _fetch.verified(path, FAKE)
    path.write_bytes(DATA[: len(DATA) // 2])
    assert not _fetch.verified(path, FAKE)
    path.write_bytes(bytes(len(DATA)))
    assert not _fetch.verified(path, FAKE)
    path.write_bytes(DATA)
    assert _fetch.verified(path, FAKE)


def test_cache_lives_outside_the_virtualenv() -> None:
    """RHAPSODE_KOKORO_CACHE wins, then XDG_CACHE_HOME/rhapsode/kokoro, then ~/.cache."""
    assert _fetch.cache_dir({"RHAPSODE_KOKORO_CACHE": "/c", "XDG_CACHE_HOME": "/x"}) == Path("/c")
    assert _fetch.cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/rhapsode/kokoro")
    assert _fetch.cache_dir({}) == Path.home() / ".cache" / "rhapsode" / "kokoro"


def test_recorded_artifacts_are_the_real_sizes() -> None:
    """The graph is the four parts' 92,361,271 bytes; the voices file is 54 arrays and a header."""
    assert _fetch.MODEL.size == 92_361_271
    assert _fetch.VOICES.size == 128 + 54 * 510 * 256 * 4
    assert len(_voices.BUILTIN_VOICES) == len(set(_voices.BUILTIN_VOICES)) == 54


def test_npy_header_is_what_numpy_reads() -> None:
    """The hand-written header parses as a float32 .npy of the shape given, data aligned."""
    header = _voices.npy_header((2, 1, 3))
    assert len(header) % 64 == 0
    values = array("f", [0.5, -1.0, 2.0, 0.0, 1.5, -0.25])
    found = read_npy(header + struct.pack("<6f", *values))
    assert found.shape == (2, 1, 3)
    assert list(found.values) == list(values)


def npy_pack(shape: tuple[int, ...], fill: float = 0.25) -> bytes:
    count = math.prod(shape)
    return _voices.npy_header(shape) + struct.pack(f"<{count}f", *([fill] * count))


@pytest.mark.parametrize("shape", [(510, 1, 256), (510, 256)])
def test_voicepacks_of_either_kokoro_shape_are_read(shape: tuple[int, ...]) -> None:
    """510 x 1 x 256 and 510 x 256 both become the same 510 x 256 float32 bytes."""
    style = _voices.style_from_voicepack("v.npy", npy_pack(shape))
    assert style == struct.pack("<f", 0.25) * (510 * 256)


@pytest.mark.parametrize("shape", [(511, 1, 256), (510, 255), (256,), (510, 2, 256)])
def test_a_voicepack_of_another_shape_is_bad_request(shape: tuple[int, ...]) -> None:
    """Any other shape is bad_request on "reference", naming the shape found."""
    with pytest.raises(BadRequest) as caught:
        _voices.style_from_voicepack("v.npy", npy_pack(shape))
    assert caught.value.field == "reference"
    assert str(shape) in caught.value.message


def test_a_voicepack_holding_nan_is_bad_request() -> None:
    """A style array with a NaN would speak garbage; it is refused."""
    data = bytearray(npy_pack((510, 256)))
    data[-4:] = struct.pack("<f", float("nan"))
    with pytest.raises(BadRequest, match="not finite"):
        _voices.style_from_voicepack("v.npy", bytes(data))


def test_a_voicepack_of_another_type_is_unsupported() -> None:
    """A .wav (or any other type) is unsupported on "reference"."""
    with pytest.raises(Unsupported) as caught:
        _voices.style_from_voicepack("clip.wav", b"RIFF....WAVE")
    assert caught.value.field == "reference"


def test_a_pickle_calling_os_system_inside_a_pt_is_refused(tmp_path: Path) -> None:
    """A .pt whose data.pkl would run a command is refused naming the global, and never runs."""
    marker = tmp_path / "ran"
    command = f"touch {marker}".encode()
    payload = b"\x80\x02cos\nsystem\nX" + struct.pack("<I", len(command)) + command + b"\x85R."
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("voice/data.pkl", payload)
    with pytest.raises(BadRequest, match="os.system"):
        _voices.style_from_voicepack("voice.pt", buffer.getvalue())
    assert not marker.exists()


def style(fill: float) -> bytes:
    return struct.pack("<f", fill) * (510 * 256)


def test_blend_is_the_weighted_sum() -> None:
    """Two thirds of one array and a third of another, value by value."""
    mixed = array("f")
    mixed.frombytes(_voices.blend_styles([(style(0.3), 2 / 3), (style(-0.6), 1 / 3)]))
    assert len(mixed) == 510 * 256
    assert all(abs(v - 0.0) < 1e-6 for v in mixed)
    uneven = array("f")
    uneven.frombytes(_voices.blend_styles([(style(1.0), 0.25), (style(2.0), 0.75)]))
    assert set(uneven) == {1.75}


def test_builtin_style_reads_one_voice_out_of_the_voices_file(tmp_path: Path) -> None:
    """The n-th array of the cache's voices file is the n-th built-in voice's style."""
    voices_file = tmp_path / "voices.npy"
    voices_file.write_bytes(
        _voices.npy_header(_voices.VOICES_SHAPE)
        + b"".join(style(float(i)) for i in range(len(_voices.BUILTIN_VOICES)))
    )
    index = _voices.BUILTIN_VOICES.index("bf_emma")
    assert _voices.builtin_style(voices_file, "bf_emma") == style(float(index))


def test_store_saves_lists_replaces_and_deletes(tmp_path: Path) -> None:
    """A created voice is listed with its label; re-creating changes its spec; delete removes it."""
    store = _voices.StyleStore(tmp_path / "voices")
    assert store.created() == []
    first = store.save("narrator", "Narrator", style(0.1), {"kind": "voicepack", "filename": "n.pt"})
    assert (first.id, first.label, first.builtin, first.tags) == ("narrator", "Narrator", False, ("voicepack",))
    assert first.description == "Voicepack from n.pt"
    assert store.created() == [first]
    assert store.style("narrator") == style(0.1)
    second = store.save("narrator", "Narrator", style(0.2), {"kind": "voicepack", "filename": "n.pt"})
    assert second.spec != first.spec
    assert store.created() == [second]
    store.delete("narrator")
    assert store.created() == []
    with pytest.raises(UnknownVoice):
        store.style_path("narrator")


def test_store_lists_a_blend_with_its_recipe(tmp_path: Path) -> None:
    """A blend's description names its components and their shares."""
    store = _voices.StyleStore(tmp_path)
    voice = store.save("host", "Host", style(0.0),
                       {"kind": "blend", "components": [["af_bella", 2 / 3], ["af_sky", 1 / 3]]})
    assert voice.description == "Blend of af_bella 67%, af_sky 33%"
    assert json.loads((tmp_path / "host.json").read_text())["origin"]["kind"] == "blend"


def test_store_lists_only_voices_whose_record_was_written(tmp_path: Path) -> None:
    """An array without its record (a save cut short) is not a voice."""
    (tmp_path / "orphan.npy").write_bytes(npy_pack((510, 1, 256)))
    assert _voices.StyleStore(tmp_path).created() == []


@pytest.mark.parametrize("verb", ["save", "delete"])
def test_store_refuses_builtin_ids(tmp_path: Path, verb: str) -> None:
    """A built-in voice can be neither replaced nor deleted."""
    store = _voices.StyleStore(tmp_path)
    with pytest.raises(Unsupported, match="built-in"):
        if verb == "save":
            store.save("af_heart", "x", style(0.0), {"kind": "voicepack", "filename": "x.npy"})
        else:
            store.delete("af_heart")


def test_builtin_listing_follows_kokoros_naming() -> None:
    """The prefix gives language and gender; unclaimed languages say so in the description."""
    heart = _voices.builtin_listing("af_heart")
    assert (heart.label, heart.tags, heart.spec) == ("Heart", ("en-US", "female"), "af_heart@kokoro-v1.0")
    assert _voices.builtin_listing("bm_george").tags == ("en-GB", "male")
    kumo = _voices.builtin_listing("jm_kumo")
    assert kumo.tags == ("ja", "male") and "cannot phonemize" in kumo.description
    for language, voice in _voices.DEFAULT_VOICES.items():
        assert _voices.builtin_listing(voice).tags[0] == language
    assert set(_voices.DEFAULT_VOICES) == set(_voices.ESPEAK_LANGUAGES)


@pytest.mark.parametrize(
    ("phonemes", "cleaned"),
    [
        # espeak-ng's own output for French and Hindi with English words in them.
        ("ˈi mˈɛ (en)dʒˈɒn at ðə(fr) staʁbˈyk ((en)dˈaʊntaʊn(fr)).",
         "ˈi mˈɛ dʒˈɒn at ðə staʁbˈyk (dˈaʊntaʊn)."),
        ("(en)piˈanəʊ(hi), (en)tˈaksi(hi).", "piˈanəʊ, tˈaksi."),
        ("(en-us)hˈɛloʊ(pt-br)", "hˈɛloʊ"),
        # Parentheses the text itself had, and phonemes that look like words, stay.
        ("stˈɑːɹbʌks (dˈaʊntaʊn).", "stˈɑːɹbʌks (dˈaʊntaʊn)."),
        ("(ən) (ˈit)", "(ən) (ˈit)"),
    ],
)
def test_language_switch_flags_are_removed(phonemes: str, cleaned: str) -> None:
    """espeak-ng's (en)...(fr) flags go, so Kokoro never says the language codes aloud."""
    assert _phonemes.without_language_switches(phonemes) == cleaned


SHRINK = {"memory.enable_memory_arena_shrinkage": "cpu:0"}


def test_only_a_requests_last_segment_shrinks_the_arena() -> None:
    """
    The runs of a segment that is not its request's last keep the arena (the next
    segment would map it afresh); a last segment's runs shrink it, and so does a run
    outside any segment.  A shrink is owed after a segment that was not the last, and
    settled by a last one that ends with nothing else running.
    """
    shrinking = _session.Shrinking()
    assert shrinking.run_config() == SHRINK and not shrinking.owed
    with shrinking.segment(False):
        assert shrinking.run_config() == {}
    assert shrinking.owed and shrinking.run_config() == SHRINK
    with shrinking.segment(True):
        assert shrinking.run_config() == SHRINK
    assert not shrinking.owed


def test_a_shrink_stays_owed_after_a_failure_or_beside_another_request() -> None:
    """
    A last segment whose run failed, or one that ended while another request's segment
    was still running (whose freed memory that shrink could not take), leaves the shrink
    owed, for the adapter's rest() to settle once the worker is idle; each thread's
    segments are its own.
    """
    shrinking = _session.Shrinking()
    with pytest.raises(RuntimeError):
        with shrinking.segment(True):
            raise RuntimeError("the run failed")
    assert shrinking.owed
    with shrinking.segment(True):
        pass
    assert not shrinking.owed
    seen: list[Any] = []
    other_started, finish = threading.Event(), threading.Event()

    def other() -> None:
        with shrinking.segment(False):
            seen.append(shrinking.run_config())
            other_started.set()
            finish.wait(30)

    thread = threading.Thread(target=other)
    thread.start()
    assert other_started.wait(30)
    with shrinking.segment(True):
        seen.append(shrinking.run_config())
    assert shrinking.owed
    finish.set()
    thread.join(30)
    assert seen == [{}, SHRINK] and shrinking.owed
