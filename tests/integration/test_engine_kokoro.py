"""
The Kokoro engine through a real worker in its own virtualenv (.venvs/kokoro): fetching
verified weights, speech in every claimed language, the speed dial, reproducibility,
streaming in segments, two generations at once with memory given back after each, and
voices made from voicepacks and blends without a model.

The weights are fetched once into .venvs/kokoro-cache (ignored by git, kept by reruns)
by the first worker's POST /fetch; every worker here shares that cache.
"""

from __future__ import annotations

import configparser
import io
import json
import math
import os
import struct
import wave
import zipfile
from array import array
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
import pytest_twisted
from twisted.internet.task import deferLater

from _worker import ROOT, Worker, deferred_raw, engine_python, resident_kib, rms, spawn_worker
from test_voices_dialogue import create, sine_wav

CACHE = ROOT / ".venvs" / "kokoro-cache"
ENGINE_DIR = ROOT / "engines" / "kokoro"
VARIANT = "v1.0-int8"
RATE = 24000
MODEL_FILE, MODEL_BYTES = "kokoro-v1.0.int8.onnx", 92_361_271
VOICES_FILE, VOICES_HEADER = "voices-v1.0.npy", 128
STYLE_VALUES = 510 * 256
SILENCE_RMS = 300.0  # about -40 dBFS of 16-bit full scale

LANGUAGES = {
    "en-US": "The weather is lovely today.",
    "en-GB": "I should rather like a cup of tea.",
    "es": "Hoy hace un tiempo precioso.",
    "fr": "Il fait vraiment beau aujourd'hui.",
    "hi": "आज मौसम बहुत अच्छा है।",
    "it": "Oggi il tempo è davvero bello.",
    "pt-BR": "O tempo está muito bonito hoje.",
}


async def start(tmp: Path, cache: Path = CACHE) -> Worker:
    from twisted.internet import reactor

    return await spawn_worker(
        reactor,
        tmp,
        module="rhapsode_engine_kokoro",
        engine="kokoro",
        python=engine_python("kokoro"),
        extra_env={"RHAPSODE_KOKORO_CACHE": str(cache)},
    )


@pytest_twisted.async_yield_fixture(scope="module")
async def kokoro(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Worker]:
    """
    One Kokoro worker for the module, its weights fetched (once per cache) through /fetch.
    """
    worker = await start(tmp_path_factory.mktemp("kokoro"))
    status, body = await worker.json("POST", "/fetch", {"variant": VARIANT})
    assert status == 204, body
    yield worker
    await worker.stop()


@pytest_twisted.async_yield_fixture()
async def fresh(tmp_path: Path) -> AsyncIterator[Worker]:
    """A worker of the test's own, with no model loaded."""
    worker = await start(tmp_path)
    yield worker
    await worker.stop()


async def speak(worker: Worker, **fields: Any) -> tuple[int, bytes]:
    """A buffered WAV: its sample rate checked, its PCM returned."""
    body = {"format": "wav", "stream": False, **fields}
    response = await deferred_raw(worker.socket_path, "POST", "/speak", json.dumps(body).encode())
    if response.status != 200:
        return response.status, response.body
    assert response.headers["content-type"] == "audio/wav"
    with wave.open(io.BytesIO(response.body)) as audio:
        assert (audio.getframerate(), audio.getnchannels(), audio.getsampwidth()) == (RATE, 1, 2)
        return 200, audio.readframes(audio.getnframes())


async def pcm(worker: Worker, **fields: Any) -> bytes:
    status, audio = await speak(worker, **fields)
    assert status == 200, audio
    return audio


def seconds(audio: bytes) -> float:
    return len(audio) / 2 / RATE


