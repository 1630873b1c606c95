"""
What the web page's browser tests share: a real `rhapsode serve` with the tone engine
from its own virtualenv, a real `rhapsode web` in front of it, Debian's headless
Chromium, and a page that records every console error.  (A module of its own, not
conftest: two test folders' conftest modules would shadow each other on import.)
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Where `make screenshots` has the tests save the README's pictures; without it they
#: go under the run's temporary folder, so a test run never rewrites a tracked file.
SCREENSHOTS_VARIABLE = "RHAPSODE_SCREENSHOTS"
TONE_PYTHON = ROOT / ".venvs" / "tone" / "bin" / "python"
BIN = Path(sys.executable).parent
#: Where Debian puts a Chromium Playwright can drive (`make browser-deps` installs one).
CHROMIUM = ("chromium-headless-shell", "chromium")
LAUNCH_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--autoplay-policy=no-user-gesture-required",
]

#: Every wait of the page's (Playwright's, in milliseconds) is a hang guard, never a
#: timing: what an idle box shows in a second or two, one ten times slower shows in 20.
HANG_GUARD_MS = 120_000


def chromium_path() -> str:
    for name in CHROMIUM:
        found = shutil.which(name)
        if found:
            return found
    for candidate in ("/usr/lib/chromium/chromium-headless-shell", "/usr/lib/chromium/chromium"):
        if os.access(candidate, os.X_OK):
            return candidate
    pytest.fail("no Chromium on this machine: `make browser-deps` installs Debian's chromium-headless-shell")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def call(base: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """A JSON call straight to a server on loopback (no Origin: not a browser)."""
    request = urllib.request.Request(
        base + path, method=method, data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw[:1] in (b"{", b"[") else raw
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")


def wait_until_up(url: str, process: "subprocess.Popen[bytes]", log: Path, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"{url} exited {process.returncode}:\n{log.read_text(errors='replace')}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except (OSError, ValueError):
            time.sleep(0.1)
    raise AssertionError(f"{url} did not answer within {seconds} s:\n{log.read_text(errors='replace')}")


@dataclass
class Served:
    """A core and the page in front of it."""

    core: str
    web: str
    folder: Path
    processes: list["subprocess.Popen[bytes]"] = field(default_factory=list)

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def serve(folder: Path, engines: dict[str, Any], **sections: Any) -> Served:
    """Start `rhapsode serve` with C{engines} and `rhapsode web` in front of it."""
    core_port, web_port = free_port(), free_port()
    config = {
        "server": {"port": core_port, "host": "127.0.0.1", "shutdownGraceMs": 1000},
        "workers": {"socketDir": str(folder / "sock"), "voiceDir": str(folder / "voices")},
        "engines": engines,
        **sections,
    }
    (folder / "rhapsode.json").write_text(json.dumps(config))
    served = Served(f"http://127.0.0.1:{core_port}", f"http://127.0.0.1:{web_port}", folder)
    env = {key: value for key, value in os.environ.items() if key != "RHAPSODE_MANAGEMENT_TOKEN"}
    try:
        core_log = folder / "core.log"
        # The child has its own copy of the descriptor: the parent's is closed at once.
        with core_log.open("wb") as out:
            served.processes.append(subprocess.Popen(
                [str(BIN / "rhapsode"), "serve", "--config", str(folder / "rhapsode.json")],
                cwd=folder, stdout=out, stderr=subprocess.STDOUT, env=env))
        wait_until_up(served.core + "/health", served.processes[0], core_log)
        web_log = folder / "web.log"
        with web_log.open("wb") as out:
            served.processes.append(subprocess.Popen(
                [str(BIN / "rhapsode"), "web", "--core", served.core, "--port", str(web_port)],
                cwd=folder, stdout=out, stderr=subprocess.STDOUT, env=env))
        wait_until_up(served.web + "/", served.processes[1], web_log)
    except BaseException:
        served.stop()
        raise
    return served


@dataclass
class Page:
    """A page of the site with every console error and uncaught exception recorded."""

    page: Any
    errors: list[str]
    #: Where screenshots go (L{screenshot_folder}).
    shots: Path

    def open(self, base: str, name: str) -> Any:
        self.page.goto(f"{base}/#{name}")
        self.page.wait_for_selector(f'main[data-ready="{name}"]', timeout=HANG_GUARD_MS)
        return self.page

    def screenshot(self, name: str) -> Path:
        self.shots.mkdir(parents=True, exist_ok=True)
        path = self.shots / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path


def screenshot_folder(temporary: Path) -> Path:
    """
    Where a run's screenshots go: $RHAPSODE_SCREENSHOTS (`make screenshots` sets it to
    docs/screenshots), else C{temporary}.
    """
    chosen = os.environ.get(SCREENSHOTS_VARIABLE)
    return Path(chosen).resolve() if chosen else temporary
