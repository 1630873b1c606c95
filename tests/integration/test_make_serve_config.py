"""
`make serve`, run for real: its config step writes run/rhapsode.json with no engine of
its own and a venvDir beside it, and only when it is missing; tools/serve.py starts the
core and installs the engines it is given through the API, printing each one's licences
and progress, and Ctrl-C stops the server it started.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _worker import free_port, get, interruptible, wait_for

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from make_config import CPU_RESIDENT_MODELS, has_accelerator  # noqa: E402


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_serve_writes_the_config_only_when_it_is_missing(tmp_path: Path) -> None:
    """
    The config step of `make serve` writes run/rhapsode.json with no engine of its own
    and install.venvDir beside it when there is none, and leaves one that exists alone.
    """
    config = tmp_path / "rhapsode.json"
    written = subprocess.run(["make", f"RUN={tmp_path}", str(config)], cwd=ROOT, capture_output=True, text=True,
                             timeout=120)
    assert written.returncode == 0, written.stdout + written.stderr
    document = json.loads(config.read_text())
    assert document["engines"] == {}
    # Without an accelerator (this box) every engine stays loaded once used.
    assert document.get("residency") == (None if has_accelerator() else {
        "maxResidentModels": CPU_RESIDENT_MODELS, "keepAliveSeconds": -1})
    assert document["install"] == {"venvDir": str(tmp_path / "venvs")}
    config.write_text('{"engines": {}}')
    again = subprocess.run(["make", f"RUN={tmp_path}", str(config)], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0 and config.read_text() == '{"engines": {}}'


def test_serve_installs_its_engines_through_the_api_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    """
    tools/serve.py starts the core, installs tone through POST /engines/tone/install
    (its licences and steps printed), says what it serves, and tone speaks; run again on
    the same config it installs nothing (the state database remembers); Ctrl-C to its
    process group stops the server and serve.py exits.
    """
    port = free_port()
    config = tmp_path / "rhapsode.json"
    config.write_text(json.dumps({
        "server": {"port": port, "host": "127.0.0.1", "shutdownGraceMs": 1000},
        "workers": {"socketDir": str(tmp_path / "sock"), "voiceDir": str(tmp_path / "voices")},
        "install": {"venvDir": str(tmp_path / "venvs")},
        "engines": {},
    }))

    def serve() -> "subprocess.Popen[str]":
        return subprocess.Popen([sys.executable, str(ROOT / "tools" / "serve.py"), str(config), "tone"],
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, preexec_fn=interruptible)

    def until_serving(process: "subprocess.Popen[str]") -> list[str]:
        lines: list[str] = []
        assert process.stdout is not None
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip("\n"))
            if line.startswith("serve: ") and " is serving " in line:
                return lines
        raise AssertionError("serve.py never said it was serving:\n" + "\n".join(lines[-40:]))

    def stop(process: "subprocess.Popen[str]") -> None:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.communicate(timeout=30)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()

    first = serve()
    try:
        lines = until_serving(first)
        text = "\n".join(lines)
        assert "serve: installing tone" in text
        assert "Tone: code MIT; weights MIT (commercial use: yes)" in text
        assert "register (4/4)" in text and "install tone: done" in text
        assert lines[-1].endswith("is serving tone (Ctrl-C stops it)")
        assert [e["id"] for e in get(port, "/engines")] == ["tone"]
        wait_for(lambda: subprocess.run(
            [str(Path(sys.executable).parent / "rhapsode"), "say", "tone", "Served.", "-o", str(tmp_path / "a.wav"),
             "--url", f"http://127.0.0.1:{port}"], capture_output=True, timeout=60).returncode == 0, 60, "tone to speak")
        assert (tmp_path / "a.wav").read_bytes()[:4] == b"RIFF"
    finally:
        stop(first)
    # A stop asked for is no failure: make says nothing of it.
    assert first.returncode == 0

    again = serve()
    try:
        lines = until_serving(again)
        assert not any("installing" in line for line in lines)
    finally:
        stop(again)


@pytest.mark.parametrize("foreign", [False, True])
def test_a_second_serve_on_a_taken_port_says_so_and_exits_non_zero(tmp_path: Path, foreign: bool) -> None:
    """
    With the port already served (by another Rhapsode, or by something else), serve.py
    says the port is taken, by what, and where the port is set, starts no server and
    exits 1: no "is serving", no traceback, no Address already in use.
    """
    import http.server
    import threading

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b'{"status": "ok", "version": "0.1.0", "contract": 1}' if not foreign else b"<html>hi</html>"
            self.send_response(200 if not foreign else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    holder = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=holder.serve_forever, daemon=True).start()
    try:
        port = holder.server_address[1]
        config = tmp_path / "rhapsode.json"
        config.write_text(json.dumps({"server": {"port": port, "host": "127.0.0.1"}, "engines": {}}))
        run = subprocess.run([sys.executable, str(ROOT / "tools" / "serve.py"), str(config), "tone"],
                             capture_output=True, text=True, timeout=120)
    finally:
        holder.shutdown()
        holder.server_close()
    assert run.returncode == 1, run.stdout + run.stderr
    said = run.stderr
    assert f"http://127.0.0.1:{port} is taken: " in said and f"set server.port in {config}" in said
    assert ("not Rhapsode" in said) == foreign and ("another Rhapsode (0.1.0" in said) == (not foreign)
    assert "is serving" not in run.stdout and "Traceback" not in said and "already in use" not in said
