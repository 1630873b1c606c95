#!/usr/bin/env python3
"""
The container's entrypoint (installed as /usr/local/bin/rhapsode-container): config from a
mounted file and the environment, then C{rhapsode serve} in its place.

    rhapsode-container rhapsode serve     # the image's command
    rhapsode-container health             # the image's HEALTHCHECK
    rhapsode-container ANY COMMAND        # runs it as it is (rhapsode catalog, bash, ...)

The core reads one JSON config file and keeps its state database (rhapsode.db) beside it,
so the file it is given must live in the volume, not in a read-only mount: at every start
this writes C{$RHAPSODE_HOME/rhapsode.json} (the volume, /var/lib/rhapsode) from three
layers, each over the one before:

1. the image's defaults: every interface on port 8080, voices, virtualenvs and caches in
   the volume, worker sockets under /tmp, the engines' sources the image ships, and on a
   box with no accelerator device every engine kept loaded (as C{make serve} does);
2. the operator's file, C{$RHAPSODE_CONFIG} (default /etc/rhapsode/rhapsode.json, read only
   when it is there), merged key by key;
3. C{RHAPSODE_CONFIG_<SECTION>_<KEY>} variables, one setting each: the key's camelCase in
   capitals with underscores (C{RHAPSODE_CONFIG_SERVER_SHUTDOWN_GRACE_MS=20000} is
   C{server.shutdownGraceMs}).  A value that reads as JSON (a number, true, a list) is
   that; anything else is a string; an empty one is as if the variable were unset.

The core checks the result as it checks any file and names a bad key; this only says, on
stdout (the log), which variables it took.  C{$RHAPSODE_CA_FILE}, where set, is a PEM
bundle added to the system's for every TLS client the server runs (pip, the weights
fetch): for a registry or mirror behind a proxy of one's own.  Standard library only: it
runs with the image's Python before anything else.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

PREFIX = "RHAPSODE_CONFIG_"
DEFAULT_FILE = "/etc/rhapsode/rhapsode.json"
SYSTEM_CA = "/etc/ssl/certs/ca-certificates.crt"
#: Where the system's roots and C{RHAPSODE_CA_FILE} are written together.
CA_BUNDLE = Path("/tmp/rhapsode-ca.pem")
#: Device nodes of an accelerator the engines may load onto (as tools/make_config.py).
ACCELERATORS = ("nvidiactl", "kfd", "dxg")


def home() -> Path:
    return Path(os.environ.get("RHAPSODE_HOME", "/var/lib/rhapsode"))


def defaults(data: Path, dev: Path = Path("/dev")) -> dict[str, Any]:
    document: dict[str, Any] = {
        "server": {"host": "0.0.0.0", "port": 8080},
        "workers": {"socketDir": "/tmp/rhapsode/workers", "voiceDir": str(data / "voices")},
        "install": {"venvDir": str(data / "venvs"), "sourceDir": "/opt/rhapsode/src/engines"},
    }
    if not any((dev / name).exists() for name in ACCELERATORS):
        # A CPU box: unloading an engine frees RAM nobody else wants and costs the next
        # request a cold start, so every engine stays loaded once used.
        document["residency"] = {"maxResidentModels": 8, "keepAliveSeconds": -1}
    return document


def merge(below: dict[str, Any], above: dict[str, Any]) -> dict[str, Any]:
    """C{above} over C{below}, object by object; anything else (a list too) replaces."""
    merged = dict(below)
    for key, value in above.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def camel(words: list[str]) -> str:
    first, *rest = [word.lower() for word in words]
    return first + "".join(word.capitalize() for word in rest)


def value_of(text: str) -> Any:
    # JSON where it reads as a number, a boolean, null, a list or an object; the core takes
    # numbers written as strings too, so a token of digits stays a string either way.
    if text[:1] in "[{" or text in ("true", "false", "null"):
        try:
            return json.loads(text)
        except ValueError:
            return text
    return text


def from_environment(environ: dict[str, str]) -> tuple[dict[str, Any], list[str]]:
    """The settings the C{RHAPSODE_CONFIG_*} variables give, and a line for each taken."""
    document: dict[str, Any] = {}
    taken = []
    for name in sorted(environ):
        if not name.startswith(PREFIX):
            continue
        if not environ[name]:
            # As if unset: compose's `${NAME:-}` and the like give empty strings.
            continue
        if environ[name].startswith("${") and environ[name].endswith("}"):
            # podman-compose 1.0.3 passes `${NAME:-}` on as it is: a token of those 14
            # characters would be one anybody can read in the compose file.
            raise SystemExit(f"rhapsode-container: {name}={environ[name]}: a compose variable left unexpanded")
        words = [word for word in name[len(PREFIX):].split("_") if word]
        if len(words) < 2:
            raise SystemExit(f"rhapsode-container: {name}: want {PREFIX}<SECTION>_<KEY>, e.g. {PREFIX}SERVER_PORT")
        section, key = words[0].lower(), camel(words[1:])
        document.setdefault(section, {})[key] = value_of(environ[name])
        shown = "(set)" if key == "token" else environ[name]
        taken.append(f"{name} -> {section}.{key} = {shown}")
    return document, taken


def assemble(environ: dict[str, str], data: Path, dev: Path = Path("/dev")) -> tuple[dict[str, Any], list[str]]:
    document = defaults(data, dev)
    notes = []
    given = environ.get("RHAPSODE_CONFIG")
    path = Path(given or DEFAULT_FILE)
    if path.is_file():
        try:
            mounted = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise SystemExit(f"rhapsode-container: {path}: not a JSON config ({error})")
        if not isinstance(mounted, dict):
            raise SystemExit(f"rhapsode-container: {path}: the config must be one JSON object")
        document = merge(document, mounted)
        notes.append(f"config from {path}")
    elif given:
        raise SystemExit(f"rhapsode-container: RHAPSODE_CONFIG={given}: no such file")
    overrides, taken = from_environment(environ)
    return merge(document, overrides), notes + taken


def write(path: Path, document: dict[str, Any]) -> None:
    # Whole or not at all, readable by the server's user only: it may hold the token.
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    partial.chmod(0o600)
    os.replace(partial, path)


def ca_bundle(environ: dict[str, str]) -> dict[str, str]:
    """The variables that point every TLS client at the system's roots plus C{RHAPSODE_CA_FILE}."""
    extra = environ.get("RHAPSODE_CA_FILE")
    if not extra:
        return {}
    bundle = CA_BUNDLE
    try:
        pem = Path(SYSTEM_CA).read_bytes() + b"\n" + Path(extra).read_bytes()
    except OSError as error:
        raise SystemExit(f"rhapsode-container: RHAPSODE_CA_FILE={extra}: {error.strerror}")
    bundle.write_bytes(pem)
    return {name: str(bundle) for name in ("PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE")}


