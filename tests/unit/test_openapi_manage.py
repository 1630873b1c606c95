"""
The public OpenAPI document's section 10 routes (the catalog, settings, installs and
their jobs) and the contract shapes they answer with: the document describes each route
with its statuses, parameters and guard, and what the core really answers (GET
/catalog, GET and PATCH /settings, a job, POST /installs/outdated's answer and the
events of GET /installs/{job}/events) validates against those shapes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Awaitable, Callable

import pytest
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, succeed
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure

from rhapsode._config import default_source_dir
from rhapsode._fleet.catalog import Catalog, read_source
from rhapsode._fleet.registry import Registry
from rhapsode._fleet.residency import Residency
from rhapsode._manage.installer import Installer
from rhapsode._manage.jobs import REPLAY_EVENTS, JobContext, JobFailed, Jobs
from rhapsode._manage.state import InstalledEngine, StateDatabase, StateStore
from rhapsode._service import Core, build_core
from rhapsode_protocol.contract import (
    CATALOG,
    CATALOG_ENTRY,
    ENGINE_SUMMARY,
    FEED_EVENT,
    INSTALL_JOB,
    INSTALL_JOB_LIST,
    OUTDATED_REINSTALLS,
    PULL_REQUEST,
    SETTINGS,
    SETTINGS_PATCH,
    public_openapi,
    validate,
)
from rhapsode_protocol.errors import BadRequest, Internal

from test_catalog_route import app_with, get, record, source, venv
from test_contract_public import MANAGEMENT
from test_installer import FakeHost, FakeRunner, Settings
from test_settings import Harness, _exchange
from test_state import ThreadedReactor

# -- the document ------------------------------------------------------------------------

#: Section 10's management routes: test_contract_public's, less those of sections 3 and 7.
_MANAGEMENT_ROUTES = sorted(
    route for route in MANAGEMENT if "/voices" not in route[0] and not route[0].endswith("/unload")
)


def _resolve(document: dict[str, Any], node: dict[str, Any]) -> Any:
    while "$ref" in node:
        target: Any = document
        for part in node["$ref"][2:].split("/"):
            target = target[part]
        node = target
    return node


def _answer(document: dict[str, Any], path: str, method: str, status: str) -> Any:
    response = document["paths"][path][method]["responses"][status]
    return response["content"]["application/json"]["schema"]


def _parameters(document: dict[str, Any], path: str, method: str) -> dict[tuple[str, str], Any]:
    item = document["paths"][path]
    found = [*item.get("parameters", []), *item[method].get("parameters", [])]
    resolved = [_resolve(document, parameter) for parameter in found]
    return {(parameter["in"], parameter["name"]): parameter for parameter in resolved}


def test_each_route_answers_its_contract_shape() -> None:
    """
    GET /catalog answers Catalog (entries of CatalogEntry), both /settings methods the
    Settings document, a job start and GET /installs/{job} an InstallJob, GET /installs
    a list of them, POST /installs/outdated its jobs and skipped, and PATCH and pull
    take their request shapes.
    """
    document = public_openapi("0.1.0")
    ref = "#/components/schemas/"
    assert _answer(document, "/catalog", "get", "200") == {"$ref": ref + "Catalog"}
    assert _resolve(document, document["components"]["schemas"]["Catalog"]["items"]) == CATALOG_ENTRY
    for method in ("get", "patch"):
        assert _answer(document, "/settings", method, "200") == {"$ref": ref + "Settings"}
    for path in ("/engines/{engine}/install", "/engines/{engine}/reinstall", "/engines/{engine}/pull"):
        assert _answer(document, path, "post", "202") == {"$ref": ref + "InstallJob"}
    assert _answer(document, "/installs/{job}", "get", "200") == {"$ref": ref + "InstallJob"}
    assert _resolve(document, _answer(document, "/installs", "get", "200")) == INSTALL_JOB_LIST
    outdated = _resolve(document, _answer(document, "/installs/outdated", "post", "202"))
    assert outdated == OUTDATED_REINSTALLS
    patch = document["paths"]["/settings"]["patch"]["requestBody"]["content"]["application/json"]
    assert _resolve(document, patch["schema"]) == SETTINGS_PATCH
    pull = document["paths"]["/engines/{engine}/pull"]["post"]["requestBody"]
    assert pull["required"] is True
    assert _resolve(document, pull["content"]["application/json"]["schema"]) == PULL_REQUEST
    for name in ("Settings", "SettingField", "InstallJob", "FeedEvent", "CatalogEntry"):
        assert name in document["components"]["schemas"]


def test_job_starts_are_202_with_a_location_and_an_uninstall_is_204() -> None:
    """
    Install, reinstall and pull answer 202 with a Location header naming the job;
    POST /installs/outdated answers 202 (several jobs, no Location); DELETE
    /engines/{engine} answers 204 with no body.
    """
    document = public_openapi("0.1.0")
    paths = document["paths"]
    for path in ("/engines/{engine}/install", "/engines/{engine}/reinstall", "/engines/{engine}/pull"):
        responses = paths[path]["post"]["responses"]
        assert "200" not in responses
        assert "/installs/{job}" in responses["202"]["headers"]["Location"]["description"]
    assert "headers" not in paths["/installs/outdated"]["post"]["responses"]["202"]
    deleted = paths["/engines/{engine}"]["delete"]["responses"]
    assert "content" not in deleted["204"] and "200" not in deleted


@pytest.mark.parametrize(
    "path, method, statuses",
    [
        ("/settings", "get", {403, 422}),
        ("/settings", "patch", {400, 403, 404, 409, 422}),
        ("/engines/{engine}", "delete", {400, 403, 404, 409, 422, 500}),
        ("/engines/{engine}/install", "post", {400, 403, 404, 409, 422, 429}),
        ("/engines/{engine}/reinstall", "post", {400, 403, 404, 409, 422, 429}),
        ("/engines/{engine}/pull", "post", {400, 403, 404, 409, 422, 429}),
        ("/installs", "get", {403}),
        ("/installs/outdated", "post", {400, 403, 422, 429}),
        ("/installs/{job}", "get", {403, 404}),
        ("/installs/{job}/events", "get", {400, 403, 404, 429}),
        ("/catalog", "get", set()),
    ],
)
def test_each_route_documents_the_errors_it_raises(path: str, method: str, statuses: set[int]) -> None:
    """
    Each route lists exactly the error statuses its implementation can answer with:
    forbidden on every management route, unsupported (422) where a server without a
    state database refuses, unknown_engine or an unknown job (404), conflict,
    overloaded where a job or a stream is refused for room, and nothing on GET /catalog.
    """
    responses = public_openapi("0.1.0")["paths"][path][method]["responses"]
    assert {int(status) for status in responses if int(status) >= 400} == statuses


def test_management_routes_carry_the_note_and_the_catalog_says_it_is_open() -> None:
    """
    Every section 10 management route's description is the management note (loopback,
    the token); GET /catalog's says it answers every caller.
    """
    paths = public_openapi("0.1.0")["paths"]
    for path, method in _MANAGEMENT_ROUTES:
        description = paths[path][method]["description"]
        assert "loopback" in description and "Authorization: Bearer" in description, path
    catalog = paths["/catalog"]["get"]["description"]
    assert "Open to every caller" in catalog and "loopback" not in catalog


def test_parameters_are_the_engine_the_job_and_the_queries_the_routes_take() -> None:
    """
    The engine routes take the engine path id, the job routes the job path id; install
    takes ?pull= and ?accept=, reinstall ?accept=; the event stream takes Last-Event-ID
    as a header and ?lastEventId=.
    """
    document = public_openapi("0.1.0")
    install = _parameters(document, "/engines/{engine}/install", "post")
    assert set(install) == {("path", "engine"), ("query", "pull"), ("query", "accept")}
    assert "weightsCommercialUse: false" in install[("query", "accept")]["description"]
    reinstall = _parameters(document, "/engines/{engine}/reinstall", "post")
    assert set(reinstall) == {("path", "engine"), ("query", "accept")}
    assert set(_parameters(document, "/engines/{engine}", "delete")) == {("path", "engine")}
    assert set(_parameters(document, "/installs/{job}", "get")) == {("path", "job")}
    events = _parameters(document, "/installs/{job}/events", "get")
    assert set(events) == {("path", "job"), ("header", "Last-Event-ID"), ("query", "lastEventId")}


def test_the_event_stream_is_described_frame_by_frame() -> None:
    """
    GET /installs/{job}/events answers text/event-stream whose frames carry a FeedEvent
    as their data's JSON (each frame described as a reader of the stream parses it: id,
    event and data, a resync frame's data {}), and its description gives the frame format, resync, both ways to resume,
    the heartbeat, and when to close the stream.
    """
    document = public_openapi("0.1.0")
    operation = document["paths"]["/installs/{job}/events"]["get"]
    content = operation["responses"]["200"]["content"]
    assert set(content) == {"text/event-stream"}
    frame = content["text/event-stream"]["schema"]
    assert frame["required"] == ["event", "data"]
    assert frame["properties"]["data"]["contentMediaType"] == "application/json"
    carried = frame["properties"]["data"]["contentSchema"]["anyOf"]
    assert _resolve(document, carried[0]) == FEED_EVENT and carried[1] == {"type": "object", "maxProperties": 0}
    description = operation["description"]
    for phrase in (
        "id: <event id>",
        "event: <kind>",
        "data: <FeedEvent as JSON>",
        "event: resync",
        "Last-Event-ID",
        "?lastEventId=",
        ": ping",
        "The stream stays open after the job ends; close it at the first progress whose "
        "status is not running",
    ):
        assert phrase in description, phrase


# -- real answers against the shapes -----------------------------------------------------


def test_the_catalog_answer_validates(tmp_path: Path) -> None:
    """
    GET /catalog as the core answers it, with an engine not installed, one installed
    with its workerVersion and outdated, and one whose weights are not for commercial
    use, validates against Catalog; so does every record the checkout ships.
    """
    records = source(tmp_path, record("tone"), record("piper", commercial=False), record("espeak"))
    catalog = Catalog(read_source(records), "0.1.0")
    catalog.declare("tone", "rhapsode_engine_tone", venv(tmp_path, "0.0.9"))
    app, _ = app_with(catalog, "tone")
    code, entries = get(app, "/catalog")
    assert code == 200
    validate(CATALOG, entries)
    assert {entry["id"]: entry.get("outdated") for entry in entries} == {
        "espeak": None, "piper": None, "tone": True,
    }
    shipped = Catalog(read_source(default_source_dir()), "0.1.0")
    assert shipped.entries()
    validate(CATALOG, shipped.entries())


def test_catalog_entries_refuse_a_wrong_installed_state() -> None:
    """
    A catalog entry's installed is no, installing or yes, and managed a boolean; its
    licence may leave out notes.
    """
    entry = {
        "id": "tone", "displayName": "Tone", "installed": "yes", "managed": False,
        "license": {"code": "MIT", "weights": "MIT", "weightsCommercialUse": True},
    }
    validate(CATALOG_ENTRY, entry)
    with pytest.raises(BadRequest) as caught:
        validate(CATALOG_ENTRY, {**entry, "installed": "maybe"})
    assert caught.value.field == "installed"
    with pytest.raises(BadRequest) as caught:
        validate(CATALOG_ENTRY, {**entry, "managed": "no"})
    assert caught.value.field == "managed"


def test_engine_summaries_may_carry_the_worker_version_and_outdated() -> None:
    """
    An engine summary validates with section 9's workerVersion and outdated, and
    without them; outdated is a boolean.
    """
    summary = {"id": "tone", "process": "down", "model": "unloaded", "restarts": 0}
    validate(ENGINE_SUMMARY, summary)
    validate(ENGINE_SUMMARY, {**summary, "workerVersion": "0.1.0", "outdated": False})
    assert {"workerVersion", "outdated"} <= set(ENGINE_SUMMARY["properties"])
    with pytest.raises(BadRequest) as caught:
        validate(ENGINE_SUMMARY, {**summary, "workerVersion": "0.1.0", "outdated": "yes"})
    assert caught.value.field == "outdated"


@pytest.fixture
def h(tmp_path: Path) -> Any:
    harness = Harness(tmp_path)
    yield harness
    harness.close()


def test_the_settings_answers_validate(h: Harness) -> None:
    """
    GET /settings, and PATCH /settings's answer with a setting waiting for a restart
    (saved) and a new token (saved: true), validate against Settings; the patch itself
    validates against SettingsPatch.
    """
    app = build_core(Registry({}), reactor=MemoryReactorClock(), settings_api=h.settings)
    head, document = _exchange(app, b"GET /settings HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    validate(SETTINGS, document)
    patch = {
        "server": {"port": 9090},
        "management": {"token": "another-token-of-thirty-two-chars"},
        "engines": {"tone": {"keepAliveSeconds": 60}},
    }
    validate(SETTINGS_PATCH, patch)
    body = json.dumps(patch).encode()
    head, document = _exchange(
        app,
        b"PATCH /settings HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body),
        reactor=h.reactor,
    )
    assert head.startswith(b"HTTP/1.1 200"), (head, document)
    validate(SETTINGS, document)
    saved = {field["key"]: field.get("saved") for field in document["fields"]}
    assert saved["server.port"] == 9090 and saved["management.token"] is True


@pytest.mark.parametrize(
    "patch",
    [{"server": None}, {"residency": {"keepAliveSeconds": None}}, {"engines": {"tone": None}}, {"engines": None}],
)
def test_a_patch_that_clears_validates(patch: dict[str, Any]) -> None:
    """
    null clears a setting, a section, an engine's settings or every engine's: each is a
    valid SettingsPatch.
    """
    validate(SETTINGS_PATCH, patch)


def test_a_patch_that_is_not_an_object_is_refused() -> None:
    """
    A settings patch is an object of sections, each an object or null.
    """
    with pytest.raises(BadRequest):
        validate(SETTINGS_PATCH, [])
    with pytest.raises(BadRequest) as caught:
        validate(SETTINGS_PATCH, {"server": 8080})
    assert caught.value.field == "server"


def _steps(*names: str, fail: str | None = None, lines: int = 1) -> Callable[[JobContext], Awaitable[None]]:
    async def work(context: JobContext) -> None:
        for name in names:
            context.step(name)
            for n in range(lines):
                context.log(f"$ step {name} line {n}")
            if name == fail:
                raise JobFailed(Internal(f"{name} failed: exit 1"))

    return work


def _frames(raw: bytes) -> list[dict[str, str]]:
    """
    The frames of a server-sent event body, each as its fields; a comment is
    {"comment": text}.
    """
    frames = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        fields: dict[str, str] = {}
        for line in block.split("\n"):
            name, _, value = line.partition(":")
            fields[name or "comment"] = value.strip()
        frames.append(fields)
    return frames


def test_jobs_and_their_events_validate() -> None:
    """
    A succeeded install that pulls, a failed reinstall (with its error) and a queued
    pull behind a running one validate against InstallJob, and a list of them against
    InstallJobList; every event of each is a FeedEvent whose frame names its id and kind,
    the last a progress whose status is not running.
    """
    jobs = Jobs(Clock())
    done = jobs.submit("kokoro", "install", _steps("venv", "packages", "verify", "register", "weights"), variant="v1")
    failed = jobs.submit("piper", "reinstall", _steps("venv", "packages", fail="packages"))
    never: Deferred[None] = Deferred()

    async def waits(context: JobContext) -> None:
        context.step("weights")
        await never

    running = jobs.submit("espeak", "pull", waits, variant="base")
    queued = jobs.submit("tone", "pull", waits, variant="base")
    documents = [job.document() for job in (done, failed, running, queued)]
    assert [d["state"] for d in documents] == ["succeeded", "failed", "running", "queued"]
    for document in documents:
        validate(INSTALL_JOB, document)
    validate(INSTALL_JOB_LIST, jobs.documents(jobs.all()))
    assert documents[1]["error"]["code"] == "internal" and documents[1]["step"] == "packages"
    for job in (done, failed):
        _, frames = job.events.after(0)
        events = []
        for number, raw in frames:
            [frame] = _frames(raw)
            event = json.loads(frame["data"])
            validate(FEED_EVENT, event)
            assert int(frame["id"]) == event["id"] == number and frame["event"] == event["kind"]
            assert event["correlationId"] == job.id
            events.append(event)
        assert events[-1]["kind"] == "progress" and events[-1]["progress"]["status"] != "running"
        assert all(e["progress"]["status"] == "running" for e in events[:-1] if e["kind"] == "progress")
    never.cancel()


def _stream(app: Core, request: bytes) -> list[dict[str, str]]:
    """
    The frames an event stream has written so far (it stays open).
    """
    channel = app.site().buildProtocol(IPv4Address("TCP", "127.0.0.1", 8080))
    transport = StringTransport(peerAddress=IPv4Address("TCP", "127.0.0.1", 40000))
    channel.makeConnection(transport)
    channel.dataReceived(request)
    head, _, body = transport.value().partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"text/event-stream" in head.lower()
    chunks, rest = [], body
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        chunks.append(rest[: int(size, 16)])
        rest = rest[int(size, 16) + 2 :]
    channel.connectionLost(Failure(ConnectionDone()))
    return _frames(b"".join(chunks))


def test_the_event_stream_is_what_the_document_says() -> None:
    """
    Over the core's own site, GET /installs/{job}/events opens with a comment, sends
    each event as id, event named after its kind, and a FeedEvent as data; resumes after
    Last-Event-ID or ?lastEventId=; and sends resync first to a client whose resume
    point has left the replay buffer.  GET /installs and /installs/{job} validate too.
    """
    app = build_core(Registry({}), reactor=MemoryReactorClock())
    job = app.jobs.submit("kokoro", "install", _steps("venv", "packages", "verify", "register"))
    get_job = b"GET /installs/%s HTTP/1.1\r\nHost: localhost\r\n\r\n" % job.id.encode()
    head, document = _exchange(app, get_job)
    assert head.startswith(b"HTTP/1.1 200"), head
    validate(INSTALL_JOB, document)
    head, listed = _exchange(app, b"GET /installs HTTP/1.1\r\nHost: localhost\r\n\r\n")
    validate(INSTALL_JOB_LIST, listed)
    path = b"/installs/%s/events" % job.id.encode()
    frames = _stream(app, b"GET %s HTTP/1.1\r\nHost: localhost\r\n\r\n" % path)
    assert frames[0] == {"comment": "following " + job.id}
    events = [json.loads(frame["data"]) for frame in frames[1:]]
    for frame, event in zip(frames[1:], events):
        validate(FEED_EVENT, event)
        assert frame["event"] == event["kind"] and int(frame["id"]) == event["id"]
    assert events[-1]["progress"]["status"] == "done"
    resumed = _stream(app, b"GET %s HTTP/1.1\r\nHost: localhost\r\nLast-Event-ID: 3\r\n\r\n" % path)
    assert [int(frame["id"]) for frame in resumed[1:]] == [event["id"] for event in events[3:]]
    queried = _stream(app, b"GET %s?lastEventId=3 HTTP/1.1\r\nHost: localhost\r\n\r\n" % path)
    assert queried == resumed

    long = app.jobs.submit("piper", "install", _steps("venv", lines=REPLAY_EVENTS + 5))
    path = b"/installs/%s/events" % long.id.encode()
    behind = _stream(app, b"GET %s HTTP/1.1\r\nHost: localhost\r\nLast-Event-ID: 1\r\n\r\n" % path)
    assert behind[1] == {"event": "resync", "data": "{}"}
    validate(FEED_EVENT, json.loads(behind[2]["data"]))


def test_the_outdated_answer_validates(tmp_path: Path) -> None:
    """
    POST /installs/outdated's answer, as the installer builds it, with a reinstall
    queued and an engine skipped for each reason (licence, busy, uncatalogued),
    validates against OutdatedReinstalls.
    """
    store = StateStore.open(tmp_path / "rhapsode.db")
    for engine_id in ("alpha", "beta", "delta", "gamma"):
        store.put_engine(InstalledEngine(engine_id, {"module": f"rhapsode_engine_{engine_id}"}, None))
    database = StateDatabase(store, ThreadedReactor())
    catalog = Catalog([record("alpha"), record("beta", commercial=False), record("delta")], "0.2.0")
    for engine_id in ("alpha", "beta", "delta", "gamma"):
        catalog.declare(engine_id, f"rhapsode_engine_{engine_id}", venv(tmp_path / engine_id, "0.1.0"))
    jobs = Jobs(Clock())
    never: Deferred[None] = Deferred()

    async def busy(context: JobContext) -> None:
        await never

    jobs.submit("delta", "pull", busy, variant="base")

    residency = Residency(clock=Clock(), settings=Settings(), terminate=lambda _: succeed(None),
                          unload=lambda _: succeed(None))
    installer = Installer(
        reactor=MemoryReactorClock(),
        jobs=jobs,
        catalog=catalog,
        state=database,
        host=FakeHost(catalog, residency, registered_ids={"alpha", "beta", "delta", "gamma"}),
        venv_dir=lambda: tmp_path / "venvs",
        source_dir=lambda: None,
        interpreter=lambda: None,
        runner=FakeRunner(),
        environ={},
        core_version="0.2.0",
    )
    try:
        answer = installer.outdated()
        validate(OUTDATED_REINSTALLS, answer)
        assert [job["engine"] for job in answer["jobs"]] == ["alpha"]
        assert answer["jobs"][0]["kind"] == "reinstall"
        assert {s["engine"]: s["reason"] for s in answer["skipped"]} == {
            "beta": "licence", "delta": "busy", "gamma": "uncatalogued",
        }
    finally:
        never.cancel()
        database.close()
