"""
The Dia engine through a real worker in its own virtualenv (.venvs/dia), with a random
Dia of the real architecture at a tiny size (tools/random_weights/build_dia.py), pulled
from a hub of our own on loopback by the real client, loaded by transformers'
from_pretrained, and spoken with a capped frame count: capabilities, the pull and its
progress, clones that need a transcript, speech, dialogue with cues, seeds, memory given
back by an unload, and the conformance checker.  Content is never asserted: the weights
are random.
"""

from __future__ import annotations

import io
import json
import os
import wave
from typing import Any, AsyncIterator

import pytest
import pytest_twisted
from _torch import Built, Served, build, conform, logged, serve
from _worker import deferred_raw, resident_kib
from test_conform import check_summary, failures, lines_of
from test_voices_dialogue import create, sine_wav
from twisted.internet.threads import deferToThread

RATE = 44_100
VARIANT = "1.6b"
#: More than Dia's 15-step codebook delay, or nothing decodes.
FRAMES = "24"


#: tiny for every push; real (Dia-1.6B's own architecture, 6.4 GB) under make test-heavy.
SIZE = os.environ.get("RHAPSODE_TEST_DIA_SIZE", "tiny")


@pytest.fixture(scope="module")
def built() -> Built:
    return build("dia", "--size", SIZE)


@pytest_twisted.async_yield_fixture(scope="module")
async def dia(built: Built, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Served]:
    """One Dia worker for the module, fetching from the test hub into a cache of its own."""
    served = await serve("dia", built, tmp_path_factory.mktemp("dia"), {"RHAPSODE_DIA_MAX_TOKENS": FRAMES})
    yield served
    await served.stop()


async def wav(served: Served, path: str, body: dict[str, Any]) -> bytes:
    """A buffered WAV from C{path}: its format checked, its PCM returned."""
    response = await deferred_raw(served.worker.socket_path, "POST", path,
                                  json.dumps({"format": "wav", "stream": False, **body}).encode())
    assert response.status == 200, response.body[:500]
    with wave.open(io.BytesIO(response.body)) as audio:
        assert (audio.getframerate(), audio.getnchannels(), audio.getsampwidth()) == (RATE, 1, 2)
        return audio.readframes(audio.getnframes())


@pytest_twisted.ensureDeferred
async def test_capabilities_before_any_load(dia: Served) -> None:
    """
    Without a model the worker describes its one variant: two speakers of dialogue, the
    eight cues, its dials, cloning, 44.1 kHz output, the licences, and the CPU it was given.
    """
    code, caps = await dia.worker.json("GET", "/capabilities")
    assert code == 200
    assert "current" not in caps
    variant = caps["variants"][VARIANT]
    assert variant["dialogue"] == {"maxSpeakers": 2}
    assert sorted(variant["cues"]) == sorted(
        ["laugh", "chuckle", "sigh", "gasp", "cough", "clear throat", "sniff", "groan"])
    assert set(variant["dials"]) == {"temperature", "cfgScale", "topP"}
    assert variant["cloning"]["supported"] is True
    assert caps["nativeFormat"]["sampleRate"] == RATE
    assert caps["license"]["code"] == caps["license"]["weights"] == "Apache-2.0"
    assert caps["device"]["type"] == "cpu"


