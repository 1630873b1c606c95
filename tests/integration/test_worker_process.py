"""
The spawn contract, end to end, with real worker processes on Unix sockets
(protocol.md sections 2, 3 and 9): handshake, negotiation, stdout capture, drain,
terminate, abort, load retry, and dying with the parent.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
import treq
from _worker import STARTUP_TIMEOUT, Worker, deferred_raw, process_alive, spawn_worker, start_process
from twisted.internet.task import deferLater

HERE = Path(__file__).parent
CHATTY = {"PYTHONPATH": str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def speak_body(text: str, **extra: Any) -> bytes:
    return json.dumps({"text": text, **extra}).encode()


@pytest_twisted.ensureDeferred
async def test_handshake_is_one_json_line_naming_the_socket(own_tone: Worker) -> None:
    """
    The worker prints exactly one handshake line on stdout once bound, and nothing after.
    """
    hs = own_tone.handshake
    assert hs == {"ready": True, "contract": 1, "engine": "tone", "listen": f"unix:{own_tone.socket_path}"}
    code, health = await own_tone.json("GET", "/health")
    assert code == 200 and health["process"] == "up"
    assert own_tone.protocol.stdout.count(b"\n") == 1


@pytest_twisted.ensureDeferred
async def test_tcp_port_zero_reports_the_bound_port(reactor: Any, tmp_path: Path) -> None:
    """
    C{tcp:127.0.0.1:0} binds an ephemeral port and the handshake names the real one.
    """
    worker = await spawn_worker(reactor, tmp_path, extra_env={"RHAPSODE_WORKER_LISTEN": "tcp:127.0.0.1:0"})
    try:
        listen = worker.handshake["listen"]
        host, port = listen[len("tcp:"):].rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        response = await treq.get(f"http://127.0.0.1:{port}/health")
        assert response.code == 200
        assert (await response.json())["engine"] == "tone"
    finally:
        await worker.stop()


@pytest_twisted.ensureDeferred
async def test_contract_offer_below_support_exits_before_handshake(reactor: Any, tmp_path: Path) -> None:
    """
    An offer below every contract the worker speaks ends it non-zero with no handshake,
    naming both numbers on stderr.
    """
    protocol, _, _ = start_process(reactor, tmp_path, contract="0")
    with pytest.raises(RuntimeError):
        await protocol.ready
    await protocol.ended
    assert protocol.exit_code not in (0, None)
    assert protocol.stdout == b""
    messages = " ".join(line["message"] for line in protocol.log_lines())
    assert "contract 0" in messages and "contract 1" in messages


@pytest_twisted.ensureDeferred
async def test_an_engine_that_cannot_be_made_exits_before_handshake_saying_why(reactor: Any, tmp_path: Path) -> None:
    """
    serve() makes the engine with the context the spawn describes, once logging goes to
    the log: an engine whose constructor raises ends the worker with status 1 and no
    handshake, its traceback a JSON log line on stderr, naming the voice folder the
    context gave it.
    """
    env = dict(CHATTY, CHATTY_FAIL_INIT="1")
    protocol, _, _ = start_process(reactor, tmp_path, module="chatty_engine", engine="chatty", extra_env=env)
    with pytest.raises(RuntimeError):
        await protocol.ready
    await protocol.ended
    assert protocol.exit_code == 1 and protocol.stdout == b""
    (failed,) = [line for line in protocol.log_lines() if line["message"] == "the engine could not be made"]
    assert failed["level"] == "critical"
    assert "chatty cannot start (voices would go in " in failed["traceback"]
    assert str(tmp_path) in failed["traceback"]


@pytest_twisted.ensureDeferred
async def test_contract_answer_is_highest_not_above_offer(reactor: Any, tmp_path: Path) -> None:
    """
    A core offering a newer contract gets the highest one the worker speaks.
    """
    worker = await spawn_worker(reactor, tmp_path, contract="7")
    try:
        assert worker.handshake["contract"] == 1
        _, caps = await worker.json("GET", "/capabilities")
        assert caps["contract"] == 1
    finally:
        await worker.stop()


@pytest_twisted.ensureDeferred
async def test_stdout_after_handshake_becomes_log_lines(reactor: Any, tmp_path: Path) -> None:
    """
    An adapter's print() after the handshake lands in the JSON log on stderr, not stdout.
    """
    worker = await spawn_worker(reactor, tmp_path, module="chatty_engine", engine="chatty", extra_env=CHATTY)
    try:
        response = await deferred_raw(worker.socket_path, "POST", "/speak", speak_body("hi", stream=False))
        assert response.status == 200
        assert worker.protocol.stdout.count(b"\n") == 1
        logged = [line for line in worker.protocol.log_lines() if line["message"] == "chatty loading only"]
        assert logged and logged[0]["engine"] == "chatty" and logged[0]["namespace"] == "stdout"
    finally:
        await worker.stop()


@pytest_twisted.ensureDeferred
async def test_failed_load_is_retried_once(reactor: Any, tmp_path: Path) -> None:
    """
    A load that fails once (an OOM) is unloaded and retried, and the request succeeds.
    """
    env = dict(CHATTY, CHATTY_FAIL_LOADS="1")
    worker = await spawn_worker(reactor, tmp_path, module="chatty_engine", engine="chatty", extra_env=env)
    try:
        response = await deferred_raw(worker.socket_path, "POST", "/speak", speak_body("hello", stream=False))
        assert response.status == 200 and response.complete
        assert any("retrying once" in line["message"] for line in worker.protocol.log_lines())
    finally:
        await worker.stop()


@pytest_twisted.ensureDeferred
async def test_load_failing_twice_is_oom_and_retryable(reactor: Any, tmp_path: Path) -> None:
    """
    Two failed loads answer 503 C{oom}, retryable, and leave nothing loaded.
    """
    env = dict(CHATTY, CHATTY_FAIL_LOADS="2")
    worker = await spawn_worker(reactor, tmp_path, module="chatty_engine", engine="chatty", extra_env=env)
    try:
        response = await deferred_raw(worker.socket_path, "POST", "/speak", speak_body("hello", stream=False))
        assert response.status == 503
        assert json.loads(response.body)["error"] == {
            "code": "oom",
            "message": "out of memory: CUDA out of memory (pretend)",
            "retryable": True,
        }
        _, health = await worker.json("GET", "/health")
        assert health["model"] == "unloaded"
    finally:
        await worker.stop()


@pytest_twisted.ensureDeferred
async def test_failure_mid_stream_aborts_the_connection(reactor: Any, tmp_path: Path) -> None:
    """
    An adapter that raises after audio has gone out makes the worker abort: the client
    sees a truncated chunked body, never a clean end.
    """
    worker = await spawn_worker(reactor, tmp_path, module="chatty_engine", engine="chatty", extra_env=CHATTY)
    try:
        text = "This first segment is perfectly fine. And then we explode right here."
        response = await deferred_raw(worker.socket_path, "POST", "/speak", speak_body(text, format="pcm"))
        assert response.status == 200
        assert response.body  # the first segment arrived
        assert not response.complete
        assert "x-rhapsode-duration-ms" not in response.trailers
        # and the worker is fine afterwards
        again = await deferred_raw(worker.socket_path, "POST", "/speak", speak_body("fine", stream=False))
        assert again.status == 200
    finally:
        await worker.stop()


async def loaded(reactor: Any, worker: Worker, seconds: float = 60.0) -> None:
    """Wait until chatty says it loads its model: a request is in flight (a hang guard)."""
    deadline = time.monotonic() + seconds
    while not any(line["message"] == "chatty loading only" for line in worker.protocol.log_lines()):
        assert time.monotonic() < deadline, "chatty never loaded"
        await deferLater(reactor, 0.02, lambda: None)


async def draining(reactor: Any, worker: Worker, seconds: float = 60.0) -> None:
    """Wait until the worker's /health says it drains (a hang guard)."""
    deadline = time.monotonic() + seconds
    while not (await worker.json("GET", "/health"))[1].get("draining"):
        assert time.monotonic() < deadline, "the worker never said it drains"
        await deferLater(reactor, 0.02, lambda: None)


