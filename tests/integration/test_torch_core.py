"""
Dia behind a real core (`rhapsode serve`), with its tiny random weights pulled from a hub of
our own (python -m rhapsode_worker.fakehub, a process of its own) through the core's pull
job: /speak, dialogue, a clone made through the core, the OpenAI shim driven by the
official SDK, MCP's speak tool driven by the official client, and the WebSocket stream.
Content is never asserted: the weights are random.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import wave
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import mcp_types
import openai
import pytest
from _torch import TOKEN, build, pins
from _worker import engine_python, serving_core
from mcp import Client
from test_speech_stream import speak as stream_speak
from test_voices_dialogue import multipart, sine_wav

RATE = 44_100
RHAPSODE = str(Path(sys.executable).parent / "rhapsode")


@contextmanager
def hub_of(engine: str, *args: str) -> Iterator[str]:
    """
    A hub of our own on loopback (python -m rhapsode_worker.fakehub, a process of its
    own) serving the engine's random weights at the commits its record pins; its endpoint.
    """
    built = build(engine, *args)
    pinned = pins(engine)
    repos = [arg for repo, folder in built.repos.items()
             for arg in ("--repo", f"{repo}@{pinned.get(repo, built.commit)}={folder}")]
    process = subprocess.Popen([sys.executable, "-m", "rhapsode_worker.fakehub", "--token", TOKEN, *repos],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert process.stdout is not None
        yield json.loads(process.stdout.readline())["endpoint"]
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def hub() -> Iterator[str]:
    """Dia's tiny random weights on a hub of our own."""
    with hub_of("dia", "--size", "tiny") as endpoint:
        yield endpoint


def wait_job(port: int, job: dict[str, Any], seconds: float) -> dict[str, Any]:
    deadline = time.monotonic() + seconds
    while job["state"] not in ("succeeded", "failed") and time.monotonic() < deadline:
        time.sleep(0.5)
        job = call(port, "GET", f"/installs/{job['id']}")
    return job


