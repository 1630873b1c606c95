"""
The command line's install subcommands and their display (rhapsode._cli.install), against a
fake client: the licence rules, --pull's default, Ctrl-C detaching, and what a terminal and
a pipe are shown.
"""

from __future__ import annotations

import argparse
import io
from typing import Any, Callable

import pytest
from rich.console import Console
from twisted.internet.defer import Deferred, ensureDeferred

from rhapsode._cli import install as _progress
from rhapsode._cli.install import DETACHED, PlainProgress, RichProgress

PIPER = {"id": "piper", "displayName": "Piper", "defaultVariant": "medium",
         "license": {"code": "GPL-3.0-or-later", "weights": "CC0-1.0 AND Research", "weightsCommercialUse": False}}
TONE = {"id": "tone", "displayName": "Tone", "defaultVariant": "expressive",
        "license": {"code": "MIT", "weights": "MIT", "weightsCommercialUse": True}}


class Out:
    def __init__(self) -> None:
        self.stdout = io.StringIO()
        self.stderr = io.StringIO()

    def line(self, text: str) -> None:
        self.stdout.write(text + "\n")

    def error(self, text: str) -> None:
        self.stderr.write(text + "\n")


class Client:
    """
    The calls the subcommands make, recorded; C{follow} feeds C{events} and then
    waits on C{release} (a Deferred the test fires, or cancels as Ctrl-C does).
    """

    def __init__(self, events: list[dict[str, Any]], state: str = "succeeded") -> None:
        self.installs: list[tuple[str, Any, Any]] = []
        self.events = events
        self.state = state
        self.release: Deferred[None] = Deferred()

    async def catalog(self) -> list[dict[str, Any]]:
        return [PIPER, TONE]

    async def install(self, engine: str, *, pull: Any = None, accept: Any = None) -> dict[str, Any]:
        self.installs.append((engine, pull, accept))
        return {"id": "J1", "engine": engine, "kind": "install", "state": "running"}

    async def follow(self, job_id: str, on_event: Callable[[dict[str, Any]], object]) -> dict[str, Any]:
        for event in self.events:
            on_event(event)
        await self.release
        error = {"code": "internal", "message": "pip install exited 1: no compiler"}
        return {"id": job_id, "state": self.state, **({"error": error} if self.state == "failed" else {})}


def namespace(**values: Any) -> argparse.Namespace:
    defaults = {"engine": "tone", "accept": None, "pull": None, "yes": False, "detach": False, "verbose": False}
    return argparse.Namespace(**{**defaults, **values})


def no_signals(cancel: Callable[[], None]) -> Callable[[], None]:
    return lambda: None


def run(ns: argparse.Namespace, client: Client, out: Out, release: bool = True) -> int:
    if release:
        client.release.callback(None)
    result: list[int] = []
    original = _progress._sigint
    _progress._sigint = no_signals  # type: ignore[assignment]
    try:
        ensureDeferred(_progress.install(ns, client, out, 0.0)).addCallback(result.append)
    finally:
        _progress._sigint = original  # type: ignore[assignment]
    return result[0]


def test_a_licence_not_for_commercial_use_is_refused_without_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """
    Piper without --accept or --yes and no terminal: both licences printed, the refusal
    names the licence and how to accept it, exit 1, and no install is asked for.
    """
    monkeypatch.setattr("sys.stdin", io.StringIO())
    out, client = Out(), Client([])
    assert run(namespace(engine="piper"), client, out) == 1
    assert "Piper: code GPL-3.0-or-later; weights CC0-1.0 AND Research (commercial use: NO)" in out.stdout.getvalue()
    assert "--accept 'CC0-1.0 AND Research'" in out.stderr.getvalue()
    assert client.installs == []


def test_yes_accepts_the_catalogs_weights_licence_and_pull_takes_the_default_variant() -> None:
    """
    --yes sends accept naming the catalog's weights licence exactly (and says so), and
    a bare --pull asks for the catalog's default variant.
    """
    out, client = Out(), Client([])
    assert run(namespace(engine="piper", yes=True, pull=""), client, out) == 0
    assert client.installs == [("piper", "medium", "CC0-1.0 AND Research")]
    assert "accepted the weights licence CC0-1.0 AND Research" in out.stdout.getvalue()
    assert out.stdout.getvalue().endswith("install piper: done\n")


def test_a_commercial_engine_sends_no_accept_and_a_failed_job_prints_its_error() -> None:
    """
    An engine whose weights allow commercial use is installed without accept; a job
    that fails prints its error's code and message and exits 1.
    """
    out, client = Out(), Client([], state="failed")
    assert run(namespace(engine="tone"), client, out) == 1
    assert client.installs == [("tone", None, None)]
    assert out.stderr.getvalue() == "internal: pip install exited 1: no compiler\n"


