"""
torchaudio beside a torch it was not built for, its pure-Python half only.

torchaudio's wheels carry native extensions linked against one torch release (2.11's
against torch 2.11 and CUDA); beside torch 2.13, the CPU build this adapter installs on a
box without a card, loading them fails and takes the import of torchaudio with it.
chatterbox-tts uses none of the native parts: its resampler (C{transforms.Resample}), the
x-vector's filterbank (C{compliance.kaldi}) and the Perth watermarker's spectrograms
(C{Spectrogram}, C{InverseSpectrogram}, C{TimeStretch}) are torch code.

torchaudio already runs without its extensions where it cannot find them (its loader
returns False for a library file that is absent, the case of a pex deployment), so
L{install} makes it look in a folder that does not exist: a finder on C{sys.meta_path}
loads C{torchaudio._extension.utils} as usual, then points its C{_LIB_DIR} elsewhere.
No installed file is changed, and nothing happens where torchaudio matches torch (a box
with the adapter's own pinned stack).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import ModuleType
from typing import Any, Sequence

_TARGET = "torchaudio._extension.utils"


def _release(distribution: str) -> tuple[int, int] | None:
    try:
        parts = version(distribution).split("+")[0].split(".")
        return int(parts[0]), int(parts[1])
    except (PackageNotFoundError, ValueError, IndexError):
        return None


def mismatched() -> bool:
    """
    Whether the installed torchaudio was built for another torch release.
    """
    audio, torch = _release("torchaudio"), _release("torch")
    return audio is not None and torch is not None and audio != torch


class _Loader(importlib.abc.Loader):
    def __init__(self, real: importlib.abc.Loader) -> None:
        self._real = real

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._real.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._real.exec_module(module)
        module._LIB_DIR = Path(module.__file__ or ".").parent / "no-native-build-for-this-torch"  # type: ignore[attr-defined]


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Sequence[str] | None = None, target: Any = None) -> Any:
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> bool:
    """
    Before torchaudio is imported: keep it to its Python half where it does not match
    torch.  Whether it did; idempotent.
    """
    if not mismatched() or any(isinstance(f, _Finder) for f in sys.meta_path):
        return False
    if "torchaudio" in sys.modules:
        raise RuntimeError("torchaudio was imported before its native half could be left out")
    sys.meta_path.insert(0, _Finder())
    return True
