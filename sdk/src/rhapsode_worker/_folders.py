"""
Where a worker keeps what it makes for its next start (optimised graphs, what it learnt
of the machine), beside the engines' own caches.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping


def cache_home(environ: Mapping[str, str]) -> Path:
    """
    C{$XDG_CACHE_HOME/rhapsode} when that variable is an absolute path (as the XDG base
    directory specification asks), else C{~/.cache/rhapsode}.
    """
    base = environ.get("XDG_CACHE_HOME", "")
    return (Path(base) if os.path.isabs(base) else Path.home() / ".cache") / "rhapsode"
