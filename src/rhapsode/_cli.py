"""
The C{rhapsode} command: C{rhapsode serve [--config FILE]} is C{twistd -n rhapsode}.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print("usage: rhapsode serve [--config FILE]")
        raise SystemExit(0 if args else 2)
    if args[0] != "serve":
        print(f"rhapsode: unknown command {args[0]!r}; try: rhapsode serve --config FILE", file=sys.stderr)
        raise SystemExit(2)
    from twisted.scripts.twistd import run

    sys.argv = ["twistd", "--nodaemon", "--pidfile=", "rhapsode", *args[1:]]
    run()
    from ._tap import made

    # twistd exits 0 however its reactor stopped; a server that could not start did not run.
    failed = [service.failed_to_start for service in made if service.failed_to_start is not None]
    if failed:
        print(f"rhapsode: {failed[0].getErrorMessage()}", file=sys.__stderr__)
        raise SystemExit(1)
