"""
The core's budget for buffered answers (limits.bufferedBytes, issue 23 section 1) against
a real `rhapsode serve` and tone, with clients on real sockets that read nothing: an answer
stays counted until it has left the core, not only until it was handed to the transport,
for /speak and a dialogue with stream false, the batch (its base64 and JSON included) and
MCP's speak;
past the budget a request is overloaded (429, retryable, Retry-After) and every answer
that was admitted arrives whole.  The OpenAI shim streams, and so holds none of it.

The core's peak memory under the issue's two scenarios is bench/buffer_memory.py's to
measure; these tests check who is refused and that nothing admitted is cut.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any, Iterator

import pytest

from _worker import get, serving_core

#: Tone says 4,096 characters in about 14.5 MB of wav and 2,048 in about 7.2 MB.
LONG = ("The quick brown fox jumps over the lazy dog while the band plays on. " * 80)[:4096]
HALF = LONG[:2048]
#: Two long answers fit (29 MB); a third does not, nor a long one beside a batch's JSON.
BUDGET = 30 * 1024 * 1024


@pytest.fixture(scope="module")
def port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    tmp = tmp_path_factory.mktemp("budget")
    with serving_core(tmp, {"tone": {"module": "rhapsode_engine_tone"}}, limits={"bufferedBytes": BUDGET}) as (_, port):
        yield port


class Client:
    """
    One request on a connection of its own whose reader takes only the answer's head
    until told to read the rest; a small receive buffer, so the kernel holds little
    of what the core sends it.
    """

    def __init__(self, port: int, path: str, body: Any) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 * 1024)
        self.sock.settimeout(120)
        self.sock.connect(("127.0.0.1", port))
        data = json.dumps(body).encode()
        self.sock.sendall(
            b"POST %s HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(data), data)
        )
        self._got = b""

    def head(self) -> tuple[int, dict[str, str]]:
        """
        The status and headers, once they have come (the answer has been written).
        """
        while b"\r\n\r\n" not in self._got:
            piece = self.sock.recv(4096)
            assert piece, self._got[:200]
            self._got += piece
        head = self._got.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
        headers = dict(line.split(": ", 1) for line in head[1:])
        return int(head[0].split()[1]), {k.lower(): v for k, v in headers.items()}

    def read(self) -> tuple[int, dict[str, str], bytes]:
        """
        Everything: the status, the headers, and the body (unchunked).
        """
        status, headers = self.head()
        while True:
            piece = self.sock.recv(1 << 20)
            if not piece:
                break
            self._got += piece
        self.sock.close()
        body = self._got.split(b"\r\n\r\n", 1)[1]
        if headers.get("transfer-encoding") == "chunked":
            pieces = []
            while True:
                size, _, body = body.partition(b"\r\n")
                if not int(size, 16):
                    break
                pieces.append(body[: int(size, 16)])
                body = body[int(size, 16) + 2 :]
            body = b"".join(pieces)
        return status, headers, body


def speak(port: int, text: str = LONG) -> Client:
    return Client(port, "/speak", {"engine": "tone", "text": text, "stream": False})


def whole(client: Client) -> bytes:
    status, headers, body = client.read()
    assert status == 200, body[:300]
    assert int(headers["content-length"]) == len(body)
    return body


def overloaded(client: Client) -> dict[str, Any]:
    status, headers, body = client.read()
    assert status == 429, (status, body[:300])
    assert headers["retry-after"] == "1"
    error: dict[str, Any] = json.loads(body)["error"]
    assert error["code"] == "overloaded" and error["retryable"] is True
    return error


def test_buffered_speech_held_by_readers_that_do_not_read_refuses_the_next(port: int) -> None:
    """
    Two stream:false answers whose clients read nothing stay counted after the core has
    written them, so a third is overloaded with Retry-After; once the two are read they
    are whole, and the budget is free again.
    """
    first, second = speak(port), speak(port)
    assert first.head()[0] == 200 and second.head()[0] == 200
    overloaded(speak(port))
    assert len(whole(first)) == len(whole(second)) > 14_000_000
    assert len(whole(speak(port))) > 14_000_000


def dialogue(port: int) -> Client:
    turns = [{"speaker": "A", "text": HALF}, {"speaker": "B", "text": HALF}]
    return Client(port, "/engines/tone/dialogue", {"variant": "classic", "turns": turns, "stream": False})


def test_buffered_dialogues_held_by_readers_that_do_not_read_refuse_the_next(port: int) -> None:
    """
    A dialogue with stream false is one buffered answer like /speak's: two whose clients
    read nothing stay counted once written, so a long /speak beside them is overloaded
    with Retry-After; both dialogues arrive whole once read, and the budget is free again.
    """
    first, second = dialogue(port), dialogue(port)
    assert first.head()[0] == 200 and second.head()[0] == 200
    overloaded(speak(port))
    assert len(whole(first)) == len(whole(second)) > 14_000_000
    assert len(whole(speak(port))) > 14_000_000


def batch(port: int, *texts: str) -> Client:
    items = [{"input": text} for text in texts]
    return Client(port, "/v1/audio/speech/batch", {"model": "tone", "items": items, "response_format": "wav"})


def test_a_batch_that_crosses_the_budget_is_refused_whole(port: int) -> None:
    """
    A batch whose audio and base64 would take the core past its budget is refused as a
    whole, overloaded with Retry-After and x-should-retry, not answered with the items
    that fitted.
    """
    refused = batch(port, LONG, LONG, LONG)
    status, headers, body = refused.read()
    assert status == 429 and headers["retry-after"] == "1" and headers["x-should-retry"] == "true", body[:300]
    assert json.loads(body)["error"]["code"] == "overloaded"
    assert len(whole(speak(port))) > 14_000_000


def test_a_batch_answer_a_client_has_not_read_still_counts(port: int) -> None:
    """
    A batch's JSON (its items' base64) stays counted while its client has not read it:
    a long buffered answer beside it is overloaded, and the batch arrives whole.
    """
    import base64

    pending = batch(port, HALF, HALF)
    assert pending.head()[0] == 200
    overloaded(speak(port))
    document = json.loads(whole(pending))
    assert (document["succeeded"], document["failed"]) == (2, 0)
    assert all(len(base64.b64decode(r["audio_data"])) > 7_000_000 for r in document["results"])
    assert len(whole(speak(port))) > 14_000_000


def mcp_speak(port: int, text: str) -> Client:
    call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": "speak", "arguments": {"engine": "tone", "text": text}}}
    return Client(port, "/mcp", call)


def test_mcp_answers_a_client_has_not_read_still_count(port: int) -> None:
    """
    MCP's speak results (the audio in base64, in JSON-RPC) stay counted while their
    clients have not read them: a long buffered answer beside two of them is overloaded,
    and both results arrive whole.
    """
    first, second = mcp_speak(port, HALF), mcp_speak(port, HALF)
    assert first.head()[0] == 200 and second.head()[0] == 200
    overloaded(speak(port))
    for client in (first, second):
        result = json.loads(whole(client))["result"]
        assert result["isError"] is False and result["content"][0]["type"] == "audio"
    assert len(whole(speak(port))) > 14_000_000


def test_the_openai_shim_streams_so_a_reader_that_does_not_read_holds_no_budget(port: int) -> None:
    """
    /v1/audio/speech streams, paused by its reader: a client reading nothing holds none
    of the buffer budget, so two long buffered answers beside it are both admitted; it
    still gets its whole answer once it reads.
    """
    shim = Client(port, "/v1/audio/speech", {"model": "tone", "input": LONG, "response_format": "wav"})
    assert shim.head()[0] == 200
    first, second = speak(port), speak(port)
    assert len(whole(first)) == len(whole(second)) > 14_000_000
    status, _, body = shim.read()
    assert status == 200 and len(body) > 14_000_000
    assert get(port, "/health")["status"] == "ok"
