"""
Who holds a TCP port, for a start that finds its port taken: the process listening on
it, read from /proc on Linux (nothing where there is no /proc, or where the process is
not this user's to read).
"""

from __future__ import annotations

import os

__all__ = ["listener_of"]

#: A socket's state in /proc/net/tcp: 0A is LISTEN.
_LISTEN = "0A"


def _listening_inodes(port: int) -> set[str]:
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as handle:
                rows = handle.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) < 10 or fields[3] != _LISTEN:
                continue
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == port:
                inodes.add(fields[9])
    return inodes


def _links(pid: int) -> set[str]:
    """What the descriptors of process C{pid} point at (none if it is gone or not ours to read)."""
    folder = f"/proc/{pid}/fd"
    try:
        descriptors = os.listdir(folder)
    except OSError:
        return set()
    links = set()
    for fd in descriptors:
        try:
            links.add(os.readlink(f"{folder}/{fd}"))
        except OSError:
            continue  # closed meanwhile (the listing's own, for this process)
    return links


def listener_of(port: int) -> str | None:
    """
    The process listening on TCP C{port} as C{"pid N (command line)"}, or None where it
    cannot be told.
    """
    wanted = {f"socket:[{inode}]" for inode in _listening_inodes(port)}
    if not wanted:
        return None
    try:
        pids = sorted(int(name) for name in os.listdir("/proc") if name.isdigit())
    except OSError:
        return None
    for pid in pids:
        if not wanted & _links(pid):
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                argv = handle.read().split(b"\0")
        except OSError:
            argv = []
        command = " ".join(part.decode("utf-8", "replace") for part in argv if part)
        return f"pid {pid} ({command[:200]})" if command else f"pid {pid}"
    return None
