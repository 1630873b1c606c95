"""
The WebSocket speech stream (GET /v1/audio/speech/stream) on a real `rhapsode serve`,
driven by a blocking wsproto client over a plain socket, so every frame, close code and
arrival time is the test's to read: text fed a word at a time is heard before the last
word is sent, frames the stream cannot read close it with a code and a reason, a page
from elsewhere is refused before the upgrade, a listener that stops reading stops the
core from buffering, and each real engine in the tree (espeak, piper, kokoro) speaks.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import time
from typing import Any, Callable, Iterator, Sequence

import pytest
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from wsproto.utilities import LocalProtocolError

from _worker import ROOT, engine_python, get, resident_kib, rms, serving_core

PATH = "/v1/audio/speech/stream"
TONE = {"tone": {"module": "rhapsode_engine_tone"}}
CACHE = ROOT / ".venvs" / "kokoro-cache"
SILENCE_RMS = 300.0  # about -40 dBFS of 16-bit full scale
WORDS = (
    "The ferry left the harbour at dawn. Gulls followed it out past the lighthouse and the "
    "long grey wall of the breakwater, calling to each other over the wake. By noon the "
    "island was a smudge on the horizon, and the passengers had gone below to sleep."
).split(" ")


class Stream:
    """
    A blocking WebSocket client of a core on loopback: what it receives, in order, as
    JSON objects, bytes, ("close", code, reason), ("rejected", status, body),
    ("accepted",) and ("eof",), each with its arrival time in C{arrivals}.
    """

    def __init__(
        self, port: int, headers: Sequence[tuple[bytes, bytes]] = (), receive_buffer: int | None = None
    ) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if receive_buffer is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        self.sock.connect(("127.0.0.1", port))
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.received: list[Any] = []
        self.arrivals: list[float] = []
        self.eof = False
        self._text = ""
        self._bytes = b""
        self._status = 0
        self._body = b""
        self.sock.sendall(self.ws.send(Request(host=f"127.0.0.1:{port}", target=PATH, extra_headers=list(headers))))

    def send(self, message: Any) -> float:
        """
        Send a dict as JSON text, a str as it is, bytes as a binary message; when it went.
        """
        if isinstance(message, bytes):
            event: Any = BytesMessage(data=message)
        else:
            event = TextMessage(data=message if isinstance(message, str) else json.dumps(message))
        self.sock.sendall(self.ws.send(event))
        return time.monotonic()

    def pump(self, timeout: float, until: Callable[["Stream"], bool] | None = None) -> None:
        """
        Read whatever arrives within C{timeout} seconds, or until C{until} holds.
        """
        deadline = time.monotonic() + timeout
        while not self.eof and not (until is not None and until(self)):
            left = deadline - time.monotonic()
            readable, _, _ = select.select([self.sock], [], [], max(left, 0))
            if not readable:
                return
            try:
                data = self.sock.recv(64 * 1024)
            except ConnectionResetError:
                data = b""
            if not data:
                self.eof = True
                self._got(("eof",))
                return
            self.ws.receive_data(data)
            self._events()
            if left <= 0:
                return

    def _events(self) -> None:
        for event in self.ws.events():
            if isinstance(event, AcceptConnection):
                self._got(("accepted",))
            elif isinstance(event, RejectConnection):
                self._status = event.status_code
            elif isinstance(event, RejectData):
                self._body += event.data
                if event.body_finished:
                    self._got(("rejected", self._status, json.loads(self._body)))
            elif isinstance(event, TextMessage):
                self._text += event.data
                if event.message_finished:
                    self._got(json.loads(self._text))
                    self._text = ""
            elif isinstance(event, BytesMessage):
                self._bytes += event.data
                if event.message_finished:
                    self._got(bytes(self._bytes))
                    self._bytes = b""
            elif isinstance(event, CloseConnection):
                self._got(("close", int(event.code), event.reason))
                try:
                    self.sock.sendall(self.ws.send(event.response()))
                except (LocalProtocolError, OSError):
                    pass

    def _got(self, item: Any) -> None:
        self.received.append(item)
        self.arrivals.append(time.monotonic())

    def wait(self, done: Callable[["Stream"], bool], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not done(self):
            if self.eof or time.monotonic() > deadline:
                raise AssertionError(f"gave up waiting; received {self.shape()[-20:]}")
            self.pump(min(0.5, deadline - time.monotonic()), done)

    def frames(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in self.received if isinstance(m, dict) and m.get("type") == kind]

    def audio(self) -> bytes:
        return b"".join(m for m in self.received if isinstance(m, bytes))

    def closed(self) -> tuple[int, str] | None:
        for m in self.received:
            if isinstance(m, tuple) and m[0] == "close":
                return m[1], m[2]
        return None

    def shape(self) -> list[str]:
        return [m["type"] if isinstance(m, dict) else "audio" if isinstance(m, bytes) else m[0] for m in self.received]

    def close(self) -> None:
        self.sock.close()


def opened(port: int, **config: Any) -> Stream:
    stream = Stream(port)
    stream.wait(lambda s: bool(s.received))
    assert stream.received[0] == ("accepted",), stream.received
    stream.send({"type": "session.config", **config})
    return stream


def speak(port: int, words: str, **config: Any) -> Stream:
    """
    One utterance spoken whole: configured, sent, flushed, and read to its session.done.
    """
    stream = opened(port, **config)
    stream.send({"type": "input.text", "text": words})
    stream.send({"type": "input.done"})
    stream.wait(lambda s: bool(s.frames("session.done")), timeout=180)
    return stream


@pytest.fixture(scope="module")
def tone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, int]]:
    """
    One core serving the tone engine, its worker started and warm.
    """
    with serving_core(tmp_path_factory.mktemp("stream-tone"), TONE) as (core, port):
        speak(port, "Warm up.", model="tone").close()
        yield core, port


def test_first_audio_arrives_before_the_last_word_is_sent(tone: tuple[Any, int]) -> None:
    """
    Text fed a word at a time, 20 words a second, is heard a sentence at a time: once
    the first sentence is settled (the word after its end has arrived) its audio comes
    while the rest of the text is still to be sent, and every sentence comes back in
    order, ended by session.done.  How soon is printed, a figure and not a bound.
    """
    _, port = tone
    stream = opened(port, model="tone")
    sent: list[float] = []
    settling = WORDS.index("dawn.") + 1
    for at, word in enumerate(WORDS[: settling + 1]):
        sent.append(stream.send({"type": "input.text", "text": word if at == 0 else " " + word}))
        stream.pump(0.05)
    # A hang guard only: nothing more is sent until the first sentence is heard.
    stream.wait(lambda s: any(isinstance(m, bytes) for m in s.received), timeout=120)
    first_audio = next(t for m, t in zip(stream.received, stream.arrivals) if isinstance(m, bytes))
    for word in WORDS[settling + 1 :]:
        sent.append(stream.send({"type": "input.text", "text": " " + word}))
        stream.pump(0.05)
    stream.send({"type": "input.done"})
    stream.wait(lambda s: bool(s.frames("session.done")))
    assert first_audio < sent[-1] and len(sent) == len(WORDS)
    print(f"tone: first audio {1000 * (first_audio - sent[settling]):.0f} ms after the first sentence was settled")
    spoken = [m["sentence_text"] for m in stream.frames("audio.start")]
    assert spoken == [
        "The ferry left the harbour at dawn.",
        "Gulls followed it out past the lighthouse and the long grey wall of the breakwater, "
        "calling to each other over the wake.",
        "By noon the island was a smudge on the horizon, and the passengers had gone below to sleep.",
    ]
    assert all(not m["error"] for m in stream.frames("audio.done"))
    assert sum(m["total_bytes"] for m in stream.frames("audio.done")) == len(stream.audio())
    assert stream.frames("session.done") == [{"type": "session.done", "utterance_index": 0, "total_sentences": 3}]
    assert stream.frames("audio.start")[0]["sample_rate"] == 24000
    stream.close()


@pytest.mark.parametrize(
    ("messages", "code", "words"),
    [
        ([b"\x00\x01\x02"], 1003, "binary"),
        (["{not json"], 1007, "not JSON"),
        ([{"type": "input.text", "text": ["a list"]}], 1007, "string"),
        (["x" * (70 * 1024)], 1009, "over 65536 bytes"),
        ([{"type": "input.text", "text": "Hi"}, {"type": "session.close"}, {"type": "input.text", "text": "more"}],
         1008, "after session.close"),
    ],
)
def test_a_frame_the_stream_cannot_read_closes_it_with_a_code_and_reason(
    tone: tuple[Any, int], messages: list[Any], code: int, words: str
) -> None:
    """
    Binary where text is expected closes 1003, text that is not the protocol's JSON
    1007, an oversize message 1009 and text after session.close 1008, each with a
    reason; the core goes on serving.
    """
    core, port = tone
    stream = opened(port, model="tone")
    for message in messages:
        stream.send(message)
    stream.wait(lambda s: s.closed() is not None)
    closed = stream.closed()
    assert closed is not None and closed[0] == code and words in closed[1], closed
    stream.close()
    assert core.poll() is None and get(port, "/health")["status"] == "ok"


def test_a_page_from_elsewhere_is_refused_before_the_upgrade(tone: tuple[Any, int]) -> None:
    """
    A browser page whose Origin is neither this machine's nor configured is refused
    403 at the head, in the OpenAI envelope, and never upgraded; this machine's is.
    """
    _, port = tone
    stream = Stream(port, headers=[(b"Origin", b"https://elsewhere.example")])
    stream.wait(lambda s: bool(s.received))
    assert stream.received[0][:2] == ("rejected", 403)
    assert stream.received[0][2]["error"]["code"] == "forbidden"
    stream.close()
    local = Stream(port, headers=[(b"Origin", b"http://127.0.0.1:5173")])
    local.wait(lambda s: bool(s.received))
    assert local.received[0] == ("accepted",)
    local.close()


def test_a_listener_that_stops_reading_does_not_make_the_core_buffer(tone: tuple[Any, int]) -> None:
    """
    A client that stops reading mid-utterance pauses the worker instead of having the
    core hold the audio: tens of megabytes are owed to it, the core's memory grows by a
    small part of that while it reads nothing, and once it reads again every byte
    arrives and the utterance ends properly.
    """
    core, port = tone
    stream = Stream(port, receive_buffer=64 * 1024)
    stream.wait(lambda s: bool(s.received))
    stream.send({"type": "session.config", "model": "tone"})
    # Four sentences of 3000 characters, each over three minutes of tone's audio.
    words = " ".join(word.strip(".,") for word in WORDS) + " "
    text = (words * 12)[:3000].rsplit(" ", 1)[0] + ". "
    for _ in range(4):
        stream.send({"type": "input.text", "text": text})
    stream.send({"type": "input.done"})
    stream.wait(lambda s: len(s.audio()) > 0)
    before = resident_kib(core.pid)
    time.sleep(4)
    grown = resident_kib(core.pid) - before
    unread = len(stream.audio())
    stream.wait(lambda s: bool(s.frames("session.done")), timeout=300)
    owed = len(stream.audio())
    print(f"tone: {owed / 1e6:.1f} MB owed; the core grew {grown / 1024:.1f} MiB while the client read nothing")
    assert unread < 1e6 and owed > 30e6
    assert grown * 1024 < owed / 4
    assert [m["error"] for m in stream.frames("audio.done")] == [False] * 4
    assert sum(m["total_bytes"] for m in stream.frames("audio.done")) == owed
    stream.close()


def test_a_quiet_stream_outlives_the_http_idle_timeout(tmp_path: Any) -> None:
    """
    With the server's idle timeout at 1 s, a configured WebSocket that sends nothing
    for 3 s is still open and still speaks: the HTTP timeout does not reach it.
    """
    with serving_core(tmp_path, TONE, server={"idleTimeoutSeconds": 1}) as (_, port):
        stream = opened(port, model="tone")
        time.sleep(3)
        stream.pump(0)
        assert stream.closed() is None and not stream.eof
        stream.send({"type": "input.text", "text": "Still here."})
        stream.send({"type": "input.done"})
        stream.wait(lambda s: bool(s.frames("session.done")), timeout=60)
        assert len(stream.audio()) > 256
        stream.close()


# -- every real engine --------------------------------------------------------------------

REAL = ("espeak", "piper", "kokoro")


def engine_config(engine: str) -> dict[str, Any]:
    config: dict[str, Any] = {"module": f"rhapsode_engine_{engine}", "python": engine_python(engine)}
    if engine == "kokoro":
        config["env"] = {"RHAPSODE_KOKORO_CACHE": str(CACHE)}
    return config


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """
    One core serving espeak, piper and kokoro, Kokoro's weights fetched into the test
    cache first (a no-op once they are there).
    """
    subprocess.run(
        [engine_python("kokoro"), "-c",
         "import os; from rhapsode_engine_kokoro._fetch import cache_dir, ensure; ensure(cache_dir(os.environ))"],
        env={**os.environ, "RHAPSODE_KOKORO_CACHE": str(CACHE)}, check=True, capture_output=True, timeout=600,
    )
    tmp = tmp_path_factory.mktemp("stream-engines")
    with serving_core(tmp, {engine: engine_config(engine) for engine in REAL},
                      workers={"startupTimeoutSeconds": 120},
                      residency={"maxResidentModels": 3}) as (_, port):
        yield port


@pytest.mark.parametrize("engine", REAL)
def test_every_engine_speaks_each_sentence_as_pcm(engines: int, engine: str) -> None:
    """
    On each real engine two sentences fed a word at a time come back as two pieces of
    speech, each non-silent 16-bit PCM at the rate its audio.start names.
    """
    stream = opened(engines, model=engine)
    for at, word in enumerate("Good morning to you. The weather is lovely today.".split(" ")):
        stream.send({"type": "input.text", "text": word if at == 0 else " " + word})
    stream.send({"type": "input.done"})
    stream.wait(lambda s: bool(s.frames("session.done")), timeout=300)
    assert [m["sentence_text"] for m in stream.frames("audio.start")] == [
        "Good morning to you.", "The weather is lovely today."
    ]
    assert [m["error"] for m in stream.frames("audio.done")] == [False, False], stream.frames("error")
    rate = stream.frames("audio.start")[0]["sample_rate"]
    assert isinstance(rate, int) and rate >= 16000
    pieces: list[bytes] = [b""]
    for message in stream.received:
        if isinstance(message, bytes):
            pieces[-1] += message
        elif isinstance(message, dict) and message["type"] == "audio.done":
            pieces.append(b"")
    for pcm in pieces[:2]:
        assert len(pcm) / 2 / rate > 0.4
        assert rms(pcm) > SILENCE_RMS
    stream.close()
