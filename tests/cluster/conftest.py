"""
The cluster tests run in their own virtualenv (.venvs/cluster, the core with its cluster
extra: Ray), by `make test` after the main suite; without Ray they are skipped.
"""

import pytest

ray = pytest.importorskip("ray", reason="Ray is the cluster extra: `make cluster-venv` installs it")
