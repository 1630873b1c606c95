"""
The core's metrics, for C{GET /metrics} in Prometheus's text format.

Counters and histograms are recorded as speech happens (L{Metrics.begin} gives each
speech request a L{Measured} to fill in); what is a state rather than an event (queue
depth, models resident and their bytes, workers and their restarts) is read at scrape
time from the core's own structures by a collector, so nothing is updated per event that
only a scrape reads.  The families are this core's own (nothing global), rendered on
the reactor thread: the collector reads reactor-owned state.
The text is written by L{rhapsode._speech.exposition}, the core's own writer, which
escapes each series' labels once rather than at every scrape (prometheus_client's
generate_latest took 12-38 ms a scrape of 1,200-1,900 series; bench/metrics.py).

Every label value is bounded: a route from a fixed set, an engine id from the registry
(a request naming an engine the registry lacks is counted under C{"-"}), an outcome from
the taxonomy's codes plus C{ok}, C{aborted} and C{cancelled}.
"""

from __future__ import annotations

from typing import Any, Iterator

from twisted.internet.interfaces import IReactorTime
from zope.interface import implementer

from rhapsode_protocol.errors import ERROR_TABLE
from rhapsode_protocol.http.answers import InFlight

from .._fleet.cluster import ClusterView
from .._fleet.registry import Registry
from .._fleet.residency import Residency
from .._interfaces import IResidencyObserver
from .exposition import CounterFamily, Family, GaugeFamily, HistogramFamily, render
from .limits import Turnstile

__all__ = ["CONTENT_TYPE", "Measured", "Metrics", "ROUTES"]

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
#: The speech routes a request is counted under.
ROUTES = frozenset({"speak", "dialogue", "preview", "openai", "stream", "mcp", "batch"})
#: An engine the registry does not have (the request was refused as unknown_engine).
UNKNOWN = "-"
_OUTCOMES = frozenset(ERROR_TABLE) | {"ok", "aborted", "cancelled"}
# Buckets are few on purpose: each is a series per engine, and a scrape's cost is its
# series (bench/metrics.py).
#: Seconds to first audio: the first chunk of a fast engine to a cold start.
_FIRST = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: Seconds for a whole answer, a sentence to a chapter.
_WHOLE = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
#: Seconds for a model's load, small ONNX to large torch models.
_LOAD = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
#: Audio seconds per wall second: under 1 is slower than real time.
_RATIO = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0)


class Measured:
    """
    One speech request as it goes: when it began, when its first audio went out, how
    many bytes and how much audio it carried.  L{end} records it once.
    """

    __slots__ = ("_metrics", "route", "engine", "started", "first", "sent", "audio_ms", "_ended")

    def __init__(self, metrics: "Metrics", route: str, engine: str, started: float) -> None:
        self._metrics = metrics
        self.route = route
        self.engine = engine
        self.started = started
        self.first: float | None = None
        self.sent = 0
        self.audio_ms: int | None = None
        self._ended = False

    def first_audio(self) -> None:
        if self.first is None:
            self.first = self._metrics.clock.seconds()

    def end(self, outcome: str) -> None:
        if self._ended:
            return
        self._ended = True
        self._metrics._record(self, outcome if outcome in _OUTCOMES else "internal")


@implementer(IResidencyObserver)
class Metrics:
    """
    The metrics of one core; its clock times requests, and what is a state is read at
    scrape time from the registry, the residency, the turnstile and the requests in flight.
    """

    def __init__(
        self,
        clock: IReactorTime,
        engines: Registry,
        residency: Residency,
        turnstile: Turnstile,
        requests: InFlight,
        cluster: ClusterView | None = None,
    ) -> None:
        self.engines = engines
        self.clock = clock
        self.requests = CounterFamily(
            "rhapsode_requests", "Speech requests answered, by route, engine and outcome (ok or the error code).",
            ["route", "engine", "code"])
        self.sent = CounterFamily(
            "rhapsode_audio_bytes", "Audio bytes sent to clients, by route and engine.", ["route", "engine"])
        self.first_audio = HistogramFamily(
            "rhapsode_time_to_first_audio_seconds", "From a speech request's arrival to its first audio byte.",
            ["engine"], buckets=_FIRST)
        self.duration = HistogramFamily(
            "rhapsode_request_duration_seconds", "A speech request's whole time, by engine.",
            ["engine"], buckets=_WHOLE)
        self.realtime = HistogramFamily(
            "rhapsode_realtime_factor", "Audio seconds per wall second of a whole answer (over 1 is faster "
            "than real time), where the audio's length is known.", ["engine"], buckets=_RATIO)
        self.loads = CounterFamily("rhapsode_model_loads", "Models admitted to load, by engine.", ["engine"])
        self.load_time = HistogramFamily(
            "rhapsode_model_load_seconds", "From a model's admission to its worker's first answer in it.",
            ["engine"], buckets=_LOAD)
        self.evictions = CounterFamily(
            "rhapsode_model_evictions", "Models that left the card, by engine and why (room, expired, unload, crash).",
            ["engine", "reason"])
        self.jobs = CounterFamily(
            "rhapsode_install_jobs", "Install, reinstall and pull jobs finished, by kind, engine and outcome.",
            ["kind", "engine", "outcome"])
        self._events: tuple[Family, ...] = (
            self.requests, self.sent, self.first_audio, self.duration, self.realtime, self.loads, self.load_time,
            self.evictions, self.jobs,
        )
        self._state = _StateCollector(self.engines, residency, turnstile, requests, cluster)

    def engine_label(self, engine_id: str) -> str:
        return engine_id if engine_id in self.engines else UNKNOWN

    def begin(self, route: str, engine_id: str) -> Measured:
        """
        Start measuring one speech request on C{route} for C{engine_id}.
        """
        return Measured(self, route if route in ROUTES else "speak", self.engine_label(engine_id), self.clock.seconds())

    def _record(self, measured: Measured, outcome: str) -> None:
        engine, route = measured.engine, measured.route
        now = self.clock.seconds()
        self.requests.labels(route, engine, outcome).inc()
        if measured.sent:
            self.sent.labels(route, engine).inc(measured.sent)
        if outcome != "ok":
            return
        elapsed = now - measured.started
        self.duration.observe((engine,), elapsed)
        if measured.first is not None:
            self.first_audio.observe((engine,), measured.first - measured.started)
        if measured.audio_ms and elapsed > 0:
            self.realtime.observe((engine,), measured.audio_ms / 1000 / elapsed)

    # -- residency, as it happens (rhapsode._fleet.residency's observer) ------------------------

    def load_started(self, engine: str, variant: str) -> None:
        self.loads.labels(self.engine_label(engine)).inc()

    def load_finished(self, engine: str, variant: str, seconds: float) -> None:
        self.load_time.observe((self.engine_label(engine),), seconds)

    def evicted(self, engine: str, reason: str) -> None:
        self.evictions.labels(self.engine_label(engine), reason).inc()

    def job_finished(self, job: Any) -> None:
        # A job's engine is a catalog id, checked before the job existed: bounded.
        self.jobs.labels(job.kind, job.engine, job.state).inc()

    def render(self) -> bytes:
        """
        Every series now, in the text format.
        """
        return render((*self._events, *self._state.collect()))


