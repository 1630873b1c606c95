"""
Residency with real workers under a real core (protocol.md section 3): the budget evicts
by terminating the least recently used worker, keep-alive 0 frees the card as the stream
ends, a hang-up releases its lease, unload is refused while speaking, and /residency and
/health agree.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from _worker import engine_of, process_alive
from test_core_service import get, serving, wait_for

TONES = {"first": {"module": "rhapsode_engine_tone"}, "second": {"module": "rhapsode_engine_tone"}}


def speak(port: int, engine: str, **fields: Any) -> tuple[int, bytes]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/speak",
        data=json.dumps({"engine": engine, "text": "Hello there.", "stream": False, **fields}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def post(port: int, path: str) -> tuple[int, Any]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=b"", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def pid_of(port: int, engine: str) -> int | None:
    return engine_of(get(port, "/health"), engine).get("pid")


def test_budget_of_one_terminates_the_least_recently_used_worker(tmp_path: Path) -> None:
    """
    With maxResidentModels 1, speaking on a second engine terminates the first worker
    process: it is gone from the process table, and /residency lists only the second.
    """
    with serving(tmp_path, TONES, residency={"maxResidentModels": 1}) as (_, port):
        assert speak(port, "first")[0] == 200
        first = pid_of(port, "first")
        assert first is not None and process_alive(first)
        assert speak(port, "second")[0] == 200
        wait_for(lambda: not process_alive(first), 10, "the evicted worker to exit")
        residency = get(port, "/residency")
        assert residency["resident"] == 1 and residency["max"] == 1
        assert [m["engine"] for m in residency["models"]] == ["second"]
        health = {e["id"]: e for e in get(port, "/health")["engines"]}
        assert health["first"]["model"] == "unloaded" and health["second"]["model"] == "loaded"


def test_keep_alive_zero_frees_the_model_as_the_stream_ends(tmp_path: Path) -> None:
    """
    keepAliveSeconds 0 leaves nothing resident right after the stream ends, and its
    worker process is terminated, not merely unloaded.
    """
    with serving(tmp_path) as (_, port):
        assert speak(port, "tone")[0] == 200
        pid = pid_of(port, "tone")
        assert pid is not None and get(port, "/residency")["resident"] == 1
        assert speak(port, "tone", keepAliveSeconds=0)[0] == 200
        assert get(port, "/residency")["models"] == []
        wait_for(lambda: not process_alive(pid), 10, "the worker to be terminated")


def test_residency_document_shape(tmp_path: Path) -> None:
    """
    /residency reports each model with its keep-alive in force, last use, deadline and
    the size the worker measured.
    """
    with serving(tmp_path, residency={"keepAliveSeconds": 120}) as (_, port):
        assert speak(port, "tone", variant="classic")[0] == 200
        document = wait_for(lambda: (d := get(port, "/residency"))["models"] and "sizeBytes" in d["models"][0] and d, 10, "a size")
        (model,) = document["models"]
        assert model["engine"] == "tone" and model["variant"] == "classic" and model["leases"] == 0
        assert model["keepAliveSeconds"] == 120
        assert model["lastUsedAt"].endswith("Z") and model["expiresAt"] > model["lastUsedAt"]
        assert model["sizeBytes"] > 0


def test_unload_refused_while_speaking_and_allowed_after(tmp_path: Path) -> None:
    """
    POST /engines/{id}/unload is 409 while a stream holds a lease; a client hanging up
    releases it, after which unload answers 200 and (mode=terminate) ends the process.
    """
    here = str(Path(__file__).parent)
    engines = {"chatty": {"module": "chatty_engine", "env": {"PYTHONPATH": here, "CHATTY_SECONDS_PER_SEGMENT": "0.5"}}}
    with serving(tmp_path, engines) as (_, port):
        sock = socket.create_connection(("127.0.0.1", port))
        body = json.dumps({"engine": "chatty", "text": " ".join(["Forty characters of text, more or less."] * 20), "format": "pcm"}).encode()
        sock.sendall(
            b"POST /speak HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        assert get(port, "/residency")["models"][0]["leases"] == 1
        code, answer = post(port, "/engines/chatty/unload")
        assert code == 409 and answer["error"]["code"] == "conflict"
        sock.close()  # hang up mid-stream
        wait_for(lambda: get(port, "/residency")["models"][0]["leases"] == 0, 10, "the lease to be released")
        pid = pid_of(port, "chatty")
        code, summary = post(port, "/engines/chatty/unload?mode=terminate")
        assert code == 200 and summary["id"] == "chatty" and summary["model"] == "unloaded"
        assert get(port, "/residency")["models"] == []
        assert pid is not None
        wait_for(lambda: not process_alive(pid), 10, "the worker to be terminated")
        code, _ = post(port, "/engines/chatty/unload")
        assert code == 200  # idempotent


def test_unload_mode_unload_keeps_the_process(tmp_path: Path) -> None:
    """
    mode=unload frees the model but keeps the worker process for a faster next load.
    """
    with serving(tmp_path) as (_, port):
        assert speak(port, "tone")[0] == 200
        pid = pid_of(port, "tone")
        code, summary = post(port, "/engines/tone/unload?mode=unload")
        assert code == 200 and summary["model"] == "unloaded"
        time.sleep(0.5)
        assert pid is not None and process_alive(pid) and pid_of(port, "tone") == pid
        code, answer = post(port, "/engines/tone/unload?mode=sideways")
        assert code == 400 and answer["error"]["field"] == "mode"
