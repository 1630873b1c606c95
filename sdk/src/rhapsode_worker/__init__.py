"""
The Rhapsode worker SDK: write one class, call L{serve}, and the SDK speaks the protocol.

This module is the engine author's face: what every adapter needs, and nothing more.
What serves one family of engines has a public module of its own:
L{rhapsode_worker.onnx} (the onnxruntime session that shares the core's cores) and
L{rhapsode_worker.arrays} (voicepacks read as data).  What the core and the workers
share (the error taxonomy, the vocabulary, the contract, the HTTP server both listen
with) is the protocol's (C{rhapsode_protocol}), which this SDK builds on; the errors an
adapter raises are re-exported here.
"""

from typing import Callable, Mapping, NoReturn

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
from rhapsode_protocol.text import split_text
from rhapsode_protocol.vocab import ALL_CUES, ALL_DELIVERIES, clean_text

from ._context import WorkerContext
from ._engine import (
    Dial,
    DialogueRequest,
    Engine,
    IEngine,
    Instructions,
    License,
    NativeFormat,
    Reference,
    Remote,
    SpeakRequest,
    Speed,
    Timestamps,
    Timing,
    Turn,
    Variant,
    Voice,
)
from ._store import VoiceStore


def serve(
    factory: "Callable[[WorkerContext], IEngine]", environ: "Mapping[str, str] | None" = None
) -> "NoReturn":
    """
    Make the engine with this worker's L{WorkerContext} and serve it under the spawn
    contract (see L{rhapsode_worker._runtime}): C{serve(MyEngine)}.

    Imported on call, so that importing the SDK to declare an adapter stays light.
    """
    from ._runtime import serve as run

    run(factory, environ)

__all__ = [
    "ALL_CUES",
    "ALL_DELIVERIES",
    "BadRequest",
    "Conflict",
    "Dial",
    "DialogueRequest",
    "Engine",
    "Forbidden",
    "IEngine",
    "Instructions",
    "Internal",
    "License",
    "ModelUnavailable",
    "NativeFormat",
    "OutOfMemory",
    "Overloaded",
    "Reference",
    "Remote",
    "SpeakRequest",
    "SpeechError",
    "Speed",
    "Timestamps",
    "Timing",
    "Turn",
    "UnknownEngine",
    "UnknownVoice",
    "Unsupported",
    "Variant",
    "Voice",
    "VoiceStore",
    "WorkerContext",
    "__version__",
    "clean_text",
    "serve",
    "split_text",
]
