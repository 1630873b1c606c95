"""
A client of Rhapsode's public API (protocol.md sections 4, 6, 7 and 9) for Twisted
programs, on treq.

Every answer but a 2xx raises the taxonomy's exception, rebuilt from the error envelope,
so a caller branches on C{.retryable} and C{.field} rather than on a status.  Answers are
handed back as the server gave them: fields this client does not know are the caller's
to ignore (section 9).  Bodies are read with C{deliverBody} and accepted only when the
server ended them properly, so a stream the server aborted after its headers raises
L{TruncatedResponse} and never comes back short.
"""

from __future__ import annotations

import json
import secrets
import typing
from dataclasses import dataclass
from typing import Any, Callable, Union, cast
from urllib.parse import quote

from treq.client import HTTPClient
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IConsumer, IPushProducer
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import Agent, HTTPConnectionPool, ResponseDone
from twisted.web.iweb import IResponse

from rhapsode_protocol.errors import Internal, SpeechError, error_from_envelope

_DURATION_HEADER = b"X-Rhapsode-Duration-Ms"

#: Where C{speak_to} writes audio: an C{IConsumer}, which also gets the connection as
#: its streaming producer, or a callable given each piece.
AudioSink = Union[IConsumer, Callable[[bytes], object]]


class _HTTP(typing.Protocol):
    """
    What the client needs of treq: C{treq.client.HTTPClient}, or C{StubTreq} in tests.
    """

    def request(self, method: str, url: str, **kwargs: Any) -> "Deferred[IResponse]": ...


@dataclass(frozen=True)
class Audio:
    """
    A buffered answer of /speak or dialogue.

    @ivar content_type: the response's Content-Type, which is authoritative over the
        format asked for.
    @ivar duration_ms: the X-Rhapsode-Duration-Ms header; None where the server sent none.
    """

    content_type: str
    data: bytes
    duration_ms: int | None


class NotRhapsode(Internal):
    """
    What answered is not a Rhapsode server: a refusal without the error envelope every
    Rhapsode answer carries, or a body that is not JSON where JSON was due (another
    program on the port, or a wrong address).

    @ivar url: the address asked.
    @ivar seen: what it answered, in words.
    """

    def __init__(self, url: str, seen: str) -> None:
        super().__init__(f"what answers at {url} is not Rhapsode ({seen})")
        self.url = url
        self.seen = seen


class TruncatedResponse(Exception):
    """
    The server began an answer and did not finish it: for audio, a failure after the
    headers, which the server can only report by aborting (section 6).  Ask for
    C{stream: false} (L{RhapsodeClient.speak}) for a failure with a reason.

    @ivar received: the bytes that arrived before the body ended.
    """

    def __init__(self, received: int, reason: Failure) -> None:
        super().__init__(
            f"the response ended after {received} bytes without finishing: "
            f"{reason.getErrorMessage()}"
        )
        self.received = received


class _Body(Protocol):
    """
    Hands each piece of a response body to C{sink}; C{done} fires with the byte count
    when the server ended the body properly, and fails otherwise.

    With a C{consumer}, the connection is registered as its streaming producer for the
    body's length, so a slow consumer pauses the socket instead of filling memory.
    """

    def __init__(self, sink: Callable[[bytes], object], consumer: IConsumer | None) -> None:
        self._sink = sink
        self._consumer = consumer
        self._error: BaseException | None = None
        self.received = 0
        self.done: Deferred[int] = Deferred()

    def connectionMade(self) -> None:
        if self._consumer is not None:
            # A treq body's transport is the connection: a push producer.
            self._consumer.registerProducer(cast(IPushProducer, self.transport), True)

    def dataReceived(self, data: bytes) -> None:
        if self._error is not None:
            return
        self.received += len(data)
        try:
            self._sink(data)
        except Exception as exc:
            # The caller's sink failed: stop reading, and report its exception rather
            # than the connection that stopping it closed.
            self._error = exc
            self.transport.stopProducing()  # type: ignore[union-attr]

    def connectionLost(self, reason: Failure = Failure(ResponseDone())) -> None:
        if self._consumer is not None:
            self._consumer.unregisterProducer()
        if self._error is not None:
            self.done.errback(Failure(self._error))
        elif reason.check(ResponseDone):
            self.done.callback(self.received)
        else:
            self.done.errback(TruncatedResponse(self.received, reason))


