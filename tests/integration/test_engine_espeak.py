"""
The eSpeak NG engine as a real worker, spawned with its own virtualenv's interpreter
(.venvs/espeak): what it claims agrees with its catalog record and with espeak's own
data, and every claim is heard in the audio it makes (duration, level, pitch).
"""

from __future__ import annotations

import configparser
import io
import json
import re
import subprocess
import time
import wave
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
import pytest_twisted
from twisted.internet.defer import ensureDeferred, gatherResults
from twisted.internet.threads import deferToThread

from _worker import ROOT, RawResponse, Worker, deferred_raw, engine_python, rms, spawn_worker
from rhapsode_engine_tone._pitch import estimate
from test_conform import check_summary, conform, failures, lines_of

ENGINE = ROOT / "engines" / "espeak"
RATE = 22050
SENTENCE = "The quick brown fox jumps over the lazy dog, and then runs far away into the woods."
VOICE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


def body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def seconds(pcm: bytes) -> float:
    return len(pcm) / 2 / RATE


def pitch(pcm: bytes) -> float:
    """
    The speaker's median fundamental in Hz (the tone engine's estimator, pure Python).
    """
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(pcm)
    return estimate(out.getvalue()).pitch


async def spawn(tmp: Path) -> Worker:
    from twisted.internet import reactor

    return await spawn_worker(
        reactor, tmp, module="rhapsode_engine_espeak", engine="espeak", python=engine_python("espeak")
    )


@pytest_twisted.async_yield_fixture(scope="module")
async def espeak(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Worker]:
    """
    One eSpeak NG worker shared by the module's tests.
    """
    worker = await spawn(tmp_path_factory.mktemp("espeak"))
    yield worker
    await worker.stop()


async def speak(worker: Worker, **fields: Any) -> RawResponse:
    fields.setdefault("format", "pcm")
    fields.setdefault("stream", False)
    response = await deferred_raw(worker.socket_path, "POST", "/speak", body(**fields))
    assert response.status == 200 and response.complete, response.body[:300]
    return response


async def pcm(worker: Worker, **fields: Any) -> bytes:
    return (await speak(worker, **fields)).body


