"""
Voices and dialogue through a real tone worker (protocol.md sections 6 and 7): cloning
from a WAV upload, blending, deleting, the id rule, the upload cap, and conversations.
"""

from __future__ import annotations

import io
import json
import math
import struct
import uuid
import wave
from typing import Any

import pytest
import pytest_twisted

from _worker import Worker, deferred_raw

RATE = 24000


def sine_wav(frequency: float, seconds: float = 2.0, rate: int = 16000) -> bytes:
    """
    A voiced-sounding clip: a fundamental with two harmonics.
    """
    frames = bytearray()
    for n in range(int(seconds * rate)):
        t = n / rate
        value = 0.5 * math.sin(2 * math.pi * frequency * t) + 0.25 * math.sin(4 * math.pi * frequency * t)
        value += 0.12 * math.sin(6 * math.pi * frequency * t)
        frames += struct.pack("<h", int(value * 20000))
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(bytes(frames))
    return out.getvalue()


def multipart(fields: dict[str, str], files: dict[str, tuple[str, bytes]] | None = None) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    parts = []
    for name, value in fields.items():
        parts.append(
            f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
        )
    for name, (filename, data) in (files or {}).items():
        parts.append(
            f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{filename}"\r\n'
            f"Content-Type: application/octet-stream\r\n\r\n".encode()
            + data
            + b"\r\n"
        )
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


async def create(worker: Worker, fields: dict[str, str], files: dict[str, tuple[str, bytes]] | None = None) -> tuple[int, Any]:
    data, ctype = multipart(fields, files)
    response = await deferred_raw(worker.socket_path, "POST", "/voices", data, content_type=ctype)
    return response.status, json.loads(response.body)


async def speak_pcm(worker: Worker, **fields: Any) -> bytes:
    response = await deferred_raw(
        worker.socket_path, "POST", "/speak", json.dumps({"format": "pcm", "stream": False, **fields}).encode()
    )
    assert response.status == 200, response.body
    return response.body


@pytest_twisted.ensureDeferred
async def test_clone_blend_speak_and_delete(own_tone: Worker) -> None:
    """
    A clone from a WAV reference and a blend are listed with specs and previews, speak in
    their own voices, and deleting one leaves the blend made from it unchanged.
    """
    code, low = await create(own_tone, {"id": "low", "label": "Low"}, {"reference": ("clip.wav", sine_wav(120))})
    assert code == 201 and low["id"] == "low" and "cloned" in low["tags"]
    assert low["previewUrl"] == "/voices/low/preview"
    code, mix = await create(own_tone, {"id": "mix", "label": "Mix", "blend": "low(1)+soprano(1)"})
    assert code == 201 and "blend" in mix["tags"]
    _, voices = await own_tone.json("GET", "/voices")
    listed = {v["id"]: v for v in voices}
    assert {"low", "mix", "alto", "soprano"} <= set(listed)
    assert listed["alto"]["builtin"] is True and listed["low"]["builtin"] is False

    text = "A sentence to hear the voice."
    by_voice = {v: await speak_pcm(own_tone, text=text, voice=v, seed=3) for v in ("alto", "low", "mix")}
    assert len(set(by_voice.values())) == 3

    preview = await deferred_raw(own_tone.socket_path, "GET", "/voices/mix/preview")
    assert preview.status == 200 and preview.headers["content-type"] == "audio/wav"
    assert len(preview.body) > 10000

    code, answer = await own_tone.json("DELETE", "/voices/low")
    assert (code, answer) == (204, None)
    assert await speak_pcm(own_tone, text=text, voice="mix", seed=3) == by_voice["mix"]
    code, answer = await own_tone.json("POST", "/speak", {"text": text, "voice": "low"})
    assert code == 404 and answer["error"]["code"] == "unknown_voice"


@pytest_twisted.ensureDeferred
async def test_recreating_a_voice_replaces_it_and_changes_spec(own_tone: Worker) -> None:
    """
    Creating an id that exists replaces the voice, and its spec changes with it.
    """
    _, first = await create(own_tone, {"id": "again"}, {"reference": ("a.wav", sine_wav(110))})
    _, second = await create(own_tone, {"id": "again"}, {"reference": ("a.wav", sine_wav(260))})
    assert first["spec"] != second["spec"]
    _, voices = await own_tone.json("GET", "/voices")
    assert [v["spec"] for v in voices if v["id"] == "again"] == [second["spec"]]


@pytest.mark.parametrize(
    ("fields", "files", "status", "code", "field"),
    [
        ({"id": "../../x", "blend": "alto"}, None, 400, "bad_request", "id"),
        ({"id": "*", "blend": "alto"}, None, 400, "bad_request", "id"),
        ({"id": "x" * 65, "blend": "alto"}, None, 400, "bad_request", "id"),
        ({"id": "ok"}, None, 400, "bad_request", "reference"),
        ({"id": "ok", "blend": "alto"}, {"reference": ("a.wav", b"RIFF")}, 400, "bad_request", "reference"),
        ({"id": "ok", "blend": "ghost(1)+alto"}, None, 404, "unknown_voice", "blend"),
        ({"id": "ok", "blend": "alto(0)"}, None, 400, "bad_request", "blend"),
        ({"id": "ok"}, {"reference": ("clip.mp3", b"ID3....")}, 422, "unsupported", "reference"),
        ({"id": "ok"}, {"reference": ("clip.wav", b"not a wave file at all")}, 400, "bad_request", "reference"),
        ({"id": "ok", "colour": "red", "blend": "alto"}, None, 400, "bad_request", "colour"),
    ],
)
@pytest_twisted.ensureDeferred
async def test_voice_create_refusals(
    tone: Worker, fields: dict[str, str], files: Any, status: int, code: str, field: str
) -> None:
    """
    Bad ids, both-or-neither of reference and blend, unknown components, bad weights,
    unlisted reference types and unreadable clips are each refused naming the field.
    """
    got, answer = await create(tone, fields, files)
    assert got == status, answer
    assert answer["error"]["code"] == code and answer["error"]["field"] == field