def test_ctrl_c_detaches_and_says_how_to_follow_again() -> None:
    """
    Cancelling the follow (what Ctrl-C does) exits 130 naming the job, which is left to
    go on: nothing else is asked of the server.
    """
    out, client = Out(), Client([])
    hooks: list[Callable[[], None]] = []

    def interrupt(cancel: Callable[[], None]) -> Callable[[], None]:
        hooks.append(cancel)
        return lambda: None

    original = _progress._sigint
    _progress._sigint = interrupt  # type: ignore[assignment]
    result: list[int] = []
    try:
        ensureDeferred(_progress.install(namespace(engine="tone"), client, out, 0.0)).addCallback(result.append)
        assert result == []
        hooks[0]()
    finally:
        _progress._sigint = original  # type: ignore[assignment]
    assert result == [DETACHED]
    assert "detached: the install of tone goes on in the server. Follow it again with `rhapsode jobs J1`" in (
        out.stdout.getvalue())


def step(phase: str, index: int, status: str = "running") -> dict[str, Any]:
    return {"kind": "progress", "progress": {"phase": phase, "index": index, "total": 4, "status": status}}


def log(message: str) -> dict[str, Any]:
    return {"kind": "log", "message": message}


def test_plain_progress_prints_a_line_per_step_and_pips_lines_only_when_verbose() -> None:
    """
    Piped, each running step is one line with its place; log lines appear only with -v,
    and never pip's raw progress counts; an error goes to stderr.
    """
    events = [step("venv", 1), log("Collecting rhapsode"), log("Progress 1024 of 4096"), step("packages", 2),
              {"kind": "error", "message": "pip install exited 1: why"}]
    quiet, verbose = Out(), Out()
    for out, shown in ((quiet, PlainProgress(quiet)), (verbose, PlainProgress(verbose, verbose=True))):
        for event in events:
            shown.event(event)
    assert quiet.stdout.getvalue() == "venv (1/4)\npackages (2/4)\n"
    assert verbose.stdout.getvalue() == "venv (1/4)\n    Collecting rhapsode\npackages (2/4)\n"
    assert quiet.stderr.getvalue() == "pip install exited 1: why\n"


def test_rich_progress_draws_steps_the_newest_line_and_a_download_bar_at_a_terminal() -> None:
    """
    At a terminal: the step bar with the newest line under the step, a download bar from
    pip's raw progress lines named after the file, and the bar gone once the next step
    begins.
    """
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=120, color_system=None)
    shown = RichProgress(console, "install kokoro")
    shown.event(step("packages", 2))
    shown.event(log("  Downloading onnxruntime-1.23.2-cp311-cp311-manylinux.whl (17.2 MB)"))
    shown.event(log("Progress 8000000 of 17200000"))
    progress = shown._progress
    tasks = {task.description.split()[0]: task for task in progress.tasks}
    download = tasks["onnxruntime-1.23.2-cp311-cp311-manylinux.whl"]
    assert (download.completed, download.total) == (8000000, 17200000)
    step_task = progress.tasks[0]
    assert step_task.description.startswith("install kokoro: packages")
    assert "Downloading onnxruntime" in step_task.description
    assert (step_task.completed, step_task.total) == (1, 4)
    shown.event(step("verify", 3))
    assert len(progress.tasks) == 1
    shown.event(step("register", 4, "done"))
    assert (progress.tasks[0].completed, progress.tasks[0].total) == (4, 4)
    shown.close()
    assert "install kokoro: register" in screen.getvalue()


def test_the_download_bar_shows_human_sizes_and_each_files_own_total() -> None:
    """
    The download bar reads in human sizes (8.0 MiB of 16 MiB, never 8000000/17200000),
    and a file that follows another starts without the one before's total: a small file
    pip reports no progress for shows none, not the previous file's bytes.
    """
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=140, color_system=None)
    shown = RichProgress(console, "install kokoro")
    shown.event(step("packages", 2))
    shown.event(log("  Downloading onnxruntime-1.23.2-cp311-cp311-manylinux.whl (17.2 MB)"))
    shown.event(log("Progress 8388608 of 17825792"))
    shown._progress.refresh()
    drawn = screen.getvalue()
    assert "8.0 MiB of 17 MiB" in drawn, drawn
    assert "8388608" not in drawn and "17825792" not in drawn
    shown.event(log("  Downloading small-1.0-py3-none-any.whl (12 kB)"))
    screen.truncate(0)
    screen.seek(0)
    shown._progress.refresh()
    drawn = screen.getvalue()
    assert "small-1.0-py3-none-any.whl" in drawn and "17 MiB" not in drawn and "17825792" not in drawn, drawn
    shown.event(log("Progress 6144 of 12288"))
    shown._progress.refresh()
    assert "6.0 KiB of 12 KiB" in screen.getvalue()
    shown.close()
