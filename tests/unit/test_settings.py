"""
The settings document and its PATCH (L{rhapsode._manage.settings}, protocol.md section 10):
three layers, live against restart keys, the refusals, the two lockout conflicts, and
the routes behind the management guard, over a real state database.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure

from rhapsode._config import Config, ConfigSettings
from rhapsode._fleet.registry import Registry
from rhapsode._http.table import MANAGEMENT
from rhapsode._manage.settings import Caller, Settings, applies, layer
from rhapsode._manage.state import StateDatabase, StateStore
from rhapsode._service import Core, build_core

from test_state import ThreadedReactor

LOCAL = Caller(local=True)
REMOTE = Caller(local=False)
TOKEN = "a-token-of-thirty-two-characters"
FILE: dict[str, Any] = {
    "server": {"port": 8080},
    "residency": {"keepAliveSeconds": 120},
    "management": {"token": TOKEN, "origins": ["https://page.example"]},
    "engines": {"tone": {"module": "rhapsode_engine_tone"}, "far": {"url": "http://127.0.0.1:9"}},
}


class Harness:
    """
    Settings over a real database in C{tmp_path}, whose writes run on its thread and
    come back when L{patch} asks; C{changed} records each config handed on.
    """

    def __init__(self, tmp_path: Path, raw: dict[str, Any] = FILE, engines: tuple[str, ...] = ("tone", "far")) -> None:
        self.tmp_path = tmp_path
        self.raw = raw
        self.engines = engines
        self.reactor = ThreadedReactor()
        self.database = StateDatabase(StateStore.open(tmp_path / "rhapsode.db"), self.reactor)
        self.changed: list[Config] = []
        self.settings = self._settings()

    def _settings(self) -> Settings:
        return Settings(
            raw=self.raw,
            base=self.tmp_path,
            database=self.database,
            engine_ids=lambda: self.engines,
            on_change=self.changed.append,
        )

    def restart(self) -> None:
        """
        What the next start sees: the same file and database, read afresh.
        """
        self.database.close()
        self.database = StateDatabase(StateStore.open(self.tmp_path / "rhapsode.db"), self.reactor)
        self.settings = self._settings()

    def patch(self, body: Any, caller: Caller = LOCAL) -> Any:
        results: list[Any] = []
        Deferred.fromCoroutine(self.settings.patch(body, caller)).addBoth(results.append)
        if not results:
            self.reactor.run_one()
        return results[0]

    def refused(self, body: Any, caller: Caller = LOCAL) -> Any:
        result = self.patch(body, caller)
        assert isinstance(result, Failure), result
        return result.value

    def field(self, key: str) -> dict[str, Any]:
        return next(f for f in self.settings.document()["fields"] if f["key"] == key)

    def close(self) -> None:
        self.database.close()


@pytest.fixture
def h(tmp_path: Path) -> Any:
    harness = Harness(tmp_path)
    yield harness
    harness.close()


def test_the_document_shows_each_layer_and_never_the_token(h: Harness) -> None:
    """
    values holds what is in use, from the file over the defaults; each field says which
    layer its value came from and whether it is live; the token is only tokenSet.
    """
    document = h.settings.document()
    values = document["values"]
    assert values["server"]["port"] == 8080
    assert values["residency"] == {"maxResidentModels": 1, "evictionWaitSeconds": 30.0, "keepAliveSeconds": 120}
    assert values["management"] == {"tokenSet": True, "origins": ["https://page.example"]}
    assert values["engines"] == {
        "tone": {"keepAliveSeconds": None, "maxConcurrent": None, "maxQueued": None},
        "far": {"keepAliveSeconds": None, "maxConcurrent": None, "maxQueued": None},
    }
    assert TOKEN not in json.dumps(document)
    fields = {f["key"]: f for f in document["fields"]}
    assert fields["residency.keepAliveSeconds"] == {"key": "residency.keepAliveSeconds", "source": "config", "applies": "live"}
    assert fields["residency.maxResidentModels"]["source"] == "default"
    assert fields["server.port"] == {"key": "server.port", "source": "config", "applies": "restart"}
    assert fields["engines.tone.keepAliveSeconds"]["applies"] == "live"
    assert "management.tokenSet" not in fields and fields["management.token"]["source"] == "config"
    assert not any("saved" in f for f in document["fields"])


def test_a_live_setting_applies_at_once_and_is_handed_on(h: Harness) -> None:
    """
    A PATCH of a live key is in values straight away, from the database, and the new
    config goes to whoever applies it (the service swaps what ConfigSettings reads).
    """
    document = h.patch({"residency": {"keepAliveSeconds": 7}, "engines": {"tone": {"keepAliveSeconds": "9"}}})
    assert document["values"]["residency"]["keepAliveSeconds"] == 7
    assert document["values"]["engines"]["tone"]["keepAliveSeconds"] == 9
    assert h.field("residency.keepAliveSeconds") == {"key": "residency.keepAliveSeconds", "source": "database", "applies": "live"}
    settings = ConfigSettings(lambda: h.changed[-1])
    assert (settings.keep_alive_seconds(), settings.engine_keep_alive_seconds("tone")) == (7, 9)
    assert h.database.settings() == {"residency.keepAliveSeconds": 7, "engines.tone.keepAliveSeconds": 9}


def test_a_restart_setting_is_saved_and_waits_for_the_next_start(h: Harness) -> None:
    """
    server.port given as a string is read as a number and saved; the port in use stays
    the old one, with the saved value beside it, until a start reads it from the database.
    """
    document = h.patch({"server": {"port": "9090"}})
    assert document["values"]["server"]["port"] == 8080
    assert h.field("server.port") == {"key": "server.port", "source": "config", "applies": "restart", "saved": 9090}
    h.restart()
    assert h.settings.config.server.port == 9090
    assert h.field("server.port") == {"key": "server.port", "source": "database", "applies": "restart"}


def test_null_clears_a_setting_back_to_the_file_then_the_default(h: Harness) -> None:
    """
    null removes a setting from the database: the value falls back to the file's, and a
    key the file does not name to its default.
    """
    h.patch({"residency": {"keepAliveSeconds": 7, "maxResidentModels": 3}})
    document = h.patch({"residency": {"keepAliveSeconds": None, "maxResidentModels": None}})
    assert document["values"]["residency"]["keepAliveSeconds"] == 120
    assert document["values"]["residency"]["maxResidentModels"] == 1
    assert h.field("residency.keepAliveSeconds")["source"] == "config"
    assert h.field("residency.maxResidentModels")["source"] == "default"
    assert h.database.settings() == {}


def test_a_new_token_is_saved_true_never_the_token(h: Harness) -> None:
    """
    A token written through the API waits for a restart, and its field says saved: true
    rather than carrying it.
    """
    document = h.patch({"management": {"token": "b" * 40}})
    assert h.field("management.token")["saved"] is True
    assert "b" * 40 not in json.dumps(document)
    assert document["values"]["management"]["tokenSet"] is True


@pytest.mark.parametrize(
    "body, field",
    [
        ({"residency": {"keepAliveSecs": 5}}, "residency.keepAliveSecs"),
        ({"nonsense": {}}, "nonsense"),
        ({"management": {"tokenSet": False}}, "management.tokenSet"),
        ({"engines": {"tone": {"module": "x"}}}, "engines.tone.module"),
        ({"server": 8080}, "server"),
        ([1, 2], "body"),
    ],
)
def test_a_key_the_document_does_not_have_is_refused_by_name(h: Harness, body: Any, field: str) -> None:
    """
    A misspelt or unwritable key is bad_request naming it, and nothing is written.
    """
    error = h.refused(body)
    assert (error.code, error.field) == ("bad_request", field)
    assert h.database.settings() == {}


@pytest.mark.parametrize(
    "key, value",
    [
        ("server.port", 70000),
        ("server.port", "eighty"),
        ("residency.keepAliveSeconds", -2),
        ("residency.maxResidentModels", 0),
        ("residency.evictionWaitSeconds", -1),
        ("server.shutdownGraceMs", -5),
        ("log.level", "loud"),
        ("management.origins", ["https://page.example/path"]),
        ("residency.maxResidentModels", True),
        ("server.host", "not an address"),
        ("server.host", "8.8.8.8"),
        ("server.host", "203.0.113.7"),
        ("management.token", "a-long-enough-token\r\nX-Injected: yes"),
        ("management.token", "a-long-enough-token\nmore"),
        ("management.token", "a-long-enough-\x00token"),
        ("management.token", "a-long-enough-t\u00f6ken"),
    ],
)
def test_a_bad_value_is_refused_naming_the_setting_and_changes_nothing(h: Harness, key: str, value: Any) -> None:
    """
    A value out of range is bad_request naming the setting (a host this machine cannot
    listen on, a token that cannot travel in an Authorization header included: each
    would have failed the next start or every call); the patch is one transaction, so
    the good keys beside it are not written either.
    """
    section, name = key.split(".")
    body: dict[str, Any] = {"residency": {"keepAliveSeconds": 11}}
    body.setdefault(section, {})[name] = value
    before = h.settings.document()
    error = h.refused(body)
    assert error.code == "bad_request" and error.field == key and key in error.message
    assert h.database.settings() == {}
    assert h.settings.document() == before and h.changed == []


def test_a_per_engine_setting_for_an_engine_not_in_the_registry_is_unknown_engine(h: Harness) -> None:
    """
    engines.<id> for an id the registry lacks is unknown_engine, and nothing is written.
    """
    error = h.refused({"residency": {"keepAliveSeconds": 11}, "engines": {"ghost": {"keepAliveSeconds": 5}}})
    assert (error.code, error.field) == ("unknown_engine", "engines.ghost")
    assert h.database.settings() == {}


def test_a_remote_caller_may_not_clear_or_empty_the_token(h: Harness) -> None:
    """
    A caller not on this machine was admitted by the token: clearing a token the
    database holds, or setting it empty, is conflict; at the machine it is allowed.
    """
    h.patch({"management": {"token": "c" * 32}})
    for token in (None, ""):
        error = h.refused({"management": {"token": token}}, REMOTE)
        assert (error.code, error.field) == ("conflict", "management.token")
    error = h.refused({"management": None}, REMOTE)
    assert error.code == "conflict"
    assert h.database.settings() == {"management.token": "c" * 32}
    h.patch({"management": {"token": None}}, LOCAL)
    assert h.database.settings() == {}


def test_a_page_may_not_leave_its_own_origin_out_of_the_list(h: Harness) -> None:
    """
    A caller whose Origin is not this machine's may not write management.origins
    without it (conflict); with it the write is allowed, and a page on this machine
    is never refused this.
    """
    page = Caller(local=True, origin="https://page.example")
    error = h.refused({"management": {"origins": ["https://other.example"]}}, page)
    assert (error.code, error.field) == ("conflict", "management.origins")
    assert h.database.settings() == {}
    h.patch({"management": {"origins": ["https://other.example", "https://page.example:443"]}}, page)
    # Cleared, the list falls back to the file's, which names the page.
    h.patch({"management": {"origins": None}}, page)
    own = Caller(local=True, origin="http://localhost:5173")
    h.patch({"management": {"origins": []}}, own)
    assert h.database.settings() == {"management.origins": []}


def test_which_keys_are_live() -> None:
    """
    The residency settings, the admission limits and every per-engine setting apply at
    once; the socket, the workers' and the management settings wait for a restart.
    """
    assert applies("residency.keepAliveSeconds") == "live"
    assert applies("limits.queueWaitSeconds") == "live"
    assert applies("engines.kokoro.keepAliveSeconds") == "live"
    assert applies("server.port") == applies("workers.socketDir") == applies("management.origins") == "restart"
    assert applies("log.level") == "restart"


def test_the_database_wins_over_the_file_and_installed_engines_lose_to_it() -> None:
    """
    layer() writes the database's settings over the file's document, leaves the file's
    document unchanged, keeps the file's entry where an install names the same engine,
    and drops a per-engine setting for an engine neither names.
    """
    raw = {"server": {"port": 1}, "engines": {"tone": {"module": "a"}}}
    document = layer(
        raw,
        {"server.port": 2, "log.level": "debug", "engines.tone.keepAliveSeconds": 3, "engines.gone.keepAliveSeconds": 4},
        {"tone": {"module": "b"}, "extra": {"module": "c"}},
    )
    assert document == {
        "server": {"port": 2},
        "log": {"level": "debug"},
        "engines": {"tone": {"module": "a", "keepAliveSeconds": 3}, "extra": {"module": "c"}},
    }
    assert raw == {"server": {"port": 1}, "engines": {"tone": {"module": "a"}}}


def _exchange(app: Core, request: bytes, peer: str = "127.0.0.1", reactor: ThreadedReactor | None = None) -> tuple[bytes, Any]:
    channel = app.site().buildProtocol(IPv4Address("TCP", "127.0.0.1", 8080))
    transport = StringTransport(peerAddress=IPv4Address("TCP", peer, 40000))
    channel.makeConnection(transport)
    channel.dataReceived(request)
    if reactor is not None:
        reactor.run_one()
    head, _, body = transport.value().partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        chunks, rest = [], body
        while rest:
            size, _, rest = rest.partition(b"\r\n")
            chunks.append(rest[: int(size, 16)])
            rest = rest[int(size, 16) + 2 :]
        body = b"".join(chunks)
    return head, json.loads(body) if body else None


def test_both_routes_are_management_routes() -> None:
    """
    GET and PATCH /settings are guarded at their heads, reading included.
    """
    assert {("GET", "/settings"), ("PATCH", "/settings")} <= MANAGEMENT


def test_the_routes_answer_and_patch_through_the_site(h: Harness) -> None:
    """
    Over the core's own site, a local caller's GET answers the document and its PATCH
    answers the document after the write.
    """
    app = build_core(Registry({}), reactor=MemoryReactorClock(), settings_api=h.settings)
    head, document = _exchange(app, b"GET /settings HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and document["values"]["server"]["port"] == 8080
    body = b'{"residency": {"keepAliveSeconds": 33}}'
    head, document = _exchange(
        app,
        b"PATCH /settings HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body),
        reactor=h.reactor,
    )
    assert head.startswith(b"HTTP/1.1 200"), head
    assert document["values"]["residency"]["keepAliveSeconds"] == 33


def test_a_remote_patch_naming_no_token_is_refused_and_its_token_conflict_is_409(h: Harness) -> None:
    """
    A remote caller without the token is forbidden before its body is read; with it, a
    patch clearing the token the database holds answers 409.
    """
    h.patch({"management": {"token": TOKEN}})
    app = build_core(Registry({}), reactor=MemoryReactorClock(), settings_api=h.settings, management_token=TOKEN)
    body = b'{"management": {"token": null}}'
    request = (
        b"PATCH /settings HTTP/1.1\r\nHost: box.example\r\nContent-Type: application/json\r\n%s"
        b"Content-Length: %d\r\n\r\n%s"
    )
    head, answer = _exchange(app, request % (b"", len(body), body), peer="203.0.113.9")
    assert head.startswith(b"HTTP/1.1 403") and answer["error"]["code"] == "forbidden"
    bearer = b"Authorization: Bearer " + TOKEN.encode() + b"\r\n"
    head, answer = _exchange(app, request % (bearer, len(body), body), peer="203.0.113.9")
    assert head.startswith(b"HTTP/1.1 409") and answer["error"]["code"] == "conflict"
    assert h.database.settings() == {"management.token": TOKEN}


def test_a_core_without_a_state_database_answers_unsupported() -> None:
    """
    A core built without settings (embedded, no config file) answers /settings with
    unsupported to a caller the guard admits.
    """
    app = build_core(Registry({}), reactor=MemoryReactorClock())
    head, answer = _exchange(app, b"GET /settings HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert answer["error"]["code"] == "unsupported", head


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "localhost", " 127.0.0.1 "])
def test_a_host_this_machine_can_listen_on_is_taken(h: Harness, host: str) -> None:
    """
    server.host takes what a socket can bind here (loopback, every interface, the name
    localhost), as it will be used at the next start.
    """
    h.patch({"server": {"host": host}})
    assert h.database.settings()["server.host"] == host.strip()
