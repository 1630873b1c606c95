"""
L{rhapsode.service.RhapsodeService} on a memory reactor: what it reports when it cannot
start, and whether it stops the reactor for that; what it says as it stops; and which of
Twisted's own lines its log observer (L{level_filtered}) lets through.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Callable

import pytest
from twisted.internet.defer import succeed
from twisted.internet.error import CannotListenError
from twisted.internet.protocol import Factory
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.logger import ILogObserver, Logger, LogLevel, capturedLogs, formatEvent, globalLogPublisher
from twisted.python import log as legacy_log
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.http import HTTPChannel

from rhapsode._service import ServiceStartError, level_filtered
from rhapsode.service import RhapsodeService, parse_config


class PortTaken(MemoryReactorClock):
    """
    A memory reactor on which every port is already taken.
    """

    stops = 0

    def listenTCP(self, port: int, factory: Any, backlog: int = 50, interface: str = "") -> Any:
        raise CannotListenError(interface, port, OSError(98, "Address already in use"))

    def stop(self) -> None:
        self.stops += 1
        super().stop()

    def start_running(self) -> None:
        """
        What running the reactor does first: the calls waiting for it to run.
        """
        self.running = True
        for f, args, kwargs in self.whenRunningHooks:
            f(*args, **kwargs)


def _failure_of(d: Any) -> Any:
    failures: list[Any] = []
    d.addErrback(failures.append)
    assert len(failures) == 1
    return failures[0]


@pytest.mark.parametrize("under_twistd", [False, True])
def test_a_port_taken_is_reported_and_stops_only_twistds_reactor(tmp_path: Path, under_twistd: bool) -> None:
    """
    A port that cannot be bound fails when_listening with why, before and after the
    fact, and is kept as failed_to_start; only a service made for twistd stops its
    reactor, and only once the reactor runs (twistd starts services before that).
    """
    reactor = PortTaken()
    config = parse_config({"workers": {"socketDir": "sock", "voiceDir": "voices"}}, tmp_path)
    core = RhapsodeService(config, reactor, stop_reactor_if_unable=under_twistd)
    waiting = core.when_listening()
    core.startService()
    assert _failure_of(waiting).check(ServiceStartError, CannotListenError)
    refused = _failure_of(core.when_listening())
    assert refused.check(ServiceStartError) and refused.check(CannotListenError)
    assert core.failed_to_start is not None and core.port is None
    assert reactor.stops == 0
    reactor.start_running()
    assert reactor.stops == (1 if under_twistd else 0)


def test_a_port_taken_says_so_and_by_what_without_a_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """
    A second core on a taken port logs one critical line saying the port is taken, by
    which process, and where the port is set, and no traceback.
    """
    import rhapsode._service as service_module

    monkeypatch.setattr(service_module, "listener_of", lambda port: f"pid 4321 (rhapsode serve, port {port})")
    (tmp_path / "rhapsode.json").write_text('{"server": {"port": 8080}, "workers": {"socketDir": "sock", "voiceDir": "voices"}}')
    config = parse_config({"server": {"port": 8080}, "workers": {"socketDir": "sock", "voiceDir": "voices"}}, tmp_path)
    core = RhapsodeService(config, PortTaken(), config_path=str(tmp_path / "rhapsode.json"))
    with capturedLogs() as events:
        core.startService()
    message = _failure_of(core.when_listening()).getErrorMessage()
    assert message == (
        f"port 8080 on 127.0.0.1 is taken by pid 4321 (rhapsode serve, port 8080): stop it, "
        f"or set server.port in {tmp_path / 'rhapsode.json'}"
    )
    [critical] = [e for e in events if e["log_level"] == LogLevel.critical]
    assert formatEvent(critical) == message and "log_failure" not in critical
    assert not [e for e in events if "log_failure" in e]


def test_the_process_listening_on_a_port_is_named(tmp_path: Path) -> None:
    """
    listener_of names the process holding a listening TCP port: here, this one.
    """
    import os
    import socket

    from rhapsode._ports import listener_of

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        named = listener_of(port)
    assert named is not None and named.startswith(f"pid {os.getpid()} (") and "python" in named
    assert listener_of(port) is None


def test_a_folder_that_cannot_be_made_is_reported_before_listening(tmp_path: Path) -> None:
    """
    A workers folder that cannot be made fails the start naming the key and folder,
    and nothing is listened on.
    """
    (tmp_path / "a-file").write_text("")
    reactor = MemoryReactorClock()
    config = parse_config({"workers": {"socketDir": "a-file/sock", "voiceDir": "voices"}}, tmp_path)
    core = RhapsodeService(config, reactor)
    core.startService()
    failure = _failure_of(core.when_listening())
    assert f"workers.socketDir {tmp_path / 'a-file' / 'sock'} cannot be made" in failure.getErrorMessage()
    assert reactor.tcpServers == [] and not reactor.hasStopped


class QuietFactory(Factory):
    """
    A factory of the core's own, as far as a namespace can tell.
    """


class QuietChannel(HTTPChannel):
    """
    A channel of the core's own, as far as a namespace can tell.
    """


def _logged_through(level: str, emit: Callable[[], object]) -> str:
    """
    What level_filtered(level) writes while C{emit} logs through Twisted's global
    publisher, where Twisted's own code sends its events.
    """
    stream = io.StringIO()
    observer = level_filtered(level, stream)
    globalLogPublisher.addObserver(observer)
    try:
        emit()
    finally:
        globalLogPublisher.removeObserver(observer)
    return stream.getvalue()


def _twisted_chatter() -> None:
    """
    Twisted's routine lines, most from the code that really logs them, and some of ours.
    """
    factory = QuietFactory()
    factory.doStart()
    factory.doStop()
    channel = QuietChannel()
    channel.makeConnection(StringTransport())
    channel.timeoutConnection()
    Logger(namespace="twisted.internet.base").info("Main loop terminated.")
    legacy_log.msg("QuietFactory starting on 8080")
    # What twisted.web's Site.log writes an access line to when it has no log file.
    legacy_log.logfile.write('127.0.0.1 - - [01/Jan/2026:00:00:00 +0000] "GET /health HTTP/1.1" 200 2\n')
    Logger(namespace="rhapsode._service.RhapsodeService").info("rhapsode listening on 127.0.0.1:8080")
    # Two of a worker's lines as its supervisor relays them: the worker's namespace, its text.
    worker = Logger(namespace="rhapsode_protocol.http.site.DirectSite")
    worker.info("[{engine}] {message}", engine="tone", message="Stopping factory <DirectSite object at 0x7f>")
    worker.info("[{engine}] {message}", engine="tone", message="serving tone on unix:/run/tone.sock")


def test_twisteds_routine_lines_are_dropped_at_info() -> None:
    """
    At info, Twisted's routine lines do not reach the log: a factory starting and
    stopping and a client timed out (logged under the namespace of the core's own
    subclass), the main loop ending (a twisted.* namespace) and a port opening (the
    legacy API), in the core or relayed from a worker; the core's own lines, a worker's
    and twisted.web's access lines do.
    """
    text = _logged_through("info", _twisted_chatter)
    assert "rhapsode listening on 127.0.0.1:8080" in text
    assert "[tone] serving tone on unix:/run/tone.sock" in text
    assert '"GET /health HTTP/1.1" 200' in text
    for chatter in ("Starting factory", "Stopping factory", "Timing out client", "Main loop terminated", "starting on 8080"):
        assert chatter not in text, (chatter, text)


def test_twisteds_warnings_and_errors_pass_at_info() -> None:
    """
    Twisted's warnings and errors are not quieted with its routine lines, whichever
    API logged them.
    """

    def trouble() -> None:
        Logger(namespace="twisted.web.http").warn("a warning from twisted.web")
        legacy_log.err(ValueError("boom"), "an error through the legacy API")
        Logger(namespace="rhapsode._http.site.CoreSite").error(
            "Starting factory failed: an error under a subclass's namespace"
        )

    text = _logged_through("info", trouble)
    assert "a warning from twisted.web" in text
    assert "an error through the legacy API" in text and "ValueError: boom" in text
    assert "an error under a subclass's namespace" in text


@pytest.mark.parametrize("level", ["debug", "trace"])
def test_twisteds_routine_lines_show_at_debug(level: str) -> None:
    """
    At debug and trace, where someone is looking into the core, Twisted's routine
    lines are shown like everything else.
    """
    text = _logged_through(level, _twisted_chatter)
    for chatter in ("Starting factory", "Stopping factory", "Timing out client", "Main loop terminated", "starting on 8080"):
        assert chatter in text, (chatter, text)


class Listening(MemoryReactorClock):
    """
    A memory reactor whose ports stop listening as real ones do: with a Deferred.
    """

    def listenTCP(self, port: int, factory: Any, backlog: int = 50, interface: str = "") -> Any:
        listening = super().listenTCP(port, factory, backlog, interface)
        listening.stopListening = lambda: succeed(None)
        return listening


def _stopping_with_a_request_in_flight(tmp_path: Path) -> tuple[Listening, RhapsodeService]:
    reactor = Listening()
    config = parse_config(
        {"server": {"shutdownGraceMs": 7000}, "workers": {"socketDir": "sock", "voiceDir": "voices"}}, tmp_path
    )
    core = RhapsodeService(config, reactor)
    core.startService()
    assert core.app is not None
    core.app.requests.enter()
    return reactor, core


def test_stopping_says_first_what_it_waits_for(tmp_path: Path) -> None:
    """
    The first line of a stop says what it waits for: the requests in flight, and for
    how long at most; when they outlast that, a warning says how many were cut off,
    and a last line says the core stopped.
    """
    reactor, core = _stopping_with_a_request_in_flight(tmp_path)
    with capturedLogs() as events:
        stopped = core.stopService()
        reactor.advance(6.9)
        assert not stopped.called
        reactor.advance(0.1)
    assert stopped.called
    lines = [(event["log_level"], formatEvent(event)) for event in events]
    assert lines == [
        (LogLevel.info, "shutting down: waiting up to 7 s for 1 request in flight to finish; no worker running"),
        (LogLevel.warn, "1 request still in flight after 7 s: cut off"),
        (LogLevel.info, "rhapsode stopped"),
    ]


def test_a_stop_whose_requests_finish_cuts_nothing_off(tmp_path: Path) -> None:
    """
    Requests that finish within the grace end the wait at once, with no warning.
    """
    _, core = _stopping_with_a_request_in_flight(tmp_path)
    with capturedLogs() as events:
        stopped = core.stopService()
        assert core.app is not None
        core.app.requests.leave()
    assert stopped.called
    assert [formatEvent(event) for event in events][1:] == ["rhapsode stopped"]


def test_stopping_with_nothing_to_wait_for_says_so(tmp_path: Path) -> None:
    """
    A stop with no request in flight and no worker running says that, and is done.
    """
    reactor = Listening()
    core = RhapsodeService(parse_config({"workers": {"socketDir": "sock", "voiceDir": "voices"}}, tmp_path), reactor)
    core.startService()
    with capturedLogs() as events:
        stopped = core.stopService()
    assert stopped.called
    assert [formatEvent(event) for event in events] == [
        "shutting down: no request in flight; no worker running",
        "rhapsode stopped",
    ]


def test_a_workers_own_log_leaves_twisteds_routine_lines_out_at_info() -> None:
    """
    A worker's JSON log on stderr (read by its supervisor, or by whoever runs it by
    hand) holds no "DirectSite starting on" or "Starting factory" at info, and its own
    lines; at debug it holds everything.
    """
    from rhapsode_worker._runtime import worker_observer

    def written(level: LogLevel) -> str:
        stream = io.StringIO()
        observer = worker_observer(stream, "tone", level)
        globalLogPublisher.addObserver(observer)
        try:
            _twisted_chatter()
            legacy_log.msg("DirectSite starting on '/run/tone.sock'")
            Logger(namespace="rhapsode_worker").info("serving tone on unix:/run/tone.sock")
        finally:
            globalLogPublisher.removeObserver(observer)
        return stream.getvalue()

    quiet = written(LogLevel.info)
    assert "serving tone on unix:/run/tone.sock" in quiet
    for chatter in ("Starting factory", "Stopping factory", "Main loop terminated", "starting on"):
        assert chatter not in quiet, (chatter, quiet)
    loud = written(LogLevel.debug)
    assert "DirectSite starting on" in loud and "Starting factory" in loud


def test_rhapsode_web_logs_as_the_core_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """
    Under twistd, `rhapsode web` offers its application the core's observer, so its
    log at info has no "WebSite starting on" or "Starting factory" line either.
    """
    from twisted.application.service import Application

    from rhapsode._web._site import WebConfig
    from rhapsode._web._tap import WebService

    stream = io.StringIO()
    monkeypatch.setattr("sys.stdout", stream)  # where the observer writes, as twistd's does
    application = Application("rhapsode-web")
    WebService(WebConfig(), "127.0.0.1", 8090).setServiceParent(application)
    observer = ILogObserver(application, None)  # type: ignore[misc]
    assert observer is not None
    globalLogPublisher.addObserver(observer)
    try:
        legacy_log.msg("WebSite starting on 8090")
        QuietFactory().doStart()
        Logger(namespace="rhapsode._web._tap.WebService").info("rhapsode web: open http://127.0.0.1:8090/")
    finally:
        globalLogPublisher.removeObserver(observer)
    text = stream.getvalue()
    assert "rhapsode web: open" in text and "starting on" not in text and "Starting factory" not in text


class _Abortable(StringTransport):
    """A connection that records being aborted."""

    aborted = False

    def abortConnection(self) -> None:
        self.aborted = True
        self.loseConnection()


def test_a_request_said_to_be_cut_off_is_cut_off_then(tmp_path: Path) -> None:
    """
    When the grace ends with a request in flight, the warning says it is cut off and
    its connection is aborted at that moment (its relay is cancelled, the worker's
    stream stopped), not left to stream until the workers are killed.
    """
    from twisted.internet.address import IPv4Address

    reactor, core = _stopping_with_a_request_in_flight(tmp_path)
    [(_, site, _, _)] = reactor.tcpServers
    channel = site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 50000))
    transport = _Abortable(peerAddress=IPv4Address("TCP", "127.0.0.1", 50001))
    channel.makeConnection(transport)
    with capturedLogs():
        stopped = core.stopService()
        reactor.advance(6.9)
        assert not transport.aborted
        reactor.advance(0.1)
    assert transport.aborted and stopped.called
# -- a start whose saved settings cannot apply ---------------------------------------------


def saved(tmp_path: Path, settings: dict[str, Any]) -> tuple[Path, Any]:
    """
    A config file in C{tmp_path} and a state database beside it holding C{settings},
    written straight to it, as an older server (which checked less) or a hand would.
    """
    import json

    from rhapsode._manage.state import FILE_NAME, StateStore

    path = tmp_path / "rhapsode.json"
    raw = {"workers": {"socketDir": "sock", "voiceDir": "voices"}}
    path.write_text(json.dumps(raw))
    store = StateStore.open(tmp_path / FILE_NAME)
    store.write_settings(settings)
    store.close()
    return path, parse_config(raw, tmp_path)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("server.host", "not an address"),
        ("server.host", "8.8.8.8"),
        ("management.token", "a-long-enough-token\r\nX-Injected: yes"),
    ],
)
def test_a_saved_setting_a_start_cannot_apply_is_named_with_how_to_drop_it(
    tmp_path: Path, key: str, value: Any
) -> None:
    """
    A start whose state database holds a value it cannot apply fails naming that saved
    key and the way to drop it (rhapsode serve --unset KEY), logged as one critical line
    with no traceback; nothing is listened on.
    """
    path, config = saved(tmp_path, {key: value})
    reactor = MemoryReactorClock()
    core = RhapsodeService(config, reactor, config_path=path)
    with capturedLogs() as events:
        core.startService()
    message = _failure_of(core.when_listening()).getErrorMessage()
    assert f"the setting {key} saved in" in message and f"rhapsode serve --unset {key}" in message
    assert "rhapsode settings" in message
    assert not any("log_failure" in event for event in events)
    assert [e["log_level"] for e in events if e.get("log_level", LogLevel.info) >= LogLevel.error] == [LogLevel.critical]
    assert reactor.tcpServers == []


def test_serve_unset_drops_the_saved_setting_and_starts(tmp_path: Path) -> None:
    """
    Started with unset=[KEY] (rhapsode serve --unset KEY), the service drops the saved
    setting before it reads the database, says so, and starts on the file's value.
    """
    from rhapsode._manage.state import FILE_NAME, StateStore

    path, config = saved(tmp_path, {"server.host": "not an address", "residency.keepAliveSeconds": 7})
    reactor = MemoryReactorClock()
    core = RhapsodeService(config, reactor, config_path=path, unset=["server.host"])
    with capturedLogs() as events:
        core.startService()
    assert core.failed_to_start is None and len(reactor.tcpServers) == 1
    assert reactor.tcpServers[0][3] == "127.0.0.1"
    assert any("dropped the setting" in formatEvent(e) and "server.host" in formatEvent(e) for e in events)
    store = StateStore.open(tmp_path / FILE_NAME)
    assert store.settings() == {"residency.keepAliveSeconds": 7}
    store.close()
    # The memory reactor's port stops at once and answers None, as IListeningPort allows.
    assert SynchronousTestCase().successResultOf(core.stopService()) is None


def test_a_saved_port_that_cannot_be_bound_is_named_with_how_to_drop_it(tmp_path: Path) -> None:
    """
    A saved server.port (or host) that passes its check but cannot be bound at the start
    (taken, privileged) fails the start naming the saved key and how to drop it.
    """
    path, config = saved(tmp_path, {"server.port": 8099})
    core = RhapsodeService(config, PortTaken(), config_path=path)
    core.startService()
    message = _failure_of(core.when_listening()).getErrorMessage()
    assert "cannot listen on 127.0.0.1:8099" in message and "Address already in use" in message
    assert "server.port" in message and "rhapsode serve --unset server.port" in message
