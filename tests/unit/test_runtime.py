"""
The worker runtime on a memory reactor: what runs inside the reactor probes nothing,
the draining SIGTERM handler is in place before the handshake is printed and only once
the reactor runs, /health names the id the worker was spawned as, the parent poll runs
on the injected reactor, and a finished drain sweeps the process group.  What the
runtime does to its own process (signals, stdout, exiting) is recorded by a fake.
"""

from __future__ import annotations

import ast
import platform
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import pytest
from _worker_fakes import MemoryWorkerReactor
from treq.testing import StubTreq
from twisted.internet.defer import Deferred
from twisted.trial.unittest import SynchronousTestCase

from rhapsode_worker import Engine, License, NativeFormat, SpeakRequest, Variant, WorkerContext, _memory, _runtime
from rhapsode_worker._runtime import Spawn, _group_members, _run

ROOT = Path(__file__).resolve().parents[2]


#: A memory reactor with the one thread-safe call a signal handler uses.
Reactor = MemoryWorkerReactor


class FakeProcess:
    """
    Records what the runtime does to its process, in order.
    """

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.parent = 4242
        self.alive = True
        self.sigterm: Callable[[], None] | None = None
        self.handshake: Mapping[str, Any] | None = None

    def parent_alive(self) -> bool:
        self.calls.append("parent?")
        return self.alive

    def on_sigterm(self, handler: Callable[[], None]) -> None:
        self.calls.append("sigterm handler")
        self.sigterm = handler

    def announce(self, handshake: Mapping[str, Any]) -> None:
        self.calls.append("handshake")
        self.handshake = handshake

    def sweep(self) -> None:
        self.calls.append("sweep")

    def exit(self, code: int) -> None:
        self.calls.append(f"exit {code}")


class Plain(Engine):
    id = "plain"
    display_name = "Plain"
    license = License(code="MIT", weights="MIT", weights_commercial_use=True)
    native_format = NativeFormat(sample_rate=16000)
    default_variant = "only"

    def variants(self) -> dict[str, Variant]:
        return {"only": Variant(languages=("en",))}

    def speak(self, request: SpeakRequest) -> Iterator[bytes]:
        yield b"\x00\x00" * 160


def _forbidden(name: str) -> Callable[..., Any]:
    def called(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"{name} ran inside the reactor")

    return called


@pytest.fixture()
def started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Reactor, FakeProcess, Deferred[None]]]:
    """
    _run for a worker spawned as "plain-a", up to the point where the reactor would
    run; anything that spawns a probe fails the test if it runs.
    """
    monkeypatch.setattr(platform, "processor", _forbidden("platform.processor"))
    monkeypatch.setattr(_runtime, "probe_ffmpeg", _forbidden("probe_ffmpeg"))
    monkeypatch.setattr(_memory, "_cpu_name", None)
    reactor = Reactor()
    process = FakeProcess()
    context = WorkerContext(voice_dir=tmp_path / "voices", cache_dir=tmp_path / "cache")
    spawn = Spawn(listen=f"unix:{tmp_path}/w.sock", engine="plain-a", contract=1, context=context)
    done = Deferred.fromCoroutine(
        _run(reactor, Plain(), spawn, process, ffmpeg=None, formats=("wav", "pcm"), access_log=False)
    )
    yield reactor, process, done
    for stop, args, kwargs in reactor.triggers.get("during", {}).get("shutdown", []):
        stop(*args, **kwargs)


def _site(reactor: Reactor) -> Any:
    ((address, site, backlog, mode, _),) = reactor.unixServers
    assert backlog == _runtime.BACKLOG and mode == 0o600
    return site


def test_the_handshake_follows_the_sigterm_handler_once_the_reactor_runs(
    started: tuple[Reactor, FakeProcess, Deferred[None]],
) -> None:
    """
    The worker is bound before the reactor runs but says nothing yet: the handshake
    waits for the reactor (whose start installs Twisted's own SIGTERM handler), and the
    draining handler replaces that one before the line is printed.
    """
    reactor, process, _ = started
    _site(reactor)
    assert process.calls == []
    reactor.run()
    assert process.calls == ["sigterm handler", "handshake"]
    assert process.handshake == {
        "ready": True,
        "contract": 1,
        "engine": "plain-a",
        "listen": f"unix:{reactor.unixServers[0][0]}",
    }


def test_sigterm_drains_and_the_stopped_worker_sweeps_its_group(
    started: tuple[Reactor, FakeProcess, Deferred[None]],
) -> None:
    """
    The SIGTERM handler reaches the drain through callFromThread; the idle worker
    stops, stops polling its parent, sweeps its process group and returns (react then
    exits 0).  A second SIGTERM changes nothing.
    """
    reactor, process, done = started
    reactor.run()
    assert process.sigterm is not None
    process.sigterm()
    assert not done.called
    reactor.advance(0)
    process.sigterm()
    reactor.advance(0)
    SynchronousTestCase().successResultOf(done)
    assert process.calls == ["sigterm handler", "handshake", "sweep"]
    assert reactor.getDelayedCalls() == []


def test_any_stop_of_the_reactor_drains(started: tuple[Reactor, FakeProcess, Deferred[None]]) -> None:
    """
    A "before shutdown" trigger drains too, so a reactor stopped by Twisted's own
    SIGTERM handler (in the moment before the draining one replaces it) or by SIGINT
    still exits through the drain.
    """
    reactor, process, done = started
    reactor.run()
    (trigger,) = reactor.triggers["before"]["shutdown"]
    stop, args, kwargs = trigger
    SynchronousTestCase().successResultOf(stop(*args, **kwargs))
    SynchronousTestCase().successResultOf(done)
    assert process.calls[-1] == "sweep"


