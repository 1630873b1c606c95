"""
The worker's own lifecycle (serving -> draining -> stopped) on fakes: what a drain
waits for and in which order, refusals while draining, and that a second drain and a
shutdown trigger change nothing.  Steps are recorded into a list and asserted.
"""

from __future__ import annotations

from typing import Any

import pytest
from treq.testing import StubTreq
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IListeningPort
from twisted.internet.testing import MemoryReactorClock
from zope.interface import implementer
from zope.interface.verify import verifyObject

from rhapsode_protocol.errors import Overloaded
from rhapsode_worker._lifecycle import WorkerLifecycle


@implementer(IListeningPort)
class FakePort:
    """
    A listening port whose stop is recorded and finishes when the test says.
    """

    def __init__(self, steps: list[str]) -> None:
        self.steps = steps
        self.stopped: Deferred[None] = Deferred()

    def startListening(self) -> None:
        pass

    def stopListening(self) -> "Deferred[None]":
        self.steps.append("stop listening")
        return self.stopped

    def getHost(self) -> Any:
        return None


class Harness:
    """
    A lifecycle whose scheduler and connections are Deferreds the test fires.
    """

    def __init__(self) -> None:
        self.steps: list[str] = []
        self.idle: Deferred[None] = Deferred()
        self.closed: Deferred[None] = Deferred()
        self.port = FakePort(self.steps)
        self.lifecycle = WorkerLifecycle(idle=self._idle, close_connections=self._close)
        self.lifecycle.listening(self.port)

    def _idle(self) -> "Deferred[None]":
        self.steps.append("scheduler idle?")
        return self.idle

    def _close(self) -> "Deferred[None]":
        self.steps.append("close connections")
        return self.closed


def test_the_fake_port_is_a_listening_port() -> None:
    """
    The fake the drain stops provides IListeningPort, as the runtime's real one does.
    """
    assert verifyObject(IListeningPort, FakePort([]))


def test_a_drain_waits_for_requests_then_scheduler_then_port_then_connections() -> None:
    """
    Draining with two requests in flight waits for both to leave, then for the
    scheduler, then stops the port, then closes the connections, and only then is
    stopped; /health's draining is true from the first moment.
    """
    h = Harness()
    lifecycle = h.lifecycle
    lifecycle.admit()
    lifecycle.admit()
    stopped = lifecycle.when_stopped()
    assert (lifecycle.state, lifecycle.in_flight, lifecycle.draining) == ("serving", 2, False)

    lifecycle.drain()
    assert (lifecycle.state, lifecycle.draining) == ("draining", True)
    lifecycle.leave()
    assert h.steps == [] and lifecycle.in_flight == 1
    lifecycle.leave()
    assert h.steps == ["scheduler idle?"]
    h.idle.callback(None)
    assert h.steps == ["scheduler idle?", "stop listening"]
    h.port.stopped.callback(None)
    assert h.steps == ["scheduler idle?", "stop listening", "close connections"]
    assert not stopped.called and lifecycle.state == "draining"
    h.closed.callback(None)
    assert stopped.called and lifecycle.state == "stopped"


def test_requests_are_refused_as_overloaded_once_draining() -> None:
    """
    From the drain on, admit raises Overloaded (429, retryable) and counts nothing,
    until and after the worker has stopped.
    """
    h = Harness()
    lifecycle = h.lifecycle
    lifecycle.admit()
    lifecycle.drain()
    with pytest.raises(Overloaded) as refused:
        lifecycle.admit()
    assert refused.value.status == 429 and refused.value.retryable
    assert lifecycle.in_flight == 1
    lifecycle.leave()
    with pytest.raises(Overloaded):
        lifecycle.admit()
    h.idle.callback(None)
    h.port.stopped.callback(None)
    h.closed.callback(None)
    assert lifecycle.state == "stopped"
    with pytest.raises(Overloaded):
        lifecycle.admit()


