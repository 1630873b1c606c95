"""
MCP at /mcp on a real core with a real tone worker, driven by the official MCP client
(the mcp distribution's Client over Streamable HTTP): the handshake (after the current
client's server/discover probe), the five tools, speech that decodes as WAV, refusals
as tool errors, and the head's answers to GET, DELETE and a foreign Origin.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import urllib.error
import urllib.request
import wave
from typing import Any, Awaitable, Callable, Iterator, TypeVar

import mcp_types
import pytest
from mcp import Client
from mcp.shared.exceptions import MCPError

from _worker import get, serving_core

T = TypeVar("T")

TONE = {"tone": {"module": "rhapsode_engine_tone"}}
STUDIO = "https://studio.example"


@pytest.fixture(scope="module")
def port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """
    One core, with one tone engine and one configured management origin, for the module.
    """
    with serving_core(tmp_path_factory.mktemp("mcp"), TONE, management={"origins": [STUDIO]}) as (_, listening):
        yield listening


def with_client(port: int, use: Callable[[Client], Awaitable[T]], mode: str = "auto") -> T:
    """
    Connect the official client to the core's /mcp on an asyncio loop of its own, run
    C{use} with it, and return what it returned.
    """

    async def session() -> T:
        async with Client(f"http://127.0.0.1:{port}/mcp", mode=mode, read_timeout_seconds=60) as client:
            return await use(client)

    return asyncio.run(asyncio.wait_for(session(), 120))


def post(port: int, body: bytes, method: str = "POST", **headers: str) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/mcp", data=body or None, method=method,
        headers={"Content-Type": "application/json", **{k.replace("_", "-"): v for k, v in headers.items()}},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def text_of(result: mcp_types.CallToolResult) -> str:
    texts = [item.text for item in result.content if isinstance(item, mcp_types.TextContent)]
    assert texts, result
    return texts[-1]


@pytest.mark.parametrize("mode", ["auto", "legacy"])
def test_the_client_connects_and_lists_the_five_tools(port: int, mode: str) -> None:
    """
    The current client, probing server/discover first (auto) or not (legacy), settles
    on the 2025-11-25 handshake, sees the server's name, and lists the five tools, the
    read-only ones annotated so and carrying output schemas.
    """

    async def use(client: Client) -> tuple[str, Any, mcp_types.ListToolsResult]:
        return client.protocol_version, client.server_info, await client.list_tools()

    version, info, listed = with_client(port, use, mode)
    assert version == "2025-11-25" and info is not None and info.name == "rhapsode"
    tools = {tool.name: tool for tool in listed.tools}
    assert sorted(tools) == ["engine_capabilities", "list_engines", "list_voices", "speak", "speak_dialogue"]
    for name in ("list_engines", "engine_capabilities", "list_voices"):
        annotations = tools[name].annotations
        assert annotations is not None and annotations.read_only_hint is True and tools[name].output_schema
    assert "stream" not in tools["speak"].input_schema["properties"]


def test_the_read_only_tools_answer_what_their_routes_do(port: int) -> None:
    """
    list_engines, engine_capabilities and list_voices answer the routes' own JSON as
    structured content, which the client checks against each tool's output schema.
    """

    async def use(client: Client) -> list[mcp_types.CallToolResult]:
        return [
            await client.call_tool("list_engines", {}),
            await client.call_tool("engine_capabilities", {"engine": "tone"}),
            await client.call_tool("list_voices", {"engine": "tone"}),
        ]

    engines, capabilities, voices = with_client(port, use)
    for result in (engines, capabilities, voices):
        assert result.is_error is False and isinstance(result.structured_content, dict)
        assert json.loads(text_of(result)) == result.structured_content
    assert [engine["id"] for engine in engines.structured_content["items"]] == ["tone"]  # type: ignore[index]
    assert capabilities.structured_content == get(port, "/engines/tone/capabilities")
    assert voices.structured_content == {"items": get(port, "/engines/tone/voices")}
    assert "alto" in {voice["id"] for voice in voices.structured_content["items"]}  # type: ignore[index]


def test_speak_returns_wav_audio_that_decodes(port: int) -> None:
    """
    speak with no format answers audio content typed audio/wav whose base64 decodes to
    a RIFF/WAVE of a sane length for one sentence, and a line naming the engine, the
    voice and the size.
    """

    async def use(client: Client) -> mcp_types.CallToolResult:
        return await client.call_tool("speak", {"engine": "tone", "text": "Hello from the tool.", "voice": "alto"})

    result = with_client(port, use)
    assert result.is_error is False
    audio = [item for item in result.content if isinstance(item, mcp_types.AudioContent)]
    assert len(audio) == 1 and audio[0].mime_type == "audio/wav"
    data = base64.b64decode(audio[0].data, validate=True)
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE"
    with wave.open(io.BytesIO(data)) as reader:
        seconds = reader.getnframes() / reader.getframerate()
    assert 0.3 < seconds < 30, seconds
    line = text_of(result)
    assert '"tone"' in line and '"alto"' in line and f"{len(data)} bytes" in line


def test_speak_dialogue_returns_audio(port: int) -> None:
    """
    speak_dialogue on the variant that performs dialogue answers a WAV of both turns.
    """

    async def use(client: Client) -> mcp_types.CallToolResult:
        return await client.call_tool("speak_dialogue", {
            "engine": "tone", "variant": "classic",
            "turns": [{"speaker": "A", "text": "Good morning."}, {"speaker": "B", "text": "Morning to you."}],
            "voices": {"A": "alto", "B": "bass"},
        })

    result = with_client(port, use)
    assert result.is_error is False
    [audio] = [item for item in result.content if isinstance(item, mcp_types.AudioContent)]
    with wave.open(io.BytesIO(base64.b64decode(audio.data))) as reader:
        assert reader.getnframes() > 0 and audio.mime_type == "audio/wav"


def test_a_refusal_is_a_tool_error_naming_its_code(port: int) -> None:
    """
    An unknown voice and an unknown engine are tool results with isError whose text
    carries the taxonomy's code, the message and that a retry will not help.
    """

    async def use(client: Client) -> list[mcp_types.CallToolResult]:
        return [
            await client.call_tool("speak", {"engine": "tone", "text": "Hello.", "voice": "nobody"}),
            await client.call_tool("list_voices", {"engine": "nope"}),
        ]

    voice, engine = with_client(port, use)
    assert voice.is_error is True and text_of(voice).startswith('unknown_voice: no voice "nobody"')
    assert engine.is_error is True and text_of(engine).startswith('unknown_engine: no engine "nope"')
    assert text_of(voice).endswith("(retryable: false)") and text_of(engine).endswith("(retryable: false)")


def test_an_unknown_tool_is_a_protocol_error(port: int) -> None:
    """
    A call to a tool that does not exist reaches the client as a JSON-RPC error
    (invalid params), not as a tool result.
    """

    async def use(client: Client) -> int:
        with pytest.raises(MCPError) as caught:
            await client.call_tool("install_engine", {"engine": "kokoro"})
        return caught.value.code

    assert with_client(port, use, "legacy") == -32602


@pytest.mark.parametrize("method", ["GET", "DELETE"])
def test_get_and_delete_are_405(port: int, method: str) -> None:
    """
    GET /mcp and DELETE /mcp answer 405 with Allow: POST: no stream is offered and no
    session is kept.
    """
    status, headers, _ = post(port, b"", method=method, Accept="text/event-stream")
    assert status == 405 and headers.get("Allow") == "POST"


def test_the_origin_rule_at_the_head(port: int) -> None:
    """
    A POST carrying an Origin from elsewhere is refused 403 as forbidden; this
    machine's own Origin, a configured one and none at all are answered.
    """
    ping = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "ping"}).encode()
    status, _, body = post(port, ping, Origin="https://evil.example")
    assert status == 403 and json.loads(body)["error"]["code"] == "forbidden"
    for origin in (f"http://localhost:{port}", STUDIO, None):
        status, headers, body = post(port, ping, **({"Origin": origin} if origin else {}))
        assert status == 200 and json.loads(body) == {"jsonrpc": "2.0", "id": 1, "result": {}}
        assert "Mcp-Session-Id" not in headers


def test_mcp_is_not_in_the_openapi_document(port: int) -> None:
    """
    GET /openapi.json does not describe /mcp: tools/list is where its operations are.
    """
    assert "/mcp" not in json.dumps(get(port, "/openapi.json"))
