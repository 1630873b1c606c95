"""
The `update`, `settings`, `warm` and `doctor` subcommands (L{rhapsode._cli.commands}): their
command line, what each prints and exits with against the stub core of
L{rhapsode.testing} (the real router in memory, a fake engine, a fake release source),
or against a client that records the settings calls.
tests/integration/test_update_cli.py runs them against a real server.
"""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionRefusedError

import rhapsode
from rhapsode._cli import commands as _cli
from rhapsode._cli.commands import parse_value, parser, settings_patch
from rhapsode._cli.render import setting_line, settings_table, update_text
from rhapsode._manage.update import Release, UpdateChecker
from rhapsode.client import BadRequest
from rhapsode.testing import FakeEngine, StubRhapsode

from test_cli_commands import command
from test_update import FakeSource, Switch

DOCUMENT: dict[str, Any] = {
    "values": {
        "server": {"port": 8080},
        "residency": {"keepAliveSeconds": 300},
        "management": {"tokenSet": True, "origins": []},
        "update": {"check": True},
        "engines": {"tone": {"keepAliveSeconds": None}},
    },
    "fields": [
        {"key": "server.port", "source": "config", "applies": "restart", "saved": 9090},
        {"key": "residency.keepAliveSeconds", "source": "default", "applies": "live"},
        {"key": "management.token", "source": "database", "applies": "restart", "saved": True},
        {"key": "management.origins", "source": "default", "applies": "restart"},
        {"key": "update.check", "source": "default", "applies": "live"},
        {"key": "engines.tone.keepAliveSeconds", "source": "default", "applies": "live"},
    ],
}


class SettingsClient:
    """
    A client whose settings are DOCUMENT; each PATCH body is kept in C{patches}.
    """

    def __init__(self) -> None:
        self.patches: list[dict[str, Any]] = []

    async def settings(self) -> dict[str, Any]:
        return DOCUMENT

    async def patch_settings(self, changes: dict[str, Any]) -> dict[str, Any]:
        self.patches.append(changes)
        return DOCUMENT


def test_the_command_lines() -> None:
    """
    update [--check], settings [KEY [VALUE]] [--unset], warm ENGINE [--variant V]
    [--keep-alive S] (a negative S too) and doctor parse; the client options come along.
    """
    assert parser().parse_args(["update", "--check", "--json"]).check is True
    ns = parser().parse_args(["settings", "residency.keepAliveSeconds", "-1", "--token", "t"])
    assert (ns.key, ns.value, ns.unset, ns.token) == ("residency.keepAliveSeconds", "-1", False, "t")
    assert parser().parse_args(["settings", "management.token", "-"]).value == "-"
    assert parser().parse_args(["settings", "log.level", "--unset"]).unset is True
    ns = parser().parse_args(["warm", "tone", "--variant", "fast", "--keep-alive", "-1"])
    assert (ns.engine, ns.variant, ns.keep_alive) == ("tone", "fast", -1)
    assert parser().parse_args(["doctor", "--url", "http://far:1"]).url == "http://far:1"
    with pytest.raises(SystemExit):
        parser().parse_args(["warm"])


@pytest.mark.parametrize(
    ("text", "value"),
    [("900", 900), ("true", True), ("null", None), ('["https://a.example"]', ["https://a.example"]),
     ("debug", "debug"), ("a-token-of-thirty-two-characters", "a-token-of-thirty-two-characters")],
)
def test_a_value_is_json_when_it_parses_and_text_otherwise(text: str, value: Any) -> None:
    """
    VALUE is read as JSON when it parses, else as the string given.
    """
    assert parse_value(text) == value


def test_a_dotted_key_becomes_the_patch_body() -> None:
    """
    SECTION.NAME and engines.ID.NAME become the nested object PATCH /settings takes; a
    key that is neither is bad_request naming it, before anything is sent.
    """
    assert settings_patch("residency.keepAliveSeconds", 5) == {"residency": {"keepAliveSeconds": 5}}
    assert settings_patch("engines.my-tone.keepAliveSeconds", None) == {"engines": {"my-tone": {"keepAliveSeconds": None}}}
    for bad in ("residency", "a.b.c", ".x", "engines.keepAliveSeconds"):
        with pytest.raises(BadRequest) as refused:
            settings_patch(bad, 1)
        assert refused.value.field == bad


def test_the_settings_table_shows_every_field_and_never_the_token() -> None:
    """
    A row per field: key, the value in use, source, live or restart, and the value saved
    for the next start; the token reads (set), a new one (new token).
    """
    text = settings_table(DOCUMENT)
    rows = {line.split()[0]: line.split() for line in text.splitlines()[1:]}
    assert text.splitlines()[0].split()[:4] == ["KEY", "VALUE", "SOURCE", "APPLIES"]
    assert rows["server.port"] == ["server.port", "8080", "config", "restart", "9090"]
    assert rows["management.token"][:2] == ["management.token", "(set)"] and "(new token)" in text
    assert rows["management.origins"][1] == "[]" and rows["engines.tone.keepAliveSeconds"][1] == "null"
    assert len(rows) == len(DOCUMENT["fields"])


