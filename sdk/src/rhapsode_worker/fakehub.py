"""
A Hugging Face hub of one's own, on loopback, for testing a torch adapter's fetch with the
real client: C{huggingface_hub} pointed at it through C{HF_ENDPOINT} downloads, resumes
and verifies exactly as it would from the hub, from folders of weights the test built.

It answers the routes the client's C{snapshot_download} and C{hf_hub_download} use:

 - C{GET /api/models/{repo}/revision/{revision}}: the commit a branch or commit names,
   and the files there (C{siblings});
 - C{GET /api/models/{repo}/tree/{revision}}: every file with its git blob id and size,
   and for a large file its LFS record (its SHA-256), which is what the client's cache
   checks a snapshot against and what L{rhapsode_worker.hub.verify} checks each file by;
 - C{HEAD} and C{GET /{repo}/resolve/{revision}/{path}}: the file, with the headers the
   client reads (C{X-Repo-Commit}, C{ETag}/C{X-Linked-Etag}, C{X-Linked-Size},
   C{Content-Length}), and byte ranges, which is how the client resumes;

and refuses what the hub refuses with the hub's C{X-Error-Code} (C{RepoNotFound},
C{RevisionNotFound}, C{EntryNotFound}), which the client turns into its own errors.  A
token, when the hub was given one, is required as C{Authorization: Bearer}, answered 401
otherwise.  It can cut a download short (L{FakeHub.interrupt}) to prove a resume, and it
counts what it served (L{FakeHub.served}, L{FakeHub.ranges}).

Large files are the ones an LFS hub would store in LFS: weights by extension, or
anything over 10 MiB.  Their hashes are read from a manifest beside them when one
matches (L{manifest_name}), since hashing 3 GB takes seconds; otherwise computed.

Run alone (C{python -m rhapsode_worker.fakehub --repo OWNER/NAME@COMMIT=FOLDER ...}) it
prints one JSON line, C{{"endpoint": ...}}, once it listens, and serves until killed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Mapping, Sequence

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IPushProducer
from twisted.internet.task import react
from twisted.logger import Logger
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site
from zope.interface import implementer

__all__ = ["FakeHub", "FakeRepo", "HubFile", "listen", "manifest_name", "write_manifest"]

log = Logger(namespace="rhapsode_worker.fakehub")

_CHUNK = 1 << 16
_LFS_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt", ".onnx", ".npy", ".model")
_LFS_BYTES = 10 << 20
_RANGE = re.compile(r"bytes=(\d+)-(\d*)")


def manifest_name() -> str:
    """
    The manifest's file name in a repository folder (left out of what is served).
    """
    return ".hub-manifest.json"


@dataclass(frozen=True)
class HubFile:
    """
    One file of a repository as the hub describes it.
    """

    path: str
    source: Path
    size: int
    oid: str
    sha256: str | None

    @property
    def etag(self) -> str:
        return self.sha256 if self.sha256 is not None else self.oid


def _hashes(path: Path) -> tuple[str, str]:
    size = path.stat().st_size
    blob = hashlib.sha1(f"blob {size}\0".encode())
    sha = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(1 << 20):
            blob.update(block)
            sha.update(block)
    return blob.hexdigest(), sha.hexdigest()


def _lfs(path: Path) -> bool:
    return path.suffix in _LFS_SUFFIXES or path.stat().st_size > _LFS_BYTES


def write_manifest(folder: Path) -> dict[str, Any]:
    """
    Hash every file of C{folder} and write the manifest the hub reads them from.
    """
    entries = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != manifest_name()):
        stat = path.stat()
        oid, sha = _hashes(path)
        entries[path.relative_to(folder).as_posix()] = {
            "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "oid": oid, "sha256": sha,
        }
    manifest = {"files": entries}
    partial = folder / (manifest_name() + ".partial")
    partial.write_text(json.dumps(manifest, indent=1))
    os.replace(partial, folder / manifest_name())
    return manifest


@dataclass
class FakeRepo:
    """
    A repository at one commit: C{branches} name it too (C{main} always does).
    """

    repo: str
    commit: str
    files: dict[str, HubFile]
    branches: tuple[str, ...] = ("main",)

    @classmethod
    def from_folder(cls, repo: str, commit: str, folder: Path, branches: Sequence[str] = ("main",)) -> "FakeRepo":
        if not re.fullmatch(r"[0-9a-f]{40}", commit):
            raise ValueError(f"a commit is 40 hex digits, not {commit!r}")
        known: dict[str, Any] = {}
        try:
            known = json.loads((folder / manifest_name()).read_text())["files"]
        except (OSError, ValueError, KeyError):
            pass
        files = {}
        for path in sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".hub-manifest")):
            name = path.relative_to(folder).as_posix()
            stat = path.stat()
            entry = known.get(name)
            if entry and (entry["size"], entry["mtime_ns"]) == (stat.st_size, stat.st_mtime_ns):
                oid, sha = entry["oid"], entry["sha256"]
            else:
                oid, sha = _hashes(path)
            files[name] = HubFile(name, path, stat.st_size, oid, sha if _lfs(path) else None)
        return cls(repo, commit, files, tuple(branches))


@dataclass
class FakeHub:
    """
    The hub's state: its repositories, its token, and what it has served.

    @ivar served: bytes of file bodies sent, by path.
    @ivar ranges: the C{Range} headers file requests carried, in order.
    @ivar interrupt: path to a byte count: the next C{GET} of that file ends, its
        connection closed, after that many bytes (once).
    """

    repos: dict[str, FakeRepo] = field(default_factory=dict)
    token: str | None = None
    served: dict[str, int] = field(default_factory=dict)
    ranges: list[tuple[str, str | None]] = field(default_factory=list)
    interrupt: dict[str, int] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)

    def add(self, repo: FakeRepo) -> None:
        self.repos[repo.repo] = repo

    def resource(self) -> Resource:
        return _Hub(self)

    def site(self) -> Site:
        site = Site(self.resource())
        site.displayTracebacks = False
        return site


@implementer(IPushProducer)
class _Body:
    """
    Streams C{length} bytes of a file from C{offset}, pausing when the transport asks;
    with C{cut}, stops after that many and drops the connection, as a network would.
    """

    def __init__(self, request: Request, handle: IO[bytes], length: int, cut: int | None,
                 count: Any) -> None:
        self._request = request
        self._handle = handle
        self._left = length
        self._cut = cut
        self._count = count
        self._paused = False
        self._done = False

    def start(self) -> None:
        self._request.registerProducer(self, True)
        self._request.notifyFinish().addErrback(lambda _: self._close())
        self.resumeProducing()

    def pauseProducing(self) -> None:
        self._paused = True

    def resumeProducing(self) -> None:
        self._paused = False
        while not self._paused and not self._done:
            if self._left <= 0:
                self._finish()
                return
            size = min(_CHUNK, self._left)
            if self._cut is not None:
                size = min(size, self._cut)
            block = self._handle.read(size)
            if not block:
                self._finish()
                return
            self._left -= len(block)
            self._count(len(block))
            self._request.write(block)
            if self._cut is not None:
                self._cut -= len(block)
                if self._cut <= 0:
                    # Closed, not reset: the body ends short of its Content-Length, the
                    # way a dropped proxy or a restarted server ends it, which the client
                    # answers by asking for the rest.
                    self._close()
                    self._request.unregisterProducer()
                    transport = self._request.channel.transport if self._request.channel else None
                    if transport is not None:
                        transport.loseConnection()
                    return

    def stopProducing(self) -> None:
        self._close()

    def _close(self) -> None:
        if not self._done:
            self._done = True
            self._handle.close()

    def _finish(self) -> None:
        self._close()
        self._request.unregisterProducer()
        self._request.finish()


class _Hub(Resource):
    isLeaf = True

    def __init__(self, hub: FakeHub) -> None:
        super().__init__()
        self._hub = hub

    # -- answers ------------------------------------------------------------------------

    def _error(self, request: Request, status: int, code: str | None, message: str) -> bytes:
        request.setResponseCode(status)
        if code is not None:
            request.setHeader(b"X-Error-Code", code.encode())
        request.setHeader(b"X-Error-Message", message.encode())
        request.setHeader(b"Content-Type", b"application/json")
        return json.dumps({"error": message}).encode()

    def _json(self, request: Request, doc: Any) -> bytes:
        request.setHeader(b"Content-Type", b"application/json")
        return json.dumps(doc).encode()

    def _authorised(self, request: Request) -> bool:
        if self._hub.token is None:
            return True
        given = (request.getHeader(b"authorization") or b"").decode("latin-1")
        return given == f"Bearer {self._hub.token}"

    def _repo(self, owner: str, name: str, revision: str) -> tuple[FakeRepo | None, str | None]:
        repo = self._hub.repos.get(f"{owner}/{name}")
        if repo is None:
            return None, "RepoNotFound"
        if revision not in (repo.commit, *repo.branches):
            return repo, "RevisionNotFound"
        return repo, None

    def render(self, request: Request) -> Any:
        method = (request.method or b"").decode()
        path = [part.decode("utf-8", "replace") for part in request.postpath or []]
        self._hub.requests.append((method, "/" + "/".join(path)))
        if not self._authorised(request):
            return self._error(request, 401, None, "Invalid credentials in Authorization header")
        if len(path) >= 6 and path[0] == "api" and path[1] == "models" and path[4] in ("revision", "tree"):
            owner, name, kind, revision = path[2], path[3], path[4], path[5]
            repo, missing = self._repo(owner, name, revision)
            if missing is not None or repo is None:
                return self._error(request, 404, missing, f"{owner}/{name}@{revision}: {missing}")
            if kind == "revision":
                return self._json(request, {
                    "id": repo.repo, "modelId": repo.repo, "sha": repo.commit, "private": False,
                    "siblings": [{"rfilename": name} for name in sorted(repo.files)],
                })
            return self._json(request, [self._tree_entry(f) for _, f in sorted(repo.files.items())])
        if len(path) >= 5 and path[2] == "resolve" and method in ("GET", "HEAD"):
            owner, name, revision, filename = path[0], path[1], path[3], "/".join(path[4:])
            repo, missing = self._repo(owner, name, revision)
            if missing is not None or repo is None:
                return self._error(request, 404, missing, f"{owner}/{name}@{revision}: {missing}")
            hub_file = repo.files.get(filename)
            if hub_file is None:
                request.setHeader(b"X-Repo-Commit", repo.commit.encode())
                return self._error(request, 404, "EntryNotFound", f"{filename} is not in {repo.repo}")
            return self._file(request, repo, hub_file, method == "HEAD")
        return self._error(request, 404, None, "no such route on this hub")

    @staticmethod
    def _tree_entry(hub_file: HubFile) -> dict[str, Any]:
        entry: dict[str, Any] = {"type": "file", "oid": hub_file.oid, "size": hub_file.size,
                                 "path": hub_file.path}
        if hub_file.sha256 is not None:
            entry["lfs"] = {"oid": hub_file.sha256, "size": hub_file.size, "pointerSize": 134}
        return entry

    def _file(self, request: Request, repo: FakeRepo, hub_file: HubFile, head: bool) -> Any:
        request.setHeader(b"X-Repo-Commit", repo.commit.encode())
        request.setHeader(b"ETag", f'"{hub_file.etag}"'.encode())
        if hub_file.sha256 is not None:
            request.setHeader(b"X-Linked-Etag", f'"{hub_file.sha256}"'.encode())
            request.setHeader(b"X-Linked-Size", str(hub_file.size).encode())
        request.setHeader(b"Accept-Ranges", b"bytes")
        request.setHeader(b"Content-Type", b"application/octet-stream")
        start, end = 0, hub_file.size - 1
        asked = request.getHeader(b"range")
        if not head:
            self._hub.ranges.append((hub_file.path, asked.decode("latin-1") if asked else None))
        if asked:
            found = _RANGE.fullmatch(asked.decode("latin-1").strip())
            if found is None or int(found.group(1)) >= max(1, hub_file.size):
                request.setHeader(b"Content-Range", f"bytes */{hub_file.size}".encode())
                return self._error(request, 416, None, "range not satisfiable")
            start = int(found.group(1))
            end = min(int(found.group(2)), end) if found.group(2) else end
            request.setResponseCode(206)
            request.setHeader(b"Content-Range", f"bytes {start}-{end}/{hub_file.size}".encode())
        length = end - start + 1
        request.setHeader(b"Content-Length", str(length).encode())
        if head:
            return b""
        handle = hub_file.source.open("rb")
        handle.seek(start)
        cut = self._hub.interrupt.pop(hub_file.path, None)

        def count(n: int) -> None:
            self._hub.served[hub_file.path] = self._hub.served.get(hub_file.path, 0) + n

        _Body(request, handle, length, cut, count).start()
        return NOT_DONE_YET


def listen(reactor: Any, hub: FakeHub, port: int = 0, interface: str = "127.0.0.1") -> Any:
    """
    Listen for C{hub} on loopback; the listening port (C{getHost().port}).
    """
    return reactor.listenTCP(port, hub.site(), interface=interface)


def _parse_repo(text: str) -> tuple[str, str, Path]:
    spec, _, folder = text.partition("=")
    repo, _, commit = spec.partition("@")
    if not (repo and commit and folder):
        raise argparse.ArgumentTypeError(f"a repo is OWNER/NAME@COMMIT=FOLDER, not {text!r}")
    return repo, commit, Path(folder)


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> None:
    """
    Serve the folders named on the command line until killed.
    """
    parser = argparse.ArgumentParser(prog="python -m rhapsode_worker.fakehub")
    parser.add_argument("--repo", action="append", type=_parse_repo, default=[], required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--token", default=None)
    args = parser.parse_args(argv)
    hub = FakeHub(token=args.token)
    for repo, commit, folder in args.repo:
        hub.add(FakeRepo.from_folder(repo, commit, folder))

    def run(reactor: Any) -> Deferred[None]:
        port = listen(reactor, hub, args.port)
        print(json.dumps({"endpoint": f"http://127.0.0.1:{port.getHost().port}"}), flush=True)
        return Deferred()

    react(run)


if __name__ == "__main__":
    main(sys.argv[1:])
