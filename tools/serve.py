"""
`make serve`: the core on its config, and the engines it should have installed through
its own API, as a person would with `rhapsode install`.

    python tools/serve.py run/rhapsode.json tone espeak piper

It starts `rhapsode serve --config FILE` (the core's state database is rhapsode.db
beside the file), waits until it answers, and runs `rhapsode install ENGINE --yes` for
each engine the catalog says is not installed: each prints its licences, the weights
licence it accepts, and its progress.  Then it waits on the server; Ctrl-C stops the
server as it would stop `rhapsode serve` itself (a second one quits at once).
Standard library only, beside the `rhapsode` command of the core's virtualenv.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any


def _say(line: str, stream: Any = None) -> None:
    # One write per line: the server writes its log to the same terminal, and print()
    # writes the text and its newline apart, so a log line could land between them.
    out = stream or sys.stdout
    out.write(line + "\n")
    out.flush()


def _address(config: Path) -> str:
    document = json.loads(config.read_text(encoding="utf-8"))
    server = document.get("server") or {}
    host = server.get("host") or "127.0.0.1"
    if host in ("::", "0.0.0.0", ""):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{server.get('port', 8080)}"


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def _taken(url: str) -> str | None:
    """
    What answers at C{url} already, in words, or None when nothing listens there: a
    Rhapsode says its version in GET /health; anything else is not Rhapsode.
    """
    parts = urllib.parse.urlsplit(url)
    try:
        socket.create_connection((parts.hostname, parts.port or 80), timeout=2).close()
    except OSError:
        return None
    try:
        health = _get(url + "/health")
    except (OSError, ValueError):
        return "a server that is not Rhapsode (it does not answer GET /health as Rhapsode does)"
    if isinstance(health, dict) and "version" in health and "contract" in health:
        return f"another Rhapsode ({health['version']}, `make serve` or `rhapsode serve` already running)"
    return "a server that is not Rhapsode (it does not answer GET /health as Rhapsode does)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("engines", nargs="*")
    parser.add_argument("--rhapsode", default=str(Path(sys.executable).parent / "rhapsode"),
                        help="the rhapsode command (default: the one beside this interpreter)")
    parser.add_argument("--wait", type=float, default=60.0, help="how long the server may take to answer")
    args = parser.parse_args(argv)
    url = _address(args.config)
    taken = _taken(url)
    if taken is not None:
        # Said before starting anything: the server's own check would be answered by
        # whatever holds the port, and its start fail with Address already in use.
        _say(f"serve: {url} is taken: {taken} answers there. Stop it, or set server.port in {args.config}",
             sys.stderr)
        return 1
    server = subprocess.Popen([args.rhapsode, "serve", "--config", str(args.config)])
    # The server gets Ctrl-C from the terminal itself (same process group); here it
    # only stops the installs and waits for the server's own stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    deadline = time.monotonic() + args.wait
    while True:
        if server.poll() is not None:
            return server.returncode
        try:
            catalog = {entry["id"]: entry for entry in _get(url + "/catalog")}
            break
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                _say(f"serve: {url} did not answer within {args.wait:g} s", sys.stderr)
                server.terminate()
                return server.wait()
            time.sleep(0.2)
    for engine in args.engines:
        entry = catalog.get(engine)
        if entry is None:
            _say(f"serve: {engine} is not in the catalog; skipped", sys.stderr)
            continue
        if entry.get("installed") == "yes":
            continue
        _say(f"serve: installing {engine} through {url}")
        installing = subprocess.run([args.rhapsode, "install", engine, "--yes", "--url", url],
                                    preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        if installing.returncode != 0:
            _say(f"serve: installing {engine} failed; the server goes on without it", sys.stderr)
        if server.poll() is not None:
            return server.returncode
    installed = [entry["id"] for entry in _get(url + "/engines")]
    _say(f"serve: {url} is serving {', '.join(installed) or 'no engine'} (Ctrl-C stops it)")
    return _status(server.wait())


def _status(code: int) -> int:
    """
    What to exit with after the server: a stop asked for (Ctrl-C, SIGTERM), which the
    server ends by its signal, is no failure for make to report.
    """
    if code in (-signal.SIGINT, -signal.SIGTERM):
        return 0
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
