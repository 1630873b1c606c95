"""
GET and PATCH /settings on a real `rhapsode serve` (protocol.md section 10): a live
keep-alive moves the deadline of the model idle now, a port change waits for the next
start and is in force after it, and a remote-looking caller or a foreign page is refused
before its body is read.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from _worker import free_port, get, serving_core, wait_for

TONE = {"tone": {"module": "rhapsode_engine_tone"}}


def call(port: int, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=data,
        method=method,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw.startswith((b"{", b"[")) else raw
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def field(document: dict[str, Any], key: str) -> dict[str, Any]:
    return next(f for f in document["fields"] if f["key"] == key)


def head_only(port: int, lines: list[str]) -> bytes:
    """
    Send a PATCH's head announcing a body it never sends; answer what comes back.
    """
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(("\r\n".join(["PATCH /settings HTTP/1.1", "Host: 127.0.0.1", *lines]) + "\r\n\r\n").encode())
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
        return answer


def test_settings_apply_live_wait_for_a_restart_and_survive_it(tmp_path: Path) -> None:
    """
    A keep-alive PATCHed to 1 s shows as live from the database and unloads the model
    idle now within seconds; a new server.port shows saved with the old one in use; a
    foreign page or a caller forwarded from elsewhere is refused 403 without sending its
    body; after a restart with the same config the saved port and the keep-alive are
    in force, from the database.
    """
    new_port = free_port()
    with serving_core(tmp_path, TONE) as (_, port):
        code, document = call(port, "GET", "/settings")
        assert code == 200, document
        assert document["values"]["residency"]["keepAliveSeconds"] == 300
        assert field(document, "residency.keepAliveSeconds")["source"] == "default"

        code, audio = call(port, "POST", "/speak", {"engine": "tone", "text": "Hello there.", "stream": False})
        assert code == 200
        assert get(port, "/residency")["resident"] == 1

        code, document = call(port, "PATCH", "/settings", {"residency": {"keepAliveSeconds": 1}})
        assert code == 200, document
        assert document["values"]["residency"]["keepAliveSeconds"] == 1
        assert field(document, "residency.keepAliveSeconds") == {
            "key": "residency.keepAliveSeconds", "source": "database", "applies": "live"
        }
        # The model idle now goes on the new deadline, not after its old 300 s.
        wait_for(lambda: get(port, "/residency")["resident"] == 0, 10, "the idle model to be unloaded")

        code, document = call(port, "PATCH", "/settings", {"server": {"port": str(new_port)}})
        assert code == 200, document
        assert document["values"]["server"]["port"] == port
        assert field(document, "server.port") == {
            "key": "server.port", "source": "config", "applies": "restart", "saved": new_port
        }

        code, refused = call(port, "PATCH", "/settings", {"residency": {"keepAliveSeconds": -5}})
        assert (code, refused["error"]["code"], refused["error"]["field"]) == (
            400, "bad_request", "residency.keepAliveSeconds"
        )
        assert call(port, "GET", "/settings")[1]["values"]["residency"]["keepAliveSeconds"] == 1

        started = time.monotonic()
        foreign = head_only(port, ["Origin: https://evil.example", "Content-Type: application/json", "Content-Length: 100000"])
        forwarded = head_only(port, ["X-Forwarded-For: 203.0.113.9", "Content-Length: 100000"])
        assert foreign.startswith(b"HTTP/1.1 403"), foreign
        assert forwarded.startswith(b"HTTP/1.1 403"), forwarded
        assert time.monotonic() - started < 5
        code, answer = call(port, "GET", "/settings", headers={"Origin": "https://evil.example"})
        assert (code, answer["error"]["code"]) == (403, "forbidden")

    assert (tmp_path / "rhapsode.db").exists()
    assert not list(tmp_path.glob("rhapsode.db-*"))
    log = open(tmp_path / "core-again.log", "wb")
    here = str(Path(__file__).resolve().parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    rhapsode = str(Path(sys.executable).parent / "rhapsode")
    core = subprocess.Popen([rhapsode, "serve", "--config", str(tmp_path / "rhapsode.json")], cwd=tmp_path,
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_for(lambda: get(new_port, "/health"), 20, "the core to listen on the saved port")
        document = get(new_port, "/settings")
        assert document["values"]["server"]["port"] == new_port
        assert field(document, "server.port") == {"key": "server.port", "source": "database", "applies": "restart"}
        assert document["values"]["residency"]["keepAliveSeconds"] == 1
    finally:
        core.terminate()
        try:
            core.wait(15)
        except subprocess.TimeoutExpired:
            core.kill()
            core.wait()
        log.close()


def test_a_start_whose_saved_host_cannot_apply_says_so_and_serve_unset_recovers(tmp_path: Path) -> None:
    """
    A state database holding a server.host no start can listen on (saved by a server
    that checked less): `rhapsode serve` exits 1 with one line naming the saved key and
    `rhapsode serve --unset server.host`, and no traceback; run so, it drops the key and
    serves on the file's host.
    """
    from rhapsode._manage.state import FILE_NAME, StateStore

    port = free_port()
    config = {"server": {"port": port, "host": "127.0.0.1"},
              "workers": {"socketDir": str(tmp_path / "sock"), "voiceDir": str(tmp_path / "voices")}, "engines": TONE}
    path = tmp_path / "rhapsode.json"
    path.write_text(json.dumps(config))
    store = StateStore.open(tmp_path / FILE_NAME)
    store.write_settings({"server.host": "not an address"})
    store.close()
    rhapsode = str(Path(sys.executable).parent / "rhapsode")
    failed = subprocess.run([rhapsode, "serve", "--config", str(path)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert failed.returncode == 1, failed.stdout[-2000:]
    said = failed.stderr + failed.stdout
    assert "the setting server.host saved in" in said and "rhapsode serve --unset server.host" in said
    assert "Traceback" not in said
    serving = subprocess.Popen([rhapsode, "serve", "--config", str(path), "--unset", "server.host"], cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: get(port, "/health"), 60, "the core to listen once the saved host was dropped")
        code, document = call(port, "GET", "/settings")
        assert code == 200 and field(document, "server.host")["source"] == "config"
    finally:
        serving.terminate()
        serving.wait(30)