def test_one_setting_in_a_line_and_an_unknown_one_refused() -> None:
    """
    settings KEY prints the value, source and when it applies, and what is saved; a key
    the document lacks is bad_request naming it.
    """
    assert setting_line(DOCUMENT, "server.port") == "server.port = 8080 (config, restart); saved 9090, in use from the next start\n"
    with pytest.raises(BadRequest, match="nope.x: no such setting"):
        setting_line(DOCUMENT, "nope.x")


def test_settings_key_value_patches_and_dash_reads_stdin(monkeypatch: pytest.MonkeyPatch) -> None:
    """
    settings KEY VALUE sends the nested patch with VALUE parsed; - reads the value from
    stdin (a token stays out of shell history); --unset sends null.
    """
    client = SettingsClient()
    code, out = command(None, "settings", "residency.keepAliveSeconds", "900", client=client)
    assert code == 0 and out.text.startswith("residency.keepAliveSeconds = ")
    monkeypatch.setattr("sys.stdin", io.StringIO("a-token-of-thirty-two-characters\n"))
    assert command(None, "settings", "management.token", "-", client=client)[0] == 0
    assert command(None, "settings", "engines.tone.keepAliveSeconds", "--unset", client=client)[0] == 0
    assert client.patches == [
        {"residency": {"keepAliveSeconds": 900}},
        {"management": {"token": "a-token-of-thirty-two-characters"}},
        {"engines": {"tone": {"keepAliveSeconds": None}}},
    ]


def test_settings_usage_errors_and_refusals() -> None:
    """
    A VALUE with --unset, or --unset without a KEY, is a usage error (exit 2) and sends
    nothing; an unknown key shown is bad_request, exit 1.
    """
    client = SettingsClient()
    code, out = command(None, "settings", "log.level", "debug", "--unset", client=client)
    assert code == 2 and "not both" in out.errors
    assert command(None, "settings", "--unset", client=client)[0] == 2
    assert client.patches == []
    code, out = command(None, "settings", "nope.x", client=client)
    assert code == 1 and out.errors.startswith("bad_request: nope.x: no such setting")


def test_settings_json_prints_the_document_or_the_field() -> None:
    """
    settings --json prints the server's document; settings KEY --json the field with
    its value.
    """
    code, out = command(None, "settings", "--json", client=SettingsClient())
    assert json.loads(out.text) == DOCUMENT
    code, out = command(None, "settings", "server.port", "--json", client=SettingsClient())
    assert json.loads(out.text) == {"key": "server.port", "source": "config", "applies": "restart", "saved": 9090, "value": 8080}


def test_settings_on_a_core_without_a_state_database_is_unsupported() -> None:
    """
    The stub core keeps no settings: the server's unsupported, printed, exit 1.
    """
    code, out = command(StubRhapsode({"tone": FakeEngine()}), "settings")
    assert code == 1 and out.errors.startswith("unsupported: ")


def stub_with_updates(version: str = "0.1.9", distribution: str = "source") -> tuple[StubRhapsode, FakeSource, Switch]:
    stub = StubRhapsode({"tone": FakeEngine()})
    source, switch = FakeSource(), Switch()
    stub.core.updates = UpdateChecker(
        clock=stub.clock, source=source, version=version, enabled=switch, distribution=distribution
    )
    return stub, source, switch


def test_update_prints_pending_then_the_answer() -> None:
    """
    update on a fresh core says pending; once the source answered it prints the latest
    release, that one is available, where, and how for a source install.
    """
    stub, source, _ = stub_with_updates()
    code, out = command(stub, "update")
    assert code == 0 and "check       pending" in out.text
    source.asked[0].callback(Release("v0.2.0", "https://github.test/r/v0.2.0"))
    code, out = command(stub, "update")
    assert out.text.splitlines() == [
        "version     0.1.9 (source)",
        f"latest      0.2.0 (asked {json.loads(command(stub, 'update', '--json')[1].text)['checkedAt']})",
        "available   yes: https://github.test/r/v0.2.0",
        "how         update this installation (git pull, then make), then reinstall the engines `rhapsode engines` marks outdated",
    ]


def test_update_check_waits_for_the_answer() -> None:
    """
    update --check posts /update/check and prints once the source answered.
    """
    stub, source, _ = stub_with_updates("0.2.0", "docker")
    running = Deferred.fromCoroutine(
        _cli.run(parser().parse_args(["update", "--check"]), stub.client(), out := _Buffers(), "http://box:8080")
    )
    stub.flush()
    assert not running.called and out.text == ""
    source.asked[0].callback(Release("v0.2.0", "https://github.test/r/v0.2.0"))
    stub.flush()
    assert running.result == 0 and "available   no: this is the latest release" in out.text
    assert "0.2.0 (docker)" in out.text


