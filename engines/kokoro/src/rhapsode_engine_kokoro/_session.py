"""
The onnxruntime session the Kokoro graph runs on: the SDK's, on as many threads as the
core budget has free (L{rhapsode_worker.onnx.BudgetedSession}), keeping no memory between
requests.

Imported by a load only, so that a worker answers its handshake, lists voices and makes
them without paying for onnxruntime.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping

from rhapsode_worker.onnx import BudgetedSession

#: The run option that makes the CPU arena hand back, when a run ends, the chunks it freed.
_SHRINK_ARENA = "memory.enable_memory_arena_shrinkage"


class Shrinking:
    """
    Which of a worker's runs give the arena back: those of a request's last segment, not
    those between its segments.  Shrinking after every run made each of a long text's
    segments map its ~600 MiB of activations afresh: ~2000 characters in 400-character
    segments took the worker 79.0-82.6 s of CPU against 77.5-78.7 s shrinking only at the
    end (two runs a side, interleaved; kokoro-onnx itself took 75.8-80.2 s).

    L{owed} says when the arena may be larger than a shrink would leave it: after a
    segment that was not a request's last (its request cut short would leave it so),
    after a failed run, and after a last segment that ended while another request's was
    running.  The adapter's C{rest()}, once the worker has been idle a while, settles it
    with a small run that shrinks.
    """

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self._running = 0
        #: Whether the arena may hold more than the runs in progress need.
        self.owed = False

    @contextmanager
    def segment(self, last: bool) -> Iterator[None]:
        """
        Around one segment's runs on this thread: C{last} if it is its request's last.
        """
        self._local.last = last
        with self._lock:
            self._running += 1
        settled = False
        try:
            yield
            settled = last
        finally:
            self._local.last = True
            with self._lock:
                self._running -= 1
                # A shrink at the end of a run frees only what no other run holds.
                self.owed = not (settled and self._running == 0)

    def run_config(self) -> Mapping[str, str]:
        """
        The run options of the run about to start on this thread.
        """
        return {_SHRINK_ARENA: "cpu:0"} if getattr(self._local, "last", True) else {}


def shrinking_session(path: Path, environ: Mapping[str, str] | None, shrinking: Shrinking) -> BudgetedSession:
    """
    A CPU session whose runs give their working memory back to the system at the end of
    a request (L{Shrinking}).

    A run's activations grow with the audio it renders, about 1.5 MiB per character of
    text, and onnxruntime's arena otherwise keeps its largest size for the life of the
    session: a worker that had spoken 190-character segments stayed at about 700 MiB,
    where shrinking brings it back to about 350 MiB.  With two generations at once the
    two runs' needs add up while they overlap (a peak of about 940 MiB for two
    190-character segments, 1.75 GiB for two ~2000-character texts in the adapter's
    400-character segments) and are not kept afterwards.  The budget's second session
    (one thread, beside the whole budget's) would hold the graph a second time (139 MiB),
    so the SDK makes it only when two runs first overlap: a worker at rest measured 481
    MiB with both, on a shared 2-core box.
    """
    # kokoro-onnx calls run(None, inputs) and has no way to pass options of its own.
    return BudgetedSession(path, run_config=shrinking.run_config, environ=environ)