def test_a_second_drain_is_harmless_and_stopped_fires_once() -> None:
    """
    A second SIGTERM, a /terminate after one, or the reactor's shutdown trigger during a
    drain starts no second wind-down; every waiter hears "stopped" exactly once, and
    one asking afterwards is answered at once.
    """
    h = Harness()
    lifecycle = h.lifecycle
    heard: list[str] = []
    lifecycle.when_stopped().addCallback(lambda _: heard.append("first"))
    lifecycle.drain()
    lifecycle.drain()
    on_shutdown = lifecycle.stop()
    assert h.steps == ["scheduler idle?"]
    h.idle.callback(None)
    h.port.stopped.callback(None)
    lifecycle.drain()
    h.closed.callback(None)
    assert h.steps == ["scheduler idle?", "stop listening", "close connections"]
    assert heard == ["first"] and on_shutdown.called
    lifecycle.drain()
    assert lifecycle.stop().called and lifecycle.when_stopped().called
    assert h.steps == ["scheduler idle?", "stop listening", "close connections"]


def test_an_idle_worker_winds_down_at_once() -> None:
    """
    With nothing in flight and everything already quiet, a drain reaches stopped within
    the call, each step in order.
    """
    steps: list[str] = []
    port = FakePort(steps)
    port.stopped.callback(None)
    lifecycle = WorkerLifecycle(
        idle=lambda: succeed(None),
        close_connections=lambda: steps.append("close connections") or succeed(None),
    )
    lifecycle.listening(port)
    lifecycle.drain()
    assert steps == ["stop listening", "close connections"]
    assert lifecycle.state == "stopped"


def test_a_failed_step_still_stops_the_worker() -> None:
    """
    A step of the wind-down that fails is logged and the worker stops anyway: a worker
    that cannot close a port must not live on refusing everything.
    """
    from twisted.logger import capturedLogs

    h = Harness()
    stopped = h.lifecycle.when_stopped()
    h.lifecycle.drain()
    with capturedLogs() as events:
        h.idle.errback(RuntimeError("scheduler exploded"))
    assert stopped.called and h.lifecycle.state == "stopped"
    assert h.steps == ["scheduler idle?"]
    assert any("draining failed" in e["log_format"] for e in events)


def test_the_routes_ask_the_lifecycle_and_health_reports_it() -> None:
    """
    WorkerApp counts each request through its lifecycle and answers 429 once it drains,
    with /health (never refused) saying draining: true.
    """
    from twisted.trial.unittest import SynchronousTestCase

    from rhapsode_worker import Engine, License, NativeFormat, SpeakRequest, Variant
    from rhapsode_worker._model import ModelState
    from rhapsode_worker._routes import WorkerApp
    from rhapsode_worker._schedule import Scheduler

    class Quiet(Engine):
        id = "quiet"
        display_name = "Quiet"
        license = License(code="MIT", weights="MIT", weights_commercial_use=True)
        native_format = NativeFormat(sample_rate=16000)
        default_variant = "only"

        def variants(self) -> dict[str, Variant]:
            return {"only": Variant(languages=("en",))}

        def speak(self, request: SpeakRequest) -> Any:
            yield b""

    from _worker_fakes import MemoryWorkerReactor, SynchronousPool

    engine = Quiet()
    reactor = MemoryWorkerReactor()
    pool = SynchronousPool(reactor)
    model = ModelState(engine, reactor, pool)
    scheduler = Scheduler(reactor, pool, model)
    h = Harness()
    app = WorkerApp(
        engine,
        reactor=reactor,
        scheduler=scheduler,
        model=model,
        formats=("wav",),
        ffmpeg=None,
        contract_version=1,
        on_terminate=h.lifecycle.drain,
        blocking=lambda f, *a, **k: succeed(f(*a, **k)),
        lifecycle=h.lifecycle,
    )
    stub = StubTreq(app.app.resource())
    case = SynchronousTestCase()

    def get(method: str, path: str) -> int:
        response = case.successResultOf(stub.request(method, "http://worker" + path))
        case.successResultOf(stub.content(response))
        return int(response.code)

    assert get("GET", "/voices") == 200
    assert h.lifecycle.in_flight == 0 and h.lifecycle.state == "serving"
    h.lifecycle.drain()
    assert get("GET", "/voices") == 429
    response = case.successResultOf(stub.get("http://worker/health"))
    assert response.code == 200
    assert case.successResultOf(stub.json_content(response))["draining"] is True
