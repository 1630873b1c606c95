"""
The core's metrics (GET /metrics): speech requests counted by route, engine and
outcome with bounded labels, time to first audio, total time, realtime factor and bytes;
loads and evictions as residency sees them; queues, resident models and workers read at
scrape time; and who may scrape.  Driven through the real router and site in memory
(rhapsode.testing) with fake engines on a clock.
"""

from __future__ import annotations

import json
from typing import Any, Coroutine

from prometheus_client.parser import text_string_to_metric_families
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.trial.unittest import SynchronousTestCase

from rhapsode._fleet.registry import EngineHandle, Registry
from rhapsode._service import build_core
from rhapsode.client import Overloaded, TruncatedResponse, UnknownEngine
from rhapsode.testing import FakeEngine, StubRhapsode

from _fakes import FakeClient, FakeSupervisor

CASE = SynchronousTestCase()
PIECE = b"\x01\x00" * 2400  # 0.1 s of 24 kHz 16-bit mono


def result(coroutine: Coroutine[Any, Any, Any]) -> Any:
    return CASE.successResultOf(Deferred.fromCoroutine(coroutine))


def refused(coroutine: Coroutine[Any, Any, Any], kind: type[BaseException]) -> Any:
    return CASE.failureResultOf(Deferred.fromCoroutine(coroutine), kind).value


def scrape(stub: StubRhapsode) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """
    Every sample of GET /metrics, by name and sorted labels.
    """
    response = CASE.successResultOf(stub.http.get(stub.base_url + "/metrics"))
    stub.flush()
    assert response.code == 200
    assert response.headers.getRawHeaders(b"content-type")[0].startswith(b"text/plain; version=0.0.4")
    body = CASE.successResultOf(response.text())
    samples = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_a_streamed_speech_is_counted_timed_and_measured() -> None:
    """
    A streamed /speak that ends whole counts once as ok under its route and engine,
    with its bytes, one time-to-first-audio and total-time observation taken on the
    clock, and a realtime factor from the worker's duration over the wall time.
    """
    engine = FakeEngine(audio=[PIECE, PIECE], chunk_interval=0.05, duration_ms=200)
    stub = StubRhapsode({"tone": engine})
    pieces: list[bytes] = []
    done = Deferred.fromCoroutine(stub.client().speak_to(pieces.append, "tone", "Hello there."))
    stub.flush()
    stub.advance(0.05)  # the second piece, 50 ms after the first
    CASE.successResultOf(done)
    samples = scrape(stub)
    assert value(samples, "rhapsode_requests_total", route="speak", engine="tone", code="ok") == 1
    assert value(samples, "rhapsode_audio_bytes_total", route="speak", engine="tone") == 2 * len(PIECE)
    assert value(samples, "rhapsode_time_to_first_audio_seconds_count", engine="tone") == 1
    first = value(samples, "rhapsode_time_to_first_audio_seconds_sum", engine="tone")
    whole = value(samples, "rhapsode_request_duration_seconds_sum", engine="tone")
    assert first < whole and 0.045 <= whole <= 0.055
    assert value(samples, "rhapsode_realtime_factor_count", engine="tone") == 1
    assert 3.6 <= value(samples, "rhapsode_realtime_factor_sum", engine="tone") <= 4.4  # 0.2 s of audio in 0.05 s
    stub.close()


def test_refusals_count_under_their_code_and_an_unknown_engine_under_a_fixed_label() -> None:
    """
    An overloaded refusal counts under its code; a request for an engine the registry
    lacks counts under engine "-", never under the name the client sent; an aborted
    stream counts as aborted.  No timing is observed for any of them.
    """
    engine = FakeEngine(audio=[PIECE, PIECE])
    stub = StubRhapsode({"tone": engine})
    client = stub.client()
    engine.fail_next(Overloaded("busy"))
    done = Deferred.fromCoroutine(client.speak("tone", "Hello."))
    stub.flush()
    CASE.failureResultOf(done, Overloaded)
    done = Deferred.fromCoroutine(client.speak('x"} evil{', "Hello."))
    stub.flush()
    CASE.failureResultOf(done, UnknownEngine)
    engine.cut_next(after=len(PIECE) + 10)
    done = Deferred.fromCoroutine(client.speak_to(lambda _: None, "tone", "Hello."))
    stub.flush()
    CASE.failureResultOf(done, TruncatedResponse)
    samples = scrape(stub)
    assert value(samples, "rhapsode_requests_total", route="speak", engine="tone", code="overloaded") == 1
    assert value(samples, "rhapsode_requests_total", route="speak", engine="-", code="unknown_engine") == 1
    assert value(samples, "rhapsode_requests_total", route="speak", engine="tone", code="aborted") == 1
    assert all("evil" not in str(labels) for _, labels in samples)
    assert value(samples, "rhapsode_request_duration_seconds_count", engine="tone") == 0
    stub.close()


