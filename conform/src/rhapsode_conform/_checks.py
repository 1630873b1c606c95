"""
The conformance checker: the worker rules of protocol.md sections 1 to 9, run against a
running worker over its socket, one result per rule.

A blocking standard-library client on purpose: it needs no reactor, and it must see the
bytes on the wire (chunk arrival, the trailer) that a friendlier client hides.  Streamed
responses are read from the raw socket and decoded by L{ChunkedDecoder}; everything else
goes through C{http.client}.

Each check is a function in L{CHECKS} returning its results.  A result is pass, FAIL, or
cannot be decided, and a check that could not have failed is never a pass: a rule the
worker gives no way to test (a seed on a variant that does not claim reproducibility, a
refusal of an undeclared format on a worker that declares all five) is "cannot be
decided", with the reason.  Every probe has a deadline, and one check failing never stops
the others.
"""

from __future__ import annotations

import enum
import http.client
import io
import json
import math
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
import wave
from array import array
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterable, Mapping, Sequence
from urllib.parse import urlsplit

from rhapsode_protocol import contract
from rhapsode_protocol.errors import ERROR_TABLE, SpeechError
from rhapsode_protocol.vocab import ALL_CUES

#: Seconds one probe may take, from its first request to its last byte: generous, since
#: the first request of a run may load a model.
DEFAULT_TIMEOUT = 120.0

DURATION_HEADER = "x-rhapsode-duration-ms"
#: How far a decoded duration may stray from the duration header.
DURATION_TOLERANCE_MS = 50.0
#: LAME's encoder delay plus the decoder's (576 + 529): samples of silence an mp3 decoder
#: emits before the audio, at the native rate.
MP3_PRIMING_SAMPLES = 1105
#: Audio with an RMS below this share of full scale (-60 dBFS) is silence.
SILENCE_FLOOR = 0.001
SEED = 20260917
BASE_TEXT = "Hello there and goodbye."
FORMAT_TEXT = "Hello there, this is how one sentence sounds in every format."
TEST_VOICE_PREFIX = "conform-"

_CRLF = b"\r\n"
_MAX_LINE = 8192
_HEX = re.compile(rb"^[0-9A-Fa-f]+$")


# -- results ------------------------------------------------------------------------------


class Outcome(enum.Enum):
    PASS = "pass"
    FAIL = "FAIL"
    UNDECIDED = "cannot be decided"


@dataclass(frozen=True)
class Result:
    """
    The outcome of one rule; C{why} says what went wrong, or why it could not be decided.
    """

    name: str
    outcome: Outcome
    why: str = ""

    def line(self) -> str:
        if self.outcome is Outcome.PASS:
            return f"pass  {self.name}"
        if self.outcome is Outcome.FAIL:
            return f"FAIL  {self.name}: {self.why}"
        return f"cannot be decided {self.name}: {self.why}"


@dataclass
class Report:
    """
    Every result of a run, in order, and what could not be put back afterwards.
    """

    results: list[Result] = field(default_factory=list)
    cleanup_problems: list[str] = field(default_factory=list)

    def count(self, outcome: Outcome) -> int:
        return sum(1 for r in self.results if r.outcome is outcome)

    @property
    def exit_code(self) -> int:
        return 1 if self.count(Outcome.FAIL) else 0

    def summary(self) -> str:
        return (
            f"conformance: {self.count(Outcome.PASS)} pass, {self.count(Outcome.FAIL)} fail, "
            f"{self.count(Outcome.UNDECIDED)} cannot be decided"
        )

    def render(self) -> str:
        return "\n".join([*(r.line() for r in self.results), self.summary()]) + "\n"


class Failed(Exception):
    """The worker broke the rule a probe tests; the message says how."""


class Undecidable(Exception):
    """The rule cannot be tested against this worker; the message says why."""


class TimedOut(Exception):
    """A probe ran past its deadline."""


class Unreachable(Exception):
    """Nothing answered HTTP at the target."""


# -- pure helpers: targets, heads, chunked bodies, media types ------------------------------


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


def mp3_slack_samples(sample_rate: int) -> int:
    """
    Extra samples an mp3 decoder may emit beyond the audio: the priming delay and one
    frame of padding (1152 samples in MPEG-1, at 32 kHz and up; 576 below).
    """
    return MP3_PRIMING_SAMPLES + (1152 if sample_rate >= 32000 else 576)


# -- audio -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pcm:
    """
    Decoded audio: interleaved signed 16-bit samples.
    """

    samples: array[int]
    rate: int
    channels: int

    @property
    def frames(self) -> int:
        return len(self.samples) // self.channels

    @property
    def duration_ms(self) -> float:
        return self.frames * 1000.0 / self.rate

    @property
    def rms(self) -> float:
        """Root mean square as a share of full scale; 0 for no samples."""
        if not self.samples:
            return 0.0
        return math.sqrt(sum(s * s for s in self.samples) / len(self.samples)) / 32768.0


def pcm_from_s16le(data: bytes, rate: int, channels: int) -> Pcm:
    if len(data) % (2 * channels):
        raise Failed(f"{len(data)} bytes is not a whole number of {channels}-channel 16-bit frames")
    samples = array("h")
    samples.frombytes(data)
    if sys.byteorder == "big":
        samples.byteswap()
    return Pcm(samples, rate, channels)


def decode_wav(data: bytes) -> Pcm:
    try:
        with wave.open(io.BytesIO(data)) as reader:
            width, channels, rate = reader.getsampwidth(), reader.getnchannels(), reader.getframerate()
            frames = reader.readframes(reader.getnframes())
    except (wave.Error, EOFError) as exc:
        raise Failed(f"the body is not a WAV file the wave module reads: {exc}") from None
    if width != 2:
        raise Failed(f"the WAV holds {8 * width}-bit samples, not 16-bit")
    return pcm_from_s16le(frames, rate, channels)


