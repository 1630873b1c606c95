"""
Testing a program that uses Rhapsode, in memory: a stub core for its own trial suite, as
C{treq.testing.StubTreq} is for programs that use treq.

    engine = FakeEngine(audio=[b"\\x01" * 4800, b"\\x02" * 4800], chunk_interval=0.1)
    stub = StubRhapsode({"tone": engine})
    client = stub.client()          # a rhapsode.client.RhapsodeClient
    ...                             # the program under test uses client
    stub.advance(0.1)               # the next piece of audio arrives

The routes are the real core's: its router behind its own site (admission, the
management guard, validation, the error taxonomy, the relay that streams and aborts), on
a L{MemoryReactorClock} that is also the client's, so nothing moves but what the test
moves and no socket or process is ever opened.  Only the engine is fake: a
L{FakeEngine} plays a worker, answering with the audio, voices and capabilities the test
gave it, failing as the test told it to, and recording what the core forwarded.

What is not modelled: backpressure (the in-memory transports never pause, so a consumer
that pauses a stream is still written to), time that passes by itself (a piece of audio
paced by C{chunk_interval} arrives only when the test advances the clock) and encoding
(the fake answers the bytes it was given, whatever format was asked for).
"""

from __future__ import annotations

import copy
import json
import struct
from io import BytesIO
from typing import Any, Callable, Iterable, Mapping, Sequence, cast

from treq.client import HTTPClient
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, succeed
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IConsumer, IDelayedCall, IPushProducer, IStreamClientEndpoint
from twisted.internet.protocol import Protocol
from twisted.internet.testing import MemoryReactorClock
from twisted.python.failure import Failure
from twisted.test import iosim
from twisted.web.client import Agent, ResponseDone, ResponseFailed
from twisted.web.http import RESPONSES
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent, IAgentEndpointFactory, IBodyProducer
from zope.interface import implementer

from rhapsode_protocol import contract
from rhapsode_protocol.errors import BadRequest, SpeechError, UnknownVoice
from rhapsode_protocol.http.answers import read_form

from ._client import _HTTP, RhapsodeClient
from ._fleet.registry import EngineHandle, Registry
from ._interfaces import ISupervisor, IWorkerClient
from ._service import Core, build_core
from ._upstream import BytesProducer

__all__ = ["FakeEngine", "StubRhapsode", "default_capabilities", "fake_voice"]

#: The duration trailer and header, as a worker sends them.
_DURATION = b"X-Rhapsode-Duration-Ms"


def default_capabilities(engine_id: str = "fake") -> dict[str, Any]:
    """
    A capability document a L{FakeEngine} answers with unless given another: one
    variant, C{"default"}, that speaks English, performs the C{[laugh]} cue, has a
    C{speed} dial from 0.5 to 2, streams, reads a dialogue of two speakers and takes
    up to 4096 characters; wav and pcm at 24 kHz mono.  A fresh copy each call, for a
    test to change and hand to L{FakeEngine}.
    """
    return {
        "contract": max(contract.CONTRACT_VERSIONS),
        "engine": {"id": engine_id, "displayName": "Fake engine", "adapterVersion": "0.0.0"},
        "license": {
            "code": "MIT",
            "weights": "none",
            "weightsCommercialUse": True,
            "notes": "rhapsode.testing's fake engine: no model, no weights.",
        },
        "device": {"type": "cpu"},
        "defaultVariant": "default",
        "variants": {
            "default": {
                "cues": ["laugh"],
                "deliveries": [],
                "dials": {"speed": {"min": 0.5, "max": 2.0, "default": 1.0}},
                "languages": ["en"],
                "maxCharacters": 4096,
                "segmentation": {"supported": False},
                "streaming": {"supported": True, "granularity": "chunk"},
                "dialogue": {"maxSpeakers": 2},
                "cloning": {"supported": True, "formats": ["wav"], "referenceSeconds": [1, 30]},
                "blending": {"supported": True},
            }
        },
        "formats": ["wav", "pcm"],
        "nativeFormat": {"encoding": "pcm_s16le", "sampleRate": 24000, "channels": 1},
    }


