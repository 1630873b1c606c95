"""
Browser pages on other origins (the cors.origins setting): a page on an allowed origin
may call the public speech and discovery routes, preflight included; any other origin,
and every management route, is refused at the head.  And refusals at the head of an
OpenAI route come in OpenAI's envelope.  Raw bytes on a memory transport through the
core's real site and routes.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from twisted.internet.address import IPv4Address
from twisted.internet.testing import MemoryReactorClock, StringTransport

from rhapsode._fleet.registry import EngineHandle, Registry
from rhapsode._service import build_core

from _fakes import FakeClient, FakeSupervisor

PAGE = "https://studio.example"


def connect(cors: tuple[str, ...] = (PAGE,)) -> tuple[Any, StringTransport]:
    handle = EngineHandle("tone", FakeClient(fallback=lambda method, path: (200, {"deleted": path})), FakeSupervisor("up", 1))
    app = build_core(Registry({"tone": handle}), reactor=MemoryReactorClock(), cors_origins=cors)
    channel = app.site().buildProtocol(IPv4Address("TCP", "127.0.0.1", 8080))
    transport = StringTransport(peerAddress=IPv4Address("TCP", "203.0.113.9", 40000))
    channel.makeConnection(transport)
    return channel, transport


def head(transport: StringTransport) -> tuple[int, dict[str, str], bytes]:
    raw, _, body = transport.value().partition(b"\r\n\r\n")
    lines = raw.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def preflight(path: bytes, method: bytes, origin: str, asked: bytes = b"content-type, authorization") -> bytes:
    return (b"OPTIONS " + path + b" HTTP/1.1\r\nHost: box\r\nOrigin: " + origin.encode()
            + b"\r\nAccess-Control-Request-Method: " + method
            + b"\r\nAccess-Control-Request-Headers: " + asked + b"\r\n\r\n")


@pytest.mark.parametrize("path, method", [
    (b"/v1/audio/speech", b"POST"), (b"/speak", b"POST"), (b"/v1/audio/voices?model=tone", b"GET"),
    (b"/engines/tone/dialogue", b"POST"), (b"/engines", b"GET"),
])
def test_a_preflight_from_an_allowed_origin_is_answered(path: bytes, method: bytes) -> None:
    """
    A preflight from an origin in cors.origins for a public route is 204, allowing that
    origin, the method and the headers the page asked to send, for a while.
    """
    channel, transport = connect()
    channel.dataReceived(preflight(path, method, PAGE))
    status, headers, _ = head(transport)
    assert status == 204
    assert headers["access-control-allow-origin"] == PAGE
    assert headers["access-control-allow-methods"] == method.decode()
    assert headers["access-control-allow-headers"] == "content-type, authorization"
    assert headers["vary"] == "Origin" and int(headers["access-control-max-age"]) > 0


@pytest.mark.parametrize("path, method, origin, cors", [
    (b"/v1/audio/speech", b"POST", "https://elsewhere.example", (PAGE,)),
    (b"/v1/audio/speech", b"POST", PAGE, ()),
    (b"/engines/tone/voices", b"POST", PAGE, (PAGE,)),
    (b"/engines/tone/unload", b"POST", PAGE, ("*",)),
])
def test_a_preflight_is_refused_for_other_origins_and_management_routes(
    path: bytes, method: bytes, origin: str, cors: tuple[str, ...]
) -> None:
    """
    A preflight from an origin not allowed (none is by default), or for a management
    route whatever the setting, is refused as forbidden with no CORS header.
    """
    channel, transport = connect(cors)
    channel.dataReceived(preflight(path, method, origin))
    status, headers, body = head(transport)
    assert status == 403 and "access-control-allow-origin" not in headers
    assert json.loads(body)["error"]["code"] == "forbidden"


def test_an_answer_to_an_allowed_page_carries_the_cors_headers() -> None:
    """
    A public route's answer to a page on an allowed origin lets the page read it,
    including the duration header and x-should-retry; without an Origin nothing is added.
    """
    channel, transport = connect(("*",))
    channel.dataReceived(b"GET /v1/models HTTP/1.1\r\nHost: box\r\nOrigin: https://any.example\r\n\r\n")
    status, headers, _ = head(transport)
    assert status == 200 and headers["access-control-allow-origin"] == "https://any.example"
    assert "X-Rhapsode-Duration-Ms" in headers["access-control-expose-headers"]
    assert "x-should-retry" in headers["access-control-expose-headers"]
    channel, transport = connect(("*",))
    channel.dataReceived(b"GET /v1/models HTTP/1.1\r\nHost: box\r\n\r\n")
    assert "access-control-allow-origin" not in head(transport)[1]


def test_a_refusal_at_the_head_of_an_openai_route_is_openais_envelope() -> None:
    """
    A body over the shim's limit is refused before it is read, in OpenAI's envelope
    with x-should-retry, and with CORS headers for an allowed page so it can read why.
    """
    channel, transport = connect()
    channel.dataReceived(b"POST /v1/audio/speech HTTP/1.1\r\nHost: box\r\nOrigin: " + PAGE.encode()
                         + b"\r\nContent-Length: 99999999\r\n\r\n")
    status, headers, body = head(transport)
    error = json.loads(body)["error"]
    assert status == 413 and error["code"] == "bad_request" and error["type"] == "invalid_request_error"
    assert headers["x-should-retry"] == "false" and headers["access-control-allow-origin"] == PAGE


def test_a_page_from_elsewhere_cannot_reach_mcp_but_an_agent_can() -> None:
    """
    /mcp refuses a request whose Origin is not this machine's (section 12) before its
    body is read; an allowed CORS origin does not widen that, and no Origin passes.
    """
    channel, transport = connect()
    channel.dataReceived(b"POST /mcp HTTP/1.1\r\nHost: box\r\nOrigin: https://evil.example\r\n"
                         b"Content-Length: 2\r\n\r\n{}")
    status, _, body = head(transport)
    assert status == 403 and json.loads(body)["error"]["code"] == "forbidden"
    channel, transport = connect()
    channel.dataReceived(b"POST /mcp HTTP/1.1\r\nHost: box\r\nOrigin: " + PAGE.encode()
                         + b"\r\nContent-Length: 2\r\n\r\n{}")
    assert head(transport)[0] == 403


def test_cors_origins_are_checked_when_the_config_is_read() -> None:
    """
    cors.origins takes absolute origins or ["*"], nothing by default; a URL with a path,
    or "*" among other origins, fails the config naming the key.
    """
    from pathlib import Path

    from rhapsode._config import ConfigError, parse_config

    assert parse_config({}, Path(".")).cors.origins == ()
    assert parse_config({"cors": {"origins": ["*"]}}, Path(".")).cors.origins == ("*",)
    assert parse_config({"cors": {"origins": [PAGE]}}, Path(".")).cors.origins == (PAGE,)
    for bad in (["https://studio.example/page"], ["*", PAGE], "*"):
        with pytest.raises(ConfigError, match="cors.origins"):
            parse_config({"cors": {"origins": bad}}, Path("."))
