"""
The seams of the core, as zope.interface interfaces, in one module that imports no other
part of the core: every wing implements or receives these, never another wing's class
where a seam stands.  The composition root (L{rhapsode._service.build_core}) wires the
objects that provide them; each test fake of one is checked with C{verifyObject}.

Threading: every method here is called on the reactor thread and answers at once or with
an awaitable; none blocks.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Coroutine, Mapping, Sequence

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IPushProducer
from zope.interface import Attribute, Interface

from rhapsode_protocol.errors import SpeechError

__all__ = [
    "IAdmissionSettings",
    "IAudioSink",
    "IClientSettings",
    "IPublicRoutes",
    "IResidencyObserver",
    "IResidencySettings",
    "ISpeech",
    "ISupervisor",
    "ITimedSink",
    "IWorkerClient",
    "Prepared",
    "Utterance",
]


# -- the fleet's seams ---------------------------------------------------------------------


class IWorkerClient(Interface):
    """
    Requests to one worker over kept-alive connections (a Unix socket or a URL).
    """

    address = Attribute("Where the worker listens: unix:/path or http(s)://host:port.")

    def request(
        method: bytes, path: str, body: Any = None, headers: Mapping[bytes, list[bytes]] | None = None
    ) -> "Deferred[Any]":
        """
        Send a request; fires with the response (an C{IResponse}-like object with C{code},
        C{headers} and C{deliverBody}) once its head has arrived.  Cancelling it before
        then abandons the request.  A worker that cannot be reached fails it with
        C{ModelUnavailable}.
        """

    def json(method: bytes, path: str, body: Any = None) -> "Coroutine[Any, Any, tuple[int, Any]]":
        """
        A small JSON exchange: the status and the decoded body (None for none).
        """

    def abort_all() -> None:
        """
        Drop every connection to the worker now; what is in flight on them fails.
        """

    def close() -> "Deferred[Any]":
        """
        Close the idle connections; fires once they have closed.
        """


class ISupervisor(Interface):
    """
    One local worker's process: started on demand, watched, restarted after a crash.
    """

    listeners = Attribute("Callables told each line the worker writes on stderr.")
    state = Attribute("The process's state: down, starting, up, draining, failed, ...")
    pid = Attribute("The process id while a process runs, else None.")

    def start() -> "Deferred[str]":
        """
        Fires with the worker's address once its process is up (spawning it when it
        is down).
        """

    def stop(ask: bool = True) -> "Deferred[None]":
        """
        End the process: the verb first when C{ask}, then a signal, then SIGKILL.
        """

    def health() -> dict[str, Any]:
        """
        The process half of the engine's state: process, restarts, lastError, ...
        """

    def hung(why: str) -> None:
        """
        The watchdog found the worker unresponsive: end it so it is started afresh.
        """


class IResidencySettings(Interface):
    """
    The residency settings, asked for each time one is used (a settings API may change
    them live).  Every method answers at once and never blocks.
    """

    def max_resident_models() -> int:
        """
        How many models may be resident at once (1 or more).
        """

    def eviction_wait_seconds() -> float:
        """
        How long an acquire waits for a leased model to let go before it fails.
        """

    def keep_alive_seconds() -> int:
        """
        The server's keep-alive: seconds an idle model stays, -1 for no deadline.
        """

    def engine_keep_alive_seconds(engine: str) -> int | None:
        """
        The engine's own keep-alive, or C{None} where it has none of its own.
        """


class IResidencyObserver(Interface):
    """
    Told of what happens to models, as it happens (the core's metrics).
    """

    def load_started(engine: str, variant: str) -> None:
        """
        A model was admitted to load (a new one, or a worker switching variant).
        """

    def load_finished(engine: str, variant: str, seconds: float) -> None:
        """
        Its worker first answered in it, C{seconds} after its admission.
        """

    def evicted(engine: str, reason: str) -> None:
        """
        A model left: C{room}, C{expired}, C{unload} or C{crash}.
        """


# -- speech's seams ------------------------------------------------------------------------


class IAdmissionSettings(Interface):
    """
    The limits on speech, asked for each time one is used (a settings API may change
    them live).  Every method answers at once.
    """

    def concurrent_per_engine(engine: str) -> int:
        """
        How many requests may speak on C{engine} at once.
        """

    def queued_per_engine(engine: str) -> int:
        """
        How many may wait for a turn on C{engine} behind those.
        """

    def queue_wait_seconds() -> float:
        """
        How long a request may wait for its turn.
        """

    def buffered_bytes() -> int:
        """
        How much buffered audio the core may hold for all answers together.
        """


class IClientSettings(Interface):
    """
    What the operator set for other people's clients, asked for each time it is used (a
    settings API may change it live).  Every method answers at once.
    """

    def voice_aliases() -> Mapping[str, tuple[str, str]]:
        """
        Each voice alias (C{voices.aliases}): the name a client may send, to the engine
        and the voice id it means.
        """

    def openai_sample_rate(engine: str) -> int | None:
        """
        The sample rate the OpenAI shim asks C{engine} for when a request names none
        (C{engines.<id>.openaiSampleRate}); None for the engine's own.
        """


class IAudioSink(Interface):
    """
    Where one utterance's answer goes, whichever door it came in by: an HTTP response,
    server-sent events, WebSocket messages, or memory (MCP, the batch).  The relay
    writes every answer through this and through nothing else.

    The order is L{begin}, then L{write}s (with a producer registered while the worker's
    body streams), then L{end} when the answer is whole or L{abort} when it cannot be.
    A failure before L{started} is true is the door's to answer in its own envelope; once
    it is true, only L{abort} can say it.
    """

    finished = Attribute(
        "A Deferred that fires when whoever reads the answer is done with it, and fails "
        "when they went away first: the relay stops the worker then, and a buffered "
        "answer's bytes stay counted against the core's budget until it fires."
    )
    started = Attribute("Whether anything of the answer has gone out.")

    def begin(code: int, headers: Sequence[tuple[bytes, bytes]]) -> None:
        """
        The answer's status and headers (Content-Type, Content-Length, ...), before any
        of its bytes.
        """

    def write(data: bytes) -> None:
        """
        The next bytes of audio.
        """

    def room() -> "Deferred[None]":
        """
        Fires once the sink's reader has taken what was written so far, so that more
        may be written without the core holding it twice: a buffered answer is written
        a piece at a time on it (what a socket holds unsent is a second copy).  At once
        for a sink that holds nothing of its own; it never fails.
        """

    def registerProducer(producer: IPushProducer) -> None:
        """
        The relay, as the producer this sink pauses when its reader falls behind.
        """

    def unregisterProducer() -> None:
        """
        The producer is done: nothing more will be written through it.
        """

    def end(duration_ms: int | None) -> None:
        """
        The answer is whole; C{duration_ms} is its length where known (HTTP sends it
        as a trailer).
        """

    def gathered() -> "AbstractContextManager[None]":
        """
        A context, entered for one turn of the loop (what one read of the worker's
        brings), in which what is written leaves together at its end: a connection's
        one send for the last audio and the answer's end, where it was two.  A sink
        with nothing to gather gives one that does nothing.
        """

    def abort(error: SpeechError | None) -> "Deferred[None]":
        """
        The answer cannot be whole: cut it off, so that its reader can never take it for
        a clean end (an event stream, which can say so, ends with an error event).
        Fires once the cut has landed (a connection aborted is gone), when the door may
        look at its request again; it never fails.
        """


class ITimedSink(IAudioSink):
    """
    A sink that can carry an utterance's timings (protocol.md section 4, "timestamps")
    beside its audio: server-sent events, a JSON document, WebSocket messages, memory.
    The relay sends timings only to one; a door whose answer has no place for them
    (raw audio, OpenAI's shapes) never asks for them.

    Timings come between L{begin} and L{end}, each batch before the audio holding the
    first sample of each of its entries, and the sink keeps that order.
    """

    def timestamps(alignment: Sequence[Mapping[str, Any]]) -> None:
        """
        The next entries of the answer's alignment (the contract's Timing shape), in
        order; seconds from the start of this answer's audio.
        """


@dataclass(frozen=True)
class Utterance:
    """
    One request to speak, whichever door it came by: its engine, its body (a checked
    C{/speak} or dialogue body), and the route it is measured under.

    @ivar dialogue: whether C{body} is a dialogue's (turns) rather than a speech's.
    @ivar route: the metrics route (speak, dialogue, openai, batch, mcp, stream).
    """

    engine_id: str
    body: Mapping[str, Any]
    dialogue: bool = False
    route: str = "speak"


@dataclass(frozen=True)
class Prepared:
    """
    An utterance checked as far as it can be before it takes a turn: its engine's
    capabilities, the effective variant (section 4's rule) and the body forwarded to the
    worker (cues stripped, deliveries dropped, the variant named).
    """

    utterance: Utterance
    capabilities: Mapping[str, Any]
    variant: str
    forwarded: dict[str, Any] = field(default_factory=dict)


class ISpeech(Interface):
    """
    One utterance from a checked body to the client, whichever door it came in by: the
    effective variant, every check that can refuse before a lease, a turn on the engine,
    a lease on its model, the worker's audio relayed to a sink, and the request measured.
    """

    def prepare(utterance: Utterance) -> "Awaitable[Prepared]":
        """
        Everything before the turn: the variant resolved, the body forwarded, the voices
        it names checked where finding out at the worker would first cost a load.

        @raise SpeechError: the utterance is refused (unknown engine, voice, dial, ...).
        """

    def speak(sink: IAudioSink, utterance: Utterance) -> "Awaitable[None]":
        """
        Prepare C{utterance} and speak it into C{sink}.  A refusal before the sink has
        started is raised for the door to answer; one after it aborts the sink.
        """

    def forwarded(
        sink: IAudioSink, engine_id: str, body: Mapping[str, Any], dialogue: bool, keep_alive: int | None
    ) -> "Awaitable[None]":
        """
        Speak a body another core has already checked and forwarded (a cluster's front,
        to one of its nodes) into C{sink}: a worker request, its variant named.  Only
        what the front could not know is checked here: the voices it names, where
        finding out at the worker would first cost a load.
        """

    def preview(sink: IAudioSink, engine_id: str, voice_id: str) -> "Awaitable[None]":
        """
        A voice's preview, which speaks (so takes a turn and a lease), buffered.
        """

    def resident(engine_id: str) -> str | None:
        """
        The variant of C{engine_id}'s model that is resident now, if one is.
        """


class IPublicRoutes(Interface):
    """
    The public routes' reads, as data rather than HTTP answers: what MCP's tools and the
    OpenAI discovery routes serve, from the same code as C{GET /engines} and friends.
    """

    def engines() -> list[dict[str, Any]]:
        """
        Every engine as C{GET /engines} lists it, from the core's own state.
        """

    def capabilities(engine_id: str) -> "Awaitable[tuple[int, Any]]":
        """
        C{GET /engines/{id}/capabilities}: the worker's status and document.
        """

    def voices(engine_id: str) -> "Awaitable[tuple[int, Any]]":
        """
        C{GET /engines/{id}/voices}: the worker's status and list, each voice with its
        C{previewUrl}.
        """


#: What the site calls to start a voice upload's worker request at its head.
StartUpload = Callable[[str, Any], Coroutine[Any, Any, Any]]
