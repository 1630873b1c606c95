"""
The route that skips the router (rhapsode_protocol.http.site): a handler's answer is written
and the request finished, a client that hangs up cancels the handler, and the site
hands only the exact method and path to it.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import CancelledError, Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET
from twisted.web.test.requesthelper import DummyRequest

from rhapsode_protocol.http.site import DirectSite, HandlerResource


def test_the_handlers_answer_is_written_and_the_request_finished() -> None:
    """
    Bytes returned by the handler become the body, then the request is finished.
    """

    async def handler(request: Any) -> bytes:
        request.setResponseCode(201)
        return b"made"

    request = DummyRequest([b"speak"])
    assert HandlerResource(handler, Logger()).render(request) is NOT_DONE_YET
    assert request.written == [b"made"] and request.finished == 1 and request.responseCode == 201


def test_a_client_that_hangs_up_cancels_the_handler() -> None:
    """
    The connection's loss cancels the handler's coroutine where it waits, and nothing
    is written to the gone request.
    """
    waiting: Deferred[None] = Deferred()
    seen: list[str] = []

    async def handler(request: Any) -> bytes:
        try:
            await waiting
        except CancelledError:
            seen.append("cancelled")
            raise
        return b"late"

    request = DummyRequest([b"speak"])
    HandlerResource(handler, Logger()).render(request)
    request.processingFailed(Failure(ConnectionError("client gone")))
    assert seen == ["cancelled"] and request.written == []


def test_a_handler_resumed_by_the_hang_up_itself_does_not_finish_the_gone_request() -> None:
    """
    A handler that waits on the request's own notifyFinish (as the speech relay does)
    is resumed by the hang-up before the route hears of it: what it returns is neither
    written nor finished on the gone request, and nothing is logged.
    """
    failures: list[Any] = []
    log = Logger(observer=lambda event: failures.append(event) if event.get("log_failure") else None)

    async def handler(request: Any) -> bytes:
        try:
            await request.notifyFinish()
        except Exception:
            pass
        return b"after the end"

    request = DummyRequest([b"speak"])
    HandlerResource(handler, log).render(request)
    # As twisted.web's Request.connectionLost: marked gone, then its notifications fail.
    request._disconnected = True
    request.processingFailed(Failure(ConnectionError("client gone")))
    assert request.written == [] and request.finished == 0 and failures == []


def test_a_handler_that_breaks_is_logged_not_lost() -> None:
    """
    A handler that raises (it should have mapped its own failure) is logged.
    """
    events: list[dict[str, Any]] = []

    async def handler(request: Any) -> bytes:
        raise RuntimeError("bug")

    request = DummyRequest([b"speak"])
    HandlerResource(handler, Logger(observer=events.append)).render(request)
    assert any(event.get("log_failure") is not None for event in events)


def test_only_the_exact_method_and_path_go_direct() -> None:
    """
    The site gives the direct resource only its own method and exact path; anything
    else goes through the root.
    """
    root, direct = Resource(), Resource()
    root.isLeaf = True  # type: ignore[misc]
    site = DirectSite(root, {(b"POST", b"/speak"): direct})
    for method, path, expected in [
        (b"POST", b"/speak", direct),
        (b"GET", b"/speak", root),
        (b"POST", b"/speak/x", root),
        (b"POST", b"/", root),
    ]:
        request = DummyRequest(path.split(b"/")[1:])
        request.method, request.path = method, path
        assert site.getResourceFor(request) is expected, (method, path)


def test_connections_are_plain_http11_channels() -> None:
    """
    The site's connections are twisted.web HTTP/1.1 channels themselves, not
    twisted.web's proxy that waits for a TLS negotiation these sites never have; they
    still know their site.
    """
    from twisted.internet.address import IPv4Address
    from twisted.web.http import HTTPChannel, _GenericHTTPChannelProtocol

    from rhapsode_protocol.http.site import EagerChannel

    site = DirectSite(Resource())
    channel = site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 1))
    assert type(channel) is EagerChannel and isinstance(channel, HTTPChannel)
    assert not isinstance(channel, _GenericHTTPChannelProtocol)
    assert channel.site is site  # type: ignore[attr-defined]
