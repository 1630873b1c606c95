"""
The Rhapsode worker SDK: write one class, call L{serve}, and the SDK speaks the protocol.

This module is the engine author's face; an ONNX adapter builds its sessions with
L{BudgetedSession}, which shares the cores the core gives its workers (L{_threads}).
The SDK also owns what the core and the workers share, each a public module of its
own: the error taxonomy (L{errors}), the vocabulary (L{vocab}), the contract
(L{contract}: L{schemas}, L{validation}, L{openapi}) and the HTTP helpers both
processes serve with (L{web}, L{site}).
"""

from typing import Mapping, NoReturn

from ._arrays import FloatArray, read_npy, read_pt, read_voicepack
from ._engine import (
    DialogueRequest,
    Dial,
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
from ._split import split_text
from ._threads import CORE_DIR_VARIABLE, CORES_VARIABLE, BudgetedSession, CoreGate, core_budget, machine_cores
from .errors import (
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
from .vocab import ALL_CUES, ALL_DELIVERIES, clean_text

__version__ = "0.1.0"


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
