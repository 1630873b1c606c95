"""
A vLLM-Omni speech server on loopback, built from its documented API (the peer's
docs/serving/speech_api.md): C{POST /v1/audio/speech} buffered in wav, pcm, flac, mp3 and
opus and streamed as raw audio or as C{speech.audio.*} server-sent events, C{GET
/v1/models}, the voices API (list, multipart upload with its consent field, delete), its
error envelopes, and the task rules of the Qwen3-TTS checkpoints (CustomVoice speakers
and style instructions, VoiceDesign's explicit task and description, Base's uploaded
voices and ref_audio), Fish Speech's reference cloning, or, with C{--openai}, a plain
OpenAI server (no voices route, no extensions, unknown fields refused).

Its audio is a tone whose pitch is a hash of what shaped it (the voice, the reference,
the instructions), at the model's native rate, a fixed time per character: a test can
hear that instructions or a clone changed the sound, and count the samples.  It streams
with backpressure (a push producer: a paused transport stops it), and counts what it
sent.  Modes set over C{POST /_fake/mode} make it slow, hang, fail with a status, die
mid-stream or send an SSE error; C{GET /_fake/requests} is every speech request's body as
it arrived, C{GET /_fake/stats} what it sent.

Run: C{python fake_vllm_omni.py --model Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice [--port 0]
[--key K] [--openai] [--rate 24000]}; it prints C{{"port": N}} once it listens.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import math
import struct
import subprocess
import sys
import time
from typing import Any

from twisted.internet import reactor
from twisted.internet.interfaces import IPushProducer
from twisted.web import resource, server
from zope.interface import implementer

SPEAKERS = ["vivian", "serena", "uncle_fu", "dylan", "eric", "ryan", "aiden", "ono_anna", "sohee"]
LANGUAGES = ["Auto", "Chinese", "English", "Japanese", "Korean", "German", "French", "Russian", "Portuguese",
             "Spanish", "Italian"]
RATES = {"fishaudio/s2-pro": 44100, "nineninesix/gepard-1.0": 22050}
MEDIA = {"wav": "audio/wav", "pcm": "audio/pcm", "mp3": "audio/mpeg", "flac": "audio/flac", "opus": "audio/ogg"}


def envelope(status: int, message: str, param: str | None = None) -> bytes:
    kind = "BadRequestError" if status == 400 else "NotFoundError" if status == 404 else "ServerError"
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": status}}).encode()


class Refused(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def tone(seed: str, seconds: float, rate: int, loud: float = 0.3) -> bytes:
    """A tone whose pitch is a hash of seed: 16-bit mono PCM."""
    pitch = 150 + int(hashlib.sha256(seed.encode()).hexdigest()[:4], 16) % 250
    frames = max(1, int(seconds * rate))
    step = 2 * math.pi * pitch / rate
    return b"".join(struct.pack("<h", int(loud * 32767 * math.sin(step * i))) for i in range(frames))


def wav_header(rate: int, pcm_bytes: int | None) -> bytes:
    size = 0xFFFFFFFF if pcm_bytes is None else pcm_bytes
    riff = 0xFFFFFFFF if pcm_bytes is None else 36 + pcm_bytes
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
            + b"data" + struct.pack("<I", size))


class Fake:
    """The server's state: its model, uploads, what it was asked, and its modes."""

    def __init__(self, model: str, key: str | None, openai: bool, rate: int | None) -> None:
        self.model = model
        self.key = key
        self.openai = openai
        self.rate = rate or RATES.get(model, 24000)
        self.uploaded: dict[str, dict[str, Any]] = {}
        self.requests: list[dict[str, Any]] = []
        self.mode: dict[str, Any] = {}
        self.sent = 0
        self.streams = 0
        self.open = 0
        self.pauses = 0
        self.hung: list[Any] = []

    @property
    def task(self) -> str:
        for task in ("CustomVoice", "VoiceDesign", "Base"):
            if self.model.endswith(task):
                return task
        return ""

    def speakers(self) -> list[str]:
        if self.openai:
            return ["alloy", "echo"]
        if self.task == "CustomVoice":
            return list(SPEAKERS)
        if self.model == "mistralai/Voxtral-4B-TTS-2603":
            return ["casual_female", "neutral_male"]
        return []

    def seconds(self, text: str) -> float:
        return max(0.3, len(text) * float(self.mode.get("seconds_per_char", 0.06)))

    def shape(self, body: dict[str, Any]) -> str:
        """What the sound depends on, checked as the real server checks it."""
        text = body.get("input")
        if not isinstance(text, str) or not text.strip():
            raise Refused(400, "Input text cannot be empty", "input")
        if self.openai:
            allowed = {"model", "input", "voice", "response_format", "speed", "instructions", "stream_format"}
            extra = sorted(set(body) - allowed)
            if extra:
                raise Refused(400, f"Unrecognized request argument supplied: {extra[0]}", extra[0])
            voice = body.get("voice", "alloy")
            if voice not in self.speakers():
                raise Refused(400, f"Invalid voice {voice!r}", "voice")
            return f"{voice}|{body.get('instructions', '')}"
        if body.get("model") not in (None, self.model):
            raise Refused(404, f"The model `{body['model']}` does not exist.", "model")
        language = body.get("language", "Auto")
        if self.model.startswith("Qwen/") and language not in LANGUAGES:
            raise Refused(400, f"Unsupported language {language!r}", "language")
        task, voice = body.get("task_type"), body.get("voice")
        ref = body.get("ref_audio")
        instructions = body.get("instructions", "")
        if self.task == "CustomVoice":
            if task not in (None, "CustomVoice") or ref or (voice in self.uploaded):
                raise Refused(400, "Qwen3-TTS CustomVoice checkpoint does not support task_type='Base'. Use "
                                   "task_type='CustomVoice' or load the matching Base checkpoint.")
            voice = voice or "vivian"
            if voice not in SPEAKERS:
                raise Refused(400, f"Unsupported speaker '{voice}'. Supported speakers: {', '.join(SPEAKERS)}",
                              "voice")
            return f"{voice}|{instructions}|{language}"
        if self.task == "VoiceDesign":
            if task != "VoiceDesign":
                raise Refused(400, "Qwen3-TTS VoiceDesign checkpoint needs task_type='VoiceDesign'")
            if not instructions:
                raise Refused(400, "VoiceDesign needs instructions describing the voice", "instructions")
            return f"design|{instructions}"
        if self.task == "Base":
            if voice in self.uploaded:
                return f"clone|{self.uploaded[voice]['sha']}"
            if ref:
                return f"clone|{hashlib.sha256(ref.encode()).hexdigest()}|{body.get('ref_text', '')}"
            raise Refused(400, "Base task needs ref_audio or an uploaded voice", "ref_audio")
        if self.model == "fishaudio/s2-pro":
            if voice not in (None, "default"):
                raise Refused(400, f"Unsupported speaker '{voice}'", "voice")
            return f"fish|{hashlib.sha256((ref or '').encode()).hexdigest()}"
        if voice is not None and voice not in self.speakers():
            raise Refused(400, f"Unsupported speaker '{voice}'", "voice")
        return f"{voice}|{instructions}"