def fake_voice(voice_id: str, label: str | None = None, *, builtin: bool = True) -> dict[str, Any]:
    """
    A voice as a worker lists it (the core rewrites its C{previewUrl} on the way out).
    """
    contract.check_voice_id(voice_id, "id")
    return {
        "id": voice_id,
        "label": label or voice_id,
        "spec": f"fake:{voice_id}",
        "tags": [],
        "previewUrl": f"/voices/{voice_id}/preview",
        "builtin": builtin,
    }


def _wav_header(native: Mapping[str, Any], data_bytes: int) -> bytes:
    rate, channels = int(native["sampleRate"]), int(native["channels"])
    return b"RIFF" + struct.pack("<I", 36 + data_bytes) + b"WAVE" + b"fmt " + struct.pack(
        "<IHHIIHH", 16, 1, channels, rate, rate * channels * 2, channels * 2, 16
    ) + b"data" + struct.pack("<I", data_bytes)


def _content_type(fmt: str, native: Mapping[str, Any]) -> bytes:
    media = contract.MEDIA_TYPES.get(fmt, "application/octet-stream")
    if fmt == "pcm":
        media += f"; rate={native['sampleRate']}; channels={native['channels']}"
    return media.encode("ascii")


def _duration_ms(fmt: str, native: Mapping[str, Any], size: int) -> int | None:
    # What a worker counts from its PCM; for a compressed format the fake has no PCM.
    per_ms = int(native["sampleRate"]) * int(native["channels"]) * 2 / 1000
    if fmt == "pcm":
        return round(size / per_ms)
    if fmt == "wav":
        return round(max(size - 44, 0) / per_ms)
    return None


class _Cut:
    """
    A failure queued on a L{FakeEngine}: the body stops after C{after} bytes.
    """

    def __init__(self, after: int) -> None:
        self.after = after


@implementer(IPushProducer)
class _Delivery:
    """
    One fake body on its way to the core's reader: the first piece at once, each next
    one C{interval} seconds later on the stub's clock (at once when it is 0), then the
    end, well (L{ResponseDone}) or badly (as a worker's connection that broke off).

    It is the reader's transport: a pause holds the pieces back, a stop gives up on them.
    """

    def __init__(
        self,
        response: "_Response",
        reader: Protocol,
        clock: MemoryReactorClock,
        pieces: Sequence[bytes],
        interval: float,
        ending: Failure,
    ) -> None:
        self._response = response
        self._reader = reader
        self._clock = clock
        self._pieces = list(pieces)
        self._interval = interval
        self._ending = ending
        self._paused = False
        self._ended = False
        self._running = False
        self._timer: IDelayedCall | None = None

    def start(self) -> None:
        self._reader.makeConnection(self)
        self._go()

    def _go(self) -> None:
        self._timer = None
        if self._running:
            return
        self._running = True
        try:
            while not (self._ended or self._paused or self._timer is not None):
                if not self._pieces:
                    self._end(self._ending)
                    return
                self._reader.dataReceived(self._pieces.pop(0))
                if self._pieces and self._interval > 0 and not self._ended:
                    self._timer = self._clock.callLater(self._interval, self._go)
        finally:
            self._running = False

    def _end(self, ending: Failure) -> None:
        if self._ended:
            return
        self._ended = True
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        if ending.check(ResponseDone):
            self._response.trailers = dict(self._response.final_trailers)
        self._reader.connectionLost(ending)

    def pauseProducing(self) -> None:
        self._paused = True

    def resumeProducing(self) -> None:
        if self._paused:
            self._paused = False
            if self._timer is None:
                self._go()

    def stopProducing(self) -> None:
        self._end(Failure(ResponseFailed([Failure(ConnectionDone("the reader stopped the body"))])))


