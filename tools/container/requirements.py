"""
The third-party requirements of the image's distributions, one a line, read from their
setup.cfg files: the Containerfile installs these in a layer of their own, before it copies
the sources, so that an edit to the code reinstalls four small distributions, not Twisted.

    python3 requirements.py setup.cfg protocol/setup.cfg sdk/setup.cfg conform/setup.cfg [--extra cli]

A requirement on another distribution of this repository (rhapsode-*) is left out: those
are installed from the sources next.  Standard library only.
"""

from __future__ import annotations

import argparse
import configparser
import re


def requirements(paths: list[str], extras: list[str]) -> list[str]:
    found: list[str] = []
    for path in paths:
        parser = configparser.ConfigParser(interpolation=None)
        parser.read(path, encoding="utf-8")
        lines = parser.get("options", "install_requires", fallback="").splitlines()
        for extra in extras:
            lines += parser.get("options.extras_require", extra, fallback="").splitlines()
        for line in lines:
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            name = re.split(r"[\s\[<>=!~;]", line, maxsplit=1)[0].lower().replace("_", "-")
            if not name.startswith("rhapsode-") and line not in found:
                found.append(line)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("setup_cfg", nargs="+")
    parser.add_argument("--extra", action="append", default=[])
    args = parser.parse_args()
    print("\n".join(requirements(args.setup_cfg, args.extra)))


if __name__ == "__main__":
    main()
