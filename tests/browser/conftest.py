"""
Fixtures for the web page's tests in a real browser (tests/browser/_browser.py has the
helpers); every test here is marked `browser`, so `-m "not browser"` runs the rest.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _browser import HANG_GUARD_MS, LAUNCH_ARGS, TONE_PYTHON, Page, Served, chromium_path, screenshot_folder, serve


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).parent == Path(__file__).parent:
            item.add_marker(pytest.mark.browser)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A core with the tone engine, from .venvs/tone, and the page in front of it."""
    if not TONE_PYTHON.exists():
        pytest.fail(f"{TONE_PYTHON} is missing: `make engines` builds it")
    folder = tmp_path_factory.mktemp("web")
    running = serve(folder, {"tone": {"module": "rhapsode_engine_tone", "python": str(TONE_PYTHON)}})
    yield running
    running.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    # Module, not session: Playwright's sync API keeps an asyncio loop running in this
    # thread while it is open, and later tests (the MCP client's) start loops of their own.
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=chromium_path(), args=LAUNCH_ARGS)
        yield launched
        launched.close()


@pytest.fixture(scope="session")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where this run's screenshots go: a temporary folder unless `make screenshots` says."""
    return screenshot_folder(tmp_path_factory.mktemp("screenshots"))


@pytest.fixture()
def page(browser: Any, shots: Path) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1200, "height": 900})
    # Any action with no timeout of its own (a click, a fill) waits as long as a hang guard.
    context.set_default_timeout(HANG_GUARD_MS)
    opened = context.new_page()
    errors: list[str] = []
    opened.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    opened.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    yield Page(opened, errors, shots)
    context.close()