@implementer(IPushProducer)
class Streamer:
    """Writes one answer's audio in 100 ms pieces, as long as its transport takes them."""

    def __init__(self, fake: Fake, request: Any, pcm_total: int, seed: str, sse: bool, wav: bool) -> None:
        self.fake, self.request = fake, request
        self.remaining = pcm_total
        self.piece = tone(seed, 0.1, fake.rate)
        self.sse, self.wav = sse, wav
        self.paused = False
        self.done = False
        self.pending: Any = None
        self.sent_audio = 0

    def start(self) -> None:
        self.fake.streams += 1
        self.fake.open += 1
        self.request.registerProducer(self, True)
        self.request.notifyFinish().addBoth(self._gone)
        if self.wav:
            self.request.write(wav_header(self.fake.rate, None))
        self._schedule(float(self.fake.mode.get("head_delay", 0)))

    def _gone(self, _: object) -> None:
        self.fake.open -= 1
        self.done = True
        if self.pending is not None and self.pending.active():
            self.pending.cancel()

    def _schedule(self, delay: float = 0.0) -> None:
        if not self.done and not self.paused and (self.pending is None or not self.pending.active()):
            self.pending = reactor.callLater(delay, self._write)

    def _write(self) -> None:
        self.pending = None
        if self.done or self.paused:
            return
        if self.remaining <= 0:
            self._finish()
            return
        chunk = self.piece[: min(len(self.piece), self.remaining)]
        self.remaining -= len(chunk)
        self.sent_audio += len(chunk)
        self.fake.sent += len(chunk)
        if self.sse:
            event = {"type": "speech.audio.delta", "audio": base64.b64encode(chunk).decode(), "response_format": "pcm"}
            self.request.write(b"event: speech.audio.delta\ndata: " + json.dumps(event).encode() + b"\n\n")
        else:
            self.request.write(chunk)
        die = self.fake.mode.get("die_after")
        if die is not None and self.sent_audio >= int(die):
            self.done = True
            self.request.transport.abortConnection()
            return
        fail = self.fake.mode.get("sse_error_after")
        if self.sse and fail is not None and self.sent_audio >= int(fail):
            error = {"type": "speech.audio.error",
                     "error": {"message": "CUDA error: an illegal memory access", "type": "server_error",
                               "param": None, "code": 500}}
            self.request.write(b"event: speech.audio.error\ndata: " + json.dumps(error).encode() + b"\n\n")
            self._end()
            return
        self._schedule(float(self.fake.mode.get("chunk_delay", 0)))

    def _finish(self) -> None:
        if self.sse:
            usage = {"input_tokens": 10, "output_tokens": 20, "total_tokens": 30,
                     "input_token_details": {"text_tokens": 10, "audio_tokens": 0}}
            self.request.write(b"event: speech.audio.done\ndata: "
                               + json.dumps({"type": "speech.audio.done", "usage": usage}).encode() + b"\n\n")
        self._end()

    def _end(self) -> None:
        self.done = True
        self.request.unregisterProducer()
        self.request.finish()

    def pauseProducing(self) -> None:
        self.paused = True
        self.fake.pauses += 1

    def resumeProducing(self) -> None:
        self.paused = False
        self._schedule()

    def stopProducing(self) -> None:
        self.done = True