@pytest_twisted.ensureDeferred
async def test_health_answers_while_speaking(reactor: Any, tmp_path: Path) -> None:
    """
    /health answers at once while a slow synthesis holds the model.
    """
    env = dict(CHATTY, CHATTY_SECONDS_PER_SEGMENT="2")
    worker = await spawn_worker(reactor, tmp_path, module="chatty_engine", engine="chatty", extra_env=env)
    try:
        speaking = deferred_raw(worker.socket_path, "POST", "/speak", speak_body("one slow segment", stream=False))
        await loaded(reactor, worker)
        code, health = await worker.json("GET", "/health")
        assert code == 200 and health["model"] == "loaded"
        assert not speaking.called
        assert (await speaking).status == 200
    finally:
        await worker.stop()


@pytest_twisted.ensureDeferred
async def test_hangup_stops_stream_and_unload_waits_only_for_abandoned_segment(
    reactor: Any, tmp_path: Path
) -> None:
    """
    A client that hangs up stops its synthesis: an unload queued after it waits for the
    abandoned segment, not for the rest of the text: by the time it answers, a few of the
    text's hundred segments were begun (the engine logs each it begins), and no more after.
    """
    segments = tmp_path / "segments.log"
    env = dict(CHATTY, CHATTY_SECONDS_PER_SEGMENT="0.5", CHATTY_SEGMENT_LOG=str(segments))
    worker = await spawn_worker(reactor, tmp_path, module="chatty_engine", engine="chatty", extra_env=env)
    try:
        text = " ".join(["Segment of some forty characters here."] * 100)  # ~50 s of work
        response = await deferred_raw(
            worker.socket_path, "POST", "/speak", speak_body(text, format="pcm"), stop_after=1
        )
        assert not response.complete
        code, health = await worker.json("POST", "/unload")
        assert code == 200 and health["model"] == "unloaded"
        begun = segments.read_text().split()
        assert 1 <= len(begun) < 50, begun
    finally:
        await worker.stop()


