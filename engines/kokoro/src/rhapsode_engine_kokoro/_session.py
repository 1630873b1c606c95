"""
The onnxruntime session the Kokoro graph runs on: the SDK's, on as many threads as the
core budget has free (L{rhapsode_worker.onnx.BudgetedSession}), keeping no memory between runs.

Imported by a load only, so that a worker answers its handshake, lists voices and makes
them without paying for onnxruntime.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from rhapsode_worker.onnx import BudgetedSession

#: The run option that makes the CPU arena hand back, when a run ends, the chunks it freed.
_SHRINK_ARENA = "memory.enable_memory_arena_shrinkage"


def shrinking_session(path: Path, environ: Mapping[str, str] | None = None) -> BudgetedSession:
    """
    A CPU session whose every run gives its working memory back to the system at its end.

    A run's activations grow with the audio it renders, about 1.5 MiB per character of
    text, and onnxruntime's arena otherwise keeps its largest size for the life of the
    session: a worker that had spoken 190-character segments stayed at about 700 MiB,
    where shrinking brings it back to about 350 MiB after every run.  The cost is the
    kernel mapping those pages afresh for every run: 1.2 s more system time over a
    2000-character text that takes 73 s, within the noise of its wall-clock time.  With
    two generations at once the two runs' needs add up while they overlap (a peak of
    about 940 MiB for two 190-character segments, 1.75 GiB for two ~2000-character texts
    in the adapter's 400-character segments) and are not kept afterwards.  The
    budget's second session (one thread, beside the whole budget's) would hold the graph
    a second time (139 MiB), so the SDK makes it only when two runs first overlap: a
    worker at rest measured 481 MiB with both, on a shared 2-core box.
    """
    # kokoro-onnx calls run(None, inputs) and has no way to pass options of its own.
    return BudgetedSession(path, run_config={_SHRINK_ARENA: "cpu:0"}, environ=environ)