def encode(fmt: str, pcm: bytes, rate: int) -> bytes:
    if fmt == "pcm":
        return pcm
    if fmt == "wav":
        return wav_header(rate, len(pcm)) + pcm
    import imageio_ffmpeg  # the formats the real server hands to its own encoder

    codec = {"mp3": ["-f", "mp3"], "flac": ["-f", "flac"], "opus": ["-c:a", "libopus", "-f", "ogg", "-ar", "48000"]}
    argv = [imageio_ffmpeg.get_ffmpeg_exe(), "-loglevel", "error", "-f", "s16le", "-ar", str(rate), "-ac", "1",
            "-i", "pipe:0", *codec[fmt], "pipe:1"]
    return subprocess.run(argv, input=pcm, capture_output=True, check=True).stdout


class Root(resource.Resource):
    isLeaf = True

    def __init__(self, fake: Fake) -> None:
        super().__init__()
        self.fake = fake

    def _json(self, request: Any, status: int, document: Any) -> bytes:
        request.setResponseCode(status)
        request.setHeader(b"content-type", b"application/json")
        return json.dumps(document).encode()

    def _refuse(self, request: Any, refused: Refused) -> bytes:
        request.setResponseCode(refused.status)
        request.setHeader(b"content-type", b"application/json")
        return envelope(refused.status, refused.message, refused.param)

    def render(self, request: Any) -> Any:
        path = request.path.decode()
        fake = self.fake
        if path.startswith("/_fake/"):
            return self._control(request, path)
        if fake.mode.get("hang"):
            fake.hung.append(request)
            return server.NOT_DONE_YET
        if fake.key is not None and request.getHeader(b"authorization") != f"Bearer {fake.key}".encode():
            return self._refuse(request, Refused(401, "Invalid API key"))
        method = request.method.decode()
        try:
            if method == "GET" and path == "/v1/models":
                return self._json(request, 200, {"object": "list", "data": [
                    {"id": fake.model, "object": "model", "created": 0, "owned_by": "vllm-omni"}]})
            if path == "/v1/audio/voices" and not fake.openai:
                if method == "GET":
                    uploaded = [dict(v, name=n) for n, v in fake.uploaded.items()]
                    for entry in uploaded:
                        entry.pop("sha", None)
                    return self._json(request, 200, {"voices": fake.speakers() + list(fake.uploaded),
                                                     "uploaded_voices": uploaded})
                if method == "POST":
                    return self._upload(request)
            if path.startswith("/v1/audio/voices/") and method == "DELETE" and not fake.openai:
                name = path.rsplit("/", 1)[1]
                if fake.uploaded.pop(name, None) is None:
                    return self._json(request, 404, {"success": False, "error": f"Voice '{name}' not found"})
                return self._json(request, 200, {"success": True, "message": f"Voice '{name}' deleted successfully"})
            if path == "/v1/audio/speech" and method == "POST":
                return self._speech(request)
        except Refused as refused:
            return self._refuse(request, refused)
        return self._refuse(request, Refused(404, f"no route {method} {path}"))

    def _upload(self, request: Any) -> bytes:
        args = request.args
        for needed in (b"audio_sample", b"consent", b"name"):
            if not args.get(needed):
                raise Refused(400, f"{needed.decode()} is required", needed.decode())
        name = args[b"name"][0].decode()
        if name in self.fake.speakers():
            raise Refused(400, f"Voice name '{name}' collides with a built-in voice", "name")
        sample = args[b"audio_sample"][0]
        entry: dict[str, Any] = {"consent": args[b"consent"][0].decode(), "created_at": int(time.time()),
                                 "file_size": len(sample), "mime_type": "audio/wav",
                                 "sha": hashlib.sha256(sample).hexdigest()}
        if args.get(b"ref_text"):
            entry["ref_text"] = args[b"ref_text"][0].decode()
        if args.get(b"speaker_description"):
            entry["speaker_description"] = args[b"speaker_description"][0].decode()
        self.fake.uploaded[name] = entry
        shown = {k: v for k, v in entry.items() if k != "sha"}
        return self._json(request, 200, {"success": True, "voice": dict(shown, name=name)})

    def _speech(self, request: Any) -> Any:
        fake = self.fake
        try:
            body = json.loads(request.content.read())
        except ValueError:
            raise Refused(400, "body is not JSON") from None
        if not isinstance(body, dict):
            raise Refused(400, "body is not an object")
        fake.requests.append(body)
        status = fake.mode.get("error")
        if status:
            raise Refused(int(status), fake.mode.get("message", "the fake was told to fail"))
        seed = fake.shape(body)
        fmt = body.get("response_format", "mp3" if fake.openai else "wav")
        if fmt not in MEDIA:
            raise Refused(400, f"Unsupported response_format {fmt!r}", "response_format")
        stream_format = body.get("stream_format") or ("sse" if body.get("stream") else None)
        if fake.openai and stream_format == "sse":
            raise Refused(400, "stream_format sse is not supported for this model", "stream_format")
        pcm_total = 2 * int(fake.seconds(body["input"]) * fake.rate)
        request.setHeader(b"x-vllm-omni-input-tokens", b"10")
        if stream_format is not None or fake.openai:
            if fmt not in ("pcm", "wav"):
                if fake.openai:
                    stream_format = None
                else:
                    raise Refused(400, "streaming requires response_format pcm or wav", "response_format")
            if stream_format is not None and body.get("speed", 1.0) != 1.0:
                raise Refused(400, "streaming requires speed 1.0", "speed")
        if stream_format in ("sse", "audio") or (fake.openai and fmt in ("pcm", "wav")):
            sse = stream_format == "sse"
            request.setHeader(b"content-type", b"text/event-stream" if sse else MEDIA[fmt].encode())
            Streamer(fake, request, pcm_total, seed, sse, wav=fmt == "wav" and not sse).start()
            return server.NOT_DONE_YET
        speed = float(body.get("speed", 1.0))
        pcm = tone(seed, fake.seconds(body["input"]) / speed, fake.rate)
        fake.sent += len(pcm)
        audio = encode(fmt, pcm, fake.rate)
        request.setHeader(b"content-type", MEDIA[fmt].encode())
        delay = float(fake.mode.get("head_delay", 0))
        if delay:
            def later() -> None:
                request.write(audio)
                request.finish()

            reactor.callLater(delay, later)
            return server.NOT_DONE_YET
        return audio

    def _control(self, request: Any, path: str) -> bytes:
        fake = self.fake
        if path == "/_fake/mode" and request.method == b"POST":
            fake.mode = json.loads(request.content.read() or b"{}")
            if not fake.mode.get("hang"):
                # Lift a hang: the requests it held are dropped, as a restarted server drops them.
                for held in fake.hung:
                    held.transport.abortConnection()
                fake.hung.clear()
            return self._json(request, 200, fake.mode)
        if path == "/_fake/requests":
            if request.method == b"DELETE":
                fake.requests.clear()
            return self._json(request, 200, fake.requests)
        if path == "/_fake/stats":
            return self._json(request, 200, {"sent": fake.sent, "streams": fake.streams, "open": fake.open, "pauses": fake.pauses,
                                             "uploaded": sorted(fake.uploaded)})
        return self._json(request, 404, {"error": "no such control"})


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--key")
    parser.add_argument("--openai", action="store_true")
    parser.add_argument("--rate", type=int)
    args = parser.parse_args(argv)
    fake = Fake(args.model, args.key, args.openai, args.rate)
    site = server.Site(Root(fake))
    site.displayTracebacks = False
    port = reactor.listenTCP(args.port, site, interface="127.0.0.1")
    print(json.dumps({"port": port.getHost().port}), flush=True)
    reactor.run()


if __name__ == "__main__":
    main(sys.argv[1:])
