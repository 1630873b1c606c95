"""
How the command line shows what the server answers: aligned tables, human sizes and
times, and the lines for engines, voices, the catalog, residency, settings and the
update check.  Pure functions of documents, shared by every subcommand.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Sequence

from rhapsode_protocol.errors import BadRequest

__all__ = [
    "catalog_table",
    "in_use",
    "engines_table",
    "residency_table",
    "setting_line",
    "settings_table",
    "size",
    "table",
    "until",
    "update_text",
    "voices_table",
]


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """
    Borderless, left-aligned columns three spaces apart, as C{ollama ps} prints them;
    no line ends in spaces.
    """
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    lines = []
    for row in [list(headers), *rows]:
        lines.append("   ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return "\n".join(lines) + "\n"


def size(count: int | None) -> str:
    """
    A byte count in binary units: C{512 B}, C{1.5 KiB}, C{310 MiB}, C{2.1 GiB}.
    """
    if count is None:
        return "-"
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    if unit == "B":
        return f"{count} B"
    return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"


def _plural(count: int, unit: str) -> str:
    return f"{count} {unit}" + ("" if count == 1 else "s")


def until(model: dict[str, Any], now: float) -> str:
    """
    When a resident model goes, in words: C{speaking (n)} while leased, C{Never} for a
    keep-alive of -1, C{4 minutes from now}, and C{Stopping...} once its time is up.
    """
    leases = model.get("leases") or 0
    if leases:
        return f"speaking ({leases})"
    if model.get("keepAliveSeconds") == -1:
        return "Never"
    expires = model.get("expiresAt")
    if not isinstance(expires, str):
        return "-"
    try:
        left = datetime.fromisoformat(expires.replace("Z", "+00:00")).timestamp() - now
    except ValueError:
        return expires
    if left <= 0:
        return "Stopping..."
    seconds = int(left)
    if seconds < 1:
        return "a moment from now"
    for unit, length in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= length:
            return _plural(seconds // length, unit) + " from now"
    return _plural(seconds, "second") + " from now"


def _licence(entry: dict[str, Any]) -> tuple[str, str]:
    licence = entry.get("license")
    if not isinstance(licence, dict):
        return "-", "-"
    weights = str(licence.get("weights", "-"))
    if licence.get("weightsCommercialUse") is False:
        weights += " (non-commercial)"
    return str(licence.get("code", "-")), weights


def _worker(entry: dict[str, Any]) -> str:
    version = entry.get("workerVersion")
    if not isinstance(version, str):
        return "-"
    return version + (" (outdated)" if entry.get("outdated") else "")


def engines_table(engines: list[dict[str, Any]]) -> str:
    """
    C{GET /engines} as C{rhapsode engines} prints it.
    """
    rows = []
    for engine in engines:
        model = str(engine.get("model", "-"))
        if engine.get("variant"):
            model += f" ({engine['variant']})"
        rows.append(
            [
                str(engine.get("id", "-")),
                str(engine.get("displayName", "-")),
                str(engine.get("process", "-")),
                model,
                *_licence(engine),
                _worker(engine),
            ]
        )
    return table(["ENGINE", "NAME", "PROCESS", "MODEL", "CODE", "WEIGHTS", "WORKER"], rows)


def voices_table(voices: list[dict[str, Any]]) -> str:
    """
    C{GET /engines/{id}/voices} as C{rhapsode voices} prints it.
    """
    rows = [
        [
            str(voice.get("id", "-")),
            str(voice.get("label", "-")),
            "yes" if voice.get("builtin") else "no",
            ", ".join(str(tag) for tag in voice.get("tags") or []) or "-",
        ]
        for voice in voices
    ]
    return table(["VOICE", "LABEL", "BUILTIN", "TAGS"], rows)


def catalog_table(entries: list[dict[str, Any]]) -> str:
    """
    C{GET /catalog} as C{rhapsode catalog} prints it.
    """
    rows = [
        [
            str(entry.get("id", "-")),
            str(entry.get("displayName", "-")),
            str(entry.get("installed", "-")),
            *_licence(entry),
            str(entry.get("defaultVariant", "-")),
            str(entry.get("python", "-")),
            _worker(entry),
        ]
        for entry in entries
    ]
    return table(["ENGINE", "NAME", "INSTALLED", "CODE", "WEIGHTS", "DEFAULT", "PYTHON", "WORKER"], rows)


def residency_table(residency: dict[str, Any], now: float) -> str:
    """
    C{GET /residency} as C{rhapsode ps} prints it: what is loaded, the next to go first.
    """
    rows = [
        [
            str(model.get("engine", "-")),
            str(model.get("variant", "-")),
            size(model.get("sizeBytes")),
            until(model, now),
        ]
        for model in residency.get("models") or []
    ]
    return table(["ENGINE", "VARIANT", "SIZE", "UNTIL"], rows)


def update_text(document: dict[str, Any]) -> str:
    """
    C{GET /update} as C{rhapsode update} prints it: this server's version, the latest
    release, and whether to update and where from.
    """
    version = str(document.get("version", "-"))
    distribution = str(document.get("distribution", "source"))
    lines = [f"version     {version} ({distribution})"]
    check = document.get("check")
    if check == "off":
        lines.append("check       off: this server does not ask (update.check, or RHAPSODE_UPDATE_CHECK=0)")
    elif check == "pending":
        lines.append("check       pending: the server is asking now; run `rhapsode update` again, or `rhapsode update --check`")
    elif check == "failed":
        lines.append("check       failed: the last attempt got no answer; the server asks again in six hours")
    elif check == "ok":
        lines.append(f"latest      {document.get('latest', '-')} (asked {document.get('checkedAt', '-')})")
        if document.get("updateAvailable"):
            lines.append(f"available   yes: {document.get('releaseUrl', '-')}")
            if distribution == "docker":
                lines.append("how         docker compose pull && docker compose up -d, then reinstall the engines `rhapsode engines` marks outdated")
            else:
                lines.append("how         update this installation (git pull, then make), then reinstall the engines `rhapsode engines` marks outdated")
        else:
            lines.append("available   no: this is the latest release")
    else:
        lines.append(f"check       {check}")
    return "\n".join(lines) + "\n"


def _value_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else value


def in_use(values: dict[str, Any], key: str) -> Any:
    """
    The value C{values} holds for a dotted key; the token only as whether one is set.
    """
    head, _, rest = key.partition(".")
    if key == "management.token":
        return "(set)" if (values.get("management") or {}).get("tokenSet") else "(not set)"
    if head == "engines":
        engine, _, name = rest.rpartition(".")
        return ((values.get("engines") or {}).get(engine) or {}).get(name)
    return (values.get(head) or {}).get(rest)


def settings_table(document: dict[str, Any]) -> str:
    """
    C{GET /settings} as C{rhapsode settings} prints it: a row per setting with the value
    in use, where it came from, whether a change applies live, and a value saved for the
    next start.
    """
    values = document.get("values") or {}
    rows = []
    for field in document.get("fields") or []:
        key = str(field.get("key", "-"))
        saved = "-"
        if "saved" in field:
            saved = "(new token)" if key == "management.token" else _value_text(field["saved"])
        rows.append([
            key,
            _value_text(in_use(values, key)),
            str(field.get("source", "-")),
            str(field.get("applies", "-")),
            saved,
        ])
    return table(["KEY", "VALUE", "SOURCE", "APPLIES", "SAVED (NEXT START)"], rows)


def setting_line(document: dict[str, Any], key: str) -> str:
    """
    One setting in one line: its value, source and when a change applies.
    """
    fields = {str(f.get("key")): f for f in document.get("fields") or []}
    field = fields.get(key)
    if field is None:
        raise BadRequest(f"{key}: no such setting (`rhapsode settings` lists them)", field=key)
    line = f"{key} = {_value_text(in_use(document.get('values') or {}, key))} ({field.get('source')}, {field.get('applies')})"
    if "saved" in field:
        saved = "a new token" if key == "management.token" else _value_text(field["saved"])
        line += f"; saved {saved}, in use from the next start"
    return line + "\n"
