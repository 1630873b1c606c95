"""
Running the checks: reach the worker, run every check with a fresh deadline each, and
leave the worker as it was found (its model, and no voice the checks made).
"""

from __future__ import annotations

import http.client
import json
from functools import partial
from typing import Any, Callable, Mapping

from ._audio import find_ffmpeg
from ._checks import CHECKS
from ._client import Client, Response, parse_target
from ._context import Context
from ._report import Failed, Report, Result, TimedOut, Unreachable, result_of

#: Seconds one probe may take, from its first request to its last byte: generous, since
#: the first request of a run may load a model.
DEFAULT_TIMEOUT = 120.0


def _first_contact(client: Client) -> Mapping[str, Any]:
    """
    GET /health once, to learn whether anything answers and what state to restore.
    """
    client.start()
    try:
        response = client.get("/health")
    except (OSError, http.client.HTTPException, TimedOut, Failed) as exc:
        raise Unreachable(f"{client.target}: {exc}") from None
    try:
        doc = json.loads(response.body)
    except (ValueError, RecursionError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _restore(ctx: Context, health: Mapping[str, Any]) -> list[str]:
    """
    Delete what the checks created and put the model back as it was.
    """
    problems: list[str] = []

    def attempt(label: str, act: Callable[[], Response], expected: int = 200) -> None:
        ctx.client.start()
        try:
            response = act()
        except Exception as exc:  # cleanup reports what it could not do and goes on
            problems.append(f"{label}: {exc}")
            return
        if response.status != expected:
            problems.append(f"{label}: {response.describe()}")

    for voice in sorted(ctx.created):
        attempt(f"deleting voice {voice}", partial(ctx.client.request, "DELETE", f"/voices/{voice}"), 204)
    variant = health.get("variant")
    if health.get("model") in ("loaded", "loading") and isinstance(variant, str):
        attempt(f"reloading {variant}", lambda: ctx.client.post("/load", {"variant": variant}))
    else:
        attempt("unloading", lambda: ctx.client.post("/unload", {}))
    return problems


def run_checks(
    target: str,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    on_result: Callable[[Result], None] | None = None,
) -> Report:
    """
    Run every check against the worker at C{target}, then leave it as it was found.

    @param timeout: seconds each probe may take.
    @param on_result: called with each result as it is known.
    @raise ValueError: if C{target} is not a socket path or an http URL.
    @raise Unreachable: if nothing answers HTTP there.
    """
    parsed = parse_target(target)
    client = Client(parsed, timeout)
    health = _first_contact(client)
    ctx = Context(client, find_ffmpeg())
    report = Report()
    try:
        for name, check in CHECKS:
            client.start()
            try:
                results = check(ctx)
            except Exception as exc:  # one broken check never stops the rest
                results = [result_of(name, exc)]
            for result in results:
                report.results.append(result)
                if on_result is not None:
                    on_result(result)
    finally:
        report.cleanup_problems = _restore(ctx, health)
    return report
