"""
The remote engine's pure parts: its configuration (both forms, and every refusal naming
where), the server's refusals as the taxonomy's, and a server's JSON nested too deep.
The readers of its answers are test_remote_relay's.  The adapter's modules are loaded
from the tree (tests/_remote_adapter.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _remote_adapter import delta, load

from rhapsode_worker import BadRequest, Internal, ModelUnavailable, Overloaded, UnknownVoice

config, client, stream = load("_config", "_client", "_stream")


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
    events = stream.Events("x")
    with pytest.raises(ModelUnavailable):
        list(events.feed(delta(b"\x01\x00") + b"data: " + DEEP + b"\n\n"))
