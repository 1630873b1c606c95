"""
The web page's site (rhapsode._web._site): who may use it (the core's Host and Origin
rules), limits checked at the request's head, and the /api proxy streaming the core's
answer with backpressure, driven over in-memory transports with a fake agent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure
from twisted.web._newclient import ResponseFailed
from twisted.web.client import ResponseDone
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH, IAgent, IResponse
from zope.interface import implementer
from zope.interface.verify import verifyObject

from rhapsode._web import WebConfig, admit, make_site
from rhapsode_protocol.errors import Forbidden

LOCAL = {"host": ["127.0.0.1:8090"]}


@implementer(IResponse)
class FakeResponse:
    """The core's answer: headers now, a body the test delivers piece by piece."""

    version = (b"HTTP", 1, 1)
    previousResponse = None
    request = None

    def __init__(self, code: int = 200, headers: dict[bytes, list[bytes]] | None = None) -> None:
        self.code = code
        self.phrase = b"OK"
        self.headers = Headers(headers or {b"content-type": [b"audio/L16; rate=24000; channels=1"]})
        self.length = UNKNOWN_LENGTH
        self.protocol: Any = None
        self.upstream = StringTransport()

    def deliverBody(self, protocol: Any) -> None:
        self.protocol = protocol
        protocol.makeConnection(self.upstream)

    def setPreviousResponse(self, response: Any) -> None:
        self.previousResponse = response


@implementer(IAgent)
class FakeAgent:
    """Records each request and answers with a Deferred the test fires."""

    def __init__(self) -> None:
        self.calls: list[tuple[bytes, bytes, Headers, Any, Deferred[Any]]] = []
        self.cancelled: list[bytes] = []

    def request(self, method: bytes, uri: bytes, headers: Headers | None = None, bodyProducer: Any = None) -> Deferred[Any]:
        d: Deferred[Any] = Deferred(lambda _: self.cancelled.append(uri))
        self.calls.append((method, uri, headers or Headers(), bodyProducer, d))
        return d


def connect(config: WebConfig, peer: str = "127.0.0.1", static: Path | None = None) -> tuple[Any, StringTransport, FakeAgent]:
    agent = FakeAgent()
    verifyObject(IAgent, agent)
    kwargs = {"static_dir": static} if static is not None else {}
    site, pool = make_site(config, MemoryReactorClock(), agent=agent, **kwargs)
    assert pool is None
    channel = site.buildProtocol(IPv4Address("TCP", peer, 40000))
    transport = StringTransport(peerAddress=IPv4Address("TCP", peer, 40000))
    channel.makeConnection(transport)
    return channel, transport, agent


def head(*lines: str, method: str = "GET", path: str = "/api/engines", host: str = "127.0.0.1:8090") -> bytes:
    return ("\r\n".join([f"{method} {path} HTTP/1.1", f"Host: {host}", *lines]) + "\r\n\r\n").encode()


@pytest.mark.parametrize(
    ("peer", "headers", "origins", "admitted"),
    [
        ("127.0.0.1", LOCAL, [], True),
        ("::1", {"host": ["[::1]:8090"], "origin": ["http://[::1]:8090"]}, [], True),
        ("127.0.0.1", {"host": ["localhost:8090"], "origin": ["http://localhost:8090"]}, [], True),
        ("127.0.0.1", {**LOCAL, "origin": ["https://evil.example"]}, [], False),
        ("127.0.0.1", {"host": ["evil.example:8090"]}, [], False),
        ("127.0.0.1", {**LOCAL, "x-forwarded-for": ["203.0.113.9"]}, [], False),
        ("127.0.0.1", {}, [], False),
        ("192.0.2.7", {"host": ["192.0.2.1:8090"]}, [], False),
        ("192.0.2.7", {"host": ["box.lan:8090"]}, ["http://box.lan:8090"], True),
        ("192.0.2.7", {"host": ["box.lan:8090"], "origin": ["http://box.lan:8090"]}, ["http://box.lan:8090"], True),
        ("192.0.2.7", {"host": ["box.lan:9999"]}, ["http://box.lan:8090"], False),
        ("192.0.2.7", {"host": ["box.lan:8090"], "origin": ["https://evil.example"]}, ["http://box.lan:8090"], False),
        ("192.0.2.7", {"host": ["box.lan:8090", "box.lan:8090"]}, ["http://box.lan:8090"], False),
    ],
)
def test_who_may_use_the_page(peer: str, headers: dict[str, list[str]], origins: list[str], admitted: bool) -> None:
    """
    A loopback browser is judged by the core's own rules (Origin this machine's or
    allowed, Host a loopback name, IP literal or allowed host, no remote
    X-Forwarded-For); a remote one only when it came by an allowed origin's host and port.
    """
    if admitted:
        admit(peer, headers, origins)
    else:
        with pytest.raises(Forbidden):
            admit(peer, headers, origins)


