"""
MCP at C{POST /mcp} (protocol.md section 12): the public routes as five tools, over
stateless Streamable HTTP.

Each POST carries one JSON-RPC message and gets one JSON answer, or 202 and no body for
a notification or a client's response; no session is kept and no C{Mcp-Session-Id} is
sent.  A tool builds the request of the route it stands for and runs it through that
route's own handler in process (L{rhapsode._speech.inprocess}), so the validation, the
ceiling, the residency lease and the error taxonomy are the route's.  A route's refusal
is a tool result with C{isError}; a message that is not JSON-RPC, an unknown method and
an unknown tool are JSON-RPC errors.

The tools' input schemas are the request contract's and the read-only tools' output
schemas the response contract's (L{rhapsode_protocol.contract}), with every C{$ref}
inlined, because a tool's schema must stand alone.  What happens at the head (the
Origin rule, Authorization stripped, 405 for GET and DELETE, the body limit) is the
site's (L{rhapsode._http.site}).

The dicts are written by hand: the SDK's server is ASGI, and its types would bring
pydantic into the core and into every engine's virtualenv.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping

from twisted.internet.defer import CancelledError
from twisted.logger import Logger
from twisted.web.iweb import IRequest

from rhapsode_protocol import contract
from rhapsode_protocol.errors import SpeechError, as_speech_error, refusal
from rhapsode_protocol.validation import TooDeep, check_json_depth

from .._http.sinks import when_delivered, write_pieces
from .._interfaces import IPublicRoutes, ISpeech, Utterance
from .._speech.inprocess import Answer, MemorySink, base64_pieces, base64_size
from .._speech.limits import BufferBudget, Hold

__all__ = ["McpServer", "PROTOCOL_VERSIONS", "tool_definitions"]

#: The handshake revisions answered in kind; any other is answered with the last.
PROTOCOL_VERSIONS = ("2025-03-26", "2025-06-18", "2025-11-25")
LATEST_VERSION = PROTOCOL_VERSIONS[-1]

# JSON-RPC 2.0's error codes.
PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602

_DURATION = b"X-Rhapsode-Duration-Ms"
_REF_PREFIX = "#/components/schemas/"
_JSON = b"application/json"

Schema = dict[str, Any]
Result = dict[str, Any]


@dataclass(frozen=True)
class RawJson:
    """
    A result already written as JSON, in pieces: the audio's base64 is spliced in as
    bytes rather than escaped again by the encoder (which, for a sentence of audio, costs
    more than all the rest of the call) and never joined into one string, and the tool
    listing is written once.  C{hold} is what the pieces hold of the core's buffer
    budget, given back once the answer has left the process.
    """

    pieces: tuple[bytes, ...]
    hold: Hold | None = None


@dataclass(frozen=True)
class ToolRefusal:
    """
    A tool that ran and was refused, and the headers its refusal carries (an overloaded
    core's C{Retry-After}) for the HTTP answer.
    """

    result: Result
    headers: tuple[tuple[bytes, bytes], ...] = ()


Answered = Result | RawJson | ToolRefusal


class _Malformed(Exception):
    """
    A body that is not one JSON-RPC message: HTTP 400, answered with a null id.
    """

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class _RpcError(Exception):
    """
    A request that is JSON-RPC but cannot be answered: a JSON-RPC error under its id.
    """

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# -- the tools' schemas, from the contract --------------------------------------------------


def inline(schema: Any, components: Mapping[str, Any], within: tuple[str, ...] = ()) -> Any:
    """
    A copy of C{schema} with every C{#/components/schemas/...} reference replaced by the
    component it names (keywords beside a C{$ref} kept over the component's).

    @raise ValueError: a reference that does not resolve, or one that reaches itself
        (which no inlining can write out).
    """
    if isinstance(schema, list):
        return [inline(item, components, within) for item in schema]
    if not isinstance(schema, dict):
        return schema
    ref = schema.get("$ref")
    if ref is None:
        return {key: inline(value, components, within) for key, value in schema.items()}
    name = ref[len(_REF_PREFIX):] if isinstance(ref, str) and ref.startswith(_REF_PREFIX) else None
    if name is None or name not in components:
        raise ValueError(f"unresolvable $ref {ref!r}")
    if name in within:
        raise ValueError(f"$ref {ref!r} refers to itself")
    target = inline(components[name], components, (*within, name))
    beside = {key: inline(value, components, within) for key, value in schema.items() if key != "$ref"}
    return {**target, **beside}


@dataclass(frozen=True)
class ToolSpec:
    """
    One tool as C{tools/list} shows it: what it takes, and for a read-only tool what
    its structured result is.
    """

    name: str
    title: str
    description: str
    input_schema: Schema
    output_schema: Schema | None = None

    def listing(self) -> dict[str, Any]:
        tool: dict[str, Any] = {
            "name": self.name,
            "title": self.title,
            "description": self.description,
            "inputSchema": self.input_schema,
        }
        if self.output_schema is not None:
            tool["outputSchema"] = self.output_schema
            tool["annotations"] = {"readOnlyHint": True, "openWorldHint": False}
        else:
            # Speaking loads a model and changes nothing a caller owns.
            tool["annotations"] = {"readOnlyHint": False, "destructiveHint": False, "openWorldHint": False}
        return tool


def _object(properties: dict[str, Any], required: list[str]) -> Schema:
    schema: Schema = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        schema["required"] = required
    return schema


def _items(schema: Schema) -> Schema:
    # MCP's structured content is an object, so a route's list goes out under "items".
    return {"type": "object", "properties": {"items": schema}, "required": ["items"]}


def _speech_input(request: Schema, engine: Schema | None) -> Schema:
    """
    A speech route's request shape as a tool takes it: without C{stream} (a tool
    result is one message, so the route runs buffered) and with C{format} defaulting to
    wav; with C{engine}, that field added and required (the dialogue route takes it in
    its path).  The engine comes first either way, as an agent picks it first.
    """
    properties = {key: value for key, value in request["properties"].items() if key != "stream"}
    if "engine" in properties:
        properties = {"engine": properties.pop("engine"), **properties}
    properties["format"] = dict(
        properties["format"],
        default="wav",
        description="wav when absent (not what /speak would choose: wav needs no encoder on "
        "the worker's box); mp3, opus, flac or pcm where the engine produces them.",
    )
    required = [key for key in request.get("required", ()) if key != "stream"]
    if engine is not None:
        properties = {"engine": engine, **properties}
        required = ["engine", *required]
    schema = dict(request, properties=properties)
    schema["required"] = required
    return schema


@functools.cache
def tool_definitions() -> tuple[ToolSpec, ...]:
    """
    The five tools of section 12, their schemas from the contract with every reference
    inlined; built once, since the contract does not change while the process runs.
    """
    components = contract.public_openapi("0")["components"]["schemas"]
    engine = inline(contract.PUBLIC_SPEAK_REQUEST["properties"]["engine"], components)
    by_engine = _object({"engine": engine}, ["engine"])
    return (
        ToolSpec(
            "list_engines",
            "List engines",
            "The engines this server speaks with (GET /engines): each one's id, licences, "
            "default variant, and what its process and model are doing now. Reading it "
            "starts nothing.",
            _object({}, []),
            _items(inline(contract.ENGINE_LIST, components)),
        ),
        ToolSpec(
            "engine_capabilities",
            "Engine capabilities",
            "One engine's capability document (GET /engines/{engine}/capabilities): its "
            "variants with their cues, deliveries, dials, languages and maxCharacters, the "
            "formats it produces, and its licences. May start the engine's worker process, "
            "never a model.",
            by_engine,
            inline(contract.CAPABILITIES, components),
        ),
        ToolSpec(
            "list_voices",
            "List voices",
            "The voices of one engine (GET /engines/{engine}/voices). A voice id is scoped "
            "to its engine: pass it as speak's voice with that engine.",
            by_engine,
            _items(inline(contract.VOICE_LIST, components)),
        ),
        ToolSpec(
            "speak",
            "Speak",
            "Say text with an engine (POST /speak, buffered) and answer the audio, wav "
            "unless format says otherwise. Cues are written in brackets, e.g. [laugh]; "
            "those the variant does not perform are dropped. With timestamps (word or "
            "phoneme, where engine_capabilities lists them) the result also holds the "
            "alignment, as structuredContent and as JSON text: each entry's unit, text, start "
            "and end in seconds. A refusal (unknown voice, text over maxCharacters, an "
            "unsupported format) is a tool error naming its code and whether a retry can help.",
            inline(_speech_input(contract.PUBLIC_SPEAK_REQUEST, None), components),
        ),
        ToolSpec(
            "speak_dialogue",
            "Speak a dialogue",
            "Perform a conversation of turns by speakers with one engine (POST "
            "/engines/{engine}/dialogue, buffered), for variants that perform dialogue "
            "(see engine_capabilities). voices maps a speaker to a voice id; an unvoiced "
            "speaker gets a voice the model picks. Answers the audio, wav unless format "
            "says otherwise; with timestamps, the alignment too, each entry naming its turn "
            "and speaker.",
            inline(_speech_input(contract.PUBLIC_DIALOGUE_REQUEST, engine), components),
        ),
    )


# -- results --------------------------------------------------------------------------------


def refusal_text(code: str, message: str, retryable: bool) -> str:
    return f"{code}: {message} (retryable: {'true' if retryable else 'false'})"


def refused(error: SpeechError) -> Result:
    """
    A tool that ran and was refused: the envelope's code, message and retryable, as
    the text an agent reads.
    """
    envelope = error.envelope()["error"]
    text = refusal_text(envelope["code"], envelope["message"], error.retryable)
    return {"content": [{"type": "text", "text": text}], "isError": True}


def _structured(code: int, document: Any, wrap: bool) -> Result:
    """
    A read-only route's answer as structured content, and the same JSON as text; a
    worker's refusal as the tool's.
    """
    if code != 200:
        return refused(refusal(document.get("error") if isinstance(document, dict) else None, code))
    if wrap:
        structured = {"items": document}
        text = json.dumps(structured)
    else:
        structured = document
        text = json.dumps(document)
    return {"content": [{"type": "text", "text": text}], "structuredContent": structured, "isError": False}


def _audio(answer: Answer, said: str, hold: Hold) -> RawJson:
    """
    A speech route's buffered answer as audio content (its Content-Type verbatim) and a
    line saying what it is; its base64 taken from C{hold} before it is encoded.

    @raise BufferFull: the budget has no room for the base64.
    """
    mime = answer.content_type or "application/octet-stream"
    size = answer.size
    line = f"Spoke {said}: {mime}, {size} bytes"
    duration = answer.header(_DURATION)
    if duration is not None and duration.isdigit():
        line += f", {duration} ms"
    timed = structured = b""
    if answer.alignment is not None:
        # Beside the audio (protocol.md section 4): as structured content, and as the
        # same JSON in text for a client that reads only content.
        line += f", {len(answer.alignment)} timings"
        alignment = _dumps({"alignment": answer.alignment})
        timed = b"".join((b',{"type":"text","text":', _dumps(alignment.decode("utf-8")), b"}"))
        structured = b',"structuredContent":' + alignment
    opening = b'{"content":[{"type":"audio","data":"'
    closing = b"".join((
        b'","mimeType":',
        _dumps(mime),
        b'},{"type":"text","text":',
        _dumps(line + "."),
        b"}",
        timed,
        b"]",
        structured,
        b',"isError":false}',
    ))
    hold.take(len(opening) + base64_size(size) + len(closing))
    # Base64's alphabet needs no escaping in a JSON string.
    return RawJson((opening, *base64_pieces(answer.pieces), closing), hold)


def _voice_named(arguments: Mapping[str, Any]) -> str:
    voice = arguments.get("voice")
    return f'voice "{voice}"' if isinstance(voice, str) else "the engine's default voice"


def _voices_named(arguments: Mapping[str, Any]) -> str:
    voices = arguments.get("voices") or {}
    if not voices:
        return "voices the model picks"
    return "voices " + ", ".join(f"{speaker}={voice}" for speaker, voice in voices.items())


# -- the server -----------------------------------------------------------------------------


Tool = Callable[[dict[str, Any]], Awaitable[Answered]]


class McpServer:
    """
    The MCP endpoint over the public routes' reads and the speech service.
    """

    log = Logger()

    def __init__(self, *, routes: IPublicRoutes, speech: ISpeech, version: str, budget: BufferBudget) -> None:
        self.routes = routes
        self.speech = speech
        self.version = version
        self.budget = budget
        self.specs = {spec.name: spec for spec in tool_definitions()}
        self._listing = RawJson((_dumps({"tools": [spec.listing() for spec in self.specs.values()]}),))
        self._tools: dict[str, Tool] = {
            "list_engines": self._list_engines,
            "engine_capabilities": self._engine_capabilities,
            "list_voices": self._list_voices,
            "speak": self._speak,
            "speak_dialogue": self._speak_dialogue,
        }
        self._methods: dict[str, Callable[[Any], Awaitable[Answered]]] = {
            "initialize": self._initialize,
            "ping": self._ping,
            "tools/list": self._tools_list,
            "tools/call": self._tools_call,
        }

    def handlers(self) -> dict[str, Callable[..., Any]]:
        """
        The handler of the table's MCP route, by name.
        """
        # Looked up per request, so a test may watch post by replacing it.
        return {"mcp": lambda request: self.post(request)}

    async def post(self, request: IRequest) -> bytes:
        """
        Answer one JSON-RPC message.
        """
        request.content.seek(0)
        raw = request.content.read()  # the site held it to the route's limit
        try:
            request_id, method, params = _read(raw)
        except _Malformed as malformed:
            request.setResponseCode(400)
            return _error(request, None, malformed.code, malformed.message)
        if method is None:
            # A notification, or a client's answer to a request of ours (we send none):
            # nothing is owed.
            request.setResponseCode(202)
            request.setHeader(b"Content-Length", b"0")
            return b""
        handler = self._methods.get(method)
        try:
            if handler is None:
                raise _RpcError(METHOD_NOT_FOUND, f'method "{method[:64]}" is not served here')
            if not isinstance(params, dict):
                raise _RpcError(INVALID_PARAMS, "params must be an object")
            result = await handler(params)
        except _RpcError as error:
            return _error(request, request_id, error.code, error.message)
        if isinstance(result, RawJson):
            head = b'{"jsonrpc":"2.0","id":' + _dumps(request_id) + b',"result":'
            pieces = (head, *result.pieces, b"}")
            hold = result.hold
            if hold is not None:
                hold.take(len(head) + 1)
                # Given back once the answer has left the process, or its client has gone.
                when_delivered(request).addBoth(lambda _: hold.release())
            return await _write(request, pieces)
        if isinstance(result, ToolRefusal):
            for name, value in result.headers:
                request.setHeader(name, value)
            result = result.result
        if result.get("isError"):
            _reason(request, result["content"][0]["text"])
        return _sized(request, _dumps({"jsonrpc": "2.0", "id": request_id, "result": result}))

    # -- methods -------------------------------------------------------------------------

    async def _initialize(self, params: dict[str, Any]) -> Result:
        asked = params.get("protocolVersion")
        return {
            "protocolVersion": asked if asked in PROTOCOL_VERSIONS else LATEST_VERSION,
            "capabilities": {"tools": {"listChanged": False}},
            "serverInfo": {"name": "rhapsode", "title": "Rhapsode", "version": self.version},
            "instructions": "Text to speech. list_engines, then list_voices for an engine, then "
            "speak with that engine and one of its voices; audio comes back as wav unless "
            "format says otherwise.",
        }

    async def _ping(self, params: dict[str, Any]) -> Result:
        return {}

    async def _tools_list(self, params: dict[str, Any]) -> Answered:
        return self._listing

    async def _tools_call(self, params: dict[str, Any]) -> Answered:
        name = params.get("name")
        if not isinstance(name, str) or name not in self._tools:
            shown = json.dumps(name)[:80]
            raise _RpcError(INVALID_PARAMS, f"no tool {shown}; tools: {', '.join(self._tools)}")
        arguments = params.get("arguments")
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            raise _RpcError(INVALID_PARAMS, "arguments must be an object")
        try:
            # Held to the tool's own schema first: it is the route's without stream, so a
            # stream argument is refused rather than quietly overridden.
            contract.validate(self.specs[name].input_schema, arguments)
            return await self._tools[name](arguments)
        except SpeechError as error:
            return ToolRefusal(refused(error), tuple(error.headers))
        except CancelledError:
            raise  # the client hung up: nobody is waiting for a result
        except Exception as exc:
            failed = as_speech_error(exc)
            if failed.code == "internal":
                self.log.failure("MCP tool {tool} failed", tool=name)
            return ToolRefusal(refused(failed), tuple(failed.headers))

    # -- tools ---------------------------------------------------------------------------

    async def _list_engines(self, arguments: dict[str, Any]) -> Result:
        return _structured(200, self.routes.engines(), wrap=True)

    async def _engine_capabilities(self, arguments: dict[str, Any]) -> Result:
        code, document = await self.routes.capabilities(arguments["engine"])
        return _structured(code, document, wrap=False)

    async def _list_voices(self, arguments: dict[str, Any]) -> Result:
        code, voices = await self.routes.voices(arguments["engine"])
        return _structured(code, voices, wrap=True)

    async def _spoken(self, utterance: Utterance, schema: dict[str, Any], said: str) -> Answered:
        """
        Speak C{utterance} into memory, its body held to the route's own schema first,
        and encode the audio while it is still counted against the buffer budget; its
        base64 stays counted until the answer has left the process.
        """
        contract.validate(schema, dict(utterance.body))
        sink = MemorySink()
        hold = self.budget.hold()
        try:
            await self.speech.speak(sink, utterance)
            return _audio(sink.answer, said, hold)
        except BaseException:
            hold.release()
            raise
        finally:
            sink.release()

    async def _speak(self, arguments: dict[str, Any]) -> Answered:
        body = {"format": "wav", **arguments, "stream": False}
        said = f'with engine "{arguments["engine"]}", {_voice_named(arguments)}'
        return await self._spoken(Utterance(body["engine"], body, route="mcp"), contract.PUBLIC_SPEAK_REQUEST, said)

    async def _speak_dialogue(self, arguments: dict[str, Any]) -> Answered:
        engine = arguments["engine"]
        body = {"format": "wav", **{k: v for k, v in arguments.items() if k != "engine"}, "stream": False}
        turns = len(arguments["turns"])
        said = f'a dialogue of {turns} turn{"" if turns == 1 else "s"} with engine "{engine}", '
        said += _voices_named(arguments)
        utterance = Utterance(engine, body, dialogue=True, route="mcp")
        return await self._spoken(utterance, contract.PUBLIC_DIALOGUE_REQUEST, said)


# -- the wire -------------------------------------------------------------------------------


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _read(raw: bytes) -> tuple[str | int | None, str | None, Any]:
    """
    The message in a POST body: its id, its method and its params for a request; no
    method for a notification or a response.  Params are as sent (an object where the
    message is MCP's; anything else is the method's to refuse, under the id).

    @raise _Malformed: not JSON, a batch, or not a JSON-RPC 2.0 message.
    """
    try:
        check_json_depth(raw)
    except TooDeep as error:
        raise _Malformed(PARSE_ERROR, f"the {error.message}") from None
    try:
        message = json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError) as error:
        raise _Malformed(PARSE_ERROR, f"the body is not JSON: {error}") from None
    if isinstance(message, list):
        raise _Malformed(INVALID_REQUEST, "one JSON-RPC message per POST: batches are not taken")
    if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
        raise _Malformed(INVALID_REQUEST, 'not a JSON-RPC 2.0 message (an object with "jsonrpc": "2.0")')
    if "method" not in message:
        if "id" in message and ("result" in message or "error" in message):
            return None, None, {}
        raise _Malformed(INVALID_REQUEST, "neither a request, a notification nor a response")
    method = message["method"]
    if not isinstance(method, str):
        raise _Malformed(INVALID_REQUEST, "method must be a string")
    if "id" not in message:
        return None, None, {}
    request_id = message["id"]
    if not _is_id(request_id):
        raise _Malformed(INVALID_REQUEST, "id must be a string or an integer")
    params = message.get("params")
    return request_id, method, {} if params is None else params


def _is_id(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode("utf-8")


def _error(request: IRequest, request_id: str | int | None, code: int, message: str) -> bytes:
    _reason(request, f"JSON-RPC {code}: {message}")
    error = {"code": code, "message": message}
    return _sized(request, _dumps({"jsonrpc": "2.0", "id": request_id, "error": error}))


def _sized(request: IRequest, body: bytes) -> bytes:
    # With its length known the answer goes out in one piece rather than chunked.
    request.setHeader(b"Content-Type", _JSON)
    request.setHeader(b"Content-Length", b"%d" % len(body))
    return body


async def _write(request: IRequest, pieces: tuple[bytes, ...]) -> bytes:
    """
    An answer of many pieces with its whole length, written a piece at a time as the
    client takes them (L{write_pieces}): the last is returned, for the route to write as
    it writes any answer.
    """
    request.setHeader(b"Content-Type", _JSON)
    request.setHeader(b"Content-Length", b"%d" % sum(map(len, pieces)))
    await write_pieces(request, pieces[:-1])
    return pieces[-1]


def _reason(request: IRequest, reason: str) -> None:
    try:
        request.error_reason = reason  # type: ignore[attr-defined]
    except AttributeError:
        pass  # a request that keeps no attributes of ours
