"""
The update check and the `update`, `settings`, `warm` and `doctor` subcommands against a
real `rhapsode serve` whose release source (update.url) is a fake GitHub this test runs on
loopback: never the network.  The check is lazy, off by the setting (live) or by
RHAPSODE_UPDATE_CHECK=0 in the server's environment, a failure is an answer, and nothing
of it reaches /health.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import urllib.request
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest

import rhapsode
from _worker import free_port, get, serving_core, wait_for

RHAPSODE = str(Path(sys.executable).parent / "rhapsode")
TONE = {"tone": {"module": "rhapsode_engine_tone"}}


class FakeReleases:
    """
    GitHub's latest-release route on 127.0.0.1: answers C{code} with C{body}, and keeps
    each request's path and headers.
    """

    def __init__(self) -> None:
        self.code = 200
        self.body: Any = {"tag_name": "v99.0.0", "html_url": "https://github.test/rhapsode/releases/tag/v99.0.0"}
        self.requests: list[tuple[str, dict[str, str]]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                fake.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
                raw = json.dumps(fake.body).encode()
                self.send_response(fake.code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/repos/maroonedsoftware/rhapsode/releases/latest"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def releases() -> Iterator[FakeReleases]:
    fake = FakeReleases()
    yield fake
    fake.close()


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory, releases: FakeReleases) -> Iterator[str]:
    """
    One core serving tone with its release source pointed at the fake; its address.
    """
    saved = os.environ.pop("RHAPSODE_UPDATE_CHECK", None)
    try:
        with serving_core(tmp_path_factory.mktemp("update"), TONE, update={"url": releases.url}) as (_, port):
            yield f"http://127.0.0.1:{port}"
    finally:
        if saved is not None:
            os.environ["RHAPSODE_UPDATE_CHECK"] = saved


def call(url: str, method: str = "GET", body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=20) as response:
        return json.loads(response.read())


def cli(url: str, *argv: str, stdin: bytes | None = None) -> "subprocess.CompletedProcess[bytes]":
    env = {**os.environ, "RHAPSODE_URL": url}
    return subprocess.run([RHAPSODE, *argv], capture_output=True, env=env, timeout=60, input=stdin)


def test_a_first_get_is_pending_then_ok_from_one_request_naming_only_rhapsode(core: str, releases: FakeReleases) -> None:
    """
    GET /update answers pending at once and starts one check; the answer then says ok,
    99.0.0 available, with the release's page; the fake saw exactly one request, whose
    User-Agent is rhapsode/<version> and which carried no token or identifier.
    """
    first = call(core + "/update")
    assert first == {"version": rhapsode.__version__, "check": "pending", "distribution": "source"}
    answer = wait_for(lambda: (lambda d: d if d["check"] == "ok" else None)(call(core + "/update")), 15, "the check")
    assert (answer["latest"], answer["updateAvailable"]) == ("99.0.0", True)
    assert answer["releaseUrl"] == releases.body["html_url"] and answer["checkedAt"].endswith("Z")
    assert len(releases.requests) == 1
    path, headers = releases.requests[0]
    assert path == "/repos/maroonedsoftware/rhapsode/releases/latest"
    assert headers["user-agent"] == f"rhapsode/{rhapsode.__version__}"
    assert not {"authorization", "cookie", "x-forwarded-for"} & set(headers)


def test_post_check_within_five_minutes_does_not_ask_again_and_health_says_nothing(core: str, releases: FakeReleases) -> None:
    """
    POST /update/check with an answer minutes old returns it without asking GitHub; and
    /health carries nothing about the check.
    """
    call(core + "/update/check", "POST")  # after the test above, or its own first answer
    asked = len(releases.requests)
    for _ in range(5):
        assert call(core + "/update/check", "POST")["check"] == "ok"
    assert len(releases.requests) == asked
    health = get(int(core.rsplit(":", 1)[1]), "/health")
    assert not {"check", "latest", "updateAvailable", "update"} & set(health)


def test_the_setting_turns_it_off_at_once_and_back(core: str, releases: FakeReleases) -> None:
    """
    PATCH /settings update.check false: GET and POST answer off straight away and ask
    nothing; cleared (null), the check is on again.
    """
    asked = len(releases.requests)
    patched = call(core + "/settings", "PATCH", {"update": {"check": False}})
    assert patched["values"]["update"]["check"] is False
    assert call(core + "/update")["check"] == "off"
    assert call(core + "/update/check", "POST") == {"version": rhapsode.__version__, "check": "off", "distribution": "source"}
    assert len(releases.requests) == asked
    call(core + "/settings", "PATCH", {"update": {"check": None}})
    assert call(core + "/update")["check"] in ("ok", "pending")


def test_the_update_command_prints_latest_and_where(core: str) -> None:
    """
    rhapsode update --check prints the version, the latest release and where it is;
    --json prints the document.
    """
    shown = cli(core, "update", "--check")
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout.decode()
    assert f"version     {rhapsode.__version__} (source)" in text
    assert "latest      99.0.0" in text and "available   yes: https://github.test/" in text
    assert json.loads(cli(core, "update", "--json").stdout)["check"] == "ok"


def test_the_settings_command_lists_shows_sets_and_unsets(core: str) -> None:
    """
    settings lists every field; settings KEY shows one; KEY VALUE patches it (JSON when
    it parses), - reads the value from stdin; --unset clears it; a restart key says it
    is saved for the next start; an unknown key is bad_request, exit 1.
    """
    listed = cli(core, "settings")
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.decode().splitlines()
    assert lines[0].split()[:4] == ["KEY", "VALUE", "SOURCE", "APPLIES"]
    assert any(line.split()[:2] == ["update.check", "true"] for line in lines)
    changed = cli(core, "settings", "residency.keepAliveSeconds", "900")
    assert changed.returncode == 0, changed.stderr
    assert changed.stdout.decode().strip() == "residency.keepAliveSeconds = 900 (database, live)"
    assert cli(core, "settings", "residency.keepAliveSeconds").stdout.decode().startswith("residency.keepAliveSeconds = 900")
    piped = cli(core, "settings", "engines.tone.keepAliveSeconds", "-", stdin=b"60\n")
    assert piped.returncode == 0 and "= 60 (database, live)" in piped.stdout.decode()
    later = cli(core, "settings", "log.level", "debug")
    assert "saved debug, in use from the next start" in later.stdout.decode()
    for key in ("residency.keepAliveSeconds", "engines.tone.keepAliveSeconds", "log.level"):
        assert cli(core, "settings", key, "--unset").returncode == 0
    assert cli(core, "settings", "residency.keepAliveSeconds").stdout.decode().startswith("residency.keepAliveSeconds = 300 (default")
    refused = cli(core, "settings", "residency.keepAliveSecs", "5")
    assert refused.returncode == 1 and refused.stderr.decode().startswith("bad_request: residency.keepAliveSecs")
    bad = cli(core, "settings", "residency.keepAliveSeconds", "-7")
    assert bad.returncode == 1 and bad.stderr.decode().startswith("bad_request: residency.keepAliveSeconds")


def test_warm_loads_tone_and_ps_shows_it(core: str) -> None:
    """
    warm tone loads its model through a discarded /speak: ps then lists tone, kept for
    the keep-alive asked.
    """
    warmed = cli(core, "warm", "tone", "--keep-alive", "-1")
    assert warmed.returncode == 0, warmed.stderr
    assert warmed.stdout.decode().startswith("tone: ") and "until Never" in warmed.stdout.decode()
    models = json.loads(cli(core, "ps", "--json").stdout)["models"]
    assert [(m["engine"], m["keepAliveSeconds"]) for m in models] == [("tone", -1)]
    assert cli(core, "unload", "tone").returncode == 0
    refused = cli(core, "warm", "nope")
    assert refused.returncode == 1 and refused.stderr.decode().startswith('unknown_engine: no engine "nope"')


def test_doctor_reports_the_server_engines_update_and_tools(core: str) -> None:
    """
    doctor against a healthy core: the server and tone ok, the catalog, the update
    check's answer, ffmpeg, uv and where the logs are; exit 0.
    """
    doctor = cli(core, "doctor")
    text = doctor.stdout.decode()
    assert doctor.returncode == 0, text + doctor.stderr.decode()
    checks = {line.split()[0] for line in text.splitlines()[1:] if line.strip()}
    assert {"server", "engine", "catalog", "update", "state", "ffmpeg", "uv", "logs"} <= checks
    assert "99.0.0 is out" in text and "stdout" in text and "FAIL" not in text


def test_doctor_with_nothing_listening_exits_1() -> None:
    """
    doctor with no server says so as a FAIL row, still reports the local tools, and exits 1.
    """
    doctor = cli(f"http://127.0.0.1:{free_port()}", "doctor")
    assert doctor.returncode == 1
    text = doctor.stdout.decode()
    assert "server   FAIL" in text and "nothing is answering" in text and "ffmpeg" in text


def test_a_failed_check_is_a_200_with_check_failed(tmp_path: Path, releases: FakeReleases) -> None:
    """
    A release source answering 403 makes POST /update/check answer 200 check: failed,
    with none of the ok fields.
    """
    releases.code = 403
    try:
        with serving_core(tmp_path, {}, update={"url": releases.url}) as (_, port):
            answer = call(f"http://127.0.0.1:{port}/update/check", "POST")
            assert answer == {"version": rhapsode.__version__, "check": "failed", "distribution": "source"}
    finally:
        releases.code = 200


def test_the_environment_turns_it_off_over_the_setting(tmp_path: Path, releases: FakeReleases, monkeypatch: pytest.MonkeyPatch) -> None:
    """
    A core started with RHAPSODE_UPDATE_CHECK=0 answers off, asks nothing, and a PATCH of
    update.check true does not turn it back on; RHAPSODE_DISTRIBUTION=docker says docker.
    """
    monkeypatch.setenv("RHAPSODE_UPDATE_CHECK", "0")
    monkeypatch.setenv("RHAPSODE_DISTRIBUTION", "docker")
    asked = len(releases.requests)
    with serving_core(tmp_path, {}, update={"url": releases.url}) as (_, port):
        base = f"http://127.0.0.1:{port}"
        call(base + "/settings", "PATCH", {"update": {"check": True}})
        assert call(base + "/update") == {"version": rhapsode.__version__, "check": "off", "distribution": "docker"}
        assert call(base + "/update/check", "POST")["check"] == "off"
    assert len(releases.requests) == asked