async def _read(response: IResponse) -> bytes:
    pieces: list[bytes] = []
    await _deliver(response, pieces.append, None)
    return b"".join(pieces)


def _deliver(
    response: IResponse, sink: Callable[[bytes], object], consumer: IConsumer | None
) -> "Deferred[int]":
    body = _Body(sink, consumer)
    response.deliverBody(body)
    return body.done


def _header(response: IResponse, name: bytes) -> str | None:
    values = response.headers.getRawHeaders(name)
    return values[0].decode("latin-1") if values else None


def _speech(fields: dict[str, Any], stream: bool) -> dict[str, Any]:
    if "stream" in fields:
        raise TypeError("stream is chosen by the method: speak buffers, speak_to streams")
    return {**fields, "stream": stream}


def _form_quote(value: str) -> str:
    # The HTML form encoding of a name in Content-Disposition: a quote or a line break
    # would end the header.
    return value.replace('"', "%22").replace("\r", "%0D").replace("\n", "%0A")


def _multipart(fields: list[tuple[str, str | tuple[str, bytes]]]) -> tuple[bytes, bytes]:
    """
    A multipart/form-data body and its Content-Type, built whole: StubTreq cannot send
    treq's C{files}, and a reference is at most 25 MB the caller already holds.
    """
    parts: list[tuple[bytes, bytes]] = []
    for name, value in fields:
        if isinstance(value, tuple):
            filename, data = value
            head = (
                f'Content-Disposition: form-data; name="{name}"; '
                f'filename="{_form_quote(filename)}"\r\n'
                "Content-Type: application/octet-stream\r\n\r\n"
            )
        else:
            head = f'Content-Disposition: form-data; name="{name}"\r\n\r\n'
            data = value.encode("utf-8")
        parts.append((head.encode("utf-8"), data))
    boundary = secrets.token_hex(16).encode("ascii")
    while any(boundary in data for _, data in parts):
        boundary = secrets.token_hex(16).encode("ascii")
    # Joined piece by piece: %-formatting a clip into the body would copy it twice.
    pieces: list[bytes] = []
    for part_head, part_data in parts:
        pieces += (b"--", boundary, b"\r\n", part_head, part_data, b"\r\n")
    pieces += (b"--", boundary, b"--\r\n")
    return b"".join(pieces), b"multipart/form-data; boundary=" + boundary


def _segment(value: str) -> str:
    return quote(value, safe="")


