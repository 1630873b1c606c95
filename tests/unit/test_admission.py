"""
The gate every core request passes at its headers: the management guard before the
body, and Authorization removed before any handler (protocol.md section 10).
"""

from __future__ import annotations

from typing import Any

from twisted.internet.address import IPv4Address
from twisted.web.test.requesthelper import DummyChannel

from rhapsode._admission import CoreRequest, is_management


class FakeCore:
    management_token = "s3cret-token-of-length"
    management_origins: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.uploads: list[str] = []

    async def start_upload(self, engine_id: str, request: Any) -> None:
        self.uploads.append(engine_id)


def request_for(method: bytes, path: bytes, headers: dict[bytes, bytes], peer: str = "127.0.0.1") -> tuple[CoreRequest, Any]:
    channel = DummyChannel()
    channel.site.core = FakeCore()  # type: ignore[attr-defined]
    channel.transport = DummyChannel.TCP()
    channel.transport.getPeer = lambda: IPv4Address("TCP", peer, 40000)  # type: ignore[method-assign]
    channel._command = method  # type: ignore[attr-defined]
    channel._path = path  # type: ignore[attr-defined]
    request = CoreRequest(channel)
    for name, value in headers.items():
        request.requestHeaders.setRawHeaders(name, [value])
    return request, channel


def test_authorization_removed_before_any_handler() -> None:
    """
    Every request loses its Authorization header at its headers, management or not.
    """
    for method, path in [(b"POST", b"/speak"), (b"DELETE", b"/engines/tone/voices/a")]:
        request, _ = request_for(method, path, {b"Host": b"localhost", b"Authorization": b"Bearer s3cret-token-of-length"})
        request.gotLength(0)
        assert request.refused is None
        assert not request.requestHeaders.hasHeader(b"authorization")
        assert request.guarded is (method == b"DELETE")


def test_guard_refuses_at_headers_and_writes_403() -> None:
    """
    A remote caller without the token is refused before the body: a 403 envelope naming
    the rule is written and the connection closed.
    """
    request, channel = request_for(b"DELETE", b"/engines/tone/voices/a", {b"Host": b"box"}, peer="203.0.113.9")
    request.gotLength(0)
    assert request.refused is not None and request.refused.code == "forbidden"
    written = channel.transport.written.getvalue()
    assert written.startswith(b"HTTP/1.1 403 Forbidden")
    assert b"management token" in written


def test_remote_caller_with_token_admitted_and_token_stripped() -> None:
    """
    A remote caller with the right bearer token is admitted, and the token is gone after.
    """
    request, _ = request_for(
        b"DELETE", b"/engines/tone/voices/a",
        {b"Host": b"box.example", b"Authorization": b"Bearer s3cret-token-of-length"},
        peer="203.0.113.9",
    )
    request.gotLength(0)
    assert request.refused is None
    assert not request.requestHeaders.hasHeader(b"authorization")


def test_upload_starts_streaming_at_headers() -> None:
    """
    A voice upload starts its worker request as soon as the headers are in.
    """
    request, channel = request_for(b"POST", b"/engines/tone/voices", {b"Host": b"localhost"})
    request.gotLength(1000)
    assert request.upload is not None and request.upstream is not None
    assert channel.site.core.uploads == ["tone"]


def test_which_routes_are_management() -> None:
    """
    Creating and deleting voices are management routes; listing and speaking are not.
    """
    assert is_management(b"POST", b"/engines/tone/voices")
    assert is_management(b"DELETE", b"/engines/tone/voices/x")
    assert not is_management(b"GET", b"/engines/tone/voices")
    assert not is_management(b"POST", b"/speak")
    assert not is_management(b"GET", b"/engines/tone/voices/x/preview")


def test_speak_goes_straight_to_its_resource_and_the_rest_to_klein() -> None:
    """
    The core's site hands POST /speak to its own resource without routing; any other
    method on /speak, and every other path, goes to the routed resource.
    """
    from twisted.web.resource import Resource

    from rhapsode._admission import CoreSite

    routed, speak = Resource(), Resource()
    routed.isLeaf = True  # type: ignore[misc]
    site = CoreSite(routed, FakeCore(), {(b"POST", b"/speak"): speak})
    for method, path, expected in [
        (b"POST", b"/speak", speak),
        (b"GET", b"/speak", routed),
        (b"POST", b"/speak/more", routed),
        (b"POST", b"/engines", routed),
    ]:
        request, _ = request_for(method, path, {b"Host": b"localhost"})
        request.method, request.path = method, path
        request.prepath, request.postpath = [], path.split(b"/")[1:]
        assert site.getResourceFor(request) is expected, (method, path)
        assert request.site is site


def test_access_lines_are_not_even_formatted_when_not_logged() -> None:
    """
    With access logging off (a log level above info) the site formats no access line;
    with it on, each request is formatted and written once.
    """
    from twisted.web.resource import Resource

    from rhapsode._admission import CoreSite

    for enabled in (False, True):
        site = CoreSite(Resource(), FakeCore(), access_log=enabled)
        formatted: list[Any] = []
        lines: list[str] = []
        site._logFormatter = lambda when, request: formatted.append(request) or "line"  # type: ignore[assignment]
        site._logFile = type("Sink", (), {"write": lambda self, line: lines.append(line)})()  # type: ignore[assignment]
        request, _ = request_for(b"POST", b"/speak", {b"Host": b"localhost"})
        site.log(request)
        assert (len(formatted), lines) == ((1, ["line\n"]) if enabled else (0, []))