def test_the_parent_poll_runs_on_the_injected_reactor(started: tuple[Reactor, FakeProcess, Deferred[None]]) -> None:
    """
    The parent poll is a LoopingCall on the reactor it was given (never the global
    one): advancing the memory clock polls, and a parent gone exits 1 (the real exit
    sweeps the group first).
    """
    reactor, process, _ = started
    reactor.run()
    reactor.advance(1.0)
    assert process.calls[-1] == "parent?"
    process.alive = False
    reactor.advance(1.0)
    assert process.calls[-2:] == ["parent?", "exit 1"]


def test_health_names_the_spawned_id_and_capabilities_the_engines(
    started: tuple[Reactor, FakeProcess, Deferred[None]],
) -> None:
    """
    A worker spawned under a registry id that is not its engine's own names that id on
    /health (as in its handshake), while /capabilities names the engine's own id; and
    /capabilities runs no `uname -p` on the reactor thread (platform.processor is
    forbidden here), naming the CPU by its architecture until start-up probed it.
    """
    reactor, process, _ = started
    reactor.run()
    stub = StubTreq(_site(reactor).resource)
    case = SynchronousTestCase()
    health = case.successResultOf(stub.json_content(case.successResultOf(stub.get("http://worker/health"))))
    assert health["engine"] == "plain-a"
    caps = case.successResultOf(stub.json_content(case.successResultOf(stub.get("http://worker/capabilities"))))
    assert caps["engine"]["id"] == "plain"
    assert caps["device"] == {"type": "cpu", "name": platform.machine()}
    assert caps["formats"] == ["wav", "pcm"]


def test_the_cpu_is_probed_once_and_then_only_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """
    probe_cpu (called at start-up, before the reactor runs) asks platform.processor
    once; device_info then reads the answer however often it is asked.
    """
    asked: list[str] = []
    monkeypatch.setattr(platform, "processor", lambda: asked.append("uname -p") or "Fancy CPU")
    monkeypatch.setattr(_memory, "_cpu_name", None)
    monkeypatch.setattr(_memory, "_torch_cuda", lambda: None)
    _memory.probe_cpu()
    assert _memory.device_info() == {"type": "cpu", "name": "Fancy CPU"}
    assert _memory.device_info() == {"type": "cpu", "name": "Fancy CPU"}
    assert asked == ["uname -p"]


def test_group_members_read_from_proc(tmp_path: Path) -> None:
    """
    The group sweep finds a group's live members in /proc/PID/stat, whatever their
    command name holds, and leaves out zombies and other groups.
    """
    stats = {
        "100": "100 (python) S 1 100 100 0",
        "101": "101 (sleep) S 100 100 100 0",
        "102": "102 (a) b) (c) R 100 100 100 0",
        "103": "103 (gone) Z 100 100 100 0",
        "104": "104 (other) S 1 104 104 0",
        "105": "105 (prefix) S 1 1000 1000 0",
    }
    for pid, stat in stats.items():
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "stat").write_text(stat)
    (tmp_path / "self").mkdir()
    (tmp_path / "106").mkdir()  # exited between the listing and the read
    assert sorted(_group_members(100, str(tmp_path)) or []) == [100, 101, 102]
    assert _group_members(100, str(tmp_path / "absent")) is None


_GLOBAL_HELPERS = {"deferToThread", "cooperate", "coiterate"}


def _global_reactor_uses(path: Path, root: Path) -> list[str]:
    """
    Every import of the global reactor in C{path}, and every helper that runs on it.
    """
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        for name in names:
            if name == "twisted.internet.reactor" or name.rpartition(".")[2] in _GLOBAL_HELPERS:
                found.append(f"{path.relative_to(root)}:{node.lineno} {name}")
    return found


def test_the_sdk_never_uses_the_global_reactor() -> None:
    """
    Nothing in rhapsode_worker or the protocol it serves with imports the global reactor
    or a helper that runs on it (deferToThread, the global cooperator): everything is
    given its reactor.  Only react(), the entry point, picks the global one.
    """
    files = sorted((ROOT / "sdk" / "src" / "rhapsode_worker").rglob("*.py"))
    files += sorted((ROOT / "protocol" / "src" / "rhapsode_protocol").rglob("*.py"))
    assert len(files) > 10
    assert [hit for path in files for hit in _global_reactor_uses(path, ROOT)] == []


def test_the_global_reactor_check_finds_each_form(tmp_path: Path) -> None:
    """
    The scan above sees each way of reaching the global reactor, so its empty answer
    means something.
    """
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from twisted.internet import reactor\n"
        "import twisted.internet.reactor\n"
        "from twisted.internet.threads import deferToThread\n"
        "from twisted.internet.task import cooperate\n"
        "from twisted.internet.threads import deferToThreadPool\n"
        "from twisted.internet import threads\n"
        "threads.deferToThread(print)\n"
    )
    found = [hit.split(" ", 1)[1] for hit in _global_reactor_uses(sample, tmp_path)]
    assert found == [
        "twisted.internet.reactor",
        "twisted.internet.reactor",
        "twisted.internet.threads.deferToThread",
        "twisted.internet.task.cooperate",
        "deferToThread",
    ]
