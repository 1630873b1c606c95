"""
The core's side of engines whose models are served elsewhere, and of instructions: the
preflight takes instructions only where the variant declares them; residency leases a
remote model outside the budget (never counted, evicted, expired or waited on, shown
with its server, unload unsupported); the watchdog fences a variant whose server the
worker cannot reach and lifts the fence once it can.
"""

from __future__ import annotations

from typing import Any

import pytest
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from rhapsode._fleet.registry import EngineHandle, Registry
from rhapsode._fleet.watchdog import Watchdog
from rhapsode._speech.preflight import forward_speak
from rhapsode._speech.relay import remote_server
from rhapsode_protocol import contract
from rhapsode_protocol.errors import BadRequest, ModelUnavailable, Unsupported

from _deferreds import failure_of, result_of
from _fakes import FakeClient, FakeSupervisor
from test_residency import Harness

SERVER = "http://10.0.0.9:8091"


def caps() -> dict[str, Any]:
    """
    A capability document of three variants: one takes style instructions, one a
    designed voice (required), one none; the first two served elsewhere.
    """
    base = {"cues": [], "deliveries": [], "dials": {}, "languages": ["en"], "maxCharacters": 200,
            "segmentation": {"supported": False}, "streaming": {"supported": True, "granularity": "chunk"}}
    return {
        "formats": ["wav", "pcm"],
        "defaultVariant": "custom",
        "variants": {
            "custom": {**base, "instructions": {"kind": "style", "maxCharacters": 20, "required": False},
                       "remote": {"server": SERVER, "model": "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice"}},
            "design": {**base, "instructions": {"kind": "design", "maxCharacters": 500, "required": True},
                       "remote": {"server": SERVER}},
            "plain": base,
        },
    }


def test_instructions_are_forwarded_where_declared_and_refused_elsewhere() -> None:
    """
    A style variant's request goes to the worker with its instructions; the variant
    that declares none is unsupported naming instructions; over the variant's ceiling,
    or missing where required, is bad_request naming them.
    """
    body = {"engine": "q", "text": "Hello.", "instructions": "Warmly."}
    assert forward_speak(body, caps(), "custom")["instructions"] == "Warmly."
    with pytest.raises(Unsupported) as unsupported:
        forward_speak(body, caps(), "plain")
    assert unsupported.value.field == "instructions"
    for wrong, variant in (({**body, "instructions": "x" * 21}, "custom"), ({"engine": "q", "text": "Hi."}, "design")):
        with pytest.raises(BadRequest) as bad:
            forward_speak(wrong, caps(), variant)
        assert bad.value.field == "instructions"


def test_the_server_of_a_variant_is_read_from_its_remote() -> None:
    """
    remote.server names where a variant's model lives; a local variant has none.
    """
    assert remote_server(caps(), "custom") == SERVER
    assert remote_server(caps(), "plain") is None and remote_server(caps(), "nosuch") is None


def test_a_remote_model_takes_no_room_and_waits_on_nothing() -> None:
    """
    With room for one model, a local model leased and two remote variants of another
    engine leased beside it: nothing was evicted or waited for, the remote ones are
    listed with their server and a keep-alive of never but not counted, and a second
    local engine still evicts only the local one.
    """
    box = Harness()
    local = box.lease("kokoro")
    styled = result_of(Deferred.fromCoroutine(box.residency.acquire("qwen", "custom", None, SERVER)))
    designed = result_of(Deferred.fromCoroutine(box.residency.acquire("qwen", "design", 0, SERVER)))
    snapshot = box.residency.snapshot()
    contract.validate(contract.RESIDENCY, snapshot)
    assert snapshot["resident"] == 1 and box.calls == []
    remote = [m for m in snapshot["models"] if m.get("server")]
    assert [(m["engine"], m["variant"], m["leases"], m["keepAliveSeconds"], m["server"]) for m in remote] == [
        ("qwen", "custom", 1, -1, SERVER), ("qwen", "design", 1, -1, SERVER)]
    assert "expiresAt" not in remote[0]
    local.release()
    styled.release()
    designed.release()
    box.clock.advance(10_000)  # past every keep-alive: only the local model expires
    assert box.calls == [("terminate", "kokoro")]
    assert [m["leases"] for m in box.residency.snapshot()["models"]] == [0, 0]
    assert box.residency.state("qwen") == {"resident": False, "leases": 0,
                                           "served": {"custom": SERVER, "design": SERVER}}


def test_unloading_a_model_served_elsewhere_is_unsupported() -> None:
    """
    There is nothing here to give back, and the server that holds the model is not this
    core's: unload answers unsupported naming the server, and terminates nothing.
    """
    box = Harness()
    result_of(Deferred.fromCoroutine(box.residency.acquire("qwen", "custom", None, SERVER))).release()
    failure = failure_of(box.unload("qwen"))
    assert failure.check(Unsupported)
    assert SERVER in failure.value.message and failure.value.field == "engine"
    assert box.calls == []


def test_the_watchdog_fences_a_variant_whose_server_the_worker_cannot_reach() -> None:
    """
    A worker whose health names a variant unreachable keeps its process (it is not what
    is down), and that variant is refused as model_unavailable, retryable, until a later
    check no longer names it; other variants are not refused.
    """
    client, supervisor = FakeClient(hold=True), FakeSupervisor("up", 7)
    handle = EngineHandle("qwen", client, supervisor)
    clock = Clock()
    dog = Watchdog(Registry({"qwen": handle}), clock, interval=5, patience=15)
    dog.start()
    clock.advance(5)
    client.asked[-1].callback((200, {"process": "up", "unreachable": {"custom": f"{SERVER} refused the connection"}}))
    assert supervisor.hangs == []
    with pytest.raises(ModelUnavailable) as refused:
        handle.check_reachable("custom")
    assert refused.value.retryable and "refused the connection" in refused.value.message
    handle.check_reachable("design")
    assert handle.health()["unreachable"] == {"custom": f"{SERVER} refused the connection"}
    clock.advance(5)
    client.asked[-1].callback((200, {"process": "up"}))
    handle.check_reachable("custom")
    assert "unreachable" not in handle.health()
    dog.stop()
