"""
Timestamps on the worker (protocol.md section 4), in memory (WorkerHarness): a variant
declares what it times; a request asks with the Accept of the framing that carries
them; the SDK refuses what the variant does not time before the adapter runs, frames
the adapter's timings as events (each before the audio holding its first sample) or
one JSON document (the contract's shape), and the tone engine's are exact.
"""

from __future__ import annotations

import base64
import io
import struct
import wave
from pathlib import Path
from typing import Any, Iterator, Mapping

import pytest

from rhapsode_engine_tone import ToneEngine
from rhapsode_protocol import contract, frames
from rhapsode_worker import (
    DialogueRequest,
    Engine,
    NativeFormat,
    SpeakRequest,
    Timestamps,
    Timing,
    Variant,
)
from rhapsode_worker.testing import WorkerHarness, WorkerResponse

EVENTS = {"Accept": "text/event-stream"}
DOCUMENT = {"Accept": "application/json"}
RATE = 24000


def stream_events(response: WorkerResponse) -> list[tuple[str, Any]]:
    assert response.code == 200, response.body[:300]
    assert response.headers["content-type"] == "text/event-stream"
    return response.events()


def check_ordered(events: list[tuple[str, Any]], header: int, frame: int = 2, rate: int = RATE) -> list[dict[str, Any]]:
    """
    Every timestamps event comes before the audio delta holding its entries' first
    sample: the audio sent before it ends at or before each entry's start.  Returns
    every entry, in order.
    """
    sent = 0
    entries: list[dict[str, Any]] = []
    for name, data in events:
        if name == "speech.audio.delta":
            sent += len(base64.b64decode(data["audio"]))
        elif name == "speech.timestamps.delta":
            contract.validate(contract.TIMESTAMPS_EVENT, data)
            played = max(sent - header, 0) / frame / rate
            for entry in data["alignment"]:
                assert played <= entry["start"] + 1e-6, (played, entry)
            entries.extend(data["alignment"])
    assert events[-1][0] == "speech.audio.done"
    return entries


def wav_pcm(audio: bytes) -> bytes:
    with wave.open(io.BytesIO(audio)) as w:
        return w.readframes(w.getnframes())


@pytest.fixture()
def tone(tmp_path: Path) -> WorkerHarness:
    return WorkerHarness(ToneEngine, tmp_path)


def test_the_capability_is_declared_per_variant_in_the_contracts_shape(tone: WorkerHarness) -> None:
    """
    Each tone variant says it times words and phonemes, exactly, with text offsets; the
    document holds to the contract.
    """
    caps = tone.get("/capabilities").json()
    contract.validate(contract.CAPABILITIES, caps)
    for variant in caps["variants"].values():
        assert variant["timestamps"] == {"units": ["word", "phoneme"], "source": "synthesizer", "textOffsets": True}


def test_tone_timings_are_exact_to_the_sample(tone: WorkerHarness) -> None:
    """
    The tone engine's words are exact: every start and end is a whole sample, what lies
    between two words is silence and what lies inside a word is not, and the last word
    ends where the audio does.
    """
    text = "Hello there, my good friend. How are you today?"
    response = tone.post("/speak", {"text": text, "format": "pcm", "stream": False, "timestamps": "word"}, DOCUMENT)
    document = response.json()
    contract.validate(contract.TIMED_AUDIO, document)
    pcm = base64.b64decode(document["audio"])
    samples = struct.unpack(f"<{len(pcm) // 2}h", pcm)
    words = document["alignment"]
    assert [w["text"] for w in words] == ["Hello", "there", "my", "good", "friend", "How", "are", "you", "today"]
    edges = []
    for word in words:
        assert text[word["textStart"]:word["textEnd"]] == word["text"]
        start, end = round(word["start"] * RATE), round(word["end"] * RATE)
        assert abs(word["start"] * RATE - start) < 0.05 and abs(word["end"] * RATE - end) < 0.05
        assert any(samples[start:end])
        edges.append((start, end))
    for (_, end), (start, _) in zip(edges, edges[1:]):
        assert end < start and not any(samples[end:start])
    assert edges[-1][1] == len(samples)
    assert document["durationMs"] == round(len(samples) * 1000 / RATE)


