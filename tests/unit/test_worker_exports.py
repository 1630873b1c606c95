"""
The worker SDK's public surface, pinned: the face (C{rhapsode_worker}) lists exactly what
an engine author needs, each name the very object of the module that defines it; what
serves one family of engines lives in a public module of its own; and importing any of
them loads no torch, onnxruntime or numpy.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from typing import Any

import pytest

import rhapsode_worker
import rhapsode_worker.arrays
import rhapsode_worker.onnx
import rhapsode_worker.testing
from rhapsode_protocol import errors, spawn, text, vocab
from rhapsode_worker import _arrays, _context, _engine, _store, _threads

#: Each public module's names, each with the module that defines it (None: the public
#: module itself).
SURFACE: dict[Any, dict[str, Any]] = {
    rhapsode_worker: {
        "ALL_CUES": vocab,
        "ALL_DELIVERIES": vocab,
        "BadRequest": errors,
        "Conflict": errors,
        "Dial": _engine,
        "DialogueRequest": _engine,
        "Engine": _engine,
        "Forbidden": errors,
        "IEngine": _engine,
        "Instructions": _engine,
        "Internal": errors,
        "License": _engine,
        "ModelUnavailable": errors,
        "NativeFormat": _engine,
        "OutOfMemory": errors,
        "Overloaded": errors,
        "Reference": _engine,
        "Remote": _engine,
        "SpeakRequest": _engine,
        "SpeechError": errors,
        "Speed": _engine,
        "Timestamps": _engine,
        "Timing": _engine,
        "Turn": _engine,
        "UnknownEngine": errors,
        "UnknownVoice": errors,
        "Unsupported": errors,
        "Variant": _engine,
        "Voice": _engine,
        "VoiceStore": _store,
        "WorkerContext": _context,
        "__version__": None,
        "clean_text": vocab,
        "serve": None,
        "split_text": text,
    },
    rhapsode_worker.onnx: {
        "BudgetedSession": _threads,
        "CORES_VARIABLE": spawn,
        "CORE_DIR_VARIABLE": spawn,
        "CoreGate": _threads,
        "core_budget": _threads,
        "machine_cores": spawn,
    },
    rhapsode_worker.arrays: {
        "FloatArray": _arrays,
        "read_npy": _arrays,
        "read_pt": _arrays,
        "read_voicepack": _arrays,
    },
    rhapsode_worker.testing: {
        "MemoryWorkerReactor": None,
        "SynchronousPool": None,
        "WorkerHarness": None,
        "WorkerResponse": None,
    },
}


@pytest.mark.parametrize("module", list(SURFACE), ids=lambda m: m.__name__)
def test_all_is_exactly_the_surface(module: Any) -> None:
    """
    Each public module's C{__all__} is exactly the names pinned here, no more and no
    fewer, so a name cannot join or leave the surface unnoticed.
    """
    assert sorted(module.__all__) == sorted(SURFACE[module])


@pytest.mark.parametrize(
    ("module", "name"),
    [(m, n) for m, names in SURFACE.items() for n in names if names[n] is not None],
    ids=lambda x: x if isinstance(x, str) else x.__name__,
)
def test_each_name_is_the_object_it_re_exports(module: Any, name: str) -> None:
    """
    A re-exported name is the defining module's object itself, not a copy or a wrapper.
    """
    assert getattr(module, name) is getattr(SURFACE[module][name], name)


@pytest.mark.parametrize(
    ("module", "name"),
    [(m, n) for m, names in SURFACE.items() for n in names if names[n] is None and n != "__version__"],
    ids=lambda x: x if isinstance(x, str) else x.__name__,
)
def test_each_own_name_is_defined_where_it_is_exported(module: Any, name: str) -> None:
    """
    A name pinned as the public module's own is defined there, not re-exported.
    """
    assert getattr(module, name).__module__ == module.__name__


def test_the_face_defines_serve_and_carries_the_release_version() -> None:
    """
    C{serve} is the face's own (it imports the runtime only when called), and
    C{rhapsode_worker.__version__} is the version the protocol was released at.
    """
    import rhapsode_protocol

    assert rhapsode_worker.serve.__module__ == "rhapsode_worker"
    assert rhapsode_worker.__version__ == rhapsode_protocol.__version__


def test_the_face_is_about_twenty_names_and_no_family_helper() -> None:
    """
    What serves one family of engines (ONNX sessions, voicepack readers) or an engine's
    tests is not on the face, and the face holds no private name.
    """
    family = set(rhapsode_worker.onnx.__all__) | set(rhapsode_worker.arrays.__all__)
    family |= set(rhapsode_worker.testing.__all__)
    assert not family & set(rhapsode_worker.__all__)
    assert not [n for n in rhapsode_worker.__all__ if n.startswith("_") and n != "__version__"]
    for name in family:
        assert not hasattr(rhapsode_worker, name), name


def test_importing_the_sdk_loads_no_framework() -> None:
    """
    In a fresh interpreter, importing the face and every public module of the SDK loads
    no torch, onnxruntime or numpy: a worker answers its handshake without them.
    """
    probe = (
        "import sys\n"
        "import rhapsode_worker, rhapsode_worker.onnx, rhapsode_worker.arrays, rhapsode_worker.testing\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'onnxruntime', 'numpy')))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_every_public_module_is_importable_by_name() -> None:
    """
    The public modules import on their own, by the names the docs give them.
    """
    for name in ("rhapsode_worker.onnx", "rhapsode_worker.arrays", "rhapsode_worker.testing"):
        assert importlib.import_module(name).__all__
