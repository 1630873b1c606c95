"""Shared test configuration."""

# tests/trial runs under `python -m twisted.trial` (make test), as a Twisted program's own
# suite would: trial checks the global reactor is clean after each test, which in one
# pytest process would also count what every earlier test left on it.
collect_ignore = ["trial"]

import atexit
import shutil
import tempfile

from hypothesis import settings
from hypothesis.configuration import set_hypothesis_home_dir

# Tests write only under temporary folders: Hypothesis keeps its example database and its
# caches in ./.hypothesis by default, which would be inside the tree; this run's go in a
# folder of its own, removed when the run ends.
_HYPOTHESIS_HOME = tempfile.mkdtemp(prefix="rhapsode-hypothesis-")
set_hypothesis_home_dir(_HYPOTHESIS_HOME)
atexit.register(shutil.rmtree, _HYPOTHESIS_HOME, True)

# No example may fail for taking long: Hypothesis's default deadline (200 ms an example)
# is a wall-clock bound, which a busy box passes or not by chance.  A timing is a bench
# figure; a test bounds time only as a hang guard.
settings.register_profile("rhapsode", deadline=None)
settings.load_profile("rhapsode")