class RhapsodeClient:
    """
    The public API of the Rhapsode server at C{base_url}, e.g. C{http://127.0.0.1:8080}.

    @param http: the treq client to send with; by default one over a persistent
        connection pool on C{reactor} (the global one if None), which L{close} closes.
    @param token: the management token, sent as C{Authorization: Bearer} on every request.
        Only management routes read it, and the server strips it before any handler.
    """

    def __init__(
        self,
        base_url: str,
        *,
        http: _HTTP | None = None,
        reactor: Any = None,
        token: str | None = None,
    ) -> None:
        self._base = base_url.rstrip("/")
        self._headers: dict[bytes, list[bytes]] = {}
        if token is not None:
            self._headers[b"Authorization"] = [b"Bearer " + token.encode("utf-8")]
        self._pool: Any = None
        if http is None:
            if reactor is None:
                from twisted.internet import reactor as global_reactor

                reactor = global_reactor
            self._pool = HTTPConnectionPool(reactor, persistent=True)
            # treq's request(method, url, **kwargs) is what _HTTP describes.
            http = cast(_HTTP, HTTPClient(Agent(reactor, pool=self._pool)))
        self._http: _HTTP = http

    async def close(self) -> None:
        """
        Close the connections this client opened; a client given C{http} owns none.
        """
        if self._pool is not None:
            await self._pool.closeCachedConnections()

    # -- the exchange ----------------------------------------------------------------

    async def _send(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        form: tuple[bytes, bytes] | None = None,
        headers: dict[str, str] | None = None,
    ) -> IResponse:
        """
        Send a request and return the response once its headers are in, its body unread;
        anything but a 2xx raises the envelope's exception.
        """
        sent = dict(self._headers)
        for name, value in (headers or {}).items():
            sent[name.encode("latin-1")] = [value.encode("latin-1")]
        kwargs: dict[str, Any] = {}
        if body is not None:
            kwargs["json"] = body
        elif form is not None:
            kwargs["data"], content_type = form
            sent[b"Content-Type"] = [content_type]
        response = await self._http.request(
            method, self._base + path, headers=sent, unbuffered=True, **kwargs
        )
        if not 200 <= response.code < 300:
            raise await self._refusal(response, method, path)
        return response

    async def _refusal(self, response: IResponse, method: str = "", path: str = "") -> SpeechError:
        raw = await _read(response)
        try:
            envelope = json.loads(raw)
        except ValueError:
            envelope = None
        if not (isinstance(envelope, dict) and isinstance(envelope.get("error"), dict)
                and "code" in envelope["error"]):
            # Rhapsode answers every refusal in its envelope: whatever answered is not it.
            return NotRhapsode(self._base, f"{method} {path} answered HTTP {response.code} without its error envelope")
        return error_from_envelope(envelope, response.code)

    async def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        response = await self._send(method, path, **kwargs)
        raw = await _read(response)
        try:
            return json.loads(raw)
        except ValueError:
            raise NotRhapsode(self._base, f"{method} {path} answered HTTP {response.code} with something that is not JSON") from None

    async def _audio(self, path: str, body: dict[str, Any]) -> Audio:
        response = await self._send("POST", path, body=body)
        data = await _read(response)
        duration = _header(response, _DURATION_HEADER)
        return Audio(
            content_type=_header(response, b"Content-Type") or "application/octet-stream",
            data=data,
            duration_ms=int(duration) if duration and duration.isdigit() else None,
        )

    # -- reading ---------------------------------------------------------------------

    async def engines(self) -> list[dict[str, Any]]:
        """GET /engines: every configured engine's summary."""
        engines: list[dict[str, Any]] = await self._json("GET", "/engines")
        return engines

    async def health(self) -> dict[str, Any]:
        """GET /health: the server's version, contract and each engine's state."""
        health: dict[str, Any] = await self._json("GET", "/health")
        return health

    async def capabilities(self, engine: str) -> dict[str, Any]:
        """GET /engines/{engine}/capabilities."""
        caps: dict[str, Any] = await self._json(
            "GET", f"/engines/{_segment(engine)}/capabilities"
        )
        return caps

    async def voices(self, engine: str) -> list[dict[str, Any]]:
        """GET /engines/{engine}/voices."""
        voices: list[dict[str, Any]] = await self._json(
            "GET", f"/engines/{_segment(engine)}/voices"
        )
        return voices

    async def catalog(self) -> list[dict[str, Any]]:
        """GET /catalog: every engine that exists, installed or not, with both licences."""
        entries: list[dict[str, Any]] = await self._json("GET", "/catalog")
        return entries

    async def residency(self) -> dict[str, Any]:
        """GET /residency: the models loaded now, the next to be evicted first."""
        residency: dict[str, Any] = await self._json("GET", "/residency")
        return residency

    async def unload(self, engine: str, mode: str | None = None) -> dict[str, Any]:
        """
        POST /engines/{engine}/unload, a management route: end the engine's worker, or
        with C{mode="unload"} free its model and keep the process.

        @return: the engine's summary afterwards.
        """
        query = f"?mode={quote(mode, safe='')}" if mode is not None else ""
        summary: dict[str, Any] = await self._json(
            "POST", f"/engines/{_segment(engine)}/unload{query}"
        )
        return summary

    # -- speaking --------------------------------------------------------------------

    async def speak(self, engine: str, text: str, **fields: Any) -> Audio:
        """
        POST /speak with C{stream: false}: the whole audio, with its duration.

        @param fields: the other request fields, as the API spells them (C{voice},
            C{format}, C{params}, C{keepAliveSeconds}, ...).
        """
        body = _speech({**fields, "engine": engine, "text": text}, False)
        return await self._audio("/speak", body)

    async def speak_to(self, sink: AudioSink, engine: str, text: str, **fields: Any) -> int:
        """
        POST /speak streamed: write each piece of audio to C{sink} as it arrives.

        @param sink: an C{IConsumer}, which gets the connection as its streaming producer
            while the body lasts, or a callable given each piece.
        @return: the number of bytes written, once the server has ended the stream.
        @raise TruncatedResponse: if the stream was aborted; the bytes already written
            are the caller's to discard.
        """
        consumer: IConsumer | None = None
        write: Callable[[bytes], object]
        if IConsumer.providedBy(sink):
            consumer = sink
            write = consumer.write
        elif callable(sink):
            write = sink
        else:
            raise TypeError(f"speak_to needs an IConsumer or a callable, not {sink!r}")
        body = _speech({**fields, "engine": engine, "text": text}, True)
        response = await self._send("POST", "/speak", body=body)
        return await _deliver(response, write, consumer)

    async def dialogue(self, engine: str, turns: list[dict[str, Any]], **fields: Any) -> Audio:
        """
        POST /engines/{engine}/dialogue with C{stream: false}.

        @param turns: C{{"speaker": ..., "text": ...}} in order; C{voices} and the rest
            go in C{fields}.
        """
        return await self._audio(
            f"/engines/{_segment(engine)}/dialogue", _speech({**fields, "turns": turns}, False)
        )

    # -- voices (management routes) --------------------------------------------------

    async def create_voice(
        self,
        engine: str,
        voice_id: str,
        *,
        label: str | None = None,
        reference: tuple[str, bytes] | None = None,
        blend: str | None = None,
        transcript: str | None = None,
    ) -> dict[str, Any]:
        """
        POST /engines/{engine}/voices: a voice from C{reference}, a (filename, bytes) pair
        whose filename's extension names its type, or from a C{blend} recipe such as
        C{"af_bella(2)+af_sky(1)"}.  The server wants exactly one of them.

        @return: the new voice, as the voice list shows it.
        """
        fields: list[tuple[str, str | tuple[str, bytes]]] = [("id", voice_id)]
        for name, value in (("label", label), ("blend", blend), ("transcript", transcript)):
            if value is not None:
                fields.append((name, value))
        if reference is not None:
            fields.append(("reference", reference))
        voice: dict[str, Any] = await self._json(
            "POST", f"/engines/{_segment(engine)}/voices", form=_multipart(fields)
        )
        return voice

    async def delete_voice(self, engine: str, voice_id: str) -> None:
        """DELETE /engines/{engine}/voices/{voice}."""
        response = await self._send(
            "DELETE", f"/engines/{_segment(engine)}/voices/{_segment(voice_id)}"
        )
        await _read(response)

    # -- the update check (section 9) and the settings (section 10) -------------------

    async def update(self) -> dict[str, Any]:
        """
        GET /update: whether a newer release exists, as the server knows now; it never
        waits (a first call after the server's start reads C{check: pending}).
        """
        document: dict[str, Any] = await self._json("GET", "/update")
        return document

    async def check_update(self) -> dict[str, Any]:
        """
        POST /update/check: ask now, waiting for the answer (the server waits at most
        its check's 10 s timeout); the same document as L{update}.
        """
        document: dict[str, Any] = await self._json("POST", "/update/check")
        return document

    async def settings(self) -> dict[str, Any]:
        """
        GET /settings, a management route: C{values} in use and a C{fields} entry for
        every setting (its source, whether it applies live, any value saved for a restart).
        """
        document: dict[str, Any] = await self._json("GET", "/settings")
        return document

    async def patch_settings(self, changes: dict[str, Any]) -> dict[str, Any]:
        """
        PATCH /settings, a management route: C{changes} is any part of C{values};
        C{None} clears a setting.  Answers the whole document after the write.
        """
        document: dict[str, Any] = await self._json("PATCH", "/settings", body=changes)
        return document

    # -- installing (section 10): management routes -------------------------------------

    async def install(self, engine: str, *, pull: str | None = None, accept: str | None = None) -> dict[str, Any]:
        """
        POST /engines/{engine}/install: the job it started.  C{accept} names the weights
        licence where the catalog says they are not for commercial use; C{pull}, a
        variant to fetch once the engine is registered.
        """
        query = _query(pull=pull, accept=accept)
        job: dict[str, Any] = await self._json("POST", f"/engines/{_segment(engine)}/install{query}")
        return job

    async def reinstall(self, engine: str, *, accept: str | None = None) -> dict[str, Any]:
        """
        POST /engines/{engine}/reinstall: rebuild an engine this API installed, beside itself.
        """
        job: dict[str, Any] = await self._json("POST", f"/engines/{_segment(engine)}/reinstall{_query(accept=accept)}")
        return job

    async def reinstall_outdated(self) -> dict[str, Any]:
        """
        POST /installs/outdated: C{{"jobs": [...], "skipped": [...]}}.
        """
        answer: dict[str, Any] = await self._json("POST", "/installs/outdated")
        return answer

    async def uninstall(self, engine: str) -> None:
        """
        DELETE /engines/{engine}: stop and remove an engine this API installed.
        """
        await _read(await self._send("DELETE", f"/engines/{_segment(engine)}"))

    async def pull(self, engine: str, variant: str) -> dict[str, Any]:
        """
        POST /engines/{engine}/pull: fetch a variant's weights without loading them.
        """
        job: dict[str, Any] = await self._json("POST", f"/engines/{_segment(engine)}/pull", body={"variant": variant})
        return job

    async def jobs(self) -> list[dict[str, Any]]:
        jobs: list[dict[str, Any]] = await self._json("GET", "/installs")
        return jobs

    async def job(self, job_id: str) -> dict[str, Any]:
        job: dict[str, Any] = await self._json("GET", f"/installs/{_segment(job_id)}")
        return job

    async def follow(
        self, job_id: str, on_event: Callable[[dict[str, Any]], object], last_event_id: int | None = None
    ) -> dict[str, Any]:
        """
        Follow a job's events, each handed to C{on_event} as it arrives (a C{resync}
        as C{{"kind": "resync"}}), until the progress that ends the job; then hang up
        and answer the job as it stands.  Cancel the Deferred to stop following: the
        job goes on.
        """
        headers = {} if last_event_id is None else {"Last-Event-ID": str(last_event_id)}
        response = await self._send("GET", f"/installs/{_segment(job_id)}/events", headers=headers)
        feed = _EventFeed(on_event)
        response.deliverBody(feed)
        try:
            await feed.done
        finally:
            feed.hang_up()
        return await self.job(job_id)


