"""
The state database (L{rhapsode._manage.state}): created in rollback-journal mode and migrated
with user_version, written once at boot so that a file the core cannot use fails the
start naming its path, one transaction per write, and writes on a dedicated thread.
"""

from __future__ import annotations

import json
import os
import queue
import sqlite3
import stat
import subprocess
import threading
from pathlib import Path
from typing import Any, Callable

import pytest
from twisted.internet.testing import MemoryReactorClock

from rhapsode._config import load_config
from rhapsode._manage.state import SCHEMA_VERSION, InstalledEngine, StateDatabase, StateError, StateStore
from rhapsode._service import RhapsodeService, ServiceStartError


def _tables(path: Path) -> set[str]:
    with sqlite3.connect(path) as db:
        return {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def test_a_new_database_is_created_private_migrated_and_in_rollback_journal_mode(tmp_path: Path) -> None:
    """
    A first open creates the file readable by its owner only, brings it to the current
    schema, keeps the journal in DELETE mode, and leaves no journal or WAL file beside it.
    """
    path = tmp_path / "rhapsode.db"
    store = StateStore.open(path, "1.2.3")
    try:
        assert store.schema_version() == SCHEMA_VERSION == 1
        assert store.journal_mode() == "delete"
        store.write_settings({"server.port": 9090})
    finally:
        store.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert {"meta", "engines", "settings"} <= _tables(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rhapsode.db"]
    with sqlite3.connect(path) as db:
        meta = dict(db.execute("SELECT key, value FROM meta"))
    assert meta["coreVersion"] == "1.2.3" and meta["openedAt"].endswith("Z")


def test_a_database_at_version_0_is_migrated_and_keeps_what_it_had(tmp_path: Path) -> None:
    """
    A SQLite file at user_version 0 (made by something older, or empty) is migrated to
    the current version; a table already there is left alone.
    """
    path = tmp_path / "rhapsode.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE older (x INTEGER)")
        db.execute("INSERT INTO older VALUES (7)")
    store = StateStore.open(path)
    store.close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert db.execute("SELECT x FROM older").fetchall() == [(7,)]
    assert {"meta", "engines", "settings"} <= _tables(path)


def test_a_database_from_a_later_core_is_refused_naming_both_versions(tmp_path: Path) -> None:
    """
    A schema newer than this core's is refused, naming the path and both numbers, and
    nothing in it is changed.
    """
    path = tmp_path / "rhapsode.db"
    with sqlite3.connect(path) as db:
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 4}")
    with pytest.raises(StateError) as caught:
        StateStore.open(path)
    message = str(caught.value)
    assert str(path) in message
    assert f"{SCHEMA_VERSION + 4}" in message and f"{SCHEMA_VERSION}" in message
    assert "settings" not in _tables(path)


def test_a_missing_directory_is_refused_naming_the_path(tmp_path: Path) -> None:
    """
    A database whose directory is not there fails naming the file and the directory.
    """
    path = tmp_path / "gone" / "rhapsode.db"
    with pytest.raises(StateError, match="does not exist") as caught:
        StateStore.open(path)
    assert str(path) in str(caught.value)
    assert not path.parent.exists()


def test_a_corrupt_file_is_refused_naming_the_path(tmp_path: Path) -> None:
    """
    A file that is not a SQLite database fails naming its path and saying so, and is
    not overwritten.
    """
    path = tmp_path / "rhapsode.db"
    junk = b"this is not a database, it is a shopping list\n" * 200
    path.write_bytes(junk)
    with pytest.raises(StateError, match="is not a usable SQLite database") as caught:
        StateStore.open(path)
    assert str(path) in str(caught.value)
    assert path.read_bytes() == junk