def test_events_put_each_timing_before_the_audio_of_its_first_sample(tone: WorkerHarness) -> None:
    """
    A stream with timestamps is the contract's events: timings first, every one before
    the audio delta that holds its first sample, through a long text split in segments,
    and a done event with the duration; the audio's own type is a header.
    """
    text = " ".join(["The ferry left the harbour at dawn, and the gulls followed it out."] * 6)
    response = tone.post("/speak", {"text": text, "format": "wav", "timestamps": "phoneme"}, EVENTS)
    events = stream_events(response)
    assert response.headers["x-rhapsode-audio-type"] == "audio/wav"
    assert events[0][0] == "speech.timestamps.delta"
    entries = check_ordered(events, header=44)
    words = [e for e in entries if e["unit"] == "word"]
    assert len(words) == len(text.split())
    for unit in ("word", "phoneme"):
        timed = [e for e in entries if e["unit"] == unit]
        assert all(a["end"] <= b["start"] for a, b in zip(timed, timed[1:]))
    for word in words:
        assert text[word["textStart"]:word["textEnd"]] == word["text"]
    assert events[-1][1]["durationMs"] == response.duration_ms


def test_the_core_gets_frames_with_the_audio_as_it_is(tone: WorkerHarness) -> None:
    """
    Asked with the core's Accept, a stream is frames: timings before the audio holding
    their first samples, the audio's bytes untouched, and an end with the duration; a
    buffered answer is its timings, its audio and an end saying what the audio is.
    """
    text = "One two three. Four five six."
    body = {"text": text, "format": "pcm", "timestamps": "word"}
    streamed = tone.post("/speak", body, {"Accept": frames.FRAMES})
    assert streamed.headers["content-type"] == frames.FRAMES
    assert streamed.headers["x-rhapsode-audio-type"] == "audio/L16; rate=24000; channels=1"
    found = frames.FrameReader().feed(streamed.body)
    played, words = 0, []
    for kind, payload in found:
        if kind == frames.AUDIO:
            played += len(payload)
        elif kind == frames.TIMINGS:
            assert all(played / 2 / RATE <= entry["start"] + 1e-6 for entry in payload)
            words.extend(entry["text"] for entry in payload)
    assert words == ["One", "two", "three", "Four", "five", "six"]
    assert found[-1] == (frames.DONE, {"durationMs": streamed.duration_ms})
    plain = tone.post("/speak", {"text": text, "format": "pcm", "seed": 1})
    timed = tone.post("/speak", {**body, "seed": 1}, {"Accept": frames.FRAMES})
    audio = b"".join(p for k, p in frames.FrameReader().feed(timed.body) if k == frames.AUDIO)
    assert audio == plain.body  # the same bytes, timed or not
    whole = tone.post("/speak", {**body, "stream": False}, {"Accept": frames.FRAMES})
    kinds = [kind for kind, _ in frames.FrameReader().feed(whole.body)]
    assert kinds == [frames.TIMINGS, frames.AUDIO, frames.DONE]
    end = frames.FrameReader().feed(whole.body)[-1][1]
    assert end == {"format": "pcm", "contentType": "audio/L16; rate=24000; channels=1", "sampleRate": RATE,
                   "channels": 1, "durationMs": whole.duration_ms}


def test_a_dialogues_timings_carry_turn_and_speaker(tone: WorkerHarness) -> None:
    """
    Dialogue times each turn's words with offsets into that turn's text, its index and
    its speaker, after the turns before it.
    """
    body = {
        "variant": "classic", "stream": False, "timestamps": "word",
        "turns": [{"speaker": "ann", "text": "Good morning."}, {"speaker": "bob", "text": "[x] Morning, Ann."}],
    }
    document = tone.post("/dialogue", body, DOCUMENT).json()
    contract.validate(contract.TIMED_AUDIO, document)
    words = document["alignment"]
    assert [(w["text"], w["turn"], w["speaker"]) for w in words] == [
        ("Good", 0, "ann"), ("morning", 0, "ann"), ("Morning", 1, "bob"), ("Ann", 1, "bob"),
    ]
    assert body["turns"][1]["text"][words[2]["textStart"]:words[2]["textEnd"]] == "Morning"
    assert words[2]["start"] > words[1]["end"]


