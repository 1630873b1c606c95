"""
The checker's client: blocking standard-library HTTP to one worker, over a Unix socket
or TCP, each request bounded by the current probe's deadline.

Blocking on purpose: it needs no reactor, and it must see the bytes on the wire (chunk
arrival, the trailer) that a friendlier client hides.  Streamed responses are read from
the raw socket and decoded by L{ChunkedDecoder}; everything else goes through
C{http.client}.
"""

from __future__ import annotations

import http.client
import json
import math
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import urlsplit

from ._report import Failed, TimedOut
from ._wire import ChunkedDecoder, ChunkedError, parse_head


@dataclass(frozen=True)
class Target:
    """
    Where a worker listens: a Unix socket path, or a TCP host and port.
    """

    unix_path: str | None = None
    host: str = "localhost"
    port: int | None = None

    @property
    def host_header(self) -> str:
        return self.host if self.port is None else f"{self.host}:{self.port}"

    def connection(self, timeout: float) -> http.client.HTTPConnection:
        if self.unix_path is not None:
            return _UnixConnection(self.unix_path, timeout)
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def __str__(self) -> str:
        if self.unix_path is not None:
            return f"unix:{self.unix_path}"
        return f"http://{self.host_header}"


def parse_target(text: str) -> Target:
    """
    C{/x/y.sock}, C{unix:/x/y.sock} or C{http://host:port}.

    @raise ValueError: for any other scheme, an http URL without a port, or one with a
        path, query or credentials (a worker serves at its root).
    """
    if text.startswith("unix:"):
        path = text[len("unix:"):]
        if not path:
            raise ValueError("unix: needs a socket path")
        return Target(unix_path=path)
    if "://" not in text:
        if not text:
            raise ValueError("no target given")
        return Target(unix_path=text)
    parts = urlsplit(text)
    if parts.scheme != "http":
        raise ValueError(f"a target is a Unix socket path or an http:// URL, not {parts.scheme}://")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise ValueError("an http target is http://host:port and nothing more")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"bad port in {text!r}") from None
    if not parts.hostname or port is None:
        raise ValueError("an http target names its host and port: http://host:port")
    return Target(host=parts.hostname, port=port)


class _UnixConnection(http.client.HTTPConnection):
    """
    HTTP over a Unix domain socket: only where the bytes go differs.
    """

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.unix_path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


@dataclass
class Response:
    """
    A whole response, as a buffered request sees it.
    """

    label: str
    status: int
    headers: dict[str, str]
    body: bytes

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's recursion
            raise Failed(f"{self.label} answered {self.status} with a body that is not JSON") from None

    def describe(self) -> str:
        """The status and, for an error envelope, its code, field and message."""
        try:
            error = json.loads(self.body)["error"]
            said = f"{error.get('code')}"
            if error.get("field") is not None:
                said += f' (field "{error["field"]}")'
            said += f": {str(error.get('message'))[:160]}"
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            said = f"{self.header('content-type') or 'no Content-Type'}, {len(self.body)} bytes"
        return f"{self.status} {said}"


@dataclass
class Streamed:
    """
    A streamed response, as the wire delivered it.

    @ivar complete: the body ended properly (the last chunk and trailer section, or
        Content-Length reached) rather than by the connection dropping.
    @ivar recvs: how many socket reads carried body bytes.
    """

    status: int
    headers: dict[str, str]
    chunked: bool
    chunks: list[bytes]
    trailers: dict[str, str]
    complete: bool
    recvs: int

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)


