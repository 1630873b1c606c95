"""
The HTTP server both processes listen with (rhapsode_protocol.http.site), fed raw bytes on a
memory transport and a fake clock: every limit on a request's head and body is refused
in the error envelope before the work it would cost, once, and the route a request is
admitted on is the one the router will run.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from klein import Klein
from twisted.internet.address import IPv4Address
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.logger import LogLevel, globalLogPublisher
from twisted.web.iweb import IRequest

from rhapsode_protocol.http.site import (
    HEAD_SECONDS,
    MAX_HEADER_LINES,
    MAX_REQUEST_LINE,
    DirectSite,
    EagerChannel,
    EagerRequest,
    Routes,
)


class App:
    """
    A small routed app: what the handlers saw, to show what reached them.
    """

    app = Klein()

    def __init__(self) -> None:
        self.seen: list[tuple[bytes, bytes, bytes]] = []
        self.routes: list[str] = []

    @app.route("/things/<string:name>", methods=["GET", "DELETE"])
    def thing(self, request: IRequest, name: str) -> bytes:
        self.seen.append((request.method, request.path, request.content.read()))
        self.routes.append(request.route.rule)  # type: ignore[attr-defined]
        return name.encode()

    @app.route("/upload", methods=["POST"])
    def upload(self, request: IRequest) -> bytes:
        body = request.content.read()
        self.seen.append((request.method, request.path, body))
        return b"%d" % len(body)


def serve(limits: dict[tuple[str, str], int] | None = None) -> tuple[App, Any, StringTransport, MemoryReactorClock]:
    app = App()
    clock = MemoryReactorClock()
    site = DirectSite(
        app.app.resource(), reactor=clock, routes=Routes(app.app.url_map, limits or {("POST", "/upload"): 100})
    )
    channel = site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 50000))
    transport = StringTransport(peerAddress=IPv4Address("TCP", "127.0.0.1", 50001))
    channel.makeConnection(transport)
    return app, channel, transport, clock


def answers(raw: bytes) -> list[tuple[int, dict[str, bytes], bytes]]:
    """
    Every HTTP/1.1 response in C{raw}: status, headers (lower-cased names), body.
    """
    out = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ")[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        if b"content-length" in headers:
            size = int(headers[b"content-length"])
            body, raw = rest[:size], rest[size:]
        elif headers.get(b"transfer-encoding") == b"chunked":
            body, raw = b"", rest
            while True:
                size_line, _, raw = raw.partition(b"\r\n")
                size = int(size_line, 16)
                body, raw = body + raw[:size], raw[size + 2 :]
                if size == 0:
                    break
        else:
            body, raw = rest, b""
        out.append((status, headers, body))
    return out


def only(transport: StringTransport) -> tuple[int, dict[str, bytes], dict[str, Any]]:
    """
    The one response written, which must be an error envelope, and the connection closed.
    """
    [(status, headers, body)] = answers(transport.value())
    assert headers[b"content-type"] == b"application/json"
    assert transport.disconnecting
    return status, headers, json.loads(body)["error"]


def test_a_request_within_every_limit_reaches_its_handler() -> None:
    """
    The ordinary case: routed, its body read, answered, the connection kept.
    """
    app, channel, transport, _ = serve()
    channel.dataReceived(b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
    [(status, _, body)] = answers(transport.value())
    assert (status, body) == (200, b"5")
    assert app.seen == [(b"POST", b"/upload", b"hello")] and not transport.disconnecting


def test_a_declared_body_over_the_routes_limit_is_413_before_a_byte_is_read() -> None:
    """
    A Content-Length over the route's limit is refused at the head: the handler never
    runs and no body is kept, however much of it came in the same read.
    """
    app, channel, transport, _ = serve()
    channel.dataReceived(b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 300000000\r\n\r\n" + b"x" * 5000)
    status, _, error = only(transport)
    assert (status, error["code"], error["field"]) == (413, "bad_request", "body")
    assert "100 bytes" in error["message"]
    assert app.seen == [] and channel.requests[0].content is None


def test_a_chunked_body_over_the_limit_is_413_as_it_arrives() -> None:
    """
    A body with no declared length is counted as it arrives and refused the moment it
    passes the limit; what follows is never read.
    """
    app, channel, transport, _ = serve()
    channel.dataReceived(b"POST /upload HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    channel.dataReceived(b"40\r\n" + b"x" * 64 + b"\r\n")
    assert transport.value() == b""
    channel.dataReceived(b"40\r\n" + b"x" * 64 + b"\r\n")
    status, _, error = only(transport)
    assert (status, error["field"]) == (413, "body")
    channel.dataReceived(b"0\r\n\r\n")
    assert app.seen == [] and len(answers(transport.value())) == 1


@pytest.mark.parametrize(
    "line",
    [b"delete /things/a HTTP/1.1", b"DELETE /th%69ngs/a HTTP/1.1", b"DELETE /things%2Fa HTTP/1.1"],
)
def test_the_route_is_resolved_as_the_router_resolves_it(line: bytes) -> None:
    """
    A method in lower case, a percent-encoded path, and an encoded slash are admitted on
    the route the router then runs, so a rule keyed to the route cannot be stepped
    around by spelling the request differently.
    """
    app, channel, transport, _ = serve()
    channel.dataReceived(line + b"\r\nHost: x\r\n\r\n")
    assert app.seen and app.seen[0][0].upper() == b"DELETE"
    [(status, _, body)] = answers(transport.value())
    assert (status, body) == (200, b"a")
    assert app.routes == ["/things/<string:name>"]


def test_an_unknown_path_is_404_and_a_wrong_method_405_with_allow() -> None:
    """
    Neither reaches a handler, and both are the envelope: 405 says which methods the
    path takes, in the envelope's message and in Allow.
    """
    app, channel, transport, _ = serve()
    channel.dataReceived(b"GET /nothing HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n")
    status, _, error = only(transport)
    assert (status, error["code"], error["field"]) == (404, "bad_request", "path")
    app, channel, transport, _ = serve()
    channel.dataReceived(b"PUT /things/a HTTP/1.1\r\nHost: x\r\n\r\n")
    status, headers, error = only(transport)
    assert (status, error["field"]) == (405, "method")
    assert headers[b"allow"] == b"DELETE, GET, HEAD"
    assert "DELETE, GET, HEAD" in error["message"]
    assert app.seen == []


def test_a_redirect_never_names_the_clients_host() -> None:
    """
    Where the router would redirect (a doubled slash), the Location is a path on this
    server, not a URL built from whatever Host the client sent.
    """
    _, channel, transport, _ = serve()
    channel.dataReceived(b"GET /things//a?x=1 HTTP/1.1\r\nHost: evil.example\r\n\r\n")
    status, headers, _ = only(transport)
    assert status == 308 and headers[b"location"] == b"/things/a?x=1"
    assert b"evil" not in transport.value()


def test_a_request_line_over_its_limit_is_414() -> None:
    """
    A request line past the limit, whole or still arriving, is 414 in the envelope.
    """
    for raw in (b"GET /" + b"a" * MAX_REQUEST_LINE + b" HTTP/1.1\r\n", b"GET /" + b"a" * 20000):
        _, channel, transport, _ = serve()
        channel.dataReceived(raw)
        status, _, error = only(transport)
        assert (status, error["code"]) == (414, "bad_request")


def test_too_many_header_lines_are_431_answered_once() -> None:
    """
    600 header lines get one 431, not one refusal per line past twisted.web's own cap.
    """
    _, channel, transport, _ = serve()
    headers = b"".join(b"X-N%d: v\r\n" % i for i in range(600))
    channel.dataReceived(b"GET /things/a HTTP/1.1\r\n" + headers + b"\r\n")
    status, _, error = only(transport)
    assert (status, error["field"]) == (431, "headers")
    assert str(MAX_HEADER_LINES) in error["message"]


def test_a_head_over_its_bytes_is_431() -> None:
    """
    A few very long header lines are refused by size, with a status, not a dropped
    connection.
    """
    _, channel, transport, _ = serve()
    channel.dataReceived(b"GET /things/a HTTP/1.1\r\n" + b"X-Big: " + b"v" * 9000 + b"\r\nX-Big2: " + b"v" * 9000 + b"\r\n\r\n")
    status, _, _ = only(transport)
    assert status == 431


def test_a_head_dribbled_slowly_is_408_at_its_deadline() -> None:
    """
    A head that arrives a byte a second (the slowloris) is refused when its deadline
    passes, however recently the last byte came.
    """
    _, channel, transport, clock = serve()
    head = b"GET /things/a HTTP/1.0\r\nHost: x\r\nX-Slow: " + b"a" * 100
    for byte in head[: int(HEAD_SECONDS) - 1]:
        channel.dataReceived(bytes([byte]))
        clock.advance(1)
    assert transport.value() == b""
    channel.dataReceived(head[int(HEAD_SECONDS) - 1 : int(HEAD_SECONDS)])
    clock.advance(1)
    status, _, error = only(transport)
    assert (status, error["field"]) == (408, "headers")


def test_an_idle_connection_between_requests_is_not_on_the_head_deadline() -> None:
    """
    The head deadline starts at a request's first byte: a kept-alive connection that
    waits between requests is only on the idle timeout.
    """
    _, channel, transport, clock = serve()
    channel.dataReceived(b"GET /things/a HTTP/1.1\r\nHost: x\r\n\r\n")
    clock.advance(HEAD_SECONDS * 3)
    assert not transport.disconnecting
    channel.dataReceived(b"GET /things/b HTTP/1.1\r\nHost: x\r\n\r\n")
    assert [a[2] for a in answers(transport.value())] == [b"a", b"b"]


def test_a_body_that_stalls_is_408_at_the_idle_timeout() -> None:
    """
    A body that stops arriving is refused once the connection has been idle for the
    site's timeout, in the envelope.
    """
    app, channel, transport, clock = serve()
    channel.dataReceived(b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\nabc")
    clock.advance(channel.timeOut + 1)
    status, _, error = only(transport)
    assert (status, error["field"]) == (408, "body")
    assert app.seen == []


def test_twisted_webs_own_refusal_is_an_envelope_too() -> None:
    """
    A malformed head that twisted.web itself refuses (a header line without a colon,
    a doubled Content-Length) gets the error envelope, once.
    """
    for head in (b"GET /things/a HTTP/1.1\r\nno colon here\r\n\r\n",
                 b"POST /upload HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab"):
        _, channel, transport, _ = serve()
        channel.dataReceived(head)
        status, _, error = only(transport)
        assert (status, error["code"]) == (400, "bad_request")


def test_a_route_decided_on_another_reading_of_the_line_is_refused() -> None:
    """
    Should twisted.web hand the request a line other than the one its route was
    decided from, the request is refused, never run on a decision about another.
    """
    app, channel, transport, _ = serve()
    request = EagerRequest(channel)
    channel.requests.append(request)
    channel.site.admit(request, b"GET", b"/things/a", 0)
    request.line = (b"GET", b"/things/a")
    request.gotLength(0)
    request.requestReceived(b"DELETE", b"/things/a", b"HTTP/1.1")
    status, _, error = only(transport)
    assert status == 400 and app.seen == []


def test_each_request_is_logged_once_with_status_duration_and_reason() -> None:
    """
    The access line names method, path, status and duration, and a refusal its reason.
    """
    events: list[dict[str, Any]] = []
    globalLogPublisher.addObserver(events.append)
    try:
        _, channel, transport, clock = serve()
        channel.dataReceived(b"GET /things/a HTTP/1.1\r\nHost: x\r\n\r\n")
        channel.dataReceived(b"GET /nothing HTTP/1.1\r\nHost: x\r\n\r\n")
    finally:
        globalLogPublisher.removeObserver(events.append)
    access = [e for e in events if e.get("log_namespace") == "rhapsode.access"]
    assert [(e["method"], e["path"], e["status"]) for e in access] == [
        ("GET", "/things/a", 200),
        ("GET", "/nothing", 404),
    ]
    assert all(e["log_level"] == LogLevel.info and "duration" in e for e in access)
    assert "no route" in access[1]["reason"]


def test_an_answered_health_check_is_logged_at_debug() -> None:
    """
    GET /health answered 200 is routine (the watchdog asks every few seconds): its access
    line is at debug, so the info log shows the requests that did something.
    """

    class Health:
        app = Klein()

        @app.route("/health", methods=["GET"])
        def health(self, request: IRequest) -> bytes:
            return b"{}"

    events: list[dict[str, Any]] = []
    site = DirectSite(Health().app.resource(), reactor=MemoryReactorClock(), routes=Routes(Health.app.url_map))
    channel = site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 50000))
    channel.makeConnection(StringTransport())
    globalLogPublisher.addObserver(events.append)
    try:
        channel.dataReceived(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    finally:
        globalLogPublisher.removeObserver(events.append)
    [line] = [e for e in events if e.get("log_namespace") == "rhapsode.access"]
    assert (line["path"], line["log_level"]) == ("/health", LogLevel.debug)


def test_a_channel_is_a_plain_http11_channel() -> None:
    """
    Connections are twisted.web's HTTP/1.1 channel itself, not the proxy that waits for a
    TLS negotiation these sites never have.
    """
    _, channel, _, _ = serve()
    assert type(channel) is EagerChannel


class _Statuses:
    """
    An app answering any status it is asked for: the reason phrase is the server's.
    """

    app = Klein()

    @app.route("/status/<int:code>", methods=["GET"])
    def status(self, request: IRequest, code: int) -> bytes:
        request.setResponseCode(code)
        return b""


@pytest.mark.parametrize(
    "code, phrase",
    [(200, b"OK"), (404, b"Not Found"), (408, b"Request Timeout"), (413, b"Content Too Large"), (422, b"Unprocessable Content"), (429, b"Too Many Requests"),
     (431, b"Request Header Fields Too Large"), (503, b"Service Unavailable")],
)
def test_every_status_goes_out_with_its_standard_reason_phrase(code: int, phrase: bytes) -> None:
    """
    A handler's status, set without a phrase, goes out with the standard one (twisted.web
    knows no 422, 429 or 431 and would send "Unknown Status", and spells others the
    way RFC 9110 no longer does).
    """
    clock = MemoryReactorClock()
    app = _Statuses()
    site = DirectSite(app.app.resource(), reactor=clock, routes=Routes(app.app.url_map))
    channel = site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 50000))
    transport = StringTransport(peerAddress=IPv4Address("TCP", "127.0.0.1", 50001))
    channel.makeConnection(transport)
    channel.dataReceived(b"GET /status/%d HTTP/1.1\r\nHost: x\r\n\r\n" % code)
    assert transport.value().split(b"\r\n", 1)[0] == b"HTTP/1.1 %d %s" % (code, phrase)


def test_a_refusal_at_the_head_goes_out_with_its_standard_reason_phrase() -> None:
    """
    431, which twisted.web has no phrase for, is "Request Header Fields Too Large" when
    the channel refuses a head.
    """
    _, channel, transport, _ = serve()
    headers = b"".join(b"X-N%d: v\r\n" % i for i in range(600))
    channel.dataReceived(b"GET /things/a HTTP/1.1\r\n" + headers + b"\r\n")
    assert transport.value().startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")


class _Shadowed:
    """
    A static path beside a rule whose argument also matches it: /jobs/outdated (POST)
    and /jobs/<job> (GET), as /installs/outdated and /installs/<job> are in the core.
    """

    app = Klein()

    @app.route("/jobs/outdated", methods=["POST"])
    def outdated(self, request: IRequest) -> bytes:
        return b"outdated"

    @app.route("/jobs/<string:job>", methods=["GET"])
    def job(self, request: IRequest, job: str) -> bytes:
        return job.encode()


def test_allow_names_only_the_methods_of_the_route_the_path_is() -> None:
    """
    A wrong method on /jobs/outdated is told the methods of /jobs/outdated (POST), not
    also those of /jobs/<job>, whose argument happens to match the word "outdated".
    """
    app = _Shadowed()
    routes = Routes(app.app.url_map)
    with pytest.raises(Exception) as refused:
        routes.resolve(b"DELETE", b"/jobs/outdated")
    assert dict(refused.value.headers)[b"Allow"] == b"POST"  # type: ignore[attr-defined]
    with pytest.raises(Exception) as refused:
        routes.resolve(b"DELETE", b"/jobs/j-1")
    assert dict(refused.value.headers)[b"Allow"] == b"GET, HEAD"  # type: ignore[attr-defined]
