"""
The remote engine's modules for tests that run in the core's virtualenv, and what a
vLLM-Omni server sends, as those tests write it.

The adapter's package is not installed there (its Engine reads the installed
distribution's version), so its modules are loaded under an empty package; the ones
loaded import nothing of the engine but Twisted and the SDK.
"""

from __future__ import annotations

import base64
import importlib.machinery
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[1] / "engines" / "remote" / "src" / "rhapsode_engine_remote"


def load(*modules: str) -> tuple[Any, ...]:
    """
    The adapter's private C{modules} (C{"_config"}, ...), in order, loaded from the tree.
    """
    name = "rhapsode_engine_remote"
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    package = importlib.util.module_from_spec(spec)
    package.__path__ = [str(SRC)]
    saved = sys.modules.get(name)
    sys.modules[name] = package
    try:
        loaded = []
        for module in modules:
            module_spec = importlib.util.spec_from_file_location(f"{name}.{module}", SRC / f"{module}.py")
            assert module_spec is not None and module_spec.loader is not None
            found = importlib.util.module_from_spec(module_spec)
            sys.modules[f"{name}.{module}"] = found
            module_spec.loader.exec_module(found)
            loaded.append(found)
        return tuple(loaded)
    finally:
        for module in modules:
            sys.modules.pop(f"{name}.{module}", None)
        if saved is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = saved


def event(kind: str, **more: Any) -> bytes:
    """One server-sent event of vLLM-Omni's speech API."""
    return b"event: " + kind.encode() + b"\ndata: " + json.dumps({"type": kind, **more}).encode() + b"\n\n"


def delta(pcm: bytes) -> bytes:
    """A speech.audio.delta carrying C{pcm}."""
    return event("speech.audio.delta", audio=base64.b64encode(pcm).decode(), response_format="pcm")


DONE = event("speech.audio.done", usage={})


def pcm_of(n: int, size: int = 4800) -> bytes:
    """C{size} bytes of PCM told apart by C{n}."""
    return bytes([n % 256, 0]) * (size // 2)
