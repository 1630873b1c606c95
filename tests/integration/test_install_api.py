"""
Installing engines through the API on a real `rhapsode serve` (protocol.md section 10):
real virtualenvs under install.venvDir, real pip from the checkout's engines/, the job's
events over server-sent events, the engine speaking on the next /speak with no restart,
a reinstall swapping slots, an uninstall refused while the engine speaks, a pip failure
reported with pip's reason, and a core killed mid-install leaving nothing behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

from _worker import get, serving_core, wait_for

HERE = Path(__file__).resolve().parent


def call(port: int, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data, method=method,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw.startswith((b"{", b"[")) else raw
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def events(port: int, job: str, last: int | None = None, seconds: float = 240) -> Iterator[dict[str, Any]]:
    """
    Follow a job's event stream, yielding each event's data (a C{resync} as
    C{{"kind": "resync"}}), until a progress that is not running; then hang up.
    """
    headers = {} if last is None else {"Last-Event-ID": str(last)}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/installs/{job}/events", headers=headers)
    with urllib.request.urlopen(request, timeout=seconds) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        frame: dict[str, str] = {}
        for raw in response:
            line = raw.decode().rstrip("\n")
            if line.startswith(":"):
                continue
            if line:
                name, _, value = line.partition(": ")
                frame[name] = value
                continue
            if not frame:
                continue
            event = json.loads(frame["data"])
            if frame.get("event") == "resync":
                yield {"kind": "resync"}
            else:
                assert frame["event"] == event["kind"] and int(frame["id"]) == event["id"]
                yield event
                if event["kind"] == "progress" and event["progress"]["status"] != "running":
                    return
            frame = {}


def follow(port: int, job: str) -> list[dict[str, Any]]:
    return list(events(port, job))


def progress(seen: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(e["progress"]["phase"], e["progress"]["status"]) for e in seen if e["kind"] == "progress"]


def installed_engines(tmp_path: Path) -> list[str]:
    import sqlite3

    with sqlite3.connect(tmp_path / "rhapsode.db") as db:
        return [row[0] for row in db.execute("SELECT id FROM engines ORDER BY id")]


#: The folders of the checkout an install from it builds: the protocol, the SDK, tone.
CHECKOUT_SOURCES = [Path(__file__).resolve().parents[2] / name for name in ("protocol", "sdk", "engines/tone")]


def _tree(folders: list[Path]) -> dict[str, int]:
    # Every file and folder with its modification time, less what importing writes.
    return {str(p): p.lstat().st_mtime_ns for folder in folders for p in folder.rglob("*")
            if "__pycache__" not in p.parts}


def test_an_engine_installs_speaks_reinstalls_and_uninstalls_without_a_restart(tmp_path: Path) -> None:
    """
    POST /engines/tone/install answers 202 with a job; a second install of it is 409
    while the first runs; its events go venv, packages, verify, register, done, with
    pip's lines among them, and a reconnect with Last-Event-ID resumes after that id.
    The engine then speaks with no restart, is managed in the catalog and recorded in the
    database; a reinstall builds the other slot and swaps to it; an uninstall is 409
    while a stream holds the engine and then removes it, its virtualenvs and its record.
    A licence that must be accepted is refused without accept, before any job.  The
    checkout it builds from is left as it was: pip builds copies inside the slot.
    """
    venvs = tmp_path / "venvs"
    before = _tree(CHECKOUT_SOURCES)
    with serving_core(tmp_path, {}, install={"venvDir": str(venvs)}) as (_, port):
        catalog = {e["id"]: e for e in get(port, "/catalog")}
        assert (catalog["tone"]["installed"], catalog["tone"]["managed"]) == ("no", False)

        code, refused = call(port, "POST", "/engines/piper/install")
        assert (code, refused["error"]["code"], refused["error"]["field"]) == (400, "bad_request", "accept")
        assert catalog["piper"]["license"]["weights"] in refused["error"]["message"]
        code, refused = call(port, "POST", "/engines/piper/install?accept=MIT")
        assert (code, refused["error"]["code"]) == (400, "bad_request")
        assert get(port, "/installs") == []

        # The guard answers at the head: a foreign page, or a caller forwarded from
        # elsewhere, is refused before its body is read, and starts nothing.
        for extra in ("Origin: https://evil.example", "X-Forwarded-For: 203.0.113.9"):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(("POST /engines/tone/install HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                              f"{extra}\r\nContent-Length: 100000\r\n\r\n").encode())
                answer = sock.recv(65536)
            assert answer.startswith(b"HTTP/1.1 403"), answer
        code, refused = call(port, "DELETE", "/engines/tone", headers={"Origin": "https://evil.example"})
        assert (code, refused["error"]["code"]) == (403, "forbidden")
        assert get(port, "/installs") == []

        code, job = call(port, "POST", "/engines/tone/install")
        assert code == 202, job
        assert (job["engine"], job["kind"], job["state"]) == ("tone", "install", "running")
        code, second = call(port, "POST", "/engines/tone/install")
        assert (code, second["error"]["code"]) == (409, "conflict")
        assert {e["id"]: e for e in get(port, "/catalog")}["tone"]["installed"] == "installing"

        seen = follow(port, job["id"])
        assert progress(seen) == [
            ("venv", "running"), ("packages", "running"), ("verify", "running"), ("register", "running"),
            ("register", "done"),
        ]
        logs = [e["message"] for e in seen if e["kind"] == "log"]
        assert any(line.startswith("$ ") and " pip install " in line for line in logs)
        assert any(line.startswith("Successfully installed") for line in logs)
        ids = [e["id"] for e in seen]
        assert ids == sorted(ids) and ids[0] == 1
        resumed = next(events(port, job["id"], last=3))
        assert resumed["id"] == 4

        assert get(port, f"/installs/{job['id']}")["state"] == "succeeded"
        code, audio = call(port, "POST", "/speak", {"engine": "tone", "text": "Installed just now.", "format": "wav"})
        assert code == 200 and audio[:4] == b"RIFF"
        summary = {e["id"]: e for e in get(port, "/engines")}["tone"]
        assert summary["workerVersion"] and summary["outdated"] is False
        entry = {e["id"]: e for e in get(port, "/catalog")}["tone"]
        assert (entry["installed"], entry["managed"]) == ("yes", True)
        assert installed_engines(tmp_path) == ["tone"]
        assert (venvs / "tone" / "bin" / "python").exists()
        # The engine's virtualenv has the SDK and the protocol it builds on, never the core.
        listed = subprocess.run([str(venvs / "tone" / "bin" / "python"), "-m", "pip", "list", "--format=json"],
                                capture_output=True, text=True, check=True, timeout=120).stdout
        names = {package["name"].lower() for package in json.loads(listed)}
        assert {"rhapsode-worker", "rhapsode-protocol", "rhapsode-engine-tone"} <= names
        assert "rhapsode" not in names and "treq" not in names

        code, job = call(port, "POST", "/engines/tone/reinstall")
        assert code == 202, job
        seen = follow(port, job["id"])
        assert progress(seen)[-1] == ("register", "done"), seen[-3:]
        assert (venvs / "tone.alt" / "bin" / "python").exists()
        assert not (venvs / "tone").exists()
        code, audio = call(port, "POST", "/speak", {"engine": "tone", "text": "Reinstalled.", "format": "wav"})
        assert code == 200 and audio[:4] == b"RIFF"

        # A client that reads nothing of a long stream holds the engine's lease.
        holder = socket.create_connection(("127.0.0.1", port))
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        body = json.dumps({"engine": "tone", "text": "A long line to keep on speaking. " * 120, "format": "pcm"}).encode()
        holder.sendall(
            b"POST /speak HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )
        wait_for(lambda: get(port, "/residency")["models"] and get(port, "/residency")["models"][0]["leases"], 20,
                 "the stream to hold the lease")
        code, refused = call(port, "DELETE", "/engines/tone")
        assert (code, refused["error"]["code"]) == (409, "conflict"), refused
        assert (venvs / "tone.alt").exists()
        holder.close()
        wait_for(lambda: get(port, "/residency")["models"][0]["leases"] == 0, 20, "the lease to end")

        code, nothing = call(port, "DELETE", "/engines/tone")
        assert code == 204, nothing
        assert "tone" not in {e["id"] for e in get(port, "/engines")}
        assert {e["id"]: e for e in get(port, "/catalog")}["tone"]["installed"] == "no"
        assert not (venvs / "tone").exists() and not (venvs / "tone.alt").exists()
        code, refused = call(port, "POST", "/speak", {"engine": "tone", "text": "Gone."})
        assert (code, refused["error"]["code"]) == (404, "unknown_engine")
        code, refused = call(port, "DELETE", "/engines/tone")
        assert (code, refused["error"]["code"]) == (404, "unknown_engine")
    assert installed_engines(tmp_path) == []
    assert _tree(CHECKOUT_SOURCES) == before


def broken_engine(root: Path) -> Path:
    """
    An engine source folder whose build fails the way a missing compiler does: with
    the reason well above pip's footer.
    """
    engine = root / "broken"
    engine.mkdir(parents=True)
    (engine / "catalog.json").write_text(json.dumps({
        "id": "broken", "displayName": "Broken", "module": "rhapsode_engine_broken",
        "distribution": "rhapsode-engine-broken",
        "license": {"code": "MIT", "weights": "MIT", "weightsCommercialUse": True},
        "defaultVariant": "default", "python": ">=3.11",
    }))
    (engine / "setup.py").write_text(
        "import sys\n"
        "sys.stderr.write('gcc: command not found: a C compiler is needed to build rhapsode-engine-broken\\n')\n"
        "sys.exit(1)\n"
    )
    return root


def test_an_install_whose_pip_fails_reports_why_and_registers_nothing(tmp_path: Path) -> None:
    """
    An adapter whose build fails: the job fails at packages with an internal error
    naming pip and the line that says why (not pip's footer), pip's lines are in the
    events, and nothing is registered, recorded or left in install.venvDir.
    """
    source = broken_engine(tmp_path / "engines")
    venvs = tmp_path / "venvs"
    with serving_core(tmp_path, {}, install={"venvDir": str(venvs), "sourceDir": str(source)}) as (_, port):
        assert [e["id"] for e in get(port, "/catalog")] == ["broken"]
        code, job = call(port, "POST", "/engines/broken/install")
        assert code == 202, job
        seen = follow(port, job["id"])
        assert progress(seen)[-1] == ("packages", "failed")
        error = [e for e in seen if e["kind"] == "error"][0]["data"]["error"]
        assert error["code"] == "internal"
        assert error["message"].startswith("pip install exited 1")
        assert "C compiler" in error["message"]
        assert any("C compiler" in e["message"] for e in seen if e["kind"] == "log")
        failed = get(port, f"/installs/{job['id']}")
        assert (failed["state"], failed["step"], failed["error"]["code"]) == ("failed", "packages", "internal")
        assert get(port, "/engines") == []
        assert {e["id"]: e for e in get(port, "/catalog")}["broken"]["installed"] == "no"
        assert not (venvs / "broken").exists()
    assert installed_engines(tmp_path) == []


def _group_alive(pgid: int) -> bool:
    """
    Whether any process of group C{pgid} still runs: a zombie waiting for whoever
    inherited it to reap it has already exited, and is not counted.
    """
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces, so split after its ")".
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _install_groups(marker: str) -> list[int]:
    """
    The process groups of commands whose command line names C{marker} (the test's
    own virtualenv folder).  A command's leader starts in the core's group, which is
    this test's own, and makes its group a moment later: a process seen in that moment
    is not counted under this test's group, which never goes.
    """
    ours = os.getpgrp()
    groups = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
            if marker in cmdline and os.getpgid(int(entry.name)) != ours:
                groups.add(os.getpgid(int(entry.name)))
        except (OSError, ProcessLookupError):
            continue
    return sorted(groups)


def test_a_core_killed_mid_install_leaves_no_process_and_the_next_install_works(tmp_path: Path) -> None:
    """
    SIGKILL of the core while pip runs: every process of the install's group is gone
    within seconds (its leader saw the core go), the restarted core has no such engine
    and the catalog says not installed, and the next install removes the remains and
    succeeds.
    """
    venvs = tmp_path / "venvs"
    with serving_core(tmp_path, {}, install={"venvDir": str(venvs)}) as (core, port):
        code, job = call(port, "POST", "/engines/tone/install")
        assert code == 202, job
        wait_for(lambda: get(port, f"/installs/{job['id']}").get("step") == "packages", 60, "pip to start")
        # The groups seen, not a second look: between two steps a second look finds none.
        groups = wait_for(lambda: _install_groups(str(venvs / "tone")), 30, "pip's process")
        core.send_signal(signal.SIGKILL)
        core.wait(60)
        wait_for(lambda: not any(_group_alive(g) for g in groups), 10, "the install's processes to go")
        # Nor any other (a step that began as the core died): each goes as its leader sees the core go.
        wait_for(lambda: _install_groups(str(venvs / "tone")) == [], 10, "every process of the install to go")
    with serving_core(tmp_path, {}, install={"venvDir": str(venvs)}) as (_, port):
        assert get(port, "/engines") == []
        assert {e["id"]: e for e in get(port, "/catalog")}["tone"]["installed"] == "no"
        code, job = call(port, "POST", "/engines/tone/install")
        assert code == 202, job
        seen = follow(port, job["id"])
        assert progress(seen)[-1] == ("register", "done"), [e["message"] for e in seen[-5:]]
        assert any("remains of an install that did not finish" in e["message"] for e in seen)
        code, audio = call(port, "POST", "/speak", {"engine": "tone", "text": "Back again.", "format": "wav"})
        assert code == 200 and audio[:4] == b"RIFF"