class _Response:
    """
    A fake worker's answer once its head is in, shaped as the core's worker client's
    (L{rhapsode._upstream.WorkerResponse}): C{code}, C{headers}, C{deliverBody}, and
    C{trailers} (lower-cased names) once a chunked body has ended.
    """

    def __init__(
        self,
        clock: MemoryReactorClock,
        code: int,
        headers: Mapping[bytes, bytes],
        pieces: Sequence[bytes],
        *,
        interval: float = 0.0,
        trailers: Mapping[bytes, bytes] | None = None,
        cut_after: int | None = None,
    ) -> None:
        self.code = code
        self.phrase = RESPONSES.get(code, b"")
        self.headers = Headers({name: [value] for name, value in headers.items()})
        self.trailers: dict[bytes, bytes] = {}
        self.final_trailers = dict(trailers or {})
        self._clock = clock
        self._interval = interval
        ending = Failure(ResponseDone())
        if cut_after is not None:
            pieces = _first_bytes(pieces, cut_after)
            ending = Failure(ResponseFailed([Failure(ConnectionDone(
                f"the fake engine cut the body short after {cut_after} bytes"
            ))]))
        self._pieces = [p for p in pieces if p]
        self._ending = ending
        self._delivered = False

    def deliverBody(self, protocol: Protocol) -> None:
        if self._delivered:
            raise RuntimeError("a body is delivered once")
        self._delivered = True
        _Delivery(self, protocol, self._clock, self._pieces, self._interval, self._ending).start()


def _first_bytes(pieces: Sequence[bytes], count: int) -> list[bytes]:
    kept: list[bytes] = []
    for piece in pieces:
        if count <= 0:
            break
        kept.append(piece[:count])
        count -= len(piece)
    return kept


def _envelope(clock: MemoryReactorClock, error: SpeechError) -> _Response:
    body = json.dumps(error.envelope()).encode("utf-8")
    return _Response(clock, error.status, {b"Content-Type": b"application/json"}, [body])


@implementer(IConsumer)
class _Collector:
    """
    Where a request body the core streams to the fake (a voice upload) is gathered.
    """

    def __init__(self) -> None:
        self.pieces: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.pieces.append(data)

    def registerProducer(self, producer: Any, streaming: bool) -> None:
        pass

    def unregisterProducer(self) -> None:
        pass


@implementer(ISupervisor)
class _Process:
    """
    The fake engine's worker process as the registry sees a supervisor's: it starts at
    once and stops when residency evicts it.
    """

    def __init__(self, engine: "FakeEngine") -> None:
        self._engine = engine
        self.state = "down"
        self.pid: int | None = None
        self.restarts = 0
        self._next_pid = 4000
        #: Nothing is written on a fake's stderr; the registry's protocol asks for this.
        self.listeners: list[Callable[[str], None]] = []

    def start(self) -> "Deferred[str]":
        if self.state != "up":
            self._next_pid += 1
            self.state, self.pid = "up", self._next_pid
            self._engine.starts += 1
        return succeed("memory:")

    def stop(self, ask: bool = True) -> "Deferred[None]":
        self.state, self.pid = "down", None
        self._engine.loaded = None
        return succeed(None)

    def health(self) -> dict[str, Any]:
        return {"process": self.state, "restarts": self.restarts}

    def hung(self, why: str) -> None:
        self.stop(ask=False)