class _StateCollector:
    """
    What is a state rather than an event, read from the core at scrape time.
    """

    def __init__(
        self,
        engines: Registry,
        residency: Residency,
        turnstile: Turnstile,
        requests: InFlight,
        cluster: ClusterView | None = None,
    ) -> None:
        self._engines = engines
        self._residency = residency
        self._turnstile = turnstile
        self._requests = requests
        self._cluster = cluster

    def collect(self) -> Iterator[Family]:
        speaking = GaugeFamily("rhapsode_requests_speaking", "Speech requests holding a turn, by engine.", ["engine"])
        queued = GaugeFamily("rhapsode_requests_queued", "Speech requests waiting for a turn, by engine.", ["engine"])
        up = GaugeFamily("rhapsode_worker_up", "1 where the engine's worker process is up.", ["engine", "state"])
        restarts = CounterFamily("rhapsode_worker_restarts", "Worker restarts after a crash, by engine.", ["engine"])
        turnstile = self._turnstile
        for handle in self._engines:
            line = turnstile.state(handle.id)
            speaking.set([handle.id], line["speaking"])
            queued.set([handle.id], line["queued"])
            health = handle.health()
            state = str(health.get("process", "remote"))
            up.set([handle.id, state], 1.0 if state == "up" else 0.0)
            restarts.set([handle.id], float(health.get("restarts", 0)))
        resident = GaugeFamily("rhapsode_model_resident", "1 for each model resident now.", ["engine", "variant", "loaded"])
        size = GaugeFamily("rhapsode_model_bytes", "What a resident model's load cost, where measured.", ["engine", "variant"])
        leases = GaugeFamily("rhapsode_model_leases", "Requests holding a resident model.", ["engine"])
        for handle in self._engines:
            model = self._residency.state(handle.id)
            if not model["resident"]:
                continue
            resident.set([handle.id, model["variant"], "true" if model["loaded"] else "false"], 1.0)
            leases.set([handle.id], float(model["leases"]))
            if model.get("sizeBytes") is not None:
                size.set([handle.id, model["variant"]], float(model["sizeBytes"]))
        in_flight = GaugeFamily("rhapsode_requests_in_flight", "Requests being answered, every route.")
        in_flight.set((), float(self._requests.count))
        yield from (speaking, queued, up, restarts, resident, size, leases, in_flight)
        if self._cluster is not None and self._cluster.urls:
            yield from self._nodes(self._cluster)

    def _nodes(self, cluster: ClusterView) -> Iterator[Family]:
        # At a cluster's front: each node as it last said (names are the directory's).
        answering = GaugeFamily("rhapsode_cluster_node_up", "1 where a cluster node answered its last ask.", ["node"])
        resident = GaugeFamily("rhapsode_cluster_model_resident", "1 for each model resident on a node.", ["node", "engine", "variant"])
        leases = GaugeFamily("rhapsode_cluster_model_leases", "Requests holding a model, by node.", ["node", "engine", "variant"])
        for node in cluster.summaries():
            answering.set([node["node"]], 1.0 if node["answering"] else 0.0)
        for model in cluster.models():
            labels = [model["node"], model["engine"], model["variant"]]
            resident.set(labels, 1.0)
            leases.set(labels, float(model.get("leases", 0)))
        yield from (answering, resident, leases)
