"""
Benchmark of the reach routes, run by hand (`.venv/bin/python bench/reach.py [--engines]`).

One core (`rhapsode serve`, a separate process) with a tone worker, and, with
`--engines`, Piper and Kokoro (Kokoro only once `make fetch-kokoro` has run).  Prints,
side by side in one run:

- the OpenAI shim's time to first byte against native /speak on the same engine and
  text (p50/p99 and the difference), on one kept-alive connection each;
- SSE (`stream_format: "sse"`): time to the first delta event against a raw stream's
  first byte;
- MCP `tools/call speak` of one sentence against a buffered /speak of it;
- (with --engines) the WebSocket text-in stream on Piper and Kokoro, text fed at 20
  words a second: first audio after the first sentence's end.

Asserts nothing.  Everything shares this machine's cores with the clients.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from _common import KeptAlive, free_port, percentile, request_bytes, start_worker, tcp, timed, wait_listening

ROOT = Path(__file__).resolve().parent.parent
SENTENCE = "The quick brown fox jumps over the lazy dog, then rests."
ROUNDS = 20
BLOCK = 25


def start_core(tmp: Path, engines: dict[str, Any]) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    config = {
        "server": {"port": port, "host": "127.0.0.1"},
        "log": {"level": "error"},
        "workers": {"socketDir": str(tmp / "sock"), "voiceDir": str(tmp / "voices")},
        "engines": engines,
    }
    (tmp / "core.json").write_text(json.dumps(config))
    rhapsode = str(Path(sys.executable).parent / "rhapsode")
    proc = subprocess.Popen([rhapsode, "serve", "--config", str(tmp / "core.json")], stdout=subprocess.DEVNULL)
    wait_listening(port)
    return proc, port


def line(title: str, a_name: str, a: list[float], b_name: str, b: list[float]) -> None:
    print(title)
    for name, values in ((a_name, a), (b_name, b)):
        print(f"  {name:<10} p50 {percentile(values, 0.5) * 1e3:8.2f}  p99 {percentile(values, 0.99) * 1e3:8.2f}")
    print(f"  {'difference':<10} p50 {(percentile(b, 0.5) - percentile(a, 0.5)) * 1e3:8.2f}"
          f"  p99 {(percentile(b, 0.99) - percentile(a, 0.99)) * 1e3:8.2f}")


def alternate(first: Callable[[], float], second: Callable[[], float]) -> tuple[list[float], list[float]]:
    """
    Blocks of 25 of each, alternating, after a warm-up: the box's drift falls on both.
    """
    for _ in range(20):
        first()
        second()
    a: list[float] = []
    b: list[float] = []
    for _ in range(ROUNDS):
        a.extend(first() for _ in range(BLOCK))
        b.extend(second() for _ in range(BLOCK))
    return a, b


def shim_against_speak(port: int) -> None:
    native = request_bytes("/speak", {"engine": "tone", "text": SENTENCE, "format": "pcm"})
    shim = request_bytes("/v1/audio/speech", {"model": "tone", "input": SENTENCE, "response_format": "pcm"})
    kept_native, kept_shim = KeptAlive(tcp(port)), KeptAlive(tcp(port))
    a, b = alternate(lambda: kept_native.timed(native)[0], lambda: kept_shim.timed(shim)[0])
    kept_native.close()
    kept_shim.close()
    line("time to first byte, one sentence on tone, 500 each, kept-alive (ms)", "/speak", a, "shim", b)


def sse_against_raw(port: int) -> None:
    raw = request_bytes("/v1/audio/speech", {"model": "tone", "input": SENTENCE, "response_format": "pcm"})
    sse = request_bytes("/v1/audio/speech", {"model": "tone", "input": SENTENCE, "response_format": "pcm",
                                             "stream_format": "sse"})
    kept_raw, kept_sse = KeptAlive(tcp(port)), KeptAlive(tcp(port))
    a, b = alternate(lambda: kept_raw.timed(raw)[0], lambda: kept_sse.timed(sse)[0])
    kept_raw.close()
    kept_sse.close()
    line("time to first byte vs first SSE delta, one sentence on tone, 500 each, kept-alive (ms)", "raw", a, "sse", b)


def mcp_against_buffered(port: int) -> None:
    speak = request_bytes("/speak", {"engine": "tone", "text": SENTENCE, "format": "wav", "stream": False})
    call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": "speak", "arguments": {"engine": "tone", "text": SENTENCE}}}
    body = json.dumps(call).encode()
    mcp = (b"POST /mcp HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\n"
           b"Accept: application/json, text/event-stream\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    connect = tcp(port)
    a, b = alternate(lambda: timed(connect, speak)[1], lambda: timed(connect, mcp)[1])
    line("whole answer, one sentence on tone as wav, 500 each, a new connection each (ms)",
         "/speak", a, "mcp speak", b)
    print(f"  ratio      p50 {percentile(b, 0.5) / percentile(a, 0.5):8.2f}")


def websocket_first_audio(port: int, engine: str, text: str, voice: str | None) -> None:
    """
    Feed C{text} a word every 50 ms (20 words/s) and time the first binary frame from
    the moment the first sentence's last word went out.
    """
    from wsproto import ConnectionType, WSConnection
    from wsproto.events import AcceptConnection, BytesMessage, CloseConnection, Message, Request, TextMessage

    sock = socket.create_connection(("127.0.0.1", port))
    ws = WSConnection(ConnectionType.CLIENT)
    sock.sendall(ws.send(Request(host="localhost", target="/v1/audio/speech/stream")))
    config: dict[str, Any] = {"type": "session.config", "model": engine, "response_format": "pcm"}
    if voice:
        config["voice"] = voice
    words = text.split()
    first_end = next(i for i, w in enumerate(words) if w.endswith((".", "!", "?")))
    sent_end = 0.0
    first_audio = 0.0
    accepted = False
    sock.settimeout(0.001)
    index = 0
    next_word = time.perf_counter()
    done = False
    while not done:
        try:
            data = sock.recv(65536)
            if not data:
                break
            ws.receive_data(data)
        except (TimeoutError, socket.timeout):
            pass
        for event in ws.events():
            if isinstance(event, AcceptConnection):
                accepted = True
                sock.sendall(ws.send(Message(data=json.dumps(config))))
            elif isinstance(event, BytesMessage) and not first_audio:
                first_audio = time.perf_counter()
                done = index >= len(words)
            elif isinstance(event, TextMessage) and json.loads(event.data).get("type") == "error":
                print(f"  {engine}: {event.data}")
                done = True
            elif isinstance(event, CloseConnection):
                done = True
        if accepted and index < len(words) and time.perf_counter() >= next_word:
            piece = words[index] + " "
            sock.sendall(ws.send(Message(data=json.dumps({"type": "input.text", "text": piece}))))
            if index == first_end:
                sent_end = time.perf_counter()
            index += 1
            next_word += 0.05
            if index == len(words):
                sock.sendall(ws.send(Message(data=json.dumps({"type": "input.done"}))))
        if first_audio and index >= len(words):
            done = True
    sock.close()
    # The sentence in flight when the socket closed finishes on the worker (an engine's
    # inference is not interrupted): let it, so the next figure does not wait on it.
    time.sleep(4)
    if not (first_audio and sent_end):
        print(f"  {engine:<8} no audio")
        return
    # The same first sentence through POST /speak, streamed, for what the engine itself takes.
    sentence = " ".join(words[: first_end + 1])
    body: dict[str, Any] = {"engine": engine, "text": sentence, "format": "pcm"}
    if voice:
        body["voice"] = voice
    speak_first = timed(tcp(port), request_bytes("/speak", body))[0]
    time.sleep(1)
    print(f"  {engine:<8} first audio {(first_audio - sent_end) * 1e3:8.1f} ms after the first sentence's end;"
          f" POST /speak of that sentence: first byte {speak_first * 1e3:8.1f} ms")


def main() -> None:
    with_engines = "--engines" in sys.argv
    tmp = Path(tempfile.mkdtemp())
    worker, path = start_worker(tmp)
    engines: dict[str, Any] = {"tone": {"url": f"unix:{path}"}}
    kokoro_cache = ROOT / ".venvs" / "kokoro-cache"
    if with_engines:
        engines["piper"] = {"module": "rhapsode_engine_piper", "python": str(ROOT / ".venvs/piper/bin/python")}
        if kokoro_cache.exists():
            engines["kokoro"] = {"module": "rhapsode_engine_kokoro", "python": str(ROOT / ".venvs/kokoro/bin/python"),
                                 "env": {"RHAPSODE_KOKORO_CACHE": str(kokoro_cache)}}
    core, port = start_core(tmp, engines)
    try:
        for part in (shim_against_speak, sse_against_raw, mcp_against_buffered):
            try:
                part(port)
            except Exception as error:  # one part failing does not hide the others' figures
                print(f"{part.__name__}: failed: {error}")
        if with_engines:
            text = ("Here is the first sentence of a reply, spoken as it is written. "
                    "And here is a second one that follows it closely. Then a third to finish.")
            print("WebSocket text in at 20 words/s: first audio after the first sentence's last word")
            for engine, voice in (("piper", None), ("kokoro", "af_heart")):
                if engine in engines:
                    websocket_first_audio(port, engine, text, None)  # warm: the model loads
                    for _ in range(3):
                        websocket_first_audio(port, engine, text, voice)
    finally:
        core.terminate()
        core.wait(20)
        worker.terminate()
        worker.wait(10)


if __name__ == "__main__":
    os.chdir(ROOT)
    main()
