"""
A test adapter with knobs for the failures a real engine has: it prints to stdout,
speaks slowly, fails mid-stream, and fails loads.  Run as C{python -m chatty_engine}
with this folder on PYTHONPATH; the knobs are environment variables.

Its audio is a square wave so that it is audible and has a known length: one segment of
text speaks for C{CHATTY_SEGMENT_MS}, taking C{CHATTY_SECONDS_PER_SEGMENT} to make.
C{CHATTY_FAIL_INIT} makes the engine fail as it is made, naming the voice folder its
context gave it.
"""

from __future__ import annotations

import os
import time
from typing import Iterator

from rhapsode_worker import Engine, License, NativeFormat, SpeakRequest, Variant, WorkerContext, serve


class ChattyEngine(Engine):
    id = "chatty"
    display_name = "Chatty"
    license = License(code="MIT", weights="MIT", weights_commercial_use=True, notes="test adapter")
    native_format = NativeFormat(sample_rate=16000)
    default_variant = "only"
    segment_characters = 40

    def __init__(self, context: WorkerContext) -> None:
        super().__init__(context)
        if os.environ.get("CHATTY_FAIL_INIT"):
            raise RuntimeError(f"chatty cannot start (voices would go in {context.voice_dir})")
        self.fail_loads = int(os.environ.get("CHATTY_FAIL_LOADS", "0"))
        self.seconds = float(os.environ.get("CHATTY_SECONDS_PER_SEGMENT", "0"))
        self.segment_ms = int(os.environ.get("CHATTY_SEGMENT_MS", "500"))
        #: A file that gets a line for each segment begun, for tests that count them.
        self.segment_log = os.environ.get("CHATTY_SEGMENT_LOG")
        self.loaded: str | None = None

    def variants(self) -> dict[str, Variant]:
        return {"only": Variant(languages=("en",))}

    def load(self, variant: str) -> None:
        print(f"chatty loading {variant}")
        if self.fail_loads:
            self.fail_loads -= 1
            raise RuntimeError("CUDA out of memory (pretend)")
        self.loaded = variant

    def unload(self) -> None:
        self.loaded = None

    def speak(self, request: SpeakRequest) -> Iterator[bytes]:
        assert self.loaded, "speak before load"
        if "explode" in request.text and request.segment_index > 0:
            raise RuntimeError("the engine fell over mid-stream")
        if self.segment_log:
            with open(self.segment_log, "a") as log:
                log.write(f"{request.segment_index}\n")
        frames = 16000 * self.segment_ms // 1000
        period = b"\xff\x3f" * 20 + b"\x01\xc0" * 20
        pcm = (period * (frames // 40 + 1))[: frames * 2]
        pieces = 10
        step = len(pcm) // pieces
        for i in range(pieces):
            if self.seconds:
                time.sleep(self.seconds / pieces)
            yield pcm[i * step : (i + 1) * step if i < pieces - 1 else len(pcm)]


if __name__ == "__main__":
    serve(ChattyEngine)
