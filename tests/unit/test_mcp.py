"""
The MCP server at POST /mcp (protocol.md section 12) on an in-memory reactor with a fake
worker: the JSON-RPC answers per message, the five tools and their schemas, audio as
audio content, refusals as tool errors, and what the core's site does at the head
(the Origin rule, Authorization stripped, 405 for GET and DELETE).  Every answer is
read back through the SDK's own wire models (mcp_types).
"""

from __future__ import annotations

import base64
import io
import json
import wave
from typing import Any

import jsonschema
import mcp_types
import pytest
from treq.testing import StubTreq
from twisted.internet.address import IPv4Address
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import ResponseDone
from twisted.web.http_headers import Headers
from twisted.web.test.requesthelper import DummyRequest

from rhapsode._doors import mcp as _mcp
from rhapsode._doors.mcp import PROTOCOL_VERSIONS, inline, tool_definitions
from rhapsode._fleet.registry import EngineHandle, Registry
from rhapsode._service import build_core
from rhapsode._speech.inprocess import base64_size
from rhapsode_protocol import contract

from _fakes import FakeClient, FakeResponse, FakeSupervisor

VARIANT = {
    "cues": ["laugh"],
    "deliveries": [],
    "dials": {},
    "languages": ["en"],
    "maxCharacters": 4096,
    "segmentation": {"supported": False},
    "streaming": {"supported": True, "granularity": "chunk"},
}
CAPABILITIES = {
    "contract": 1,
    "engine": {"id": "tone", "displayName": "Tone", "adapterVersion": "0.1.0"},
    "license": {"code": "MIT", "weights": "MIT", "weightsCommercialUse": True, "notes": ""},
    "device": {"type": "cpu"},
    "defaultVariant": "expressive",
    "variants": {"expressive": VARIANT, "classic": {**VARIANT, "dialogue": {"maxSpeakers": 2}}},
    "formats": ["wav", "pcm"],
    "nativeFormat": {"encoding": "pcm_s16le", "sampleRate": 24000, "channels": 1},
}
VOICES = [
    {"id": voice, "label": voice.title(), "spec": f"{voice}@1", "tags": [],
     "previewUrl": f"/voices/{voice}/preview", "builtin": True}
    for voice in ("alto", "bass")
]
PCM_TYPE = b"audio/L16; rate=24000; channels=1"


def wav_of(frames: int, rate: int = 24000) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as writer:
        writer.setnchannels(1)
        writer.setsampwidth(2)
        writer.setframerate(rate)
        writer.writeframes(b"\x01\x00" * frames)
    return out.getvalue()