def espeak_data() -> Path:
    """
    The espeak-ng-data directory of the worker's own espeakng-loader, as it reports it.
    """
    out = subprocess.run(
        [engine_python("espeak"), "-c", "import espeakng_loader; print(espeakng_loader.get_data_path())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip())


@pytest_twisted.ensureDeferred
async def test_capabilities_agree_with_the_catalog_record(espeak: Worker) -> None:
    """
    The catalog record the core reads before install says what the running adapter says:
    id, licences, default variant, and the Python range setup.cfg declares.
    """
    catalog = json.loads((ENGINE / "catalog.json").read_text())
    setup = configparser.ConfigParser()
    setup.read(ENGINE / "setup.cfg")
    _, caps = await espeak.json("GET", "/capabilities")
    assert catalog["id"] == caps["engine"]["id"] == "espeak"
    assert catalog["displayName"] == caps["engine"]["displayName"]
    assert catalog["module"] == "rhapsode_engine_espeak"
    assert catalog["distribution"] == setup["metadata"]["name"]
    assert catalog["license"] == caps["license"]
    assert catalog["license"]["code"] == "GPL-3.0-or-later"
    # No weights: it names the licence of the voice data it speaks from, and says so.
    assert catalog["license"]["weights"] == "GPL-3.0-or-later"
    assert catalog["license"]["weightsCommercialUse"] is True
    assert "espeak-ng-data" in catalog["license"]["notes"]
    assert catalog["defaultVariant"] in caps["variants"]
    assert catalog["python"] == setup["options"]["python_requires"]
    assert caps["engine"]["upstreamVersion"] == "1.52.0"


@pytest_twisted.ensureDeferred
async def test_the_variant_claims_what_espeak_varies(espeak: Worker) -> None:
    """
    One variant: no cues, both deliveries, espeak's four parameters with their own
    ranges, no seed reproducibility, 400-character segments joined by espeak's own
    pause, and its languages with English first.
    """
    _, caps = await espeak.json("GET", "/capabilities")
    assert list(caps["variants"]) == ["default"]
    variant = caps["variants"]["default"]
    assert variant["cues"] == []
    assert variant["deliveries"] == ["hushed", "frantic"]
    assert variant["dials"] == {
        "rate": {"min": 80, "max": 450, "default": 175},
        "pitch": {"min": 0, "max": 100, "default": 50},
        "volume": {"min": 0, "max": 200, "default": 100},
        "wordGap": {"min": 0, "max": 100, "default": 0},
    }
    assert variant["seeding"] == {"reproducible": False}
    assert variant["maxCharacters"] == 4096
    assert variant["segmentation"] == {"supported": True, "segmentCharacters": 400, "jointSilenceMs": 0}
    assert variant["languages"][0] == "en"
    assert {"en-us", "en-gb", "fr", "de", "es", "ru", "cmn", "ja", "hi", "ar"} <= set(variant["languages"])
    assert len(variant["languages"]) > 100


@pytest_twisted.ensureDeferred
async def test_voices_are_espeaks_variants(espeak: Worker) -> None:
    """
    The voices listed are espeak's variants, one each, labelled with the name in each
    variant file of the wheel's espeak-ng-data, with ids that fit the rule.
    """
    names = set()
    for path in (espeak_data() / "voices" / "!v").iterdir():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("name "):
                names.add(line[len("name "):].strip())
    code, voices = await espeak.json("GET", "/voices")
    assert code == 200
    assert {v["label"] for v in voices} == names
    ids = [v["id"] for v in voices]
    assert len(set(ids)) == len(ids) == len(names)
    assert all(VOICE_ID.match(i) for i in ids)
    assert {"female3", "male2", "whisper", "klatt"} <= set(ids)


@pytest_twisted.ensureDeferred
async def test_every_voice_speaks_and_they_differ(espeak: Worker) -> None:
    """
    Every listed voice says a sentence aloud, and a female variant speaks higher than
    the language's own (male) voice.
    """
    _, voices = await espeak.json("GET", "/voices")
    for voice in voices:
        audio = await pcm(espeak, text="Hello there.", voice=voice["id"])
        assert seconds(audio) > 0.3 and rms(audio) > 100, voice["id"]
    plain = await pcm(espeak, text=SENTENCE)
    female = await pcm(espeak, text=SENTENCE, voice="female3")
    assert pitch(female) > 1.4 * pitch(plain)


@pytest_twisted.ensureDeferred
async def test_speech_streams_at_22050_hz_with_a_plausible_length(espeak: Worker) -> None:
    """
    A stream arrives in several chunks of 22050 Hz mono PCM, audible, lasting 0.03-0.2 s
    a character; a buffered WAV says 22050 Hz in its header.
    """
    text = " ".join([SENTENCE] * 3)
    response = await speak(espeak, text=text, stream=True)
    assert response.headers["content-type"] == f"audio/L16; rate={RATE}; channels=1"
    assert len(response.chunks) > 1
    assert 0.03 * len(text) < seconds(response.body) < 0.2 * len(text)
    assert rms(response.body) > 1000
    wav = await speak(espeak, text=SENTENCE, format="wav")
    with wave.open(io.BytesIO(wav.body)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (RATE, 1, 2)


@pytest_twisted.ensureDeferred
async def test_longer_text_makes_longer_audio(espeak: Worker) -> None:
    """
    Three sentences last about three times as long as one.
    """
    one = seconds(await pcm(espeak, text=SENTENCE))
    three = seconds(await pcm(espeak, text=" ".join([SENTENCE] * 3)))
    assert 2.7 * one < three < 3.6 * one


@pytest_twisted.ensureDeferred
async def test_segments_join_with_espeaks_own_sentence_pause(espeak: Worker) -> None:
    """
    Text over 400 characters is spoken in segments, and the joint between them carries
    espeak's own pause after a sentence, as a sentence boundary inside a segment does:
    two halves spoken together last as long as both alone plus one such pause (about
    0.3 s at the default rate), neither losing a pause at the joint nor doubling one.
    """
    first = " ".join(f"This is sentence number {n} of the first half, and it runs on for some time." for n in range(4))
    second = " ".join(f"Here is sentence number {n} of the second half, which is also long." for n in range(4))
    together = first + " " + second
    assert len(first) < 400 and len(second) < 400 < len(together)
    a = seconds(await pcm(espeak, text=first))
    b = seconds(await pcm(espeak, text=second))
    both = seconds(await pcm(espeak, text=together))
    assert 0.22 < both - a - b < 0.38


@pytest_twisted.ensureDeferred
async def test_each_dial_is_heard(espeak: Worker) -> None:
    """
    rate changes the length, volume the level, pitch the fundamental, and word gap
    adds a pause between words.
    """
    slow = await pcm(espeak, text=SENTENCE, params={"rate": 80})
    fast = await pcm(espeak, text=SENTENCE, params={"rate": 450})
    assert seconds(slow) > 3.5 * seconds(fast)
    quiet = await pcm(espeak, text=SENTENCE, params={"volume": 40})
    loud = await pcm(espeak, text=SENTENCE, params={"volume": 160})
    assert rms(loud) > 2.5 * rms(quiet)
    low = await pcm(espeak, text=SENTENCE, params={"pitch": 10})
    high = await pcm(espeak, text=SENTENCE, params={"pitch": 90})
    assert pitch(high) > 1.3 * pitch(low)
    plain = await pcm(espeak, text=SENTENCE)
    gapped = await pcm(espeak, text=SENTENCE, params={"wordGap": 30})
    # 16 words: 15 gaps of 300 ms.
    assert seconds(gapped) - seconds(plain) > 3.0


@pytest.mark.parametrize("voice", [None, "female3"])
@pytest_twisted.ensureDeferred
async def test_deliveries_are_heard_relative_to_the_voice(espeak: Worker, voice: str | None) -> None:
    """
    Against the same voice read plainly, hushed is quieter, lower and slower, and
    frantic louder, higher and faster.
    """
    fields: dict[str, Any] = {"text": SENTENCE} if voice is None else {"text": SENTENCE, "voice": voice}
    plain = await pcm(espeak, **fields)
    hushed = await pcm(espeak, delivery="hushed", **fields)
    frantic = await pcm(espeak, delivery="frantic", **fields)
    assert rms(hushed) < 0.6 * rms(plain) and rms(frantic) > 1.1 * rms(plain)
    assert seconds(hushed) > 1.1 * seconds(plain) > 1.1**2 * seconds(frantic)
    assert pitch(hushed) < 0.95 * pitch(plain) and pitch(frantic) > 1.05 * pitch(plain)


@pytest_twisted.ensureDeferred
async def test_every_claimed_language_speaks(espeak: Worker) -> None:
    """
    Each language the variant lists makes sound, so none is claimed whose dictionary
    the wheel lacks (it ships none for Faroese, for one).
    """
    _, caps = await espeak.json("GET", "/capabilities")
    languages = caps["variants"]["default"]["languages"]
    assert "fo" not in languages
    for language in languages:
        audio = await pcm(espeak, text="a", language=language)
        assert rms(audio) > 100, language


@pytest_twisted.ensureDeferred
async def test_languages_read_in_their_own_words(espeak: Worker) -> None:
    """
    A handful of languages each read their own text audibly, and the same digits read
    in each come out at lengths no two share: each says its own number words.
    """
    native = {
        "en": "Good morning, how are you today?",
        "fr": "Bonjour, comment allez-vous aujourd'hui ?",
        "de": "Guten Morgen, wie geht es Ihnen heute?",
        "es": "Buenos días, ¿cómo está usted hoy?",
        "ru": "Доброе утро, как у вас дела сегодня?",
        "cmn": "早上好，你今天好吗？",
        "ja": "おはようございます、お元気ですか？",
        "hi": "सुप्रभात, आज आप कैसे हैं?",
        "ar": "صباح الخير، كيف حالك اليوم؟",
    }
    for language, text in native.items():
        audio = await pcm(espeak, text=text, language=language)
        assert seconds(audio) > 1.0 and rms(audio) > 1000, language
    lengths = {
        language: len(await pcm(espeak, text="17, 42, 365, 1999.", language=language)) for language in native
    }
    assert len(set(lengths.values())) == len(native), lengths


@pytest_twisted.ensureDeferred
async def test_tags_and_embedded_commands_are_not_performed(espeak: Worker) -> None:
    """
    A cue (none is claimed) and an espeak embedded command (control-A, here setting
    the amplitude to 20) are removed before espeak sees the text: the audio has the
    plain text's length and level (to the few milliseconds by which espeak's take on
    one text varies from the last).
    """
    plain = await pcm(espeak, text="Hello there and goodbye.")
    for text in ("Hello there [laugh] and goodbye.", "Hello there \x0120A and goodbye."):
        other = await pcm(espeak, text=text)
        assert abs(seconds(other) - seconds(plain)) < 0.03, text
        assert abs(rms(other) - rms(plain)) < 0.05 * rms(plain), text


@pytest.mark.parametrize(
    "text",
    ["\x01\x02\x07\x1b", "\u200b\u200f\u2066\u2069\ufeff", "\U0001f600\U0001f389 \u2764\ufe0f"],
    ids=["control", "invisible", "emoji"],
)
@pytest_twisted.ensureDeferred
async def test_text_with_nothing_to_say_is_the_clients_fault(espeak: Worker, text: str) -> None:
    """
    Control characters, zero-width and direction marks, or emoji alone are 400
    bad_request naming "text" before espeak sees them, never a 500.
    """
    code, answer = await espeak.json("POST", "/speak", {"text": text})
    assert (code, answer["error"]["code"], answer["error"]["field"]) == (400, "bad_request", "text")


@pytest_twisted.ensureDeferred
async def test_letters_among_control_characters_are_spoken(espeak: Worker) -> None:
    """
    Letters among control and invisible characters are spoken, about as long as the
    letters alone, in a language matched without case.
    """
    plain = await pcm(espeak, text="Hello there, world.")
    noisy = await pcm(espeak, text="Hello\x07 there,\x1b world\u200b.", language="EN")
    assert abs(seconds(noisy) - seconds(plain)) < 0.03 and rms(noisy) > 0


@pytest_twisted.ensureDeferred
async def test_starting_and_speaking_write_nothing_from_espeak_to_stderr(tmp_path: Path) -> None:
    """
    A worker's start-up (which lists and probes every voice) and a load and a speak
    leave only the SDK's JSON log lines on stderr: no "Can't read dictionary file" for
    the voices whose dictionaries the wheel does not ship, which are never probed.
    """
    worker = await spawn(tmp_path)
    try:
        await pcm(worker, text=SENTENCE)
    finally:
        await worker.stop()
    stderr = worker.protocol.stderr.decode("utf-8", "replace")
    assert "Can't read dictionary" not in stderr
    assert [line for line in stderr.splitlines() if line and not line.startswith("{")] == []


@pytest_twisted.ensureDeferred
async def test_fresh_workers_agree_but_one_worker_drifts(tmp_path: Path) -> None:
    """
    Why seed reproducibility is not claimed: two fresh workers give the same request the
    same bytes, but one worker asked twice does not, because espeak's wave generator
    carries state from one utterance into the next (which moves even the length by a
    few milliseconds).
    """
    first = await spawn(tmp_path / "a")
    second = await spawn(tmp_path / "b")
    try:
        one = await pcm(first, text=SENTENCE, seed=7)
        two = await pcm(second, text=SENTENCE, seed=7)
        again = await pcm(first, text=SENTENCE, seed=7)
    finally:
        await first.stop()
        await second.stop()
    assert one == two
    assert again != one and abs(seconds(again) - seconds(one)) < 0.03


@pytest_twisted.ensureDeferred
async def test_a_hang_up_stops_synthesis_and_the_next_request_is_whole(espeak: Worker) -> None:
    """
    A client that hangs up after the first chunk of a long text abandons its synthesis,
    and the worker then speaks the next request whole.
    """
    text = " ".join([SENTENCE] * 40)
    cut = await deferred_raw(
        espeak.socket_path, "POST", "/speak", body(text=text, format="pcm"), recv_size=4096, stop_after=4096
    )
    assert not cut.complete
    plain = await pcm(espeak, text=SENTENCE)
    after = await pcm(espeak, text=SENTENCE)
    assert abs(seconds(after) - seconds(plain)) < 0.03


@pytest_twisted.ensureDeferred
async def test_two_callers_at_once_each_get_their_whole_text(espeak: Worker) -> None:
    """
    Two long requests at once (espeak is not re-entrant, so they take turns) each come
    back whole, as long as each does alone.
    """
    text = " ".join([SENTENCE] * 12)
    alone = seconds(await pcm(espeak, text=text))
    a, b = await gatherResults(
        [ensureDeferred(speak(espeak, text=text, stream=True)) for _ in range(2)]
    )
    assert abs(seconds(a.body) - alone) < 0.1 and abs(seconds(b.body) - alone) < 0.1


@pytest_twisted.ensureDeferred
async def test_a_long_text_streams_in_pieces(espeak: Worker) -> None:
    """
    2000 characters (about two minutes of speech) stream back whole, in more than one
    piece.  How fast (first chunk, whole answer) is bench/latency.py's figure, not a
    test's: a timing depends on the box.
    """
    text = (" ".join([SENTENCE] * 25))[:2000]
    await pcm(espeak, text="warm up")
    response = await speak(espeak, text=text, stream=True)
    assert response.status == 200 and response.complete
    assert seconds(response.body) > 100
    assert len(response.arrivals) > 1


@pytest_twisted.ensureDeferred
async def test_conforms(espeak: Worker) -> None:
    """
    The conformance checker finds no FAIL; what it cannot decide is only what needs a
    cue or seed reproducibility, neither of which is claimed, a variant of one
    language, which espeak's is not, or an undeclared timestamps unit, where every unit
    is timed.
    """
    run = await deferToThread(conform, espeak.socket_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert failures(run) == {}
    check_summary(run)
    for line in lines_of(run, "cannot be decided "):
        assert re.search(
            r"claims none|does not claim seed reproducibility|does not claim it|every format|"
            r"lists more than one language|times every unit",
            line,
        ), line
