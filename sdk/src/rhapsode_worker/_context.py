"""
L{WorkerContext}: what a worker was given at spawn (protocol.md section 2), handed to
the engine as it is made, so that an adapter reads where to keep things rather than the
SDK writing into it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from rhapsode_protocol.spawn import ENGINE_VARIABLE, VOICE_DIR_VARIABLE

from ._threads import core_budget


@dataclass(frozen=True)
class WorkerContext:
    """
    Where this worker keeps what it makes and fetches, and the cores it may use.

    @ivar voice_dir: the folder for the voices the engine creates (the core sets it,
        C{RHAPSODE_WORKER_VOICE_DIR}); the core keeps no copy.  A L{VoiceStore} there
        writes each voice whole or not at all.
    @ivar cache_dir: the folder for weights and anything else fetched, outside the
        virtualenv so a reinstall keeps it: C{$XDG_CACHE_HOME/rhapsode/<engine id>}, else
        C{~/.cache/rhapsode/<engine id>}.  Nothing creates it until the engine writes.
    @ivar environ: the environment the worker was spawned with, for the engine's own
        settings (and L{rhapsode_worker.onnx.BudgetedSession}'s C{environ}).
    """

    voice_dir: Path
    cache_dir: Path
    environ: Mapping[str, str] = field(default_factory=dict, repr=False)

    @property
    def cores(self) -> int:
        """
        How many cores this worker's generations may use at once, all of them together:
        C{RHAPSODE_WORKER_CORES}, else every core this process may run on.  ONNX engines
        share them through L{rhapsode_worker.onnx.BudgetedSession}; anything else that
        runs threads should run no more than this.

        @raise ValueError: naming the variable, when it is not a positive integer (read
            when asked, so a bad budget fails the load that needs it, as a session does).
        """
        return core_budget(self.environ)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], engine_id: str) -> "WorkerContext":
        """
        The context the spawn contract's variables describe, for the engine C{engine_id}.

        The default voice folder is named after the id the core spawned the worker as
        (C{RHAPSODE_WORKER_ENGINE}, which may differ from C{engine_id}: one engine
        registered twice keeps two sets of voices); the cache is the engine's own, shared
        by every registration of it.
        """
        name = environ.get(ENGINE_VARIABLE) or engine_id
        data = Path(environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
        voice_dir = Path(environ.get(VOICE_DIR_VARIABLE) or data / "rhapsode" / "voices" / name)
        cache = Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        return cls(
            voice_dir=voice_dir,
            cache_dir=cache / "rhapsode" / engine_id,
            environ=dict(environ),
        )
