"""
An engine whose speak() is an asynchronous generator (a relaying engine's, as the remote
engine's is) through the worker's real routes, in memory (rhapsode_worker.testing): its
audio drawn on the reactor, no synthesis thread; its refusals before any audio answered
as the taxonomy's; a failure after the first audio a connection cut, never a clean end.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import AsyncIterator

import pytest
from twisted.internet.defer import succeed

from rhapsode_worker import Engine, NativeFormat, SpeakRequest, UnknownVoice, Variant, WorkerContext
from rhapsode_worker.testing import WorkerHarness

#: Three chunks of 10 ms at 8 kHz.
CHUNKS = [struct.pack("<80h", *([i, -i] * 40)) for i in range(1, 4)]


class Relaying(Engine):
    """
    Three chunks of 16-bit PCM, each awaited as a relay awaits its server's; a voice
    named "nobody" refused before any audio, one named "breaks" failing after the first.
    """

    id = "relaying"
    display_name = "Relaying"
    default_variant = "default"
    relays = True
    native_format = NativeFormat(sample_rate=8000)

    def __init__(self, context: WorkerContext) -> None:
        super().__init__(context)
        self.drawn: list[str] = []

    def variants(self) -> dict[str, Variant]:
        return {"default": Variant()}

    async def speak(self, request: SpeakRequest) -> AsyncIterator[bytes]:  # type: ignore[override]
        if request.text.startswith("nobody"):
            raise UnknownVoice('no voice "nobody"', field="voice")
        for index, chunk in enumerate(CHUNKS):
            if index == 1 and request.text.startswith("breaks"):
                raise RuntimeError("the server went away mid-stream")
            self.drawn.append(request.text)
            yield await succeed(chunk)


@pytest.fixture
def worker(tmp_path: Path) -> WorkerHarness:
    return WorkerHarness(Relaying, tmp_path)


def test_an_asynchronous_speak_is_drawn_on_the_reactor_into_the_answer(worker: WorkerHarness) -> None:
    """
    Streamed pcm and a buffered WAV carry the adapter's chunks in order; the synthesis
    pool ran the load alone, the audio came on the reactor.
    """
    streamed = worker.post("/speak", {"text": "Hello there.", "format": "pcm"})
    assert streamed.code == 200 and streamed.complete and streamed.body == b"".join(CHUNKS)
    assert streamed.headers["transfer-encoding"] == "chunked" and streamed.duration_ms == 30
    buffered = worker.post("/speak", {"text": "Hello again.", "format": "wav", "stream": False})
    assert buffered.code == 200 and buffered.body[:4] == b"RIFF" and buffered.body.endswith(b"".join(CHUNKS))
    assert [name for name in worker.pool.ran if "speak" in name or "drain" in name] == []
    assert worker.engine.drawn == ["Hello there."] * 3 + ["Hello again."] * 3  # type: ignore[attr-defined]


def test_an_asynchronous_speaks_refusal_before_audio_is_the_taxonomys(worker: WorkerHarness) -> None:
    """
    What the adapter raises before its first chunk is an ordinary error answer.
    """
    answer = worker.post("/speak", {"text": "nobody speaks", "format": "pcm"})
    assert answer.code == 404 and answer.json()["error"]["code"] == "unknown_voice"
    assert answer.json()["error"]["field"] == "voice"


def test_an_asynchronous_speak_failing_after_audio_cuts_the_connection(worker: WorkerHarness) -> None:
    """
    A failure after the first chunk went out aborts the connection: the reader sees
    the first chunk and no end, never a short answer that ends cleanly.
    """
    answer = worker.post("/speak", {"text": "breaks after one", "format": "pcm"})
    assert answer.code == 200 and not answer.complete and answer.body == CHUNKS[0]


def test_an_asynchronous_speak_must_yield_16_bit_pcm(tmp_path: Path) -> None:
    """
    An adapter whose asynchronous speak() would yield float PCM is refused as the worker
    is built, naming why: the reactor never converts audio.
    """

    class Floats(Relaying):
        native_format = NativeFormat(sample_rate=8000, encoding="pcm_f32le")

    with pytest.raises(TypeError, match="asynchronous"):
        WorkerHarness(Floats, tmp_path)
