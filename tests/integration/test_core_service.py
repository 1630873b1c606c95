"""
The core as the README runs it: `rhapsode serve --config FILE` (twistd's rhapsode
plugin) as a real process supervising real tone workers: spawn on demand, crash
restart, shutdown, no orphans, flat memory under a slow client, and the dropin being
visible to twistd in both the editable and the regular install.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest

from _worker import engine_of, free_port, get, process_alive, resident_kib, serving_core, wait_for

ROOT = Path(__file__).resolve().parent.parent.parent
RHAPSODE = str(Path(sys.executable).parent / "rhapsode")


def speak(port: int, **fields: Any) -> tuple[int, bytes]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/speak",
        data=json.dumps({"engine": "tone", **fields}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


@contextmanager
def serving(
    tmp_path: Path,
    engines: dict[str, Any] | None = None,
    grace_ms: int = 2000,
    residency: dict[str, Any] | None = None,
) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    with serving_core(
        tmp_path,
        engines or {"tone": {"module": "rhapsode_engine_tone"}},
        server={"shutdownGraceMs": grace_ms},
        residency=residency or {},
    ) as running:
        yield running


def serve_once(tmp_path: Path, port: int, socket_dir: Path) -> subprocess.CompletedProcess[str]:
    """
    Run `rhapsode serve` on C{port} with no engines until it exits by itself.
    """
    config = tmp_path / "rhapsode.json"
    config.write_text(json.dumps({
        "server": {"port": port, "host": "127.0.0.1"},
        "workers": {"socketDir": str(socket_dir), "voiceDir": str(tmp_path / "voices")},
    }))
    return subprocess.run([RHAPSODE, "serve", "--config", str(config)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=30)


def test_a_port_already_taken_ends_the_server_saying_why(tmp_path: Path) -> None:
    """
    `rhapsode serve` on a port something else holds exits at once with status 1 and
    says why (the port is taken, by which process, and where it is set), rather than
    running on listening nowhere or printing a traceback.
    """
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        run = serve_once(tmp_path, port, tmp_path / "sock")
    assert run.returncode == 1, (run.returncode, run.stdout[-500:])
    # Which process holds it (this one), and where the port is set; no traceback.
    assert f"port {port} on 127.0.0.1 is taken by pid {os.getpid()} (" in run.stderr, run.stderr
    assert "server.port in" in run.stderr and "Traceback" not in run.stderr + run.stdout


def test_a_folder_that_cannot_be_made_ends_the_server_saying_which(tmp_path: Path) -> None:
    """
    A workers folder that cannot be made (its parent is a file) ends `rhapsode serve` at
    once with status 1, naming the key and the folder, before it listens.
    """
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    run = serve_once(tmp_path, free_port(), blocker / "sock")
    assert run.returncode == 1, (run.returncode, run.stdout[-500:])
    assert f"workers.socketDir {blocker / 'sock'} cannot be made" in run.stderr
    assert "cannot be made" in run.stdout and "rhapsode listening on" not in run.stdout


def worker_pid(port: int) -> int | None:
    state = engine_of(get(port, "/health"), "tone")
    return state.get("pid") if state["process"] == "up" else None


def test_spawns_on_demand_and_restarts_a_crashed_worker(tmp_path: Path) -> None:
    """
    No worker runs until something speaks; a worker killed from outside is a crash, and
    the core restarts it and speaks again; SIGTERM to the core stops it cleanly.
    """
    with serving(tmp_path) as (core, port):
        assert engine_of(get(port, "/health"), "tone")["process"] == "down"
        # The licences show before the engine has ever run: they come from its catalog.
        (summary,) = get(port, "/engines")
        assert summary["license"]["code"] == "MIT" and summary["process"] == "down"
        status, audio = speak(port, text="Hello there.", stream=False)
        assert status == 200 and len(audio) > 1000
        first = worker_pid(port)
        assert first is not None and process_alive(first)
        os.kill(first, signal.SIGKILL)
        second = wait_for(lambda: (pid := worker_pid(port)) and pid != first and pid, 20, "a restart")
        assert engine_of(get(port, "/health"), "tone")["restarts"] >= 1
        status, _ = speak(port, text="Back again.", stream=False)
        assert status == 200
        core.send_signal(signal.SIGTERM)
        # twistd stops cleanly, then re-raises the signal so its exit status says why.
        assert core.wait(20) == -signal.SIGTERM
        assert b"rhapsode stopped" in (tmp_path / "core.log").read_bytes()
        assert not process_alive(second)


def test_shutdown_lets_a_stream_in_flight_finish(tmp_path: Path) -> None:
    """
    SIGTERM stops the listener but gives a request in flight up to shutdownGraceMs to
    finish: the client gets its whole stream, then the core and its worker exit.
    """
    here = str(Path(__file__).parent)
    engines = {
        "chatty": {
            "module": "chatty_engine",
            "env": {"PYTHONPATH": here, "CHATTY_SECONDS_PER_SEGMENT": "0.3"},
        }
    }
    with serving(tmp_path, engines, grace_ms=10000) as (core, port):
        text = " ".join(["A sentence of about forty characters."] * 5)
        sock = socket.create_connection(("127.0.0.1", port))
        body = json.dumps({"engine": "chatty", "text": text, "format": "pcm"}).encode()
        sock.sendall(
            b"POST /speak HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        core.send_signal(signal.SIGTERM)
        data = first
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        sock.close()
        assert data.endswith(b"\r\n\r\n") and b"\r\n0\r\nX-Rhapsode-Duration-Ms: 2500\r\n\r\n" in data
        assert core.wait(20) == -signal.SIGTERM


ACCESS_LINE = re.compile(r"\] (\[[\w-]+\] )?(GET|POST|PUT|DELETE) /")


def test_a_second_ctrl_c_quits_at_once_saying_so(tmp_path: Path) -> None:
    """
    The first SIGINT logs, as the stop's first line, what it waits for: the request in
    flight and for how long at most, then the worker by name and pid.  A second SIGINT
    quits at once, long before that grace is up, with status 1 and no traceback; the
    worker, orphaned, exits by itself.
    """
    here = str(Path(__file__).parent)
    engines = {
        "chatty": {
            "module": "chatty_engine",
            "env": {"PYTHONPATH": here, "CHATTY_SECONDS_PER_SEGMENT": "0.5"},
        }
    }
    log_path = tmp_path / "core.log"
    with serving(tmp_path, engines, grace_ms=60000) as (core, port):
        # Forty segments at half a second each: in flight for the whole test.
        text = " ".join(["A sentence of about forty characters."] * 40)
        sock = socket.create_connection(("127.0.0.1", port))
        body = json.dumps({"engine": "chatty", "text": text, "format": "pcm"}).encode()
        sock.sendall(
            b"POST /speak HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        (chatty,) = [engine for engine in get(port, "/engines") if engine["id"] == "chatty"]
        pid = chatty["pid"]
        before = len(log_path.read_text())
        core.send_signal(signal.SIGINT)
        wait_for(lambda: "shutting down:" in log_path.read_text()[before:], 10, "the first SIGINT's line")
        core.send_signal(signal.SIGINT)
        # A hang guard only, half the 60 s grace a core that did not quit would wait.
        status = core.wait(30)
        sock.close()
    log = log_path.read_text()
    # Access lines (the core's, a worker's health checks) may land anywhere; the stop's own come first.
    first = [line for line in log[before:].splitlines() if not ACCESS_LINE.search(line)][0]
    assert "shutting down: waiting up to 60 s for 1 request in flight to finish" in first, first
    assert f"then stopping worker chatty (pid {pid})" in first, first
    assert "SIGINT received; press Ctrl-C again (or send SIGTERM) to quit at once" in log
    assert status == 1, status
    assert "rhapsode: SIGINT while stopping: quitting at once" in log
    assert "Traceback" not in log and "rhapsode stopped" not in log, log[before:]
    wait_for(lambda: not process_alive(pid), 20, "the orphaned worker to exit")


def test_no_orphan_worker_after_the_core_is_killed(tmp_path: Path) -> None:
    """
    A core killed with SIGKILL cannot stop its workers; they notice and exit.
    """
    with serving(tmp_path) as (core, port):
        assert speak(port, text="hi", stream=False)[0] == 200
        pid = worker_pid(port)
        assert pid is not None
        core.kill()
        core.wait()
        wait_for(lambda: not process_alive(pid), 10, "the orphaned worker to exit")


def test_nothing_in_the_workers_group_outlives_a_killed_core(tmp_path: Path) -> None:
    """
    A core killed with SIGKILL takes each worker's whole process group with it: the
    worker exits, and so does a process its adapter started (the forking engine's
    `sleep 60`), which would otherwise live on as an orphan.
    """
    here = str(Path(__file__).parent)
    pid_file = tmp_path / "helper.pid"
    engines = {"forking": {"module": "forking_engine", "env": {"PYTHONPATH": here, "FORKING_PID_FILE": str(pid_file)}}}
    helper: int | None = None
    try:
        with serving(tmp_path, engines) as (core, port):
            status, body = speak(port, engine="forking", text="hi", stream=False)
            assert status == 200, body
            worker = engine_of(get(port, "/health"), "forking")["pid"]
            helper = child = int(pid_file.read_text())
            assert process_alive(child) and os.getpgid(child) == worker
            core.kill()
            core.wait()
            wait_for(
                lambda: not process_alive(worker) and not process_alive(child),
                5,
                "the worker and its adapter's child to exit",
            )
    finally:
        if helper is not None and process_alive(helper):
            os.kill(helper, signal.SIGKILL)


def test_slow_client_keeps_core_memory_flat(tmp_path: Path) -> None:
    """
    A client that stops reading a long stream pauses the worker's socket: the core's
    resident memory does not grow by the stream it has not delivered.
    """
    text = " ".join(["A long sentence that keeps the stream going for a while."] * 70)[:4000]
    with serving(tmp_path) as (core, port):
        assert speak(port, text="warm up", stream=False)[0] == 200
        before = resident_kib(core.pid)
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
        body = json.dumps({"engine": "tone", "text": text, "format": "pcm"}).encode()
        sock.sendall(
            b"POST /speak HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        got = 0
        while got < 256 * 1024:
            got += len(sock.recv(16384))
        samples = []
        for _ in range(10):
            time.sleep(0.2)
            samples.append(resident_kib(core.pid))
        while True:
            data = sock.recv(262144)
            if not data:
                break
            got += len(data)
        sock.close()
        assert got > 12_000_000
        assert max(samples) - before < 6 * 1024, (before, samples)


def test_bad_config_refused_naming_the_key(tmp_path: Path) -> None:
    """
    An unknown key in the config stops the start with a message naming it.
    """
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"engines": {"tone": {"modul": "x"}}}))
    run = subprocess.run([RHAPSODE, "serve", "--config", str(path)], cwd=tmp_path, capture_output=True, timeout=60)
    assert run.returncode != 0
    assert b"engines.tone.modul" in run.stdout + run.stderr


PLUGINS = (
    "from twisted.plugin import getPlugins\n"
    "from twisted.application.service import IServiceMaker\n"
    "import sys\n"
    "found = [p for p in getPlugins(IServiceMaker) if p.tapname == 'rhapsode']\n"
    "import twisted.plugins.rhapsode_plugin as dropin\n"
    "print(dropin.__file__ if found else 'missing')\n"
)


def test_twistd_finds_the_plugin_in_the_editable_install(tmp_path: Path) -> None:
    """
    The install the README uses (make's strict editable install) makes `twistd rhapsode`
    visible from any directory.
    """
    run = subprocess.run([sys.executable, "-c", PLUGINS], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().endswith("rhapsode_plugin.py")


def test_twistd_finds_the_plugin_in_a_regular_install(tmp_path: Path) -> None:
    """
    A wheel of the project installs the dropin into twisted/plugins (and no __init__.py
    there), and twistd finds it from that install.
    """
    wheels = tmp_path / "wheels"
    # Built from a copy: setuptools writes build/ and an egg-info into the tree it builds.
    source = tmp_path / "source"
    junk = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dropin.cache")
    source.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    for folder in ("src", "twisted"):
        shutil.copytree(ROOT / folder, source / folder, ignore=junk)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(wheels), str(source)],
        check=True, capture_output=True, timeout=300,
    )
    (wheel,) = wheels.glob("rhapsode-*.whl")
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(wheel)],
        check=True, capture_output=True, timeout=300,
    )
    assert (target / "twisted" / "plugins" / "rhapsode_plugin.py").exists()
    assert not (target / "twisted" / "plugins" / "__init__.py").exists()
    assert not (target / "twisted" / "__init__.py").exists()
    env = dict(os.environ, PYTHONPATH=str(target))
    run = subprocess.run([sys.executable, "-c", PLUGINS], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert run.stdout.strip() == str(target / "twisted" / "plugins" / "rhapsode_plugin.py"), run.stderr


@pytest.mark.parametrize("module", ["rhapsode._tap", "twisted.plugins.rhapsode_plugin"])
def test_dropin_and_tap_are_import_light(module: str) -> None:
    """
    Importing the dropin or the tap module loads no reactor and no engine library.
    """
    code = (
        f"import importlib, sys; importlib.import_module({module!r}); "
        "heavy = [m for m in ('twisted.internet.reactor', 'torch', 'numpy', 'onnxruntime', 'klein') if m in sys.modules]; "
        "print(heavy)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd="/")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