def peak_kib(pid: int) -> int:
    """The most resident memory the process has held (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM")


def assert_speech(audio: bytes, text: str) -> None:
    """Audible, and as long as someone saying C{text} would take."""
    per_character = seconds(audio) / len(text)
    assert 0.03 <= per_character <= 0.2, f"{seconds(audio):.2f} s for {len(text)} characters"
    assert rms(audio) > SILENCE_RMS


def builtin_style(name: str, voices: list[str]) -> bytes:
    """A built-in voice's float32 bytes, straight out of the cache's voices file."""
    with (CACHE / VOICES_FILE).open("rb") as handle:
        handle.seek(VOICES_HEADER + voices.index(name) * STYLE_VALUES * 4)
        return handle.read(STYLE_VALUES * 4)


def npy(shape: tuple[int, ...], data: bytes) -> bytes:
    header = f"{{'descr': '<f4', 'fortran_order': False, 'shape': {shape!r}, }}"
    header += " " * (-(10 + len(header) + 1) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode() + data


def tensor_pt(shape: tuple[int, ...], data: bytes) -> bytes:
    """A float32 tensor as torch.save lays it out: a zip of data.pkl and the raw storage."""

    def text(value: str) -> bytes:
        return b"X" + struct.pack("<I", len(value)) + value.encode()

    def numbers(values: tuple[int, ...]) -> bytes:
        return b"(" + b"".join(b"J" + struct.pack("<i", v) for v in values) + b"t"

    strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    count = math.prod(shape)
    pickled = (
        b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n(("
        + text("storage") + b"ctorch\nFloatStorage\n" + text("0") + text("cpu")
        + b"J" + struct.pack("<i", count) + b"tQ"
        + b"J" + struct.pack("<i", 0) + numbers(shape) + numbers(strides)
        + b"\x89ccollections\nOrderedDict\n)RtR."
    )
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("voice/data.pkl", pickled)
        archive.writestr("voice/byteorder", b"little")
        archive.writestr("voice/data/0", data)
        archive.writestr("voice/version", b"3\n")
    return out.getvalue()


def evil_pt(marker: Path) -> bytes:
    """A torch-like .pt whose data.pkl runs `touch marker` when unpickled."""
    command = f"touch {marker}".encode()
    pickled = b"\x80\x02cos\nsystem\nX" + struct.pack("<I", len(command)) + command + b"\x85R."
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("voice/data.pkl", pickled)
        archive.writestr("voice/byteorder", b"little")
    return out.getvalue()


# -- weights ---------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_fetch_puts_verified_weights_in_the_cache(kokoro: Worker) -> None:
    """
    POST /fetch left the graph (the four parts, 92,361,271 bytes) and the voices file in
    the cache, logged as verified; fetching again only re-verifies, and loads nothing.
    """
    assert (CACHE / MODEL_FILE).stat().st_size == MODEL_BYTES
    assert (CACHE / VOICES_FILE).stat().st_size == VOICES_HEADER + 54 * STYLE_VALUES * 4
    status, body = await kokoro.json("POST", "/fetch", {"variant": VARIANT})
    assert (status, body) == (204, None)
    messages = [line["message"] for line in kokoro.protocol.log_lines()
                if line["namespace"] == "rhapsode_engine_kokoro"]
    assert any(f"{MODEL_FILE} already in" in m for m in messages), messages
    assert not any(name.endswith(".partial") for name in os.listdir(CACHE))
    status, unknown = await kokoro.json("POST", "/fetch", {"variant": "v9"})
    assert (status, unknown["error"]["code"], unknown["error"]["field"]) == (422, "unsupported", "variant")


@pytest_twisted.ensureDeferred
async def test_a_load_refetches_a_damaged_voices_file(tmp_path: Path, kokoro: Worker) -> None:
    """
    A load finding a half-written voices file (and an interrupted fetch's temporary file)
    fetches the voices again, verified, before it loads; the intact graph is kept.
    """
    cache = tmp_path / "cache"
    cache.mkdir()
    os.link(CACHE / MODEL_FILE, cache / MODEL_FILE)
    whole = (CACHE / VOICES_FILE).read_bytes()
    (cache / VOICES_FILE).write_bytes(whole[: len(whole) // 2])
    (cache / f".{VOICES_FILE}.abc.partial").write_bytes(whole[:1000])
    worker = await start(tmp_path, cache)
    try:
        status, body = await worker.json("POST", "/load", {"variant": VARIANT})
        assert status == 200, body
        assert (cache / VOICES_FILE).read_bytes() == whole
        assert (cache / MODEL_FILE).stat().st_ino == (CACHE / MODEL_FILE).stat().st_ino
        assert sorted(os.listdir(cache)) == [".lock", MODEL_FILE, VOICES_FILE]
        messages = [line["message"] for line in worker.protocol.log_lines()]
        assert any("kokoro-js@1.2.1 downloaded" in m for m in messages), messages
    finally:
        await worker.stop()


# -- what the engine says about itself ----------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_catalog_record_agrees_with_the_adapter(kokoro: Worker) -> None:
    """
    catalog.json (read by the core before install) says what the running adapter says:
    id, name, licences, default variant; and its module, distribution and Python range
    are the package's.
    """
    catalog = json.loads((ENGINE_DIR / "catalog.json").read_text())
    status, capabilities = await kokoro.json("GET", "/capabilities")
    assert status == 200
    assert catalog["id"] == capabilities["engine"]["id"] == kokoro.handshake["engine"]
    assert catalog["displayName"] == capabilities["engine"]["displayName"]
    assert catalog["license"] == capabilities["license"]
    assert catalog["defaultVariant"] == capabilities["defaultVariant"] == VARIANT
    setup = configparser.ConfigParser()
    setup.read(ENGINE_DIR / "setup.cfg")
    assert catalog["distribution"] == setup["metadata"]["name"]
    assert catalog["python"] == setup["options"]["python_requires"]
    assert (ENGINE_DIR / "src" / catalog["module"] / "__main__.py").exists()
    assert capabilities["license"]["code"] == "GPL-3.0-or-later"
    assert "espeak-ng" in capabilities["license"]["notes"]
    variant = capabilities["variants"][VARIANT]
    assert variant["languages"] == list(LANGUAGES)
    assert variant["segmentation"]["segmentCharacters"] == 400
    assert variant["segmentation"]["firstSegmentCharacters"] == 30
    assert variant["segmentation"]["segmentGrowth"] == 2
    assert variant["segmentation"]["jointSilenceMs"] == 250


@pytest_twisted.ensureDeferred
async def test_the_54_builtin_voices_are_listed(kokoro: Worker) -> None:
    """GET /voices lists kokoro-js's 54 voices, each tagged with its language and gender."""
    status, voices = await kokoro.json("GET", "/voices")
    assert status == 200
    builtins = [v for v in voices if v["builtin"]]
    assert len(builtins) == 54
    heart = next(v for v in builtins if v["id"] == "af_heart")
    assert heart["tags"] == ["en-US", "female"]
    assert {v["id"][:2] for v in builtins} == {
        "af", "am", "bf", "bm", "ef", "em", "ff", "hf", "hm", "if", "im", "jf", "jm", "pf", "pm",
        "zf", "zm",
    }


# -- speaking ---------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_speech_is_audible_and_as_long_as_its_text(kokoro: Worker) -> None:
    """English at 24 kHz: audible, of plausible length, and longer for a longer text."""
    short = "Hello there, and welcome."
    longer = short + " This sentence makes the text about three times longer than it was."
    short_audio = await pcm(kokoro, text=short)
    long_audio = await pcm(kokoro, text=longer)
    assert_speech(short_audio, short)
    assert_speech(long_audio, longer)
    assert seconds(long_audio) > 2 * seconds(short_audio)


@pytest_twisted.ensureDeferred
async def test_speed_dial_changes_the_pace(kokoro: Worker) -> None:
    """speed 2.0 says the same words in well under half the time speed 0.5 takes."""
    text = "Counting slowly, one two three."
    fast = await pcm(kokoro, text=text, params={"speed": 2.0})
    slow = await pcm(kokoro, text=text, params={"speed": 0.5})
    assert seconds(slow) > 2.5 * seconds(fast)
    assert rms(fast) > SILENCE_RMS and rms(slow) > SILENCE_RMS


@pytest_twisted.ensureDeferred
async def test_every_claimed_language_speaks_and_differs(kokoro: Worker) -> None:
    """
    Each claimed language reads its own sentence audibly at a plausible length, and the
    same Latin-script words in the same voice come out differently in each language that
    reads Latin script.  Hindi reads them as English, switching as espeak-ng does, and
    exactly as en-GB does: the switch flags are gone, not spoken.
    """
    for language, text in LANGUAGES.items():
        assert_speech(await pcm(kokoro, text=text, language=language), text)
    same = "Piano, taxi."
    takes = {language: await pcm(kokoro, text=same, language=language, voice="af_heart")
             for language in LANGUAGES}
    latin = [takes[language] for language in LANGUAGES if language != "hi"]
    assert len(set(latin)) == len(latin)
    assert takes["hi"] == takes["en-GB"]


@pytest_twisted.ensureDeferred
async def test_unclaimed_languages_are_unsupported(kokoro: Worker) -> None:
    """Japanese and Chinese are not claimed (espeak-ng cannot read them for Kokoro)."""
    for language in ("ja", "zh"):
        status, body = await speak(kokoro, text="こんにちは", language=language)
        assert status == 422
        assert json.loads(body)["error"]["code"] == "unsupported"


@pytest_twisted.ensureDeferred
async def test_text_with_nothing_to_pronounce_is_bad_request(kokoro: Worker) -> None:
    """A text espeak-ng makes no phonemes of is refused naming "text", not spoken as silence."""
    status, body = await speak(kokoro, text="♪ ♪")
    assert status == 400
    assert json.loads(body)["error"]["field"] == "text"


@pytest_twisted.ensureDeferred
async def test_identical_requests_give_identical_bytes(kokoro: Worker) -> None:
    """The seed-reproducibility claim: the same request twice is the same audio, byte for byte."""
    status, capabilities = await kokoro.json("GET", "/capabilities")
    assert capabilities["variants"][VARIANT]["seeding"]["reproducible"] is True
    first = await pcm(kokoro, text="Same words, same sound.", seed=7)
    second = await pcm(kokoro, text="Same words, same sound.", seed=7)
    assert first == second


@pytest_twisted.ensureDeferred
async def test_long_text_streams_a_segment_at_a_time(kokoro: Worker) -> None:
    """
    A text of several segments streams: the first audio (a short first segment) arrives
    well before the last, and the joint after a segment that ends a sentence carries the
    adapter's quarter second of silence, while the joint cut inside a sentence carries
    none: its segments are "It was late." (30 characters at most), then "The lamps were
    out. The station had emptied hours before," (60 at most, cut at a clause), then the
    rest.
    """
    text = ("It was late. The lamps were out. The station had emptied hours before, and the "
            "last train was long gone, so she walked home along the river.")
    body = json.dumps({"text": text, "format": "pcm", "stream": True}).encode()
    response = await deferred_raw(kokoro.socket_path, "POST", "/speak", body)
    assert response.status == 200 and response.complete
    assert len(response.chunks) >= 2
    spread = response.arrivals[-1] - response.arrivals[0]
    assert spread > 1.0, f"all audio arrived within {spread:.2f} s"
    audio = response.body
    assert_speech(audio, text)
    samples = array("h")
    samples.frombytes(audio)
    # The joint's silence is written as zeros; the model's own pauses are quiet, not
    # zero (a quarter second of exact zeros from it would be a coincidence).
    joint = RATE // 4
    runs, run = [], 0
    for sample in samples:
        if sample == 0:
            run += 1
            continue
        if run:
            runs.append(run)
        run = 0
    long_runs = [r for r in runs if r >= joint // 2]
    # One, the joint's (a zero sample of the model's own may touch either edge of it).
    assert len(long_runs) == 1 and joint <= long_runs[0] <= joint + 2, f"runs of zeros: {sorted(runs)[-3:]}"


@pytest_twisted.ensureDeferred
async def test_two_requests_are_synthesised_at_once_each_as_if_alone(kokoro: Worker) -> None:
    """
    Two generations run at once on the one session: a short request sent while a slow
    one is being synthesised is answered in full before any of the slow one's audio,
    where one generation at a time would make it wait for the slow one; and each comes
    out byte for byte as it does alone, so neither run disturbs the other.
    """
    slow = json.dumps({"text": "The lamp was lit at nine.", "params": {"speed": 0.5},
                       "format": "pcm", "stream": False}).encode()
    quick = json.dumps({"text": "Hello.", "format": "pcm", "stream": False}).encode()
    status, body = await kokoro.json("POST", "/load", {"variant": VARIANT})
    assert status == 200, body
    pending = deferred_raw(kokoro.socket_path, "POST", "/speak", slow)
    # Time for the slow request to reach its generation before the quick one is asked.
    await deferLater(kokoro.reactor, 0.3, lambda: None)
    answered = await deferred_raw(kokoro.socket_path, "POST", "/speak", quick)
    delayed = await pending
    assert answered.status == delayed.status == 200
    assert answered.arrivals[-1] < delayed.arrivals[0]
    assert_speech(delayed.body, "The lamp was lit at nine.")
    alone = await deferred_raw(kokoro.socket_path, "POST", "/speak", slow)
    assert delayed.body == alone.body
    alone = await deferred_raw(kokoro.socket_path, "POST", "/speak", quick)
    assert answered.body == alone.body


@pytest_twisted.ensureDeferred
async def test_a_generation_gives_its_memory_back(fresh: Worker) -> None:
    """
    The worker's resident memory after a generation is back near where it was before,
    though the run needed far more while it lasted: onnxruntime's arena shrinks at the
    end of every run instead of keeping its largest size.
    """
    status, body = await fresh.json("POST", "/load", {"variant": VARIANT})
    assert status == 200, body
    await pcm(fresh, text="Hi.")
    before = resident_kib(fresh.pid)
    audio = await pcm(fresh, text="The lamp was lit at nine.", params={"speed": 0.5})
    after = resident_kib(fresh.pid)
    peak = peak_kib(fresh.pid)
    assert seconds(audio) > 3.0
    # Measured: about 11 MiB kept and 67 MiB given back; an arena that keeps its size
    # leaves the worker at its peak, about 57 MiB up.
    assert after - before < 25 * 1024, (before, after, peak)
    assert peak - after > 40 * 1024, (before, after, peak)


# -- voices -----------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_a_voicepack_speaks_exactly_as_the_voice_it_holds(kokoro: Worker) -> None:
    """
    bf_emma's style array uploaded as a .npy (510x1x256) and as a .pt (510x256) makes
    voices that speak byte for byte as bf_emma does.
    """
    status, voices = await kokoro.json("GET", "/voices")
    names = [v["id"] for v in voices if v["builtin"]]
    emma = builtin_style("bf_emma", names)
    status, made = await create(kokoro, {"id": "emma-npy", "label": "Emma (npy)"},
                                {"reference": ("emma.npy", npy((510, 1, 256), emma))})
    assert status == 201, made
    assert (made["builtin"], made["tags"]) == (False, ["voicepack"])
    status, made = await create(kokoro, {"id": "emma-pt"},
                                {"reference": ("emma.pt", tensor_pt((510, 256), emma))})
    assert status == 201, made
    text = "Good evening."
    original = await pcm(kokoro, text=text, voice="bf_emma", language="en-GB")
    assert await pcm(kokoro, text=text, voice="emma-npy", language="en-GB") == original
    assert await pcm(kokoro, text=text, voice="emma-pt", language="en-GB") == original
    for voice_id in ("emma-npy", "emma-pt"):
        status, _ = await kokoro.json("DELETE", f"/voices/{voice_id}")
        assert status == 204


@pytest_twisted.ensureDeferred
async def test_a_blend_is_the_weighted_sum_and_sounds_like_neither(kokoro: Worker) -> None:
    """
    af_heart(3)+am_adam(1) is stored as 0.75 of one array plus 0.25 of the other, and
    speaks differently from both of its components.
    """
    status, voices = await kokoro.json("GET", "/voices")
    names = [v["id"] for v in voices if v["builtin"]]
    status, made = await create(kokoro, {"id": "mix", "label": "Mix", "blend": "af_heart(3)+am_adam(1)"})
    assert status == 201, made
    assert made["description"] == "Blend of af_heart 75%, am_adam 25%"
    stored = array("f")
    stored.frombytes((kokoro_voice_dir(kokoro) / "mix.npy").read_bytes()[128:])
    heart, adam = array("f"), array("f")
    heart.frombytes(builtin_style("af_heart", names))
    adam.frombytes(builtin_style("am_adam", names))
    assert all(abs(s - (0.75 * h + 0.25 * a)) < 1e-6 for s, h, a in zip(stored, heart, adam))
    text = "Which voice is this?"
    takes = [await pcm(kokoro, text=text, voice=v) for v in ("mix", "af_heart", "am_adam")]
    assert len(set(takes)) == 3
    assert_speech(takes[0], text)
    status, _ = await kokoro.json("DELETE", "/voices/mix")
    assert status == 204


def kokoro_voice_dir(worker: Worker) -> Path:
    return Path(worker.socket_path).parent / "voices"


@pytest_twisted.ensureDeferred
async def test_making_voices_loads_no_model(fresh: Worker) -> None:
    """A voicepack and a blend are created, listed and deleted with no model ever loaded."""
    status, voices = await fresh.json("GET", "/voices")
    names = [v["id"] for v in voices if v["builtin"]]
    pack = npy((510, 256), builtin_style("ff_siwis", names))
    status, _ = await create(fresh, {"id": "pack"}, {"reference": ("p.npy", pack)})
    assert status == 201
    status, _ = await create(fresh, {"id": "mixed", "blend": "pack(1)+bm_george(1)"})
    assert status == 201
    status, voices = await fresh.json("GET", "/voices")
    assert {"pack", "mixed"} <= {v["id"] for v in voices if not v["builtin"]}
    status, health = await fresh.json("GET", "/health")
    assert health["model"] == "unloaded"
    for voice_id in ("pack", "mixed"):
        status, _ = await fresh.json("DELETE", f"/voices/{voice_id}")
        assert status == 204


@pytest_twisted.ensureDeferred
async def test_bad_references_are_refused_and_nothing_runs(fresh: Worker, tmp_path: Path) -> None:
    """
    A wrong shape is bad_request on "reference"; a WAV is unsupported; a .pt whose pickle
    would run `touch` is refused and the marker never appears; no voice is left behind.
    """
    status, body = await create(fresh, {"id": "wrong"},
                                {"reference": ("w.npy", npy((256, 510), bytes(256 * 510 * 4)))})
    assert (status, body["error"]["code"], body["error"]["field"]) == (400, "bad_request", "reference")
    assert "(256, 510)" in body["error"]["message"]
    status, body = await create(fresh, {"id": "clip"}, {"reference": ("clip.wav", sine_wav(220.0, 0.5))})
    assert (status, body["error"]["code"]) == (422, "unsupported")
    marker = tmp_path / "unpickled"
    status, body = await create(fresh, {"id": "evil"}, {"reference": ("evil.pt", evil_pt(marker))})
    assert (status, body["error"]["code"], body["error"]["field"]) == (400, "bad_request", "reference")
    assert "os.system" in body["error"]["message"]
    assert not marker.exists()
    status, voices = await fresh.json("GET", "/voices")
    assert all(v["builtin"] for v in voices)
    assert not list(kokoro_voice_dir(fresh).glob("*.npy"))