class FakeEngine:
    """
    A fake engine behind a L{StubRhapsode}, playing its worker.

    Everything a test sets here may be changed between requests: the next request
    reads it afresh.

    @ivar audio: what a speech request answers, as pieces (each piece reaches the core
        as one read), or C{None} for a quarter second of silence in the format asked
        (a WAV header before it for wav).  The bytes are answered as they are, whatever
        format was asked for, under that format's Content-Type.  Under 256 bytes in all
        is not audio to the core: it refuses a buffered answer and aborts a stream.
    @ivar chunk_interval: seconds of the stub's clock between one piece and the next;
        0 sends them all at once.
    @ivar duration_ms: the duration the worker reports; C{None} counts it from the
        bytes for pcm and wav (as a worker counts its PCM) and sends none otherwise.
    @ivar voices: the voices it lists, as L{fake_voice} makes them.
    @ivar spoken: the body of every C{/speak} the core forwarded, in order: what the
        program asked for, after the core's checks and edits (the engine and
        keep-alive gone, the variant resolved, unclaimed cues stripped).
    @ivar dialogues: the body of every C{/dialogue} the core forwarded.
    @ivar created: the fields of every voice upload the core streamed to it (C{id},
        C{label}, and C{reference} as a (filename, bytes) pair or C{blend}).
    @ivar starts: how many times the core started its worker process.
    @ivar loaded: the variant its model holds, or None.
    @ivar id: the engine id the stub knows it by (C{"fake"} until it is given to one).
    """

    def __init__(
        self,
        *,
        audio: bytes | Iterable[bytes] | None = None,
        chunk_interval: float = 0.0,
        duration_ms: int | None = None,
        voices: Iterable[str | Mapping[str, Any]] = ("alto",),
        capabilities: Mapping[str, Any] | None = None,
    ) -> None:
        self.audio: list[bytes] | None = None
        if audio is not None:
            self.audio = [audio] if isinstance(audio, bytes) else list(audio)
        self.chunk_interval = chunk_interval
        self.duration_ms = duration_ms
        self.voices: list[dict[str, Any]] = [
            fake_voice(v) if isinstance(v, str) else dict(v) for v in voices
        ]
        self.spoken: list[dict[str, Any]] = []
        self.dialogues: list[dict[str, Any]] = []
        self.created: list[dict[str, Any]] = []
        self.starts = 0
        self.loaded: str | None = None
        self.id = "fake"
        self._capabilities: dict[str, Any] | None = None
        self._failures: list[SpeechError | _Cut] = []
        self._clock = MemoryReactorClock()
        self._handle: EngineHandle | None = None
        if capabilities is not None:
            self.capabilities = capabilities

    # -- what the test sets -------------------------------------------------------------

    @property
    def capabilities(self) -> dict[str, Any]:
        """
        The capability document it answers: L{default_capabilities} under its engine id
        unless set.  Setting one checks it against the contract and makes the core ask
        again, as it would of a reinstalled worker.
        """
        if self._capabilities is not None:
            return copy.deepcopy(self._capabilities)
        return default_capabilities(self.id)

    @capabilities.setter
    def capabilities(self, given: Mapping[str, Any]) -> None:
        document = copy.deepcopy(dict(given))
        try:
            contract.validate(contract.CAPABILITIES, document)
        except SpeechError as error:
            raise ValueError(f"not a capability document: {error.message}") from None
        self._capabilities = document
        if self._handle is not None:
            self._handle.forget_capabilities()

    def fail_next(self, error: SpeechError, times: int = 1) -> None:
        """
        The next C{times} speech requests (a C{/speak}, a dialogue or a preview) that
        reach this engine are answered with C{error}'s envelope and status, as a worker
        that raised it would answer, before any audio.
        """
        self._failures.extend([error] * times)

    def cut_next(self, after: int, times: int = 1) -> None:
        """
        The next C{times} speech requests answer 200 and then stop after C{after} bytes
        of audio, as a worker that crashed mid-answer.  A streamed answer then reaches
        the client as L{rhapsode.client.TruncatedResponse} (with C{after} of at least 1:
        at 0 the core has sent no headers either, and the client sees its connection
        close unanswered); a buffered one as an C{internal} error.  The core logs
        both as failures, as a real one does, so a trial test flushes them
        (docs/testing-your-program.md, "Trial and logged errors").
        """
        self._failures.extend([_Cut(after)] * times)

    # -- playing the worker (what the core's worker client is asked) --------------------

    def _attach(self, engine_id: str, clock: MemoryReactorClock) -> EngineHandle:
        self.id = engine_id
        self._clock = clock
        self._handle = EngineHandle(engine_id, _Worker(self), _Process(self))
        return self._handle

    def _native(self) -> dict[str, Any]:
        native: dict[str, Any] = self.capabilities["nativeFormat"]
        return native

    def _speech(self, fmt: str, stream: bool, variant: str | None) -> _Response:
        failure = self._failures.pop(0) if self._failures else None
        if isinstance(failure, SpeechError):
            return _envelope(self._clock, failure)
        native = self._native()
        if self.audio is not None:
            pieces = list(self.audio)
        else:
            pcm = bytes(int(native["sampleRate"]) * int(native["channels"]) * 2 // 4)
            pieces = [_wav_header(native, len(pcm)) + pcm] if fmt == "wav" else [pcm]
        size = sum(map(len, pieces))
        duration = self.duration_ms if self.duration_ms is not None else _duration_ms(fmt, native, size)
        headers = {b"Content-Type": _content_type(fmt, native)}
        trailers: dict[bytes, bytes] = {}
        if stream:
            headers[b"Trailer"] = _DURATION
            if duration is not None:
                trailers[_DURATION.lower()] = b"%d" % duration
        else:
            headers[b"Content-Length"] = b"%d" % size
            if duration is not None:
                headers[_DURATION] = b"%d" % duration
        if variant is not None:
            self.loaded = variant
        return _Response(
            self._clock,
            200,
            headers,
            pieces,
            interval=self.chunk_interval,
            trailers=trailers,
            cut_after=failure.after if isinstance(failure, _Cut) else None,
        )

    def _voice_ids(self) -> set[str]:
        return {str(v.get("id")) for v in self.voices}

    def _speak(self, path: str, body: dict[str, Any]) -> _Response:
        if path == "/speak":
            self.spoken.append(body)
            contract.validate(contract.SPEAK_REQUEST, body)
            wanted = {"voice": body["voice"]} if "voice" in body else {}
        else:
            self.dialogues.append(body)
            contract.validate(contract.DIALOGUE_REQUEST, body)
            wanted = {f"voices.{label}": v for label, v in body.get("voices", {}).items()}
        for field, voice_id in wanted.items():
            if voice_id not in self._voice_ids():
                raise UnknownVoice(f'no voice "{voice_id}"', field=field)
        return self._speech(body.get("format", "wav"), body.get("stream", True), body.get("variant"))

    def _create(self, content_type: bytes, data: bytes) -> _Response:
        fields = read_form(content_type, BytesIO(data))
        unknown = sorted(set(fields) - {"id", "label", "reference", "blend", "transcript"})
        if unknown:
            raise BadRequest(f'unknown field "{unknown[0]}"', field=unknown[0])
        if "id" not in fields:
            raise BadRequest('"id" is required', field="id")
        if ("reference" in fields) == ("blend" in fields):
            raise BadRequest("give exactly one of reference or blend", field="reference")
        text = {name: value.decode("utf-8", "replace") for name, (_, value) in fields.items() if name != "reference"}
        voice_id = contract.check_voice_id(text["id"], "id")
        record: dict[str, Any] = dict(text)
        if "reference" in fields:
            filename, reference = fields["reference"]
            record["reference"] = (filename or "", reference)
        self.created.append(record)
        voice = fake_voice(voice_id, text.get("label"), builtin=False)
        self.voices = [v for v in self.voices if v.get("id") != voice_id] + [voice]
        return _Response(self._clock, 201, {b"Content-Type": b"application/json"}, [json.dumps(voice).encode()])

    def _health(self) -> dict[str, Any]:
        health: dict[str, Any] = {
            "process": "up",
            "model": "loaded" if self.loaded else "unloaded",
            "engine": self.id,
            "contract": max(contract.CONTRACT_VERSIONS),
            "device": "cpu",
            "draining": False,
        }
        if self.loaded:
            health["variant"] = self.loaded
        return health


@implementer(IWorkerClient)
class _Worker:
    """
    The fake engine's worker as the core's client to it sees it.
    """

    address = "memory:"

    def __init__(self, engine: FakeEngine) -> None:
        self._engine = engine

    async def json(self, method: bytes, path: str, body: Any = None) -> tuple[int, Any]:
        """
        A small JSON exchange: capabilities, voices, health, a voice deleted, unload.
        """
        engine = self._engine
        if (method, path) == (b"GET", "/capabilities"):
            return 200, engine.capabilities
        if (method, path) == (b"GET", "/voices"):
            return 200, copy.deepcopy(engine.voices)
        if (method, path) == (b"GET", "/health"):
            return 200, engine._health()
        if (method, path) == (b"POST", "/unload"):
            engine.loaded = None
            return 200, engine._health()
        if (method, path) == (b"POST", "/terminate"):
            engine.loaded = None
            return 200, {"terminating": True}
        if method == b"DELETE" and path.startswith("/voices/"):
            voice_id = path[len("/voices/"):]
            if voice_id not in engine._voice_ids():
                return 404, UnknownVoice(f'no voice "{voice_id}"', field="id").envelope()
            engine.voices = [v for v in engine.voices if v.get("id") != voice_id]
            return 204, None
        return 404, BadRequest(f"no route {path}", field="path", status=404).envelope()

    def request(
        self,
        method: bytes,
        path: str,
        body: IBodyProducer | None = None,
        headers: Mapping[bytes, list[bytes]] | None = None,
    ) -> "Deferred[_Response]":
        """
        A request whose answer may be audio: speech, a preview, a voice upload.
        """
        engine = self._engine
        clock = engine._clock
        if (method, path) == (b"POST", "/voices") and body is not None:
            collector = _Collector()
            content_type = dict(headers or {}).get(b"Content-Type", [b""])[0]
            done: Deferred[Any] = body.startProducing(collector)
            return done.addCallback(lambda _: self._answer(lambda: engine._create(content_type, b"".join(collector.pieces))))
        raw = body.data if isinstance(body, BytesProducer) else b""
        if method == b"POST" and path in ("/speak", "/dialogue"):
            return succeed(self._answer(lambda: engine._speak(path, json.loads(raw))))
        if method == b"GET" and path.startswith("/voices/") and path.endswith("/preview"):
            voice_id = path[len("/voices/"):-len("/preview")]

            def preview() -> _Response:
                if voice_id not in engine._voice_ids():
                    raise UnknownVoice(f'no voice "{voice_id}"', field="id")
                return engine._speech("wav", False, engine.loaded or engine.capabilities["defaultVariant"])

            return succeed(self._answer(preview))
        return succeed(_envelope(clock, BadRequest(f"no route {path}", field="path", status=404)))

    def _answer(self, make: Any) -> _Response:
        try:
            response: _Response = make()
        except SpeechError as error:
            return _envelope(self._engine._clock, error)
        return response

    def abort_all(self) -> None:
        """
        What the watchdog does to a hung worker's connections: nothing is open here.
        """

    def close(self) -> "Deferred[None]":
        return succeed(None)


@implementer(IPushProducer)
class _Transport(iosim.FakeTransport):
    """
    One side of an in-memory connection that, as a socket's transport does, says it is
    a push producer (twisted.web then registers its channel with it) and stops the
    producer registered with it when the connection is lost, before its protocol
    hears: that is how a core streaming an answer learns that its client hung up.
    Its pauses do nothing: iosim moves whatever has been written.
    """

    def reportDisconnect(self) -> None:
        producer, self.producer = self.producer, None
        if producer is not None:
            producer.stopProducing()
        super().reportDisconnect()


@implementer(IStreamClientEndpoint)
class _Endpoint:
    """
    Connects a client's protocol to a new connection of the core's site, in memory
    (twisted.test.iosim, as treq.testing does), pumped by the stub.
    """

    def __init__(self, stub: "StubRhapsode") -> None:
        self._stub = stub

    def connect(self, factory: Any) -> "Deferred[Any]":
        stub = self._stub
        server_address = IPv4Address("TCP", "127.0.0.1", 8080)
        client_address = IPv4Address("TCP", stub.peer, 40000 + len(stub._pumps))
        server = stub._site.buildProtocol(client_address)
        client = factory.buildProtocol(server_address)
        pump = iosim.connect(
            server,
            _Transport(server, isServer=True, hostAddress=server_address, peerAddress=client_address),
            client,
            _Transport(client, isServer=False, hostAddress=client_address, peerAddress=server_address),
            greet=False,
            clock=stub.clock,
        )
        stub._pumps.append(pump)
        stub._fresh.append(pump)
        return succeed(client)


@implementer(IAgentEndpointFactory)
class _Endpoints:
    def __init__(self, stub: "StubRhapsode") -> None:
        self._endpoint = _Endpoint(stub)

    def endpointForURI(self, uri: Any) -> _Endpoint:
        return self._endpoint


@implementer(IAgent)
class _Agent:
    """
    A real twisted.web Agent over the in-memory connections; each request is carried
    as far as it goes at once (its own connection flushed, as StubTreq does).
    """

    def __init__(self, stub: "StubRhapsode") -> None:
        self._stub = stub
        self._agent = Agent.usingEndpointFactory(stub.clock, _Endpoints(stub))

    def request(
        self, method: bytes, uri: bytes, headers: Headers | None = None, bodyProducer: IBodyProducer | None = None
    ) -> "Deferred[Any]":
        stub = self._stub
        fresh, stub._fresh = stub._fresh, []
        try:
            answer: Deferred[Any] = self._agent.request(method, uri, headers, bodyProducer)
            mine = stub._fresh
        finally:
            stub._fresh = fresh
        for pump in mine:
            pump.flush()
        stub._forget_closed()
        return answer


class StubRhapsode:
    """
    The core, in memory, over fake engines.

    @param engines: each L{FakeEngine} by the id the core knows it by, in the order
        C{GET /engines} lists them.
    @param management_token: the core's C{management.token}, if it has one.
    @param peer: the address requests come from; a loopback one (the default) may call
        the management routes without the token, as on a real core.
    @param clock: the reactor the core and its clients run on; a fresh
        L{MemoryReactorClock} by default.

    @ivar clock: that reactor: advance it (or L{advance}) to move time.
    @ivar engines: the fake engines, by id.
    @ivar core: the real core the stub serves (L{rhapsode._service.Core}: its site, its
        residency, its speech service and relay, its routes), for a test that needs them.
    @ivar base_url: the URL the clients this makes are pointed at.
    @ivar http: a treq C{HTTPClient} whose requests reach this core, for a program
        that takes one (C{RhapsodeClient(base_url, http=stub.http)}, as L{client}).
    """

    base_url = "http://127.0.0.1:8080"

    def __init__(
        self,
        engines: Mapping[str, FakeEngine],
        *,
        management_token: str | None = None,
        peer: str = "127.0.0.1",
        clock: MemoryReactorClock | None = None,
    ) -> None:
        self.clock = clock if clock is not None else MemoryReactorClock()
        self.peer = peer
        self.engines = dict(engines)
        handles = {engine_id: engine._attach(engine_id, self.clock) for engine_id, engine in self.engines.items()}
        self.core: Core = build_core(
            Registry(handles),
            reactor=self.clock,
            contract_version=max(contract.CONTRACT_VERSIONS),
            management_token=management_token,
        )
        self._site = self.core.site(access_log=False)
        self._pumps: list[Any] = []
        self._fresh: list[Any] = []
        # Bodies are written at once, not through a cooperator on the global reactor.
        self.http = HTTPClient(_Agent(self), data_to_body_producer=BytesProducer)

    def client(self, token: str | None = None) -> RhapsodeClient:
        """
        A L{RhapsodeClient} of this core, sending C{token} as the management token.
        """
        return RhapsodeClient(self.base_url, http=cast(_HTTP, self.http), token=token)

    def flush(self) -> None:
        """
        Carry every byte either side has written until nothing moves: what the core can
        answer without time passing has then been answered.
        """
        for _ in range(10_000):
            moved = False
            for pump in list(self._pumps):
                moved = pump.flush() or moved
            self._forget_closed()
            if not moved:
                return
        raise RuntimeError("the stub's connections never went quiet")

    def advance(self, seconds: float) -> None:
        """
        Move the clock on by C{seconds} (paced audio, timers), then L{flush}.
        """
        self.clock.advance(seconds)
        self.flush()

    def close(self) -> None:
        """
        Shut the core down: the connections still open are dropped (an answer still
        streaming is abandoned, as when its client hangs up) and the core's timers
        (keep-alive, stall sweeps) stopped, so a test that is done with the stub leaves
        nothing on its clock.
        """
        self.flush()
        for pump in self._pumps:
            pump.serverIO.abortConnection()
        self.flush()
        self.core.close()

    def _forget_closed(self) -> None:
        self._pumps = [p for p in self._pumps if not (p.clientIO.disconnected and p.serverIO.disconnected)]
