"""
The state database (protocol.md section 10): C{rhapsode.db} beside the config file, where
the core keeps what it has been told since it started from the file: the settings
written through C{PATCH /settings} and the engines the API installs.

One SQLite file in rollback-journal mode, so that a copy of the one file taken between
writes is the whole database.  L{StateStore} is the plain synchronous access, opened and
written once at boot on the calling thread so that a file the core cannot use fails the
start naming its path.  L{StateDatabase} is what the running core uses: every write goes
to one dedicated thread, one transaction each, and reads are answered from a mirror in
memory that is updated once a write has committed.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from twisted.internet.defer import Deferred
from twisted.internet.threads import deferToThreadPool
from twisted.python.threadpool import ThreadPool

#: The file's name, in the config file's directory.
FILE_NAME = "rhapsode.db"

#: How long a write waits for another connection's lock before it fails (a person
#: with the sqlite3 shell open on the file, say).
BUSY_TIMEOUT_MS = 5000

#: The schema's migrations in order: migration n brings C{user_version} n-1 to n.
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE engines (
        id TEXT PRIMARY KEY,
        entry TEXT NOT NULL,
        accepted TEXT,
        installed_at TEXT NOT NULL,
        updated_at TEXT NOT NULL
    );
    CREATE TABLE settings (key TEXT PRIMARY KEY, value TEXT NOT NULL, updated_at TEXT NOT NULL);
    """,
)
SCHEMA_VERSION = len(MIGRATIONS)

_T = TypeVar("_T")


class StateError(Exception):
    """
    The state database cannot be used; the message names its path and what is wrong.
    """


