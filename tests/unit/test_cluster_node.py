"""
A core as a cluster's node (server.role "node") and as a cluster's front (an engine whose
"cluster" is set), in memory: the node serves its engines' worker routes under its own
turns and leases and says who it is; the front takes neither for a cluster engine, names
the model each request is for, and passes on the node that answered.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from treq.testing import StubTreq
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, succeed
from twisted.internet.error import ConnectionLost
from twisted.internet.protocol import Protocol
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from rhapsode._config import parse_config
from rhapsode._fleet.registry import EngineHandle, Registry
from rhapsode._service import RhapsodeService, build_core
from rhapsode._speech.relay import KEEP_ALIVE_HEADER, MODEL_HEADER, NODE_HEADER
from rhapsode._upstream import ClusterClient
from rhapsode_protocol import contract, frames
from rhapsode_protocol.errors import ModelUnavailable

from _fakes import FakeClient, FakeResponse, FakeSupervisor
from test_router import CAPABILITIES

AUDIO = b"RIFF" + b"\x00" * 1020


class SpeakingClient(FakeClient):
    """
    The shared fake worker client, whose speech answers a WAV (with a node's name, where
    it stands for a cluster) and whose JSON answers are its capabilities and voices.
    """

    def __init__(self, node: bytes | None = None) -> None:
        super().__init__({(b"GET", "/capabilities"): (200, CAPABILITIES), (b"GET", "/voices"): (200, [])})
        self.node = node

    def request(self, method: bytes, path: str, body: Any = None, headers: Any = None) -> "Deferred[Any]":
        super().request(method, path, body, headers)
        answer = {b"Content-Type": b"audio/wav", b"X-Rhapsode-Duration-Ms": b"21", b"Content-Length": b"1024"}
        if self.node is not None:
            answer[NODE_HEADER] = self.node
        return succeed(FakeResponse(200, AUDIO, answer))


def node_core(client: FakeClient | None = None) -> tuple[Any, StubTreq, FakeClient, FakeSupervisor]:
    client = client or SpeakingClient()
    supervisor = FakeSupervisor()
    core = build_core(Registry({"tone": EngineHandle("tone", client, supervisor)}), reactor=MemoryReactorClock(),
                      node="box-1")
    return core, StubTreq(core.resource()), client, supervisor


def answered(stub: StubTreq, method: str, path: str, body: Any = None, headers: Any = None) -> tuple[Any, bytes]:
    case = SynchronousTestCase()
    data = json.dumps(body).encode() if body is not None else None
    response = case.successResultOf(stub.request(method, "http://node" + path, data=data, headers=headers))
    return response, case.successResultOf(response.content())


def test_a_node_answers_its_state_from_its_own_state() -> None:
    """
    GET /node names the node, its engines, its residency, its free slots and leases and
    the machine's memory, and starts nothing to say so.
    """
    core, stub, client, supervisor = node_core()
    response, raw = answered(stub, "GET", "/node")
    state = json.loads(raw)
    assert response.code == 200 and response.headers.getRawHeaders(NODE_HEADER) == [b"box-1"]
    assert state["node"] == "box-1" and state["engines"] == ["tone"]
    assert state["slots"] == 1 and state["leases"] == 0 and state["residency"]["models"] == []
    assert set(state["memory"]) in ({"totalBytes", "freeBytes"}, set())
    assert supervisor.starts == 0 and client.calls == []


def test_a_node_speaks_a_forwarded_body_under_its_own_lease_and_keep_alive() -> None:
    """
    POST /worker/tone/speak relays a worker request to the node's own worker, under the
    node's turn and lease, with the keep-alive the front passed on; the answer is the
    worker's, and says which node gave it.
    """
    core, stub, client, _ = node_core()
    body = {"text": "Hello there.", "variant": "expressive", "format": "wav", "stream": False}
    response, audio = answered(stub, "POST", "/worker/tone/speak", body, {KEEP_ALIVE_HEADER: [b"60"]})
    assert response.code == 200 and audio == AUDIO
    assert response.headers.getRawHeaders(NODE_HEADER) == [b"box-1"]
    assert response.headers.getRawHeaders(b"X-Rhapsode-Duration-Ms") == [b"21"]
    [(method, path, sent)] = [r for r in client.requests if r[1] == "/speak"]
    assert json.loads(sent.data) == body
    [model] = core.residency.snapshot()["models"]
    assert (model["engine"], model["variant"], model["keepAliveSeconds"]) == ("tone", "expressive", 60)


def test_a_node_refuses_what_it_cannot_speak_as_a_worker_would() -> None:
    """
    A forwarded body naming a variant the engine lacks, or with a field the worker
    protocol does not have, is refused in the taxonomy's envelope before any lease.
    """
    core, stub, client, _ = node_core()
    response, raw = answered(stub, "POST", "/worker/tone/speak", {"text": "Hi.", "variant": "nope"})
    assert response.code == 422 and json.loads(raw)["error"]["field"] == "variant"
    response, raw = answered(stub, "POST", "/worker/tone/speak", {"text": "Hi.", "engine": "tone"})
    assert response.code == 400 and json.loads(raw)["error"]["code"] == "bad_request"
    assert core.residency.snapshot()["models"] == []


def test_a_node_never_lets_a_front_unload_or_terminate_its_models() -> None:
    """
    The worker verbs a front would use to evict are refused as unsupported: the node's
    own residency decides what leaves its card.
    """
    _, stub, client, supervisor = node_core()
    for verb in ("unload", "terminate"):
        response, raw = answered(stub, "POST", f"/worker/tone/{verb}")
        assert response.code == 422 and json.loads(raw)["error"]["code"] == "unsupported"
    assert supervisor.stops == [] and client.calls == []


def test_a_node_answers_an_engines_health_without_starting_its_worker() -> None:
    """
    A front's watchdog asking a node about an engine is answered from the node's state:
    no worker is started to say so.
    """
    _, stub, client, supervisor = node_core()
    response, raw = answered(stub, "GET", "/worker/tone/health")
    health = json.loads(raw)
    assert response.code == 200 and health["node"] == "box-1" and health["model"]["resident"] is False
    assert supervisor.starts == 0 and client.calls == []


def test_a_core_that_is_no_node_has_no_node_routes() -> None:
    """
    An ordinary core answers neither /node nor any worker route.
    """
    core = build_core(Registry({"tone": EngineHandle("tone", SpeakingClient(), FakeSupervisor())}),
                      reactor=MemoryReactorClock())
    stub = StubTreq(core.resource())
    assert answered(stub, "GET", "/node")[0].code == 404
    assert answered(stub, "POST", "/worker/tone/speak", {"text": "Hi."})[0].code == 404


def test_a_front_takes_no_turn_or_lease_for_a_cluster_engine_and_names_its_model() -> None:
    """
    Speech for an engine on a cluster goes out naming its model (engine/variant) and the
    caller's keep-alive for the node; the front holds no lease, shows nothing resident,
    and passes on the node that answered.
    """
    client = SpeakingClient(node=b"box-2")
    core = build_core(Registry({"tone": EngineHandle("tone", client, None, elsewhere=True)}),
                      reactor=MemoryReactorClock())
    stub = StubTreq(core.resource())
    body = {"engine": "tone", "text": "Hello there.", "format": "wav", "stream": False, "keepAliveSeconds": 90}
    response, audio = answered(stub, "POST", "/speak", body)
    assert response.code == 200 and audio == AUDIO
    assert response.headers.getRawHeaders(NODE_HEADER) == [b"box-2"]
    [headers] = client.sent_headers
    assert headers[MODEL_HEADER] == [b"tone/expressive"] and headers[KEEP_ALIVE_HEADER] == [b"90"]
    assert core.residency.snapshot()["models"] == []
    assert core.relay.turnstile.state("tone") == {"speaking": 0, "queued": 0}
    # Nor is the worker asked for its voices first: the node checks, knowing its card.
    assert (b"GET", "/voices") not in client.calls


def test_a_front_refuses_to_unload_a_cluster_engine() -> None:
    """
    POST /engines/{id}/unload (from this machine, so past the guard) on an engine the
    cluster's nodes own is unsupported, and says where to unload it.
    """
    core = build_core(Registry({"tone": EngineHandle("tone", SpeakingClient(), None, elsewhere=True)}),
                      reactor=MemoryReactorClock())
    channel = core.site().buildProtocol(IPv4Address("TCP", "127.0.0.1", 8080))
    transport = StringTransport(peerAddress=IPv4Address("TCP", "127.0.0.1", 40000))
    channel.makeConnection(transport)
    channel.dataReceived(b"POST /engines/tone/unload HTTP/1.0\r\nHost: localhost\r\n\r\n")
    head, _, body = transport.value().partition(b"\r\n\r\n")
    error = json.loads(body)["error"]
    assert head.startswith(b"HTTP/1.0 422") and error["code"] == "unsupported" and "cluster" in error["message"]


def test_a_cluster_engine_in_the_config_is_one_upstream_naming_its_engine(tmp_path: Path) -> None:
    """
    engines.<id>.cluster makes a remote engine reached through the cluster's Serve app
    (each request routed there, then sent to the node it names), whose models this core
    never counts.
    """
    config = parse_config({"engines": {"tone": {"cluster": "http://head:8000/rhapsode/"}}}, tmp_path)
    service = RhapsodeService(config, MemoryReactorClock())
    core = service.build()
    handle = core.registry.get("tone")
    assert handle.elsewhere and handle.supervisor is None
    assert isinstance(handle.client, ClusterClient)
    assert handle.client.address == "http://head:8000/rhapsode/_route" and handle.client.engine_id == "tone"
    assert service.cluster is not None and service.cluster.urls == ["http://head:8000/rhapsode"]


class Routing(FakeClient):
    """
    A cluster app that routes every request to one node, recording the model each named.
    """

    def __init__(self, answer: bytes = b'{"node": "box-3", "url": "http://10.0.0.3:9000"}', code: int = 200) -> None:
        super().__init__()
        self.answer = answer
        self.code = code

    def request(self, method: bytes, path: str, body: Any = None, headers: Any = None) -> "Deferred[Any]":
        super().request(method, path, body, headers)
        return succeed(FakeResponse(self.code, self.answer, {b"Content-Type": b"application/json"}))


def test_a_cluster_client_asks_the_cluster_then_speaks_to_the_node_itself() -> None:
    """
    Each request is routed by the cluster (GET /_route naming its model, the engine's
    own where the request names none) and then sent, headers and all, to that node
    core's /worker/<engine>; a node's client is kept for the next request.
    """
    app = Routing()
    made: dict[str, SpeakingClient] = {}

    def node(url: str) -> SpeakingClient:
        made[url] = SpeakingClient(node=b"box-3")
        return made[url]

    client = ClusterClient(app, "tone", MODEL_HEADER, node)
    case = SynchronousTestCase()
    headers = {MODEL_HEADER: [b"tone/classic"], KEEP_ALIVE_HEADER: [b"30"]}
    response = case.successResultOf(client.request(b"POST", "/speak", None, headers))
    assert response.code == 200 and client.last_node == "box-3"
    assert app.requests == [(b"GET", "/_route", None)] and app.sent_headers == [{MODEL_HEADER: [b"tone/classic"]}]
    [worker] = made.values()
    assert list(made) == ["http://10.0.0.3:9000/worker/tone"] and worker.sent_headers == [headers]
    code, caps = case.successResultOf(Deferred.fromCoroutine(client.json(b"GET", "/capabilities")))
    assert code == 200 and caps == CAPABILITIES and len(made) == 1
    assert app.sent_headers[-1] == {MODEL_HEADER: [b"tone"]}


def test_a_cluster_that_names_no_node_is_a_model_unavailable() -> None:
    """
    An answer to /_route that is not a node (the app's error, a body that is not one,
    JSON nested too deep to parse) fails the request as retryable model_unavailable,
    sending nothing on.
    """
    case = SynchronousTestCase()
    deep = Routing(b"[" * 1100 + b"]" * 1100)
    for app in (Routing(b'{"error": "no replicas"}', 503), Routing(b"not json"), deep):
        client = ClusterClient(app, "tone", MODEL_HEADER, lambda url: SpeakingClient())
        failure = case.failureResultOf(client.request(b"POST", "/speak"), ModelUnavailable)
        assert failure.value.retryable


def test_a_cluster_client_keeps_the_clusters_answer_a_moment_and_drops_it_on_failure() -> None:
    """
    For a second the cluster's answer for a model stands for a request made when no
    other for that model is being answered (no second /_route); a request to the node
    that fails before its answer drops it, so the next asks afresh; and once the second
    is over the cluster is asked again.
    """
    clock = MemoryReactorClock()
    app = Routing()
    worker = FakeClient()
    client = ClusterClient(app, "tone", MODEL_HEADER, lambda url: worker, clock)
    headers = {MODEL_HEADER: [b"tone/classic"]}
    case = SynchronousTestCase()
    first = client.request(b"POST", "/speak", None, headers)
    worker.pending[0].callback(FakeResponse(200, b"pcm", {}))
    case.successResultOf(first).deliverBody(Protocol())
    second = client.request(b"POST", "/speak", None, headers)
    assert len(app.requests) == 1 and len(worker.pending) == 2
    worker.pending[1].errback(ConnectionRefusedError())
    case.failureResultOf(second, ConnectionRefusedError)
    third = client.request(b"POST", "/speak", None, headers)
    assert len(app.requests) == 2
    worker.pending[2].callback(FakeResponse(200, b"pcm", {}))
    case.successResultOf(third).deliverBody(Protocol())
    fourth = client.request(b"POST", "/speak", None, headers)
    assert len(app.requests) == 2
    worker.pending[3].callback(FakeResponse(200, b"pcm", {}))
    case.successResultOf(fourth).deliverBody(Protocol())
    clock.advance(1.5)
    client.request(b"POST", "/speak", None, headers)
    assert len(app.requests) == 3


class CutResponse(FakeResponse):
    """
    A node's response whose body is cut short: some audio, then the connection lost.
    """

    def __init__(self) -> None:
        super().__init__(200, b"pcm", {})

    def deliverBody(self, protocol: Any) -> None:
        protocol.makeConnection(StringTransport())
        protocol.dataReceived(self._body)
        protocol.connectionLost(Failure(ConnectionLost()))


def test_a_request_made_while_its_model_is_being_answered_asks_the_cluster() -> None:
    """
    While a request for a model is being answered (its head not yet come, or its body
    not yet ended), another for the same model asks the cluster's router, which sees
    every node's leases, rather than following the kept answer to the same node; once
    every body has ended, however it ended, the kept answer stands again; a request for
    another model is not held to the first's.
    """
    clock = MemoryReactorClock()
    app = Routing()
    worker = FakeClient()
    client = ClusterClient(app, "tone", MODEL_HEADER, lambda url: worker, clock)
    classic = {MODEL_HEADER: [b"tone/classic"]}
    expressive = {MODEL_HEADER: [b"tone/expressive"]}
    case = SynchronousTestCase()
    first = client.request(b"POST", "/speak", None, classic)
    second = client.request(b"POST", "/speak", None, classic)
    assert len(app.requests) == 2
    worker.pending[0].callback(FakeResponse(200, b"pcm", {}))
    worker.pending[1].callback(CutResponse())
    client.request(b"POST", "/speak", None, expressive)
    assert len(app.requests) == 3  # another model's answer is kept apart
    fourth = client.request(b"POST", "/speak", None, classic)
    assert len(app.requests) == 4  # both heads came, neither body has been read
    reader = Protocol()
    case.successResultOf(first).deliverBody(reader)
    assert isinstance(reader.transport, StringTransport)  # the reader has the body's own transport
    fifth = client.request(b"POST", "/speak", None, classic)
    assert len(app.requests) == 5  # the second's body is unread, the fourth has no head
    case.successResultOf(second).deliverBody(Protocol())
    worker.pending[3].errback(ConnectionRefusedError())
    case.failureResultOf(fourth, ConnectionRefusedError)
    worker.pending[4].callback(FakeResponse(200, b"pcm", {}))
    case.successResultOf(fifth).deliverBody(Protocol())
    sixth = client.request(b"POST", "/speak", None, classic)
    assert len(app.requests) == 6  # nothing is being answered, but the failure dropped the kept answer
    worker.pending[5].callback(FakeResponse(200, b"pcm", {}))
    seventh = client.request(b"POST", "/speak", None, classic)
    assert len(app.requests) == 7  # the sixth's body is unread
    case.successResultOf(sixth).deliverBody(Protocol())
    worker.pending[6].callback(FakeResponse(200, b"pcm", {}))
    case.successResultOf(seventh).deliverBody(Protocol())
    client.request(b"POST", "/speak", None, classic)
    assert len(app.requests) == 7  # every body ended: the kept answer stands


TIMED_CAPABILITIES = {
    **CAPABILITIES,
    "variants": {
        name: {**variant, "timestamps": {"units": ["word"], "source": "synthesizer", "textOffsets": True}}
        for name, variant in CAPABILITIES["variants"].items()
    },
}
WORD = {"unit": "word", "text": "Hello", "start": 0.0, "end": 0.3, "textStart": 0, "textEnd": 5}
LATER = {"unit": "word", "text": "there", "start": 0.35, "end": 0.6, "textStart": 6, "textEnd": 11}
PCM = b"\x01\x02" * 400


def worker_frames(stream: bool) -> bytes:
    """What a worker answers a timed request in frames: timings before their audio, then the end."""
    end: dict[str, Any] = {"durationMs": 18}
    if not stream:
        end.update({"format": "wav", "contentType": "audio/wav", "sampleRate": 22050,
                    "channels": 1})
    return b"".join([
        frames.frame(frames.TIMINGS, json.dumps([WORD]).encode()),
        frames.frame(frames.AUDIO, PCM[:400]),
        frames.frame(frames.TIMINGS, json.dumps([LATER]).encode()),
        frames.frame(frames.AUDIO, PCM[400:]),
        frames.frame(frames.DONE, json.dumps(end).encode()),
    ])


class FramingWorker(FakeClient):
    """
    A node's worker that times words: it answers a timed request in the frames the core
    asks for, with the audio's own type in its header, and records what it was asked.
    """

    def __init__(self) -> None:
        super().__init__({(b"GET", "/capabilities"): (200, TIMED_CAPABILITIES), (b"GET", "/voices"): (200, [])})

    def request(self, method: bytes, path: str, body: Any = None, headers: Any = None) -> "Deferred[Any]":
        super().request(method, path, body, headers)
        stream = json.loads(body.data).get("stream", True)
        answer = {b"Content-Type": frames.FRAMES.encode(), b"X-Rhapsode-Audio-Type": b"audio/wav"}
        return succeed(FakeResponse(200, worker_frames(stream), answer))


class NodeDoor(FakeClient):
    """
    A cluster front's client of one node: JSON from the table, speech sent through the
    node core's own resource at /worker/tone, as the cluster client sends it.
    """

    def __init__(self, node: StubTreq) -> None:
        super().__init__({(b"GET", "/capabilities"): (200, TIMED_CAPABILITIES)})
        self.node = node

    def request(self, method: bytes, path: str, body: Any = None, headers: Any = None) -> "Deferred[Any]":
        super().request(method, path, body, headers)
        return self.node.request(method.decode(), "http://node/worker/tone" + path, data=body.data,
                                 headers=dict(headers or {}))


def front_of_a_node() -> tuple[StubTreq, StubTreq, FramingWorker, NodeDoor]:
    worker = FramingWorker()
    _, node, _, _ = node_core(worker)
    door = NodeDoor(node)
    front = build_core(Registry({"tone": EngineHandle("tone", door, None, elsewhere=True)}),
                       reactor=MemoryReactorClock())
    return StubTreq(front.resource()), node, worker, door


def test_timings_pass_through_a_node_in_frames_to_the_fronts_events() -> None:
    """
    A timed stream to a cluster engine: the front asks the node for frames as it asks a
    worker, the node asks its worker the same and passes the frames on (the audio's
    type in its header), and the front's caller gets the contract's events, each
    timing before the audio holding its first sample, and the end with the duration.
    """
    front, node, worker, door = front_of_a_node()
    body = {"engine": "tone", "text": "Hello there.", "format": "wav", "timestamps": "word"}
    response, raw = answered(front, "POST", "/speak", body, {b"Accept": [b"text/event-stream"]})
    assert response.code == 200, raw
    assert response.headers.getRawHeaders(b"Content-Type") == [b"text/event-stream"]
    assert response.headers.getRawHeaders(NODE_HEADER) == [b"box-1"]
    assert door.sent_headers[0][b"Accept"] == [frames.FRAMES.encode()]
    assert worker.sent_headers[0][b"Accept"] == [frames.FRAMES.encode()]
    events = [json.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: ")]
    kinds = [event["type"] for event in events]
    assert kinds[0] == "speech.timestamps.delta" and kinds[-1] == "speech.audio.done"
    assert [e["alignment"] for e in events if e["type"] == "speech.timestamps.delta"] == [[WORD], [LATER]]
    audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert audio == PCM and events[-1]["durationMs"] == 18
    # LATER's first sample is in the second piece: its timing comes before that piece.
    later = kinds.index("speech.timestamps.delta", 1)
    assert 0 < later < len(kinds) - 1 and "speech.audio.delta" in kinds[later + 1:]


def test_a_buffered_timed_answer_passes_through_a_node_as_one_document() -> None:
    """
    Buffered, the node writes its worker's frames whole, its end saying what the audio
    is, and the front answers the contract's JSON document with all of the alignment.
    """
    front, node, worker, door = front_of_a_node()
    body = {"engine": "tone", "text": "Hello there.", "format": "wav", "stream": False, "timestamps": "word"}
    response, raw = answered(front, "POST", "/speak", body, {b"Accept": [b"application/json"]})
    assert response.code == 200, raw
    document = json.loads(raw)
    contract.validate(contract.TIMED_AUDIO, document)
    assert base64.b64decode(document["audio"]) == PCM and document["alignment"] == [WORD, LATER]
    assert (document["sampleRate"], document["durationMs"]) == (22050, 18)


def test_a_node_answers_anyone_else_timings_as_the_public_api_does() -> None:
    """
    Asked for timings without frames in its Accept (a person with curl at the node
    door), the node answers the contract's events, and refuses an Accept that names
    neither with the field named.
    """
    _, node, _, _ = node_core(FramingWorker())
    body = {"text": "Hello there.", "variant": "expressive", "format": "wav", "timestamps": "word"}
    response, raw = answered(node, "POST", "/worker/tone/speak", body, {b"Accept": [b"text/event-stream"]})
    assert response.code == 200 and raw.startswith(b"event: speech.timestamps.delta")
    response, raw = answered(node, "POST", "/worker/tone/speak", body, {b"Accept": [b"audio/wav"]})
    assert response.code == 400 and json.loads(raw)["error"]["field"] == "timestamps"