def decode_with_ffmpeg(ffmpeg: str, data: bytes, rate: int, channels: int, timeout: float) -> Pcm:
    """
    Decode any container ffmpeg reads to s16le at C{rate} and C{channels}.
    """
    argv = [
        ffmpeg, "-hide_banner", "-loglevel", "error", "-nostdin", "-i", "pipe:0",
        "-f", "s16le", "-acodec", "pcm_s16le", "-ar", str(rate), "-ac", str(channels), "pipe:1",
    ]
    try:
        done = subprocess.run(argv, input=data, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise TimedOut(f"ffmpeg took over {timeout:.0f} s to decode") from None
    if done.returncode != 0:
        why = done.stderr.decode("utf-8", "replace").strip().splitlines()
        raise Failed(f"ffmpeg cannot decode the body: {why[-1] if why else done.returncode}")
    return pcm_from_s16le(done.stdout, rate, channels)


def tiny_wav(seconds: float = 1.0, rate: int = 16000) -> bytes:
    """A sine at 220 Hz: a well-formed reference file for refusals to be about its type."""
    samples = array("h", (int(8000 * math.sin(2 * math.pi * 220 * i / rate)) for i in range(int(seconds * rate))))
    if sys.byteorder == "big":
        samples.byteswap()
    out = io.BytesIO()
    with wave.open(out, "wb") as writer:
        writer.setnchannels(1)
        writer.setsampwidth(2)
        writer.setframerate(rate)
        writer.writeframes(samples.tobytes())
    return out.getvalue()


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


# -- the client ----------------------------------------------------------------------------


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
        except ValueError:
            raise Failed(f"{self.label} answered {self.status} with a body that is not JSON") from None

    def describe(self) -> str:
        """The status and, for an error envelope, its code, field and message."""
        try:
            error = json.loads(self.body)["error"]
            said = f"{error.get('code')}"
            if error.get("field") is not None:
                said += f' (field "{error["field"]}")'
            said += f": {str(error.get('message'))[:160]}"
        except (ValueError, KeyError, TypeError, AttributeError):
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
        self, method: str, path: str, body: bytes | None = None, content_type: str = "application/json"
    ) -> Response:
        label = f"{method} {path}"
        conn = self.target.connection(self.remaining(label))
        headers = {"Connection": "close"}
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

    def post(self, path: str, doc: Any) -> Response:
        return self.request("POST", path, json.dumps(doc).encode("utf-8"))

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


# -- the context of one run ------------------------------------------------------------------


class Context:
    """
    What the checks share: the client, the capability document, the ffmpeg to decode with,
    seeded audio already fetched, and the voices a check created and must not leave behind.
    """

    def __init__(self, client: Client, ffmpeg: str | None) -> None:
        self.client = client
        self.ffmpeg = ffmpeg
        self.created: set[str] = set()
        self._caps: dict[str, Any] | None = None
        self._twice: dict[tuple[Any, ...], tuple[bytes, bytes]] = {}

    # The variants of a worker do not change while it runs, so one read serves every
    # check; only checks about current read /capabilities afresh.
    def capabilities(self) -> dict[str, Any]:
        if self._caps is None:
            response = self.client.get("/capabilities")
            try:
                doc = response.json()
                contract.validate(contract.CAPABILITIES, doc)
            except (Failed, SpeechError) as exc:
                raise Undecidable(f"/capabilities is unreadable ({exc}); see the capabilities check") from None
            self._caps = doc
        return self._caps

    def variants(self) -> dict[str, dict[str, Any]]:
        return dict(self.capabilities()["variants"])

    def default_variant(self) -> str:
        return str(self.capabilities()["defaultVariant"])

    def native(self) -> tuple[int, int]:
        native = self.capabilities()["nativeFormat"]
        return int(native["sampleRate"]), int(native["channels"])

    def voice_ids(self) -> list[str]:
        response = self.client.get("/voices")
        if response.status != 200:
            raise Undecidable(f"GET /voices answered {response.describe()}")
        doc = response.json()
        if not isinstance(doc, list):
            raise Undecidable("GET /voices is not a list")
        return [v["id"] for v in doc if isinstance(v, dict) and isinstance(v.get("id"), str)]

    def speak(self, **doc: Any) -> Response:
        return self.client.post("/speak", doc)

    def pcm(self, variant: str, text: str, **extra: Any) -> bytes:
        """Buffered pcm of a request that must succeed."""
        response = self.speak(text=text, variant=variant, format="pcm", stream=False, **extra)
        if response.status != 200:
            raise Failed(f"speaking {text!r} on {variant} answered {response.describe()}")
        return response.body

    def twice(self, variant: str, text: str, seed: int, **extra: Any) -> tuple[bytes, bytes]:
        """The same seeded request, made twice (once per run)."""
        key = (variant, text, seed, tuple(sorted(extra.items())))
        if key not in self._twice:
            self._twice[key] = (
                self.pcm(variant, text, seed=seed, **extra),
                self.pcm(variant, text, seed=seed, **extra),
            )
        return self._twice[key]

    def steady(self, variant: str, text: str) -> bytes:
        """
        Seeded audio shown to reproduce, as a baseline a change can be measured against.
        """
        if not reproducible(self.variants()[variant]):
            raise Undecidable("the variant does not claim seed reproducibility")
        first, second = self.twice(variant, text, SEED)
        if first != second:
            raise Undecidable("the same seeded request gave different audio twice (see the seed check)")
        return first

    def probe(self, name: str, test: Callable[[], None]) -> Result:
        """Run one test under a fresh deadline and turn its ending into a result."""
        self.client.start()
        return outcome_of(name, test)


def outcome_of(name: str, test: Callable[[], Any]) -> Result:
    """Run C{test}; its ending, returned or raised, is the result named C{name}."""
    try:
        test()
    except Exception as exc:  # a worker can answer anything; the run must go on
        return result_of(name, exc)
    return Result(name, Outcome.PASS)