@pytest_twisted.ensureDeferred
async def test_sigterm_drains_refuses_new_and_exits_zero(reactor: Any, tmp_path: Path) -> None:
    """
    SIGTERM: requests in flight finish, new ones get 429 C{overloaded} (retryable), and
    the process exits 0.
    """
    env = dict(CHATTY, CHATTY_SECONDS_PER_SEGMENT="1")
    worker = await spawn_worker(reactor, tmp_path, module="chatty_engine", engine="chatty", extra_env=env)
    try:
        in_flight = deferred_raw(worker.socket_path, "POST", "/speak", speak_body("one more line", stream=False))
        # In flight once its model loads (the worker logs it), however long that takes here.
        await loaded(reactor, worker)
        os.kill(worker.pid, signal.SIGTERM)
        await draining(reactor, worker)
        refused = await deferred_raw(worker.socket_path, "POST", "/speak", speak_body("late"))
        assert refused.status == 429
        assert json.loads(refused.body)["error"]["code"] == "overloaded"
        assert json.loads(refused.body)["error"]["retryable"] is True
        finished = await in_flight
        assert finished.status == 200 and finished.complete
        assert await worker.protocol.ended == 0
    finally:
        await worker.stop()


@pytest_twisted.ensureDeferred
async def test_terminate_verb_answers_then_exits_zero(own_tone: Worker) -> None:
    """
    POST /terminate answers 202 and the worker drains and exits 0.
    """
    code, body = await own_tone.json("POST", "/terminate")
    assert code == 202 and body == {"terminating": True}
    assert await own_tone.protocol.ended == 0
    assert not process_alive(own_tone.pid)


