"""
The OpenAI shim on every engine in the tree (tone, espeak, piper, kokoro), through a
real `rhapsode serve` with each engine in its own virtualenv, driven by the official
`openai` SDK: the voices discovery lists are ones the engine speaks in, a WAV that is
speech, server-sent PCM, and a batch.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import urllib.request
from typing import Any, Iterator

import openai
import pytest

from _worker import ROOT, decode_pcm, engine_python, rms, serving_core

CACHE = ROOT / ".venvs" / "kokoro-cache"
ENGINES = ("tone", "espeak", "piper", "kokoro")
SILENCE_RMS = 300.0


def engine_config(engine: str) -> dict[str, Any]:
    config: dict[str, Any] = {"module": f"rhapsode_engine_{engine}"}
    if engine != "tone":
        config["python"] = engine_python(engine)
    if engine == "kokoro":
        config["env"] = {"RHAPSODE_KOKORO_CACHE": str(CACHE)}
    return config


@pytest.fixture(scope="module")
def port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """
    One core serving all four engines; Kokoro's weights are fetched into the test cache
    first (a no-op once they are there), as `make fetch-kokoro` does.
    """
    env = {**os.environ, "RHAPSODE_KOKORO_CACHE": str(CACHE)}
    subprocess.run(
        [engine_python("kokoro"), "-c",
         "import os; from rhapsode_engine_kokoro._fetch import cache_dir, ensure; ensure(cache_dir(os.environ))"],
        env=env, check=True, capture_output=True, timeout=600,
    )
    tmp = tmp_path_factory.mktemp("openai-engines")
    with serving_core(tmp, {engine: engine_config(engine) for engine in ENGINES},
                      workers={"startupTimeoutSeconds": 120}) as (_, listening):
        yield listening


def get(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=120) as response:
        return json.loads(response.read())


def client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=180)


def rate_of(content_type: str) -> int:
    return int(content_type.split("rate=")[1].split(";")[0])


@pytest.mark.parametrize("engine", ENGINES)
def test_each_engine_speaks_through_the_sdk(port: int, engine: str) -> None:
    """
    For each engine, the first voice /v1/audio/voices lists speaks a sentence through
    `audio.speech.create` as a WAV of speech (not silence), and the same as server-sent
    pcm events at the rate the Content-Type of a raw pcm answer names.
    """
    voices = get(port, f"/v1/audio/voices?model={engine}")
    assert voices["data"][0]["model"] == engine and voices["voices"], voices
    voice = voices["voices"][0]["id"]
    sdk = client(port)
    text = "Hello from the speech server. This is a test."
    wav = sdk.audio.speech.create(model=engine, voice=voice, input=text, response_format="wav").content
    assert wav[:4] == b"RIFF"
    rate = int.from_bytes(wav[24:28], "little")
    assert rms(decode_pcm(wav, "wav", rate)) > SILENCE_RMS
    raw = sdk.audio.speech.create(model=engine, voice=voice, input=text, response_format="pcm")
    assert rate_of(raw.response.headers["content-type"]) == rate
    sse = sdk.audio.speech.create(model=engine, voice=voice, input=text, response_format="pcm", stream_format="sse")
    blocks = [b for b in sse.content.decode().split("\n\n") if b.strip()]
    deltas = [json.loads(b.split("data: ", 1)[1]) for b in blocks if b.startswith("event: speech.audio.delta")]
    assert blocks[-1].startswith("event: speech.audio.done") and deltas
    pcm = b"".join(base64.b64decode(d["audio"]) for d in deltas)
    assert rms(pcm) > SILENCE_RMS and len(pcm) > rate  # more than half a second of 16-bit audio


def test_models_lists_every_engine_and_its_variants(port: int) -> None:
    """
    /v1/models lists each engine and each engine:variant its capabilities declare, and
    loads no model to say so.
    """
    ids = [m["id"] for m in get(port, "/v1/models")["data"]]
    for engine in ENGINES:
        caps = get(port, f"/engines/{engine}/capabilities")
        assert engine in ids and all(f"{engine}:{v}" in ids for v in caps["variants"])


@pytest.mark.parametrize("engine", ENGINES)
def test_each_engine_speaks_through_mcp(port: int, engine: str) -> None:
    """
    MCP's speak tool on each engine answers a WAV of speech as audio content, its
    mimeType the route's Content-Type, and a line naming the engine.
    """
    call = {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
            "params": {"name": "speak", "arguments": {"engine": engine, "text": "Hello from an agent."}}}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/mcp", data=json.dumps(call).encode(), headers={
        "Content-Type": "application/json", "Accept": "application/json, text/event-stream"})
    with urllib.request.urlopen(request, timeout=180) as response:
        result = json.loads(response.read())["result"]
    assert result["isError"] is False, result
    audio, line = result["content"]
    wav = base64.b64decode(audio["data"])
    assert audio["type"] == "audio" and audio["mimeType"] == "audio/wav" and wav[:4] == b"RIFF"
    assert rms(decode_pcm(wav, "wav", int.from_bytes(wav[24:28], "little"))) > SILENCE_RMS
    assert f'engine "{engine}"' in line["text"]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_batch_across_formats(port: int, engine: str) -> None:
    """
    A batch on each engine answers each item in its own format, each decoding to speech.
    """
    body = json.dumps({"model": engine, "items": [
        {"input": "One line of a batch."}, {"input": "And another.", "response_format": "mp3"}]}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/audio/speech/batch", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=180) as response:
        result = json.loads(response.read())
    assert result["succeeded"] == 2, result
    wav, mp3 = (base64.b64decode(r["audio_data"]) for r in result["results"])
    rate = int.from_bytes(wav[24:28], "little")
    assert rms(decode_pcm(wav, "wav", rate)) > SILENCE_RMS
    assert result["results"][1]["media_type"] == "audio/mpeg" and rms(decode_pcm(mp3, "mp3", rate)) > SILENCE_RMS



def test_the_readmes_openai_snippet_runs_as_shown(port: int, tmp_path_factory: pytest.TempPathFactory) -> None:
    """
    The README's OpenAI SDK snippet, run as it stands against this core (only the port
    changed), writes openai.wav: Piper's voice saying the line.
    """
    import re
    import runpy

    readme = (ROOT / "README.md").read_text()
    (snippet,) = [block for block in re.findall(r"^```python\n(.*?)^```", readme, re.S | re.M)
                  if "from openai import OpenAI" in block]
    folder = tmp_path_factory.mktemp("snippet")
    program = folder / "snippet.py"
    program.write_text(snippet.replace("http://127.0.0.1:8080/v1", f"http://127.0.0.1:{port}/v1"))
    here = os.getcwd()
    os.chdir(folder)
    try:
        runpy.run_path(str(program))
    finally:
        os.chdir(here)
    wav = (folder / "openai.wav").read_bytes()
    assert wav[:4] == b"RIFF" and rms(decode_pcm(wav, "wav", int.from_bytes(wav[24:28], "little"))) > SILENCE_RMS
