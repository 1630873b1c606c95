"""
The client subcommands of `rhapsode` (L{rhapsode._cli.commands}): their command line, the plain
tables they print, and what each prints and exits with against the stub core of
L{rhapsode.testing} (the real router over an in-memory reactor, a fake engine).
tests/integration/test_cli_client.py runs the real executable against a real server.
"""

from __future__ import annotations

import argparse
import io
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.defer import Deferred, fail
from twisted.internet.error import ConnectionRefusedError
from twisted.trial.unittest import SynchronousTestCase

import rhapsode
from rhapsode._cli.commands import DEFAULT_URL, Output, parser, run, server_url
from rhapsode._cli.render import catalog_table, engines_table, residency_table, size, table, until, voices_table
from rhapsode.client import RhapsodeClient
from rhapsode.testing import FakeEngine, StubRhapsode

CASE = SynchronousTestCase()
NOW = datetime(2026, 12, 1, 12, 0, 0, tzinfo=timezone.utc).timestamp()


class Buffers(Output):
    """
    An Output into memory; C{tty} says whether its stdout claims to be a terminal.
    """

    def __init__(self, tty: bool = False) -> None:
        binary = io.BytesIO()
        binary.isatty = lambda: tty  # type: ignore[method-assign]
        super().__init__(io.StringIO(), io.StringIO(), binary)

    @property
    def text(self) -> str:
        return self.stdout.getvalue()  # type: ignore[attr-defined,no-any-return]

    @property
    def errors(self) -> str:
        return self.stderr.getvalue()  # type: ignore[attr-defined,no-any-return]


def command(stub: StubRhapsode | None, *argv: str, tty: bool = False, client: Any = None) -> tuple[int, Buffers]:
    """
    Run one client subcommand against C{stub}; its exit status and what it wrote.
    """
    ns = parser().parse_args(list(argv))
    out = Buffers(tty)
    if client is None:
        assert stub is not None
        client = stub.client()
    code = CASE.successResultOf(Deferred.fromCoroutine(run(ns, client, out, "http://box:8080", now=NOW)))
    return code, out


# -- the command line --------------------------------------------------------------------


def test_the_listing_commands_take_url_and_json() -> None:
    """
    engines, voices, catalog and ps take --json and --url after the subcommand.
    """
    ns = parser().parse_args(["voices", "tone", "--json", "--url", "http://far:1"])
    assert (ns.command, ns.engine, ns.json, ns.url) == ("voices", "tone", True, "http://far:1")
    for name in ("engines", "catalog", "ps"):
        ns = parser().parse_args([name])
        assert (ns.command, ns.json, ns.url) == (name, False, None)


def test_say_takes_its_engine_text_and_options() -> None:
    """
    say ENGINE TEXT with -o, --voice, --format and --variant; none of them required.
    """
    ns = parser().parse_args(["say", "tone", "Hello there.", "-o", "a.wav", "--voice", "alto", "--format", "mp3"])
    assert (ns.engine, ns.text, ns.output, ns.voice, ns.format, ns.variant) == (
        "tone", "Hello there.", "a.wav", "alto", "mp3", None,
    )
    assert parser().parse_args(["say", "tone", "hi"]).output is None


@pytest.mark.parametrize(
    "argv",
    [["voices"], ["say", "tone"], ["unload"], ["unload", "tone", "--mode", "sleep"], ["engines", "--voice", "x"], ["nope"]],
)
def test_a_bad_command_line_exits_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """
    A missing argument, an unknown option or mode, or an unknown subcommand is a
    usage error: argparse's exit 2, with the usage on stderr.
    """
    with pytest.raises(SystemExit) as exited:
        parser().parse_args(argv)
    assert exited.value.code == 2
    assert "usage: rhapsode" in capsys.readouterr().err


def test_the_server_is_url_then_the_environment_then_the_default() -> None:
    """
    --url wins over RHAPSODE_URL, which wins over http://127.0.0.1:8080; a trailing
    slash is dropped.
    """
    assert server_url("http://a:1/", {"RHAPSODE_URL": "http://b:2"}) == "http://a:1"
    assert server_url(None, {"RHAPSODE_URL": "http://b:2"}) == "http://b:2"
    assert server_url(None, {}) == DEFAULT_URL == "http://127.0.0.1:8080"


