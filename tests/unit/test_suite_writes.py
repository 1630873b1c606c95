"""
The suite writes only under temporary folders (issue 23, section 7): what the test tools
themselves keep between examples goes outside the repository too.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st
from hypothesis.configuration import storage_directory

ROOT = Path(__file__).resolve().parents[2]


@given(st.integers())
def test_hypothesis_keeps_its_examples_and_caches_under_a_temporary_folder(number: int) -> None:
    """
    Hypothesis's storage (its example database and its caches, ./.hypothesis by default)
    is a folder under the system's temporary one, not in the tree, while it runs.
    """
    home = storage_directory(intent_to_write=False).home_directory.resolve()
    assert home.is_relative_to(Path(tempfile.gettempdir()).resolve()), home
    assert not home.is_relative_to(ROOT), home
    assert not (ROOT / ".hypothesis").exists()
