"""
Weights from the Hugging Face hub, the way its users expect them (protocol.md section 8,
C{fetch}): through C{huggingface_hub}'s own client, at pinned revisions, into the hub's
own cache, verified.

A variant names its files as a L{HubSnapshot}: a repository, a revision (a commit, so
that the weights a release was tested with are the weights every box gets; a branch is
resolved by the first fetch and the hub's cache records what it resolved to), and the
file patterns it loads.  L{fetch} downloads what the cache lacks with C{snapshot_download}:

 - The cache is the hub's (C{HF_HUB_CACHE}, else C{HF_HOME/hub}, else
   C{$XDG_CACHE_HOME/huggingface/hub}, else C{~/.cache/huggingface/hub}): outside every
   virtualenv, so a reinstall keeps it, and shared with every other tool on the box.
 - The endpoint is C{HF_ENDPOINT} and the token C{HF_TOKEN}, else the token file the
   hub's own login wrote; C{HF_HUB_OFFLINE} is the client's to honour.
 - An interrupted transfer resumes: a body that ends short or a connection that
   times out is asked for again from where it stopped, with a C{Range} (the client's
   own retry, five times).  A fetch that fails leaves no partial file behind: the
   client (since 1.x) downloads into a name of its own per process and deletes it, so
   the next fetch starts that file again.
 - Progress is logged as C{Progress <bytes> of <total>}, the line an install job relays
   (as Kokoro's fetch does), at most once per percent.
 - Every file is checked against the hub's own record of it once downloaded: the SHA-256
   the hub lists for a large (LFS) file, the git blob id for a small one.  A file that
   does not match is deleted from the cache and the fetch fails, so a damaged download
   is never loaded and the next fetch downloads it again.

L{local} answers, without the network, where a complete snapshot already is.
C{huggingface_hub} is imported on call: it is the adapter's dependency, not the SDK's.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from twisted.logger import Logger

from rhapsode_protocol.errors import Internal, ModelUnavailable

__all__ = ["HubSnapshot", "fetch", "hub_cache", "local", "verify"]

log = Logger(namespace="rhapsode_worker.hub")

_CHUNK = 1 << 20


@dataclass(frozen=True)
class HubSnapshot:
    """
    The files of one variant on the hub.

    @ivar repo: C{owner/name}.
    @ivar revision: a 40-hex commit (pinned), or a branch or tag.
    @ivar files: the patterns of the files the variant loads (C{fnmatch}, as the
        client's C{allow_patterns}).
    """

    repo: str
    revision: str
    files: Sequence[str]
    repo_type: str = "model"

    @property
    def pinned(self) -> bool:
        return len(self.revision) == 40 and all(c in "0123456789abcdef" for c in self.revision)


def hub_cache(environ: Mapping[str, str] | None = None) -> Path:
    """
    The hub's cache folder, by the client's own rules.
    """
    environ = os.environ if environ is None else environ
    if environ.get("HF_HUB_CACHE"):
        return Path(environ["HF_HUB_CACHE"]).expanduser()
    if environ.get("HF_HOME"):
        return Path(environ["HF_HOME"]).expanduser() / "hub"
    base = Path(environ["XDG_CACHE_HOME"]) if environ.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def _client(environ: Mapping[str, str]) -> dict[str, Any]:
    # None lets the client read its own token file and default endpoint.
    return {
        "endpoint": environ.get("HF_ENDPOINT") or None,
        "token": environ.get("HF_TOKEN") or environ.get("HUGGING_FACE_HUB_TOKEN") or None,
    }


def local(snapshot: HubSnapshot, environ: Mapping[str, str] | None = None) -> Path | None:
    """
    The folder of a complete snapshot already in the cache, asking nothing of the
    network; None where it is missing or incomplete.  Blocks (it reads the disk).
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    environ = os.environ if environ is None else environ
    try:
        folder = snapshot_download(
            snapshot.repo, repo_type=snapshot.repo_type, revision=snapshot.revision,
            allow_patterns=list(snapshot.files), cache_dir=hub_cache(environ),
            local_files_only=True, **_client(environ),
        )
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        return None
    except Exception as error:  # an incomplete snapshot is an error of its own kind
        log.info("{repo}@{revision} is not complete in the cache: {error}", repo=snapshot.repo,
                 revision=snapshot.revision, error=str(error))
        return None
    return Path(folder)


def fetch(snapshot: HubSnapshot, environ: Mapping[str, str] | None = None) -> Path:
    """
    Blocking: the snapshot's folder in the cache, downloading and verifying what is
    missing.

    @raise ModelUnavailable: the hub cannot be reached (retryable).
    @raise Internal: the hub refuses (no such repository or revision, a gated
        repository without a token).
    @raise Internal: a downloaded file is not the file the hub lists.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    environ = os.environ if environ is None else environ
    client = _client(environ)
    where = f"{snapshot.repo}@{snapshot.revision}"
    log.info("fetching {where} ({files}) from {endpoint} into {cache}", where=where,
             files=", ".join(snapshot.files), endpoint=client["endpoint"] or "the hub",
             cache=str(hub_cache(environ)))
    progress = _Progress()
    try:
        folder = Path(snapshot_download(
            snapshot.repo, repo_type=snapshot.repo_type, revision=snapshot.revision,
            allow_patterns=list(snapshot.files), cache_dir=hub_cache(environ),
            tqdm_class=progress.bar, **client,
        ))
    except (RepositoryNotFoundError, GatedRepoError) as error:
        # Not retryable: the same request gets the same refusal until a token is given.
        raise Internal(f"the hub refuses {snapshot.repo}: {_first_line(error)}") from None
    except RevisionNotFoundError as error:
        raise Internal(f"{where}: no such revision on the hub: {_first_line(error)}") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as error:
        raise ModelUnavailable(f"fetching {where} failed: {_first_line(error)}") from None
    except Exception as error:
        # httpx's transport errors, which the client lets through.
        if type(error).__module__.startswith(("httpx", "httpcore")):
            raise ModelUnavailable(f"fetching {where} failed: {type(error).__name__}: "
                                   f"{_first_line(error)}") from None
        raise
    progress.finish()
    checked = verify(snapshot, folder, environ)
    log.info("{where} is in {folder}: {count} file(s), {size} bytes, verified", where=where,
             folder=str(folder), count=len(checked), size=sum(checked.values()))
    return folder


def verify(snapshot: HubSnapshot, folder: Path, environ: Mapping[str, str] | None = None) -> dict[str, int]:
    """
    Check every file of C{folder} (the snapshot at the commit it is named after) against
    the hub's listing of that commit; the sizes of the files checked, by path.  A file
    that does not match is deleted, blob and link.

    @raise Internal: a file does not match, or the listing names none of the patterns.
    """
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile
    from huggingface_hub.utils import filter_repo_objects

    environ = os.environ if environ is None else environ
    api = HfApi(**_client(environ))
    commit = folder.name
    entries = {
        entry.path: entry
        for entry in api.list_repo_tree(snapshot.repo, recursive=True, revision=commit,
                                        repo_type=snapshot.repo_type)
        if isinstance(entry, RepoFile)
    }
    wanted = list(filter_repo_objects(entries.keys(), allow_patterns=list(snapshot.files)))
    if not wanted:
        raise Internal(f"{snapshot.repo}@{commit} has no file matching {', '.join(snapshot.files)}")
    checked: dict[str, int] = {}
    for name in wanted:
        entry = entries[name]
        path = folder / name
        if entry.lfs is not None:
            expected, found = entry.lfs.sha256, _sha256(path)
        else:
            expected, found = entry.blob_id, _git_blob(path)
        if found != expected:
            target = path.resolve()
            path.unlink(missing_ok=True)
            target.unlink(missing_ok=True)
            raise Internal(f"{snapshot.repo}@{commit}: {name} came out as {found}, not the hub's "
                           f"{expected}; deleted, and the next fetch downloads it again")
        checked[name] = path.stat().st_size
    return checked


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _git_blob(path: Path) -> str:
    # The id git gives a file: SHA-1 over "blob <size>\0" and the bytes.
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with path.open("rb") as handle:
        while block := handle.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


class _Progress:
    """
    A progress bar class for the client that logs instead of drawing: C{Progress <bytes>
    of <total>} for the bytes of a snapshot, at most once per percent and at the end.

    The client makes several bars of bytes (what it received, what it wrote) counting
    the same download, and one of files; the most advanced byte bar is the one reported.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bars: list[_Bar] = []
        self._said = (-1, -1)
        self._when = 0.0
        progress = self

        class Bar(_Bar):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(progress, *args, **kwargs)

        self.bar = Bar

    def add(self, bar: "_Bar") -> None:
        with self._lock:
            self._bars.append(bar)

    def moved(self, final: bool = False) -> None:
        with self._lock:
            bytes_bars = [bar for bar in self._bars if bar.unit == "B" and bar.total]
            if not bytes_bars:
                return
            best = max(bytes_bars, key=lambda bar: (bar.n, bar.total))
            done, total = int(best.n), int(best.total or 0)
            step = max(1, total // 100)
            now = time.monotonic()
            if (done, total) == self._said:
                return
            if not final and done < total and done - max(self._said[0], 0) < step and now - self._when < 5:
                return
            self._said, self._when = (done, total), now
        log.info("Progress {done} of {total}", done=done, total=total)

    def finish(self) -> None:
        self.moved(final=True)


class _Bar:
    """
    Enough of C{tqdm}'s face for the client: made with a total, told of updates,
    entered and closed, iterated where it wraps an iterable (the files bar).
    """

    def __init__(self, progress: _Progress, iterable: Any = None, *args: Any, **kwargs: Any) -> None:
        self._progress = progress
        self.iterable = iterable
        self.unit = kwargs.get("unit", "it")
        self.total = kwargs.get("total")
        self.n = kwargs.get("initial", 0) or 0
        self.desc = kwargs.get("desc", "")
        self.disable = False
        progress.add(self)

    def __iter__(self) -> Any:
        for item in self.iterable if self.iterable is not None else ():
            self.update(1)
            yield item

    def __enter__(self) -> "_Bar":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __len__(self) -> int:
        return int(self.total or 0)

    def update(self, n: float | None = 1) -> None:
        self.n += n or 0
        self._progress.moved()

    def refresh(self, *args: Any, **kwargs: Any) -> None:
        self._progress.moved()

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        self.desc = desc or ""

    def set_description_str(self, desc: str | None = None, refresh: bool = True) -> None:
        self.desc = desc or ""

    def set_postfix_str(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_postfix(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        # Whatever else a newer client asks of a bar is drawing, which this one does not.
        if name.startswith("set_") or name in ("clear", "display", "unpause", "moveto"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    def reset(self, total: float | None = None) -> None:
        self.n = 0
        if total is not None:
            self.total = total

    def close(self) -> None:
        pass