@pytest.mark.parametrize(
    "body, headers",
    [
        ({"stream": True}, {}),
        ({"stream": True}, {"Accept": "*/*"}),
        ({"stream": True}, {"Accept": "text/event-stream;q=0, application/json"}),
        ({"stream": False}, {}),
        ({"stream": False}, {"Accept": "text/event-stream"}),
    ],
)
def test_timestamps_without_the_accept_of_their_framing_are_bad_request(
    tone: WorkerHarness, body: dict[str, Any], headers: Mapping[str, str]
) -> None:
    """
    Raw audio has no place for timings: a request for them that does not accept the
    framing carrying them is refused, naming the field, before anything is synthesised.
    """
    response = tone.post("/speak", {"text": "Hello.", "timestamps": "word", **body}, headers)
    assert response.code == 400
    error = response.json()["error"]
    assert error["code"] == "bad_request" and error["field"] == "timestamps"
    assert "Accept: " + ("text/event-stream" if body["stream"] else "application/json") in error["message"]
    assert tone.pool.ran == []  # nothing loaded, nothing synthesised


class Heard(Engine):
    """
    Records what reached it; its variants time words only, or nothing.
    """

    id = "heard"
    native_format = NativeFormat(sample_rate=RATE, encoding="pcm_f32le")
    default_variant = "timed"

    def __init__(self, context: Any = None) -> None:
        super().__init__(context)
        self.heard: list[Any] = []

    def variants(self) -> Mapping[str, Variant]:
        return {
            "timed": Variant(timestamps=Timestamps(units=("word",), source="model", text_offsets=True)),
            "plain": Variant(),
        }

    def speak(self, request: SpeakRequest) -> Iterator[bytes | Timing]:
        self.heard.append(request)
        second = struct.pack("<f", 0.25) * (RATE // 10)
        if request.timestamps:
            # Overlapping words of one expansion, handed over together before their audio.
            yield Timing("word", 0.0, 0.05, text_start=0, text_end=2)
            yield Timing("word", 0.05, 0.1, text_start=1, text_end=3)
        yield second[:-3]  # a float split across two chunks
        if request.timestamps:
            yield Timing("word", 0.1, 0.2, text_start=4, text_end=8)
        yield second[-3:] + second

    def dialogue(self, request: DialogueRequest) -> Iterator[bytes | Timing]:
        self.heard.append(request)
        yield struct.pack("<f", 0.25) * RATE


def test_a_unit_the_variant_does_not_time_is_unsupported_and_the_adapter_never_hears_of_it(tmp_path: Path) -> None:
    """
    phoneme from a variant that times words, and anything from one that times nothing,
    are unsupported naming timestamps, before the adapter is called; a request without
    the field reaches the adapter with timestamps None.
    """
    worker = WorkerHarness(Heard, tmp_path)
    engine = worker.engine
    assert isinstance(engine, Heard)
    caps = worker.get("/capabilities").json()
    assert "timestamps" not in caps["variants"]["plain"]
    for variant, unit in (("timed", "phoneme"), ("plain", "word")):
        for path, body in (("/speak", {"text": "Hello."}), ("/dialogue", {"turns": [{"speaker": "a", "text": "Hi."}]})):
            refused = worker.post(path, {**body, "variant": variant, "timestamps": unit, "stream": False}, DOCUMENT)
            assert refused.code == 422, refused.body
            assert refused.json()["error"]["field"] == "timestamps"
    assert engine.heard == []
    assert worker.post("/speak", {"text": "Hello.", "variant": "plain", "stream": False}).code == 200
    assert [request.timestamps for request in engine.heard] == [None]


def test_overlapping_words_are_merged_and_float_pcm_passes_timings_through(tmp_path: Path) -> None:
    """
    Words whose text overlaps, handed over together, are one entry; timings pass the
    SDK's float conversion in their place, and the audio is whole.
    """
    worker = WorkerHarness(Heard, tmp_path)
    response = worker.post("/speak", {"text": "3:45 pm", "format": "pcm", "timestamps": "word"}, EVENTS)
    entries = check_ordered(stream_events(response), header=0)
    assert entries == [
        {"unit": "word", "text": "3:4", "start": 0.0, "end": 0.1, "textStart": 0, "textEnd": 3},
        {"unit": "word", "text": "pm", "start": 0.1, "end": 0.2, "textStart": 5, "textEnd": 7},
    ]
    audio = b"".join(base64.b64decode(d["audio"]) for n, d in response.events() if n == "speech.audio.delta")
    assert len(audio) == 2 * 2 * (RATE // 10)
