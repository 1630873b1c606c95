"""
What happens to a request before any handler runs (protocol.md sections 7 and 10).

As soon as a request's headers are in, and before its body is read: the management guard
runs for management routes, C{Authorization} is removed so no handler or log ever sees
it, and a voice upload starts streaming to its worker as it arrives, so a clip costs the
core neither memory nor disk.  Refusals at this point are written straight to the
connection, which is then closed: the body they refuse is never read.
"""

from __future__ import annotations

import json
import re
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IConsumer
from twisted.web import server
from twisted.web.iweb import UNKNOWN_LENGTH, IBodyProducer
from zope.interface import implementer

from rhapsode_worker.errors import BadRequest, SpeechError, as_speech_error
from rhapsode_worker.site import DirectSite, EagerRequest

from ._guard import check_management

#: A voice upload above this is refused (protocol.md section 7): generous for any clip.
MAX_UPLOAD_BYTES = 25 * 1000 * 1000
#: Bytes an upload may hold while its worker starts, before the client is paused.
_EARLY_BUFFER = 256 * 1024

_VOICES = re.compile(rb"^/engines/([^/]+)/voices$")
_VOICE = re.compile(rb"^/engines/([^/]+)/voices/([^/]+)$")
_UNLOAD = re.compile(rb"^/engines/([^/]+)/unload$")


def is_management(method: bytes, path: bytes) -> bool:
    """
    The management routes that exist so far: creating and deleting voices, and giving a
    model's memory back.
    """
    if method == b"POST":
        return bool(_VOICES.match(path) or _UNLOAD.match(path))
    return method == b"DELETE" and bool(_VOICE.match(path))


@implementer(IBodyProducer)
class Upload:
    """
    A client's request body, produced into the worker's request as it arrives.

    The client's connection is this producer's source: when the worker's socket is full
    the client is paused, so the core never holds more than a socket's worth.
    """

    def __init__(self, request: "CoreRequest", length: int | None, limit: int) -> None:
        self._request = request
        self.length: Any = UNKNOWN_LENGTH if length is None else length
        self._limit = limit
        self.received = 0
        self._early: list[bytes] = []
        self._early_size = 0
        self._consumer: IConsumer | None = None
        self._complete = False
        self._done: Deferred[None] | None = None
        self.failed: SpeechError | None = None

    def chunk(self, data: bytes) -> None:
        self.received += len(data)
        if self.received > self._limit:
            self.fail(BadRequest(f"upload is over {self._limit} bytes", field="body"))
            return
        if self._consumer is not None:
            self._consumer.write(data)
            return
        self._early.append(data)
        self._early_size += len(data)
        if self._early_size > _EARLY_BUFFER:
            self._request.channel.pauseProducing()

    def input_complete(self) -> None:
        self._complete = True
        if self._done is not None and not self._done.called:
            self._done.callback(None)

    def fail(self, error: SpeechError) -> None:
        if self.failed is None:
            self.failed = error
            if self._done is not None and not self._done.called:
                self._done.errback(error)

    # IBodyProducer, driven by the worker's connection

    def startProducing(self, consumer: IConsumer) -> "Deferred[None]":
        self._consumer = consumer
        self._done = Deferred()
        early, self._early = self._early, []
        for data in early:
            consumer.write(data)
        if self._early_size > _EARLY_BUFFER:
            self._request.channel.resumeProducing()
        self._early_size = 0
        if self.failed is not None:
            self._done.errback(self.failed)
        elif self._complete:
            self._done.callback(None)
        return self._done

    def pauseProducing(self) -> None:
        channel = getattr(self._request, "channel", None)
        if channel is not None:
            channel.pauseProducing()

    def resumeProducing(self) -> None:
        channel = getattr(self._request, "channel", None)
        if channel is not None:
            channel.resumeProducing()

    def stopProducing(self) -> None:
        self.fail(BadRequest("the worker stopped reading the upload", field="body"))


