"""
The update check (L{rhapsode._manage.update}, protocol.md section 9, "The core asks whether it is
current"): lazy on a Clock, a day for an answer and six hours after a failure, POST
/update/check's five minutes and its shared flight, the ten-second timeout, off by the
setting (live) or the environment, the x.y.z comparison, what is asked of GitHub and
with which headers, and the two open routes on the real router.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from treq.testing import StubTreq
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource
from twisted.web.server import Request
from zope.interface import implementer
from zope.interface.verify import verifyObject

import rhapsode
from rhapsode._config import RELEASES_URL, ConfigError, parse_config
from rhapsode._http.table import CORS_ROUTES, MANAGEMENT, UPDATE, UPDATE_CHECK
from rhapsode._manage.settings import applies
from rhapsode._manage.update import (
    FRESH_SECONDS,
    RECENT_SECONDS,
    RETRY_SECONDS,
    TIMEOUT_SECONDS,
    GitHubReleases,
    IReleaseSource,
    Release,
    ReleaseError,
    UpdateChecker,
    checker_for,
    distribution,
    environment_allows,
    newer,
    read_release,
    user_agent,
)
from rhapsode.client import BadRequest
from rhapsode.testing import FakeEngine, StubRhapsode
from rhapsode_protocol.contract import UPDATE_STATUS, public_openapi, validate

from test_settings import Harness

CASE = SynchronousTestCase()
RELEASE = Release("v0.2.0", "https://github.com/maroonedsoftware/rhapsode/releases/tag/v0.2.0")
ONLY_WITH_OK = {"latest", "updateAvailable", "releaseUrl", "checkedAt"}


@implementer(IReleaseSource)
class FakeSource:
    """
    A release source whose every ask is a Deferred the test fires; C{asked} holds them.
    """

    url = "https://releases.example/latest"

    def __init__(self) -> None:
        self.asked: list[Deferred[Release]] = []
        self.cancelled = 0

    def latest(self) -> "Deferred[Release]":
        def cancel(d: Deferred[Release]) -> None:
            self.cancelled += 1

        asked: Deferred[Release] = Deferred(cancel)
        self.asked.append(asked)
        return asked


class Switch:
    """
    The setting, as the service reads it on each request.
    """

    def __init__(self) -> None:
        self.on = True

    def __call__(self) -> bool:
        return self.on


def checker(version: str = "0.1.9", distribution: str = "source") -> tuple[UpdateChecker, FakeSource, Clock, Switch]:
    clock = Clock()
    clock.advance(1_790_000_000)  # 2026-09-21, so checkedAt reads as a real date
    source = FakeSource()
    switch = Switch()
    return UpdateChecker(clock=clock, source=source, version=version, enabled=switch, distribution=distribution), source, clock, switch


def test_the_fakes_provide_the_interface() -> None:
    """
    The fake source and the real one both provide IReleaseSource.
    """
    verifyObject(IReleaseSource, FakeSource())
    verifyObject(IReleaseSource, GitHubReleases(Clock(), "0.1.0", http=StubTreq(Resource())))


def test_a_first_status_is_pending_and_starts_exactly_one_check() -> None:
    """
    GET /update with no answer starts one check and answers pending at once, with only
    version, check and distribution; asking again while it is in flight starts no other.
    """
    updates, source, clock, _ = checker()
    first = updates.status()
    assert first == {"version": "0.1.9", "check": "pending", "distribution": "source"}
    assert updates.status() == first
    assert len(source.asked) == 1 and updates.in_flight


def test_an_answer_is_ok_with_latest_available_url_and_when() -> None:
    """
    Once the source answers: ok, latest without its v, updateAvailable from the
    comparison, the release's page, and checkedAt in ISO 8601 UTC with milliseconds.
    """
    updates, source, clock, _ = checker()
    updates.status()
    clock.advance(1.5)
    source.asked[0].callback(RELEASE)
    document = updates.status()
    assert document == {
        "version": "0.1.9",
        "check": "ok",
        "latest": "0.2.0",
        "updateAvailable": True,
        "releaseUrl": RELEASE.url,
        "checkedAt": "2026-09-21T14:13:21.500Z",
        "distribution": "source",
    }
    validate(UPDATE_STATUS, document)
    assert len(source.asked) == 1


def test_an_answer_stands_for_a_day_and_a_stale_one_is_shown_while_asking_again() -> None:
    """
    No second check before a day has passed; at a day, one starts in the background and
    the answer held is still what the route shows until the new one arrives.
    """
    updates, source, clock, _ = checker()
    updates.status()
    source.asked[0].callback(RELEASE)
    clock.advance(FRESH_SECONDS - 1)
    updates.status()
    assert len(source.asked) == 1
    clock.advance(1)
    stale = updates.status()
    assert len(source.asked) == 2 and stale["check"] == "ok" and stale["latest"] == "0.2.0"
    source.asked[1].callback(Release("v0.3.0", "https://example.test/r/0.3.0"))
    assert updates.status()["latest"] == "0.3.0"


def test_a_failed_check_is_failed_without_the_ok_fields_and_retried_after_six_hours() -> None:
    """
    A failure reads check: failed and nothing else; the next status within six hours
    asks nothing, and the first one after starts one check.
    """
    updates, source, clock, _ = checker()
    updates.status()
    source.asked[0].errback(ReleaseError("the release source answered 403"))
    assert updates.status() == {"version": "0.1.9", "check": "failed", "distribution": "source"}
    clock.advance(RETRY_SECONDS - 1)
    updates.status()
    assert len(source.asked) == 1
    clock.advance(1)
    updates.status()
    assert len(source.asked) == 2


def test_a_failure_replaces_an_older_answer() -> None:
    """
    check says what the last attempt got: an ok a day old, then a failure, reads failed.
    """
    updates, source, clock, _ = checker()
    updates.status()
    source.asked[0].callback(RELEASE)
    clock.advance(FRESH_SECONDS)
    updates.status()
    source.asked[1].errback(ReleaseError("unreachable"))
    assert set(updates.status()) == {"version", "check", "distribution"}


def test_the_check_times_out_after_ten_seconds_and_abandons_the_request() -> None:
    """
    A source that never answers is cancelled at the check's ten-second timeout, and the
    check reads failed.
    """
    updates, source, clock, _ = checker()
    updates.status()
    clock.advance(TIMEOUT_SECONDS - 0.1)
    assert updates.status()["check"] == "pending"
    clock.advance(0.1)
    assert source.cancelled == 1
    assert updates.status()["check"] == "failed" and not updates.in_flight


def test_check_now_waits_for_the_answer() -> None:
    """
    POST /update/check with nothing held asks, and answers only once the source has.
    """
    updates, source, clock, _ = checker()
    answered = Deferred.fromCoroutine(updates.check_now())
    CASE.assertNoResult(answered)
    source.asked[0].callback(RELEASE)
    assert CASE.successResultOf(answered)["check"] == "ok"


def test_check_now_joins_a_check_in_flight() -> None:
    """
    Requests arriving while a check is in flight (a background one included) wait for
    that one: the source is asked once.
    """
    updates, source, clock, _ = checker()
    updates.status()
    first = Deferred.fromCoroutine(updates.check_now())
    second = Deferred.fromCoroutine(updates.check_now())
    assert len(source.asked) == 1
    source.asked[0].callback(RELEASE)
    one, other = CASE.successResultOf(first), CASE.successResultOf(second)
    assert one == other and one["latest"] == "0.2.0"


def test_check_now_returns_an_answer_under_five_minutes_old_as_it_is() -> None:
    """
    Pressed again and again, POST /update/check asks at most once in five minutes: an
    answer younger than that comes back without asking, an older one is asked again.
    """
    updates, source, clock, _ = checker()
    first = Deferred.fromCoroutine(updates.check_now())
    source.asked[0].callback(RELEASE)
    CASE.successResultOf(first)
    for _ in range(10):
        clock.advance((RECENT_SECONDS - 1) / 10)
        assert CASE.successResultOf(Deferred.fromCoroutine(updates.check_now()))["check"] == "ok"
    assert len(source.asked) == 1
    clock.advance(1)
    again = Deferred.fromCoroutine(updates.check_now())
    assert len(source.asked) == 2
    source.asked[1].callback(Release("v0.2.1", "https://example.test/r"))
    assert CASE.successResultOf(again)["latest"] == "0.2.1"


def test_a_failure_from_check_now_is_an_answer_and_the_six_hour_retry_follows() -> None:
    """
    The source failing is check: failed (not an error), that answer counts as recent for
    five minutes, and GET /update waits six hours before asking again.
    """
    updates, source, clock, _ = checker()
    answered = Deferred.fromCoroutine(updates.check_now())
    source.asked[0].errback(ConnectionRefusedError())
    assert CASE.successResultOf(answered)["check"] == "failed"
    CASE.successResultOf(Deferred.fromCoroutine(updates.check_now()))
    clock.advance(RETRY_SECONDS - 1)
    updates.status()
    assert len(source.asked) == 1


def test_check_now_waits_at_most_the_checks_timeout() -> None:
    """
    POST /update/check against a source that never answers answers check: failed at the
    ten-second timeout, not later, and the request to the source is abandoned.
    """
    updates, source, clock, _ = checker()
    answered = Deferred.fromCoroutine(updates.check_now())
    clock.advance(TIMEOUT_SECONDS - 0.01)
    CASE.assertNoResult(answered)
    clock.advance(0.01)
    assert CASE.successResultOf(answered)["check"] == "failed" and source.cancelled == 1


def test_an_answer_from_check_now_stands_for_a_day() -> None:
    """
    An answer POST /update/check got is held like any other: GET /update asks nothing
    more until a day after it.
    """
    updates, source, clock, _ = checker()
    answered = Deferred.fromCoroutine(updates.check_now())
    source.asked[0].callback(RELEASE)
    CASE.successResultOf(answered)
    clock.advance(FRESH_SECONDS - 1)
    assert updates.status()["check"] == "ok" and len(source.asked) == 1
    clock.advance(1)
    updates.status()
    assert len(source.asked) == 2


def test_a_caller_that_goes_away_does_not_cancel_the_shared_check() -> None:
    """
    Cancelling one waiting POST (its client hung up) cancels its wait only: the check
    goes on, and another waiter still gets the answer.
    """
    updates, source, clock, _ = checker()
    leaving = Deferred.fromCoroutine(updates.check_now())
    staying = Deferred.fromCoroutine(updates.check_now())
    leaving.cancel()
    CASE.failureResultOf(leaving, CancelledError)
    assert source.cancelled == 0
    source.asked[0].callback(RELEASE)
    assert CASE.successResultOf(staying)["check"] == "ok"


def test_off_asks_nothing_and_the_setting_applies_at_once() -> None:
    """
    With the check off, GET and POST answer check: off, with nothing else but version
    and distribution, and never ask; turned back on, the next request asks.
    """
    updates, source, clock, switch = checker(distribution="docker")
    switch.on = False
    assert updates.status() == {"version": "0.1.9", "check": "off", "distribution": "docker"}
    assert CASE.successResultOf(Deferred.fromCoroutine(updates.check_now()))["check"] == "off"
    clock.advance(FRESH_SECONDS * 3)
    updates.status()
    assert source.asked == []
    switch.on = True
    assert updates.status()["check"] == "pending" and len(source.asked) == 1


def test_turning_it_off_hides_an_answer_already_held() -> None:
    """
    off wins over an ok answer held from before: the route says off, not the old release.
    """
    updates, source, clock, switch = checker()
    updates.status()
    source.asked[0].callback(RELEASE)
    switch.on = False
    assert updates.status()["check"] == "off" and "latest" not in updates.status()


@pytest.mark.parametrize(
    ("latest", "current", "expected"),
    [
        ("0.2.0", "0.1.9", True),
        ("v0.1.10", "0.1.9", True),
        ("1.0.0", "0.9.9", True),
        ("0.1.9", "0.1.9", False),
        ("0.1.8", "0.1.9", False),  # a core newer than the latest: no downgrade
        ("0.1.10", "0.2.0.dev3", False),
        ("0.2.0", "0.2.0rc1", True),  # a prerelease of the same numbers is behind
        ("0.2.0", "0.2.0.dev3", True),
        ("0.2.0", "0.2.0-rc.1", True),
        ("0.2.0", "0.2.0+local", False),
        ("0.2.0", "0.2.0.post1", False),
        ("0.2.0-rc1", "0.1.0", False),  # a latest that is not x.y.z offers nothing
        ("0.2", "0.1.0", False),
        ("latest", "0.1.0", False),
        ("0.2.0", "unknown", False),
    ],
)
def test_newer_compares_x_y_z_releases(latest: str, current: str, expected: bool) -> None:
    """
    updateAvailable's comparison: x.y.z numerically, no downgrade, prereleases of the
    running core behind their release, and an unparsable latest offering nothing.
    """
    assert newer(latest, current) is expected


def test_an_unparsable_or_prerelease_latest_is_ok_but_offers_nothing() -> None:
    """
    A tag that is not x.y.z, or one the source marks a prerelease, is reported as the
    latest with updateAvailable false.
    """
    updates, source, clock, _ = checker()
    updates.status()
    source.asked[0].callback(Release("nightly", "https://example.test/n"))
    assert (updates.status()["latest"], updates.status()["updateAvailable"]) == ("nightly", False)
    clock.advance(FRESH_SECONDS)
    updates.status()
    source.asked[1].callback(Release("v9.0.0", "https://example.test/9", prerelease=True))
    assert updates.status()["updateAvailable"] is False


@pytest.mark.parametrize(
    ("code", "body", "why"),
    [
        (403, b'{"message": "API rate limit exceeded"}', "answered 403"),
        (200, b"<html>", "not JSON"),
        (200, b"[" * 1100 + b"]" * 1100, "not JSON"),
        (200, b"[]", "not a JSON object"),
        (200, b'{"html_url": "https://x.test/r"}', "no tag_name"),
        (200, b'{"tag_name": "v1.0.0"}', "no html_url"),
        (200, b'{"tag_name": "v1.0.0", "html_url": "javascript:alert(1)"}', "no html_url"),
    ],
)
def test_an_answer_that_is_not_a_release_is_a_failure(code: int, body: bytes, why: str) -> None:
    """
    A refusal, a body that is not a JSON object (nor JSON nested too deep to parse), or
    one without tag_name or an http(s) html_url is ReleaseError saying which.
    """
    with pytest.raises(ReleaseError, match=why):
        read_release(code, body)


def test_a_release_is_read_with_its_tag_page_and_prerelease_mark() -> None:
    """
    tag_name and html_url make the release; draft or prerelease true marks it.
    """
    release = read_release(200, b'{"tag_name": "v0.2.0", "html_url": "https://x.test/r", "prerelease": false}')
    assert (release.tag, release.version, release.url, release.prerelease) == ("v0.2.0", "0.2.0", "https://x.test/r", False)
    assert read_release(200, b'{"tag_name": "0.3.0", "html_url": "https://x.test/r", "draft": true}').prerelease


class FakeGitHub(Resource):
    """
    GitHub's latest-release route: answers C{code} and C{body}, and records each
    request's headers.
    """

    isLeaf = True

    def __init__(self, code: int = 200, body: Any = None) -> None:
        super().__init__()
        self.code = code
        self.body = body if body is not None else {"tag_name": "v0.2.0", "html_url": "https://github.test/r/v0.2.0"}
        self.requests: list[tuple[bytes, bytes, dict[bytes, list[bytes]]]] = []

    def render(self, request: Request) -> bytes:
        headers = {name.lower(): values for name, values in request.requestHeaders.getAllRawHeaders()}
        self.requests.append((request.method, request.uri, headers))
        request.setResponseCode(self.code)
        return self.body if isinstance(self.body, bytes) else json.dumps(self.body).encode()


def test_github_is_asked_with_a_user_agent_naming_rhapsode_and_nothing_else() -> None:
    """
    The real source GETs the configured URL with Accept, the API version and a
    User-Agent of rhapsode/<version>, and nothing else about the box: no token, no
    cookie, no identifier.
    """
    github = FakeGitHub()
    http = StubTreq(github)
    source = GitHubReleases(Clock(), "0.1.9", url="https://api.github.test/repos/o/r/releases/latest", http=http)
    asked = source.latest()
    http.flush()
    release = CASE.successResultOf(asked)
    assert (release.version, release.url) == ("0.2.0", "https://github.test/r/v0.2.0")
    [(method, uri, headers)] = github.requests
    assert (method, uri, headers[b"host"]) == (b"GET", b"/repos/o/r/releases/latest", [b"api.github.test"])
    assert headers[b"user-agent"] == [b"rhapsode/0.1.9"] == [user_agent("0.1.9").encode()]
    assert headers[b"accept"] == [b"application/vnd.github+json"]
    assert set(headers) <= {b"user-agent", b"accept", b"accept-encoding", b"x-github-api-version", b"host", b"connection", b"content-length"}


def test_github_refusing_is_a_release_error() -> None:
    """
    GitHub's 403 (rate limited) fails the ask with ReleaseError naming the status.
    """
    http = StubTreq(FakeGitHub(403, {"message": "API rate limit exceeded"}))
    asked = GitHubReleases(Clock(), "0.1.9", http=http).latest()
    http.flush()
    assert "403" in str(CASE.failureResultOf(asked, ReleaseError).value)


def test_the_default_url_is_the_repository_in_the_spec() -> None:
    """
    The release source is the spec's repository's latest release, on GitHub's API.
    """
    assert RELEASES_URL == "https://api.github.com/repos/maroonedsoftware/rhapsode/releases/latest"
    assert parse_config({}, Path(".")).update.url == RELEASES_URL


@pytest.mark.parametrize(
    ("environ", "allowed"),
    [({}, True), ({"RHAPSODE_UPDATE_CHECK": "0"}, False), ({"RHAPSODE_UPDATE_CHECK": "false"}, False),
     ({"RHAPSODE_UPDATE_CHECK": "OFF"}, False), ({"RHAPSODE_UPDATE_CHECK": "1"}, True)],
)
def test_the_environment_can_only_turn_it_off(environ: dict[str, str], allowed: bool) -> None:
    """
    RHAPSODE_UPDATE_CHECK=0 (false, no, off) turns the check off; any other value leaves
    it to the setting, which cannot overrule the environment's off.
    """
    assert environment_allows(environ) is allowed
    source = FakeSource()
    updates = checker_for(Clock(), "0.1.0", RELEASES_URL, lambda: True, environ, source=source)
    assert (updates.status()["check"] == "off") is (not allowed)
    assert len(source.asked) == (1 if allowed else 0)
    never = checker_for(Clock(), "0.1.0", RELEASES_URL, lambda: False, environ, source=source)
    assert never.status()["check"] == "off"


def test_distribution_is_docker_only_where_the_image_says_so() -> None:
    """
    RHAPSODE_DISTRIBUTION=docker (the published image's) gives docker; anything else source.
    """
    assert distribution({"RHAPSODE_DISTRIBUTION": "docker"}) == "docker"
    assert distribution({}) == distribution({"RHAPSODE_DISTRIBUTION": "pip"}) == "source"
    env = {"RHAPSODE_DISTRIBUTION": "docker", "RHAPSODE_UPDATE_CHECK": "0"}
    assert checker_for(Clock(), "0.1.0", RELEASES_URL, lambda: True, env).status()["distribution"] == "docker"


# -- the setting -----------------------------------------------------------------------


def test_update_check_is_a_live_setting_and_update_url_waits(tmp_path: Path) -> None:
    """
    update.check applies as soon as it is written (the config handed on says false);
    update.url is read at start; a value that is not a boolean is refused naming the key.
    """
    assert applies("update.check") == "live" and applies("update.url") == "restart"
    h = Harness(tmp_path)
    try:
        assert h.settings.document()["values"]["update"] == {"check": True, "url": RELEASES_URL}
        document = h.patch({"update": {"check": False}})
        assert document["values"]["update"]["check"] is False
        assert h.changed[-1].update.check is False
        refused = h.refused({"update": {"check": "maybe"}})
        assert isinstance(refused, BadRequest) and refused.field == "update.check"
        refused = h.refused({"update": {"url": "ftp://x"}})
        assert refused.field == "update.url"
        assert h.database.settings() == {"update.check": False}
    finally:
        h.close()


def test_the_config_file_turns_it_off() -> None:
    """
    update.check: false in the file is the config's answer; a non-boolean fails the start.
    """
    assert parse_config({"update": {"check": False}}, Path(".")).update.check is False
    with pytest.raises(ConfigError, match="update.check"):
        parse_config({"update": {"check": "no"}}, Path("."))


# -- the routes ------------------------------------------------------------------------


def stub_with(updates: UpdateChecker | None = None, peer: str = "127.0.0.1") -> tuple[StubRhapsode, FakeSource, Switch]:
    stub = StubRhapsode({"tone": FakeEngine()}, peer=peer)
    source, switch = FakeSource(), Switch()
    stub.core.updates = updates or UpdateChecker(
        clock=stub.clock, source=source, version=rhapsode.__version__, enabled=switch
    )
    return stub, source, switch


def test_the_routes_answer_pending_then_ok_to_a_remote_caller() -> None:
    """
    GET /update and POST /update/check are open routes: a caller on another machine,
    with no token, gets pending, then the answer once the source gave it.
    """
    stub, source, _ = stub_with(peer="192.0.2.7")
    client = stub.client()
    assert CASE.successResultOf(Deferred.fromCoroutine(client.update()))["check"] == "pending"
    posted = Deferred.fromCoroutine(client.check_update())
    stub.flush()
    CASE.assertNoResult(posted)
    source.asked[0].callback(Release("v99.0.0", "https://github.test/r/v99.0.0"))
    stub.flush()
    document = CASE.successResultOf(posted)
    assert (document["check"], document["latest"], document["updateAvailable"]) == ("ok", "99.0.0", True)
    assert len(source.asked) == 1


def test_a_post_with_a_body_is_refused_naming_it() -> None:
    """
    POST /update/check takes no body: anything but nothing (or {}) is bad_request on body.
    """
    stub, source, _ = stub_with()
    response = CASE.successResultOf(stub.http.post(stub.base_url + UPDATE_CHECK, data=b'{"force": true}'))
    stub.flush()
    assert response.code == 400
    envelope = json.loads(CASE.successResultOf(response.content()))
    assert (envelope["error"]["code"], envelope["error"]["field"]) == ("bad_request", "body")
    assert source.asked == []


def test_nothing_about_the_check_reaches_health() -> None:
    """
    /health carries no field of the update check, and asking it starts no check.
    """
    stub, source, _ = stub_with()
    health = CASE.successResultOf(Deferred.fromCoroutine(stub.client().health()))
    assert not set(health) & {"check", "latest", "updateAvailable", "update", "releaseUrl"}
    assert source.asked == []


def test_the_routes_are_open_cors_routes_and_in_the_openapi_document() -> None:
    """
    Both are in CORS_ROUTES and not management routes; the public document describes
    both, answering UpdateStatus.
    """
    assert {("GET", UPDATE), ("POST", UPDATE_CHECK)} <= CORS_ROUTES
    assert not {("GET", UPDATE), ("POST", UPDATE_CHECK)} & MANAGEMENT
    document = public_openapi("0.1.0")
    for path, method in (("/update", "get"), ("/update/check", "post")):
        ok = document["paths"][path][method]["responses"]["200"]["content"]["application/json"]["schema"]
        assert ok == {"$ref": "#/components/schemas/UpdateStatus"}
    assert document["components"]["schemas"]["UpdateStatus"] == UPDATE_STATUS


def test_a_core_built_without_a_checker_has_githubs_on_its_reactor() -> None:
    """
    An embedded core gets the spec's default: GitHub's API, checked lazily (nothing is
    asked until a request), on unless the environment turned it off.
    """
    stub = StubRhapsode({"tone": FakeEngine()})
    updates = stub.core.updates
    assert isinstance(updates, UpdateChecker) and not updates.in_flight
    assert stub.clock.tcpClients == []