@pytest.fixture(scope="module")
def port(hub: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """
    A core serving dia, its worker pointed at the test hub; the weights pulled by a job.
    """
    tmp = tmp_path_factory.mktemp("torch-core")
    engine = {"module": "rhapsode_engine_dia", "python": engine_python("dia"),
              "env": {"HF_ENDPOINT": hub, "HF_TOKEN": TOKEN, "HF_HUB_CACHE": str(tmp / "hf"),
                      "RHAPSODE_DIA_MAX_TOKENS": "24", "TRANSFORMERS_VERBOSITY": "error"},
              "device": "cpu"}
    with serving_core(tmp, {"dia": engine}, workers={"startupTimeoutSeconds": 120}) as (_, listening):
        job = wait_job(listening, call(listening, "POST", "/engines/dia/pull", {"variant": "1.6b"}), 300)
        assert job["state"] == "succeeded", job
        yield listening


def call(port: int, method: str, path: str, body: Any = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(request, timeout=300) as response:
        raw = response.read()
    return json.loads(raw) if raw else None


def pcm_of(data: bytes) -> bytes:
    with wave.open(io.BytesIO(data)) as audio:
        assert (audio.getframerate(), audio.getnchannels()) == (RATE, 1)
        return audio.readframes(audio.getnframes())


def post_audio(port: int, path: str, body: dict[str, Any]) -> bytes:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method="POST",
                                     data=json.dumps({"format": "wav", "stream": False, **body}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return response.read()


def test_speak_and_dialogue_through_the_core(port: int) -> None:
    """/speak and /engines/dia/dialogue through the core answer 44.1 kHz WAVs, cues and all."""
    assert pcm_of(post_audio(port, "/speak", {"engine": "dia", "text": "Hello there. [laugh] Hi."}))
    turns = [{"speaker": "a", "text": "Did you hear that? [gasp]"}, {"speaker": "b", "text": "Only the cat."}]
    assert pcm_of(post_audio(port, "/engines/dia/dialogue", {"turns": turns}))


def test_the_shim_mcp_and_the_stream_speak_dia(port: int) -> None:
    """
    A clone made through the core's management route is a voice the OpenAI shim speaks
    in through the official SDK; MCP's speak tool answers a WAV; the WebSocket stream
    answers PCM at Dia's rate.
    """
    body, content_type = multipart({"id": "host", "label": "Host", "transcript": "Hello and welcome."},
                                   {"reference": ("clip.wav", sine_wav(150, seconds=4.0, rate=RATE))})
    request = urllib.request.Request(f"http://127.0.0.1:{port}/engines/dia/voices", data=body, method="POST",
                                     headers={"Content-Type": content_type})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 201
    sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
    wav = sdk.audio.speech.create(model="dia", voice="host", input="Welcome back to the show.",
                                  response_format="wav").content
    assert pcm_of(wav)

    async def use(client: Client) -> mcp_types.CallToolResult:
        return await client.call_tool("speak", {"engine": "dia", "text": "Hello from the tool."})

    async def session() -> mcp_types.CallToolResult:
        async with Client(f"http://127.0.0.1:{port}/mcp", read_timeout_seconds=300) as client:
            return await use(client)

    result = asyncio.run(asyncio.wait_for(session(), 300))
    assert result.is_error is False
    [audio] = [item for item in result.content if isinstance(item, mcp_types.AudioContent)]
    assert pcm_of(base64.b64decode(audio.data))

    stream = stream_speak(port, "Good morning to you.", model="dia")
    assert [m["error"] for m in stream.frames("audio.done")] == [False], stream.frames("error")
    assert stream.frames("audio.start")[0]["sample_rate"] == RATE
    assert stream.audio()
    stream.close()


def test_a_device_the_box_lacks_fails_the_worker_s_start_naming_it(tmp_path: Path) -> None:
    """
    engines.dia.device reaches the worker as the spawn contract's device: "cuda" on a box
    with no card fails the worker's start (internal, the worker gone before its
    handshake), and the worker's words in the server's log name the device it was given.
    """
    engine = {"module": "rhapsode_engine_dia", "python": engine_python("dia"), "device": "cuda",
              "env": {"TRANSFORMERS_VERBOSITY": "error"}}
    with serving_core(tmp_path, {"dia": engine}, workers={"startupTimeoutSeconds": 120, "maxRestarts": 0}) as (_, listening):
        request = urllib.request.Request(f"http://127.0.0.1:{listening}/speak", method="POST",
                                         data=json.dumps({"engine": "dia", "text": "Hello."}).encode(),
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as failed:
            urllib.request.urlopen(request, timeout=300)
        body = json.loads(failed.value.read())
    assert failed.value.code == 500 and body["error"]["code"] == "internal", body
    assert "before its handshake" in body["error"]["message"]
    assert "RHAPSODE_WORKER_DEVICE is cuda" in (tmp_path / "core.log").read_text(errors="replace")


#: Each torch engine's install test: its hub's weights, the settings that cap a
#: generation of random weights, and the rate it speaks at.  Chatterbox's weights are real
#: size (3.2 GB, its loader fixes the sizes): its install is in make test-heavy only.
INSTALLS = {
    "dia": (("--size", "tiny"), {"RHAPSODE_DIA_MAX_TOKENS": "24"}, 44_100),
    "chatterbox": ((), {"RHAPSODE_CHATTERBOX_MAX_TOKENS": "3"}, 24_000),
}
HEAVY = os.environ.get("RHAPSODE_TEST_HEAVY") == "1"


@pytest.mark.parametrize("engine", [
    "dia", pytest.param("chatterbox", marks=pytest.mark.skipif(not HEAVY, reason="real size: make test-heavy")),
])
def test_rhapsode_install_pull_builds_by_the_box_s_recipe_and_speaks(
    engine: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """
    `rhapsode install ENGINE --pull --yes` on this CPU box: the installer runs the
    record's cpu recipe (torch 2.13.0's CPU build first, then the rest, so nothing pulls
    a CUDA torch), registers the engine, pulls its weights through the hub client from
    our hub, and `rhapsode say` then speaks audio of the engine's rate through it.
    """
    build_args, env, rate = INSTALLS[engine]
    with hub_of(engine, *build_args) as endpoint:
        for name, value in {"HF_ENDPOINT": endpoint, "HF_TOKEN": TOKEN, "HF_HUB_CACHE": str(tmp_path / "hf"),
                            "TRANSFORMERS_VERBOSITY": "error", **env}.items():
            monkeypatch.setenv(name, value)
        venvs = tmp_path / "venvs"
        with serving_core(tmp_path, {}, install={"venvDir": str(venvs), "box": "cpu"},
                          workers={"startupTimeoutSeconds": 300}) as (_, listening):
            url = ("--url", f"http://127.0.0.1:{listening}")
            installed = subprocess.run([RHAPSODE, "install", engine, "--pull", "--yes", *url], capture_output=True,
                                       text=True, timeout=3600, stdin=subprocess.DEVNULL)
            assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
            torch = subprocess.run([str(venvs / engine / "bin" / "python"), "-c",
                                    "import torch; print(torch.__version__, torch.version.cuda)"],
                                   capture_output=True, text=True, timeout=300)
            assert torch.stdout.split() == ["2.13.0+cpu", "None"], torch.stdout + torch.stderr
            [job] = [j for j in call(listening, "GET", "/installs") if j["kind"] == "install"]
            assert job["state"] == "succeeded"
            said = subprocess.run([RHAPSODE, "say", engine, "Installed and pulled.", "-o", str(tmp_path / "a.wav"),
                                   *url], capture_output=True, text=True, timeout=1200, stdin=subprocess.DEVNULL)
            assert said.returncode == 0, said.stderr
    with wave.open(str(tmp_path / "a.wav")) as audio:
        assert (audio.getframerate(), audio.getnchannels()) == (rate, 1) and audio.getnframes() > 0
