"""
The onnxruntime session the Kokoro graph runs on: how many threads, and what memory it keeps.

Imported by a load only, so that a worker answers its handshake, lists voices and makes
them without paying for onnxruntime.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import onnxruntime

#: The run option that makes the CPU arena hand back, when a run ends, the chunks it freed.
_SHRINK_ARENA = "memory.enable_memory_arena_shrinkage"


class ShrinkingSession(onnxruntime.InferenceSession):
    """
    A CPU session whose every run gives its working memory back to the system at its end.

    A run's activations grow with the audio it renders, about 1.5 MiB per character of
    text, and onnxruntime's arena otherwise keeps its largest size for the life of the
    session: a worker that had spoken 190-character segments stayed at about 700 MiB,
    where shrinking brings it back to about 350 MiB after every run.  The cost is the
    kernel mapping those pages afresh for every run: 1.2 s more system time over a
    2000-character text that takes 73 s, within the noise of its wall-clock time.  With
    two generations at once the two runs' needs add up while they overlap (a peak of
    about 940 MiB for two 190-character segments) and are not kept afterwards.
    """

    def __init__(self, path: Path, threads: int) -> None:
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        super().__init__(str(path), options, providers=["CPUExecutionProvider"])
        self._shrinking = onnxruntime.RunOptions()
        self._shrinking.add_run_config_entry(_SHRINK_ARENA, "cpu:0")

    def run(
        self,
        output_names: Sequence[str] | None,
        input_feed: dict[str, Any],
        run_options: onnxruntime.RunOptions | None = None,
    ) -> list[Any]:
        # kokoro-onnx calls run(None, inputs) and has no way to pass options of its own.
        return super().run(output_names, input_feed, run_options or self._shrinking)