def result_of(name: str, exc: Exception) -> Result:
    """The result of a test that raised C{exc}."""
    if isinstance(exc, Undecidable):
        return Result(name, Outcome.UNDECIDED, str(exc))
    if isinstance(exc, (Failed, TimedOut)):
        return Result(name, Outcome.FAIL, str(exc))
    if isinstance(exc, (OSError, http.client.HTTPException)):
        return Result(name, Outcome.FAIL, f"the exchange failed: {type(exc).__name__}: {exc}")
    return Result(name, Outcome.FAIL, f"unexpected answer ({type(exc).__name__}: {exc})")


# -- expectations ---------------------------------------------------------------------------


def reproducible(variant: Mapping[str, Any]) -> bool:
    """Whether a variant claims seed reproducibility; one that does not say claims nothing."""
    return bool(variant.get("seeding", {}).get("reproducible", False))


def refused(
    response: Response, status: int, code: str, field: str | None = None, names: str | None = None
) -> None:
    """
    Fail unless C{response} is the error envelope with this status and code, carrying
    C{field} and a message that mentions C{names}.
    """
    wanted = f"{status} {code}" + (f' naming field "{field}"' if field else "")
    if response.status != status:
        raise Failed(f"expected {wanted}, got {response.describe()}")
    doc = response.json()
    error = doc.get("error") if isinstance(doc, dict) else None
    if not isinstance(error, dict) or error.get("code") != code:
        raise Failed(f"expected {wanted}, got {response.describe()}")
    if field is not None and error.get("field") != field:
        raise Failed(f"expected {wanted}, got {response.describe()}")
    if names is not None and names not in str(error.get("message", "")):
        raise Failed(f'the message does not name "{names}": {error.get("message")!r}')


def conforms(schema: dict[str, Any], value: Any, what: str) -> None:
    try:
        contract.validate(schema, value)
    except SpeechError as exc:
        raise Failed(f"{what} does not match the contract: {exc.message}") from None


def audible(pcm: Pcm, what: str) -> None:
    if pcm.rms < SILENCE_FLOOR:
        raise Failed(f"{what} is silent (RMS {pcm.rms:.5f} of full scale)")


def duration_header(response: Response) -> int:
    value = response.header(DURATION_HEADER)
    if value is None:
        raise Failed("no X-Rhapsode-Duration-Ms header")
    if not value.strip().isdigit():
        raise Failed(f"X-Rhapsode-Duration-Ms is {value!r}, not a whole number")
    return int(value)


def buffered_length(response: Response) -> None:
    length = response.header("content-length")
    if length is None:
        raise Failed("no Content-Length on a buffered response")
    if "chunked" in (response.header("transfer-encoding") or "").lower():
        raise Failed("a buffered response was sent chunked")
    if not length.strip().isdigit() or int(length) != len(response.body):
        raise Failed(f"Content-Length says {length} but the body is {len(response.body)} bytes")


def l16_parameters(value: str | None, native: tuple[int, int]) -> tuple[int, int]:
    """Check an C{audio/L16; rate=N; channels=C} type against the native format."""
    kind, params = parse_media_type(value or "")
    if kind != "audio/l16":
        raise Failed(f"Content-Type is {value!r}, not audio/L16")
    try:
        rate, channels = int(params["rate"]), int(params["channels"])
    except (KeyError, ValueError):
        raise Failed(f"Content-Type {value!r} does not give rate and channels") from None
    if (rate, channels) != native:
        raise Failed(f"Content-Type {value!r} is not the native {native[0]} Hz, {native[1]} channel(s)")
    return rate, channels


# -- the checks ----------------------------------------------------------------------------

Check = Callable[[Context], list[Result]]


def check_health(ctx: Context) -> list[Result]:
    def test() -> None:
        unloaded = ctx.client.post("/unload", {})
        if unloaded.status != 200:
            raise Failed(f"POST /unload answered {unloaded.describe()}")
        conforms(contract.HEALTH, unloaded.json(), "the answer to POST /unload")
        response = ctx.client.get("/health")
        if response.status != 200:
            raise Failed(f"GET /health answered {response.describe()}")
        doc = response.json()
        conforms(contract.HEALTH, doc, "/health")
        if doc["process"] != "up" or doc["model"] != "unloaded":
            raise Failed(f'after /unload, /health says process {doc["process"]!r}, model {doc["model"]!r}')
        if "variant" in doc:
            raise Failed(f'/health names variant {doc["variant"]!r} with nothing loaded')

    return [ctx.probe("health answers while unloaded", test)]


def check_capabilities(ctx: Context) -> list[Result]:
    def test() -> None:
        unloaded = ctx.client.post("/unload", {})
        if unloaded.status != 200:
            raise Failed(f"POST /unload answered {unloaded.describe()}")
        response = ctx.client.get("/capabilities")
        if response.status != 200:
            raise Failed(f"GET /capabilities answered {response.describe()}")
        doc = response.json()
        conforms(contract.CAPABILITIES, doc, "/capabilities")
        if "current" in doc:
            raise Failed("current is present while nothing is loaded")
        if doc["defaultVariant"] not in doc["variants"]:
            raise Failed(f'defaultVariant {doc["defaultVariant"]!r} is not among the variants')

    return [ctx.probe("capabilities match the contract, without current while unloaded", test)]


