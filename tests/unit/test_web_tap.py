"""
`twistd rhapsode-web` and `rhapsode web`: the dropin is found, the options are
validated before anything starts, the token comes from a file or the environment, and
the service listens on the reactor it is given and closes what it opened at stop.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from twisted.internet.testing import MemoryReactorClock
from twisted.python import usage

from rhapsode._web._tap import Options, WebService, makeService, read_token


def test_the_dropin_is_found() -> None:
    """Twisted's plugin scan finds rhapsode-web, pointing at this module."""
    from twisted.application.service import IServiceMaker
    from twisted.plugin import getPlugins

    makers = {maker.tapname: maker for maker in getPlugins(IServiceMaker)}
    assert makers["rhapsode-web"].module == "rhapsode._web._tap"


def test_defaults() -> None:
    """No options: loopback 8090, the core at 127.0.0.1:8080, no token, no extra origins."""
    options = Options()
    options.parseOptions([])
    config = options["config"]
    assert (options["host"], options["port"]) == ("127.0.0.1", 8090)
    assert (config.core, config.token, tuple(config.origins)) == ("http://127.0.0.1:8080", None, ())


@pytest.mark.parametrize(
    "argv",
    [
        ["--core", "ftp://x"],
        ["--core", "http://127.0.0.1:8080/api"],
        ["--port", "0"],
        ["--port", "70000"],
        ["--allow-origin", "box.lan"],
        ["--allow-origin", "http://box.lan/path"],
        ["--max-body", "0"],
        ["--token-file", "/nonexistent/token"],
    ],
)
def test_bad_options_are_refused(argv: list[str]) -> None:
    """Each bad value is a usage error naming it, before any service exists."""
    with pytest.raises(usage.UsageError):
        Options().parseOptions(argv)


def test_allowed_origins_and_the_token_file(tmp_path: Path) -> None:
    """--allow-origin repeats; --token-file's first line is the token."""
    token = tmp_path / "token"
    token.write_text("  abc123 \nignored\n")
    options = Options()
    options.parseOptions(["--allow-origin", "http://box.lan:8090", "--allow-origin", "https://tv.lan",
                          "--token-file", str(token)])
    assert tuple(options["config"].origins) == ("http://box.lan:8090", "https://tv.lan")
    assert options["config"].token == "abc123"


def test_the_token_from_the_environment_and_limits(tmp_path: Path) -> None:
    """Without a file the environment's token is used; an empty or huge file is refused."""
    assert read_token(None, {"RHAPSODE_MANAGEMENT_TOKEN": "t"}) == "t"
    assert read_token(None, {}) is None
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(usage.UsageError):
        read_token(str(empty), {})
    huge = tmp_path / "huge"
    huge.write_bytes(b"x" * 5000)
    with pytest.raises(usage.UsageError):
        read_token(str(huge), {})


def test_the_service_listens_on_its_reactor_and_stops_listening() -> None:
    """The service listens on the given reactor's address and port; stopping stops it."""
    options = Options()
    options.parseOptions(["--port", "18123"])
    assert isinstance(makeService(options), WebService)
    reactor = MemoryReactorClock()
    service = WebService(options["config"], "127.0.0.1", 18123, reactor=reactor)
    service.startService()
    [(port, _factory, _backlog, interface)] = reactor.tcpServers
    assert (port, interface) == (18123, "127.0.0.1")
    stopped = service.stopService()
    assert stopped.called
    assert not reactor.getDelayedCalls()


def test_a_port_that_cannot_be_bound_stops_the_run() -> None:
    """
    A port in use is recorded (so `rhapsode web` exits 1 naming it) and stops the
    reactor as soon as it runs, rather than leaving a process that serves nothing.
    """
    from twisted.internet.error import CannotListenError

    class Busy(MemoryReactorClock):
        def listenTCP(self, *args: object, **kwargs: object) -> object:
            raise CannotListenError("127.0.0.1", 8090, OSError(98, "Address already in use"))

    reactor = Busy()
    options = Options()
    options.parseOptions([])
    service = WebService(options["config"], "127.0.0.1", 8090, reactor=reactor)
    service.startService()
    assert "Address already in use" in service.failed_to_start.getErrorMessage()
    [(hook, _, _)] = reactor.whenRunningHooks
    assert hook == reactor.stop


def test_the_timeouts_and_the_connection_cap() -> None:
    """
    The core's head and idle timeouts (10 s, 60 s) and a connection cap are the
    defaults; each can be set, and a value that is not positive is refused.
    """
    options = Options()
    options.parseOptions([])
    config = options["config"]
    assert (config.head_timeout, config.idle_timeout, config.max_connections) == (10.0, 60.0, 256)
    options = Options()
    options.parseOptions(["--head-timeout", "5", "--idle-timeout", "20.5", "--max-connections", "8"])
    config = options["config"]
    assert (config.head_timeout, config.idle_timeout, config.max_connections) == (5.0, 20.5, 8)
    for bad in (["--head-timeout", "0"], ["--idle-timeout", "-1"], ["--max-connections", "0"]):
        with pytest.raises(usage.UsageError):
            Options().parseOptions(bad)