@pytest_twisted.ensureDeferred
async def test_deleting_builtin_or_unknown_voice_refused(tone: Worker) -> None:
    """
    A built-in voice cannot be deleted; an unknown one is unknown_voice; a bad id is
    bad_request before the adapter sees it.
    """
    code, answer = await tone.json("DELETE", "/voices/alto")
    assert code == 422 and answer["error"]["code"] == "unsupported"
    code, answer = await tone.json("DELETE", "/voices/nobody")
    assert code == 404 and answer["error"]["code"] == "unknown_voice"
    code, answer = await tone.json("DELETE", "/voices/a*b")
    assert code == 400 and answer["error"]["field"] == "id"


@pytest_twisted.ensureDeferred
async def test_upload_over_25mb_refused_before_reading(tone: Worker) -> None:
    """
    A voice upload declaring more than 25 MB is refused at its head, 413 with a
    bad_request envelope naming the body, without the worker reading it.
    """
    import socket

    from twisted.internet.threads import deferToThread

    def oversized() -> tuple[bytes, int]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(tone.socket_path)
        sock.sendall(
            b"POST /voices HTTP/1.1\r\nHost: w\r\nContent-Type: multipart/form-data; boundary=x\r\n"
            b"Content-Length: 26000001\r\n\r\n" + b"x" * 1000
        )
        answer = b""
        while True:
            data = sock.recv(65536)
            if not data:
                break
            answer += data
        sock.close()
        return answer, len(answer)

    answer, _ = await deferToThread(oversized)
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 413")
    error = json.loads(body)["error"]
    assert (error["code"], error["field"]) == ("bad_request", "body")


@pytest_twisted.ensureDeferred
async def test_dialogue_two_speakers(tone: Worker) -> None:
    """
    The classic variant performs a two-speaker dialogue in mapped and model-picked
    voices, reproducibly under a seed; the expressive variant does not perform dialogue.
    """
    request = {
        "turns": [
            {"speaker": "a", "text": "Did you hear that?"},
            {"speaker": "b", "text": "It is only the cat."},
            {"speaker": "a", "text": "It is never only the cat."},
        ],
        "voices": {"a": "bass"},
        "variant": "classic",
        "format": "pcm",
        "seed": 7,
        "stream": False,
    }
    first = await deferred_raw(tone.socket_path, "POST", "/dialogue", json.dumps(request).encode())
    again = await deferred_raw(tone.socket_path, "POST", "/dialogue", json.dumps(request).encode())
    assert first.status == 200 and len(first.body) > RATE * 2
    assert first.body == again.body
    three = dict(request, turns=request["turns"] + [{"speaker": "c", "text": "Me too."}])
    code, answer = await tone.json("POST", "/dialogue", three)
    assert code == 422 and answer["error"]["code"] == "unsupported"
    stray = dict(request, voices={"a": "bass", "zed": "alto"})
    code, answer = await tone.json("POST", "/dialogue", stray)
    assert code == 400 and answer["error"]["field"] == "voices.zed"
    unknown = dict(request, voices={"a": "ghost"})
    code, answer = await tone.json("POST", "/dialogue", unknown)
    assert code == 404 and answer["error"]["code"] == "unknown_voice"
    expressive = dict(request, variant="expressive")
    code, answer = await tone.json("POST", "/dialogue", expressive)
    assert code == 422 and answer["error"]["code"] == "unsupported"


@pytest_twisted.ensureDeferred
async def test_a_form_of_two_hundred_thousand_parts_is_refused(tone: Worker) -> None:
    """
    A create of 200,000 empty parts (11 MB, and 13 s of the worker's CPU when the whole
    body was parsed) is bad_request naming "body", and the worker answers at once after.
    """
    data, ctype = multipart({f"p{i}": "" for i in range(200_000)})
    response = await deferred_raw(tone.socket_path, "POST", "/voices", data, content_type=ctype)
    error = json.loads(response.body)["error"]
    assert (response.status, error["code"], error["field"]) == (400, "bad_request", "body")
    assert "parts" in error["message"]
    code, _ = await tone.json("GET", "/health")
    assert code == 200


@pytest_twisted.ensureDeferred
async def test_a_reference_claiming_an_absurd_rate_is_refused_without_growing_the_worker(own_tone: Worker) -> None:
    """
    A 24 MB WAV whose header claims 4,294,967,295 Hz is bad_request naming "reference",
    and the worker's resident memory grows by well under the 600 MB its analysis took.
    """
    from _worker import resident_kib

    clip = bytearray(sine_wav(120, seconds=0.1))
    clip += bytes(24_000_000)
    struct.pack_into("<I", clip, 4, len(clip) - 8)
    struct.pack_into("<I", clip, 24, 4_294_967_295)
    struct.pack_into("<I", clip, 40, len(clip) - 44)
    before = resident_kib(own_tone.pid)
    code, answer = await create(own_tone, {"id": "absurd"}, {"reference": ("absurd.wav", bytes(clip))})
    assert (code, answer["error"]["code"], answer["error"]["field"]) == (400, "bad_request", "reference")
    assert "4294967295 Hz" in answer["error"]["message"]
    assert resident_kib(own_tone.pid) - before < 150 * 1024
