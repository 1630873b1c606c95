"""
Whether a newer release of rhapsode exists (protocol.md section 9, "The core asks
whether it is current"): C{GET /update} and C{POST /update/check}.

The check is lazy.  There is no timer: a status asked for with no answer held, or with
one past its time (a day for an answer, six hours for a failure), starts one check in
the background and is answered at once with what there is.  A check asked for now
(L{UpdateChecker.check_now}) waits for GitHub, at most the check's own timeout, but
returns an answer under five minutes old as it is and joins a check already in flight,
so an open route cannot make the box phone out more than once in five minutes.

Where the answer comes from is an L{IReleaseSource}: L{GitHubReleases} asks GitHub's
API through treq on the injected reactor; tests give a fake.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Mapping
from urllib.parse import urlsplit

from twisted.internet.defer import Deferred
from twisted.logger import Logger
from zope.interface import Attribute, Interface, implementer

from rhapsode_protocol.validation import TooDeep, loads_json

from .._config import RELEASES_URL

#: How long an answer stands, and how long after a failure the next check waits.
FRESH_SECONDS = 24 * 3600.0
RETRY_SECONDS = 6 * 3600.0
#: An answer younger than this is what C{POST /update/check} returns without asking.
RECENT_SECONDS = 5 * 60.0
#: The check's own timeout: the longest C{POST /update/check} waits.
TIMEOUT_SECONDS = 10.0
#: The most of GitHub's answer read; a release document is a few KiB.
ANSWER_LIMIT = 1024 * 1024
#: The environment variable that turns the check off (it cannot turn it on).
ENV_CHECK = "RHAPSODE_UPDATE_CHECK"
#: The environment variable the published image sets to C{docker}.
ENV_DISTRIBUTION = "RHAPSODE_DISTRIBUTION"

_OFF_WORDS = frozenset({"0", "false", "no", "off"})
_RELEASE = re.compile(r"v?([0-9]+)\.([0-9]+)\.([0-9]+)", re.ASCII)
_OWN = re.compile(r"([0-9]+)\.([0-9]+)\.([0-9]+)(.*)", re.ASCII | re.DOTALL)


class ReleaseError(Exception):
    """
    The release source did not give an answer: unreachable, refused, or not a release.
    """


@dataclass(frozen=True)
class Release:
    """
    The latest release as the source named it.

    @ivar tag: its tag, as given (C{v0.2.0}); C{version} is the tag without its C{v}.
    @ivar url: the page of the release, for a person.
    @ivar prerelease: whether the source marked it a draft or a prerelease.
    """

    tag: str
    url: str
    prerelease: bool = False

    @property
    def version(self) -> str:
        return self.tag[1:] if self.tag[:1] in ("v", "V") else self.tag


class IReleaseSource(Interface):
    """
    Where the latest release is learnt from.
    """

    url = Attribute("What is asked, for the log: a URL.")

    def latest() -> "Deferred[Release]":
        """
        Ask for the latest release.  Called on the reactor thread; never blocks.  The
        Deferred fails with L{ReleaseError} (or the connection's own failure) when no
        release came back, and cancelling it abandons the request.
        """


def user_agent(version: str) -> str:
    """
    The User-Agent of the check: rhapsode and its version, and nothing else about the box.
    """
    return f"rhapsode/{version}"


def read_release(code: int, body: bytes) -> Release:
    """
    A GitHub "latest release" answer as a L{Release}; L{ReleaseError} saying what is
    wrong with anything else.
    """
    if code != 200:
        raise ReleaseError(f"the release source answered {code}")
    try:
        document = loads_json(body)
    except (TooDeep, ValueError):
        raise ReleaseError("the release source's answer is not JSON") from None
    if not isinstance(document, dict):
        raise ReleaseError("the release source's answer is not a JSON object")
    tag = document.get("tag_name")
    if not isinstance(tag, str) or not tag.strip():
        raise ReleaseError("the release source's answer has no tag_name")
    url = document.get("html_url")
    if not isinstance(url, str) or urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).netloc:
        raise ReleaseError("the release source's answer has no html_url")
    prerelease = document.get("prerelease") is True or document.get("draft") is True
    return Release(tag.strip(), url, prerelease)


@implementer(IReleaseSource)
class GitHubReleases:
    """
    GitHub's API for a repository's latest release, asked through treq.

    @param http: the treq client to ask with (C{StubTreq} in tests); by default one on
        C{reactor}'s own agent, without a persistent pool: it asks once a day at most,
        and leaves no connection behind to close at shutdown.
    """

    def __init__(self, reactor: Any, version: str, url: str = RELEASES_URL, http: Any = None) -> None:
        self.url = url
        self._version = version
        if http is None:
            from treq.client import HTTPClient
            from twisted.web.client import Agent

            http = HTTPClient(Agent(reactor))
        self._http = http

    def latest(self) -> "Deferred[Release]":
        from .._upstream import collect

        async def ask() -> Release:
            response = await self._http.request(
                "GET",
                self.url,
                headers={
                    b"Accept": [b"application/vnd.github+json"],
                    b"X-GitHub-Api-Version": [b"2022-11-28"],
                    b"User-Agent": [user_agent(self._version).encode("ascii", "replace")],
                },
                unbuffered=True,
            )
            body = await collect(response, ANSWER_LIMIT)
            return read_release(response.code, body)

        return Deferred.fromCoroutine(ask())


def _release_numbers(text: str) -> tuple[int, int, int] | None:
    match = _RELEASE.fullmatch(text)
    return None if match is None else (int(match[1]), int(match[2]), int(match[3]))


def newer(latest: str, current: str) -> bool:
    """
    Whether the release C{latest} (x.y.z, a leading v allowed) is newer than this core's
    C{current} version.  A C{latest} that is not x.y.z offers nothing, and a core newer
    than it is not offered a downgrade.  A core at a prerelease or development build of
    the same numbers (C{0.2.0rc1}, C{0.2.0.dev3}, C{0.2.0-rc.1}) is behind that release;
    a local build label (C{0.2.0+local}) or a post release is not.  A core whose own
    version cannot be read is offered nothing: it cannot say what it runs.
    """
    offered = _release_numbers(latest)
    own = _OWN.fullmatch(current)
    if offered is None or own is None:
        return False
    numbers = (int(own[1]), int(own[2]), int(own[3]))
    if offered != numbers:
        return offered > numbers
    rest = own[4]
    if not rest or rest.startswith("+") or re.match(r"[.-]?post", rest):
        return False
    return True


def distribution(environ: Mapping[str, str]) -> str:
    """
    C{docker} where the published image says so (C{RHAPSODE_DISTRIBUTION=docker}), and
    C{source} everywhere else.
    """
    return "docker" if environ.get(ENV_DISTRIBUTION, "").strip().lower() == "docker" else "source"


def environment_allows(environ: Mapping[str, str]) -> bool:
    """
    False where the server's environment turned the check off (C{RHAPSODE_UPDATE_CHECK=0},
    or false, no, off); anything else leaves it to the settings.
    """
    return environ.get(ENV_CHECK, "").strip().lower() not in _OFF_WORDS


def _iso(seconds: float) -> str:
    moment = datetime.fromtimestamp(seconds, timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


@dataclass(frozen=True)
class _Answer:
    """
    What the last check that finished got: a release, or why it got none; and when.
    """

    at: float
    release: Release | None
    why: str | None = None


class UpdateChecker:
    """
    The update check of one core.

    @param clock: when answers were got, and the check's timeout (the reactor).
    @param source: where the latest release is learnt.
    @param version: this core's version.
    @param enabled: asked on every request: whether checking is on now (the setting,
        read live, and the environment, which can only turn it off).
    @param distribution: C{docker} or C{source}.
    """

    log = Logger()

    def __init__(
        self,
        *,
        clock: Any,
        source: IReleaseSource,
        version: str,
        enabled: Callable[[], bool],
        distribution: str = "source",
        timeout: float = TIMEOUT_SECONDS,
    ) -> None:
        self._clock = clock
        self._source = source
        self._version = version
        self._enabled = enabled
        self._distribution = distribution
        self._timeout = timeout
        self._answer: _Answer | None = None
        self._waiting: list[Deferred[None]] | None = None

    @property
    def in_flight(self) -> bool:
        return self._waiting is not None

    def _document(self) -> dict[str, Any]:
        document: dict[str, Any] = {"version": self._version}
        answer = self._answer
        if not self._enabled():
            document["check"] = "off"
        elif answer is None:
            document["check"] = "pending"
        elif answer.release is None:
            document["check"] = "failed"
        else:
            release = answer.release
            document.update(
                check="ok",
                latest=release.version,
                updateAvailable=not release.prerelease and newer(release.version, self._version),
                releaseUrl=release.url,
                checkedAt=_iso(answer.at),
            )
        document["distribution"] = self._distribution
        return document

    def _due(self) -> bool:
        answer = self._answer
        if answer is None:
            return True
        wait = FRESH_SECONDS if answer.release is not None else RETRY_SECONDS
        return self._clock.seconds() - answer.at >= wait

    def status(self) -> dict[str, Any]:
        """
        C{GET /update}: what is known now, never waiting.  Starts one check in the
        background when there is no answer or the one held is past its time.
        """
        if self._enabled() and self._waiting is None and self._due():
            self._start()
        return self._document()

    async def check_now(self) -> dict[str, Any]:
        """
        C{POST /update/check}: the document once the source has answered (at most the
        check's timeout); an answer under five minutes old as it is; the answer of a
        check in flight, joined rather than repeated.  Off stays off, asking nothing.
        """
        if not self._enabled():
            return self._document()
        answer = self._answer
        recent = answer is not None and self._clock.seconds() - answer.at < RECENT_SECONDS
        if not recent:
            # A waiter of its own: a caller that goes away cancels only its wait.
            waiter: Deferred[None] = Deferred()
            if self._waiting is None:
                self._start()
            assert self._waiting is not None
            self._waiting.append(waiter)
            await waiter
        return self._document()

    def _start(self) -> None:
        self._waiting = []
        self.log.info("asking {url} for the latest release", url=self._source.url)
        asked = self._source.latest()
        asked.addTimeout(self._timeout, self._clock)
        asked.addCallbacks(self._got, self._failed)

    def _got(self, release: Release) -> None:
        self._finish(_Answer(self._clock.seconds(), release))
        self.log.info("the latest release is {tag}", tag=release.tag)

    def _failed(self, failure: Any) -> None:
        why = failure.getErrorMessage() or failure.type.__name__
        self._finish(_Answer(self._clock.seconds(), None, why))
        self.log.warn("the update check got no answer: {why}; retried in six hours", why=why)

    def _finish(self, answer: _Answer) -> None:
        self._answer = answer
        waiting, self._waiting = self._waiting or [], None
        for waiter in waiting:
            if not waiter.called:
                waiter.callback(None)


def checker_for(
    reactor: Any,
    version: str,
    url: str,
    setting: Callable[[], bool],
    environ: Mapping[str, str] | None = None,
    *,
    source: IReleaseSource | None = None,
) -> UpdateChecker:
    """
    The checker a core runs: GitHub's API at C{url} on C{reactor} (or C{source}), on
    while C{setting} says so and the environment (the server's own, by default) has not
    turned it off.  The environment is read once, here: it is the server's at start.
    """
    env = os.environ if environ is None else environ
    allowed = environment_allows(env)
    return UpdateChecker(
        clock=reactor,
        source=source if source is not None else GitHubReleases(reactor, version, url),
        version=version,
        enabled=lambda: allowed and setting(),
        distribution=distribution(env),
    )
