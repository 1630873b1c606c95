"""
The C{rhapsode} command.  C{rhapsode serve [--config FILE]} is C{twistd -n rhapsode}, with
one difference: while it stops, a second Ctrl-C (or SIGTERM) quits at once.  The other
subcommands (C{engines}, C{voices}, C{say}, C{catalog}, C{ps}, C{unload}, C{version},
C{update}, C{settings}, C{warm}, C{doctor}) are
clients of a running server's public routes through L{rhapsode.client.RhapsodeClient}:
listings print aligned plain tables, or the server's JSON with C{--json}; a refusal
prints the taxonomy's C{code: message} on stderr and exits 1.  docs/cli.md has the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from types import FrameType
from typing import IO, Any, Awaitable, Callable, Mapping

from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectError, DNSLookupError
from twisted.logger import Logger

from rhapsode_protocol.errors import BadRequest, SpeechError

from .. import __version__
from .._cluster.commands import main as cluster_main
from .install import COMMANDS as _INSTALL_COMMANDS
from .install import add_parsers as _install_parsers
from .render import (
    catalog_table,
    engines_table,
    in_use,
    residency_table,
    setting_line,
    settings_table,
    size,
    table,
    until,
    update_text,
    voices_table,
)

#: What a forced quit exits with: not the signal, which is how a clean stop ends.
FORCED_EXIT = 1

_Handler = Callable[[int, "FrameType | None"], Any]


class SecondInterrupt:
    """
    Ctrl-C and SIGTERM for a server whose stop waits (for requests in flight, for its
    workers): the first is the reactor's own, a clean stop; one arriving after the stop
    began, for that reason or any other, quits the process at once.

    The reactor's handler would otherwise take the second as another C{reactor.stop()}
    and log the C{ReactorNotRunning} it raises.  Workers need nothing from a forced
    quit: each exits when its parent does.

    @param getsignal: L{signal.getsignal}; C{setsignal}, L{signal.signal}; C{write}, a
        line to stderr; C{exit}, L{os._exit}.  Tests give fakes.
    """

    log = Logger()

    def __init__(
        self,
        reactor: Any,
        *,
        getsignal: Callable[[int], Any] = signal.getsignal,
        setsignal: Callable[[int, _Handler], Any] = signal.signal,
        write: Callable[[str], None] | None = None,
        exit: Callable[[int], Any] = os._exit,
    ) -> None:
        self._reactor = reactor
        self._getsignal = getsignal
        self._setsignal = setsignal
        self._write = write or _write_stderr
        self._exit = exit
        self._previous: dict[int, _Handler] = {}
        self._stopping = False
        self._first: str | None = None

    def arm(self) -> None:
        """
        Put this in front of the reactor's handlers; call it once the reactor runs,
        which is when it has installed them.  A signal the process ignores (a server
        started in the background with Ctrl-C ignored) stays ignored.
        """
        for number in (signal.SIGINT, signal.SIGTERM):
            previous = self._getsignal(number)
            if callable(previous):
                self._previous[number] = previous
                self._setsignal(number, self.received)
        self._reactor.addSystemEventTrigger("before", "shutdown", self._shutting_down)

    def _shutting_down(self) -> None:
        self._stopping = True
        if self._first is not None:
            self.log.info(
                "{signal} received; press Ctrl-C again (or send SIGTERM) to quit at once, "
                "cutting off what is in flight",
                signal=self._first,
            )

    def received(self, number: int, frame: FrameType | None) -> None:
        """
        The handler of both signals.  It runs between two Python instructions of the
        reactor's thread, so it neither logs nor writes through a buffer that thread
        may be holding: a forced quit writes its line straight to file descriptor 2.
        """
        name = signal.Signals(number).name
        if not self._stopping:
            self._stopping = True
            self._first = name
            self._previous[number](number, frame)
            return
        try:
            # The log goes to the real stdout, which a quit without unwinding leaves unflushed.
            if sys.__stdout__ is not None:
                sys.__stdout__.flush()
        except (OSError, ValueError, RuntimeError):
            pass
        self._write(
            f"rhapsode: {name} while stopping: quitting at once; requests in flight are "
            "cut off and the workers exit by themselves\n"
        )
        self._exit(FORCED_EXIT)


def _write_stderr(line: str) -> None:
    try:
        os.write(2, line.encode("utf-8", "replace"))
    except OSError:
        pass


#: Where the client subcommands find the server without C{--url} or C{RHAPSODE_URL}.
DEFAULT_URL = "http://127.0.0.1:8080"
#: What a refusal, or a server that does not answer, exits with; a bad command line is 2.
FAILED = 1
USAGE = 2


def parser() -> argparse.ArgumentParser:
    """
    The command line of every subcommand but C{serve}, whose options are the twistd
    plugin's (L{rhapsode._tap.Options}) and are handed to it as they are.
    """
    top = argparse.ArgumentParser(
        prog="rhapsode",
        description="Rhapsode, a multi-engine speech server, and a client of one.",
    )
    commands = top.add_subparsers(dest="command", metavar="COMMAND")
    client = argparse.ArgumentParser(add_help=False)
    client.add_argument(
        "--url",
        default=None,
        help=f"the server (default: $RHAPSODE_URL, else {DEFAULT_URL})",
    )
    listing = argparse.ArgumentParser(add_help=False)
    listing.add_argument("--json", action="store_true", help="print the server's JSON as it is")
    commands.add_parser("serve", help="run the server: rhapsode serve [--config FILE] [--unset KEY]")
    commands.add_parser("web", help="serve the web page: rhapsode web [--core URL] [--port N] (docs/web.md)")
    commands.add_parser("cluster", help="run Rhapsode on a Ray cluster: rhapsode cluster up|status|down (docs/cluster.md)")
    commands.add_parser("engines", parents=[client, listing], help="the engines this server has")
    voices = commands.add_parser("voices", parents=[client, listing], help="an engine's voices")
    voices.add_argument("engine")
    say = commands.add_parser("say", parents=[client], help="speak TEXT and write the audio")
    say.add_argument("engine")
    say.add_argument("text")
    say.add_argument("-o", "--output", metavar="FILE", help="where the audio goes (default: stdout)")
    say.add_argument("--voice", help="a voice id the engine lists")
    say.add_argument("--format", help="wav, mp3, opus, flac, aac or pcm (default: the server's)")
    say.add_argument("--variant", help="the engine's variant (default: the resident one, else its default)")
    commands.add_parser(
        "catalog", parents=[client, listing], help="every engine that exists, with both licences"
    )
    commands.add_parser("ps", parents=[client, listing], help="the models loaded now")
    unload = commands.add_parser(
        "unload", parents=[client], help="end an engine's worker (a management route)"
    )
    unload.add_argument("engine")
    unload.add_argument(
        "--mode",
        choices=("terminate", "unload"),
        default=None,
        help="terminate (the default) ends the worker; unload frees the model and keeps it",
    )
    unload.add_argument(
        "--token",
        default=None,
        help="the management token, for a server on another machine "
        "(default: $RHAPSODE_MANAGEMENT_TOKEN)",
    )
    commands.add_parser("version", parents=[client], help="this client's version and the server's")
    _manage_parsers(commands, client, listing)

    _install_parsers(commands, client, listing)
    return top


def server_url(given: str | None, environ: Mapping[str, str]) -> str:
    """
    C{--url}, else C{RHAPSODE_URL}, else L{DEFAULT_URL}.
    """
    return (given or environ.get("RHAPSODE_URL") or DEFAULT_URL).rstrip("/")


# -- plain text ----------------------------------------------------------------------


# -- running a client subcommand -----------------------------------------------------


@dataclass
class Output:
    """
    Where a subcommand writes: text to C{stdout} and C{stderr}, audio to C{binary}
    (stdout's bytes).  Tests give buffers.
    """

    stdout: IO[str]
    stderr: IO[str]
    binary: IO[bytes]

    def line(self, text: str) -> None:
        self.stdout.write(text if text.endswith("\n") else text + "\n")

    def error(self, text: str) -> None:
        self.stderr.write(text + "\n")


def _listing(ns: argparse.Namespace, out: Output, document: Any, plain: Callable[[], str]) -> None:
    if ns.json:
        out.line(json.dumps(document, indent=2, ensure_ascii=False))
    else:
        out.line(plain())


async def _engines(ns: argparse.Namespace, client: Any, out: Output, now: float) -> int:
    engines = await client.engines()
    _listing(ns, out, engines, lambda: engines_table(engines))
    return 0


async def _voices(ns: argparse.Namespace, client: Any, out: Output, now: float) -> int:
    voices = await client.voices(ns.engine)
    _listing(ns, out, voices, lambda: voices_table(voices))
    return 0


async def _catalog(ns: argparse.Namespace, client: Any, out: Output, now: float) -> int:
    entries = await client.catalog()
    _listing(ns, out, entries, lambda: catalog_table(entries))
    return 0


async def _ps(ns: argparse.Namespace, client: Any, out: Output, now: float) -> int:
    residency = await client.residency()
    _listing(ns, out, residency, lambda: residency_table(residency, now))
    return 0


async def _say(ns: argparse.Namespace, client: Any, out: Output, now: float) -> int:
    if ns.output is None and out.binary.isatty():
        # Audio on a terminal is noise and can leave it in a strange state.
        out.error("rhapsode: say writes audio: give -o FILE, or redirect stdout to a file or a player")
        return USAGE
    fields = {k: v for k, v in (("voice", ns.voice), ("format", ns.format), ("variant", ns.variant)) if v}
    audio = await client.speak(ns.engine, ns.text, **fields)
    if ns.output is None:
        out.binary.write(audio.data)
        out.binary.flush()
        return 0
    with open(ns.output, "wb") as file:
        file.write(audio.data)
    seconds = f", {audio.duration_ms / 1000:g} s" if audio.duration_ms is not None else ""
    out.line(f"{ns.output}: {size(len(audio.data))} of {audio.content_type}{seconds}")
    return 0


async def _unload(ns: argparse.Namespace, client: Any, out: Output, now: float) -> int:
    summary = await client.unload(ns.engine, ns.mode)
    out.line(f"{ns.engine}: process {summary.get('process', '-')}, model {summary.get('model', '-')}")
    return 0


async def _version(ns: argparse.Namespace, client: Any, out: Output, now: float) -> int:
    out.line(f"client version {__version__}")
    health = await client.health()
    out.line(f"server version {health.get('version', '-')} (contract {health.get('contract', '-')})")
    return 0


_COMMANDS: dict[str, Callable[[argparse.Namespace, Any, Output, float], Awaitable[int]]] = {
    "engines": _engines,
    "voices": _voices,
    "say": _say,
    "catalog": _catalog,
    "ps": _ps,
    "unload": _unload,
    "version": _version,
}


async def run(ns: argparse.Namespace, client: Any, out: Output, url: str, now: float | None = None) -> int:
    """
    Run the client subcommand C{ns} names against C{client} (a
    L{rhapsode.client.RhapsodeClient}); the exit status.  A refusal is the taxonomy's
    C{code: message} on stderr; a server that does not answer says so and how to start one.
    """
    try:
        return await _COMMANDS[ns.command](ns, client, out, time.time() if now is None else now)
    except SpeechError as refusal:
        out.error(f"{refusal.code}: {refusal.message}")
    except (ConnectError, DNSLookupError) as failure:
        out.error(f"rhapsode: nothing is answering at {url} ({failure.__class__.__name__}). "
                  "Start it with `rhapsode serve`, or give --url")
    except OSError as failure:
        # -o naming a file that cannot be written.
        out.error(f"rhapsode: {failure}")
    except Exception as failure:
        # Anything else the connection did (a reset, a truncated body): said, not a traceback.
        out.error(f"rhapsode: talking to {url} failed: {failure}")
    return FAILED


def _client_main(reactor: Any, ns: argparse.Namespace) -> "Deferred[None]":
    from ..client import RhapsodeClient

    url = server_url(ns.url, os.environ)
    token = getattr(ns, "token", None) or os.environ.get("RHAPSODE_MANAGEMENT_TOKEN") or None
    client = RhapsodeClient(url, reactor=reactor, token=token)
    out = Output(sys.stdout, sys.stderr, sys.stdout.buffer)

    async def go() -> None:
        try:
            code = await run(ns, client, out, url)
        finally:
            await client.close()
        sys.stdout.flush()
        if code:
            raise SystemExit(code)

    return Deferred.fromCoroutine(go())


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "serve":
        _serve(args[1:])
        return
    if args and args[0] == "web":
        _web(args[1:])
        return
    if args and args[0] == "cluster":
        # Ray's own commands and serve.run, blocking: no reactor of ours is needed.
        raise SystemExit(cluster_main(args))
    options = parser()
    if not args:
        options.print_usage(sys.stderr)
        raise SystemExit(USAGE)
    ns = options.parse_args(args)
    from twisted.internet.task import react

    react(_client_main, (ns,))


def _serve(args: list[str]) -> None:
    # The reactor twistd would install by itself (this command passes it no --reactor).
    from twisted.internet import reactor
    from twisted.scripts.twistd import run

    reactor.callWhenRunning(SecondInterrupt(reactor).arm)
    sys.argv = ["twistd", "--nodaemon", "--pidfile=", "rhapsode", *args]
    run()
    from .._tap import made

    # twistd exits 0 however its reactor stopped; a server that could not start did not run.
    failed = [service.failed_to_start for service in made if service.failed_to_start is not None]
    if failed:
        print(f"rhapsode: {failed[0].getErrorMessage()}", file=sys.__stderr__)
        raise SystemExit(1)


def _web(args: list[str]) -> None:
    """
    C{rhapsode web [--core URL] [--port N] [--host H] [--token-file FILE]
    [--allow-origin ORIGIN]}: C{twistd -n rhapsode-web}, the page of docs/web.md.
    """
    from twisted.scripts.twistd import run

    sys.argv = ["twistd", "--nodaemon", "--pidfile=", "rhapsode-web", *args]
    run()
    from .._web._tap import made

    failed = [service.failed_to_start for service in made if service.failed_to_start is not None]
    if failed:
        print(f"rhapsode web: {failed[0].getErrorMessage()}", file=sys.__stderr__)
        raise SystemExit(1)


# -- update, settings, warm and doctor (protocol.md sections 9 and 10) ----------------


def _manage_parsers(commands: Any, client: argparse.ArgumentParser, listing: argparse.ArgumentParser) -> None:
    """
    The subcommands that read and change how the server is run: C{update}, C{settings},
    C{warm} and C{doctor}.
    """
    token = argparse.ArgumentParser(add_help=False)
    token.add_argument(
        "--token",
        default=None,
        help="the management token, for a server on another machine (default: $RHAPSODE_MANAGEMENT_TOKEN)",
    )
    update = commands.add_parser(
        "update", parents=[client, listing], help="whether a newer release of rhapsode exists"
    )
    update.add_argument("--check", action="store_true", help="ask now rather than report the last answer")
    settings = commands.add_parser(
        "settings",
        parents=[client, listing, token],
        help="every setting; settings KEY shows one; settings KEY VALUE changes it",
    )
    settings.add_argument("key", nargs="?", help="a dotted key, e.g. residency.keepAliveSeconds")
    settings.add_argument(
        "value",
        nargs="?",
        help="the new value, read as JSON when it parses and as a string otherwise; - reads it from stdin",
    )
    settings.add_argument("--unset", action="store_true", help="clear KEY from the database (null)")
    warm = commands.add_parser(
        "warm", parents=[client], help="load an engine's model now, so the first request is not a cold start"
    )
    warm.add_argument("engine")
    warm.add_argument("--variant", help="the variant to load (default: the resident one, else its default)")
    warm.add_argument(
        "--keep-alive",
        dest="keep_alive",
        type=int,
        metavar="S",
        default=None,
        help="keep it loaded S seconds after (-1: until the room is needed; default: the server's)",
    )
    commands.add_parser(
        "doctor", parents=[client, token], help="what is installed, outdated and reachable; exits 1 if something is wrong"
    )


async def _update_command(ns: argparse.Namespace, client: Any, out: Output, now: float) -> int:
    document = await (client.check_update() if ns.check else client.update())
    _listing(ns, out, document, lambda: update_text(document))
    return 0


def settings_patch(key: str, value: Any) -> dict[str, Any]:
    """
    The PATCH body that sets one dotted key: C{engines.ID.NAME} or C{SECTION.NAME}.
    """
    head, _, rest = key.partition(".")
    if head == "engines":
        engine, _, name = rest.rpartition(".")
        if engine and name:
            return {"engines": {engine: {name: value}}}
    elif head and rest and "." not in rest:
        return {head: {rest: value}}
    raise BadRequest(
        f"{key}: a setting is a dotted key such as residency.keepAliveSeconds or engines.tone.keepAliveSeconds",
        field=key,
    )


def parse_value(text: str) -> Any:
    """
    A value from the command line: JSON when it parses (C{900}, C{true}, C{["a"]}), the
    text itself otherwise.
    """
    try:
        return json.loads(text)
    except ValueError:
        return text


async def _settings_command(ns: argparse.Namespace, client: Any, out: Output, now: float) -> int:
    if ns.key is None:
        if ns.unset:
            out.error("rhapsode: settings --unset needs a KEY")
            return USAGE
        document = await client.settings()
        _listing(ns, out, document, lambda: settings_table(document))
        return 0
    if ns.value is not None and ns.unset:
        out.error("rhapsode: settings KEY takes a VALUE or --unset, not both")
        return USAGE
    if ns.value is None and not ns.unset:
        document = await client.settings()
        line = setting_line(document, ns.key)
        if ns.json:
            field = next(f for f in document["fields"] if f.get("key") == ns.key)
            out.line(json.dumps({**field, "value": in_use(document["values"], ns.key)}, indent=2, ensure_ascii=False))
        else:
            out.line(line)
        return 0
    if ns.unset:
        value = None
    elif ns.value == "-":
        # Read from stdin, so that a token stays out of the shell's history.
        value = parse_value(sys.stdin.read().rstrip("\r\n"))
    else:
        value = parse_value(ns.value)
    document = await client.patch_settings(settings_patch(ns.key, value))
    if ns.json:
        out.line(json.dumps(document, indent=2, ensure_ascii=False))
    else:
        out.line(setting_line(document, ns.key))
    return 0


#: What warm says: short, so the model's load is nearly all the cost.
WARM_TEXT = "Ready."


async def _warm(ns: argparse.Namespace, client: Any, out: Output, now: float) -> int:
    # There is no load route: a short buffered /speak loads the model, and its audio is
    # dropped.  keepAliveSeconds then sets how long it stays.
    fields: dict[str, Any] = {}
    if ns.variant:
        fields["variant"] = ns.variant
    if ns.keep_alive is not None:
        fields["keepAliveSeconds"] = ns.keep_alive
    began = time.monotonic()
    await client.speak(ns.engine, WARM_TEXT, **fields)
    took = time.monotonic() - began
    residency = await client.residency()
    model = next((m for m in residency.get("models") or [] if m.get("engine") == ns.engine), None)
    if model is None:
        out.line(f"{ns.engine}: spoke in {took:.1f} s, but it is not resident now (a keep-alive of 0?)")
        return 0
    out.line(
        f"{ns.engine}: {model.get('variant', '-')} loaded in {took:.1f} s, {size(model.get('sizeBytes'))}, "
        f"until {until(model, now)}"
    )
    return 0


def local_tools() -> dict[str, str | None]:
    """
    Where this machine's ffmpeg and uv are; None for one that is missing.  ffmpeg is the
    one a worker encodes with (PATH, else the imageio-ffmpeg wheel's); uv is the one
    beside this interpreter, else on PATH.
    """
    import shutil

    from .._manage.installer import find_uv

    ffmpeg = shutil.which("ffmpeg")
    if ffmpeg is None:
        try:
            import imageio_ffmpeg  # the doctor extra, or the SDK beside the core
        except ImportError:
            imageio_ffmpeg = None
        try:
            ffmpeg = str(imageio_ffmpeg.get_ffmpeg_exe()) if imageio_ffmpeg is not None else None
        except RuntimeError:
            ffmpeg = None
    return {"ffmpeg": ffmpeg, "uv": find_uv()}


_OK, _WARN, _FAIL, _INFO = "ok", "warn", "FAIL", "info"


async def doctor_rows(client: Any, url: str, tools: dict[str, str | None]) -> list[list[str]]:
    """
    Every check C{rhapsode doctor} makes, as rows of CHECK, STATUS and DETAIL.
    """
    rows: list[list[str]] = []
    try:
        health = await client.health()
    except (ConnectError, DNSLookupError) as failure:
        rows.append(["server", _FAIL, f"nothing is answering at {url} ({failure.__class__.__name__}): start it with `rhapsode serve`"])
        health = None
    if health is not None:
        status = health.get("status")
        rows.append([
            "server",
            _OK if status == "ok" else _FAIL,
            f"{url}: rhapsode {health.get('version', '-')}, contract {health.get('contract', '-')}, {status}",
        ])
        for engine in health.get("engines") or []:
            name = str(engine.get("id", "-"))
            process = engine.get("process", "-")
            worker = engine.get("workerVersion")
            detail = f"{name}: process {process}, model {engine.get('model', '-')}"
            detail += f", worker {worker}" if isinstance(worker, str) else ""
            state = _OK
            if process == "failed" or engine.get("lastError"):
                state = _FAIL
                detail += f": {engine.get('lastError', 'failed')}"
            elif engine.get("outdated"):
                state = _WARN
                detail += f" is outdated (the server is {health.get('version', '-')}): reinstall {name}"
            rows.append(["engine", state, detail])
        if not health.get("engines"):
            rows.append(["engine", _WARN, "no engine is installed: `rhapsode catalog` lists what exists"])
        try:
            entries = await client.catalog()
        except SpeechError as refusal:
            rows.append(["catalog", _WARN, f"{refusal.code}: {refusal.message}"])
        else:
            installed = [str(e.get("id")) for e in entries if e.get("installed") == "yes"]
            others = [str(e.get("id")) for e in entries if e.get("installed") != "yes"]
            detail = f"{len(entries)} engines known, installed: {', '.join(installed) or 'none'}"
            if others:
                detail += f"; not installed: {', '.join(others)}"
            rows.append(["catalog", _OK, detail])
        try:
            update = await client.update()
        except SpeechError as refusal:
            rows.append(["update", _WARN, f"{refusal.code}: {refusal.message}"])
        else:
            check = update.get("check")
            if check == "ok" and update.get("updateAvailable"):
                rows.append(["update", _WARN, f"{update.get('latest')} is out: {update.get('releaseUrl')} (`rhapsode update`)"])
            elif check == "ok":
                rows.append(["update", _OK, f"{update.get('version')} is the latest release"])
            elif check == "failed":
                rows.append(["update", _WARN, "the last check got no answer; the server retries in six hours"])
            elif check == "pending":
                rows.append(["update", _INFO, "the server is asking now: `rhapsode update` shortly"])
            else:
                rows.append(["update", _INFO, "off: this server does not ask (update.check, RHAPSODE_UPDATE_CHECK)"])
        try:
            settings = await client.settings()
        except SpeechError as refusal:
            rows.append(["state", _INFO, f"settings not readable here ({refusal.code}): the state database is rhapsode.db beside the server's config file"])
        else:
            # The document names the database only if a server adds it; the rule otherwise.
            named: Any = (settings.get("values") or {}).get("state")
            where: Any = named.get("path") if isinstance(named, dict) else None
            detail = (
                f"the state database is {where}"
                if isinstance(where, str)
                else "the state database is rhapsode.db beside the server's config file"
            )
            rows.append(["state", _INFO, detail + f"; {len(settings.get('fields') or [])} settings (`rhapsode settings`)"])
    ffmpeg = tools.get("ffmpeg")
    if ffmpeg:
        rows.append(["ffmpeg", _OK, ffmpeg])
    else:
        rows.append(["ffmpeg", _WARN, "not found on PATH nor from imageio-ffmpeg: only wav and pcm can be served"])
    uv = tools.get("uv")
    if uv:
        rows.append(["uv", _OK, f"{uv}: installs make their virtualenvs with it"])
    else:
        rows.append(["uv", _WARN, "not found: installs use python -m venv, which is slower"])
    rows.append([
        "logs",
        _INFO,
        "the server logs to its stdout: under `rhapsode serve`, the terminal it runs in (or wherever its "
        "service manager sends stdout, e.g. journalctl or docker logs)",
    ])
    return rows


async def _doctor(ns: argparse.Namespace, client: Any, out: Output, now: float) -> int:
    rows = await doctor_rows(client, server_url(ns.url, os.environ), local_tools())
    out.line(table(["CHECK", "STATUS", "DETAIL"], rows))
    return FAILED if any(row[1] == _FAIL for row in rows) else 0


_COMMANDS.update(_INSTALL_COMMANDS)
_COMMANDS.update({"update": _update_command, "settings": _settings_command, "warm": _warm, "doctor": _doctor})