def check_licences(ctx: Context) -> list[Result]:
    def test() -> None:
        response = ctx.client.get("/capabilities")
        doc = response.json()
        license = doc.get("license") if isinstance(doc, dict) else None
        if not isinstance(license, dict):
            raise Failed("/capabilities has no license object")
        code = license.get("code")
        if not isinstance(code, str) or not code.strip():
            raise Failed(f"license.code is {code!r}, not a licence name")
        if "weights" not in license:
            raise Failed("license.weights is absent (null says the engine has no weights)")
        weights = license["weights"]
        if weights is not None and (not isinstance(weights, str) or not weights.strip()):
            raise Failed(f"license.weights is {weights!r}, neither a licence name nor null")
        if "weightsCommercialUse" not in license:
            raise Failed("license.weightsCommercialUse is absent")
        commercial = license["weightsCommercialUse"]
        if commercial is not None and not isinstance(commercial, bool):
            raise Failed(f"license.weightsCommercialUse is {commercial!r}, not a boolean or null")
        if weights is None and commercial is not None:
            raise Failed("license.weights is null (no weights) but weightsCommercialUse says otherwise")

    return [ctx.probe("both licences are named", test)]


def check_load_on_demand(ctx: Context) -> list[Result]:
    def test() -> None:
        default = ctx.default_variant()
        unloaded = ctx.client.post("/unload", {})
        if unloaded.status != 200:
            raise Failed(f"POST /unload answered {unloaded.describe()}")
        response = ctx.speak(text=BASE_TEXT, format="wav", stream=False)
        if response.status != 200:
            raise Failed(f"/speak after /unload answered {response.describe()}")
        audible(decode_wav(response.body), "the audio")
        health = ctx.client.get("/health").json()
        if health.get("model") != "loaded" or health.get("variant") != default:
            raise Failed(
                f"after /speak, /health says model {health.get('model')!r}, variant "
                f"{health.get('variant')!r}; expected loaded, {default!r}"
            )
        caps = ctx.client.get("/capabilities").json()
        conforms(contract.CAPABILITIES, caps, "/capabilities while loaded")
        current = caps.get("current")
        if not isinstance(current, dict) or current.get("variant") != default:
            named = current.get("variant") if isinstance(current, dict) else None
            raise Failed(f"current names {named!r}, not the effective variant {default!r}")

    return [ctx.probe("speak loads on demand", test)]


def check_formats(ctx: Context) -> list[Result]:
    results = []
    variant = ctx.default_variant()
    seeded = reproducible(ctx.variants()[variant])
    native = ctx.native()
    for fmt in ctx.capabilities()["formats"]:
        name = f"format {fmt} decodes to audio of the stated length"
        if fmt == "mp3":
            name += f" (allowing mp3's {MP3_PRIMING_SAMPLES}-sample priming delay and one frame)"

        def test(fmt: str = fmt) -> None:
            extra = {"seed": SEED} if seeded else {}
            response = ctx.speak(text=FORMAT_TEXT, variant=variant, format=fmt, stream=False, **extra)
            if response.status != 200:
                raise Failed(f"answered {response.describe()}")
            ctype = response.header("content-type")
            if fmt == "pcm":
                l16_parameters(ctype, native)
            elif ctype != contract.MEDIA_TYPES[fmt]:
                raise Failed(f"Content-Type is {ctype!r}, not {contract.MEDIA_TYPES[fmt]}")
            buffered_length(response)
            stated = duration_header(response)
            pcm = _decode(ctx, fmt, response.body, native)
            slack = DURATION_TOLERANCE_MS
            if fmt == "mp3":
                slack += mp3_slack_samples(native[0]) * 1000.0 / native[0]
            if not (-DURATION_TOLERANCE_MS <= pcm.duration_ms - stated <= slack):
                raise Failed(f"decodes to {pcm.duration_ms:.0f} ms; the header says {stated} ms")
            audible(pcm, "the decoded audio")

        results.append(ctx.probe(name, test))
    return results


def _decode(ctx: Context, fmt: str, body: bytes, native: tuple[int, int]) -> Pcm:
    if fmt == "wav":
        pcm = decode_wav(body)
        if (pcm.rate, pcm.channels) != native:
            raise Failed(f"the WAV is {pcm.rate} Hz, {pcm.channels} channel(s); the native format is not")
        return pcm
    if fmt == "pcm":
        return pcm_from_s16le(body, *native)
    if ctx.ffmpeg is None:
        raise Undecidable(f"there is no ffmpeg here to decode {fmt}")
    return decode_with_ffmpeg(ctx.ffmpeg, body, native[0], native[1], ctx.client.remaining("decoding"))


def check_buffered_wav(ctx: Context) -> list[Result]:
    def test() -> None:
        response = ctx.speak(text=BASE_TEXT, variant=ctx.default_variant(), format="wav", stream=False)
        if response.status != 200:
            raise Failed(f"answered {response.describe()}")
        buffered_length(response)

    return [ctx.probe("a buffered wav carries Content-Length", test)]


def check_refused_formats(ctx: Context) -> list[Result]:
    def undeclared() -> None:
        declared = ctx.capabilities()["formats"]
        missing = [f for f in contract.MEDIA_TYPES if f not in declared]
        if not missing:
            raise Undecidable("every format of the contract is declared")
        response = ctx.speak(text=BASE_TEXT, format=missing[0], stream=False)
        refused(response, 422, "unsupported", "format", names=missing[0])

    def unknown() -> None:
        # Outside the contract's five is unsupported too (section 6): a format this
        # worker does not do, like any other, not a malformed request.
        refused(ctx.speak(text=BASE_TEXT, format="aac", stream=False), 422, "unsupported", "format", names="aac")

    return [
        ctx.probe("an undeclared format is unsupported, naming it", undeclared),
        ctx.probe('a format outside the contract is unsupported, naming it', unknown),
    ]


def _long_text(segment: int | None, ceiling: int) -> str:
    """Sentences enough for several segments, within the ceiling."""
    wanted = min(ceiling, 3 * segment + 40 if segment else 600)
    sentences: list[str] = []
    while len(" ".join(sentences)) < wanted:
        sentences.append(f"Sentence {len(sentences) + 1} is here to make the stream run long.")
    text = " ".join(sentences)
    while len(text) > ceiling and " " in text:
        text = text.rsplit(" ", 1)[0]
    return text


