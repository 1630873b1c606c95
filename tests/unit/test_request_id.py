"""
x-request-id on the HTTP server both processes listen with: a client's id is echoed on
its answer and named in its access line, one is made where the client sent none (or one
that is not fit for a log line), and a refusal at the head carries one too.
"""

from __future__ import annotations

from typing import Any

from twisted.logger import globalLogPublisher

from rhapsode_protocol.http.site import REQUEST_ID

from test_site import answers, only, serve


def _access(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("log_namespace") == "rhapsode.access"]


def test_a_clients_request_id_is_echoed_and_logged() -> None:
    """
    The id the client sent comes back on its answer, and its access line names it.
    """
    events: list[dict[str, Any]] = []
    globalLogPublisher.addObserver(events.append)
    try:
        _, channel, transport, _ = serve()
        channel.dataReceived(b"GET /things/a HTTP/1.1\r\nHost: x\r\nX-Request-Id: lk-4f2a.9\r\n\r\n")
    finally:
        globalLogPublisher.removeObserver(events.append)
    [(status, headers, _)] = answers(transport.value())
    assert (status, headers[b"x-request-id"]) == (200, b"lk-4f2a.9")
    [line] = _access(events)
    assert line["request_id"] == "lk-4f2a.9" and "id={request_id}" in line["log_format"]


def test_an_id_is_made_for_a_request_without_one_and_each_differs() -> None:
    """
    A request that sends none is given one, a different one for each request.
    """
    _, channel, transport, _ = serve()
    channel.dataReceived(b"GET /things/a HTTP/1.1\r\nHost: x\r\n\r\n")
    channel.dataReceived(b"GET /things/b HTTP/1.1\r\nHost: x\r\n\r\n")
    [(_, first, _), (_, second, _)] = answers(transport.value())
    assert REQUEST_ID.fullmatch(first[b"x-request-id"]) and len(first[b"x-request-id"]) == 32
    assert first[b"x-request-id"] != second[b"x-request-id"]


def test_an_unfit_id_is_replaced_not_echoed() -> None:
    """
    An id with a space or quote in it, an overlong one, or two of them, is not written
    back or logged: the answer carries one made here.
    """
    for sent in (b"X-Request-Id: a b\"c\r\n", b"X-Request-Id: " + b"x" * 129 + b"\r\n",
                 b"X-Request-Id: one\r\nX-Request-Id: two\r\n"):
        _, channel, transport, _ = serve()
        channel.dataReceived(b"GET /things/a HTTP/1.1\r\nHost: x\r\n" + sent + b"\r\n")
        [(_, headers, _)] = answers(transport.value())
        echoed = headers[b"x-request-id"]
        assert len(echoed) == 32 and echoed not in sent


def test_a_refusal_at_the_head_carries_the_request_id() -> None:
    """
    A 404 decided before any handler runs still answers with the client's id, and its
    access line names it.
    """
    events: list[dict[str, Any]] = []
    globalLogPublisher.addObserver(events.append)
    try:
        _, channel, transport, _ = serve()
        channel.dataReceived(b"GET /nothing HTTP/1.1\r\nHost: x\r\nX-Request-Id: abc-123\r\n\r\n")
    finally:
        globalLogPublisher.removeObserver(events.append)
    status, headers, _ = only(transport)
    assert (status, headers[b"x-request-id"]) == (404, b"abc-123")
    [line] = _access(events)
    assert line["request_id"] == "abc-123"


def test_a_refusal_before_any_request_still_carries_an_id() -> None:
    """
    A request line too long is refused before a request exists: its answer has an id.
    """
    _, channel, transport, _ = serve()
    channel.dataReceived(b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n")
    status, headers, _ = only(transport)
    assert status == 414 and len(headers[b"x-request-id"]) == 32