@pytest_twisted.ensureDeferred
async def test_sigterm_the_moment_the_handshake_is_read_drains_and_exits_zero(reactor: Any, tmp_path: Path) -> None:
    """
    A SIGTERM sent the instant the handshake line arrives is a drain like any other:
    the worker exits 0, never killed by the signal, spawn after spawn (the draining
    handler is in place before the line is printed).
    """
    for attempt in range(4):
        protocol, transport, _ = start_process(reactor, tmp_path / str(attempt))
        protocol.ready.addCallback(lambda _: transport.signalProcess("TERM"))
        try:
            await protocol.ended.addTimeout(STARTUP_TIMEOUT, reactor)
        finally:
            if protocol.exit_code is None and protocol.signal is None:
                transport.signalProcess("KILL")
        assert (protocol.exit_code, protocol.signal) == (0, None), (attempt, protocol.stderr.decode()[-2000:])


@pytest_twisted.ensureDeferred
async def test_a_worker_spawned_under_another_id_names_it(reactor: Any, tmp_path: Path) -> None:
    """
    The tone module spawned as "tone-a" (a second registration of one engine) keeps
    working: its handshake, /health and its log lines name "tone-a", /capabilities
    names the engine's own id, and it speaks.
    """
    worker = await spawn_worker(reactor, tmp_path, engine="tone-a")
    try:
        assert worker.handshake["engine"] == "tone-a"
        _, health = await worker.json("GET", "/health")
        assert health["engine"] == "tone-a"
        _, caps = await worker.json("GET", "/capabilities")
        assert caps["engine"]["id"] == "tone"
        response = await deferred_raw(worker.socket_path, "POST", "/speak", speak_body("still speaking", stream=False))
        assert response.status == 200 and len(response.body) > 1000
        assert {line["engine"] for line in worker.protocol.log_lines()} == {"tone-a"}
    finally:
        await worker.stop()


def test_worker_dies_with_its_parent(tmp_path: Path) -> None:
    """
    A worker whose parent process is killed exits by itself: nothing is orphaned.
    """
    script = (
        "import os, subprocess, sys\n"
        "env = dict(os.environ, RHAPSODE_WORKER_LISTEN='unix:" + str(tmp_path / "w.sock") + "',\n"
        "           RHAPSODE_WORKER_ENGINE='tone', RHAPSODE_WORKER_CONTRACT='1')\n"
        "child = subprocess.Popen([sys.executable, '-m', 'rhapsode_engine_tone'], env=env,\n"
        "                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)\n"
        "child.stdout.readline()\n"
        "print(child.pid, flush=True)\n"
        "import time; time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    assert parent.stdout is not None
    child_pid = int(parent.stdout.readline())
    assert process_alive(child_pid)
    parent.kill()
    parent.wait()
    parent.stdout.close()
    # A hang guard: the worker polls for its parent every second or so.
    deadline = time.monotonic() + 60
    while process_alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not process_alive(child_pid)


@pytest_twisted.ensureDeferred
async def test_serves_without_torch(reactor: Any, tmp_path: Path) -> None:
    """
    The SDK imports and serves in an environment where importing torch fails.
    """
    blocker = tmp_path / "block"
    (blocker / "torch").mkdir(parents=True)
    (blocker / "torch" / "__init__.py").write_text("raise ImportError('torch is absent here')\n")
    env = {"PYTHONPATH": str(blocker) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    worker = await spawn_worker(reactor, tmp_path, extra_env=env)
    try:
        response = await deferred_raw(worker.socket_path, "POST", "/speak", speak_body("no torch here", stream=False))
        assert response.status == 200 and len(response.body) > 1000
        _, health = await worker.json("GET", "/health")
        assert health["device"] == "cpu"
    finally:
        await worker.stop()
