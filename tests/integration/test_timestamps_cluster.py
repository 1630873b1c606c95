"""
Timestamps through a cluster (docs/cluster.md, docs/timestamps.md), without Ray: a real
node core (`server.role: node`) with the eSpeak NG worker, a small stand-in for the
cluster's Serve app that answers what the app answers (`_route`: this node; `_nodes`:
the directory), and a real front whose espeak engine is that cluster.  The front asks
the node in frames, the node asks its worker the same, and the front's caller gets the
contract's events and document with the caller's text at every word's offsets.
(tests/cluster runs the real Ray app, with untimed speech.)
"""

from __future__ import annotations

import base64
import http.client
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest

from _worker import engine_python, serving_core
from rhapsode_protocol import contract

TEXT = "The ferry left at 3:45 pm, and the gulls followed it."


class Directory(ThreadingHTTPServer):
    node_url = ""


class _App(BaseHTTPRequestHandler):
    """What the cluster's Serve app answers a front: the one node, for every model."""

    server: Directory

    def do_GET(self) -> None:
        node = {"node": "box-1", "url": self.server.node_url}
        if self.path == "/rhapsode/_route":
            body = json.dumps(node).encode()
        elif self.path == "/rhapsode/_nodes":
            body = json.dumps([node]).encode()
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """
    A node core with eSpeak NG, the app's stand-in naming it, and a front before them.
    """
    home = tmp_path_factory.mktemp("cluster-timestamps")
    (home / "node").mkdir()
    (home / "front").mkdir()
    espeak = {"espeak": {"module": "rhapsode_engine_espeak", "python": engine_python("espeak")}}
    with serving_core(home / "node", espeak, server={"role": "node", "node": "box-1"}) as (_, node_port):
        app = Directory(("127.0.0.1", 0), _App)
        app.node_url = f"http://127.0.0.1:{node_port}"
        threading.Thread(target=app.serve_forever, daemon=True).start()
        try:
            cluster = {"espeak": {"cluster": f"http://127.0.0.1:{app.server_address[1]}/rhapsode/"}}
            with serving_core(home / "front", cluster) as (_, front_port):
                yield front_port
        finally:
            app.shutdown()
            app.server_close()


def post(port: int, body: Any, accept: str) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    connection.request("POST", "/speak", json.dumps(body), {"Content-Type": "application/json", "Accept": accept})
    response = connection.getresponse()
    answer = response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    connection.close()
    return answer


def test_a_timed_stream_crosses_the_node_to_the_fronts_events(front: int) -> None:
    """
    Streamed: the contract's events from the node that spoke (X-Rhapsode-Node), every
    word's timing before the audio holding its first sample and its text the caller's
    at its offsets, the audio whole, and the end with its duration.
    """
    body = {"engine": "espeak", "text": TEXT, "format": "pcm", "timestamps": "word"}
    status, headers, raw = post(front, body, "text/event-stream")
    assert status == 200, raw[:300]
    assert headers["content-type"] == "text/event-stream" and headers["x-rhapsode-node"] == "box-1"
    found = []
    for frame in raw.decode("utf-8").split("\n\n"):
        if frame.strip():
            lines = dict(line.split(": ", 1) for line in frame.split("\n"))
            found.append(json.loads(lines["data"]))
    kinds = [event["type"] for event in found]
    assert kinds[0] == "speech.timestamps.delta" and kinds[-1] == "speech.audio.done"
    words = [entry for event in found if event["type"] == "speech.timestamps.delta" for entry in event["alignment"]]
    assert [TEXT[w["textStart"]:w["textEnd"]] for w in words] == [w["text"] for w in words]
    texts = [w["text"] for w in words]
    # eSpeak's "3", "45" and "5 " overlap at the 5: merged into 3 and 45, as on one core.
    assert texts[:6] == ["The", "ferry", "left", "at", "3", "45"] and texts[-1] == "it"
    audio = b"".join(base64.b64decode(event["audio"]) for event in found if event["type"] == "speech.audio.delta")
    seconds = len(audio) / 2 / 22050
    assert abs(found[-1]["durationMs"] / 1000 - seconds) < 0.01
    assert words[-1]["end"] <= seconds + 0.05
    # Each word's timing arrives before the audio holding its first sample.
    sent = 0
    for event in found:
        if event["type"] == "speech.audio.delta":
            sent += len(base64.b64decode(event["audio"])) // 2
        elif event["type"] == "speech.timestamps.delta":
            assert all(entry["start"] * 22050 >= sent - 1 for entry in event["alignment"])


def test_a_buffered_timed_answer_crosses_the_node_as_the_contracts_document(front: int) -> None:
    """
    Buffered: one document valid against the contract, its WAV audio and every word.
    """
    body = {"engine": "espeak", "text": TEXT, "format": "wav", "stream": False, "timestamps": "word"}
    status, headers, raw = post(front, body, "application/json")
    assert status == 200, raw[:300]
    document = json.loads(raw)
    contract.validate(contract.TIMED_AUDIO, document)
    assert base64.b64decode(document["audio"])[:4] == b"RIFF" and document["sampleRate"] == 22050
    assert [TEXT[w["textStart"]:w["textEnd"]] for w in document["alignment"]] == [w["text"] for w in document["alignment"]]
    assert headers["x-rhapsode-node"] == "box-1"