def check_stream(ctx: Context) -> list[Result]:
    variant = ctx.default_variant()
    caps = ctx.variants()[variant]
    segmentation = caps["segmentation"]
    segment = segmentation.get("segmentCharacters") if segmentation.get("supported") else None
    text = _long_text(segment, caps["maxCharacters"])
    native = ctx.native()
    got: list[Streamed] = []

    def pieces() -> None:
        answer = ctx.client.stream("/speak", {"text": text, "variant": variant, "format": "pcm", "stream": True})
        got.append(answer)
        if answer.status != 200:
            raise Failed(f"answered {answer.status}: {answer.body[:160]!r}")
        l16_parameters(answer.headers.get("content-type"), native)
        if not answer.chunked:
            raise Failed("not sent with Transfer-Encoding: chunked")
        if "content-length" in answer.headers:
            raise Failed("a chunked response also carries Content-Length")
        if not answer.complete:
            raise Failed(f"the body ended without its last chunk, after {len(answer.body)} bytes")
        if len(answer.chunks) < 2 and answer.recvs < 2:
            if segment is None:
                raise Undecidable("the variant does not segment, and its audio came in one piece")
            raise Failed(f"{len(text)} characters over {segment}-character segments came in one piece")
        pcm_from_s16le(answer.body, *native)

    def trailer() -> None:
        if not got:
            raise Undecidable("the stream above was not received")
        answer = got[0]
        if answer.status != 200 or not answer.complete:
            raise Undecidable("the stream above did not end properly")
        declared = [n.strip().lower() for n in answer.headers.get("trailer", "").split(",")]
        if DURATION_HEADER not in declared:
            raise Failed("the Trailer header does not declare X-Rhapsode-Duration-Ms")
        value = answer.trailers.get(DURATION_HEADER)
        if value is None:
            raise Failed("the stream ended without an X-Rhapsode-Duration-Ms trailer")
        if not value.isdigit():
            raise Failed(f"the trailer is {value!r}, not a whole number")
        heard = pcm_from_s16le(answer.body, *native).duration_ms
        if abs(int(value) - heard) > 1:
            raise Failed(f"the trailer says {value} ms; the stream carried {heard:.1f} ms")

    return [
        ctx.probe("a stream arrives chunked, in pieces, and ends with a last chunk", pieces),
        ctx.probe("a stream ends with its duration as a trailer", trailer),
    ]


def check_seed(ctx: Context) -> list[Result]:
    results = []
    for variant, caps in ctx.variants().items():
        name = f"a seed reproduces audio in variant {variant}"
        if not reproducible(caps):
            results.append(Result(name, Outcome.UNDECIDED, "the variant does not claim it"))
            continue

        def test(variant: str = variant) -> None:
            first, second = ctx.twice(variant, BASE_TEXT, SEED)
            if first != second:
                raise Failed("two identical seeded requests gave different audio")
            # A different seed giving the same audio is not a failure: an engine with no
            # randomness reproduces under every seed, which is all the claim says.

        results.append(ctx.probe(name, test))
    return results


def check_cues(ctx: Context) -> list[Result]:
    results = []
    for variant, caps in ctx.variants().items():
        claimed = list(caps["cues"])
        if not claimed:
            results.append(
                Result(f"claimed cues change the audio in variant {variant}", Outcome.UNDECIDED, "the variant claims none")
            )
        for cue in claimed:

            def changes(variant: str = variant, cue: str = cue) -> None:
                base = ctx.steady(variant, BASE_TEXT)
                if ctx.pcm(variant, f"Hello there [{cue}] and goodbye.", seed=SEED) == base:
                    raise Failed(f"[{cue}] left the audio byte for byte as it was without it")

            results.append(ctx.probe(f"cue [{cue}] changes the audio in variant {variant}", changes))
        unclaimed = [c for c in ALL_CUES if c not in claimed]

        def stripped(variant: str = variant) -> None:
            if not unclaimed:
                raise Undecidable("the variant claims every cue")
            base = ctx.steady(variant, BASE_TEXT)
            if ctx.pcm(variant, f"Hello there [{unclaimed[0]}] and goodbye.", seed=SEED) != base:
                raise Failed(f"the unclaimed [{unclaimed[0]}] changed the audio: it was not stripped")

        results.append(ctx.probe(f"an unclaimed cue is stripped in variant {variant}", stripped))
    return results


def check_deliveries(ctx: Context) -> list[Result]:
    results = []
    for variant, caps in ctx.variants().items():
        claimed = list(caps["deliveries"])
        if not claimed:
            results.append(
                Result(f"claimed deliveries change the audio in variant {variant}", Outcome.UNDECIDED, "the variant claims none")
            )
        for delivery in claimed:

            def changes(variant: str = variant, delivery: str = delivery) -> None:
                base = ctx.steady(variant, BASE_TEXT)
                if ctx.pcm(variant, BASE_TEXT, seed=SEED, delivery=delivery) == base:
                    raise Failed(f"delivery {delivery} left the audio byte for byte as it was without it")

            results.append(ctx.probe(f"delivery {delivery} changes the audio in variant {variant}", changes))
    return results


def check_dials(ctx: Context) -> list[Result]:
    def unknown() -> None:
        response = ctx.speak(text=BASE_TEXT, variant=ctx.default_variant(), params={"noSuchDial": 1}, stream=False)
        refused(response, 400, "bad_request", "params.noSuchDial", names="noSuchDial")

    def out_of_range() -> None:
        dialled = [(v, c["dials"]) for v, c in ctx.variants().items() if c["dials"]]
        if not dialled:
            raise Undecidable("no variant declares a dial")
        variant, dials = dialled[0]
        dial, bounds = next(iter(dials.items()))
        response = ctx.speak(
            text=BASE_TEXT, variant=variant, params={dial: bounds["max"] + 1}, stream=False
        )
        refused(response, 400, "bad_request", f"params.{dial}", names=dial)

    return [
        ctx.probe("an unknown dial is refused naming it", unknown),
        ctx.probe("a dial out of range is refused naming it", out_of_range),
    ]