def test_loads_evictions_and_state_are_as_residency_sees_them() -> None:
    """
    With room for one model, speaking on one engine then another counts two loads and
    one eviction for room; the state read at scrape time names the one resident model,
    each engine's queue, and its worker.
    """
    stub = StubRhapsode({"tone": FakeEngine(audio=[PIECE]), "bell": FakeEngine(audio=[PIECE])})
    client = stub.client()
    for engine in ("tone", "bell"):
        done = Deferred.fromCoroutine(client.speak(engine, "Hello."))
        stub.flush()
        CASE.successResultOf(done)
    samples = scrape(stub)
    assert value(samples, "rhapsode_model_loads_total", engine="tone") == 1
    assert value(samples, "rhapsode_model_loads_total", engine="bell") == 1
    assert value(samples, "rhapsode_model_load_seconds_count", engine="bell") == 1
    assert value(samples, "rhapsode_model_evictions_total", engine="tone", reason="room") == 1
    assert value(samples, "rhapsode_model_resident", engine="bell", variant="default", loaded="true") == 1
    assert ("rhapsode_model_resident", (("engine", "tone"), ("loaded", "true"), ("variant", "default"))) not in samples
    assert value(samples, "rhapsode_requests_queued", engine="tone") == 0
    assert ("rhapsode_requests_speaking", (("engine", "bell"),)) in samples
    assert ("rhapsode_worker_restarts_total", (("engine", "tone"),)) in samples
    stub.close()


def connect(public: bool, peer: str) -> tuple[Any, StringTransport]:
    handle = EngineHandle("tone", FakeClient(fallback=lambda method, path: (200, {"deleted": path})), FakeSupervisor("up", 1))
    app = build_core(Registry({"tone": handle}), reactor=MemoryReactorClock(), metrics_public=public)
    channel = app.site().buildProtocol(IPv4Address("TCP", "127.0.0.1", 8080))
    transport = StringTransport(peerAddress=IPv4Address("TCP", peer, 40000))
    channel.makeConnection(transport)
    channel.dataReceived(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    return channel, transport


def test_who_may_scrape_is_a_setting() -> None:
    """
    By default /metrics answers whom the management routes answer: a remote caller is
    refused at the head, a loopback one served; with metrics.public anybody is served.
    """
    _, remote = connect(public=False, peer="203.0.113.9")
    head, _, body = remote.value().partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 403") and json.loads(body)["error"]["code"] == "forbidden"
    _, local = connect(public=False, peer="127.0.0.1")
    assert local.value().startswith(b"HTTP/1.1 200")
    _, public = connect(public=True, peer="203.0.113.9")
    assert public.value().startswith(b"HTTP/1.1 200") and b"rhapsode_worker_up" in public.value()


def test_install_jobs_are_counted_by_kind_engine_and_outcome() -> None:
    """
    Each install, reinstall or pull job that ends is counted under its kind, its engine
    and whether it succeeded or failed.
    """
    from rhapsode_protocol.errors import Internal

    stub = StubRhapsode({"tone": FakeEngine(audio=[PIECE])})
    jobs = stub.core.jobs

    async def works(context: Any) -> None:
        context.step("weights")

    async def fails(context: Any) -> None:
        context.step("weights")
        raise Internal("the download stopped")

    jobs.submit("tone", "pull", works, variant="default")
    jobs.submit("tone", "pull", fails, variant="default")
    jobs.submit("tone", "pull", works, variant="default")
    stub.flush()
    samples = scrape(stub)
    assert value(samples, "rhapsode_install_jobs_total", kind="pull", engine="tone", outcome="succeeded") == 2
    assert value(samples, "rhapsode_install_jobs_total", kind="pull", engine="tone", outcome="failed") == 1
    stub.close()