@dataclass(frozen=True)
class InstalledEngine:
    """
    An engine the API installed: its engine entry, as the config would hold it, and the
    weights licence the install accepted (C{None} where none was needed).
    """

    id: str
    entry: Mapping[str, Any]
    accepted: str | None


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class StateStore:
    """
    Synchronous access to the state database.  Not for the reactor thread once the core
    runs: L{StateDatabase} calls it from its own thread.
    """

    def __init__(self, path: Path, connection: sqlite3.Connection) -> None:
        self.path = path
        self._db = connection

    @classmethod
    def open(cls, path: str | os.PathLike[str], core_version: str = "") -> "StateStore":
        """
        Open the database at C{path}, creating it (mode 0600) if it is not there, migrate
        it to L{SCHEMA_VERSION}, and write once, so that a file that cannot be written
        fails now rather than at the first install.

        @raise StateError: naming the path: its directory is missing, it is not a
            database, it cannot be written, or its schema is newer than this core's.
        """
        where = Path(os.path.abspath(path))
        if not where.parent.is_dir():
            raise StateError(f"state database {where}: its directory {where.parent} does not exist")
        try:
            # Created here rather than by SQLite so that nobody else can read it: it
            # holds the management token once one is set through the API.
            os.close(os.open(where, os.O_RDWR | os.O_CREAT, 0o600))
        except OSError as error:
            raise StateError(f"state database {where}: cannot be opened for writing: {error.strerror}") from None
        try:
            # Autocommit: every transaction below is begun and ended explicitly.
            connection = sqlite3.connect(where, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as error:
            raise StateError(f"state database {where}: cannot be opened: {error}") from None
        store = cls(where, connection)
        try:
            store._prepare(core_version)
        except sqlite3.DatabaseError as error:
            connection.close()
            raise StateError(f"state database {where}: {_why(error)}") from None
        except StateError:
            connection.close()
            raise
        return store

    def _prepare(self, core_version: str) -> None:
        db = self._db
        db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        # The journal exists only while writing: a copy of the one file is the database.
        mode = db.execute("PRAGMA journal_mode = DELETE").fetchone()[0]
        if str(mode).lower() != "delete":
            raise StateError(f"state database {self.path}: journal mode stays {mode}, not delete")
        db.execute("PRAGMA synchronous = FULL")
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise StateError(
                f"state database {self.path}: schema version {version} is newer than this core's "
                f"{SCHEMA_VERSION}; it was written by a later rhapsode"
            )
        for number in range(version + 1, SCHEMA_VERSION + 1):
            # A migration and the version it brings commit together or not at all.
            self._transaction(lambda: self._migrate(number))
        # The write at boot: a file that cannot be written fails the start, not an install.
        self._transaction(lambda: self._opened(core_version))

    def _migrate(self, number: int) -> None:
        for statement in MIGRATIONS[number - 1].split(";"):
            if statement.strip():
                self._db.execute(statement)
        self._db.execute(f"PRAGMA user_version = {number}")

    def _opened(self, core_version: str) -> None:
        for key, value in (("openedAt", _now()), ("coreVersion", core_version)):
            self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    def _transaction(self, work: Callable[[], _T]) -> _T:
        # IMMEDIATE takes the write lock at the start, so a busy file fails before any
        # of the work rather than halfway.
        self._db.execute("BEGIN IMMEDIATE")
        try:
            result = work()
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")
        return result

    def schema_version(self) -> int:
        return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def journal_mode(self) -> str:
        return str(self._db.execute("PRAGMA journal_mode").fetchone()[0])

    def settings(self) -> dict[str, Any]:
        """
        Every setting the database holds: dotted key to its JSON value.
        """
        rows = self._db.execute("SELECT key, value FROM settings ORDER BY key").fetchall()
        return {key: json.loads(value) for key, value in rows}

    def write_settings(self, changes: Mapping[str, Any]) -> None:
        """
        Set each dotted key to its value, or clear it where the value is C{None}, in one
        transaction: all of them or, on any failure, none.
        """
        stamp = _now()

        def write() -> None:
            for key, value in changes.items():
                if value is None:
                    self._db.execute("DELETE FROM settings WHERE key = ?", (key,))
                else:
                    self._db.execute(
                        "INSERT OR REPLACE INTO settings (key, value, updated_at) VALUES (?, ?, ?)",
                        (key, json.dumps(value), stamp),
                    )

        self._transaction(write)

    def engines(self) -> dict[str, InstalledEngine]:
        """
        The engines the API installed, by id.
        """
        rows = self._db.execute("SELECT id, entry, accepted FROM engines ORDER BY id").fetchall()
        return {id_: InstalledEngine(id_, json.loads(entry), accepted) for id_, entry, accepted in rows}

    def put_engine(self, engine: InstalledEngine) -> None:
        """
        Record an installed engine, replacing any entry of the same id.
        """
        stamp = _now()
        self._transaction(
            lambda: self._db.execute(
                "INSERT INTO engines (id, entry, accepted, installed_at, updated_at) VALUES (?, ?, ?, ?, ?)"
                " ON CONFLICT (id) DO UPDATE SET entry = excluded.entry, accepted = excluded.accepted,"
                " updated_at = excluded.updated_at",
                (engine.id, json.dumps(dict(engine.entry)), engine.accepted, stamp, stamp),
            )
        )

    def delete_engine(self, engine_id: str) -> None:
        """
        Forget an engine and its per-engine settings, in one transaction.
        """
        # LIKE's wildcards in an id would match other engines' settings.
        escaped = engine_id.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")

        def delete() -> None:
            self._db.execute("DELETE FROM engines WHERE id = ?", (engine_id,))
            self._db.execute("DELETE FROM settings WHERE key LIKE ? ESCAPE '\\'", (f"engines.{escaped}.%",))

        self._transaction(delete)

    def close(self) -> None:
        self._db.close()


def _why(error: sqlite3.DatabaseError) -> str:
    text = str(error)
    if "not a database" in text or "malformed" in text:
        return f"is not a usable SQLite database ({text})"
    if "readonly" in text or "read-only" in text:
        return f"cannot be written ({text})"
    if "locked" in text or "busy" in text:
        return f"is locked by another process ({text})"
    return text


class StateDatabase:
    """
    The running core's view of the state database: writes on one dedicated thread,
    each one transaction, and the settings read from a mirror in memory, so that the
    reactor thread never waits on the disk.

    Every method is called on the reactor thread; the Deferreds fire there.
    """

    def __init__(self, store: StateStore, reactor: Any) -> None:
        self.store = store
        self.path = store.path
        self._reactor = reactor
        self._settings: dict[str, Any] = store.settings()
        self._engines: dict[str, InstalledEngine] = store.engines()
        # One thread: writes reach the file in the order they were asked for.  Started
        # at the first write, so that no thread is lost to a fork (twistd daemonizing)
        # between opening the database and serving.
        self._pool = ThreadPool(1, 1, name="rhapsode-state")
        self._closed = False

    def _started(self) -> ThreadPool:
        if not self._pool.started:
            self._pool.start()
            # Its thread is not a daemon: a program that stops the reactor without
            # stopping the service must still be able to exit.
            add_trigger = getattr(self._reactor, "addSystemEventTrigger", None)
            if add_trigger is not None:
                add_trigger("after", "shutdown", self.close)
        return self._pool

    def settings(self) -> Mapping[str, Any]:
        """
        The settings as of the last committed write.
        """
        return dict(self._settings)

    def write_settings(self, changes: Mapping[str, Any]) -> "Deferred[None]":
        """
        Write C{changes} (dotted key to value, C{None} to clear) in one transaction on
        the database's thread; the mirror changes once it has committed.
        """
        changes = dict(changes)

        def committed(_: None) -> None:
            for key, value in changes.items():
                if value is None:
                    self._settings.pop(key, None)
                else:
                    self._settings[key] = value

        d: Deferred[None] = deferToThreadPool(
            self._reactor, self._started(), self.store.write_settings, changes
        )
        d.addCallback(committed)
        return d

    def engines(self) -> dict[str, InstalledEngine]:
        """
        The engines the API installed, as of the last committed write.
        """
        return dict(self._engines)

    def put_engine(self, engine: InstalledEngine) -> "Deferred[None]":
        """
        Record an installed engine (one transaction on the database's thread); the
        mirror changes once it has committed.
        """
        d: Deferred[None] = deferToThreadPool(self._reactor, self._started(), self.store.put_engine, engine)
        d.addCallback(lambda _: self._engines.__setitem__(engine.id, engine))
        return d

    def delete_engine(self, engine_id: str) -> "Deferred[None]":
        """
        Forget an engine and its per-engine settings, in one transaction.
        """
        prefix = f"engines.{engine_id}."

        def committed(_: None) -> None:
            self._engines.pop(engine_id, None)
            for key in [key for key in self._settings if key.startswith(prefix)]:
                del self._settings[key]

        d: Deferred[None] = deferToThreadPool(self._reactor, self._started(), self.store.delete_engine, engine_id)
        d.addCallback(committed)
        return d

    def close(self) -> None:
        """
        Let the writes asked for finish, end the thread and close the file; once.
        """
        if self._closed:
            return
        self._closed = True
        if self._pool.started:
            self._pool.stop()
        self.store.close()
