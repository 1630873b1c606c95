"""
The command line's install subcommands (protocol.md section 10): C{install},
C{reinstall}, C{uninstall}, C{pull} and C{jobs}, and how a job's progress is shown.

At a terminal, with rich installed (C{rhapsode[cli]}), a job is a spinner with a bar of
its steps, the newest line pip printed under it, and a download bar while pip reports
one (C{Progress N of M}); elsewhere, one plain line per step, and pip's lines with
C{-v}.  Ctrl-C while following detaches: the job goes on in the server, and the command
says how to follow it again.  The API has no way to cancel a job, so neither has this.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
from typing import IO, Any, Callable, Protocol

from twisted.internet.defer import CancelledError, Deferred

from rhapsode_protocol.errors import BadRequest

from .render import size, table

#: What a detached command exits with, as a shell reports an interrupted one.
DETACHED = 130
_PROGRESS = re.compile(r"^Progress (\d+) of (\d+)$")
_DOWNLOADING = re.compile(r"^\s*Downloading (\S+)")


class _Out(Protocol):
    stdout: IO[str]
    stderr: IO[str]

    def line(self, text: str) -> None: ...

    def error(self, text: str) -> None: ...


class PlainProgress:
    """
    One line per step and the outcome; pip's lines too when C{verbose}.
    """

    def __init__(self, out: _Out, verbose: bool = False) -> None:
        self._out = out
        self._verbose = verbose

    def event(self, event: dict[str, Any]) -> None:
        kind = event.get("kind")
        if kind == "progress":
            progress = event["progress"]
            if progress["status"] == "running":
                self._out.line(f"{progress['phase']} ({progress['index']}/{progress['total']})")
        elif kind == "log" and self._verbose:
            message = str(event.get("message", ""))
            if not _PROGRESS.match(message.strip()):
                # pip's raw progress (byte counts, many a second) is for a bar, not a line.
                self._out.line("    " + message)
        elif kind == "resync":
            self._out.line("    (some lines were missed while reconnecting)")
        elif kind == "error":
            self._out.error(str(event.get("message", "")))

    def close(self) -> None:
        pass


class RichProgress:
    """
    A live display at a terminal: the steps as a bar with a spinner and the newest
    line, and a download bar from pip's raw progress lines.
    """

    def __init__(self, console: Any, title: str) -> None:
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn

        # One set of columns draws both bars, so each task says its own count: the
        # steps as N/M, a download in human sizes (a column per kind would be drawn for both).
        self._progress = Progress(
            SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[count]}"),
            console=console, transient=False,
        )
        self._title = title
        self._step = self._progress.add_task(title, total=None, count="")
        self._download: Any = None
        self._file = "download"
        self._phase = ""
        self._progress.start()

    def _end_download(self) -> None:
        if self._download is not None:
            self._progress.remove_task(self._download)
            self._download = None

    def event(self, event: dict[str, Any]) -> None:
        kind = event.get("kind")
        progress = self._progress
        if kind == "progress":
            step = event["progress"]
            # A step's downloads are over once the next step begins.
            self._end_download()
            self._phase = step["phase"]
            done = step["index"] - (1 if step["status"] == "running" else 0)
            progress.update(self._step, total=step["total"], completed=done,
                            description=f"{self._title}: {self._phase}", count=f"{done}/{step['total']}")
        elif kind == "log":
            message = str(event.get("message", ""))
            found = _PROGRESS.match(message.strip())
            if found:
                completed, total = int(found.group(1)), int(found.group(2))
                count = f"{size(completed)} of {size(total)}"
                if self._download is None:
                    self._download = progress.add_task(f"  {self._file}", total=total, count=count)
                progress.update(self._download, completed=completed, total=total, count=count)
                return
            downloading = _DOWNLOADING.match(message)
            if downloading:
                # A new file: its own bar, with no total until pip reports one (a small
                # file it reports none for shows none, not the last file's).
                self._file = downloading.group(1)[:48]
                self._end_download()
                self._download = progress.add_task(f"  {self._file}", total=None, count="")
            newest = message.strip()[:60]
            progress.update(self._step, description=f"{self._title}: {self._phase}  [dim]{newest}[/dim]")
        elif kind == "error":
            progress.console.print(f"[red]{event.get('message', '')}[/red]")

    def close(self) -> None:
        if self._download is not None:
            self._progress.remove_task(self._download)
            self._download = None
        self._progress.stop()


def display(out: _Out, title: str, verbose: bool) -> Any:
    """
    Rich's live display when stdout is a terminal and rich is installed, else plain lines.
    """
    try:
        from rich.console import Console
    except ImportError:
        return PlainProgress(out, verbose)
    console = Console(file=out.stdout)
    if not console.is_terminal:
        return PlainProgress(out, verbose)
    return RichProgress(console, title)


async def follow(
    ns: argparse.Namespace, client: Any, out: _Out, job: dict[str, Any], *,
    on_interrupt: Callable[[Callable[[], None]], Callable[[], None]] | None = None,
) -> int:
    """
    Follow C{job} to its end with a display; its exit status (0 succeeded, 1 failed,
    L{DETACHED} on Ctrl-C, the job going on).
    """
    shown = display(out, f"{job['kind']} {job['engine']}", getattr(ns, "verbose", False))
    following: Deferred[dict[str, Any]] = Deferred.fromCoroutine(client.follow(job["id"], shown.event))
    restore = (on_interrupt or _sigint)(following.cancel)
    try:
        finished = await following
    except CancelledError:
        shown.close()
        out.line(f"detached: the {job['kind']} of {job['engine']} goes on in the server. "
                 f"Follow it again with `rhapsode jobs {job['id']}`")
        return DETACHED
    finally:
        restore()
    shown.close()
    if finished["state"] == "succeeded":
        out.line(f"{job['kind']} {job['engine']}: done")
        return 0
    error = finished.get("error") or {}
    out.error(f"{error.get('code', 'internal')}: {error.get('message', 'the job failed')}")
    return 1


def _sigint(cancel: Callable[[], None]) -> Callable[[], None]:
    """
    Ctrl-C cancels following, not the job; answers how to put the old handler back.
    """
    from twisted.internet import reactor

    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, lambda number, frame: reactor.callFromThread(cancel))  # type: ignore[attr-defined]

    def restore() -> None:
        signal.signal(signal.SIGINT, previous)

    return restore


def _licence(entry: dict[str, Any]) -> tuple[str, str, bool]:
    licence = entry.get("license") or {}
    return str(licence.get("code", "?")), str(licence.get("weights", "?")), licence.get("weightsCommercialUse") is not False


def _ask(question: str, stdin: IO[str]) -> bool:
    sys.stdout.write(question)
    sys.stdout.flush()
    answer = stdin.readline()
    return answer.strip().lower() in ("y", "yes")


async def install(ns: argparse.Namespace, client: Any, out: _Out, now: float) -> int:
    """
    C{rhapsode install ENGINE}: both licences shown, the weights licence asked for
    where the catalog says it is not for commercial use (C{--accept} names it, C{--yes}
    accepts for a script), then the job followed.
    """
    catalog = {entry["id"]: entry for entry in await client.catalog()}
    entry = catalog.get(ns.engine)
    accept = ns.accept
    pull = ns.pull
    if entry is not None:
        code, weights, commercial = _licence(entry)
        out.line(f"{entry.get('displayName', ns.engine)}: code {code}; weights {weights}"
                 f" (commercial use: {'yes' if commercial else 'NO'})")
        if pull == "":
            pull = entry.get("defaultVariant")
        if not commercial and accept is None:
            if ns.yes:
                accept = weights
            elif sys.stdin.isatty():
                if not _ask(f"Its weights are under {weights}, which does not allow commercial use. "
                            "Accept that licence? [y/N] ", sys.stdin):
                    out.error("not installed: the weights licence was not accepted")
                    return 1
                accept = weights
            else:
                out.error(f"bad_request: the weights of {ns.engine} are under {weights}, which does not allow "
                          f"commercial use; pass --accept '{weights}' (or --yes) to accept it")
                return 1
    elif pull == "":
        raise BadRequest(f"--pull needs a variant for {ns.engine}: the catalog does not name one", field="pull")
    job = await client.install(ns.engine, pull=pull, accept=accept)
    if accept is not None:
        out.line(f"accepted the weights licence {accept}")
    if ns.detach:
        out.line(f"started {job['id']}; follow it with `rhapsode jobs {job['id']}`")
        return 0
    return await follow(ns, client, out, job)


async def reinstall(ns: argparse.Namespace, client: Any, out: _Out, now: float) -> int:
    """
    C{rhapsode reinstall ENGINE}, or C{--outdated} for every engine an upgrade left behind.
    """
    if ns.outdated:
        answer = await client.reinstall_outdated()
        for skipped in answer["skipped"]:
            out.line(f"skipped {skipped['engine']}: {skipped['reason']}")
        if not answer["jobs"]:
            out.line("nothing is outdated")
            return 0
        status = 0
        for job in answer["jobs"]:
            status = max(status, await follow(ns, client, out, job))
            if status == DETACHED:
                return status
        return status
    if ns.engine is None:
        raise BadRequest("name an engine, or give --outdated", field="engine")
    job = await client.reinstall(ns.engine, accept=ns.accept)
    return await follow(ns, client, out, job)


async def uninstall(ns: argparse.Namespace, client: Any, out: _Out, now: float) -> int:
    await client.uninstall(ns.engine)
    out.line(f"{ns.engine}: uninstalled (its weights, in the engine's own cache, are left alone)")
    return 0


async def pull(ns: argparse.Namespace, client: Any, out: _Out, now: float) -> int:
    variant = ns.variant
    if variant is None:
        entry = {e["id"]: e for e in await client.catalog()}.get(ns.engine) or {}
        variant = entry.get("defaultVariant")
        if variant is None:
            raise BadRequest(f"name a variant of {ns.engine} to pull", field="variant")
    job = await client.pull(ns.engine, variant)
    return await follow(ns, client, out, job)


async def jobs(ns: argparse.Namespace, client: Any, out: _Out, now: float) -> int:
    """
    C{rhapsode jobs}: every job the server knows, newest first; C{rhapsode jobs JOB}
    follows one (or shows how it ended).
    """
    if ns.job is None:
        listed = await client.jobs()
        if getattr(ns, "json", False):
            import json

            out.line(json.dumps(listed, indent=2))
            return 0

        rows = [[j["id"], j["kind"], j["engine"], j.get("variant", ""), j["state"], j.get("step", ""),
                 j["createdAt"]] for j in listed]
        out.line(table(["JOB", "KIND", "ENGINE", "VARIANT", "STATE", "STEP", "CREATED"], rows) if rows
                 else "no jobs since the server started")
        return 0
    job = await client.job(ns.job)
    if job["state"] in ("succeeded", "failed"):
        error = job.get("error")
        out.line(f"{job['kind']} {job['engine']}: {job['state']}" + (f" ({error['message']})" if error else ""))
        return 0 if job["state"] == "succeeded" else 1
    return await follow(ns, client, out, job)


def add_parsers(commands: Any, client: argparse.ArgumentParser, listing: argparse.ArgumentParser) -> None:
    """
    The install subcommands, on the top parser's C{commands}.
    """
    token = argparse.ArgumentParser(add_help=False)
    token.add_argument("--token", default=None,
                       help="the management token (default: $RHAPSODE_MANAGEMENT_TOKEN)")
    token.add_argument("-v", "--verbose", action="store_true", help="print every line pip prints")
    one = commands.add_parser("install", parents=[client, token], help="install an engine from the catalog")
    one.add_argument("engine")
    one.add_argument("--accept", metavar="LICENCE", help="accept the engine's weights licence, named exactly")
    one.add_argument("--yes", action="store_true", help="accept the weights licence without asking")
    one.add_argument("--pull", nargs="?", const="", default=None, metavar="VARIANT",
                     help="fetch a variant's weights too (the engine's default without a value)")
    one.add_argument("--detach", action="store_true", help="start the job and return at once")
    again = commands.add_parser("reinstall", parents=[client, token],
                                help="rebuild an installed engine beside itself")
    again.add_argument("engine", nargs="?")
    again.add_argument("--outdated", action="store_true", help="every engine an upgrade left behind")
    again.add_argument("--accept", metavar="LICENCE")
    gone = commands.add_parser("uninstall", parents=[client, token], help="remove an engine this API installed")
    gone.add_argument("engine")
    fetch = commands.add_parser("pull", parents=[client, token], help="fetch a variant's weights")
    fetch.add_argument("engine")
    fetch.add_argument("variant", nargs="?")
    listed = commands.add_parser("jobs", parents=[client, listing, token],
                                 help="the install jobs, or follow one: rhapsode jobs [JOB]")
    listed.add_argument("job", nargs="?")


COMMANDS = {"install": install, "reinstall": reinstall, "uninstall": uninstall, "pull": pull, "jobs": jobs}