def test_a_read_only_file_is_refused_naming_the_path(tmp_path: Path) -> None:
    """
    A database the core may read but not write fails at open, naming its path, rather
    than at the first write.  Where the tests run as root, who may write any file whatever
    its mode, the file is made immutable instead (chattr +i).
    """
    path = tmp_path / "rhapsode.db"
    StateStore.open(path).close()
    path.chmod(0o444)
    immutable = os.geteuid() == 0
    if immutable:
        made = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
        if made.returncode != 0:
            pytest.skip(f"root, and chattr +i is refused here: {made.stderr.strip()}")
    try:
        with pytest.raises(StateError) as caught:
            StateStore.open(path)
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(path)], check=True)
    message = str(caught.value)
    assert str(path) in message
    assert "cannot be opened for writing" in message


def test_a_refused_write_changes_nothing(tmp_path: Path) -> None:
    """
    A write of several settings is one transaction: when one of them cannot be written,
    the ones before it in the same write are not kept either.
    """
    store = StateStore.open(tmp_path / "rhapsode.db")
    try:
        store.write_settings({"residency.keepAliveSeconds": 60})
        with pytest.raises(TypeError):
            store.write_settings({"server.port": 9090, "log.level": object()})
        assert store.settings() == {"residency.keepAliveSeconds": 60}
        store.write_settings({"residency.keepAliveSeconds": None, "log.level": "debug"})
        assert store.settings() == {"log.level": "debug"}
    finally:
        store.close()


def test_uninstalling_an_engine_takes_its_settings_and_only_its(tmp_path: Path) -> None:
    """
    An engine's entry and accepted licence are kept; deleting it removes its per-engine
    settings, but not those of an engine whose id LIKE's wildcards would match.
    """
    store = StateStore.open(tmp_path / "rhapsode.db")
    try:
        store.put_engine(InstalledEngine("a_b", {"module": "x"}, "CC-BY-NC-4.0"))
        store.write_settings({"engines.a_b.keepAliveSeconds": 5, "engines.aXb.keepAliveSeconds": 6})
        assert store.engines()["a_b"] == InstalledEngine("a_b", {"module": "x"}, "CC-BY-NC-4.0")
        store.delete_engine("a_b")
        assert store.engines() == {}
        assert store.settings() == {"engines.aXb.keepAliveSeconds": 6}
    finally:
        store.close()


class ThreadedReactor:
    """
    Just enough reactor for deferToThreadPool: calls from the pool's thread are queued
    and run on the test's thread when it asks, as the reactor thread would run them.
    """

    def __init__(self) -> None:
        self.calls: "queue.Queue[tuple[Callable[..., Any], tuple[Any, ...]]]" = queue.Queue()

    def callFromThread(self, f: Callable[..., Any], *args: Any) -> None:
        self.calls.put((f, args))

    def run_one(self) -> None:
        f, args = self.calls.get(timeout=10)
        f(*args)


class RecordingStore(StateStore):
    """
    A store that notes which thread each write ran on.
    """

    threads: list[int]

    def write_settings(self, changes: Any) -> None:
        self.threads.append(threading.get_ident())
        super().write_settings(changes)


def test_writes_run_on_the_pool_thread_and_the_mirror_changes_after_commit(tmp_path: Path) -> None:
    """
    A write through L{StateDatabase} runs on its own thread, never the caller's (the
    reactor's); the mirror the reads come from changes only once the write has committed.
    """
    opened = StateStore.open(tmp_path / "rhapsode.db")
    store = RecordingStore(opened.path, opened._db)
    store.threads = []
    reactor = ThreadedReactor()
    database = StateDatabase(store, reactor)
    try:
        results: list[Any] = []
        database.write_settings({"residency.keepAliveSeconds": 42}).addBoth(results.append)
        assert database.settings() == {}
        reactor.run_one()
        assert results == [None]
        assert store.threads and threading.get_ident() not in store.threads
        assert database.settings() == {"residency.keepAliveSeconds": 42}
        assert StateStore.settings(store) == {"residency.keepAliveSeconds": 42}
    finally:
        database.close()