class _Buffers(_cli.Output):
    def __init__(self) -> None:
        super().__init__(io.StringIO(), io.StringIO(), io.BytesIO())

    @property
    def text(self) -> str:
        return self.stdout.getvalue()  # type: ignore[attr-defined,no-any-return]


@pytest.mark.parametrize(
    ("document", "says"),
    [
        ({"version": "1.0.0", "check": "off", "distribution": "source"}, "check       off"),
        ({"version": "1.0.0", "check": "failed", "distribution": "source"}, "check       failed"),
        ({"version": "1.0.0", "check": "ok", "latest": "1.1.0", "updateAvailable": True, "releaseUrl": "u",
          "checkedAt": "t", "distribution": "docker"}, "docker compose pull"),
    ],
)
def test_update_text_for_each_state(document: dict[str, Any], says: str) -> None:
    """
    off, failed and an available release in the image each say so, with what to do.
    """
    assert says in update_text(document)


def test_warm_loads_the_model_through_a_discarded_speak() -> None:
    """
    warm ENGINE speaks a short text buffered with the keep-alive and variant given,
    writes no audio anywhere, and prints what is resident now.
    """
    stub = StubRhapsode({"tone": FakeEngine()})
    code, out = command(stub, "warm", "tone", "--keep-alive", "-1")
    assert code == 0, out.errors
    assert out.text.startswith("tone: ") and "until Never" in out.text
    assert out.binary.getvalue() == b""  # type: ignore[attr-defined]
    [spoken] = stub.engines["tone"].spoken
    assert spoken["text"] == _cli.WARM_TEXT and "keepAliveSeconds" not in spoken
    code, out = command(stub, "warm", "nope")
    assert code == 1 and out.errors.startswith('unknown_engine: no engine "nope"')


TOOLS = {"ffmpeg": "/usr/bin/ffmpeg", "uv": None}


def test_doctor_on_a_healthy_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """
    doctor lists the server, each engine, the catalog, the update check, the state
    database, ffmpeg, uv (missing: a warning) and where the logs are; nothing failed, exit 0.
    """
    monkeypatch.setattr(_cli, "local_tools", lambda: TOOLS)
    stub, source, switch = stub_with_updates(rhapsode.__version__)
    switch.on = False
    code, out = command(stub, "doctor")
    assert code == 0, out.text
    rows = {line.split()[0]: line for line in out.text.splitlines()[1:] if line.strip()}
    assert set(rows) == {"server", "engine", "catalog", "update", "state", "ffmpeg", "uv", "logs"}
    assert "ok" in rows["server"].split() and "warn" in rows["uv"].split()
    assert "off" in rows["update"] and "/usr/bin/ffmpeg" in rows["ffmpeg"] and "stdout" in rows["logs"]
    assert "rhapsode.db beside the server's config file" in rows["state"]


def test_doctor_fails_when_nothing_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """
    A server that does not answer is a FAIL row and exit 1; the local checks still run.
    """
    monkeypatch.setattr(_cli, "local_tools", lambda: TOOLS)

    class Nowhere:
        async def health(self) -> Any:
            raise ConnectionRefusedError()

    code, out = command(None, "doctor", "--url", "http://box:9", client=Nowhere())
    assert code == 1
    assert "FAIL" in out.text and "nothing is answering at http://box:9" in out.text and "ffmpeg" in out.text


def test_doctor_fails_on_a_failed_engine_and_warns_on_an_outdated_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """
    An engine whose process failed is a FAIL (exit 1); one whose worker is outdated is a
    warning naming the reinstall.
    """
    monkeypatch.setattr(_cli, "local_tools", lambda: TOOLS)

    class Broken:
        async def health(self) -> Any:
            return {"status": "degraded", "version": "0.2.0", "contract": 1, "engines": [
                {"id": "kokoro", "process": "failed", "model": "unloaded", "lastError": "exited 1"},
                {"id": "piper", "process": "down", "model": "unloaded", "workerVersion": "0.1.0", "outdated": True},
            ]}

        async def catalog(self) -> Any:
            return []

        async def update(self) -> Any:
            return {"version": "0.2.0", "check": "failed", "distribution": "source"}

        async def settings(self) -> Any:
            return DOCUMENT

    code, out = command(None, "doctor", client=Broken())
    assert code == 1
    lines = out.text.splitlines()
    assert any("FAIL" in line and "kokoro" in line and "exited 1" in line for line in lines)
    assert any("warn" in line.split() and "piper" in line and "reinstall piper" in line for line in lines)
    assert any(line.startswith("update") and "warn" in line.split() for line in lines)
