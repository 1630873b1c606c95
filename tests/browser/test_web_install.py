"""
Installing an engine from the Engines page (protocol.md section 10) against a real
core with nothing configured: the job's events drive the progress bar to done, and the
catalog then says the engine is installed by this API.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from _browser import HANG_GUARD_MS, ROOT, Page, Served, call, serve


@pytest.fixture()
def empty(tmp_path: Path) -> Iterator[Served]:
    """A core with no engines, installing into a folder of the test's own from this checkout."""
    running = serve(tmp_path, {}, install={"venvDir": str(tmp_path / "venvs"), "sourceDir": str(ROOT / "engines")})
    yield running
    running.stop()


def test_install_from_the_page_reaches_done(empty: Served, page: Page) -> None:
    """
    Install on the tone row starts a job whose progress bar, fed by its event stream,
    reaches its maximum with the job marked succeeded; the core then lists tone as
    installed and managed, the page offers to uninstall it, and the finished job is a
    row of the Jobs table.
    """
    p = page.open(empty.web, "engines")
    p.get_by_role("button", name="Install Tone").click()
    card = p.locator("#jobs .card").first
    card.wait_for(timeout=HANG_GUARD_MS)
    state = card.locator("output")
    p.wait_for_function(
        "() => ['succeeded', 'failed'].includes(document.querySelector('#jobs .card output').dataset.state)",
        timeout=240000,
    )
    assert state.get_attribute("data-state") == "succeeded", card.inner_text()
    bar = card.locator("progress")
    assert float(bar.get_attribute("max") or 0) > 1
    assert bar.evaluate("b => b.value === b.max")
    assert "register" in card.inner_text()
    _, catalog = call(empty.core, "GET", "/catalog")
    tone = next(e for e in catalog if e["id"] == "tone")
    assert (tone["installed"], tone["managed"]) == ("yes", True)
    p.get_by_role("button", name="Uninstall tone").wait_for(timeout=HANG_GUARD_MS)
    # The job just finished is in the Jobs table, as GET /installs lists it.
    row = p.locator("section[aria-labelledby=jobs-heading] table tr", has_text="succeeded")
    row.wait_for(timeout=HANG_GUARD_MS)
    assert "install" in row.inner_text() and "tone" in row.inner_text()
    page.screenshot("engines-install")
    assert page.errors == []
