"""
The `rhapsode` executable's client subcommands against a real `rhapsode serve` with the
tone engine: each one's output and exit status as a shell sees them, the server found
through RHAPSODE_URL or --url, and a server that is not there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

import rhapsode
from _worker import free_port, serving_core

RHAPSODE = str(Path(sys.executable).parent / "rhapsode")


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """
    One core serving tone, shared by the module's tests, its address.
    """
    with serving_core(tmp_path_factory.mktemp("cli"), {"tone": {"module": "rhapsode_engine_tone"}}) as (_, port):
        yield f"http://127.0.0.1:{port}"


def rhapsode_cli(url: str | None, *argv: str, env_url: bool = True) -> "subprocess.CompletedProcess[bytes]":
    """
    Run the executable with the server in RHAPSODE_URL (or none, without C{env_url}).
    """
    env = {k: v for k, v in os.environ.items() if k != "RHAPSODE_URL"}
    if env_url and url is not None:
        env["RHAPSODE_URL"] = url
    return subprocess.run([RHAPSODE, *argv], capture_output=True, env=env, timeout=60)


def test_engines_lists_tone_with_its_worker_version(url: str) -> None:
    """
    engines prints a table with tone in it; --json prints /engines, whose tone carries
    workerVersion (this checkout's rhapsode in the venv the core runs it with) and
    outdated false.
    """
    plain = rhapsode_cli(url, "engines")
    assert plain.returncode == 0, plain.stderr
    header, row = plain.stdout.decode().splitlines()
    assert header.split()[0] == "ENGINE" and row.split()[0] == "tone"
    assert row.split()[-1] == rhapsode.__version__
    [tone] = json.loads(rhapsode_cli(url, "engines", "--json").stdout)
    assert (tone["id"], tone["workerVersion"], tone["outdated"]) == ("tone", rhapsode.__version__, False)


def test_catalog_lists_every_engine_in_the_checkout(url: str) -> None:
    """
    catalog shows every engine with a record under engines/, tone installed and the
    rest not, with both licences, over --url rather than the environment.
    """
    shown = rhapsode_cli(url, "catalog", "--json", "--url", url, env_url=False)
    assert shown.returncode == 0, shown.stderr
    entries = {entry["id"]: entry for entry in json.loads(shown.stdout)}
    assert {"tone", "espeak", "piper", "kokoro"} <= set(entries)
    assert (entries["tone"]["installed"], entries["tone"]["managed"], entries["tone"]["outdated"]) == ("yes", False, False)
    assert entries["piper"]["installed"] == "no" and entries["piper"]["license"]["weightsCommercialUse"] is False
    table = rhapsode_cli(url, "catalog").stdout.decode()
    assert "(non-commercial)" in table and table.splitlines()[0].split()[:3] == ["ENGINE", "NAME", "INSTALLED"]


def test_voices_lists_tones_voices(url: str) -> None:
    """
    voices tone prints one row per voice /engines/tone/voices lists.
    """
    voices = json.loads(rhapsode_cli(url, "voices", "tone", "--json").stdout)
    plain = rhapsode_cli(url, "voices", "tone")
    assert plain.returncode == 0
    assert [line.split()[0] for line in plain.stdout.decode().splitlines()[1:]] == [v["id"] for v in voices]


def test_say_writes_a_wav_then_ps_shows_tone_and_unload_ends_it(tmp_path: Path, url: str) -> None:
    """
    say -o writes a WAV file; say without -o writes the same kind of audio to stdout,
    bytes unaltered; ps then shows tone resident; unload ends it and ps shows nothing.
    """
    target = tmp_path / "hello.wav"
    said = rhapsode_cli(url, "say", "tone", "Hello from the command line.", "-o", str(target), "--voice", "alto")
    assert said.returncode == 0, said.stderr
    audio = target.read_bytes()
    assert audio[:4] == b"RIFF" and audio[8:12] == b"WAVE" and len(audio) > 1000
    piped = rhapsode_cli(url, "say", "tone", "Hello.", "--format", "wav")
    assert piped.returncode == 0 and piped.stdout[:4] == b"RIFF"
    resident = rhapsode_cli(url, "ps")
    assert resident.returncode == 0
    assert [line.split()[0] for line in resident.stdout.decode().splitlines()] == ["ENGINE", "tone"]
    unloaded = rhapsode_cli(url, "unload", "tone")
    assert unloaded.returncode == 0, unloaded.stderr
    assert json.loads(rhapsode_cli(url, "ps", "--json").stdout)["models"] == []


def test_an_unknown_engine_is_code_and_message_with_exit_1(tmp_path: Path, url: str) -> None:
    """
    say with an engine the server lacks prints unknown_engine: ... on stderr, writes
    no file and exits 1.
    """
    target = tmp_path / "never.wav"
    refused = rhapsode_cli(url, "say", "nope", "Hello.", "-o", str(target))
    assert refused.returncode == 1
    assert refused.stderr.decode().startswith('unknown_engine: no engine "nope"')
    assert not target.exists()


def test_version_prints_both(url: str) -> None:
    """
    version prints this client's version and the server's.
    """
    shown = rhapsode_cli(url, "version")
    assert shown.returncode == 0
    assert shown.stdout.decode().splitlines() == [
        f"client version {rhapsode.__version__}",
        f"server version {rhapsode.__version__} (contract 1)",
    ]


def test_nothing_listening_says_so_and_exits_1() -> None:
    """
    A server that is not there is one line naming the address and how to start one,
    exit 1, no traceback.
    """
    nowhere = f"http://127.0.0.1:{free_port()}"
    failed = rhapsode_cli(nowhere, "engines")
    assert failed.returncode == 1
    err = failed.stderr.decode()
    assert err.startswith(f"rhapsode: nothing is answering at {nowhere}") and "Traceback" not in err


@pytest.fixture(params=["html-404", "html-200"])
def foreign(request: pytest.FixtureRequest) -> Iterator[str]:
    """
    A web server that is not Rhapsode, on a loopback port: a 404 page for every path,
    or a 200 page that is not JSON.
    """
    import http.server
    import threading

    status = 404 if request.param == "html-404" else 200

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"<html><body>Not here</body></html>"
            self.send_response(status)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_server_that_is_not_rhapsode_is_said_to_be_so(foreign: str) -> None:
    """
    engines and doctor against a foreign server on the port say that what answers is
    not Rhapsode and where the address and the port are set, exit 1, no traceback; not
    "internal: HTTP 404 without an error envelope".
    """
    for argv in (["engines"], ["doctor"]):
        failed = rhapsode_cli(foreign, *argv)
        said = failed.stdout.decode() + failed.stderr.decode()
        assert failed.returncode == 1, said
        assert f"what answers at {foreign} is not Rhapsode" in said, said
        assert "--url" in said and "RHAPSODE_URL" in said and "server.port" in said, said
        assert "without an error envelope" not in said and "Traceback" not in said, said
