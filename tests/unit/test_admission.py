"""
Admission in the core (rhapsode._http.site): at a request's head, before its body is
read, the management guard runs on the route as the router will resolve it, the body is
held to its route's limit, Authorization is removed, and a voice upload starts streaming
to its worker (protocol.md sections 7 and 10).  Driven with raw bytes on a memory
transport through the core's real site and routes, with a fake worker.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionDone
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure

from rhapsode._fleet.registry import EngineHandle, Registry
from rhapsode._service import build_core

from _fakes import FakeClient, FakeSupervisor

TOKEN = "s3cret-token-of-length"


def connect(peer: str = "127.0.0.1", token: str | None = None) -> tuple[Any, StringTransport, FakeClient]:
    _, channel, transport, client = connect_core(peer, token)
    return channel, transport, client


def connect_core(peer: str = "127.0.0.1", token: str | None = None) -> tuple[Any, Any, StringTransport, FakeClient]:
    client = FakeClient(fallback=lambda method, path: (200, {"deleted": path}))
    handle = EngineHandle("tone", client, FakeSupervisor("up", 1))
    app = build_core(Registry({"tone": handle}), reactor=MemoryReactorClock(), management_token=token)
    channel = app.site().buildProtocol(IPv4Address("TCP", "127.0.0.1", 8080))
    transport = StringTransport(peerAddress=IPv4Address("TCP", peer, 40000))
    channel.makeConnection(transport)
    return app, channel, transport, client


def refusal(transport: StringTransport) -> tuple[int, dict[str, Any]]:
    """
    The one response written, an error envelope, with the connection closing.
    """
    head, _, body = transport.value().partition(b"\r\n\r\n")
    assert transport.disconnecting
    assert b"Content-Type: application/json" in head
    return int(head.split(b" ")[1]), json.loads(body)["error"]


@pytest.mark.parametrize(
    "line",
    [
        b"POST /engines/tone/voices HTTP/1.1",
        b"post /engines/tone/voices HTTP/1.1",
        b"POST /engines/tone/voice%73 HTTP/1.1",
        b"POST /engines%2Ftone%2Fvoices HTTP/1.1",
        b"delete /engines/tone/voices/x HTTP/1.1",
        b"POST /engines/tone/unl%6fad HTTP/1.1",
    ],
)
def test_a_remote_caller_is_refused_on_every_spelling_of_a_management_route(line: bytes) -> None:
    """
    The guard runs on the route the router will run: a lower-case method or a
    percent-encoded path reaches the same route, so it is refused the same way, at the
    head, with nothing of a 30 MB body read and no worker asked.
    """
    channel, transport, client = connect(peer="203.0.113.9")
    channel.dataReceived(line + b"\r\nHost: box\r\nContent-Length: 30000000\r\n\r\n" + b"x" * 4096)
    status, error = refusal(transport)
    assert (status, error["code"]) == (403, "forbidden")
    assert client.requests == []


def test_a_loopback_caller_passes_the_guard_and_loses_authorization() -> None:
    """
    A local caller reaches the management route; the Authorization header it sent is
    gone before the handler runs.
    """
    channel, transport, client = connect()
    channel.dataReceived(
        b"DELETE /engines/tone/voices/abc HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer xyz\r\n\r\n"
    )
    assert client.requests == [(b"DELETE", "/voices/abc", None)]
    assert b"HTTP/1.1 200" in transport.value()


def test_a_remote_caller_with_the_token_is_admitted() -> None:
    """
    From anywhere, the management token admits a caller; the token never reaches a handler.
    """
    channel, transport, client = connect(peer="203.0.113.9", token=TOKEN)
    channel.dataReceived(
        b"DELETE /engines/tone/voices/abc HTTP/1.1\r\nHost: box\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\n\r\n"
    )
    assert client.requests == [(b"DELETE", "/voices/abc", None)]


def test_a_speak_body_over_its_limit_is_refused_at_the_head() -> None:
    """
    A 300 MB POST /speak is refused before any of it is read or spooled, in the
    envelope, on any spelling of the route.
    """
    for line in (b"POST /speak HTTP/1.1", b"post /spea%6b HTTP/1.1"):
        channel, transport, client = connect()
        channel.dataReceived(line + b"\r\nHost: localhost\r\nContent-Length: 300000000\r\n\r\n{")
        status, error = refusal(transport)
        assert (status, error["code"], error["field"]) == (413, "bad_request", "body")
        assert client.requests == []


def test_an_upload_over_25_mb_is_refused_at_the_head_before_its_worker_is_asked() -> None:
    """
    A voice upload that says it is over the section 7 cap is refused at once; one that
    does not say, and then goes over, is refused as it passes the cap.
    """
    channel, transport, client = connect()
    channel.dataReceived(b"POST /engines/tone/voices HTTP/1.1\r\nHost: localhost\r\nContent-Length: 25000001\r\n\r\n")
    status, error = refusal(transport)
    assert (status, error["field"]) == (413, "body")
    assert client.requests == []


def test_an_upload_starts_streaming_to_its_worker_at_the_head() -> None:
    """
    Once admitted, a voice upload's worker request starts at once, fed the body as it
    arrives: nothing of it is kept in the core.
    """
    channel, transport, client = connect()
    channel.dataReceived(
        b"POST /engines/tone/voices HTTP/1.1\r\nHost: localhost\r\nContent-Type: multipart/form-data; boundary=b\r\n"
        b"Content-Length: 10\r\n\r\n"
    )
    [(method, path, upload)] = client.requests
    assert (method, path) == (b"POST", "/voices")
    assert upload.length == 10
    channel.dataReceived(b"0123456789")
    assert upload.received == 10


def test_unknown_routes_and_methods_are_the_envelope() -> None:
    """
    An unknown path is 404 and a known path with the wrong method 405 naming what it
    takes, both as the error envelope rather than HTML or a 400 "no route".
    """
    channel, transport, _ = connect()
    channel.dataReceived(b"GET /nope HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert refusal(transport)[0] == 404
    channel, transport, _ = connect()
    channel.dataReceived(b"GET /speak HTTP/1.1\r\nHost: localhost\r\n\r\n")
    status, error = refusal(transport)
    assert status == 405 and b"Allow: POST" in transport.value()


def test_an_upload_cut_off_by_its_worker_is_retryable_not_the_clients_fault() -> None:
    """
    A voice upload whose worker goes away mid-body (an eviction, an unload, a crash) is
    refused as model_unavailable, retryable, rather than bad_request.
    """
    channel, transport, client = connect()
    channel.dataReceived(
        b"POST /engines/tone/voices HTTP/1.1\r\nHost: localhost\r\nContent-Type: multipart/form-data; boundary=b\r\n"
        b"Content-Length: 100\r\n\r\n0123456789"
    )
    [(_, _, upload)] = client.requests
    upload.stopProducing()  # the worker's connection went
    channel.dataReceived(b"more of the body")
    status, error = refusal(transport)
    assert (status, error["code"], error["retryable"]) == (503, "model_unavailable", True)


def test_an_unload_is_refused_while_an_upload_is_in_flight() -> None:
    """
    POST /engines/{id}/unload answers 409 while a voice upload streams to that engine's
    worker, as it does while the engine speaks; once the upload is over it unloads.
    """
    core, channel, transport, client = connect_core()
    channel.dataReceived(
        b"POST /engines/tone/voices HTTP/1.1\r\nHost: localhost\r\nContent-Type: multipart/form-data; boundary=b\r\n"
        b"Content-Length: 100\r\n\r\n0123456789"
    )
    app = core.router
    unloading = channel.site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 8080))
    answered = StringTransport(peerAddress=IPv4Address("TCP", "127.0.0.1", 40001))
    unloading.makeConnection(answered)
    unloading.dataReceived(b"POST /engines/tone/unload HTTP/1.0\r\nHost: localhost\r\n\r\n")
    head, _, body = answered.value().partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 409") and json.loads(body)["error"]["code"] == "conflict"
    assert "voice upload" in json.loads(body)["error"]["message"]
    channel.connectionLost(Failure(ConnectionDone()))
    assert app.uploads == {"tone": 0}


def test_a_head_too_slow_is_refused_408_before_any_request_exists() -> None:
    """
    A head dribbled past the head deadline is answered 408 in the taxonomy's envelope
    and closed, although no request (no route, no request line) exists yet to shape the
    refusal by.
    """
    clock = MemoryReactorClock()
    core = build_core(Registry({}), reactor=clock, head_timeout=2)
    channel = core.site().buildProtocol(IPv4Address("TCP", "127.0.0.1", 8080))
    transport = StringTransport(peerAddress=IPv4Address("TCP", "127.0.0.1", 40000))
    channel.makeConnection(transport)
    for byte in b"GET /health HTTP/1.0\r\nHost: x\r\nX-Slow: aaaaaaa":
        channel.dataReceived(bytes([byte]))
        clock.advance(0.25)
    status, error = refusal(transport)
    assert status == 408 and error["code"] == "bad_request" and "within 2 s" in error["message"]


class Refused:
    """
    A worker's refusal of an upload, its envelope delivered at once.
    """

    code = 422

    def __init__(self) -> None:
        from twisted.web.http_headers import Headers

        self.headers = Headers({b"Content-Type": [b"application/json"]})

    def deliverBody(self, protocol: Any) -> None:
        from twisted.web.client import ResponseDone

        protocol.makeConnection(StringTransport())
        protocol.dataReceived(json.dumps({"error": {
            "code": "unsupported", "message": "reference mp3 is not one of wav", "retryable": False,
            "field": "reference"}}).encode())
        protocol.connectionLost(Failure(ResponseDone()))


class Consumer:
    def __init__(self) -> None:
        self.written = b""

    def write(self, data: bytes) -> None:
        self.written += data


def test_an_upload_refused_by_its_worker_leaves_its_connection_reading() -> None:
    """
    An upload whose worker paused it (its socket full) and then refused it with 422
    once the body was in: the refusal is answered, the client's connection reads
    again, and the next request on it is answered (the pause was the channel's own
    "the transport is full", which kept it from ever reading the next request).
    """
    channel, transport, client = connect()
    body = b"--b\r\nContent-Disposition: form-data; name=\"id\"\r\n\r\nv\r\n--b--\r\n"
    channel.dataReceived(
        b"POST /engines/tone/voices HTTP/1.1\r\nHost: localhost\r\nContent-Type: multipart/form-data; boundary=b\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    [(_, _, upload)] = client.requests
    consumer = Consumer()
    done = upload.startProducing(consumer)
    upload.pauseProducing()  # the worker's socket is full
    assert transport.producerState == "paused"
    channel.dataReceived(body)
    assert consumer.written == body and done.called
    client.pending[0].callback(Refused())  # the worker read it all, then refused it
    head, _, answer = transport.value().partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 422") and b'"code": "unsupported"' in answer
    assert not transport.disconnecting
    assert transport.producerState == "producing"
    transport.clear()
    channel.dataReceived(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert transport.value().startswith(b"HTTP/1.1 200")


def test_a_client_that_goes_mid_upload_takes_the_workers_request_with_it() -> None:
    """
    A client that hangs up before its upload's body is in fails the upload, so the
    worker's request is given up on at once (the worker then lets go of the spooled
    body), and nothing is answered on the gone connection.
    """
    channel, transport, client = connect()
    channel.dataReceived(
        b"POST /engines/tone/voices HTTP/1.1\r\nHost: localhost\r\nContent-Type: multipart/form-data; boundary=b\r\n"
        b"Content-Length: 1000\r\n\r\n0123456789"
    )
    [(_, _, upload)] = client.requests
    done = upload.startProducing(Consumer())
    channel.connectionLost(Failure(ConnectionDone()))
    assert done.called and client.pending[0].called
    failures: list[Failure] = []
    done.addErrback(failures.append)
    client.pending[0].addErrback(lambda _: None)
    assert failures and transport.value() == b""


def test_an_upload_answered_with_json_too_deep_to_read_is_the_workers_fault() -> None:
    """
    A worker that answers an upload with JSON nested too deep to parse (a remote worker
    is any server at a URL) gets the caller a 500 internal, not the bad_request that
    would blame the caller's body.
    """
    from _fakes import FakeResponse

    channel, transport, client = connect()
    body = b"--b\r\nContent-Disposition: form-data; name=\"id\"\r\n\r\nv\r\n--b--\r\n"
    channel.dataReceived(
        b"POST /engines/tone/voices HTTP/1.1\r\nHost: localhost\r\nContent-Type: multipart/form-data; boundary=b\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    deep = b"[" * 1100 + b"]" * 1100
    client.pending[0].callback(FakeResponse(201, deep, {b"Content-Type": b"application/json"}))
    head, _, answer = transport.value().partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 500"), head
    assert b'"code": "internal"' in answer and b'"retryable": false' in answer
