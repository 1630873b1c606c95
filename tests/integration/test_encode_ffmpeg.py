"""
Integration tests for the SDK's encoders against real ffmpeg processes on the real reactor:
round-trip durations, streaming, end-to-end backpressure, abort and failure.
"""

from __future__ import annotations

import math
import os
import random
import signal
import subprocess
import time
from array import array
from typing import Any, Callable, Iterator, Sequence

import pytest
import pytest_twisted
from twisted.internet import process
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IConsumer, IProcessTransport, IProducer, IPushProducer
from twisted.internet.task import deferLater
from zope.interface import implementer

from rhapsode_worker._encode import (
    EncoderFailed,
    EncodingAborted,
    available_formats,
    find_ffmpeg,
    make_encoder,
)
from rhapsode_worker._engine import NativeFormat

# MP3 carries LAME's 1105-sample priming delay; only a LAME tag, which the muxer writes by seeking
# back and so never on a pipe, would let a decoder trim it.
MP3_PRIMING_SAMPLES = 1105
TOLERANCE_S = 0.050


@pytest.fixture
def reactor() -> Any:
    from twisted.internet import reactor

    return reactor


@pytest.fixture(autouse=True)
def leaves_nothing_behind(reactor: Any) -> Iterator[None]:
    """
    Each test ends with every child reaped and no timer of its own pending: pytest-twisted
    checks neither.  (Timers that were already there belong to other modules' fixtures.)
    """
    before = set(reactor.getDelayedCalls())
    yield
    assert not process.reapProcessHandlers
    assert not [call for call in reactor.getDelayedCalls() if call.active() and call not in before]


@pytest.fixture(scope="module")
def ffmpeg() -> str:
    found = find_ffmpeg()
    assert found is not None, "imageio-ffmpeg is a dependency: there is always an ffmpeg"
    assert set(available_formats(found)) == {"wav", "mp3", "opus", "flac", "pcm", "aac"}
    return found


def sine(native: NativeFormat, seconds: float) -> bytes:
    """
    A 440 Hz sine at half scale, the same on every channel, as s16le.
    """
    frames = round(native.sample_rate * seconds)
    samples = array("h")
    for i in range(frames):
        value = int(16000 * math.sin(2 * math.pi * 440 * i / native.sample_rate))
        samples.extend([value] * native.channels)
    return samples.tobytes()


def decode(ffmpeg: str, fmt: str, data: bytes, native: NativeFormat) -> bytes:
    """
    Decode an encoded body back to s16le at the native rate and channel count.
    """
    demux = ["-f", "s16le", "-ar", str(native.sample_rate), "-ac", str(native.channels)]
    argv = [ffmpeg, "-hide_banner", "-loglevel", "error", "-nostdin",
            *(demux if fmt == "pcm" else []), "-i", "pipe:0", *demux, "pipe:1"]
    return subprocess.run(argv, input=data, capture_output=True, check=True, timeout=30).stdout


@implementer(IConsumer)
class CollectingSink:
    """
    A sink that keeps every write; optionally it pauses each producer it is given, as a full
    socket would, until L{release} is called.
    """

    def __init__(self, stalled: bool = False) -> None:
        self.chunks: list[bytes] = []
        self.producer: IProducer | None = None
        self.stalled = stalled

    def registerProducer(self, producer: IProducer, streaming: bool) -> None:
        assert self.producer is None and streaming
        self.producer = producer
        if self.stalled:
            producer.pauseProducing()  # type: ignore[attr-defined]

    def unregisterProducer(self) -> None:
        assert self.producer is not None
        self.producer = None

    def write(self, data: bytes) -> None:
        self.chunks.append(data)

    def release(self) -> None:
        self.stalled = False
        if self.producer is not None:
            self.producer.resumeProducing()  # type: ignore[attr-defined]


@implementer(IPushProducer)
class PcmSource:
    """
    A push producer feeding PCM to a consumer one chunk per reactor turn (or per C{interval}),
    honouring pauses; C{done} fires once everything was written.
    """

    def __init__(self, reactor: Any, consumer: IConsumer, pcm: bytes, chunk: int,
                 interval: float = 0.0) -> None:
        self.reactor = reactor
        self.consumer = consumer
        self.pcm = pcm
        self.chunk = chunk
        self.interval = interval
        self.offset = 0
        self.state = "producing"
        self.pauses = 0
        self.done: Deferred[None] = Deferred()
        self._call: Any = None
        consumer.registerProducer(self, True)
        self._schedule()

    def _schedule(self) -> None:
        if self._call is None and self.state == "producing":
            self._call = self.reactor.callLater(self.interval, self._feed)

    def _feed(self) -> None:
        self._call = None
        if self.state != "producing":
            return
        self.consumer.write(self.pcm[self.offset:self.offset + self.chunk])
        self.offset += self.chunk
        if self.offset >= len(self.pcm):
            self.state = "finished"
            self.consumer.unregisterProducer()
            self.done.callback(None)
        else:
            self._schedule()

    def pauseProducing(self) -> None:
        self.pauses += 1
        if self.state == "producing":
            self.state = "paused"

    def resumeProducing(self) -> None:
        if self.state == "paused":
            self.state = "producing"
            self._schedule()

    def stopProducing(self) -> None:
        self.state = "stopped"


