"""
The conformance checker, as a command: C{python -m rhapsode_conform TARGET} (or
C{rhapsode-conform TARGET}) runs the worker rules against a running worker and prints one
line per check, then a summary.

TARGET is a Unix socket path (C{/x/y.sock} or C{unix:/x/y.sock}) or C{http://host:port}.
Exit status: 0 when nothing failed, 1 when something did, 2 when nothing answers at the
target.  The checks are L{rhapsode_conform._checks}; L{rhapsode_conform._run} runs them.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ._checks import CHECKS
from ._report import Outcome, Report, Result, Unreachable
from ._run import DEFAULT_TIMEOUT, run_checks


def main(argv: Sequence[str] | None = None) -> int:
    """
    Run the checks and print the report; returns the exit status.
    """
    parser = argparse.ArgumentParser(
        prog="rhapsode-conform",
        description="Check a running Rhapsode worker against the worker protocol.",
    )
    parser.add_argument("target", help="a Unix socket path, unix:PATH, or http://host:port")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help=f"seconds one probe may take, a model load included (default {DEFAULT_TIMEOUT:g})",
    )
    args = parser.parse_args(argv)

    def show(result: Result) -> None:
        print(result.line(), flush=True)

    try:
        report = run_checks(args.target, timeout=args.timeout, on_result=show)
    except ValueError as exc:
        print(f"conformance: {exc}", file=sys.stderr)
        return 2
    except Unreachable as exc:
        print(f"conformance: cannot reach {exc}", file=sys.stderr)
        return 2
    for problem in report.cleanup_problems:
        print(f"conformance: could not put the worker back: {problem}", file=sys.stderr)
    print(report.summary())
    return report.exit_code


__all__ = ["CHECKS", "Outcome", "Report", "Result", "Unreachable", "main", "run_checks"]

if __name__ == "__main__":
    sys.exit(main())
