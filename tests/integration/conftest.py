"""
Fixtures that start real tone workers on Unix sockets.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, AsyncIterator

import pytest
import pytest_twisted

from _worker import Worker, spawn_worker


@pytest.fixture(scope="module")
def worker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("worker")


@pytest_twisted.async_yield_fixture(scope="module")
async def tone(worker_dir: Path) -> AsyncIterator[Worker]:
    """
    One tone worker shared by a module's read-mostly tests.
    """
    from twisted.internet import reactor

    worker = await spawn_worker(reactor, worker_dir)
    yield worker
    await worker.stop()


@pytest_twisted.async_yield_fixture()
async def own_tone(tmp_path: Path) -> AsyncIterator[Worker]:
    """
    A tone worker of the test's own, for tests that drain, kill or fill it.
    """
    from twisted.internet import reactor

    worker = await spawn_worker(reactor, tmp_path)
    yield worker
    await worker.stop()


@pytest.fixture()
def reactor() -> Any:
    from twisted.internet import reactor

    return reactor
