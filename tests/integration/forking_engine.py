"""
A test adapter that starts a child process of its own when it loads, as an engine
running a helper server or a compiler pool does, so that the supervisor's process-group
handling can be checked.  Run as C{python -m forking_engine} with this folder on
PYTHONPATH; it writes the child's pid to the file named by C{FORKING_PID_FILE}.  With
C{FORKING_NEW_SESSION} set the child starts a session of its own (as a daemonising
helper does), so it escapes the worker's process group, and it keeps the worker's stdout
and stderr open.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Iterator

from rhapsode_worker import Engine, License, NativeFormat, SpeakRequest, Variant, WorkerContext, serve


class ForkingEngine(Engine):
    id = "forking"
    display_name = "Forking"
    license = License(code="MIT", weights="MIT", weights_commercial_use=True, notes="test adapter")
    native_format = NativeFormat(sample_rate=16000)
    default_variant = "only"

    def __init__(self, context: WorkerContext) -> None:
        super().__init__(context)
        self.helper: subprocess.Popen[bytes] | None = None

    def variants(self) -> dict[str, Variant]:
        return {"only": Variant(languages=("en",))}

    def load(self, variant: str) -> None:
        # The helper inherits the worker's stdout and stderr, as Popen's children do.
        alone = bool(os.environ.get("FORKING_NEW_SESSION"))
        self.helper = subprocess.Popen(["sleep", "60"], start_new_session=alone)
        Path(os.environ["FORKING_PID_FILE"]).write_text(str(self.helper.pid))

    def unload(self) -> None:
        pass

    def speak(self, request: SpeakRequest) -> Iterator[bytes]:
        yield b"\x00\x00" * 1600


if __name__ == "__main__":
    serve(ForkingEngine)
