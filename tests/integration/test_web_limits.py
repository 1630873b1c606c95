"""
`rhapsode web` as a real process on loopback has the core's limits (issue 23, section 4):
a head dribbled a byte at a time is 408 at its head timeout, a declared body that never
comes is 408 at the idle timeout, and one connection past --max-connections is refused
429 at once while the others stay served.  Every wait is a hang guard.
"""

from __future__ import annotations

import select
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

BIN = Path(sys.executable).parent
#: A hang guard: what each step waits for happens in seconds on an idle box.
GUARD = 60.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.fixture
def web(tmp_path: Path) -> Iterator[int]:
    """The page's server, a 1 s head timeout, a 2 s idle one and 3 connections at most."""
    port = free_port()
    log = tmp_path / "web.log"
    # No core needed: the limits are the page's own server's, before any request is relayed.
    with log.open("wb") as out:
        process = subprocess.Popen(
            [str(BIN / "rhapsode"), "web", "--core", f"http://127.0.0.1:{free_port()}", "--port", str(port),
             "--head-timeout", "1", "--idle-timeout", "2", "--max-connections", "3"],
            cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + GUARD
        while True:
            assert process.poll() is None, log.read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=GUARD):
                    break
            except OSError:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
        yield port
    finally:
        process.terminate()
        try:
            process.wait(GUARD)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def answer_of(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (a hang guard bounds the wait)."""
    sock.settimeout(GUARD)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_head_dribbled_a_byte_at_a_time_is_408_and_closed(web: int) -> None:
    """
    A head whose bytes keep coming, one every 0.2 s (so never idle), is answered 408 and
    the connection closed once the head timeout is past, while the client still sends.
    """
    with socket.create_connection(("127.0.0.1", web), timeout=GUARD) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        deadline = time.monotonic() + GUARD
        while not select.select([sock], [], [], 0.2)[0]:
            assert time.monotonic() < deadline, "the dribbled head was never cut off"
            try:
                sock.sendall(b"a")
            except OSError:
                break
        raw = answer_of(sock)
    assert raw.startswith(b"HTTP/1.1 408 "), raw[:200]


def test_a_declared_body_that_never_comes_is_408_at_the_idle_timeout(web: int) -> None:
    """A POST declaring 100 bytes that sends none is answered 408 and closed."""
    with socket.create_connection(("127.0.0.1", web), timeout=GUARD) as sock:
        sock.sendall(b"POST /api/speak HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n")
        raw = answer_of(sock)
    assert raw.startswith(b"HTTP/1.1 408 "), raw[:200]


def test_one_connection_past_the_cap_is_refused_and_the_others_are_served(web: int) -> None:
    """
    With three connections open and idle, a fourth is answered 429 with Retry-After and
    closed before anything of it is read; each of the three is still served, and once
    one closes a new connection is let in.
    """
    held = [socket.create_connection(("127.0.0.1", web), timeout=GUARD) for _ in range(3)]
    try:
        # Each is counted once the server has accepted it: one request on each proves it.
        for sock in held:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert sock.recv(12) == b"HTTP/1.1 200"
        with socket.create_connection(("127.0.0.1", web), timeout=GUARD) as extra:
            raw = answer_of(extra)
        assert raw.startswith(b"HTTP/1.1 429 ") and b"Retry-After: 1" in raw, raw[:300]
        held.pop().close()
        deadline = time.monotonic() + GUARD
        while True:
            with socket.create_connection(("127.0.0.1", web), timeout=GUARD) as again:
                again.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                raw = answer_of(again)
            if raw.startswith(b"HTTP/1.1 200"):
                break
            # The server may not have seen the close yet: refused until it has.
            assert raw.startswith(b"HTTP/1.1 429 ") and time.monotonic() < deadline, raw[:300]
            time.sleep(0.1)
    finally:
        for sock in held:
            sock.close()