@pytest_twisted.ensureDeferred
async def test_pull_through_the_hub(dia: Served, built: Built) -> None:
    """
    POST /fetch downloads both repositories through huggingface_hub from the test hub,
    sending the token, logging its progress as an install job relays it, into the hub
    cache at the commit the branch resolves to, and verified; a second fetch downloads
    nothing.
    """
    code, _ = await dia.worker.json("POST", "/fetch", {"variant": VARIANT})
    assert code == 204
    for repo, folder in built.repos.items():
        snapshot = dia.cache / f"models--{repo.replace('/', '--')}" / "snapshots" / built.commit
        assert snapshot.is_dir(), repo
        files = [p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")]
        assert files
        for path in files:
            assert (snapshot / path.name).read_bytes() == path.read_bytes(), path.name
    lines = await logged(dia.worker, lambda ls: any("verified" in line for line in ls))
    progress = [line for line in lines if line.startswith("Progress ")]
    assert progress, lines[-20:]
    done, _, total = progress[-1][len("Progress "):].partition(" of ")
    assert done == total
    assert any("verified" in line for line in lines)
    served = dict(dia.hub.served)
    code, _ = await dia.worker.json("POST", "/fetch", {"variant": VARIANT})
    assert code == 204
    assert dia.hub.served == served


@pytest_twisted.ensureDeferred
async def test_a_clone_needs_its_transcript(dia: Served) -> None:
    """
    A clip without the words said in it is refused naming transcript; with them it is a
    voice, listed, and gone once deleted.
    """
    clip = {"reference": ("clip.wav", sine_wav(150, seconds=4.0, rate=RATE))}
    code, body = await create(dia.worker, {"id": "host", "label": "Host"}, clip)
    assert code == 400 and body["error"]["code"] == "bad_request" and body["error"]["field"] == "transcript"
    code, body = await create(dia.worker, {"id": "host", "label": "Host", "transcript": "Hello and welcome."}, clip)
    assert code == 201, body
    code, listed = await dia.worker.json("GET", "/voices")
    assert [v["id"] for v in listed] == ["host"]


@pytest_twisted.ensureDeferred
async def test_speak_loads_on_demand_and_speaks_44k(dia: Served) -> None:
    """
    /speak with no model loaded loads it through transformers and answers 44.1 kHz audio,
    with a cue in the text; then in the cloned voice; /health reports what the load took.
    """
    pcm = await wav(dia, "/speak", {"text": "Hello there. [laugh] That was quick."})
    assert len(pcm) > 0
    code, health = await dia.worker.json("GET", "/health")
    assert health["model"] == "loaded" and health["device"] == "cpu"
    assert health.get("modelBytes", 0) > 0
    cloned = await wav(dia, "/speak", {"text": "And now in the host's voice.", "voice": "host"})
    assert len(cloned) > 0


@pytest_twisted.ensureDeferred
async def test_dialogue_for_two_speakers(dia: Served) -> None:
    """
    /dialogue renders two speakers in one take, with cues, one of them in a cloned voice;
    a third speaker is unsupported.
    """
    turns = [{"speaker": "a", "text": "Did you hear that? [gasp]"},
             {"speaker": "b", "text": "[laugh] It's only the cat."},
             {"speaker": "a", "text": "It is never only the cat."}]
    pcm = await wav(dia, "/dialogue", {"turns": turns, "voices": {"b": "host"}})
    assert len(pcm) > 0
    response = await deferred_raw(dia.worker.socket_path, "POST", "/dialogue", json.dumps(
        {"turns": turns + [{"speaker": "c", "text": "Me too."}], "format": "wav", "stream": False}).encode())
    assert response.status == 422


@pytest_twisted.ensureDeferred
async def test_a_seed_reproduces_a_take(dia: Served) -> None:
    """The same seed gives the same bytes; another seed, other bytes."""
    first = await wav(dia, "/speak", {"text": "Seeded words.", "seed": 7})
    again = await wav(dia, "/speak", {"text": "Seeded words.", "seed": 7})
    other = await wav(dia, "/speak", {"text": "Seeded words.", "seed": 8})
    assert first == again
    assert first != other


@pytest_twisted.ensureDeferred
async def test_unload_gives_the_memory_back(dia: Served) -> None:
    """
    An unload drops the model: the worker's resident set falls back by most of what the
    load took, and a later /speak loads it again.
    """
    code, health = await dia.worker.json("GET", "/health")
    if health["model"] != "loaded":
        await wav(dia, "/speak", {"text": "Load me."})
        code, health = await dia.worker.json("GET", "/health")
    loaded = resident_kib(dia.worker.pid) * 1024
    model_bytes = health["modelBytes"]
    code, _ = await dia.worker.json("POST", "/unload")
    assert code in (200, 204)
    code, health = await dia.worker.json("GET", "/health")
    assert health["model"] == "unloaded" and "modelBytes" not in health
    freed = loaded - resident_kib(dia.worker.pid) * 1024
    assert freed > 0.5 * model_bytes, (freed, model_bytes)
    assert any("unloaded" in line for line in await logged(dia.worker, lambda ls: any("unloaded" in x for x in ls)))


@pytest_twisted.ensureDeferred
async def test_dia_conforms(dia: Served) -> None:
    """
    The Dia worker passes every check the checker can decide: cues, a seed, dialogue and
    a clone among them.
    """
    # In a thread: the reactor keeps reading the worker's log pipe meanwhile, which a
    # blocked reactor would let fill until the worker stalled writing to it.
    run = await deferToThread(conform, dia.worker.socket_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert failures(run) == {}
    check_summary(run)
    passed = set(lines_of(run, "pass  "))
    assert "a seed reproduces audio in variant 1.6b" in passed, run.stdout
