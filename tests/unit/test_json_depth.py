"""
JSON nested too deep is a clear refusal, never a 500 (issue 23 section 3): every JSON
body the core or a worker parses, and every message the speech WebSocket reads, has its
depth bounded before a parser recurses into it.  Python's parser recurses once per level
and stops at the interpreter's limit: a 1,100-deep array of 2.2 KB reached it, and /mcp
answered 500 text/html with a RecursionError.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from twisted.internet.address import IPv4Address
from twisted.internet.testing import MemoryReactorClock, StringTransport

from rhapsode._fleet.registry import EngineHandle, Registry
from rhapsode._http.table import NODE_ROUTES, ROUTES
from rhapsode._manage.settings import read_patch
from rhapsode._service import build_core
from rhapsode_protocol.errors import BadRequest
from rhapsode_protocol.validation import MAX_JSON_DEPTH, TooDeep, check_json_depth, parse_json_body

from _fakes import FakeClient, FakeSupervisor

DEEP = b"[" * 1100 + b"]" * 1100


def nested(depth: int) -> bytes:
    return b'{"a":' * (depth - 1) + b"[1]" + b"}" * (depth - 1)


def test_depth_is_counted_in_structure_not_in_strings() -> None:
    """
    A document nested exactly MAX_JSON_DEPTH deep passes and one level more is refused
    naming the body; brackets inside strings (escaped quotes included) are text.
    """
    check_json_depth(nested(MAX_JSON_DEPTH))
    with pytest.raises(TooDeep) as refused:
        check_json_depth(nested(MAX_JSON_DEPTH + 1))
    assert refused.value.field == "body" and f"deeper than {MAX_JSON_DEPTH}" in refused.value.message
    check_json_depth(json.dumps({"text": "[" * 5000, "quote": '\\"[{' * 100}))
    check_json_depth(json.dumps([{"a": [1, 2, {"b": []}]}] * 5000))
    with pytest.raises(TooDeep):
        check_json_depth("[" * 100)  # brackets that never close, as deep as you like


def test_the_body_reader_refuses_a_deep_body_before_parsing_it() -> None:
    """
    The body reader both sides use refuses a deep body as bad_request naming the body.
    """
    with pytest.raises(BadRequest) as refused:
        parse_json_body(DEEP, {"type": "object"})
    assert refused.value.status == 400 and refused.value.field == "body"


def test_a_settings_patch_nested_too_deep_is_bad_request() -> None:
    """
    PATCH /settings reads its body with the same bound: bad_request, not a RecursionError.
    """
    with pytest.raises(BadRequest) as refused:
        read_patch(DEEP)
    assert refused.value.status == 400 and "deeper" in refused.value.message


def core_answer(method: str, path: str, body: bytes, node: str | None = None) -> tuple[int, bytes, bytes]:
    client = FakeClient(fallback=lambda method, path: (200, {}))
    handle = EngineHandle("tone", client, FakeSupervisor("up", 1))
    app = build_core(Registry({"tone": handle}), reactor=MemoryReactorClock(), node=node)
    channel = app.site().buildProtocol(IPv4Address("TCP", "127.0.0.1", 8080))
    transport = StringTransport(peerAddress=IPv4Address("TCP", "127.0.0.1", 40000))
    channel.makeConnection(transport)
    channel.dataReceived(
        b"%s %s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
        % (method.encode(), path.encode(), len(body), body)
    )
    head, _, rest = transport.value().partition(b"\r\n\r\n")
    if b"Transfer-Encoding: chunked" in head:
        size, _, rest = rest.partition(b"\r\n")
        rest = rest[: int(size, 16)]
    return int(head.split(b" ")[1]), head, rest


BODIED = [spec for spec in ROUTES + NODE_ROUTES if spec.method in ("POST", "PATCH", "PUT") and not spec.upload]


@pytest.mark.parametrize("spec", BODIED, ids=[f"{s.method} {s.rule}" for s in BODIED])
def test_no_route_answers_a_deep_body_with_a_server_error(spec: Any) -> None:
    """
    Every route of the public port that takes a body (a cluster node's worker routes
    included, on a core that is a node) answers a 1,100-deep array in JSON, with a
    status under 500: a refusal of the body (or of the call), never a traceback.
    """
    path = spec.rule.replace("<string:engine_id>", "tone").replace("<string:job_id>", "j1")
    node = "box-1" if spec in NODE_ROUTES else None
    status, head, body = core_answer(spec.method, path, DEEP, node)
    assert status < 500, (status, body[:300])
    assert b"Content-Type: application/json" in head
    json.loads(body)


def test_mcp_answers_a_deep_body_with_a_json_rpc_parse_error() -> None:
    """
    POST /mcp with a 1,100-deep array is JSON-RPC's parse error (-32700), HTTP 400,
    application/json, with a null id: not 500 text/html.
    """
    status, head, body = core_answer("POST", "/mcp", DEEP)
    answer = json.loads(body)
    assert status == 400 and b"Content-Type: application/json" in head
    assert answer["id"] is None and answer["error"]["code"] == -32700
    assert f"deeper than {MAX_JSON_DEPTH}" in answer["error"]["message"]
