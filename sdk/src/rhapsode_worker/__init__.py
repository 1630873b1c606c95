"""
The Rhapsode worker SDK: write one class, call L{serve}, and the SDK speaks the protocol.

This module is the engine author's face; an ONNX adapter builds its sessions with
L{BudgetedSession}, which shares the cores the core gives its workers (L{_threads}).
What the core and the workers share (the error taxonomy, the vocabulary, the contract,
the HTTP server both listen with) is the protocol's (C{rhapsode_protocol}), which this
SDK builds on; the errors an adapter raises are re-exported here.
"""

from typing import Mapping, NoReturn

from rhapsode_protocol import __version__
from rhapsode_protocol.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    Internal,
    ModelUnavailable,
    OutOfMemory,
    Overloaded,
    SpeechError,
    UnknownEngine,
    UnknownVoice,
    Unsupported,
)
from rhapsode_protocol.spawn import CORE_DIR_VARIABLE, CORES_VARIABLE, machine_cores
from rhapsode_protocol.text import split_text
from rhapsode_protocol.vocab import ALL_CUES, ALL_DELIVERIES, clean_text

from ._arrays import FloatArray, read_npy, read_pt, read_voicepack
from ._engine import (
    Dial,
    DialogueRequest,
    Engine,
    IEngine,
    License,
    NativeFormat,
    Reference,
    SpeakRequest,
    Turn,
    Variant,
    Voice,
)
from ._threads import BudgetedSession, CoreGate, core_budget


def serve(engine: IEngine, environ: "Mapping[str, str] | None" = None) -> "NoReturn":
    """
    Serve C{engine} under the spawn contract (see L{rhapsode_worker._runtime}).

    Imported on call, so that importing the SDK to declare an adapter stays light.
    """
    from ._runtime import serve as run

    run(engine, environ)

__all__ = [
    "CORES_VARIABLE",
    "CORE_DIR_VARIABLE",
    "machine_cores",
    "ALL_CUES",
    "ALL_DELIVERIES",
    "BadRequest",
    "BudgetedSession",
    "Conflict",
    "CoreGate",
    "Dial",
    "DialogueRequest",
    "Engine",
    "FloatArray",
    "Forbidden",
    "IEngine",
    "Internal",
    "License",
    "ModelUnavailable",
    "NativeFormat",
    "OutOfMemory",
    "Overloaded",
    "Reference",
    "SpeakRequest",
    "SpeechError",
    "Turn",
    "UnknownEngine",
    "UnknownVoice",
    "Unsupported",
    "Variant",
    "Voice",
    "__version__",
    "clean_text",
    "core_budget",
    "read_npy",
    "read_pt",
    "read_voicepack",
    "serve",
    "split_text",
]