class CoreRequest(EagerRequest):
    """
    A request that is guarded, stripped and (for uploads) streamed at its headers.
    """

    refused: SpeechError | None = None
    #: Set once the management guard has admitted this request.
    guarded = False
    upload: Upload | None = None
    upstream: "Deferred[Any] | None" = None

    def gotLength(self, length: int | None) -> None:
        # At the headers the request line is known only to the channel (twisted.web sets
        # the request's own method and path once the body is in, too late to refuse
        # without reading it).  Should that ever be unreadable, no request is marked
        # guarded and every management route refuses (CoreApp checks the mark).
        method = getattr(self.channel, "_command", b"") or b""
        path = (getattr(self.channel, "_path", b"") or b"").split(b"?", 1)[0]
        core = self.channel.site.core  # type: ignore[attr-defined]
        if is_management(method, path):
            try:
                check_management(
                    peer=_peer(self),
                    headers=_headers(self),
                    token=core.management_token,
                    origins=core.management_origins,
                )
            except SpeechError as error:
                self._refuse(error)
                return
            self.guarded = True
        # Gone before any handler runs, and so never logged.
        self.requestHeaders.removeHeader(b"authorization")
        match = _VOICES.match(path) if method == b"POST" else None
        if match is None:
            super().gotLength(length)
            return
        if length is not None and length > MAX_UPLOAD_BYTES:
            self._refuse(BadRequest(f"upload is over {MAX_UPLOAD_BYTES} bytes", field="body"))
            return
        super().gotLength(0)
        self.upload = Upload(self, length, MAX_UPLOAD_BYTES)
        engine_id = match.group(1).decode("utf-8", "replace")
        self.upstream = Deferred.fromCoroutine(core.start_upload(engine_id, self))
        self.upstream.addErrback(self._upstream_failed)

    def _upstream_failed(self, failure: Any) -> Any:
        # Before the body is in, nobody else can answer: refuse now (the route would
        # never run behind a paused upload).  After it, the route reports the failure.
        if self.refused is not None or getattr(self, "_received", False):
            return failure if self.refused is None else None
        error = as_speech_error(failure.value)
        if self.upload is not None:
            self.upload.fail(error)
        self._refuse(error)
        return None

    def handleContentChunk(self, data: bytes) -> None:
        if self.refused is not None:
            return
        if self.upload is None:
            super().handleContentChunk(data)
            return
        self.upload.chunk(data)
        if self.upload.failed is not None:
            error = self.upload.failed
            if self.upstream is not None and not self.upstream.called:
                self.upstream.cancel()
            self._refuse(error)

    def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:
        if self.refused is not None:
            return
        if self.upload is not None:
            self._received = True
            self.upload.input_complete()
        super().requestReceived(command, path, version)

    def _refuse(self, error: SpeechError) -> None:
        if self.refused is not None:
            return
        self.refused = error
        body = json.dumps(error.envelope()).encode()
        reason = {400: b"Bad Request", 403: b"Forbidden", 404: b"Not Found"}.get(error.status, b"Error")
        transport = self.channel.transport
        assert transport is not None  # the request is being received on it
        transport.write(
            b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (error.status, reason, len(body), body)
        )
        transport.loseConnection()


def _peer(request: server.Request) -> str | None:
    transport = request.channel.transport
    assert transport is not None  # the request is being received on it
    address = transport.getPeer()
    return getattr(address, "host", None)


def _headers(request: server.Request) -> dict[str, list[str]]:
    return {
        name.decode("latin-1").lower(): [v.decode("latin-1") for v in values]
        for name, values in request.requestHeaders.getAllRawHeaders()
    }


class CoreSite(DirectSite):
    """
    A site whose requests can reach the core before their handlers run.  C{direct}
    routes skip Klein and C{access_log} is as for L{DirectSite}.

    Its requests are L{CoreRequest}s: guarded, stripped and streamed at their headers as
    above.
    """

    requestFactory = CoreRequest

    def __init__(
        self,
        resource: Any,
        core: Any,
        direct: dict[tuple[bytes, bytes], Any] | None = None,
        access_log: bool = True,
        reactor: Any = None,
    ) -> None:
        super().__init__(resource, direct, access_log, reactor=reactor)
        self.core = core
        self.displayTracebacks = False