class RecordingReactor:
    """
    The real reactor, keeping the process transports it spawns so a test can see their pids.
    """

    def __init__(self, reactor: Any) -> None:
        self.reactor = reactor
        self.processes: list[IProcessTransport] = []

    def spawnProcess(self, *args: Any, **kwargs: Any) -> IProcessTransport:
        spawned = self.reactor.spawnProcess(*args, **kwargs)
        self.processes.append(spawned)
        return spawned


async def until(reactor: Any, condition: Callable[[], bool], within: float = 60.0) -> None:
    """
    Let the reactor turn until C{condition} holds, failing after C{within} seconds (a
    hang guard: it returns as soon as the condition holds).
    """
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await deferLater(reactor, 0.01, lambda: None)


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # succeeds on a zombie, so this is only true once the child is reaped
    except ProcessLookupError:
        return True
    return False


CASES: Sequence[tuple[str, int, float]] = [
    (fmt, 24000, seconds) for fmt in ("mp3", "opus", "flac", "wav", "pcm") for seconds in (1.0, 2.5)
] + [("opus", 22050, 1.0), ("opus", 22050, 2.5)]


@pytest.mark.parametrize(("fmt", "rate", "seconds"), CASES)
@pytest_twisted.ensureDeferred
async def test_round_trip_duration(reactor: Any, ffmpeg: str, fmt: str, rate: int,
                                   seconds: float) -> None:
    """Encoding a sine and decoding it back with ffmpeg gives the input's duration within 50 ms
    (past MP3's fixed priming delay), for every format; opus resamples 22050 Hz input."""
    native = NativeFormat(sample_rate=rate)
    pcm = sine(native, seconds)
    sink = CollectingSink()
    encoder = make_encoder(fmt, native, sink, reactor=reactor, ffmpeg=ffmpeg, streaming=True)
    source = PcmSource(reactor, encoder, pcm, chunk=native.bytes_per_second // 10)
    await source.done
    await encoder.finish()
    assert encoder.pcm_bytes == len(pcm)
    assert sink.producer is None
    decoded = decode(ffmpeg, fmt, b"".join(sink.chunks), native)
    expected = seconds + (MP3_PRIMING_SAMPLES / rate if fmt == "mp3" else 0.0)
    assert abs(len(decoded) / native.bytes_per_second - expected) <= TOLERANCE_S
    if fmt in ("wav", "pcm", "flac"):
        assert decoded == pcm


@pytest.mark.parametrize("fmt", ["aac"])
@pytest_twisted.ensureDeferred
async def test_aac_round_trip_duration(reactor: Any, ffmpeg: str, fmt: str) -> None:
    """aac is ADTS frames: decoded back, a second of sine is a second long plus at most the
    encoder's priming and the last frame's padding (two frames of 1024 samples), and loud."""
    native = NativeFormat(sample_rate=22050)
    pcm = sine(native, 1.0)
    sink = CollectingSink()
    encoder = make_encoder(fmt, native, sink, reactor=reactor, ffmpeg=ffmpeg, streaming=True)
    source = PcmSource(reactor, encoder, pcm, chunk=native.bytes_per_second // 10)
    await source.done
    await encoder.finish()
    body = b"".join(sink.chunks)
    assert body[0] == 0xFF and body[1] & 0xF0 == 0xF0  # an ADTS sync word
    decoded = decode(ffmpeg, fmt, body, native)
    extra = len(decoded) // 2 - len(pcm) // 2
    assert 0 <= extra <= 2 * 1024
    samples = array("h")
    samples.frombytes(decoded)
    assert max(samples) > 8000


@pytest.mark.parametrize(("fmt", "streaming"), [("pcm", True), ("wav", True), ("wav", False), ("mp3", True)])
@pytest_twisted.ensureDeferred
async def test_a_rate_asked_for_is_resampled(reactor: Any, ffmpeg: str, fmt: str, streaming: bool) -> None:
    """22.05 kHz PCM asked for at 24 kHz (what LiveKit and Pipecat assume): pcm comes out
    24000 samples a second through ffmpeg's resampler, a wav's header says 24000 (with its
    sizes filled in when buffered), an mp3's frames are at 24 kHz; the tone is still 440 Hz
    at half scale, not silence or noise."""
    native = NativeFormat(sample_rate=22050)
    pcm = sine(native, 1.0)
    sink = CollectingSink()
    encoder = make_encoder(fmt, native, sink, reactor=reactor, ffmpeg=ffmpeg, streaming=streaming, rate=24000)
    source = PcmSource(reactor, encoder, pcm, chunk=native.bytes_per_second // 10)
    await source.done
    await encoder.finish()
    chunks = encoder.finalize(sink.chunks) if not streaming else sink.chunks
    body = b"".join(chunks)
    target = NativeFormat(sample_rate=24000)
    if fmt == "wav":
        assert body[:4] == b"RIFF" and int.from_bytes(body[24:28], "little") == 24000
        size = int.from_bytes(body[40:44], "little")
        assert size == (0xFFFFFFFF if streaming else len(body) - 44)
    decoded = decode(ffmpeg, fmt, body, target)
    seconds = len(decoded) / target.bytes_per_second
    assert abs(seconds - (1.0 + (MP3_PRIMING_SAMPLES / 24000 if fmt == "mp3" else 0.0))) <= TOLERANCE_S
    samples = array("h")
    samples.frombytes(decoded)
    middle = samples[6000:18000]
    crossings = sum(1 for a, b in zip(middle, middle[1:]) if a < 0 <= b)
    assert 14000 < max(middle) < 17000 and abs(crossings - 220) <= 3  # 440 Hz over half a second


@pytest.mark.parametrize("fmt", ["mp3", "opus", "flac", "aac"])
@pytest_twisted.ensureDeferred
async def test_output_streams_before_finish(reactor: Any, ffmpeg: str, fmt: str) -> None:
    """Fed 10 s of PCM in 100 ms writes with the reactor turning between them, ffmpeg's output
    reaches the sink in several writes before finish() is called."""
    native = NativeFormat(sample_rate=24000)
    sink = CollectingSink()
    encoder = make_encoder(fmt, native, sink, reactor=reactor, ffmpeg=ffmpeg, streaming=True)
    source = PcmSource(reactor, encoder, sine(native, 10.0), chunk=native.bytes_per_second // 10,
                       interval=0.005)
    await source.done
    await until(reactor, lambda: len(sink.chunks) > 1)
    streamed = len(sink.chunks)
    await encoder.finish()
    assert streamed > 1 and len(sink.chunks) >= streamed


@pytest_twisted.ensureDeferred
async def test_stalled_sink_pauses_the_source(reactor: Any, ffmpeg: str) -> None:
    """A sink that stops reading stalls ffmpeg's stdout, then its stdin, then pauses the PCM
    source with a bounded amount fed; releasing it lets the whole input through, losslessly."""
    native = NativeFormat(sample_rate=24000)
    noise = random.Random(7).randbytes(8 * 1024 * 1024)  # noise keeps flac near 1:1
    sink = CollectingSink(stalled=True)
    encoder = make_encoder("flac", native, sink, reactor=reactor, ffmpeg=ffmpeg, streaming=True)
    source = PcmSource(reactor, encoder, noise, chunk=64 * 1024)
    await until(reactor, lambda: source.state == "paused")
    await deferLater(reactor, 0.2, lambda: None)
    fed = source.offset
    assert source.state == "paused" and fed < 1024 * 1024
    sink.release()
    await source.done
    await encoder.finish()
    assert source.pauses >= 1
    assert decode(ffmpeg, "flac", b"".join(sink.chunks), native) == noise


@pytest_twisted.ensureDeferred
async def test_abort_kills_ffmpeg(reactor: Any, ffmpeg: str) -> None:
    """abort kills the running ffmpeg with SIGKILL, the child is reaped (no zombie), and finish()
    then fails."""
    native = NativeFormat(sample_rate=24000)
    recording = RecordingReactor(reactor)
    sink = CollectingSink()
    encoder = make_encoder("opus", native, sink, reactor=recording, ffmpeg=ffmpeg, streaming=True)
    [child] = recording.processes
    pid = child.pid
    assert pid is not None
    encoder.write(sine(native, 1.0))
    await deferLater(reactor, 0.1, lambda: None)
    encoder.abort()
    await until(reactor, lambda: pid_gone(pid))
    # Stdin was never closed, so only the signal can have ended it.
    status = getattr(child, "status")
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    with pytest.raises(EncodingAborted):
        await encoder.finish()
    assert sink.producer is None


@pytest_twisted.ensureDeferred
async def test_ffmpeg_failure_carries_stderr(reactor: Any, ffmpeg: str) -> None:
    """An ffmpeg that exits non-zero (nine-channel input mp3 cannot take) fails finish() with
    its stderr."""
    native = NativeFormat(sample_rate=24000, channels=9)
    sink = CollectingSink()
    encoder = make_encoder("mp3", native, sink, reactor=reactor, ffmpeg=ffmpeg, streaming=True)
    encoder.write(bytes(native.bytes_per_second // 2))
    with pytest.raises(EncoderFailed) as failed:
        await encoder.finish()
    assert "exited with status" in failed.value.message
    assert failed.value.stderr.strip()
    assert sink.producer is None