def test_a_foreign_page_is_refused_at_the_head_before_its_body() -> None:
    """
    A POST from another site's page announcing a body is answered 403 with the error
    envelope and the connection closed, with no body sent and nothing asked of the core.
    """
    channel, transport, agent = connect(WebConfig())
    channel.dataReceived(head("Origin: https://evil.example", "Content-Length: 100000", method="POST", path="/api/speak"))
    answer = transport.value()
    assert answer.startswith(b"HTTP/1.1 403 ")
    assert b'"code": "forbidden"' in answer and b'"retryable": false' in answer
    assert transport.disconnecting
    assert agent.calls == []


def test_a_remote_caller_is_refused_by_default() -> None:
    """Without --allow-origin, a browser on another machine gets 403 even for the page's files."""
    channel, transport, agent = connect(WebConfig(), peer="192.0.2.7")
    channel.dataReceived(head(path="/", host="192.0.2.1:8090"))
    assert transport.value().startswith(b"HTTP/1.1 403 ")
    assert agent.calls == []


def test_a_declared_body_over_the_limit_is_refused_before_it_is_read() -> None:
    """Content-Length over the limit is 413 at the head, before any byte of the body."""
    channel, transport, agent = connect(WebConfig(body_limit=1000))
    channel.dataReceived(head("Content-Length: 1001", "Content-Type: application/json", method="POST", path="/api/speak"))
    assert transport.value().startswith(b"HTTP/1.1 413 ")
    assert b'"field": "body"' in transport.value()
    assert agent.calls == []


def test_a_chunked_body_over_the_limit_is_refused_as_it_arrives() -> None:
    """A chunked body that grows past the limit is 413 at the chunk that passes it."""
    channel, transport, agent = connect(WebConfig(body_limit=10))
    channel.dataReceived(head("Transfer-Encoding: chunked", method="POST", path="/api/speak"))
    assert transport.value() == b""
    channel.dataReceived(b"8\r\n12345678\r\n")
    assert transport.value() == b""
    channel.dataReceived(b"8\r\n12345678\r\n")
    assert transport.value().startswith(b"HTTP/1.1 413 ")
    channel.dataReceived(b"0\r\n\r\n")
    assert agent.calls == []


def test_the_proxy_forwards_the_request_and_presents_the_token() -> None:
    """
    /api/X?q goes to the core's /X?q with the method and body; the token is presented
    as a bearer, the browser's address is in X-Forwarded-For, its Origin is kept for
    the core to judge, and its own cookies and Authorization are not passed on.
    """
    channel, transport, agent = connect(WebConfig(core="http://127.0.0.1:9999", token="s3cret"))
    channel.dataReceived(head(
        "Origin: http://127.0.0.1:8090", "Cookie: a=b", "Authorization: Bearer other", "Content-Type: application/json",
        "Content-Length: 2", method="POST", path="/api/engines/tone/install?pull=x",
    ) + b"{}")
    [(method, uri, headers, body, _)] = agent.calls
    assert (method, uri) == (b"POST", b"http://127.0.0.1:9999/engines/tone/install?pull=x")
    assert headers.getRawHeaders(b"authorization") == [b"Bearer s3cret"]
    assert headers.getRawHeaders(b"x-forwarded-for") == [b"127.0.0.1"]
    assert headers.getRawHeaders(b"origin") == [b"http://127.0.0.1:8090"]
    assert headers.getRawHeaders(b"content-type") == [b"application/json"]
    assert headers.getRawHeaders(b"cookie") is None
    assert body is not None and body.length == 2


def test_without_a_token_none_is_presented() -> None:
    """No token configured: the browser's own Authorization is still not passed on."""
    channel, _, agent = connect(WebConfig())
    channel.dataReceived(head("Authorization: Bearer guessed"))
    assert agent.calls[0][2].getRawHeaders(b"authorization") is None
    assert agent.calls[0][3] is None