def _query(**values: str | None) -> str:
    given = [(name, value) for name, value in values.items() if value is not None]
    if not given:
        return ""
    return "?" + "&".join(f"{name}={quote(value, safe='')}" for name, value in given)


class _EventFeed(Protocol):
    """
    A server-sent event stream read as it arrives: C{id:}, C{event:} and C{data:}
    lines, a blank line ending each event, comments (the heartbeat) ignored.  C{done}
    fires at the first progress that is not running, and fails if the stream ends first.
    """

    #: A frame longer than this is not one the server sends.
    MAX_FRAME = 1 << 20

    def __init__(self, on_event: Callable[[dict[str, Any]], object]) -> None:
        self._on_event = on_event
        self._buffer = b""
        self._frame: dict[str, str] = {}
        self.done: Deferred[None] = Deferred(lambda _: self.hang_up())

    def dataReceived(self, data: bytes) -> None:
        self._buffer += data
        while b"\n" in self._buffer and not self.done.called:
            line, self._buffer = self._buffer.split(b"\n", 1)
            self._line(line.rstrip(b"\r").decode("utf-8", "replace"))
        if len(self._buffer) > self.MAX_FRAME and not self.done.called:
            self.done.errback(ValueError("the event stream sent a line longer than 1 MiB"))
            self.hang_up()

    def _line(self, line: str) -> None:
        if line.startswith(":"):
            return
        if line:
            name, _, value = line.partition(":")
            self._frame[name] = value[1:] if value.startswith(" ") else value
            return
        frame, self._frame = self._frame, {}
        if "data" not in frame:
            return
        if frame.get("event") == "resync":
            self._on_event({"kind": "resync"})
            return
        event = json.loads(frame["data"])
        self._on_event(event)
        progress = event.get("progress") if event.get("kind") == "progress" else None
        if isinstance(progress, dict) and progress.get("status") != "running":
            self.done.callback(None)

    def hang_up(self) -> None:
        if self.transport is not None:
            self.transport.stopProducing()  # type: ignore[attr-defined]

    def connectionLost(self, reason: Failure = Failure(ResponseDone())) -> None:
        if not self.done.called:
            self.done.errback(TruncatedResponse(0, reason))
