"""
The config `make serve` runs from (run/rhapsode.json), written so that a hand edit survives.

    python3 tools/make_config.py write run/rhapsode.json

C{write} writes the file only when it does not exist, with no engine of its own: `make
serve` installs its engines through the API (tools/serve.py), into C{install.venvDir}
beside the file, and the core records them in its state database, rhapsode.db beside it.
Engines named here are the operator's, configured by hand (C{add} names some, each
running from C{<venvs>/<engine>/bin/python}); an install through the API refuses those.
C{add} adds engines the file does not name yet and changes nothing else; a file that does
not exist is left for C{write}.  Each says on stdout what it did.  Paths in the file are
absolute.  Standard library only: it runs before any virtualenv exists.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any


def engine_entry(engine: str, venvs: Path) -> dict[str, str]:
    return {"module": f"rhapsode_engine_{engine}", "python": str(venvs.absolute() / engine / "bin" / "python")}


#: Device nodes whose presence means an accelerator the engines may load onto: NVIDIA's
#: control device, AMD's ROCm compute device, WSL's GPU.
ACCELERATORS = ("nvidiactl", "kfd", "dxg")
#: On a box without one, this many models stay resident, and none expires.
CPU_RESIDENT_MODELS = 8


def has_accelerator(dev: Path = Path("/dev")) -> bool:
    return any((dev / name).exists() for name in ACCELERATORS)


def fresh(config: Path, engines: list[str], venvs: Path, accelerator: bool | None = None) -> dict[str, Any]:
    run = config.absolute().parent
    document: dict[str, Any] = {
        "server": {"port": 8080, "host": "127.0.0.1"},
        "workers": {"socketDir": str(run / "sockets"), "voiceDir": str(run / "voices")},
        "install": {"venvDir": str(run / "venvs")},
        "engines": {engine: engine_entry(engine, venvs) for engine in engines},
    }
    if not (has_accelerator() if accelerator is None else accelerator):
        # CPU engines cost a few hundred MB of RAM each, and a cold start costs seconds:
        # on a box with no card to share, every installed engine stays loaded.
        document["residency"] = {"maxResidentModels": CPU_RESIDENT_MODELS, "keepAliveSeconds": -1}
    return document


def save(config: Path, document: dict[str, Any]) -> None:
    """Write C{document} whole or not at all: a half-written config would not load."""
    config.parent.mkdir(parents=True, exist_ok=True)
    partial = config.with_name(config.name + ".partial")
    partial.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    os.replace(partial, config)


def write(config: Path, engines: list[str], venvs: Path) -> str:
    if config.exists():
        return f"{config} exists: left as it is (delete it to have it written afresh)"
    document = fresh(config, engines, venvs)
    save(config, document)
    named = f"engines {', '.join(engines)} configured by hand" if engines else "no engine of its own"
    if "residency" in document:
        named += " (no GPU here: every engine stays loaded once used)"
    return (
        f"wrote {config} with {named}; it is yours to edit: make never writes it again "
        "(delete it to have it written afresh)"
    )


def add(config: Path, engines: list[str], venvs: Path) -> str:
    if not config.exists():
        return f"{config} does not exist yet: make serve writes it with {', '.join(engines)}"
    try:
        document = json.loads(config.read_text(encoding="utf-8"))
    except ValueError as error:
        raise SystemExit(f"{config} is not JSON ({error}): left as it is; add {', '.join(engines)} by hand")
    if not isinstance(document, dict) or not isinstance(document.setdefault("engines", {}), dict):
        raise SystemExit(f"{config} has no engines object: left as it is; add {', '.join(engines)} by hand")
    missing = [engine for engine in engines if engine not in document["engines"]]
    if not missing:
        return f"{config} already configures {', '.join(engines)}: left as it is"
    for engine in missing:
        document["engines"][engine] = engine_entry(engine, venvs)
    save(config, document)
    return f"added engine {', '.join(missing)} to {config}; the rest of it is as it was"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("action", choices=["write", "add"])
    parser.add_argument("config", type=Path)
    parser.add_argument("engines", nargs="*")
    parser.add_argument("--venvs", type=Path, default=Path(".venvs"), help="where the engines' virtualenvs are")
    args = parser.parse_args(argv)
    act = write if args.action == "write" else add
    print(act(args.config, args.engines, args.venvs))


if __name__ == "__main__":
    main(sys.argv[1:])