class FakeWorker(FakeClient):
    """
    A worker's client (the shared fake's table of JSON answers: its capabilities and
    voices) whose speech is a short WAV (or raw PCM when asked for pcm), or the refusal
    it is told to give.  It records every request and the body each speech request
    carried.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bodies: list[dict[str, Any]] = []
        self.refusal: tuple[int, dict[str, Any]] | None = None
        self.audio = wav_of(12000)

    async def json(self, method: bytes, path: str, body: Any = None) -> tuple[int, Any]:
        self.calls.append((method, path))
        answers = {"/capabilities": CAPABILITIES, "/voices": json.loads(json.dumps(VOICES)), "/health": {}}
        return 200, answers[path]

    def request(self, method: bytes, path: str, body: Any = None, headers: Any = None) -> "Deferred[Any]":
        self.calls.append((method, path))
        sent = json.loads(body.data)
        self.bodies.append(sent)
        if self.refusal is not None:
            status, envelope = self.refusal
            refusal = json.dumps(envelope).encode()
            return succeed(FakeResponse(status, refusal, {b"Content-Type": b"application/json"}))
        if sent.get("format") == "pcm":
            return succeed(FakeResponse(200, self.audio[44:], {b"Content-Type": PCM_TYPE}))
        headers = {b"Content-Type": b"audio/wav", b"X-Rhapsode-Duration-Ms": b"500"}
        return succeed(FakeResponse(200, self.audio, headers))


class Core:
    """
    A core over one fake tone worker, and its MCP endpoint as a client reaches it.
    """

    def __init__(self, **settings: Any) -> None:
        self.worker = FakeWorker()
        self.supervisor = FakeSupervisor()
        handle = EngineHandle("tone", self.worker, self.supervisor)
        self.app = build_core(Registry({"tone": handle}), reactor=MemoryReactorClock(), **settings)
        self.stub = StubTreq(self.app.resource())
        self.case = SynchronousTestCase()
        self._id = 0

    def post(self, body: bytes, headers: dict[bytes, list[bytes]] | None = None) -> tuple[int, Headers, bytes]:
        response = self.case.successResultOf(
            self.stub.request("POST", "http://core/mcp", data=body, headers=headers or {
                b"Content-Type": [b"application/json"],
                b"Accept": [b"application/json, text/event-stream"],
            })
        )
        return response.code, response.headers, self.case.successResultOf(self.stub.content(response))

    def rpc(self, method: str, params: Any = None) -> dict[str, Any]:
        """
        One JSON-RPC request, answered with HTTP 200 as JSON; the message it answered.
        """
        self._id += 1
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": self._id, "method": method}
        if params is not None:
            message["params"] = params
        code, headers, body = self.post(json.dumps(message).encode())
        assert code == 200
        assert headers.getRawHeaders(b"content-type") == [b"application/json"]
        assert not headers.hasHeader(b"mcp-session-id")
        answer = json.loads(body)
        assert answer["id"] == self._id
        return answer  # type: ignore[no-any-return]

    def result(self, method: str, params: Any = None) -> dict[str, Any]:
        answer = self.rpc(method, params)
        mcp_types.JSONRPCResponse.model_validate(answer)
        return answer["result"]  # type: ignore[no-any-return]

    def call(self, tool: str, arguments: Any = None) -> dict[str, Any]:
        params: dict[str, Any] = {"name": tool}
        if arguments is not None:
            params["arguments"] = arguments
        result = self.result("tools/call", params)
        same(mcp_types.CallToolResult, result)
        return result

    def error(self, method: str, params: Any = None) -> dict[str, Any]:
        answer = self.rpc(method, params)
        mcp_types.JSONRPCError.model_validate(answer)
        return answer["error"]  # type: ignore[no-any-return]


def same(model: Any, data: dict[str, Any]) -> None:
    """
    C{data} read as the SDK's C{model} and written back is C{data}: every field is one
    the SDK knows, spelled as it spells it, of the type it expects.
    """
    assert model.model_validate(data).model_dump(by_alias=True, exclude_unset=True, mode="json") == data


def tools(core: Core) -> dict[str, dict[str, Any]]:
    return {tool["name"]: tool for tool in core.result("tools/list")["tools"]}


# -- the JSON-RPC messages ------------------------------------------------------------------


@pytest.mark.parametrize("asked", PROTOCOL_VERSIONS)
def test_initialize_echoes_a_handshake_revision_it_speaks(asked: str) -> None:
    """
    initialize answers the client's protocolVersion when it is one of the three
    handshake revisions served, with the tools capability, the server's name and the
    package version, and no session id.
    """
    core = Core()
    result = core.result("initialize", {"protocolVersion": asked, "capabilities": {},
                                        "clientInfo": {"name": "test", "version": "1"}})
    same(mcp_types.InitializeResult, result)
    assert result["protocolVersion"] == asked
    assert result["capabilities"] == {"tools": {"listChanged": False}}
    assert result["serverInfo"]["name"] == "rhapsode" and result["serverInfo"]["version"] == core.app.mcp.version


@pytest.mark.parametrize("asked", ["2024-11-05", "2026-07-28", "tomorrow", None])
def test_initialize_answers_the_latest_revision_for_any_other(asked: Any) -> None:
    """
    A protocolVersion the server does not speak, or none, is answered with 2025-11-25.
    """
    params: dict[str, Any] = {"capabilities": {}, "clientInfo": {"name": "test", "version": "1"}}
    if asked is not None:
        params["protocolVersion"] = asked
    assert Core().result("initialize", params)["protocolVersion"] == "2025-11-25"


@pytest.mark.parametrize(
    "message",
    [
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 3}},
        {"jsonrpc": "2.0", "id": 7, "result": {}},
        {"jsonrpc": "2.0", "id": "x", "error": {"code": -1, "message": "no"}},
    ],
)
def test_notifications_and_client_responses_are_accepted_with_no_body(message: dict[str, Any]) -> None:
    """
    A notification, or a client's response, is answered 202 with an empty body: nothing
    is owed to it, and nothing is kept.
    """
    code, headers, body = Core().post(json.dumps(message).encode())
    assert (code, body) == (202, b"")
    assert not headers.hasHeader(b"mcp-session-id")


def test_ping_answers_an_empty_result() -> None:
    """
    ping is answered with an empty result.
    """
    result = Core().result("ping")
    assert result == {}
    same(mcp_types.EmptyResult, result)


@pytest.mark.parametrize("method", ["server/discover", "resources/list", "prompts/get", "notifications/initialized"])
def test_an_unknown_method_is_method_not_found_with_http_200(method: str) -> None:
    """
    server/discover (the 2026-07-28 probe, so the current client falls back to
    initialize) and any other method not served is -32601 under the request's id,
    with HTTP 200.
    """
    error = Core().error(method, {})
    assert error["code"] == -32601 and method in error["message"]


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"{not json", -32700),
        (b"", -32700),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "ping", "params": {"x": NaN}}', -32700),
        (b"\xff\xfe\x00", -32700),
        (b'[{"jsonrpc": "2.0", "id": 1, "method": "ping"}]', -32600),
        (b'"ping"', -32600),
        (b'{"id": 1, "method": "ping"}', -32600),
        (b'{"jsonrpc": "1.0", "id": 1, "method": "ping"}', -32600),
        (b'{"jsonrpc": "2.0", "id": 1.5, "method": "ping"}', -32600),
        (b'{"jsonrpc": "2.0", "id": true, "method": "ping"}', -32600),
        (b'{"jsonrpc": "2.0", "id": null, "method": "ping"}', -32600),
        (b'{"jsonrpc": "2.0", "id": 1, "method": 5}', -32600),
        (b'{"jsonrpc": "2.0", "id": 1}', -32600),
    ],
)
def test_a_body_that_is_not_one_json_rpc_message_is_400(body: bytes, code: int) -> None:
    """
    A body that is not JSON is -32700, and one that is JSON but not one JSON-RPC
    request, notification or response (a batch, no "jsonrpc": "2.0", an id that is
    neither a string nor an integer) is -32600: both HTTP 400 with a null id.
    """
    status, headers, raw = Core().post(body)
    assert status == 400 and headers.getRawHeaders(b"content-type") == [b"application/json"]
    answer = json.loads(raw)
    mcp_types.JSONRPCError.model_validate(answer)
    assert answer["id"] is None and answer["error"]["code"] == code


def test_params_that_are_not_an_object_are_invalid_params() -> None:
    """
    A request whose params are not an object is -32602 under its own id.
    """
    error = Core().error("tools/list", [1, 2])
    assert error["code"] == -32602


# -- tools/list -----------------------------------------------------------------------------


def test_tools_list_has_the_five_tools_each_schema_standing_alone() -> None:
    """
    tools/list lists the five tools of section 12, in the SDK's own Tool shape; no
    schema holds a $ref, and the three read-only tools say so and carry an output
    schema while the two that speak carry none.
    """
    core = Core()
    result = core.result("tools/list")
    same(mcp_types.ListToolsResult, result)
    listed = {tool["name"]: tool for tool in result["tools"]}
    assert list(listed) == ["list_engines", "engine_capabilities", "list_voices", "speak", "speak_dialogue"]
    assert "$ref" not in json.dumps(result)
    for name in ("list_engines", "engine_capabilities", "list_voices"):
        assert listed[name]["annotations"]["readOnlyHint"] is True
        assert listed[name]["outputSchema"]["type"] == "object"
        jsonschema.Draft202012Validator.check_schema(listed[name]["outputSchema"])
    for name in ("speak", "speak_dialogue"):
        assert listed[name]["annotations"]["readOnlyHint"] is False and "outputSchema" not in listed[name]
    for tool in listed.values():
        assert tool["inputSchema"]["type"] == "object" and tool["description"]
        jsonschema.Draft202012Validator.check_schema(tool["inputSchema"])


def test_speech_input_schemas_are_the_request_contract_without_stream() -> None:
    """
    speak takes /speak's body and speak_dialogue the dialogue body with engine added,
    field for field from the contract, except that neither takes stream and format
    says it defaults to wav.
    """
    listed = tools(Core())
    speak, dialogue = listed["speak"]["inputSchema"], listed["speak_dialogue"]["inputSchema"]
    for schema, request, required in (
        (speak, contract.PUBLIC_SPEAK_REQUEST, ["engine", "text"]),
        (dialogue, contract.PUBLIC_DIALOGUE_REQUEST, ["engine", "turns"]),
    ):
        assert "stream" not in schema["properties"] and schema["additionalProperties"] is False
        assert sorted(schema["required"]) == sorted(required)
        assert schema["properties"]["format"]["default"] == "wav"
        for name, field in request["properties"].items():
            if name not in ("stream", "format"):
                assert schema["properties"][name] == field, name
    assert dialogue["properties"]["engine"] == contract.PUBLIC_SPEAK_REQUEST["properties"]["engine"]
    assert list(speak["properties"])[0] == list(dialogue["properties"])[0] == "engine"


def test_output_schemas_are_the_response_contract_with_lists_under_items() -> None:
    """
    The read-only tools' output schemas are the route's response shapes with the
    components inlined, a list wrapped as an object whose items is that list.
    """
    listed = tools(Core())
    components = contract.public_openapi("0")["components"]["schemas"]
    assert listed["engine_capabilities"]["outputSchema"] == inline(contract.CAPABILITIES, components)
    for name, shape in (("list_engines", contract.ENGINE_LIST), ("list_voices", contract.VOICE_LIST)):
        wrapped = listed[name]["outputSchema"]
        assert wrapped["required"] == ["items"] and wrapped["properties"]["items"] == inline(shape, components)
        assert wrapped["properties"]["items"]["items"]["type"] == "object"


def test_inlining_resolves_nested_references_and_refuses_what_it_cannot_write_out() -> None:
    """
    A $ref is replaced by its component, recursively and with its sibling keywords
    kept; a reference that names no component, or that reaches itself, is refused.
    """
    components = {
        "A": {"type": "object", "properties": {"b": {"$ref": "#/components/schemas/B"}}},
        "B": {"type": "string"},
        "Loop": {"type": "array", "items": {"$ref": "#/components/schemas/Loop"}},
    }
    schema = {"type": "array", "items": {"$ref": "#/components/schemas/A", "description": "an A"}}
    assert inline(schema, components) == {
        "type": "array",
        "items": {"type": "object", "properties": {"b": {"type": "string"}}, "description": "an A"},
    }
    with pytest.raises(ValueError, match="unresolvable"):
        inline({"$ref": "#/components/schemas/Missing"}, components)
    with pytest.raises(ValueError, match="unresolvable"):
        inline({"$ref": "https://elsewhere/A"}, components)
    with pytest.raises(ValueError, match="itself"):
        inline({"$ref": "#/components/schemas/Loop"}, components)


def test_tool_definitions_are_built_once() -> None:
    """
    The tools come from the contract once per process: each core's listing shares them.
    """
    assert tool_definitions() is tool_definitions()
    assert Core().app.mcp.specs["speak"] is Core().app.mcp.specs["speak"]


# -- the read-only tools --------------------------------------------------------------------


def check_structured(core: Core, tool: str, result: dict[str, Any]) -> Any:
    """
    A successful read-only result: its structured content matches the tool's output
    schema, and its text is the same JSON.
    """
    assert result["isError"] is False
    structured = result["structuredContent"]
    jsonschema.validate(structured, tools(core)[tool]["outputSchema"])
    [text] = result["content"]
    assert text["type"] == "text" and json.loads(text["text"]) == structured
    return structured


def test_list_engines_is_get_engines_under_items_and_starts_nothing() -> None:
    """
    list_engines answers what GET /engines does, as {"items": [...]}, and like the
    route starts no worker.
    """
    core = Core()
    structured = check_structured(core, "list_engines", core.call("list_engines"))
    direct = json.loads(core.case.successResultOf(core.stub.content(
        core.case.successResultOf(core.stub.get("http://core/engines")))))
    assert structured == {"items": direct}
    assert [engine["id"] for engine in structured["items"]] == ["tone"]
    assert core.supervisor.starts == 0 and core.worker.calls == []


def test_engine_capabilities_is_the_workers_document() -> None:
    """
    engine_capabilities answers the engine's capability document as its structured
    content.
    """
    core = Core()
    structured = check_structured(core, "engine_capabilities", core.call("engine_capabilities", {"engine": "tone"}))
    assert structured == CAPABILITIES


def test_list_voices_carries_the_previews_the_route_rewrites() -> None:
    """
    list_voices answers the route's voices, previewUrl rewritten under the engine as the
    route does, under items.
    """
    core = Core()
    structured = check_structured(core, "list_voices", core.call("list_voices", {"engine": "tone"}))
    assert [voice["id"] for voice in structured["items"]] == ["alto", "bass"]
    assert structured["items"][0]["previewUrl"] == "/engines/tone/voices/alto/preview"


def test_a_read_only_refusal_is_a_tool_error_without_structured_content() -> None:
    """
    An unknown engine is the route's unknown_engine, as a tool error whose text names
    the code, the message (with the engines there are) and that a retry will not help.
    """
    core = Core()
    result = core.call("list_voices", {"engine": "nope"})
    assert result["isError"] is True and "structuredContent" not in result
    [text] = result["content"]
    assert text["text"].startswith('unknown_engine: no engine "nope"')
    assert "tone" in text["text"] and text["text"].endswith("(retryable: false)")


# -- speaking -------------------------------------------------------------------------------


def audio_of(result: dict[str, Any]) -> tuple[dict[str, Any], str]:
    assert result["isError"] is False
    audio, line = result["content"]
    assert audio["type"] == "audio" and line["type"] == "text"
    return audio, line["text"]


def test_speak_answers_wav_audio_content_and_a_line_saying_what_it_is() -> None:
    """
    speak runs /speak buffered with format wav when none is given, and answers the
    worker's audio as base64 audio content of its Content-Type, then a line naming the
    engine, the voice, the type, the size and the worker's duration.
    """
    core = Core()
    audio, line = audio_of(core.call("speak", {"engine": "tone", "text": "Hello there.", "voice": "alto"}))
    data = base64.b64decode(audio["data"], validate=True)
    assert data == core.worker.audio and audio["mimeType"] == "audio/wav"
    with wave.open(io.BytesIO(data)) as reader:
        assert (reader.getframerate(), reader.getnframes()) == (24000, 12000)
    assert core.worker.bodies[-1]["format"] == "wav" and core.worker.bodies[-1]["stream"] is False
    assert line == f'Spoke with engine "tone", voice "alto": audio/wav, {len(data)} bytes, 500 ms.'


def test_speak_keeps_the_format_asked_for_and_its_type_verbatim() -> None:
    """
    A format given is the one asked of the worker, and pcm's type goes out as the route
    gave it, rate and channels included; a line without a duration says none.
    """
    core = Core()
    audio, line = audio_of(core.call("speak", {"engine": "tone", "text": "Hello there.", "format": "pcm"}))
    assert audio["mimeType"] == PCM_TYPE.decode() and core.worker.bodies[-1]["format"] == "pcm"
    assert base64.b64decode(audio["data"]) == core.worker.audio[44:]
    assert line == f"Spoke with engine \"tone\", the engine's default voice: {PCM_TYPE.decode()}, 24000 bytes."


@pytest.mark.parametrize(
    ("arguments", "start"),
    [
        ({"engine": "nope", "text": "hi"}, 'unknown_engine: no engine "nope"'),
        ({"engine": "tone", "text": "hi", "voice": "nobody"}, 'unknown_voice: no voice "nobody"'),
        ({"engine": "tone", "text": "hi", "format": "mp3"}, 'unsupported: format "mp3"'),
        ({"engine": "tone", "text": "x" * 4097}, "bad_request:"),
        ({"engine": "tone", "text": "hi", "stream": True}, "bad_request:"),
        ({"engine": "tone"}, "bad_request:"),
        ({"engine": "tone", "text": 5}, "bad_request:"),
    ],
)
def test_a_speech_refusal_is_a_tool_error_and_costs_no_speech(arguments: dict[str, Any], start: str) -> None:
    """
    What the route refuses (an unknown engine or voice, a format not produced, text
    over the ceiling or missing) and what the tool's schema refuses (stream, which the
    tool does not take) is a tool result with isError whose text starts with the code,
    and the worker is never asked to speak.
    """
    core = Core()
    result = core.call("speak", arguments)
    [text] = result["content"]
    assert result["isError"] is True and text["text"].startswith(start), text["text"]
    assert text["text"].endswith("(retryable: false)")
    assert (b"POST", "/speak") not in core.worker.calls


def test_a_workers_retryable_refusal_says_a_retry_can_help() -> None:
    """
    A refusal from the worker itself (here model_unavailable, 503) reaches the agent
    with its code, its message and retryable true.
    """
    core = Core()
    core.worker.refusal = (503, {"error": {"code": "model_unavailable", "message": "loading; try again", "retryable": True}})
    result = core.call("speak", {"engine": "tone", "text": "hi"})
    assert result["isError"] is True
    assert result["content"] == [{"type": "text", "text": "model_unavailable: loading; try again (retryable: true)"}]


def test_speak_dialogue_runs_the_dialogue_route_with_the_engine_from_its_arguments() -> None:
    """
    speak_dialogue takes the engine as an argument and sends the worker's /dialogue the
    rest, buffered and wav by default, and answers its audio as audio content.
    """
    core = Core()
    turns = [{"speaker": "A", "text": "Hello."}, {"speaker": "B", "text": "Hi there."}]
    result = core.call("speak_dialogue", {"engine": "tone", "variant": "classic", "turns": turns,
                                          "voices": {"A": "alto", "B": "bass"}})
    audio, line = audio_of(result)
    assert base64.b64decode(audio["data"]) == core.worker.audio and audio["mimeType"] == "audio/wav"
    assert (b"POST", "/dialogue") in core.worker.calls
    sent = core.worker.bodies[-1]
    assert "engine" not in sent and sent["stream"] is False and sent["format"] == "wav"
    assert sent["turns"] == turns and sent["voices"] == {"A": "alto", "B": "bass"}
    assert line.startswith('Spoke a dialogue of 2 turns with engine "tone", voices A=alto, B=bass: audio/wav')


def test_speak_dialogue_refused_by_a_variant_without_dialogue() -> None:
    """
    A dialogue on a variant that performs none is the route's unsupported, as a tool
    error.
    """
    core = Core()
    result = core.call("speak_dialogue", {"engine": "tone", "turns": [{"speaker": "A", "text": "Hello."}]})
    assert result["isError"] is True and result["content"][0]["text"].startswith("unsupported:")
    assert (b"POST", "/dialogue") not in core.worker.calls


def test_audio_is_encoded_while_still_counted_against_the_buffer_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """
    The buffered answer stays counted against the core's buffer budget while its audio
    is encoded, and so does the base64 it is encoded into, taken before it is made;
    both are given back once the tool has answered.
    """
    core = Core()
    held: list[int] = []
    encode = _mcp.base64_pieces

    def encoding(pieces: Any) -> list[bytes]:
        held.append(core.app.budget.held)
        return encode(pieces)

    monkeypatch.setattr(_mcp, "base64_pieces", encoding)
    audio_of(core.call("speak", {"engine": "tone", "text": "Hello there."}))
    size = len(core.worker.audio)
    assert len(held) == 1 and size + base64_size(size) < held[0] < size + base64_size(size) + 1024
    assert core.app.budget.held == 0


def test_an_unknown_tool_or_arguments_not_an_object_are_invalid_params() -> None:
    """
    A call to a tool that does not exist, or with arguments that are not an object, is
    a protocol error (-32602), not a tool result; the error names the tools there are.
    """
    core = Core()
    error = core.error("tools/call", {"name": "install_engine", "arguments": {}})
    assert error["code"] == -32602 and "install_engine" in error["message"] and "speak" in error["message"]
    assert core.error("tools/call", {"arguments": {}})["code"] == -32602
    assert core.error("tools/call", {"name": "speak", "arguments": ["tone", "hi"]})["code"] == -32602


def test_missing_arguments_are_an_empty_object() -> None:
    """
    A tool that takes nothing may be called without arguments; one that takes an engine
    is then refused as bad_request naming it.
    """
    core = Core()
    assert core.call("list_engines")["isError"] is False
    result = core.call("list_voices")
    assert result["isError"] is True and "engine" in result["content"][0]["text"]


def test_a_client_that_hangs_up_cancels_the_speech_rather_than_answering_it() -> None:
    """
    A tool call cancelled mid-speech (its client hung up) stays cancelled: it is not
    turned into a tool result, and the worker's request is cancelled with it.
    """
    core = Core()
    pending: list[Deferred[Any]] = []
    cancelled: list[str] = []

    def request(method: bytes, path: str, body: Any = None, headers: Any = None) -> "Deferred[Any]":
        core.worker.calls.append((method, path))
        waiting: Deferred[Any] = Deferred(lambda _: cancelled.append(path))
        pending.append(waiting)
        return waiting

    core.worker.request = request  # type: ignore[method-assign]
    message = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
               "params": {"name": "speak", "arguments": {"engine": "tone", "text": "Hello."}}}
    request = DummyRequest([b"mcp"])
    request.method = b"POST"
    request.content = io.BytesIO(json.dumps(message).encode())
    call = Deferred.fromCoroutine(core.app.mcp.post(request))
    assert len(pending) == 1 and not call.called
    call.cancel()
    core.case.failureResultOf(call, CancelledError)
    assert cancelled == ["/speak"]
    assert core.app.budget.held == 0


# -- at the head: the core's own site --------------------------------------------------------


def connect(core: Core) -> tuple[Any, StringTransport]:
    channel = core.app.site().buildProtocol(IPv4Address("TCP", "127.0.0.1", 8080))
    transport = StringTransport(peerAddress=IPv4Address("TCP", "127.0.0.1", 40000))
    channel.makeConnection(transport)
    return channel, transport


def head_and_body(transport: StringTransport) -> tuple[int, bytes, bytes]:
    head, _, body = transport.value().partition(b"\r\n\r\n")
    if b"Transfer-Encoding: chunked" in head:
        chunks = []
        while body:
            size, _, rest = body.partition(b"\r\n")
            length = int(size, 16)
            if not length:
                break
            chunks.append(rest[:length])
            body = rest[length + 2:]
        body = b"".join(chunks)
    return int(head.split(b" ")[1]), head, body


PING = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "ping"}).encode()


def post_through_site(core: Core, *headers: bytes, method: bytes = b"POST", body: bytes = PING) -> tuple[int, bytes, bytes]:
    channel, transport = connect(core)
    lines = [method + b" /mcp HTTP/1.1", b"Host: localhost", b"Content-Type: application/json",
             b"Content-Length: %d" % len(body), *headers]
    channel.dataReceived(b"\r\n".join(lines) + b"\r\n\r\n" + body)
    return head_and_body(transport)


@pytest.mark.parametrize(
    "origin",
    [None, b"http://localhost:8080", b"http://127.0.0.1:3000", b"https://studio.example"],
)
def test_the_site_admits_no_origin_this_machines_and_the_configured_ones(origin: bytes | None) -> None:
    """
    Through the core's own site, a POST with no Origin (an agent), this machine's own
    Origin or one in management.origins reaches the server and is answered.
    """
    core = Core(management_origins=["https://studio.example"])
    status, _, body = post_through_site(core, *([b"Origin: " + origin] if origin else []))
    assert status == 200 and json.loads(body) == {"jsonrpc": "2.0", "id": 1, "result": {}}


def test_answers_go_out_whole_with_their_length() -> None:
    """
    Through the core's own site an answer carries its Content-Length and is not
    chunked, speech included, and a notification's 202 says its length is 0.
    """
    core = Core()
    call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": "speak", "arguments": {"engine": "tone", "text": "Hello."}}}
    status, head, body = post_through_site(core, body=json.dumps(call).encode())
    assert status == 200 and b"chunked" not in head
    assert b"Content-Length: %d" % len(body) in head
    assert json.loads(body)["result"]["content"][0]["type"] == "audio"
    notification = json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}).encode()
    status, head, body = post_through_site(core, body=notification)
    assert (status, body) == (202, b"") and b"Content-Length: 0" in head


def test_the_site_refuses_an_origin_from_elsewhere_before_the_server_runs() -> None:
    """
    A POST carrying an Origin that is neither this machine's nor configured is refused
    at the head as forbidden (403, the error envelope); the server never sees it.
    """
    core = Core(management_origins=["https://studio.example"])
    seen: list[Any] = []
    core.app.mcp.post = lambda request: seen.append(request)  # type: ignore[method-assign]
    status, _, body = post_through_site(core, b"Origin: https://evil.example")
    assert status == 403 and json.loads(body)["error"]["code"] == "forbidden" and seen == []


def test_the_site_strips_authorization_before_the_server_runs() -> None:
    """
    A bearer token sent to /mcp is gone from the request before the server reads it,
    and the call is answered as any other.
    """
    core = Core()
    seen: list[Any] = []
    post = core.app.mcp.post

    async def spy(request: Any) -> bytes:
        seen.append(request.requestHeaders.getRawHeaders(b"authorization"))
        return await post(request)

    core.app.mcp.post = spy  # type: ignore[method-assign]
    status, _, _ = post_through_site(core, b"Authorization: Bearer sk-secret")
    assert status == 200 and seen == [None]


@pytest.mark.parametrize("method", [b"GET", b"DELETE"])
def test_get_and_delete_are_405_allowing_post(method: bytes) -> None:
    """
    GET /mcp and DELETE /mcp are refused with 405 and Allow: POST, which is how the
    transport says the server offers no stream and keeps no session.
    """
    status, head, body = post_through_site(Core(), method=method, body=b"")
    assert status == 405 and b"Allow: POST" in head
    assert json.loads(body)["error"]["code"] == "bad_request"


def test_the_route_is_not_in_the_openapi_document() -> None:
    """
    /mcp is not described in GET /openapi.json: tools/list describes its operations.
    """
    core = Core()
    response = core.case.successResultOf(core.stub.get("http://core/openapi.json"))
    document = json.loads(core.case.successResultOf(core.stub.content(response)))
    assert "/mcp" not in document["paths"] and "mcp" not in json.dumps(document["paths"]).lower()