def check_unknown_variant(ctx: Context) -> list[Result]:
    # A build the worker cannot load is unsupported, like a format it cannot make, and
    # the message names the variants it has.
    def speak() -> None:
        response = ctx.speak(text=BASE_TEXT, variant="no-such-variant", stream=False)
        refused(response, 422, "unsupported", "variant", names=ctx.default_variant())

    def fetch() -> None:
        response = ctx.client.post("/fetch", {"variant": "no-such-variant"})
        refused(response, 422, "unsupported", "variant", names=ctx.default_variant())

    return [
        ctx.probe("an unknown variant is unsupported, naming the variants", speak),
        ctx.probe("fetching an unknown variant is unsupported", fetch),
    ]


def check_voice_ids(ctx: Context) -> list[Result]:
    def malformed() -> None:
        for voice in ("../../x", "*", "", "a" * 65):
            response = ctx.speak(text=BASE_TEXT, voice=voice, stream=False)
            try:
                refused(response, 400, "bad_request", "voice")
            except Failed as exc:
                raise Failed(f"voice {voice!r}: {exc}") from None

    def unknown() -> None:
        voice = f"{TEST_VOICE_PREFIX}no-such-voice"
        if voice in ctx.voice_ids():
            raise Undecidable(f"the worker has a voice named {voice}")
        refused(ctx.speak(text=BASE_TEXT, voice=voice, stream=False), 404, "unknown_voice")

    def in_path() -> None:
        for path in ("/voices/..%2Fx", "/voices/..%2F..%2Fx", "/voices/%2A"):
            response = ctx.client.request("DELETE", path)
            if response.status not in (400, 404):
                raise Failed(f"DELETE {path} answered {response.describe()}; expected 400 or 404")

    return [
        ctx.probe("malformed voice ids are bad_request", malformed),
        ctx.probe("an unknown voice is unknown_voice", unknown),
        ctx.probe("a voice id in a path cannot climb out", in_path),
    ]


def check_voice_list(ctx: Context) -> list[Result]:
    listed: list[dict[str, Any]] = []

    def listing() -> None:
        response = ctx.client.get("/voices")
        if response.status != 200:
            raise Failed(f"GET /voices answered {response.describe()}")
        doc = response.json()
        conforms(contract.VOICE_LIST, doc, "/voices")
        ids = [v["id"] for v in doc]
        if len(set(ids)) != len(ids):
            raise Failed("a voice id is listed twice")
        for voice in doc:
            if voice["previewUrl"] != f"/voices/{voice['id']}/preview":
                raise Failed(f'voice {voice["id"]}: previewUrl is {voice["previewUrl"]!r}')
        listed.extend(doc)

    def preview() -> None:
        if not listed:
            raise Undecidable("no voices are listed (or the list is broken)")
        url = listed[0]["previewUrl"]
        response = ctx.client.get(url)
        if response.status != 200:
            raise Failed(f"GET {url} answered {response.describe()}")
        if response.header("content-type") != "audio/wav":
            raise Failed(f"GET {url} is {response.header('content-type')!r}, not audio/wav")
        audible(decode_wav(response.body), "the preview")

    return [
        ctx.probe("the voice list matches the contract", listing),
        ctx.probe("a voice preview is a wav that decodes", preview),
    ]


def check_language(ctx: Context) -> list[Result]:
    # Section 6: a variant that lists several languages reads the field, matching tags
    # without case as BCP 47 does; one that lists a single language ignores it.
    def several() -> tuple[str, list[str]]:
        for variant, caps in ctx.variants().items():
            if len(caps["languages"]) > 1:
                return variant, list(caps["languages"])
        raise Undecidable("no variant lists more than one language")

    def unlisted() -> None:
        variant, _ = several()
        response = ctx.speak(text=BASE_TEXT, variant=variant, language="xx-nope", stream=False)
        refused(response, 422, "unsupported", "language")

    def any_case() -> None:
        variant, languages = several()
        asked = languages[0].swapcase()
        response = ctx.speak(text=BASE_TEXT, variant=variant, language=asked, format="wav", stream=False)
        if response.status != 200:
            raise Failed(f"language {asked!r} (listed as {languages[0]!r}) answered {response.describe()}")

    def ignored() -> None:
        single = [v for v, caps in ctx.variants().items() if len(caps["languages"]) == 1]
        if not single:
            raise Undecidable("every variant lists more than one language")
        response = ctx.speak(text=BASE_TEXT, variant=single[0], language="xx-nope", format="wav", stream=False)
        if response.status != 200:
            raise Failed(f"variant {single[0]} lists one language, yet refused another: {response.describe()}")

    return [
        ctx.probe("an unlisted language is unsupported", unlisted),
        ctx.probe("a listed language is matched without case", any_case),
        ctx.probe("a variant of one language ignores the language asked for", ignored),
    ]


