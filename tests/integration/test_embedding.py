"""
The core as a library (rhapsode.service): a Twisted program starts the service on its
own reactor, learns where it listens, speaks through it with rhapsode.client, and stops
it, taking its worker with it; and the README's program that does so runs as shown.
"""

from __future__ import annotations

import json
import re
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import pytest_twisted
from twisted.application.service import Application, IServiceCollection
from twisted.internet.error import CannotListenError

from _worker import ROOT, engine_of, process_alive
from rhapsode.client import RhapsodeClient
from rhapsode.service import Config, RhapsodeService, parse_config


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _config(tmp_path: Path, port: int) -> Config:
    return parse_config(
        {
            "server": {"port": port, "host": "127.0.0.1", "shutdownGraceMs": 2000},
            "log": {"level": "error"},
            "workers": {"socketDir": "sock", "voiceDir": "voices", "drainGraceMs": 2000},
            "engines": {"tone": {"module": "rhapsode_engine_tone", "python": sys.executable}},
        },
        tmp_path,
    )


@pytest_twisted.ensureDeferred
async def test_a_program_embeds_the_core_and_speaks_through_it(tmp_path: Path) -> None:
    """
    Added to an application and started, the service reports its address; a client on
    the same reactor gets real audio through it from a worker it spawned; stopping the
    service closes the port and ends the worker.
    """
    port = _free_port()
    core = RhapsodeService(_config(tmp_path, port))
    application = Application("embedding-test")
    core.setServiceParent(application)
    IServiceCollection(application).startService()
    client = RhapsodeClient(f"http://127.0.0.1:{port}")
    try:
        address = await core.when_listening()
        assert (address.host, address.port) == ("127.0.0.1", port)
        audio = await client.speak("tone", "Hello from a program that embeds the core.", format="wav")
        assert audio.content_type == "audio/wav" and audio.data[:4] == b"RIFF"
        rate, = struct.unpack("<I", audio.data[24:28])
        assert rate == 24000 and audio.duration_ms is not None and audio.duration_ms > 1000
        assert round((len(audio.data) - 44) // 2 * 1000 / rate) == audio.duration_ms
        health = await client.health()
        pid = engine_of(health, "tone")["pid"]
        assert engine_of(health, "tone")["process"] == "up" and process_alive(pid)
        assert (await core.when_listening()).port == port
    finally:
        await client.close()
        await IServiceCollection(application).stopService()
    assert not process_alive(pid)
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0


@pytest_twisted.ensureDeferred
async def test_a_port_taken_fails_when_listening(tmp_path: Path) -> None:
    """
    A real port something else holds is reported through when_listening, and the
    service stops cleanly after it.  (That the embedding program's reactor is not
    stopped for it is tests/unit/test_service.py's to show.)
    """
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        core = RhapsodeService(_config(tmp_path, taken.getsockname()[1]))
        core.startService()
        with pytest.raises(CannotListenError):
            await core.when_listening()
        await core.stopService()


def test_the_readmes_embedding_program_runs_as_shown(tmp_path: Path) -> None:
    """
    The README's embedding program, run as it says (from a folder holding the
    run/rhapsode.json `make serve` writes), starts the core, speaks through it into
    program.wav, stops it and exits 0, leaving no worker behind.
    """
    readme = (ROOT / "README.md").read_text()
    (program,) = [block for block in re.findall(r"^```python\n(.*?)^```", readme, re.S | re.M)
                  if "RhapsodeService" in block]
    port = _free_port()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "rhapsode.json").write_text(json.dumps({
        "server": {"port": port, "host": "127.0.0.1"},
        "log": {"level": "error"},
        "workers": {"socketDir": str(tmp_path / "run" / "sockets"), "voiceDir": str(tmp_path / "run" / "voices")},
        "engines": {"tone": {"module": "rhapsode_engine_tone", "python": sys.executable}},
    }))
    (tmp_path / "embed.py").write_text(program)
    run = subprocess.run([sys.executable, "embed.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("program.wav: ") and "ms of audio/wav" in run.stdout
    assert (tmp_path / "program.wav").read_bytes()[:4] == b"RIFF"
    assert not list((tmp_path / "run" / "sockets").glob("*.sock"))