def test_the_answer_streams_as_it_arrives_and_ends_whole() -> None:
    """
    The core's status and headers go out when they arrive (hop-by-hop ones dropped),
    each piece of body as it comes, and the response ends when the core's does.
    """
    channel, transport, agent = connect(WebConfig())
    channel.dataReceived(head(method="POST", path="/api/speak", *("Content-Length: 0",)))
    response = FakeResponse(headers={b"content-type": [b"audio/L16; rate=24000; channels=1"], b"connection": [b"close"]})
    verifyObject(IResponse, response)
    agent.calls[0][4].callback(response)
    response.protocol.dataReceived(b"first")
    sent = transport.value()
    assert sent.startswith(b"HTTP/1.1 200 OK")
    assert b"audio/L16; rate=24000; channels=1" in sent and b"first" in sent
    assert b"Connection: close" not in sent
    assert b"frame-ancestors 'none'" in sent
    response.protocol.dataReceived(b"second")
    assert transport.value().endswith(b"second\r\n")
    response.protocol.connectionLost(Failure(ResponseDone()))
    assert transport.value().endswith(b"0\r\n\r\n")
    assert not transport.disconnecting


def test_a_slow_browser_pauses_the_core() -> None:
    """
    The core's connection is the producer of the browser's response: the browser's
    transport pausing pauses it, and resuming resumes it.
    """
    channel, transport, agent = connect(WebConfig())
    channel.dataReceived(head(path="/api/installs/1/events"))
    response = FakeResponse(headers={b"content-type": [b"text/event-stream"]})
    agent.calls[0][4].callback(response)
    assert response.upstream.producerState == "producing"
    # What a real transport does when its send buffer fills, and when it drains.
    transport.producer.pauseProducing()
    assert response.upstream.producerState == "paused"
    transport.producer.resumeProducing()
    assert response.upstream.producerState == "producing"


def test_a_core_that_fails_after_the_headers_aborts_the_browser() -> None:
    """A truncated answer is an aborted connection, never a clean short one."""
    channel, transport, agent = connect(WebConfig())
    channel.dataReceived(head(path="/api/speak", method="POST", *("Content-Length: 0",)))
    response = FakeResponse()
    agent.calls[0][4].callback(response)
    response.protocol.dataReceived(b"partial")
    response.protocol.connectionLost(Failure(ResponseFailed([Failure(ConnectionRefusedError())])))
    assert transport.disconnecting
    assert not transport.value().endswith(b"0\r\n\r\n")


def test_a_core_that_does_not_answer_is_an_error_envelope() -> None:
    """No core: 502 with a retryable envelope that says where it looked and what to do."""
    channel, transport, agent = connect(WebConfig(core="http://127.0.0.1:9"))
    channel.dataReceived(head())
    agent.calls[0][4].errback(ConnectionRefusedError())
    answer = transport.value()
    assert answer.startswith(b"HTTP/1.1 502 ")
    assert b'"retryable": true' in answer
    assert b"http://127.0.0.1:9" in answer and b"rhapsode serve" in answer


def test_a_browser_that_leaves_before_the_answer_cancels_it() -> None:
    """The browser hanging up before the core answers cancels the request to the core."""
    channel, transport, agent = connect(WebConfig())
    channel.dataReceived(head())
    channel.connectionLost(Failure(ConnectionRefusedError()))
    assert agent.cancelled == [b"http://127.0.0.1:8080/engines"]
    assert transport.value() == b""


def test_a_browser_that_leaves_mid_stream_stops_the_core() -> None:
    """The browser hanging up mid-stream stops the core's connection."""
    channel, transport, agent = connect(WebConfig())
    channel.dataReceived(head(path="/api/speak", method="POST", *("Content-Length: 0",)))
    response = FakeResponse()
    agent.calls[0][4].callback(response)
    response.protocol.dataReceived(b"some")
    channel.connectionLost(Failure(ConnectionRefusedError()))
    assert response.upstream.producerState == "stopped"