def check_text(ctx: Context) -> list[Result]:
    def empty() -> None:
        refused(ctx.speak(text="", stream=False), 400, "bad_request", "text")

    def nothing_to_say() -> None:
        # Control characters, zero-width and direction marks, emoji: nothing to read.
        for text in ("\x01\x02\x07", "\u200b\u200f\u2066\ufeff", "\U0001f600\U0001f389"):
            try:
                refused(ctx.speak(text=text, stream=False), 400, "bad_request", "text")
            except Failed as exc:
                raise Failed(f"text {text!r}: {exc}") from None

    def too_long() -> None:
        variant = ctx.default_variant()
        ceiling = int(ctx.variants()[variant]["maxCharacters"])
        text = ("Hello there. " * (ceiling // 13 + 2))[: ceiling + 1]
        text = text[:-1] + "x"
        response = ctx.speak(text=text, variant=variant, stream=False)
        refused(response, 400, "bad_request", "text")

    return [
        ctx.probe('empty text is refused naming "text"', empty),
        ctx.probe('text with no letter or digit is refused naming "text"', nothing_to_say),
        ctx.probe('text over maxCharacters is refused naming "text"', too_long),
    ]


def check_unknown_field(ctx: Context) -> list[Result]:
    def test() -> None:
        response = ctx.speak(text=BASE_TEXT, noSuchField=1, stream=False)
        refused(response, 400, "bad_request", "noSuchField", names="noSuchField")

    return [ctx.probe("an unknown request field is refused naming it", test)]


def check_dialogue(ctx: Context) -> list[Result]:
    results = []
    two_turns = [{"speaker": "a", "text": "Hello there."}, {"speaker": "b", "text": "Hello to you."}]
    for variant, caps in ctx.variants().items():
        dialogue = caps.get("dialogue")
        if dialogue is None:

            def undeclared(variant: str = variant) -> None:
                response = ctx.client.post("/dialogue", {"turns": two_turns, "variant": variant, "stream": False})
                refused(response, 422, "unsupported")

            results.append(ctx.probe(f"dialogue is unsupported in variant {variant}, which does not declare it", undeclared))
            continue

        def speaks(variant: str = variant) -> None:
            response = ctx.client.post(
                "/dialogue", {"turns": two_turns, "variant": variant, "format": "wav", "stream": False}
            )
            if response.status != 200:
                raise Failed(f"answered {response.describe()}")
            buffered_length(response)
            audible(decode_wav(response.body), "the dialogue")

        def crowded(variant: str = variant, most: int = int(dialogue["maxSpeakers"])) -> None:
            turns = [{"speaker": f"s{i}", "text": "Hello there."} for i in range(most + 1)]
            response = ctx.client.post("/dialogue", {"turns": turns, "variant": variant, "stream": False})
            refused(response, 422, "unsupported")

        def unused_label(variant: str = variant) -> None:
            voices = ctx.voice_ids()
            if not voices:
                raise Undecidable("no voices are listed to map a label to")
            response = ctx.client.post(
                "/dialogue",
                {"turns": two_turns, "voices": {"nobody": voices[0]}, "variant": variant, "stream": False},
            )
            refused(response, 400, "bad_request", names="nobody")

        results += [
            ctx.probe(f"dialogue of two turns speaks in variant {variant}", speaks),
            ctx.probe(f"dialogue over maxSpeakers is unsupported in variant {variant}", crowded),
            ctx.probe(f"dialogue refuses a voices label no turn uses in variant {variant}", unused_label),
        ]
    return results


def _create_voice(ctx: Context, voice_id: str, part: tuple[str, str | None, bytes]) -> Response:
    """POST /voices; a voice it creates is remembered, to be deleted however the check ends."""
    body, content_type = multipart([("id", None, voice_id.encode()), part])
    response = ctx.client.request("POST", "/voices", body, content_type)
    if 200 <= response.status < 300:
        ctx.created.add(voice_id)
    return response


def check_cloning(ctx: Context) -> list[Result]:
    cloning = [c["cloning"] for c in ctx.variants().values() if "cloning" in c]
    clones = [c for c in cloning if c["supported"]]
    voice_id = f"{TEST_VOICE_PREFIX}clone"

    def odd_type() -> None:
        if any("xyz" in c.get("formats", ()) for c in clones):
            raise Undecidable("the worker lists xyz as a reference type")
        response = _create_voice(ctx, voice_id, ("reference", "x.xyz", tiny_wav()))
        refused(response, 422, "unsupported", "reference")

    def no_cloning() -> None:
        response = _create_voice(ctx, voice_id, ("reference", "x.wav", tiny_wav()))
        refused(response, 422, "unsupported")

    if clones:
        return [ctx.probe("a clone from a reference of an unlisted type is unsupported", odd_type)]
    name = "a clone is unsupported where no variant clones"
    if len(cloning) < len(ctx.variants()):
        # Section 4: a variant without cloning has not said, so nothing is promised.
        return [Result(name, Outcome.UNDECIDED, "a variant does not say whether it clones")]
    return [ctx.probe(name, no_cloning)]


def check_blending(ctx: Context) -> list[Result]:
    # Section 4: blending absent means no, since only an adapter that says so blends.
    blends = [v for v, c in ctx.variants().items() if c.get("blending", {}).get("supported")]
    voice_id = f"{TEST_VOICE_PREFIX}blend"

    def listed_pair() -> list[str]:
        voices = ctx.voice_ids()
        if voice_id in voices:
            raise Undecidable(f"a voice {voice_id} exists already, and the checker will not replace it")
        return [v for v in voices if not v.startswith(TEST_VOICE_PREFIX)][:2]

    def round_trip() -> None:
        pair = listed_pair()
        if len(pair) < 2:
            raise Undecidable("fewer than two voices are listed to blend")
        recipe = f"{pair[0]}(1)+{pair[1]}(1)"
        response = _create_voice(ctx, voice_id, ("blend", None, recipe.encode()))
        if response.status != 201:
            raise Failed(f"creating a blend answered {response.describe()}; expected 201")
        doc = response.json()
        conforms(contract.VOICE, doc, "the created voice")
        if doc["id"] != voice_id:
            raise Failed(f"the created voice is {doc['id']!r}, not {voice_id!r}")
        if voice_id not in ctx.voice_ids():
            raise Failed("the blend is not in GET /voices")
        spoken = ctx.speak(text=BASE_TEXT, voice=voice_id, variant=blends[0], format="wav", stream=False)
        if spoken.status != 200:
            raise Failed(f"speaking with the blend answered {spoken.describe()}")
        audible(decode_wav(spoken.body), "the blend's audio")
        deleted = ctx.client.request("DELETE", f"/voices/{voice_id}")
        if deleted.status != 204 or deleted.body:
            raise Failed(f"DELETE /voices/{voice_id} answered {deleted.describe()}; expected 204, no body")
        ctx.created.discard(voice_id)
        if voice_id in ctx.voice_ids():
            raise Failed("the blend is still listed after DELETE")

    def no_blending() -> None:
        # Listed voices where there are two, so only the blending itself is refused;
        # a worker that blends nothing refuses any recipe.
        pair = listed_pair()
        if len(pair) < 2:
            pair = [f"{TEST_VOICE_PREFIX}a", f"{TEST_VOICE_PREFIX}b"]
        response = _create_voice(ctx, voice_id, ("blend", None, "+".join(pair).encode()))
        refused(response, 422, "unsupported")

    if blends:
        return [ctx.probe("a blend is created, listed, spoken and deleted", round_trip)]
    return [ctx.probe("a blend is unsupported where no variant blends", no_blending)]


_MESSAGE_STATUSES = frozenset({404, 405, 408, 413, 414, 431})


def check_error_envelopes(ctx: Context) -> list[Result]:
    def test() -> None:
        if not ctx.client.errors:
            raise Undecidable("no error responses were collected")
        for response in ctx.client.errors:
            doc = response.json()
            conforms(contract.ERROR, doc, f"the {response.status} answer to {response.label}")
            code = doc["error"]["code"]
            status, retryable, _ = ERROR_TABLE[code]
            # A refusal of the HTTP message itself (no such route, a wrong method, a head
            # or body over its limit) is bad_request under HTTP's own status for it.
            allowed = {status} | (_MESSAGE_STATUSES if code == "bad_request" else set())
            if response.status not in allowed:
                raise Failed(f"{response.label} answered {code} with {response.status}, not {status}")
            if doc["error"]["retryable"] is not retryable:
                raise Failed(f"{response.label} answered {code} with retryable {not retryable}")

    return [ctx.probe("every error carries code, message and retryable, as the table says", test)]


#: Every check, in the order they run, under the name a result takes when the check
#: cannot even begin.  The envelope check comes last: it reads the error responses every
#: other check collected.
CHECKS: tuple[tuple[str, Check], ...] = (
    ("health answers while unloaded", check_health),
    ("capabilities match the contract", check_capabilities),
    ("both licences are named", check_licences),
    ("speak loads on demand", check_load_on_demand),
    ("every declared format decodes", check_formats),
    ("a buffered wav carries Content-Length", check_buffered_wav),
    ("formats not produced are refused", check_refused_formats),
    ("a stream arrives in pieces", check_stream),
    ("a seed reproduces audio", check_seed),
    ("claimed cues change the audio", check_cues),
    ("claimed deliveries change the audio", check_deliveries),
    ("dials are checked", check_dials),
    ("an unknown variant is unsupported", check_unknown_variant),
    ("bad voice ids are refused", check_voice_ids),
    ("the voice list matches the contract", check_voice_list),
    ("languages are as declared", check_language),
    ("text is checked", check_text),
    ("an unknown request field is refused", check_unknown_field),
    ("dialogue is as declared", check_dialogue),
    ("cloning is as declared", check_cloning),
    ("blending is as declared", check_blending),
    ("every error carries code, message and retryable", check_error_envelopes),
)


# -- running -------------------------------------------------------------------------------


def _first_contact(client: Client) -> Mapping[str, Any]:
    """
    GET /health once, to learn whether anything answers and what state to restore.
    """
    client.start()
    try:
        response = client.get("/health")
    except (OSError, http.client.HTTPException, TimedOut, Failed) as exc:
        raise Unreachable(f"{client.target}: {exc}") from None
    try:
        doc = json.loads(response.body)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _restore(ctx: Context, health: Mapping[str, Any]) -> list[str]:
    """
    Delete what the checks created and put the model back as it was.
    """
    problems: list[str] = []

    def attempt(label: str, act: Callable[[], Response], expected: int = 200) -> None:
        ctx.client.start()
        try:
            response = act()
        except Exception as exc:  # cleanup reports what it could not do and goes on
            problems.append(f"{label}: {exc}")
            return
        if response.status != expected:
            problems.append(f"{label}: {response.describe()}")

    for voice in sorted(ctx.created):
        attempt(f"deleting voice {voice}", partial(ctx.client.request, "DELETE", f"/voices/{voice}"), 204)
    variant = health.get("variant")
    if health.get("model") in ("loaded", "loading") and isinstance(variant, str):
        attempt(f"reloading {variant}", lambda: ctx.client.post("/load", {"variant": variant}))
    else:
        attempt("unloading", lambda: ctx.client.post("/unload", {}))
    return problems


def _ffmpeg() -> str | None:
    """
    The ffmpeg that decodes what a worker encoded: one on PATH, else imageio-ffmpeg's.
    """
    found = shutil.which("ffmpeg")
    if found is None:
        # Imported here, so that importing the checker (for --help, say) stays light.
        import imageio_ffmpeg

        try:
            found = str(imageio_ffmpeg.get_ffmpeg_exe())
        except RuntimeError:
            return None
    return found


def run_checks(
    target: str,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    on_result: Callable[[Result], None] | None = None,
) -> Report:
    """
    Run every check against the worker at C{target}, then leave it as it was found.

    @param timeout: seconds each probe may take.
    @param on_result: called with each result as it is known.
    @raise ValueError: if C{target} is not a socket path or an http URL.
    @raise Unreachable: if nothing answers HTTP there.
    """
    parsed = parse_target(target)
    client = Client(parsed, timeout)
    health = _first_contact(client)
    ctx = Context(client, _ffmpeg())
    report = Report()
    try:
        for name, check in CHECKS:
            client.start()
            try:
                results = check(ctx)
            except Exception as exc:  # one broken check never stops the rest
                results = [result_of(name, exc)]
            for result in results:
                report.results.append(result)
                if on_result is not None:
                    on_result(result)
    finally:
        report.cleanup_problems = _restore(ctx, health)
    return report

