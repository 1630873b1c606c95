"""
The blocking HTTP client a variant's synthesis thread speaks to its server with.

The standard library's C{http.client}, over connections kept alive per server (one
utterance's first byte should not pay a TCP handshake), each checked out by one thread
at a time and put back only once its response was read to the end.  A connection that
was idle may have been closed by the server meanwhile; a request that finds it so before
any answer is sent once more on a fresh one, and only then is the server unreachable.

Two clocks bound every exchange: C{head_seconds} until the response's head, and
C{stall_seconds} between two reads of its body.  What the server answers is never
trusted to be small: error bodies are read to a cap, lines to a cap.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Mapping
from urllib.parse import urlsplit

from ._config import ServerConfig

#: The most of an error body (or a JSON answer) read from a server.
ANSWER_LIMIT = 1024 * 1024
#: Idle connections kept per server.
_IDLE = 16
#: What the kernel may hold of a server's answer for this worker.  Linux grows a TCP
#: receive buffer on its own up to net.ipv4.tcp_rmem's maximum (32 MiB here), so a reader
#: that paused would leave the server free to send that much before it felt the pause;
#: set, the buffer stays this size (the kernel doubles it for its bookkeeping).
RECEIVE_BUFFER = 256 * 1024


class _Connection(http.client.HTTPConnection):
    def connect(self) -> None:
        super().connect()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)


class _SecureConnection(http.client.HTTPSConnection):
    def connect(self) -> None:
        super().connect()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)


class Unreachable(Exception):
    """
    The server did not answer: refused, reset, unresolvable, or silent past a deadline.
    """


@dataclass
class ServerError(Exception):
    """
    The server answered with an error status; C{message} and C{param} from its envelope.
    """

    status: int
    message: str
    param: str | None = None

    def __str__(self) -> str:
        return f"{self.status}: {self.message}"


class NotJSON(ServerError):
    """
    A 2xx whose body is not JSON: the route is not the API's (a web page's catch-all
    answering every path, as local-tts-studio's does).
    """


def _document(raw: bytes, where: str) -> Any:
    """
    A 2xx answer's JSON document; C{where} says whose answer, for the error.

    @raise NotJSON: it is not JSON, or nests deeper than Python's parser recurses.
    """
    try:
        return json.loads(raw) if raw else None
    except (ValueError, RecursionError):
        raise NotJSON(502, f"{where} with no JSON") from None


def _message(raw: bytes) -> tuple[str, str | None]:
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        # Not JSON, or nested past the parser's recursion: a server's words all the same.
        return raw[:200].decode("utf-8", "replace").strip() or "no message", None
    error = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(error, dict):
        param = error.get("param")
        return str(error.get("message") or error)[:500], param if isinstance(param, str) else None
    if isinstance(error, str):
        return error[:500], None
    detail = doc.get("detail") if isinstance(doc, dict) else None
    if detail is not None:
        return str(detail)[:500], None
    return str(doc)[:500], None


class Server:
    """
    One speech server: its connections, and the requests made of it.
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        parts = urlsplit(config.url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or ""
        self._port = parts.port or (443 if self._https else 80)
        self._prefix = parts.path.rstrip("/")
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    @property
    def origin(self) -> str:
        return self.config.origin

    def _headers(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        headers = {"Accept": "*/*", "User-Agent": "rhapsode-worker"}
        if self.config.key:
            headers["Authorization"] = f"Bearer {self.config.key}"
        headers.update(extra or {})
        return headers

    def _new(self, timeout: float) -> http.client.HTTPConnection:
        if self._https:
            return _SecureConnection(self._host, self._port, timeout=timeout)
        return _Connection(self._host, self._port, timeout=timeout)

    def _checkout(self, timeout: float) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            if self._idle:
                connection = self._idle.pop()
                if connection.sock is not None:
                    connection.sock.settimeout(timeout)
                return connection, True
        return self._new(timeout), False

    def _checkin(self, connection: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < _IDLE and connection.sock is not None:
                self._idle.append(connection)
                return
        connection.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    @contextmanager
    def exchange(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        *,
        head_seconds: float | None = None,
        fresh: bool = False,
    ) -> Iterator[http.client.HTTPResponse]:
        """
        Send a request and hand its response over once the head is in; the connection
        goes back to the pool only if the body was read to its end.

        @param fresh: use a connection of its own (the prober's, so a hung request on a
            pooled one never decides whether the server answers).
        @raise Unreachable: no head came.
        """
        head = self.config.head_seconds if head_seconds is None else head_seconds
        sent = self._headers(headers)
        for attempt in (0, 1):
            connection, reused = (self._new(head), False) if fresh else self._checkout(head)
            try:
                connection.request(method, self._prefix + path, body=body, headers=sent)
                response = connection.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as exc:
                connection.close()
                if reused and attempt == 0:
                    continue  # the server closed an idle connection: once more, fresh
                raise Unreachable(f"{self.origin} dropped the connection ({type(exc).__name__})") from None
            except (socket.timeout, TimeoutError):
                connection.close()
                raise Unreachable(f"{self.origin} did not answer within {head:g} s") from None
            except OSError as exc:
                connection.close()
                reason = exc.strerror or type(exc).__name__
                raise Unreachable(f"{self.origin} could not be reached ({reason})") from None
            except http.client.HTTPException as exc:
                connection.close()
                raise Unreachable(f"{self.origin} answered with no usable head ({type(exc).__name__})") from None
            break
        if connection.sock is not None:
            connection.sock.settimeout(self.config.stall_seconds)
        complete = False
        try:
            yield response
            complete = response.isclosed() and not response.will_close
        finally:
            if complete:
                self._checkin(connection)
            else:
                connection.close()

    def json(
        self, method: str, path: str, document: Any = None, *, head_seconds: float | None = None, fresh: bool = False
    ) -> Any:
        """
        A JSON exchange: the answer's document on a 2xx.

        @raise ServerError: any other status, with the server's message.
        @raise Unreachable: no answer.
        """
        body = json.dumps(document).encode() if document is not None else None
        headers = {"Content-Type": "application/json"} if body is not None else {}
        with self.exchange(method, path, body, headers, head_seconds=head_seconds, fresh=fresh) as response:
            raw = read_capped(response, ANSWER_LIMIT)
            if not 200 <= response.status < 300:
                message, param = _message(raw)
                raise ServerError(response.status, message, param)
        return _document(raw, f"{self.origin}{path} answered {response.status}")

    def upload(self, path: str, fields: list[tuple[str, str | None, bytes, str | None]]) -> Any:
        """
        A multipart/form-data POST of C{fields} (name, filename, data, content type).
        """
        boundary = "rhapsode-" + threading.get_ident().to_bytes(8, "little").hex()
        parts: list[bytes] = []
        for name, filename, data, content_type in fields:
            disposition = f'form-data; name="{name}"'
            if filename is not None:
                disposition += f'; filename="{filename}"'
            head = f"--{boundary}\r\nContent-Disposition: {disposition}\r\n"
            if content_type:
                head += f"Content-Type: {content_type}\r\n"
            parts.append(head.encode() + b"\r\n" + data + b"\r\n")
        body = b"".join(parts) + f"--{boundary}--\r\n".encode()
        headers = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
        with self.exchange("POST", path, body, headers) as response:
            raw = read_capped(response, ANSWER_LIMIT)
            if not 200 <= response.status < 300:
                message, param = _message(raw)
                raise ServerError(response.status, message, param)
        return _document(raw, f"{self.origin}{path} answered {response.status}")


def read_capped(response: http.client.HTTPResponse, limit: int) -> bytes:
    """
    A response's body, to C{limit} bytes (the rest is left unread: the connection is then
    not reused).
    """
    try:
        return response.read(limit)
    except (socket.timeout, TimeoutError):
        return b""