def test_files_are_served_and_directories_are_not_listed(tmp_path: Path) -> None:
    """/ is the shell, a module has a JavaScript type, and a folder is 404, not a listing."""
    from twisted.web.server import NOT_DONE_YET
    from twisted.web.test.requesthelper import DummyRequest

    (tmp_path / "index.html").write_text("<!doctype html><title>t</title>")
    (tmp_path / "js").mkdir()
    (tmp_path / "js" / "app.js").write_text("export {};")
    site, _ = make_site(WebConfig(), MemoryReactorClock(), agent=FakeAgent(), static_dir=tmp_path)
    for path, code, kind, body in (
        ([b""], 200, b"text/html", b"<!doctype html>"),
        ([b"js", b"app.js"], 200, b"text/javascript", b"export {};"),
        ([b"js", b""], 404, None, None),
        ([b"nope.js"], 404, None, None),
    ):
        request = DummyRequest(path)
        rendered = site.getResourceFor(request).render(request)
        if rendered is not NOT_DONE_YET:
            request.write(rendered)
        assert request.responseCode in (code, None if code == 200 else code), path
        if kind is not None:
            assert request.responseHeaders.getRawHeaders(b"content-type") == [kind]
            assert b"".join(request.written).startswith(body)
        else:
            assert b"Index of" not in b"".join(request.written)


def test_a_head_dribbled_slowly_is_408_at_the_head_timeout() -> None:
    """
    A head that trickles in a byte at a time is answered 408 in the envelope and the
    connection closed once the head timeout has passed since its first byte, however
    often a byte arrives, as the core's own site does.
    """
    channel, transport, agent = connect(WebConfig(head_timeout=10.0, idle_timeout=60.0))
    clock = channel.site.reactor
    raw = head("X-Slow: " + "y" * 40)
    for byte in raw[:19]:
        channel.dataReceived(bytes([byte]))
        clock.advance(0.5)
    assert transport.value() == b"" and not transport.disconnecting
    for byte in raw[19:30]:
        channel.dataReceived(bytes([byte]))
        clock.advance(0.5)
    answer = transport.value()
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), answer
    assert b'"field": "headers"' in answer and transport.disconnecting
    assert agent.calls == []


def test_a_declared_body_that_never_comes_is_408_at_the_idle_timeout() -> None:
    """
    A POST whose head promises a body that never arrives is 408 once the connection
    has sent nothing for the idle timeout, and nothing is asked of the core.
    """
    channel, transport, agent = connect(WebConfig(head_timeout=10.0, idle_timeout=30.0))
    clock = channel.site.reactor
    channel.dataReceived(head("Content-Length: 100", "Content-Type: application/json", method="POST", path="/api/speak"))
    clock.advance(29.0)
    assert transport.value() == b""
    clock.advance(2.0)
    assert transport.value().startswith(b"HTTP/1.1 408 ")
    assert b'"field": "body"' in transport.value() and transport.disconnecting
    assert agent.calls == []


def test_an_idle_connection_is_closed_at_the_idle_timeout() -> None:
    """A connection that never sends a byte is closed once the idle timeout has passed."""
    channel, transport, _ = connect(WebConfig(idle_timeout=30.0))
    channel.site.reactor.advance(29.0)
    assert not transport.disconnecting
    channel.site.reactor.advance(2.0)
    assert transport.disconnecting


def test_connections_past_the_cap_are_refused_until_one_closes() -> None:
    """
    With --max-connections 2, a third connection is answered 429 overloaded (retryable,
    with Retry-After) and closed at once; once one of the two closes, a new one is served.
    """
    agent = FakeAgent()
    site, _ = make_site(WebConfig(max_connections=2), MemoryReactorClock(), agent=agent)

    def opened() -> tuple[Any, StringTransport]:
        channel = site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 40000))
        transport = StringTransport(peerAddress=IPv4Address("TCP", "127.0.0.1", 40000))
        channel.makeConnection(transport)
        return channel, transport

    first, second = opened(), opened()
    _, refused = opened()
    answer = refused.value()
    assert answer.startswith(b"HTTP/1.1 429 Too Many Requests\r\n"), answer
    assert b'"code": "overloaded"' in answer and b"Retry-After: " in answer
    assert refused.disconnecting
    assert not first[1].disconnecting and not second[1].disconnecting
    first[0].connectionLost(Failure(ConnectionRefusedError()))
    channel, transport = opened()
    channel.dataReceived(head())
    assert len(agent.calls) == 1 and not transport.disconnecting
