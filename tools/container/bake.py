"""
The engines tag's build step: engines installed into the image's /var/lib/rhapsode through
the server's own API, exactly as an operator's `rhapsode install` would do at run time.

    python3 bake.py tone espeak piper

It starts the image's command (C{rhapsode-container rhapsode serve}) on a loopback port of
its own, runs C{rhapsode install ENGINE --yes} for each engine (which accepts the weights
licence each names, and prints it), stops the server with SIGTERM as a container stop
would, and fails when any step does.  The virtualenvs and the state database that records
them stay in the image's volume folder, so a new volume starts with them; pip's cache is
left out of the image, and files the virtualenvs have in common are stored once.
Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def dedupe(root: Path, smallest: int = 4096) -> tuple[int, int]:
    """
    Identical files under C{root} made one file with several names (hard links): each
    engine's virtualenv has its own copy of what they all depend on, ffmpeg's 173 MB binary
    first, and a layer stores a hard-linked file once.  pip replaces a file by writing a new
    one, never in place, so a later install into one virtualenv leaves the others as they
    were.  Only files of one owner and mode are joined.  Answers (files linked, bytes saved).
    """
    by_size: dict[tuple[int, int, int, int], list[Path]] = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = Path(folder, name)
            facts = path.lstat()
            if path.is_symlink() or not path.is_file() or facts.st_size < smallest or facts.st_nlink > 1:
                continue
            by_size.setdefault((facts.st_size, facts.st_mode, facts.st_uid, facts.st_gid), []).append(path)
    linked = saved = 0
    for (size, *_), paths in by_size.items():
        if len(paths) < 2:
            continue
        first: dict[str, Path] = {}
        for path in sorted(paths):
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            if digest not in first:
                first[digest] = path
                continue
            partial = path.with_name(path.name + ".link")
            os.link(first[digest], partial)
            os.replace(partial, path)
            linked += 1
            saved += size
    return linked, saved


def main(engines: list[str]) -> int:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    environ = {**os.environ, "RHAPSODE_CONFIG_SERVER_HOST": "127.0.0.1", "RHAPSODE_CONFIG_SERVER_PORT": str(port)}
    server = subprocess.Popen(["rhapsode-container", "rhapsode", "serve"], env=environ)
    try:
        deadline = time.monotonic() + 120
        while True:
            if server.poll() is not None:
                print(f"bake: the server exited with {server.returncode} before answering", file=sys.stderr)
                return 1
            try:
                with urllib.request.urlopen(url + "/catalog", timeout=5) as answer:
                    catalog = {entry["id"] for entry in json.loads(answer.read())}
                break
            except OSError:
                if time.monotonic() > deadline:
                    print(f"bake: {url} did not answer within 120 s", file=sys.stderr)
                    return 1
                time.sleep(0.3)
        for engine in engines:
            if engine not in catalog:
                print(f"bake: {engine} is not in the catalog ({', '.join(sorted(catalog))})", file=sys.stderr)
                return 1
            started = time.monotonic()
            done = subprocess.run(["rhapsode", "install", engine, "--yes", "--url", url])
            if done.returncode != 0:
                print(f"bake: installing {engine} failed ({done.returncode})", file=sys.stderr)
                return 1
            print(f"bake: {engine} installed in {time.monotonic() - started:.0f} s", flush=True)
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=120)
    if server.returncode not in (0, -signal.SIGTERM):
        print(f"bake: the server's stop ended with {server.returncode}", file=sys.stderr)
        return 1
    home = Path(os.environ.get("RHAPSODE_HOME", "/var/lib/rhapsode"))
    shutil.rmtree(home / "cache" / "pip", ignore_errors=True)
    linked, saved = dedupe(home / "venvs")
    print(f"bake: {linked} files shared between the virtualenvs, {saved / 1e6:.0f} MB saved", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
