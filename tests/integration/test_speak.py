"""
Speaking through a real tone worker (protocol.md sections 4, 6 and 8): streaming and
buffered responses, the duration header and trailer, every format decoding to the right
length, first audio for a second caller, and a slow reader that does not grow the worker.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from twisted.internet.defer import gatherResults
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread

from _worker import Worker, decode_pcm, deferred_raw, resident_kib, rms, spawn_worker

RATE = 24000
LONG = " ".join(
    f"Sentence number {i} rolls along at an ordinary pace, with a comma, and a full stop." for i in range(12)
)


def body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


@pytest_twisted.ensureDeferred
async def test_stream_is_chunked_in_pieces_and_ends_with_duration_trailer(tone: Worker) -> None:
    """
    C{stream: true} arrives chunked, in more than one piece, declares its trailer up front
    and ends with X-Rhapsode-Duration-Ms matching the PCM that arrived.
    """
    response = await deferred_raw(tone.socket_path, "POST", "/speak", body(text=LONG, format="pcm", seed=1))
    assert response.status == 200 and response.complete
    assert response.headers["transfer-encoding"] == "chunked"
    assert response.headers["trailer"].lower() == "x-rhapsode-duration-ms"
    assert response.headers["content-type"] == f"audio/L16; rate={RATE}; channels=1"
    assert len(response.chunks) > 1
    assert int(response.trailers["x-rhapsode-duration-ms"]) == round(len(response.body) // 2 * 1000 / RATE)


@pytest_twisted.ensureDeferred
async def test_speak_by_another_method_or_below_is_routed_like_any_path(tone: Worker) -> None:
    """
    POST /speak skips the worker's router, but GET /speak and a path below /speak are
    refused as any unrouted request is, at the head, in the envelope: 405 with Allow for
    the wrong method, 404 for no such path.
    """
    response = await deferred_raw(tone.socket_path, "GET", "/speak", body(text="hi"))
    error = json.loads(response.body)["error"]
    assert (response.status, error["code"], error["field"]) == (405, "bad_request", "method")
    response = await deferred_raw(tone.socket_path, "POST", "/speak/now", body(text="hi"))
    error = json.loads(response.body)["error"]
    assert (response.status, error["code"], error["field"]) == (404, "bad_request", "path")
    assert error["message"] == "no route /speak/now"


@pytest_twisted.ensureDeferred
async def test_buffered_response_has_length_and_duration_header(tone: Worker) -> None:
    """
    C{stream: false} sets Content-Length and the duration header, and the body is the
    same audio the same seeded request gives again.  (Streamed, the same request is cut
    with tone's shorter first segment: one generation and one joint more.)
    """
    buffered = await deferred_raw(tone.socket_path, "POST", "/speak", body(text=LONG, format="pcm", seed=4, stream=False))
    again = await deferred_raw(tone.socket_path, "POST", "/speak", body(text=LONG, format="pcm", seed=4, stream=False))
    streamed = await deferred_raw(tone.socket_path, "POST", "/speak", body(text=LONG, format="pcm", seed=4))
    assert buffered.status == 200 and buffered.complete
    assert int(buffered.headers["content-length"]) == len(buffered.body)
    assert int(buffered.headers["x-rhapsode-duration-ms"]) == round(len(buffered.body) // 2 * 1000 / RATE)
    assert buffered.body == again.body
    assert streamed.complete and "content-length" not in streamed.headers and len(streamed.body) > RATE


@pytest.mark.parametrize("fmt", ["wav", "pcm", "flac", "opus", "mp3"])
@pytest.mark.parametrize("stream", [False, True])
@pytest_twisted.ensureDeferred
async def test_every_format_decodes_to_the_duration(tone: Worker, fmt: str, stream: bool) -> None:
    """
    Each declared format decodes back to the reported duration within 50 ms and is not
    silence.  (MP3 carries its encoder's priming, 1105 samples plus up to a frame, which
    no player can trim from a stream without a seekable header; that is allowed for.)
    """
    _, caps = await tone.json("GET", "/capabilities")
    assert fmt in caps["formats"]
    text = "The quick brown fox jumps over the lazy dog, twice, and then sits down."
    # The same request as pcm, streamed or not as this one is (a stream's first segment is
    # cut shorter, so its audio differs from a buffered answer's by a joint).
    reference = await deferred_raw(tone.socket_path, "POST", "/speak", body(text=text, format="pcm", seed=9, stream=stream))
    expected = len(reference.body) / 2 / RATE
    response = await deferred_raw(tone.socket_path, "POST", "/speak", body(text=text, format=fmt, seed=9, stream=stream))
    assert response.status == 200 and response.complete
    pcm = await deferToThread(decode_pcm, response.body, fmt, RATE)
    seconds = len(pcm) / 2 / RATE
    allowance = 0.050 + ((1105 + 1152) / RATE if fmt == "mp3" and stream else 0.0)
    assert abs(seconds - expected) <= allowance, (fmt, seconds, expected)
    assert rms(pcm) > 300
    if fmt == "wav" and not stream:
        assert response.body[40:44] == (len(response.body) - 44).to_bytes(4, "little")


@pytest_twisted.ensureDeferred
async def test_longer_text_makes_longer_audio(tone: Worker) -> None:
    """
    Duration grows with the text, at a plausible speaking rate.
    """
    short = await deferred_raw(tone.socket_path, "POST", "/speak", body(text="Hello there.", format="pcm", stream=False))
    long = await deferred_raw(tone.socket_path, "POST", "/speak", body(text=LONG, format="pcm", stream=False))
    short_ms = int(short.headers["x-rhapsode-duration-ms"])
    long_ms = int(long.headers["x-rhapsode-duration-ms"])
    assert long_ms > 10 * short_ms
    assert 0.03 < long_ms / 1000 / len(LONG) < 0.2  # seconds per character


@pytest_twisted.ensureDeferred
async def test_second_caller_waits_one_segment_not_the_whole_text(tone: Worker) -> None:
    """
    A second streamed request's first audio arrives while the first request is still
    being synthesised, not after it.
    """
    huge = " ".join([LONG] * 4)[:4000]
    first = deferred_raw(tone.socket_path, "POST", "/speak", body(text=huge, format="pcm"))
    await deferLater(tone.reactor, 0.05, lambda: None)
    second = deferred_raw(tone.socket_path, "POST", "/speak", body(text="Me too, please.", format="pcm"))
    a, b = await gatherResults([first, second])
    assert a.complete and b.complete
    assert b.arrivals[0] < a.arrivals[-1]


@pytest_twisted.ensureDeferred
async def test_two_streams_at_once_are_spoken_one_after_the_other(tmp_path: Path) -> None:
    """
    Two streamed requests for the same text at once, on a worker paced like a model
    (fifty times faster than realtime): the second gets its first audio at once, then
    waits with audio in hand while the first is spoken to its end, and is spoken after
    it, rather than both taking turns and finishing together.  Its listener never runs
    dry: what reaches it before the first ends is its first segment, seconds of speech.
    """
    from twisted.internet import reactor

    worker = await spawn_worker(reactor, tmp_path, extra_env={"RHAPSODE_TONE_PACE": "0.02"})
    try:
        text = body(text=LONG, format="pcm")
        first = deferred_raw(worker.socket_path, "POST", "/speak", text)
        await deferLater(reactor, 0.05, lambda: None)
        second = deferred_raw(worker.socket_path, "POST", "/speak", text)
        a, b = await gatherResults([first, second])
    finally:
        await worker.stop()
    assert a.complete and b.complete and len(a.body) == len(b.body)
    early = sum(size for at, size in zip(b.arrivals, b.received) if at < a.arrivals[-1])
    # The head, and the first segment (at most 60 characters of the ~1000) as its audio.
    assert 0 < early < len(b.body) / 8, (early, len(b.body))
    assert b.arrivals[0] < a.arrivals[len(a.arrivals) // 2]


@pytest_twisted.ensureDeferred
async def test_slow_reader_keeps_worker_memory_flat(own_tone: Worker) -> None:
    """
    A client that stops reading a long stream pauses its synthesis: the worker does not
    synthesise (and hold) the rest of the text, and the stream completes once read.
    """
    text = " ".join([LONG] * 4)[:4000]  # about 4.5 minutes, 13 MB of PCM
    await deferred_raw(own_tone.socket_path, "POST", "/speak", body(text="warm up", format="pcm", stream=False))
    before = resident_kib(own_tone.pid)
    samples: list[int] = []

    def slow_then_fast() -> Any:
        # Read 256 KB, then stall for two seconds (sampling the worker), then drain.
        import socket

        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
        sock.connect(own_tone.socket_path)
        payload = body(text=text, format="pcm")
        sock.sendall(
            b"POST /speak HTTP/1.1\r\nHost: w\r\nConnection: close\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload)
        )
        got = 0
        while got < 256 * 1024:
            got += len(sock.recv(16384))
        for _ in range(10):
            time.sleep(0.2)
            samples.append(resident_kib(own_tone.pid))
        total = got
        while True:
            data = sock.recv(65536)
            if not data:
                break
            total += len(data)
        sock.close()
        return total

    total = await deferToThread(slow_then_fast)
    assert total > 12_000_000
    assert max(samples) - before < 6 * 1024, (before, samples)


@pytest_twisted.ensureDeferred
async def test_current_appears_once_loaded(own_tone: Worker) -> None:
    """
    C{current} is absent until a model is loaded and then names the resident variant;
    C{variants} is always there.
    """
    _, caps = await own_tone.json("GET", "/capabilities")
    assert "current" not in caps and set(caps["variants"]) == {"expressive", "classic"}
    _, health = await own_tone.json("GET", "/health")
    assert health["model"] == "unloaded" and "variant" not in health
    response = await deferred_raw(own_tone.socket_path, "POST", "/speak", body(text="hi", variant="classic", stream=False))
    assert response.status == 200
    _, caps = await own_tone.json("GET", "/capabilities")
    assert caps["current"]["variant"] == "classic"
    assert caps["current"]["dials"] == caps["variants"]["classic"]["dials"]
    _, health = await own_tone.json("GET", "/health")
    assert health["model"] == "loaded" and health["variant"] == "classic"
    code, health = await own_tone.json("POST", "/load", {"variant": "expressive"})
    assert code == 200 and health["variant"] == "expressive"
    code, health = await own_tone.json("POST", "/unload")
    assert code == 200 and health["model"] == "unloaded"


@pytest.mark.parametrize(
    ("fields", "status", "code", "field"),
    [
        ({"text": ""}, 400, "bad_request", "text"),
        ({"text": "x" * 4097}, 400, "bad_request", "text"),
        ({"text": "[laugh]", "variant": "classic"}, 400, "bad_request", "text"),
        ({"text": "hi", "variant": "nope"}, 422, "unsupported", "variant"),
        ({"text": "hi", "params": {"pitch": 1.2}}, 400, "bad_request", "params.pitch"),
        ({"text": "hi", "variant": "classic", "params": {"pitch": 9}}, 400, "bad_request", "params.pitch"),
        ({"text": "hi", "variant": "classic", "params": {"wobble": 1}}, 400, "bad_request", "params.wobble"),
        ({"text": "hi", "delivery": "hushed"}, 422, "unsupported", "delivery"),
        ({"text": "hi", "language": "xx"}, 422, "unsupported", "language"),
        ({"text": "hi", "format": "wma"}, 422, "unsupported", "format"),
        ({"text": "hi", "format": "mp3", "sampleRate": 23000}, 422, "unsupported", "sampleRate"),
        ({"text": "hi", "speed": 2}, 400, "bad_request", "speed"),
        ({"text": "hi", "voice": "../../x"}, 400, "bad_request", "voice"),
        ({"text": "hi", "voice": "nobody"}, 404, "unknown_voice", "voice"),
        ({"text": "hi", "keepAliveSeconds": 5}, 400, "bad_request", "keepAliveSeconds"),
        ({"text": "hi", "seed": True}, 400, "bad_request", "seed"),
    ],
)
@pytest_twisted.ensureDeferred
async def test_bad_requests_refused_naming_the_field(
    tone: Worker, fields: dict[str, Any], status: int, code: str, field: str
) -> None:
    """
    Each invalid request is refused before the adapter sees it, with the taxonomy's code
    and status, the field named, and retryable false.
    """
    got, answer = await tone.json("POST", "/speak", fields)
    assert got == status
    assert answer["error"]["code"] == code
    assert answer["error"]["field"] == field
    assert answer["error"]["retryable"] is False


@pytest_twisted.ensureDeferred
async def test_unknown_route_is_an_error_envelope(tone: Worker) -> None:
    """
    A route the worker does not have answers with the envelope, not an HTML page.
    """
    code, answer = await tone.json("GET", "/nope")
    assert code == 404 and answer["error"]["code"] == "bad_request"


@pytest_twisted.ensureDeferred
async def test_fetch_is_unsupported_for_an_engine_without_weights(tone: Worker) -> None:
    """
    An adapter that does not override fetch answers /fetch with unsupported.
    """
    code, answer = await tone.json("POST", "/fetch", {"variant": "classic"})
    assert code == 422 and answer["error"]["code"] == "unsupported"



#: Texts with no letter or digit: control characters, zero-width and direction marks,
#: emoji.  The worker answered 500 internal to the last two before they were refused.
UNSPEAKABLE = ["\x01\x02\x07\x1b", "\u200b\u200f\u2066\u2069\ufeff", "\U0001f600\U0001f389 \u2764\ufe0f"]


@pytest.mark.parametrize("text", UNSPEAKABLE, ids=["control", "invisible", "emoji"])
@pytest_twisted.ensureDeferred
async def test_text_with_nothing_to_say_is_the_clients_fault(tone: Worker, text: str) -> None:
    """
    Text with nothing to say is 400 bad_request naming "text" on /speak and the turn's
    "turns[i].text" on /dialogue, never a 500 from the engine.
    """
    code, answer = await tone.json("POST", "/speak", {"text": text})
    assert (code, answer["error"]["code"], answer["error"]["field"]) == (400, "bad_request", "text")
    turns = [{"speaker": "a", "text": "Hello there."}, {"speaker": "b", "text": text}]
    code, answer = await tone.json("POST", "/dialogue", {"turns": turns, "variant": "classic"})
    assert (code, answer["error"]["code"], answer["error"]["field"]) == (400, "bad_request", "turns[1].text")


@pytest_twisted.ensureDeferred
async def test_letters_among_control_characters_are_spoken(tone: Worker) -> None:
    """
    Text with letters among control and invisible characters is spoken as the letters
    alone would be, and a listed language is matched without case.
    """
    noisy = await deferred_raw(
        tone.socket_path,
        "POST",
        "/speak",
        body(text="Hello\x07 there,\x1b world\u200b.", format="pcm", stream=False, seed=4, language="FR"),
    )
    plain = await deferred_raw(
        tone.socket_path, "POST", "/speak", body(text="Hello there, world.", format="pcm", stream=False, seed=4, language="fr")
    )
    assert noisy.status == plain.status == 200, noisy.body[:300]
    assert noisy.body == plain.body and rms(plain.body) > 0
