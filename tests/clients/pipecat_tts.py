"""
Pipecat's OpenAITTSService against a Rhapsode core, run in the clients' virtualenv by
tests/integration/test_clients.py, driven outside a pipeline (its run_tts generator, as
a pipeline's TTS step calls it) with a voice from OpenAI's thirteen, which Pipecat insists
on and the operator's alias maps to one of the engine's voices.

    python pipecat_tts.py BASE_URL MODEL VOICE OUT_DIR
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from pipecat.frames.frames import ErrorFrame, TTSAudioRawFrame
from pipecat.services.openai.tts import OpenAITTSService

TEXT = "Pipecat asked for alloy, and the operator's alias gave it a real voice."


async def main(base_url: str, model: str, voice: str, out: Path) -> None:
    service = OpenAITTSService(
        api_key="sk-not-a-real-key", base_url=base_url,
        settings=OpenAITTSService.Settings(model=model, voice=voice), sample_rate=24000,
    )
    # Outside a pipeline nothing sends the StartFrame that would set the rate.
    service._sample_rate = 24000
    audio, rates, errors = [], set(), []
    async for frame in service.run_tts(TEXT, "context-1"):
        if isinstance(frame, TTSAudioRawFrame):
            audio.append(frame.audio)
            rates.add(frame.sample_rate)
        elif isinstance(frame, ErrorFrame):
            errors.append(frame.error)
    (out / "pipecat.pcm").write_bytes(b"".join(audio))
    # The same service told the engine's own voice name refuses it before sending:
    # why the alias exists.
    service._settings.voice = "joe"
    refused = [frame.error async for frame in service.run_tts(TEXT, "context-2") if isinstance(frame, ErrorFrame)]
    (out / "found.json").write_text(json.dumps(
        {"frames": len(audio), "rates": sorted(rates), "errors": errors, "refused_joe": refused}))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])))
