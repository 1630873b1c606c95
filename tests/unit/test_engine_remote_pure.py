"""
The remote engine's pure parts: its configuration (both forms, and every refusal naming
where), the server's refusals as the taxonomy's, and the readers of its answers (an SSE
of PCM deltas that must end with done; a PCM body that must not end short).

The adapter's package is not installed in the core's virtualenv (its Engine reads the
installed distribution's version), so these modules are loaded under an empty package,
as the Kokoro adapter's pure tests do; they import nothing but the SDK.
"""

from __future__ import annotations

import base64
import importlib.machinery
import importlib.util
import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from rhapsode_worker import BadRequest, Internal, ModelUnavailable, Overloaded, UnknownVoice

SRC = Path(__file__).resolve().parents[2] / "engines" / "remote" / "src" / "rhapsode_engine_remote"


def _load() -> tuple[Any, Any, Any]:
    name = "rhapsode_engine_remote"
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    package = importlib.util.module_from_spec(spec)
    package.__path__ = [str(SRC)]
    saved = sys.modules.get(name)
    sys.modules[name] = package
    try:
        loaded = []
        for module in ("_config", "_client", "_stream"):
            path = SRC / f"{module}.py"
            module_spec = importlib.util.spec_from_file_location(f"{name}.{module}", path)
            assert module_spec is not None and module_spec.loader is not None
            found = importlib.util.module_from_spec(module_spec)
            sys.modules[f"{name}.{module}"] = found
            module_spec.loader.exec_module(found)
            loaded.append(found)
        return loaded[0], loaded[1], loaded[2]
    finally:
        for module in ("_config", "_client", "_stream"):
            sys.modules.pop(f"{name}.{module}", None)
        if saved is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = saved


config, client, stream = _load()


def test_one_server_from_the_short_form() -> None:
    """
    RHAPSODE_REMOTE_URL makes one variant, "default" unless named, its key and model
    as given; /v1 on the URL is the API's, not the server's, and is dropped.
    """
    read = config.read_config({"RHAPSODE_REMOTE_URL": "http://gpu:8091/v1", "RHAPSODE_REMOTE_KEY": "sk-1"})
    server = read.variants["default"]
    assert read.default_variant == "default" and server.url == "http://gpu:8091" and server.key == "sk-1"
    assert server.origin == "http://gpu:8091" and "sk-1" not in repr(server)
    named = config.read_config({"RHAPSODE_REMOTE_URL": "https://x", "RHAPSODE_REMOTE_VARIANT": "qwen3",
                                "RHAPSODE_REMOTE_MODEL": "Qwen/Qwen3-TTS-12Hz-1.7B-Base"})
    assert named.variants["qwen3"].model == "Qwen/Qwen3-TTS-12Hz-1.7B-Base"


def test_several_servers_from_a_document_or_its_file(tmp_path: Path) -> None:
    """
    The document names each variant's server; a key comes from the environment by
    keyEnv; the default is the one named, else the first; a file path works as well.
    """
    document = {"defaultVariant": "base", "concurrency": 4, "variants": {
        "custom": {"url": "http://a:1", "instructions": "style", "headSeconds": 2},
        "base": {"url": "http://b:2", "keyEnv": "B_KEY", "consent": "c-9", "cloning": "upload"}}}
    environ = {"RHAPSODE_REMOTE_CONFIG": json.dumps(document), "B_KEY": "secret"}
    read = config.read_config(environ)
    assert (read.default_variant, read.concurrency) == ("base", 4)
    assert read.variants["base"].key == "secret" and read.variants["base"].consent == "c-9"
    assert read.variants["custom"].head_seconds == 2.0 and read.variants["custom"].instructions == "style"
    path = tmp_path / "remote.json"
    path.write_text(json.dumps({"variants": {"only": {"url": "http://c:3"}}}))
    assert config.read_config({"RHAPSODE_REMOTE_CONFIG": str(path)}).default_variant == "only"


@pytest.mark.parametrize(("environ", "names"), [
    ({}, "RHAPSODE_REMOTE_URL"),
    ({"RHAPSODE_REMOTE_URL": "http://a", "RHAPSODE_REMOTE_CONFIG": "{}"}, "exactly one"),
    ({"RHAPSODE_REMOTE_URL": "ftp://a"}, "RHAPSODE_REMOTE_URL"),
    ({"RHAPSODE_REMOTE_URL": "http://user:pw@a"}, "RHAPSODE_REMOTE_URL"),
    ({"RHAPSODE_REMOTE_CONFIG": '{"variants": {"v": {"url": "http://a", "colour": 1}}}'}, "variants.v.colour"),
    ({"RHAPSODE_REMOTE_CONFIG": '{"variants": {"v": {"url": "http://a", "keyEnv": "NOPE"}}}'}, "NOPE"),
    ({"RHAPSODE_REMOTE_CONFIG": '{"variants": {"v": {"url": "http://a", "instructions": "loud"}}}'},
     "variants.v.instructions"),
    ({"RHAPSODE_REMOTE_CONFIG": '{"variants": {"v": {"url": "http://a"}}, "defaultVariant": "w"}'}, "defaultVariant"),
    ({"RHAPSODE_REMOTE_CONFIG": '{"variants": {"v": {"url": "http://a", "license": {"weights": "MIT"}}}}'},
     "variants.v.license"),
    ({"RHAPSODE_REMOTE_CONFIG": '{"variants": {}}'}, "variants"),
    ({"RHAPSODE_REMOTE_CONFIG": "/no/such/file.json"}, "/no/such/file.json"),
    ({"RHAPSODE_REMOTE_CONFIG": '{"variants": ' + "[" * 1100 + "]" * 1100 + "}"}, "RHAPSODE_REMOTE_CONFIG: not JSON"),
])
def test_what_cannot_be_used_is_refused_naming_where(environ: dict[str, str], names: str) -> None:
    """
    Each unusable configuration fails the start with a message naming the variable or
    the key's path, never silently ignored.
    """
    with pytest.raises(config.RemoteConfigError) as refused:
        config.read_config(environ)
    assert names in str(refused.value)