def serve(argv: list[str]) -> None:
    data = home()
    config = data / "rhapsode.json"
    document, notes = assemble(dict(os.environ), data)
    try:
        data.mkdir(parents=True, exist_ok=True)
        write(config, document)
    except OSError as error:
        raise SystemExit(
            f"rhapsode-container: cannot write {config} ({error.strerror}): the volume at {data} "
            f"must be writable by uid {os.getuid()}"
        )
    os.environ.update(ca_bundle(dict(os.environ)))
    for line in notes:
        print(f"rhapsode-container: {line}", flush=True)
    print(f"rhapsode-container: rhapsode serve --config {config}", flush=True)
    os.execvp(argv[0], [*argv, "--config", str(config)])


def health(data: Path) -> int:
    """0 when the server answers GET /health with 200 (its body says ok or degraded)."""
    try:
        server = json.loads((data / "rhapsode.json").read_text(encoding="utf-8")).get("server") or {}
    except (OSError, ValueError) as error:
        print(f"no config yet: {error}")
        return 1
    host = server.get("host") or "127.0.0.1"
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    url = f"http://{'[' + host + ']' if ':' in host else host}:{server.get('port', 8080)}/health"
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            print(f"{url}: {json.loads(answer.read()).get('status')}")
            return 0
    except (OSError, ValueError) as error:
        print(f"{url}: {error}")
        return 1


def main(argv: list[str]) -> int:
    if not argv:
        argv = ["rhapsode", "serve"]
    if argv == ["health"]:
        return health(home())
    if argv == ["rhapsode", "serve"]:
        serve(argv)
    os.execvp(argv[0], argv)
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