def test_a_failed_write_leaves_the_mirror_alone(tmp_path: Path) -> None:
    """
    A write that fails on the pool's thread fails its Deferred and the mirror keeps what
    the file holds.
    """
    database = StateDatabase(StateStore.open(tmp_path / "rhapsode.db"), ThreadedReactor())
    reactor = database._reactor
    try:
        failures: list[Any] = []
        database.write_settings({"server.port": 1, "log.level": object()}).addErrback(failures.append)
        reactor.run_one()
        assert len(failures) == 1 and failures[0].check(TypeError)
        assert database.settings() == {}
    finally:
        database.close()


def test_a_service_with_a_corrupt_database_fails_its_start_naming_the_path(tmp_path: Path) -> None:
    """
    A core given a config file opens rhapsode.db beside it as it starts; a corrupt one
    fails the start (when_listening fails, the reason logged) naming the file.
    """
    config_path = tmp_path / "rhapsode.json"
    config_path.write_text(json.dumps({"workers": {"socketDir": "sock", "voiceDir": "voices"}}))
    (tmp_path / "rhapsode.db").write_bytes(b"\x00garbage" * 1000)
    reactor = MemoryReactorClock()
    core = RhapsodeService(load_config(config_path), reactor)
    core.startService()
    failures: list[Any] = []
    core.when_listening().addErrback(failures.append)
    assert len(failures) == 1 and failures[0].check(ServiceStartError)
    assert str(tmp_path / "rhapsode.db") in failures[0].getErrorMessage()
    assert reactor.tcpServers == []


def test_a_bad_setting_in_the_database_fails_the_start_naming_it(tmp_path: Path) -> None:
    """
    A setting the database holds that this core does not take (edited by hand, say)
    fails the start naming the database and the key, rather than being ignored.
    """
    config_path = tmp_path / "rhapsode.json"
    config_path.write_text(json.dumps({"workers": {"socketDir": "sock", "voiceDir": "voices"}}))
    store = StateStore.open(tmp_path / "rhapsode.db")
    store.write_settings({"residency.keepAliveSeconds": -7})
    store.close()
    core = RhapsodeService(load_config(config_path), MemoryReactorClock())
    core.startService()
    failures: list[Any] = []
    core.when_listening().addErrback(failures.append)
    message = failures[0].getErrorMessage()
    assert str(tmp_path / "rhapsode.db") in message and "residency.keepAliveSeconds" in message


def test_the_database_closes_once_at_reactor_shutdown(tmp_path: Path) -> None:
    """
    The write thread, started at the first write, is no daemon, so the database closes
    itself after the reactor's shutdown even where the service was never stopped (the
    write asked for finishes first); closing twice is harmless.
    """
    reactor = MemoryReactorClock()
    database = StateDatabase(StateStore.open(tmp_path / "rhapsode.db"), reactor)
    assert reactor.triggers == {}  # no thread, and nothing to stop, before the first write
    database.write_settings({"log.level": "debug"})
    [(f, args, kwargs)] = reactor.triggers["after"]["shutdown"]
    f(*args, **kwargs)
    with pytest.raises(sqlite3.ProgrammingError):
        database.store.settings()
    database.close()
    assert StateStore.open(tmp_path / "rhapsode.db").settings() == {"log.level": "debug"}


def test_a_service_reads_the_database_before_twistd_asks_for_its_log_observer(tmp_path: Path) -> None:
    """
    Given a parent, the service already has the config the database layers over the
    file (a saved log.level included), and holds no open database across a fork that
    may come before it starts.
    """
    from twisted.application.service import Application

    config_path = tmp_path / "rhapsode.json"
    config_path.write_text(json.dumps({"log": {"level": "info"}, "workers": {"socketDir": "sock", "voiceDir": "voices"}}))
    store = StateStore.open(tmp_path / "rhapsode.db")
    store.write_settings({"log.level": "warn", "server.port": 9999})
    store.close()
    core = RhapsodeService(load_config(config_path), MemoryReactorClock())
    core.setServiceParent(Application("test"))
    assert (core.config.log.level, core.config.server.port) == ("warn", 9999)
    assert core.state is None and core.settings is None
