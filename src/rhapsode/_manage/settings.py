"""
The settings document (protocol.md section 10, "Settings"): C{GET /settings} and its
C{PATCH}.

A value comes from three layers, each over the one before: the defaults, the operator's
config file, and the state database (L{rhapsode._manage.state}).  A C{PATCH} writes only the
database.  A few settings are read by the core each time it uses them and so apply as
soon as they are written (L{LIVE}); the rest wait for the next start, and until then the
document shows the value in use and, beside it, the one saved.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rhapsode_protocol.errors import BadRequest, Conflict, UnknownEngine
from rhapsode_protocol.validation import TooDeep, loads_json

from .._config import ENGINE_SETTINGS, SECTIONS, Config, ConfigError, parse_config
from .._guard import _forwarded_remote, _loopback_ip, is_loopback, origin_key
from .state import StateDatabase

#: The settings that apply as soon as they are written: the core reads each when it
#: uses it (the residency manager and admission read them through ConfigSettings).
LIVE = frozenset({
    "residency.maxResidentModels",
    "residency.evictionWaitSeconds",
    "residency.keepAliveSeconds",
    "limits.concurrentPerEngine",
    "limits.queuedPerEngine",
    "limits.queueWaitSeconds",
    "limits.bufferedBytes",
    "update.check",
})
#: Every per-engine setting is read when used, and so is live.
LIVE_PER_ENGINE = frozenset(ENGINE_SETTINGS)

TOKEN = "management.token"
ORIGINS = "management.origins"


def applies(key: str) -> str:
    """
    C{live} or C{restart} for a dotted key.
    """
    if key.startswith("engines."):
        return "live" if key.rsplit(".", 1)[1] in LIVE_PER_ENGINE else "restart"
    return "live" if key in LIVE else "restart"


def _snake(key: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in key)


def _json(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def layer(
    raw: Mapping[str, Any], settings: Mapping[str, Any], installed: Mapping[str, Mapping[str, Any]] | None = None
) -> dict[str, Any]:
    """
    The config file's document with the engines the API installed beside its own (the
    file's entry wins where both name one) and the database's settings written over it.
    A per-engine setting for an engine neither names is left out: it is kept until the
    engine is uninstalled, and means nothing meanwhile.
    """
    document = copy.deepcopy(dict(raw))
    if installed:
        engines = dict(document.get("engines") or {})
        for engine_id, recorded in installed.items():
            engines.setdefault(engine_id, copy.deepcopy(dict(recorded)))
        document["engines"] = engines
    for key, value in settings.items():
        head, _, rest = key.partition(".")
        if head == "engines":
            engine_id, _, name = rest.rpartition(".")
            entry = (document.get("engines") or {}).get(engine_id)
            if isinstance(entry, dict):
                entry[name] = value
        else:
            if not isinstance(document.get(head), dict):
                document[head] = {}
            document[head][rest] = value
    return document


def _check(key: str) -> Any:
    head, _, rest = key.partition(".")
    if head == "engines":
        return ENGINE_SETTINGS.get(rest.rpartition(".")[2])
    if head in SECTIONS:
        return SECTIONS[head][1].get(rest)
    return None


@dataclass(frozen=True)
class Caller:
    """
    Who is asking, as the two lockout rules need it: whether it is on this machine, and
    the Origin its request carried.
    """

    local: bool
    origin: str | None = None

    @property
    def own_origin(self) -> bool:
        if self.origin is None:
            return True
        key = origin_key(self.origin)
        return key is not None and (key[1] == "localhost" or _loopback_ip(key[1]))


def caller_of(request: Any) -> Caller:
    """
    The caller of a request on the core's site, judged as the management guard judges it.
    """
    address = request.getClientAddress()
    host = getattr(address, "host", None)
    local = host is None or is_loopback(host)
    forwarded = [
        value.decode("latin-1") for value in request.requestHeaders.getRawHeaders(b"x-forwarded-for", [])
    ]
    if _forwarded_remote(forwarded):
        local = False
    origins = request.requestHeaders.getRawHeaders(b"origin", [])
    return Caller(local, origins[0].decode("latin-1").strip() if origins else None)


class Settings:
    """
    The settings of a running core: the document, and the writes that change it.

    @ivar config: the config the process is using: live settings as the database holds
        them now, the others as they were when it started.
    """

    def __init__(
        self,
        *,
        raw: Mapping[str, Any],
        base: Path,
        database: StateDatabase,
        engine_ids: Callable[[], Iterable[str]] = lambda: (),
        on_change: Callable[[Config], None] = lambda config: None,
        installed: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """
        @param raw: the config file's document; C{base}, its directory.
        @param engine_ids: the engines in the registry, which are the ones with settings.
        @param on_change: called with the new config in use once a live setting changed.
        @raise ConfigError: a setting the database holds is not one this core takes.
        """
        self._raw = raw
        self._base = base
        self._database = database
        self._engine_ids = engine_ids
        self._on_change = on_change
        self._installed = installed or {}
        self._boot = dict(database.settings())
        self.config = self._parse(self._boot)

    def _parse(self, settings: Mapping[str, Any]) -> Config:
        return parse_config(layer(self._raw, settings, self._installed), self._base)

    def _in_use(self) -> dict[str, Any]:
        saved = self._database.settings()
        in_use = {key: value for key, value in saved.items() if applies(key) == "live"}
        in_use.update((key, value) for key, value in self._boot.items() if applies(key) == "restart")
        return in_use

    def _engines(self) -> list[str]:
        return [engine_id for engine_id in self._engine_ids() if engine_id in self.config.engines]

    def values(self) -> dict[str, Any]:
        """
        C{values}: every setting as the process uses it, the token only as C{tokenSet}.
        """
        config = self.config
        values: dict[str, Any] = {}
        for name, (_, checks) in SECTIONS.items():
            section = getattr(config, name)
            values[name] = {key: _json(getattr(section, _snake(key))) for key in checks}
        token = values["management"].pop("token")
        values["management"] = {"tokenSet": token is not None, **values["management"]}
        values["engines"] = {
            engine_id: {key: getattr(config.engines[engine_id], _snake(key)) for key in ENGINE_SETTINGS}
            for engine_id in self._engines()
        }
        return values

    def _keys(self) -> list[str]:
        keys = [f"{name}.{key}" for name, (_, checks) in SECTIONS.items() for key in checks]
        keys += [f"engines.{engine_id}.{key}" for engine_id in self._engines() for key in ENGINE_SETTINGS]
        return keys

    def _in_file(self, key: str) -> bool:
        head, _, rest = key.partition(".")
        if head == "engines":
            engine_id, _, name = rest.rpartition(".")
            entry = (self._raw.get("engines") or {}).get(engine_id) or self._installed.get(engine_id) or {}
            return entry.get(name) is not None
        return ((self._raw.get(head) or {}).get(rest)) is not None

    def _used(self, key: str, values: Mapping[str, Any]) -> Any:
        head, _, rest = key.partition(".")
        if key == TOKEN:
            return self.config.management.token
        if head == "engines":
            engine_id, _, name = rest.rpartition(".")
            return values["engines"][engine_id][name]
        return values[head][rest]

    def document(self) -> dict[str, Any]:
        """
        The whole document C{GET /settings} answers.
        """
        values = self.values()
        in_use = self._in_use()
        saved = self._database.settings()
        fields = []
        for key in self._keys():
            source = "database" if key in in_use else "config" if self._in_file(key) else "default"
            field: dict[str, Any] = {"key": key, "source": source, "applies": applies(key)}
            if key in saved and saved[key] != self._used(key, values):
                # Never the token itself: the document is read to draw a form.
                field["saved"] = True if key == TOKEN else saved[key]
            fields.append(field)
        return {"values": values, "fields": fields}

    def _flatten(self, body: Any) -> dict[str, Any]:
        """
        The patch as dotted keys, each a value or C{None} (clear); unknown keys refused.
        """
        if not isinstance(body, Mapping):
            raise BadRequest("a settings patch is a JSON object shaped like values", field="body")
        changes: dict[str, Any] = {}
        for head, part in body.items():
            if head == "engines":
                changes.update(self._flatten_engines(part))
                continue
            if head not in SECTIONS:
                raise BadRequest(f"{head}: no such setting", field=str(head))
            keys = [key for key in SECTIONS[head][1]]
            if part is None:
                changes.update((f"{head}.{key}", None) for key in keys)
                continue
            if not isinstance(part, Mapping):
                raise BadRequest(f"{head}: must be an object of settings, or null", field=head)
            for key, value in part.items():
                where = f"{head}.{key}"
                if where == "management.tokenSet":
                    raise BadRequest(
                        "management.tokenSet is never written: write management.token", field=where
                    )
                if key not in keys:
                    raise BadRequest(f"{where}: no such setting", field=where)
                changes[where] = value
        return changes

    def _flatten_engines(self, part: Any) -> dict[str, Any]:
        if part is None:
            part = {engine_id: None for engine_id in self._engines()}
        if not isinstance(part, Mapping):
            raise BadRequest("engines: must be an object of engines, or null", field="engines")
        registered = set(self._engines())
        changes: dict[str, Any] = {}
        for engine_id, settings in part.items():
            where = f"engines.{engine_id}"
            if engine_id not in registered:
                raise UnknownEngine(f'no engine "{engine_id}"', field=where)
            if settings is None:
                settings = {key: None for key in ENGINE_SETTINGS}
            if not isinstance(settings, Mapping):
                raise BadRequest(f"{where}: must be an object of settings, or null", field=where)
            for key, value in settings.items():
                if key not in ENGINE_SETTINGS:
                    raise BadRequest(f"{where}.{key}: no such per-engine setting", field=f"{where}.{key}")
                changes[f"{where}.{key}"] = value
        return changes

    async def patch(self, body: Any, caller: Caller) -> dict[str, Any]:
        """
        Apply a C{PATCH /settings}: every key checked, the lockout rules applied, then
        one transaction; a patch refused changes nothing.  Answers the new document.
        """
        changes = self._flatten(body)
        saved = self._database.settings()
        token = changes.get(TOKEN, ...)
        if not caller.local and (token == "" or (token is None and TOKEN in saved)):
            raise Conflict(
                "a caller that is not on this machine may not clear the management token: "
                "it was admitted by it, and every request after would be refused",
                field=TOKEN,
            )
        checked: dict[str, Any] = {}
        for key, value in changes.items():
            if value is None:
                checked[key] = None
                continue
            try:
                checked[key] = _json(_check(key)(value, key, self._base))
            except ConfigError as error:
                raise BadRequest(str(error), field=key) from None
        if ORIGINS in checked and not caller.own_origin:
            assert caller.origin is not None
            origins = checked[ORIGINS]
            if origins is None:
                origins = (self._raw.get("management") or {}).get("origins") or []
            if origin_key(caller.origin) not in {origin_key(origin) for origin in origins}:
                raise Conflict(
                    f"management.origins must keep {caller.origin}: the page asking would be "
                    "refused from the next start",
                    field=ORIGINS,
                )
        after = {**saved, **checked}
        try:
            self._parse({key: value for key, value in after.items() if value is not None})
        except ConfigError as error:
            raise BadRequest(str(error)) from None
        if checked:
            await self._database.write_settings(checked)
            self._refresh()
        return self.document()

    def installed_changed(self, installed: Mapping[str, Mapping[str, Any]]) -> None:
        """
        The API installed or removed an engine: the config in use takes its entry (and
        its per-engine settings) from now on, without a restart.
        """
        self._installed = dict(installed)
        self._refresh()

    def _refresh(self) -> None:
        self.config = self._parse(self._in_use())
        self._on_change(self.config)


def saved_fault(
    raw: Mapping[str, Any],
    base: Path,
    saved: Mapping[str, Any],
    installed: Mapping[str, Mapping[str, Any]] | None = None,
) -> str | None:
    """
    The saved setting a start cannot apply, where one can be named: the first whose own
    check refuses it (one saved by an older server, or written into the database by
    hand), else the first without which the layers parse; None when the fault is not
    the database's.
    """
    for key, value in saved.items():
        check = _check(key)
        if check is None:
            return key
        try:
            check(value, key, base)
        except ConfigError:
            return key
    try:
        parse_config(layer(raw, {}, installed), base)
    except ConfigError:
        return None  # the file (or an installed engine) is at fault
    for key in saved:
        try:
            parse_config(layer(raw, {k: v for k, v in saved.items() if k != key}, installed), base)
        except ConfigError:
            continue
        return key
    return None


def unset_hint(key: str) -> str:
    """
    How to drop a saved setting, from a stopped server or a running one.
    """
    return (
        f"start with `rhapsode serve --unset {key}` to drop it (the config file's value, or the "
        f"default, applies again); while a server runs, `rhapsode settings {key} --unset` does the same"
    )


def read_patch(raw: bytes) -> Any:
    """
    A PATCH body as JSON; anything else is bad_request.
    """
    try:
        return loads_json(raw or b"{}")
    except TooDeep:
        raise
    except ValueError as error:
        raise BadRequest(f"the body is not JSON: {error}", field="body") from None
