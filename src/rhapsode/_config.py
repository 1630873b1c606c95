"""
The operator's config file (protocol.md sections 3 and 10): JSON read into frozen dataclasses.

Every setting has a default, so a core runs without a file.  A key the file should not
have, or a value out of range, fails the start with a L{ConfigError} naming the key's
dotted path, so a misspelt setting is refused rather than silently ignored.  Numbers
are coerced as the contract coerces them ("8080" is 8080, a boolean is not a number)
and null means the setting is absent.  Relative paths resolve against the directory
of the file that names them.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from types import MappingProxyType
from typing import Any
from urllib.parse import unquote, urlparse, urlsplit

from zope.interface import implementer

from rhapsode_protocol.contract import MAX_KEEP_ALIVE_SECONDS, VOICE_ID_PATTERN

from ._guard import origin_key
from ._interfaces import IAdmissionSettings, IResidencySettings

LOG_LEVELS = ("error", "warn", "info", "debug", "trace")


#: The core's own distribution: installed from a checkout, that checkout's protocol/
#: and sdk/ folders are what an engine's virtualenv is given.
CORE_DISTRIBUTION = "rhapsode"
#: The repository's latest release, by GitHub's definition: neither a draft nor a prerelease.
RELEASES_URL = "https://api.github.com/repos/maroonedsoftware/rhapsode/releases/latest"


def source_of(dist: Any) -> Path | None:
    """
    The folder a distribution was installed from, where its metadata says (a C{pip
    install PATH} or an editable install); None for one from an index.
    """
    direct = dist.read_text("direct_url.json")
    if not direct:
        return None
    try:
        url = json.loads(direct).get("url", "")
    except (ValueError, AttributeError):
        return None
    parsed = urlparse(url)
    if parsed.scheme != "file":
        return None
    return Path(unquote(parsed.path))


@lru_cache(maxsize=1)
def default_source_dir() -> Path | None:
    """
    The C{engines} folder of the checkout this core runs from, where it runs from one:
    the folder its distribution was installed from (an editable install, or C{pip
    install PATH}) when that holds an C{engines} folder.  None for a core installed
    from an index, which ships no engine sources.  Worked out once per process:
    every L{rhapsode._config.Config} made asks.
    """
    try:
        dist = metadata.distribution(CORE_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None
    source = source_of(dist)
    if source is None or not (source / "engines").is_dir():
        return None
    return source / "engines"


class ConfigError(Exception):
    """
    The config file cannot be used; the message names the key path and why.
    """


def _default_socket_dir() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    # The XDG spec says to ignore a relative value.
    if os.path.isabs(runtime):
        return Path(runtime, "rhapsode", "workers")
    return Path(f"/tmp/rhapsode-{os.getuid()}", "workers")


def _default_voice_dir() -> Path:
    data = os.environ.get("XDG_DATA_HOME", "")
    base = Path(data) if os.path.isabs(data) else Path.home() / ".local" / "share"
    return base / "rhapsode" / "voices"


def _default_venv_dir() -> Path:
    data = os.environ.get("XDG_DATA_HOME", "")
    base = Path(data) if os.path.isabs(data) else Path.home() / ".local" / "share"
    return base / "rhapsode" / "venvs"


#: What a core is: an ordinary one, or a node of a cluster (docs/cluster.md), which
#: also serves its engines' worker routes to the cluster's front.
ROLES = ("core", "node")


@dataclass(frozen=True)
class ServerConfig:
    port: int = 8080
    host: str = "127.0.0.1"
    shutdown_grace_ms: int = 10000
    head_timeout_seconds: float = 10.0
    idle_timeout_seconds: float = 60.0
    role: str = "core"
    #: A node's name in its cluster (X-Rhapsode-Node); by default the host's name.
    node: str | None = None


@dataclass(frozen=True)
class LogConfig:
    level: str = "info"


@dataclass(frozen=True)
class ResidencyConfig:
    max_resident_models: int = 1
    eviction_wait_seconds: float = 30.0
    keep_alive_seconds: int = 300


@dataclass(frozen=True)
class WorkersConfig:
    socket_dir: Path = field(default_factory=_default_socket_dir)
    voice_dir: Path = field(default_factory=_default_voice_dir)
    startup_timeout_seconds: float = 120.0
    drain_grace_ms: int = 10000
    max_restarts: int = 5
    restart_decay_seconds: float = 300.0
    health_check_seconds: float = 5.0
    unresponsive_seconds: float = 15.0
    stall_seconds: float = 120.0
    #: The cores every worker's runs share (L{rhapsode_worker.onnx.BudgetedSession}); None
    #: for the cores this process may run on, counted when a worker is spawned.
    cores: int | None = None
    #: Start every local engine's worker process (not its model) when the core starts.
    prestart: bool = False


@dataclass(frozen=True)
class LimitsConfig:
    concurrent_per_engine: int = 8
    queued_per_engine: int = 32
    queue_wait_seconds: float = 30.0
    buffered_bytes: int = 256 * 1024 * 1024


@dataclass(frozen=True)
class ManagementConfig:
    token: str | None = None
    origins: tuple[str, ...] = ()


@dataclass(frozen=True)
class MetricsConfig:
    #: Whether GET /metrics answers everybody; otherwise only whom the management
    #: routes answer (it names every engine and what each model costs).
    public: bool = False


@dataclass(frozen=True)
class CorsConfig:
    #: Browser origins whose pages may call the public speech and discovery routes;
    #: "*" for any.  None by default: a page on another origin is refused.
    origins: tuple[str, ...] = ()


@dataclass(frozen=True)
class InstallConfig:
    #: Where the catalog records the core ships are (C{<id>/catalog.json}): by default
    #: the C{engines} folder of the checkout the core was installed from, else none.
    source_dir: Path | None = field(default_factory=default_source_dir)
    #: Where the engines installed through the API get their virtualenvs (two slots
    #: each, C{<id>} and C{<id>.alt}).
    venv_dir: Path = field(default_factory=_default_venv_dir)
    #: The interpreter new virtualenvs are made from: a path, or a version ("3.12")
    #: for uv to find; None for the core's own.
    python: str | None = None
    #: Which of an engine's install recipes (its catalog record's C{install}) to run:
    #: C{cuda} or C{cpu}, or C{auto}, C{cuda} where the kernel lists an NVIDIA card.
    box: str = "auto"


@dataclass(frozen=True)
class UpdateConfig:
    #: Whether the core asks, when asked, for the latest release (protocol.md section
    #: 9); RHAPSODE_UPDATE_CHECK=0 in the server's environment turns it off whatever
    #: this says.
    check: bool = True
    #: What it asks: GitHub's API for the repository's latest release.
    url: str = RELEASES_URL


@dataclass(frozen=True)
class EngineConfig:
    """
    One engine: a C{module} the core spawns with C{python}, the C{url} of a worker
    somebody else runs, or the C{cluster} whose nodes serve it (exactly one is set).

    @ivar keep_alive_seconds: this engine's keep-alive, C{None} for the server's.
    @ivar cluster: the URL of a Rhapsode cluster's Ray Serve app (docs/cluster.md):
        its nodes own the engine's models, so this core neither counts nor evicts them.
    """

    id: str
    module: str | None = None
    url: str | None = None
    cluster: str | None = None
    python: str | None = None
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    #: The torch device its worker is given (C{cpu}, C{mps}, C{cuda}, C{cuda:N}); None
    #: leaves the choice to the worker (the first card, else the CPU).
    device: str | None = None
    keep_alive_seconds: int | None = None
    max_concurrent: int | None = None
    max_queued: int | None = None


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    log: LogConfig = field(default_factory=LogConfig)
    residency: ResidencyConfig = field(default_factory=ResidencyConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    management: ManagementConfig = field(default_factory=ManagementConfig)
    cors: CorsConfig = field(default_factory=CorsConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    install: InstallConfig = field(default_factory=InstallConfig)
    update: UpdateConfig = field(default_factory=UpdateConfig)
    engines: Mapping[str, EngineConfig] = field(default_factory=lambda: MappingProxyType({}))

    def engine(self, engine_id: str) -> EngineConfig:
        """
        The engine of that id; C{KeyError} if the config has none.
        """
        return self.engines[engine_id]


# A check takes the value, its key path and the config file's directory.
_Check = Callable[[Any, str, Path], Any]

_INTEGER_TEXT = re.compile(r"[+-]?[0-9]+", re.ASCII)
_NUMBER_TEXT = re.compile(r"[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?", re.ASCII)
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", re.ASCII)
_ENGINE_ID = re.compile(VOICE_ID_PATTERN)


def _fail(where: str, must: str, value: Any) -> ConfigError:
    return ConfigError(f"{where}: must be {must}, not {json.dumps(value, default=repr)}")


def _integer(minimum: int, maximum: int | None = None) -> _Check:
    must = f"an integer >= {minimum}"
    if maximum is not None:
        must = f"an integer from {minimum} to {maximum}"

    def check(value: Any, where: str, base: Path) -> int:
        number = value
        if isinstance(value, str) and _INTEGER_TEXT.fullmatch(value.strip()):
            number = int(value)
        elif isinstance(value, float) and value.is_integer():
            number = int(value)
        if (
            isinstance(number, bool)
            or not isinstance(number, int)
            or number < minimum
            or (maximum is not None and number > maximum)
        ):
            raise _fail(where, must, value)
        return number

    return check


def _number(minimum: float, inclusive: bool, maximum: float | None = None) -> _Check:
    must = f"a number {'>=' if inclusive else '>'} {minimum:g}"
    if maximum is not None:
        must += f" and <= {maximum:g}"

    def check(value: Any, where: str, base: Path) -> float:
        number = value
        if isinstance(value, str) and _NUMBER_TEXT.fullmatch(value.strip()):
            number = float(value)
        if (
            isinstance(number, bool)
            or not isinstance(number, (int, float))
            or not math.isfinite(number)
            or number < minimum
            or (number == minimum and not inclusive)
            or (maximum is not None and number > maximum)
        ):
            raise _fail(where, must, value)
        return float(number)

    return check


def _text(value: Any, where: str, base: Path) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _fail(where, "a non-empty string", value)
    return value


def _path(value: Any, where: str, base: Path) -> Path:
    return base / _text(value, where, base)


def _level(value: Any, where: str, base: Path) -> str:
    if value not in LOG_LEVELS:
        raise _fail(where, "one of " + ", ".join(LOG_LEVELS), value)
    return str(value)


def _host(value: Any, where: str, base: Path) -> str:
    """
    An address this machine can listen on: an IP literal (or localhost) that a socket
    binds to now, so that a value that would fail the next start is refused when it is
    written, naming why.
    """
    text = _text(value, where, base).strip()
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(text).version == 6 else socket.AF_INET
    except ValueError:
        if text != "localhost":
            raise ConfigError(
                f"{where}: must be an IP address of this machine (127.0.0.1, 0.0.0.0 or :: for every "
                f"interface), or localhost, not {json.dumps(value)}"
            ) from None
        family = socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((text, 0))
    except OSError as error:
        raise ConfigError(
            f"{where}: {text} is not an address this machine can listen on ({error.strerror or error})"
        ) from None
    return text


#: What an HTTP header value carries as it is: visible ASCII and the space.
_HEADER_SAFE = re.compile(r"[ -~]*")


def _token(value: Any, where: str, base: Path) -> str:
    if not isinstance(value, str) or len(value) < 16 or value != value.strip():
        raise ConfigError(
            f"{where}: must be a string of at least 16 characters without surrounding spaces"
        )
    if not _HEADER_SAFE.fullmatch(value):
        # A caller sends it as "Authorization: Bearer <token>": a line break, a control
        # character or a letter outside ASCII cannot travel in that header as it is.
        raise ConfigError(
            f"{where}: must be printable ASCII (letters, digits, punctuation, spaces): it travels in "
            "an Authorization header, which cannot carry a line break, a control character or "
            "other text"
        )
    return value


def _origins(value: Any, where: str, base: Path) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise _fail(where, "a list of origins", value)
    for index, origin in enumerate(value):
        if not isinstance(origin, str) or origin_key(origin) is None:
            must = "an absolute http or https origin with nothing after the host and port"
            raise _fail(f"{where}[{index}]", must, origin)
    return tuple(value)


def _flag(value: Any, where: str, base: Path) -> bool:
    if not isinstance(value, bool):
        raise _fail(where, "true or false", value)
    return value


def _cors_origins(value: Any, where: str, base: Path) -> tuple[str, ...]:
    if isinstance(value, list) and value == ["*"]:
        return ("*",)
    return _origins(value, where, base)


def _module(value: Any, where: str, base: Path) -> str:
    if not isinstance(value, str) or not _MODULE.fullmatch(value):
        raise _fail(where, "a dotted Python module name", value)
    return value


def _url(value: Any, where: str, base: Path) -> str:
    must = "an http or https URL of a worker, or unix:/path/to/socket"
    if not isinstance(value, str):
        raise _fail(where, must, value)
    if value.startswith("unix:"):
        valid = value[len("unix:") :].startswith("/")
    else:
        try:
            parts = urlsplit(value)
            port = parts.port
        except ValueError:
            raise _fail(where, must, value) from None
        valid = (
            parts.scheme in ("http", "https")
            and bool(parts.hostname)
            and port != 0
            and "@" not in parts.netloc
            and not parts.query
            and not parts.fragment
        )
    if not valid:
        raise _fail(where, must, value)
    return value


def _role(value: Any, where: str, base: Path) -> str:
    if value not in ROLES:
        raise _fail(where, "one of " + ", ".join(ROLES), value)
    return str(value)


def _node_name(value: Any, where: str, base: Path) -> str:
    if not isinstance(value, str) or not _NODE_NAME.fullmatch(value):
        raise _fail(where, "1 to 64 letters, digits, '.', '_' or '-'", value)
    return value


_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _cluster_url(value: Any, where: str, base: Path) -> str:
    must = "the http or https URL of a Rhapsode cluster's Ray Serve app (http://head:8000/rhapsode)"
    if not isinstance(value, str):
        raise _fail(where, must, value)
    try:
        parts = urlsplit(value)
        parts.port
    except ValueError:
        raise _fail(where, must, value) from None
    if parts.scheme not in ("http", "https") or not parts.hostname or "@" in parts.netloc or parts.query or parts.fragment:
        raise _fail(where, must, value)
    return value.rstrip("/")


def _release_url(value: Any, where: str, base: Path) -> str:
    must = "an http or https URL answering as GitHub's latest-release API does"
    if not isinstance(value, str):
        raise _fail(where, must, value)
    try:
        parts = urlsplit(value)
        parts.port
    except ValueError:
        raise _fail(where, must, value) from None
    if parts.scheme not in ("http", "https") or not parts.hostname or "@" in parts.netloc or parts.fragment:
        raise _fail(where, must, value)
    return value


def _env(value: Any, where: str, base: Path) -> Mapping[str, str]:
    if not isinstance(value, dict):
        raise _fail(where, "an object of strings", value)
    for name, text in value.items():
        if not name or "=" in name or "\0" in name:
            raise ConfigError(f"{where}.{name}: not a usable environment variable name")
        if not isinstance(text, str) or "\0" in text:
            raise _fail(f"{where}.{name}", "a string", text)
    return MappingProxyType(dict(value))


def _python(value: Any, where: str, base: Path) -> str:
    return str(_path(value, where, base))


_DEVICE = re.compile(r"cpu|mps|cuda(:[0-9]{1,3})?", re.ASCII)


def _device(value: Any, where: str, base: Path) -> str:
    # The torch device the worker is given (RHAPSODE_WORKER_DEVICE): the worker checks
    # that its box has it, the config only that it names one.
    if not isinstance(value, str) or not _DEVICE.fullmatch(value.strip().lower()):
        raise _fail(where, 'a device: "cpu", "mps", "cuda" or "cuda:N"', value)
    return value.strip().lower()


_BOXES = ("auto", "cpu", "cuda")


def _box(value: Any, where: str, base: Path) -> str:
    if value not in _BOXES:
        raise _fail(where, " or ".join(f'"{box}"' for box in _BOXES), value)
    return str(value)


def _snake(key: str) -> str:
    return re.sub(r"[A-Z]", lambda m: "_" + m.group().lower(), key)


def _read(raw: Any, where: str, checks: Mapping[str, _Check], base: Path) -> dict[str, Any]:
    """
    Check an object's keys and values; answer snake_case names to values, nulls left out.
    """
    if not isinstance(raw, Mapping):
        raise _fail(where, "an object", raw)
    values: dict[str, Any] = {}
    for key, value in raw.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in checks:
            raise ConfigError(f"{path}: unknown key")
        if value is not None:
            values[_snake(key)] = checks[key](value, path, base)
    return values


def _section(cls: type[Any], checks: Mapping[str, _Check]) -> _Check:
    return lambda value, where, base: cls(**_read(value, where, checks, base))


_ENGINE_KEYS: dict[str, _Check] = {
    "module": _module,
    "url": _url,
    "cluster": _cluster_url,
    "python": _python,
    "env": _env,
    "device": _device,
    "keepAliveSeconds": _integer(-1, MAX_KEEP_ALIVE_SECONDS),
    "maxConcurrent": _integer(1, 10_000),
    "maxQueued": _integer(0, 10_000),
}


def _engine(engine_id: str, raw: Any, base: Path) -> EngineConfig:
    where = f"engines.{engine_id}"
    if not _ENGINE_ID.search(engine_id):
        raise ConfigError(
            f"{where}: an engine id is 1 to 64 letters, digits, _ or -, "
            "starting with a letter or digit"
        )
    values = _read(raw, where, _ENGINE_KEYS, base)
    if sum(key in values for key in ("module", "url", "cluster")) != 1:
        raise ConfigError(f"{where}: needs exactly one of module, url or cluster")
    if "url" in values or "cluster" in values:
        for key in ("python", "env", "device"):
            if key in values:
                raise ConfigError(f"{where}.{key}: only an engine with a module takes {key}")
    else:
        values.setdefault("python", sys.executable)
    return EngineConfig(id=engine_id, **values)


def engine_entry(engine_id: str, raw: Mapping[str, Any]) -> EngineConfig:
    """
    An engine entry as the config file would hold it (an install records absolute
    paths), checked as the file's are.

    @raise ConfigError: it is not a valid entry.
    """
    return _engine(engine_id, raw, Path.cwd())


def _engines(value: Any, where: str, base: Path) -> Mapping[str, EngineConfig]:
    if not isinstance(value, Mapping):
        raise _fail(where, "an object of engines", value)
    return MappingProxyType(
        {key: _engine(key, entry, base) for key, entry in value.items() if entry is not None}
    )


#: Each section of the file: its dataclass and the check of each of its keys, by the
#: key's name in the file.  The settings API (L{rhapsode._manage.settings}) checks a value
#: written through it with these same checks.
SECTIONS: Mapping[str, tuple[type[Any], Mapping[str, _Check]]] = MappingProxyType({
    "server": (
        ServerConfig,
        {
            "port": _integer(1, 65535),
            "host": _host,
            "shutdownGraceMs": _integer(0, 600_000),
            "headTimeoutSeconds": _number(0, inclusive=False, maximum=600),
            "idleTimeoutSeconds": _number(0, inclusive=False, maximum=3600),
            "role": _role,
            "node": _node_name,
        },
    ),
    "log": (LogConfig, {"level": _level}),
    "residency": (
        ResidencyConfig,
        {
            "maxResidentModels": _integer(1, 64),
            "evictionWaitSeconds": _number(0, inclusive=True, maximum=3600),
            "keepAliveSeconds": _integer(-1, MAX_KEEP_ALIVE_SECONDS),
        },
    ),
    "workers": (
        WorkersConfig,
        {
            "socketDir": _path,
            "voiceDir": _path,
            "startupTimeoutSeconds": _number(0, inclusive=False, maximum=3600),
            "drainGraceMs": _integer(0, 600_000),
            "maxRestarts": _integer(0, 1000),
            "restartDecaySeconds": _number(0, inclusive=False, maximum=86_400),
            "healthCheckSeconds": _number(0, inclusive=False, maximum=300),
            "unresponsiveSeconds": _number(0, inclusive=False, maximum=600),
            "stallSeconds": _number(0, inclusive=False, maximum=3600),
            "cores": _integer(1, 4096),
            "prestart": _flag,
        },
    ),
    "management": (ManagementConfig, {"token": _token, "origins": _origins}),
    "cors": (CorsConfig, {"origins": _cors_origins}),
    "metrics": (MetricsConfig, {"public": _flag}),
    "limits": (
        LimitsConfig,
        {
            "concurrentPerEngine": _integer(1, 10_000),
            "queuedPerEngine": _integer(0, 10_000),
            "queueWaitSeconds": _number(0, inclusive=True, maximum=3600),
            "bufferedBytes": _integer(1024 * 1024, 16 * 1024**3),
        },
    ),
    "install": (InstallConfig, {"sourceDir": _path, "venvDir": _path, "python": _text, "box": _box}),
    "update": (UpdateConfig, {"check": _flag, "url": _release_url}),
})

#: The keys of an engine's entry that tune it rather than say what it is: the settings
#: API writes these per engine; the rest of an entry is the operator's or an install's.
ENGINE_SETTINGS: Mapping[str, _Check] = MappingProxyType(
    {key: _ENGINE_KEYS[key] for key in ("keepAliveSeconds", "maxConcurrent", "maxQueued")}
)

_TOP: dict[str, _Check] = {
    **{name: _section(cls, checks) for name, (cls, checks) in SECTIONS.items()},
    "engines": _engines,
}


def parse_config(raw: Mapping[str, Any], base_dir: Path) -> Config:
    """
    Build a L{Config} from a parsed config document.

    @param base_dir: the directory relative paths in C{raw} resolve against.
    @raise ConfigError: naming the first key that is unknown or out of range.
    """
    return Config(**_read(raw, "", _TOP, base_dir))


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        # The JSON module keeps the last of two equal keys, which hides a setting.
        if key in seen:
            raise ConfigError(f'key "{key}" appears twice in one object')
        seen[key] = value
    return seen


def load_config(path: str | os.PathLike[str] | None) -> Config:
    """
    Read the config file at C{path}; C{None} gives every default and no engines.

    @raise ConfigError: the file cannot be read, is not JSON, or fails L{parse_config}.
    """
    if path is None:
        return parse_config({}, Path.cwd())
    where = Path(os.path.abspath(path))
    try:
        with open(where, encoding="utf-8") as f:
            raw = json.load(f, object_pairs_hook=_no_duplicates)
    except OSError as e:
        raise ConfigError(f"{where}: cannot be read: {e.strerror}") from e
    except ValueError as e:
        raise ConfigError(f"{where}: is not JSON: {e}") from e
    except RecursionError:
        raise ConfigError(f"{where}: is not JSON: it nests deeper than can be read") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must hold a JSON object")
    config = parse_config(raw, where.parent)
    # Kept beside the fields (not one of them: a Config compares by its settings) so
    # that a service given only the Config can find the file's directory, where the
    # state database lives, and the document the database's settings layer over.
    object.__setattr__(config, "_source", ConfigSource(where, raw))
    return config


@dataclass(frozen=True)
class ConfigSource:
    """
    The file a L{Config} was read from and the document it held.
    """

    path: Path
    raw: Mapping[str, Any]


def config_source(config: Config) -> ConfigSource | None:
    """
    Where L{load_config} read C{config} from; C{None} for one built any other way.
    """
    source = getattr(config, "_source", None)
    return source if isinstance(source, ConfigSource) else None


@implementer(IResidencySettings, IAdmissionSettings)
class ConfigSettings:
    """
    Residency and admission settings read from whatever config C{current} answers at
    the time.
    """

    def __init__(self, current: Callable[[], Config]) -> None:
        self._current = current

    def max_resident_models(self) -> int:
        return self._current().residency.max_resident_models

    def eviction_wait_seconds(self) -> float:
        return self._current().residency.eviction_wait_seconds

    def keep_alive_seconds(self) -> int:
        return self._current().residency.keep_alive_seconds

    def engine_keep_alive_seconds(self, engine: str) -> int | None:
        config = self._current().engines.get(engine)
        return None if config is None else config.keep_alive_seconds

    # The admission limits (rhapsode._http.site.IAdmissionSettings).

    def concurrent_per_engine(self, engine: str) -> int:
        config = self._current()
        own = config.engines.get(engine)
        return own.max_concurrent if own is not None and own.max_concurrent is not None else config.limits.concurrent_per_engine

    def queued_per_engine(self, engine: str) -> int:
        config = self._current()
        own = config.engines.get(engine)
        return own.max_queued if own is not None and own.max_queued is not None else config.limits.queued_per_engine

    def queue_wait_seconds(self) -> float:
        return self._current().limits.queue_wait_seconds

    def buffered_bytes(self) -> int:
        return self._current().limits.buffered_bytes