class Client:
    """
    Blocking requests to one worker, each bounded by the current probe's deadline, and a
    record of every error response for the envelope check.
    """

    def __init__(self, target: Target, timeout: float) -> None:
        self.target = target
        self.timeout = timeout
        self.deadline = math.inf
        self.errors: list[Response] = []

    def start(self) -> None:
        """Begin a probe: give it a fresh deadline."""
        self.deadline = time.monotonic() + self.timeout

    def remaining(self, label: str) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimedOut(f"no complete answer to {label} within {self.timeout:g} s")
        return left

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        content_type: str = "application/json",
        extra: dict[str, str] | None = None,
    ) -> Response:
        label = f"{method} {path}"
        conn = self.target.connection(self.remaining(label))
        headers = {"Connection": "close", **(extra or {})}
        if body is not None:
            headers["Content-Type"] = content_type
        try:
            conn.request(method, path, body=body, headers=headers)
            sock = conn.sock
            answer = conn.getresponse()
            pieces: list[bytes] = []
            # The response closes the socket itself once the body ends, so the
            # deadline is set only while it is still open.
            while not answer.isclosed():
                if sock is not None:
                    sock.settimeout(self.remaining(label))
                piece = answer.read(65536)
                if not piece:
                    break
                pieces.append(piece)
            received = {k.lower(): v for k, v in answer.getheaders()}
        except TimeoutError:
            raise TimedOut(f"no complete answer to {label} within {self.timeout:g} s") from None
        except http.client.IncompleteRead:
            raise Failed(f"the answer to {label} was cut off") from None
        finally:
            conn.close()
        response = Response(label, answer.status, received, b"".join(pieces))
        if response.status >= 400:
            self.errors.append(response)
        return response

    def post(self, path: str, doc: Any, headers: dict[str, str] | None = None) -> Response:
        return self.request("POST", path, json.dumps(doc).encode("utf-8"), extra=headers)

    def get(self, path: str) -> Response:
        return self.request("GET", path)

    def stream(self, path: str, doc: Any) -> Streamed:
        """
        POST C{doc} and read the answer from the raw socket, chunk by chunk.
        """
        label = f"POST {path}"
        body = json.dumps(doc).encode("utf-8")
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.target.host_header}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"TE: trailers\r\nConnection: close\r\n\r\n"
        ).encode("latin-1")
        conn = self.target.connection(self.remaining(label))
        try:
            conn.connect()
            sock = conn.sock
            assert sock is not None
            sock.sendall(head + body)

            def more() -> bytes:
                sock.settimeout(self.remaining(label))
                try:
                    return bytes(sock.recv(65536))
                except ConnectionResetError:
                    return b""

            buffer = b""
            while b"\r\n\r\n" not in buffer:
                data = more()
                if not data:
                    raise Failed(f"the connection closed before the headers of {label}")
                buffer += data
            raw_head, rest = buffer.split(b"\r\n\r\n", 1)
            try:
                status, headers = parse_head(raw_head)
            except ValueError as exc:
                raise Failed(str(exc)) from None
            chunked = "chunked" in headers.get("transfer-encoding", "").lower()
            result = (
                self._read_chunked(more, rest, status, headers)
                if chunked
                else self._read_plain(more, rest, status, headers)
            )
        except TimeoutError:
            raise TimedOut(f"no complete answer to {label} within {self.timeout:g} s") from None
        finally:
            conn.close()
        if status >= 400:
            self.errors.append(Response(label, status, headers, result.body))
        return result

    @staticmethod
    def _read_chunked(
        more: Callable[[], bytes], rest: bytes, status: int, headers: dict[str, str]
    ) -> Streamed:
        decoder = ChunkedDecoder()
        recvs = 0
        data = rest
        try:
            while True:
                if data:
                    recvs += 1
                decoder.feed(data)
                if decoder.done:
                    break
                data = more()
                if not data:
                    break
        except ChunkedError as exc:
            raise Failed(f"the chunked body is malformed: {exc}") from None
        return Streamed(status, headers, True, decoder.chunks, decoder.trailers, decoder.done, recvs)

    @staticmethod
    def _read_plain(
        more: Callable[[], bytes], rest: bytes, status: int, headers: dict[str, str]
    ) -> Streamed:
        length = int(headers["content-length"]) if headers.get("content-length", "").isdigit() else None
        body = rest
        recvs = 1 if rest else 0
        while length is None or len(body) < length:
            data = more()
            if not data:
                break
            body += data
            recvs += 1
        complete = length is not None and len(body) >= length
        return Streamed(status, headers, False, [body], {}, complete, recvs)
