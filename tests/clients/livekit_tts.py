"""
LiveKit Agents' OpenAI TTS (livekit-plugins-openai) against a Rhapsode core, run in the
clients' virtualenv by tests/integration/test_clients.py: the plugin as its docs set it
up for an OpenAI-compatible server (a base URL, a key, a model), every other option its
default (mp3, stream_format "sse", the voice "ash"), driven outside a room.

Writes what it heard to the folder it is given: each path's PCM as LiveKit's frames carry
it, their rate and channels, and the request id the plugin saw; the test judges them.

    python livekit_tts.py BASE_URL MODEL OUT_DIR
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from livekit.agents import tokenize, tts
from livekit.plugins import openai

TEXT = "Rhapsode speaks to LiveKit. Every frame is real audio, decoded from mp3."


def _keep(frames: list, out: Path, name: str) -> dict:
    pcm = b"".join(bytes(frame.data) for frame in frames)
    (out / f"{name}.pcm").write_bytes(pcm)
    rates = sorted({frame.sample_rate for frame in frames})
    channels = sorted({frame.num_channels for frame in frames})
    return {"frames": len(frames), "rates": rates, "channels": channels, "bytes": len(pcm)}


async def main(base_url: str, model: str, out: Path) -> None:
    found: dict = {}
    # As LiveKit's docs configure an OpenAI-compatible TTS: everything else is its default.
    plugin = openai.TTS(base_url=base_url, api_key="sk-not-a-real-key", model=model)
    found["defaults"] = {"format": plugin._opts.response_format, "voice": plugin._opts.voice}

    # The chunked path: synthesize() as an agent's say() uses it.
    frames, ids = [], set()
    async with plugin.synthesize(TEXT) as stream:
        async for audio in stream:
            frames.append(audio.frame)
            ids.add(audio.request_id)
    found["synthesize"] = {**_keep(frames, out, "synthesize"), "request_ids": sorted(ids)}

    # The stream path: an AgentSession wraps a non-streaming TTS in a StreamAdapter,
    # which speaks each sentence as the language model's text arrives.
    adapter = tts.StreamAdapter(tts=plugin, sentence_tokenizer=tokenize.basic.SentenceTokenizer())
    frames = []
    stream = adapter.stream()
    for word in TEXT.split(" "):
        stream.push_text(word + " ")
    stream.end_input()
    async for audio in stream:
        frames.append(audio.frame)
    await stream.aclose()
    found["stream"] = _keep(frames, out, "stream")

    # pcm: LiveKit plays it as 24 kHz whatever the answer says, so the operator's
    # engines.<id>.openaiSampleRate must have the core resample.
    pcm = openai.TTS(base_url=base_url, api_key="sk-not-a-real-key", model=model, response_format="pcm")
    frames = []
    async with pcm.synthesize(TEXT) as stream:
        async for audio in stream:
            frames.append(audio.frame)
    found["pcm"] = _keep(frames, out, "pcm")
    await pcm.aclose()
    await adapter.aclose()
    await plugin.aclose()
    (out / "found.json").write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], Path(sys.argv[3])))