# -- plain text --------------------------------------------------------------------------


def test_tables_are_left_aligned_three_spaces_apart_without_trailing_spaces() -> None:
    """
    Each column as wide as its widest cell, header included, and no line ends in spaces.
    """
    assert table(["A", "LONGER"], [["wide cell", "x"], ["b", ""]]) == (
        "A           LONGER\n"
        "wide cell   x\n"
        "b\n"
    )
    assert table(["ENGINE", "SIZE"], []) == "ENGINE   SIZE\n"


@pytest.mark.parametrize(
    "count, shown",
    [(None, "-"), (0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (5 * 1024**2, "5.0 MiB"), (310 * 1024**2, "310 MiB"), (int(2.25 * 1024**3), "2.2 GiB")],
)
def test_sizes_are_binary(count: int | None, shown: str) -> None:
    """
    Bytes in binary units, one decimal under ten.
    """
    assert size(count) == shown


def _at(seconds: float) -> str:
    return datetime.fromtimestamp(NOW + seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")


@pytest.mark.parametrize(
    "model, shown",
    [
        ({"leases": 2, "keepAliveSeconds": 300, "expiresAt": _at(60)}, "speaking (2)"),
        ({"leases": 0, "keepAliveSeconds": -1}, "Never"),
        ({"leases": 0, "keepAliveSeconds": 300, "expiresAt": _at(4 * 60 + 30)}, "4 minutes from now"),
        ({"leases": 0, "keepAliveSeconds": 300, "expiresAt": _at(1)}, "1 second from now"),
        ({"leases": 0, "keepAliveSeconds": 9000, "expiresAt": _at(2 * 3600 + 5)}, "2 hours from now"),
        ({"leases": 0, "keepAliveSeconds": 604800, "expiresAt": _at(3 * 86400)}, "3 days from now"),
        ({"leases": 0, "keepAliveSeconds": 0, "expiresAt": _at(-2)}, "Stopping..."),
    ],
)
def test_until_says_when_a_model_goes_in_words(model: dict[str, Any], shown: str) -> None:
    """
    ps's UNTIL: speaking while leased, Never for -1, a human span ahead, and
    Stopping... once the time is past.
    """
    assert until(model, NOW) == shown


LICENSE = {"code": "GPL-3.0-or-later", "weights": "CC-BY-NC-4.0", "weightsCommercialUse": False}


def test_engines_table_shows_licences_model_and_an_outdated_worker() -> None:
    """
    One row per engine: its model with the variant, both licences (weights marked
    non-commercial where they are) and its worker version, marked when outdated.
    """
    text = engines_table(
        [
            {"id": "piper", "displayName": "Piper", "process": "up", "model": "loaded", "variant": "medium",
             "license": LICENSE, "workerVersion": "0.0.9", "outdated": True},
            {"id": "far", "process": "down", "model": "unloaded"},
        ]
    )
    header, piper, far = text.splitlines()
    assert header.split() == ["ENGINE", "NAME", "PROCESS", "MODEL", "CODE", "WEIGHTS", "WORKER"]
    assert "loaded (medium)" in piper and "CC-BY-NC-4.0 (non-commercial)" in piper
    assert piper.endswith("0.0.9 (outdated)")
    assert far.split() == ["far", "-", "down", "unloaded", "-", "-", "-"]


def test_catalog_table_shows_what_is_installed() -> None:
    """
    One row per catalog entry: installed or not, both licences, default variant, the
    Python range, and the worker version where installed.
    """
    text = catalog_table(
        [
            {"id": "kokoro", "displayName": "Kokoro-82M", "installed": "no", "license": LICENSE,
             "defaultVariant": "v1.0-int8", "python": ">=3.11,<3.14", "managed": False},
            {"id": "tone", "displayName": "Tone", "installed": "yes", "license": {"code": "MIT", "weights": "MIT",
             "weightsCommercialUse": True}, "defaultVariant": "expressive", "python": ">=3.11",
             "workerVersion": "0.1.0", "outdated": False},
        ]
    )
    header, kokoro, tone = text.splitlines()
    assert header.split() == ["ENGINE", "NAME", "INSTALLED", "CODE", "WEIGHTS", "DEFAULT", "PYTHON", "WORKER"]
    assert kokoro.split()[:3] == ["kokoro", "Kokoro-82M", "no"] and kokoro.endswith(">=3.11,<3.14   -")
    assert tone.split() == ["tone", "Tone", "yes", "MIT", "MIT", "expressive", ">=3.11", "0.1.0"]


def test_voices_and_residency_tables() -> None:
    """
    voices: id, label, built in or not, tags; ps: engine, variant, size and until.
    """
    voices = voices_table([{"id": "alto", "label": "Alto", "builtin": True, "tags": ["mid", "warm"]}])
    assert voices.splitlines()[1] == "alto    Alto    yes       mid, warm"
    ps = residency_table(
        {"models": [{"engine": "tone", "variant": "expressive", "leases": 0, "keepAliveSeconds": -1, "sizeBytes": 4 * 1024**2}]},
        NOW,
    )
    assert ps.splitlines() == [
        "ENGINE   VARIANT      SIZE      UNTIL",
        "tone     expressive   4.0 MiB   Never",
    ]


# -- against the stub core -------------------------------------------------------------------


def test_engines_prints_a_table_or_the_servers_json() -> None:
    """
    engines lists what the server has; --json prints the very document /engines answered.
    """
    stub = StubRhapsode({"tone": FakeEngine()})
    code, out = command(stub, "engines")
    assert code == 0 and out.text.splitlines()[1].split()[:4] == ["tone", "-", "down", "unloaded"]
    code, out = command(stub, "engines", "--json")
    assert code == 0
    assert json.loads(out.text) == CASE.successResultOf(Deferred.fromCoroutine(stub.client().engines()))


def test_voices_lists_an_engines_voices() -> None:
    """
    voices ENGINE prints one row per voice the engine lists.
    """
    code, out = command(StubRhapsode({"tone": FakeEngine()}), "voices", "tone", "--json")
    assert code == 0
    voices = json.loads(out.text)
    assert voices and all("previewUrl" in v for v in voices)
    code, out = command(StubRhapsode({"tone": FakeEngine()}), "voices", "tone")
    assert [line.split()[0] for line in out.text.splitlines()[1:]] == [v["id"] for v in voices]


def test_a_refusal_is_code_colon_message_on_stderr_and_exit_1() -> None:
    """
    An unknown engine is the server's unknown_engine, printed as the taxonomy's
    code: message on stderr, nothing on stdout, and exit 1.
    """
    code, out = command(StubRhapsode({"tone": FakeEngine()}), "voices", "nope")
    assert code == 1 and out.text == ""
    assert out.errors.startswith('unknown_engine: no engine "nope"')


def test_say_writes_the_audio_to_stdout_or_a_file(tmp_path: Path) -> None:
    """
    Without -o the audio goes to stdout's bytes, unaltered; with it, to the file, and a
    line says what was written.
    """
    stub = StubRhapsode({"tone": FakeEngine(audio=[b"\x01\x02" * 800])})
    code, out = command(stub, "say", "tone", "Hello.", "--format", "pcm")
    assert code == 0 and out.binary.getvalue() == b"\x01\x02" * 800  # type: ignore[attr-defined]
    target = tmp_path / "hello.pcm"
    code, out = command(stub, "say", "tone", "Hello.", "--format", "pcm", "-o", str(target))
    assert code == 0 and target.read_bytes() == b"\x01\x02" * 800
    assert out.text.startswith(f"{target}: 1.6 KiB of audio/L16")
    assert [body["format"] for body in stub.engines["tone"].spoken] == ["pcm", "pcm"]


def test_say_refuses_to_write_audio_to_a_terminal() -> None:
    """
    Audio on a terminal is refused before anything is asked of the server (exit 2).
    """
    stub = StubRhapsode({"tone": FakeEngine()})
    code, out = command(stub, "say", "tone", "Hello.", tty=True)
    assert code == 2 and "-o FILE" in out.errors
    assert out.binary.getvalue() == b""  # type: ignore[attr-defined]


def test_ps_lists_the_resident_models() -> None:
    """
    After speaking, ps shows the engine resident in its variant; unload ends it, and ps
    is then only its header.
    """
    stub = StubRhapsode({"tone": FakeEngine()})
    command(stub, "say", "tone", "Hello.", "--format", "pcm")
    code, out = command(stub, "ps")
    assert code == 0
    [header, row] = out.text.splitlines()
    assert header.split() == ["ENGINE", "VARIANT", "SIZE", "UNTIL"] and row.startswith("tone")
    code, out = command(stub, "unload", "tone")
    assert code == 0 and out.text.startswith("tone: process")
    assert json.loads(command(stub, "ps", "--json")[1].text)["models"] == []


def test_version_prints_the_clients_and_the_servers() -> None:
    """
    version prints this client's version and the server's from /health.
    """
    code, out = command(StubRhapsode({"tone": FakeEngine()}), "version")
    assert code == 0
    assert out.text.splitlines() == [
        f"client version {rhapsode.__version__}",
        f"server version {rhapsode.__version__} (contract 1)",
    ]


class Refused:
    """
    What treq does when nothing listens: the connection is refused.
    """

    def request(self, method: str, url: str, **kwargs: Any) -> "Deferred[Any]":
        return fail(ConnectionRefusedError())


def test_a_server_that_does_not_answer_is_named_with_how_to_start_one() -> None:
    """
    Nothing listening is exit 1 and one line naming the address and `rhapsode serve`,
    never a traceback.
    """
    code, out = command(None, "engines", client=RhapsodeClient("http://box:8080", http=Refused()))
    assert code == 1
    assert out.errors.startswith("rhapsode: nothing is answering at http://box:8080")
    assert "rhapsode serve" in out.errors and "Traceback" not in out.errors


def test_catalog_prints_the_servers_catalog() -> None:
    """
    catalog --json prints GET /catalog as the server answered it (the stub core, built
    without a catalog, answers []); the table is then its header alone.
    """
    stub = StubRhapsode({"tone": FakeEngine()})
    assert json.loads(command(stub, "catalog", "--json")[1].text) == []
    assert command(stub, "catalog")[1].text.split() == ["ENGINE", "NAME", "INSTALLED", "CODE", "WEIGHTS", "DEFAULT", "PYTHON", "WORKER"]


def test_unused_namespace_fields_do_not_matter() -> None:
    """
    run dispatches on the subcommand alone: a namespace built by hand with only what
    the subcommand reads works the same as parse_args's.
    """
    ns = argparse.Namespace(command="version", url=None)
    out = Buffers()
    stub = StubRhapsode({"tone": FakeEngine()})
    code = CASE.successResultOf(Deferred.fromCoroutine(run(ns, stub.client(), out, "http://box", now=NOW)))
    assert code == 0 and out.text.startswith("client version")


def test_say_takes_a_language() -> None:
    """
    say --language TAG asks the server for that language (protocol.md section 6), as
    --voice and --variant are asked; without it none is sent.
    """
    from rhapsode.client import Audio

    class Recording:
        def __init__(self) -> None:
            self.asked: list[dict[str, Any]] = []

        async def speak(self, engine: str, text: str, **fields: Any) -> Audio:
            self.asked.append(fields)
            return Audio(content_type="audio/L16; rate=24000; channels=1", data=b"\x00\x00", duration_ms=None)

    client = Recording()
    assert command(None, "say", "tone", "Bonjour.", "--language", "fr-FR", "-o", "/dev/null", client=client)[0] == 0
    assert command(None, "say", "tone", "Hello.", "-o", "/dev/null", client=client)[0] == 0
    assert client.asked == [{"language": "fr-FR"}, {}]