@pytest.mark.parametrize(("status", "message", "voice", "kind", "field"), [
    (400, "Unsupported speaker 'bob'. Supported speakers: vivian", "bob", UnknownVoice, "voice"),
    (400, "Input text cannot be empty", None, BadRequest, "text"),
    (429, "too many requests", None, Overloaded, None),
    (401, "Invalid API key", None, Internal, None),
    (404, "The model `x` does not exist.", None, ModelUnavailable, None),
    (500, "boom", None, Internal, None),
    (503, "loading", None, ModelUnavailable, None),
])
def test_a_servers_refusals_are_the_taxonomys(status: int, message: str, voice: str | None, kind: type,
                                               field: str | None) -> None:
    """
    vLLM-Omni's 400 for an unknown speaker is unknown_voice; other 400s bad_request; a
    429 overloaded; a refused key internal (the operator's to fix, not retryable); a
    model it no longer serves and a 5xx other than 500 model_unavailable, retryable.
    """
    error = stream.refusal(client.ServerError(status, message, "input" if field == "text" else None),
                           "http://gpu:8091", voice)
    assert isinstance(error, kind) and (field is None or error.field == field)
    if kind is Internal and status == 401:
        assert "Invalid API key" not in error.message and "key" in error.message


class Answer(io.BytesIO):
    """An answer's body as http.client's response reads it."""

    def __init__(self, body: bytes, *, chunked: bool = True, length: int | None = None) -> None:
        super().__init__(body)
        self.chunked = chunked
        self.length = length

    def read1(self, size: int = -1) -> bytes:
        data = super().read1(size)
        if self.length is not None:
            self.length -= len(data)
        return data

    def isclosed(self) -> bool:
        return self.tell() == len(self.getvalue())


def sse(*events: dict[str, Any]) -> bytes:
    return b"".join(b"event: " + e["type"].encode() + b"\ndata: " + json.dumps(e).encode() + b"\n\n" for e in events)


def delta(pcm: bytes) -> dict[str, Any]:
    return {"type": "speech.audio.delta", "audio": base64.b64encode(pcm).decode(), "response_format": "pcm"}


def test_an_sse_answer_is_its_deltas_until_done() -> None:
    """
    The deltas' PCM, in order, and nothing after speech.audio.done.
    """
    body = sse(delta(b"\x01\x00" * 10), delta(b"\x02\x00" * 5), {"type": "speech.audio.done", "usage": {}})
    assert list(stream.sse_pcm(Answer(body), "x")) == [b"\x01\x00" * 10, b"\x02\x00" * 5]


@pytest.mark.parametrize("tail", [
    b"",  # the stream ends without done
    sse({"type": "speech.audio.error", "error": {"message": "CUDA error"}}),
    b"data: {not json}\n\n",
    b'data: {"type": "speech.audio.delta", "audio": "***"}\n\n',
])
def test_an_sse_answer_that_does_not_end_with_done_fails(tail: bytes) -> None:
    """
    An end without done, an error event, or an event that cannot be read fails the
    stream after what came before it, so the worker aborts instead of ending clean.
    """
    got: list[bytes] = []
    with pytest.raises(ModelUnavailable):
        for pcm in stream.sse_pcm(Answer(sse(delta(b"\x01\x00")) + tail), "x"):
            got.append(pcm)
    assert got == [b"\x01\x00"]


def test_a_pcm_body_short_of_its_length_fails() -> None:
    """
    A Content-Length body read to its length ends; one that ends before it fails.
    """
    assert b"".join(stream.raw_pcm(Answer(b"\x00" * 100, chunked=False, length=100), "x")) == b"\x00" * 100
    with pytest.raises(ModelUnavailable):
        list(stream.raw_pcm(Answer(b"\x00" * 100, chunked=False, length=200), "x"))


DEEP = b"[" * 5000 + b"]" * 5000


def test_a_servers_json_nested_too_deep_to_parse_is_its_fault_not_a_crash() -> None:
    """
    A server's answer nested deeper than Python's parser can recurse (a 10 KB body) is
    read as what it is, a body that is not the API's: its refusal's message is its
    opening bytes, a 2xx document is NotJSON (502), and an SSE event fails the stream
    as model_unavailable, where each was a RecursionError out of the adapter.
    """
    message, param = client._message(DEEP)
    assert message.startswith("[[[") and param is None
    with pytest.raises(client.NotJSON) as refused:
        client._document(DEEP, "http://gpu:8091/v1/models answered 200")
    assert refused.value.status == 502 and "/v1/models" in refused.value.message
    with pytest.raises(ModelUnavailable):
        list(stream.sse_pcm(Answer(sse(delta(b"\x01\x00")) + b"data: " + DEEP + b"\n\n"), "x"))
