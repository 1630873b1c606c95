"""
HTTP/1.1 as the checker reads it off the socket, with nothing between: response heads,
chunked bodies with their trailers (RFC 9112 section 7.1), media types, and the
multipart bodies it uploads voices with.  Pure functions, no I/O.
"""

from __future__ import annotations

import re
import uuid
from typing import Iterable, Sequence

DURATION_HEADER = "x-rhapsode-duration-ms"

_CRLF = b"\r\n"
_MAX_LINE = 8192
_HEX = re.compile(rb"^[0-9A-Fa-f]+$")


def parse_head(raw: bytes) -> tuple[int, dict[str, str]]:
    """
    The status and headers of a response head (without its blank line).  Header names are
    lower-cased; a repeated header's values are joined with ", ".

    @raise ValueError: if the status line or a header line is malformed.
    """
    lines = raw.decode("latin-1").split("\r\n")
    status_line = lines[0].split(" ", 2)
    if len(status_line) < 2 or not status_line[0].startswith("HTTP/") or not status_line[1].isdigit():
        raise ValueError(f"not an HTTP status line: {lines[0]!r}")
    return int(status_line[1]), _fields(lines[1:])


def _fields(lines: Iterable[str]) -> dict[str, str]:
    fields: dict[str, str] = {}
    for line in lines:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            raise ValueError(f"not a header line: {line!r}")
        key = name.lower()
        fields[key] = f"{fields[key]}, {value.strip()}" if key in fields else value.strip()
    return fields


class ChunkedError(ValueError):
    """A chunked body that breaks the framing of RFC 9112 section 7.1."""


class ChunkedDecoder:
    """
    Decodes a chunked body incrementally: feed it bytes as they arrive, and it keeps the
    chunks, the trailer fields, and whether the last chunk and the trailer section ended.

    @ivar chunks: the data of every complete chunk, in order.
    @ivar trailers: trailer fields, names lower-cased.
    @ivar done: the zero-size chunk and the blank line after the trailers have arrived.
    """

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.trailers: dict[str, str] = {}
        self.done = False
        self._buffer = bytearray()
        self._size: int | None = None
        self._in_trailer = False
        self._trailer_lines: list[str] = []

    def feed(self, data: bytes) -> list[bytes]:
        """
        Take more of the body; return the chunks it completed.

        @raise ChunkedError: on malformed framing, or bytes after the message ended.
        """
        if self.done:
            if data:
                raise ChunkedError("bytes after the last chunk")
            return []
        self._buffer += data
        completed: list[bytes] = []
        while not self.done:
            if self._in_trailer:
                line = self._line()
                if line is None:
                    break
                if line:
                    self._trailer_lines.append(line.decode("latin-1"))
                    continue
                try:
                    self.trailers = _fields(self._trailer_lines)
                except ValueError as exc:
                    raise ChunkedError(f"bad trailer: {exc}") from None
                self.done = True
                if self._buffer:
                    raise ChunkedError("bytes after the last chunk")
            elif self._size is None:
                line = self._line()
                if line is None:
                    break
                token = line.split(b";", 1)[0].strip(b" \t")
                if not _HEX.match(token):
                    raise ChunkedError(f"bad chunk size line {bytes(line)!r}")
                self._size = int(token, 16)
                if self._size == 0:
                    self._in_trailer = True
            else:
                if len(self._buffer) < self._size + 2:
                    break
                if self._buffer[self._size : self._size + 2] != _CRLF:
                    raise ChunkedError("a chunk's data is not followed by CRLF")
                chunk = bytes(self._buffer[: self._size])
                del self._buffer[: self._size + 2]
                self._size = None
                self.chunks.append(chunk)
                completed.append(chunk)
        return completed

    def _line(self) -> bytes | None:
        end = self._buffer.find(_CRLF)
        if end < 0:
            if len(self._buffer) > _MAX_LINE:
                raise ChunkedError("a chunk size or trailer line runs on without CRLF")
            return None
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 2]
        return line


def parse_media_type(value: str) -> tuple[str, dict[str, str]]:
    """
    C{"audio/L16; rate=24000; channels=1"} to C{("audio/l16", {"rate": "24000", ...})}:
    the type and parameter names lower-cased, quoted values unquoted.
    """
    kind, *params = value.split(";")
    parsed: dict[str, str] = {}
    for param in params:
        name, _, raw = param.partition("=")
        parsed[name.strip().lower()] = raw.strip().strip('"')
    return kind.strip().lower(), parsed


def multipart(fields: Sequence[tuple[str, str | None, bytes]]) -> tuple[bytes, str]:
    """
    A multipart/form-data body of (name, filename or None, data); returns it and its
    Content-Type.
    """
    boundary = f"conform{uuid.uuid4().hex}"
    out = bytearray()
    for name, filename, data in fields:
        out += f"--{boundary}\r\n".encode()
        disposition = f'Content-Disposition: form-data; name="{name}"'
        if filename is not None:
            disposition += f'; filename="{filename}"'
            disposition += "\r\nContent-Type: application/octet-stream"
        out += f"{disposition}\r\n\r\n".encode() + data + _CRLF
    out += f"--{boundary}--\r\n".encode()
    return bytes(out), f"multipart/form-data; boundary={boundary}"
