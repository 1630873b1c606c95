"""
Unit tests for the SDK's audio encoding (rhapsode_worker._encode): headers, content types, the
format probe, passthrough backpressure, and the ffmpeg encoder's lifecycle against a fake
process reactor (tests/unit/_worker_fakes.py).  No real process runs here.
"""

from __future__ import annotations

import io
import os
import stat
import struct
import wave
from pathlib import Path
from typing import Any, Iterator

import imageio_ffmpeg
import pytest
from _deferreds import failure_of
from _worker_fakes import FakeProcess, FakeProcessReactor, RecordingProducer
from twisted.internet.error import ProcessDone, ProcessTerminated
from twisted.internet.interfaces import IConsumer, IProcessTransport, IPushProducer, IReactorProcess
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from zope.interface.verify import verifyObject

from rhapsode_protocol.errors import Unsupported
from rhapsode_worker._encode import (
    _audio_encoders,
    FORMATS,
    EncoderFailed,
    EncodingAborted,
    available_formats,
    content_type,
    find_ffmpeg,
    probe_cache_dir,
    probe_ffmpeg,
    make_encoder,
    pcm16_from_f32le,
    wav_header,
)
from rhapsode_worker._engine import NativeFormat

MONO_24K = NativeFormat(sample_rate=24000, channels=1)
STEREO_22K = NativeFormat(sample_rate=22050, channels=2)


def ffmpeg_encoder(fmt: str = "mp3", native: NativeFormat = MONO_24K, streaming: bool = True) -> Any:
    """
    An ffmpeg encoder on a fake reactor, with its sink, protocol and fake process.
    """
    reactor = FakeProcessReactor()
    sink = StringTransport()
    encoder = make_encoder(fmt, native, sink, reactor=reactor, ffmpeg="/opt/ff", streaming=streaming)
    [spawned] = reactor.spawned
    return encoder, sink, spawned.protocol, spawned.argv, spawned.process


def test_fakes_provide_their_interfaces() -> None:
    """The fake process, its reactor and the PCM source provide the interfaces they stand in for."""
    verifyObject(IProcessTransport, FakeProcess())
    verifyObject(IReactorProcess, FakeProcessReactor())
    verifyObject(IPushProducer, RecordingProducer())



def test_wav_header_known_size_parses() -> None:
    """A header for a known size states the format and the frame count the stdlib reads back."""
    data = bytes(range(256)) * 40  # 10240 bytes: 2560 stereo frames
    header = wav_header(STEREO_22K, len(data))
    assert len(header) == 44
    with wave.open(io.BytesIO(header + data)) as parsed:
        assert parsed.getnchannels() == 2
        assert parsed.getsampwidth() == 2
        assert parsed.getframerate() == 22050
        assert parsed.getnframes() == 2560
        assert parsed.readframes(2560) == data
    assert struct.unpack_from("<I", header, 4)[0] == 36 + len(data)
    assert struct.unpack_from("<I", header, 28)[0] == 22050 * 4
    too_big = wav_header(STEREO_22K, 2**32)
    assert struct.unpack_from("<I", too_big, 4) == struct.unpack_from("<I", too_big, 40) == (
        0xFFFFFFFF,)


def test_wav_header_stream_marks_sizes_unknown() -> None:
    """A header for a stream of unknown length has 0xFFFFFFFF as both the RIFF and data size."""
    header = wav_header(MONO_24K, None)
    assert len(header) == 44
    assert header[:4] == b"RIFF" and header[8:16] == b"WAVEfmt " and header[36:40] == b"data"
    assert struct.unpack_from("<I", header, 4)[0] == 0xFFFFFFFF
    assert struct.unpack_from("<I", header, 40)[0] == 0xFFFFFFFF


def test_content_types() -> None:
    """Each format has the Content-Type the contract names; pcm carries rate and channels."""
    assert content_type("wav", MONO_24K) == "audio/wav"
    assert content_type("mp3", MONO_24K) == "audio/mpeg"
    assert content_type("opus", MONO_24K) == "audio/opus"
    assert content_type("flac", MONO_24K) == "audio/flac"
    assert content_type("pcm", STEREO_22K) == "audio/L16; rate=22050; channels=2"
    assert content_type("aac", MONO_24K) == "audio/aac"
    with pytest.raises(ValueError):
        content_type("wma", MONO_24K)


def test_wav_streams_header_then_pcm_and_finalize_fixes_sizes() -> None:
    """WAV writes an unknown-size header before the first PCM; finalize gives exact sizes even
    when the collected chunks split and merge the header arbitrarily."""
    sink = StringTransport()
    encoder = make_encoder("wav", MONO_24K, sink, reactor=FakeProcessReactor(), ffmpeg=None,
                           streaming=False)
    assert sink.value() == b""
    pcm = b"".join(struct.pack("<h", i) for i in range(-300, 300))
    encoder.write(pcm[:7])  # an odd write passes through as-is
    encoder.write(pcm[7:])
    done = encoder.finish()
    assert done.called and done.result is None
    assert sink.value() == wav_header(MONO_24K, None) + pcm
    assert encoder.pcm_bytes == len(pcm)
    body = sink.value()
    regrouped = [body[i:i + 10] for i in range(0, len(body), 10)]
    fixed = b"".join(encoder.finalize(regrouped))
    with wave.open(io.BytesIO(fixed)) as parsed:
        assert parsed.getnframes() == 600
        assert parsed.readframes(600) == pcm
    assert struct.unpack_from("<I", fixed, 4)[0] == 36 + len(pcm)


def test_wav_s_header_leaves_in_the_first_pcm_s_write() -> None:
    """
    A streamed WAV's header and its first PCM reach the sink in one write (one send on a
    socket, where two writes were two), and later PCM passes through as it came.
    """
    writes: list[bytes] = []

    class Sink(StringTransport):
        def write(self, data: bytes) -> None:
            writes.append(data)

    encoder = make_encoder("wav", MONO_24K, Sink(), reactor=FakeProcessReactor(), ffmpeg=None, streaming=True)
    encoder.write(b"\x01\x00" * 3)
    encoder.write(b"\x02\x00")
    assert writes == [wav_header(MONO_24K, None) + b"\x01\x00" * 3, b"\x02\x00"]
    assert encoder.pcm_bytes == 8


def test_wav_without_pcm_still_has_a_header() -> None:
    """A WAV that receives no PCM still gets its header, and finalize makes it a valid empty file."""
    sink = StringTransport()
    encoder = make_encoder("wav", MONO_24K, sink, reactor=FakeProcessReactor(), ffmpeg=None,
                           streaming=False)
    encoder.finish()
    with wave.open(io.BytesIO(b"".join(encoder.finalize([sink.value()])))) as parsed:
        assert parsed.getnframes() == 0
    with pytest.raises(ValueError):
        encoder.finalize([b"RIFF"])


def test_pcm_passes_through_and_finalize_is_identity() -> None:
    """pcm writes exactly what it receives, counts it, and leaves collected chunks alone."""
    sink = StringTransport()
    encoder = make_encoder("pcm", MONO_24K, sink, reactor=FakeProcessReactor(), ffmpeg=None,
                           streaming=True)
    encoder.write(b"\x01\x02\x03")
    encoder.write(b"\x04")
    assert sink.value() == b"\x01\x02\x03\x04"
    assert encoder.pcm_bytes == 4
    assert encoder.finalize([b"a", b"b"]) == [b"a", b"b"]


@pytest.mark.parametrize("fmt", ["wav", "pcm"])
def test_passthrough_backpressure_reaches_the_source(fmt: str) -> None:
    """A passthrough encoder makes the PCM source the sink's producer: when the sink pauses and
    resumes its producer, the source is paused and resumed."""
    sink = StringTransport()
    source = StringTransport()
    encoder = make_encoder(fmt, MONO_24K, sink, reactor=FakeProcessReactor(), ffmpeg=None,
                           streaming=True)
    encoder.registerProducer(source, True)
    assert sink.producer is source and sink.streaming
    sink.producer.pauseProducing()
    assert source.producerState == "paused"
    sink.producer.resumeProducing()
    assert source.producerState == "producing"
    encoder.unregisterProducer()
    assert sink.producer is None


def test_passthrough_abort() -> None:
    """After abort a passthrough drops PCM and finish fails; a second abort is harmless."""
    sink = StringTransport()
    encoder = make_encoder("wav", MONO_24K, sink, reactor=FakeProcessReactor(), ffmpeg=None,
                           streaming=True)
    encoder.abort()
    encoder.write(b"\x00\x00")
    encoder.abort()
    assert sink.value() == b""
    assert encoder.pcm_bytes == 0
    failure_of(encoder.finish()).trap(EncodingAborted)


def fake_ffmpeg(tmp_path: Path, script: str) -> str:
    """
    Write an executable shell script standing in for ffmpeg and return its path.
    """
    path = tmp_path / "ffmpeg"
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


LISTING = """\
Encoders:
 V..... = Video
 A..... = Audio
 ------
 V....D libopus_lookalike    a video encoder that must not count
 A....D aac                  AAC (Advanced Audio Coding)
 A....D flac                 FLAC (Free Lossless Audio Codec)
 A....D libmp3lame           libmp3lame MP3 (MPEG audio layer 3) (codec mp3)
"""


def test_available_formats_reads_the_encoder_list(tmp_path: Path) -> None:
    """Formats follow the audio encoders the binary lists, in canonical order; the probe runs
    once per binary path."""
    counter = tmp_path / "runs"
    ffmpeg = fake_ffmpeg(tmp_path, f'echo run >> "{counter}"\ncat <<"EOF"\n{LISTING}EOF\n')
    assert available_formats(ffmpeg) == ("wav", "mp3", "flac", "pcm", "aac")
    assert available_formats(ffmpeg) == ("wav", "mp3", "flac", "pcm", "aac")
    assert counter.read_text() == "run\n"


def test_available_formats_without_a_working_ffmpeg(tmp_path: Path) -> None:
    """No ffmpeg, a failing one, or a missing path leaves wav and pcm only."""
    assert available_formats(None) == ("wav", "pcm")
    assert available_formats(fake_ffmpeg(tmp_path, "echo broken >&2\nexit 1\n")) == ("wav", "pcm")
    assert available_formats(str(tmp_path / "absent")) == ("wav", "pcm")
    assert set(available_formats(None)) <= set(FORMATS)


def first_on_path(folder: Path, script: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """
    A fake ffmpeg (L{fake_ffmpeg}) in C{folder}, put first on PATH; the rest of PATH still
    finds the shell's own commands.
    """
    folder.mkdir()
    ffmpeg = fake_ffmpeg(folder, script)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    return ffmpeg


def test_probe_ffmpeg_keeps_its_answer_for_the_next_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A start probes ffmpeg once and keeps what it found; the next start (the in-process
    memo cleared) reads it without running anything, until the binary or PATH changes."""
    counter = tmp_path / "runs"
    ffmpeg = first_on_path(tmp_path / "bin", f'echo run >> "{counter}"\ncat <<"EOF"\n{LISTING}EOF\n', monkeypatch)
    cache = tmp_path / "cache"

    def start() -> tuple[str | None, tuple[str, ...]]:
        _audio_encoders.cache_clear()
        return probe_ffmpeg(cache)

    assert start() == (ffmpeg, ("wav", "mp3", "flac", "pcm", "aac"))
    assert start() == (ffmpeg, ("wav", "mp3", "flac", "pcm", "aac"))
    assert counter.read_text() == "run\n"
    assert [p.name.startswith("ffmpeg-") for p in cache.iterdir()] == [True]
    # The binary replaced in place: probed again.
    Path(ffmpeg).write_text(f'#!/bin/sh\necho run >> "{counter}"\necho " ------"\necho " A....D flac  FLAC"\n')
    os.utime(ffmpeg, ns=(1, 1))
    assert start() == (ffmpeg, ("wav", "flac", "pcm"))
    assert counter.read_text() == "run\nrun\n"
    assert start() == (ffmpeg, ("wav", "flac", "pcm"))
    assert counter.read_text() == "run\nrun\n"
    # Another ffmpeg first on PATH: another key, probed.
    second = first_on_path(tmp_path / "other", f'echo other >> "{counter}"\ncat <<"EOF"\n{LISTING}EOF\n', monkeypatch)
    assert start() == (second, ("wav", "mp3", "flac", "pcm", "aac"))
    assert counter.read_text() == "run\nrun\nother\n"


def test_probe_ffmpeg_keeps_no_failure_and_survives_a_bad_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A probe that found no encoders is not kept (the next start probes again), and a
    cache that is garbage or cannot be written only costs the probe."""
    counter = tmp_path / "runs"
    ffmpeg = first_on_path(tmp_path / "bin", f'echo run >> "{counter}"\nexit 1\n', monkeypatch)
    cache = tmp_path / "cache"
    for _ in range(2):
        _audio_encoders.cache_clear()
        assert probe_ffmpeg(cache) == (ffmpeg, ("wav", "pcm"))
    assert counter.read_text() == "run\nrun\n"
    assert not cache.exists()
    # A file where the folder should be: nothing can be kept, the answer still comes.
    blocked = tmp_path / "blocked"
    blocked.write_text("not a folder")
    Path(ffmpeg).write_text(f'#!/bin/sh\ncat <<"EOF"\n{LISTING}EOF\n')
    _audio_encoders.cache_clear()
    assert probe_ffmpeg(blocked) == (ffmpeg, ("wav", "mp3", "flac", "pcm", "aac"))
    # A kept answer that is garbage is probed over and replaced.
    _audio_encoders.cache_clear()
    assert probe_ffmpeg(cache)[1] == ("wav", "mp3", "flac", "pcm", "aac")
    (kept,) = cache.iterdir()
    kept.write_text("{not json")
    _audio_encoders.cache_clear()
    assert probe_ffmpeg(cache)[1] == ("wav", "mp3", "flac", "pcm", "aac")
    assert kept.read_text().startswith("{")
    assert list(cache.iterdir()) == [kept]


def test_probe_cache_dir_follows_xdg(tmp_path: Path) -> None:
    """The probes' folder is under XDG_CACHE_HOME when it is absolute, else ~/.cache."""
    assert probe_cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "rhapsode" / "probes"
    assert probe_cache_dir({"XDG_CACHE_HOME": "relative"}) == Path.home() / ".cache" / "rhapsode" / "probes"
    assert probe_cache_dir({}) == Path.home() / ".cache" / "rhapsode" / "probes"


def test_find_ffmpeg_prefers_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An ffmpeg on PATH wins; without one, the binary imageio-ffmpeg ships is used."""
    ffmpeg = fake_ffmpeg(tmp_path, "exit 0\n")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_ffmpeg() == ffmpeg
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert find_ffmpeg() == imageio_ffmpeg.get_ffmpeg_exe()


def test_make_encoder_refuses_what_it_cannot_produce() -> None:
    """An unknown format, or an ffmpeg format without ffmpeg, is unsupported (422, field format)."""
    for fmt in ("aac", "mp3"):
        with pytest.raises(Unsupported) as raised:
            make_encoder(fmt, MONO_24K, StringTransport(), reactor=FakeProcessReactor(),
                         ffmpeg=None, streaming=True)
        assert raised.value.field == "format"


def test_ffmpeg_command_lines() -> None:
    """The ffmpeg argv reads s16le from stdin at the native rate, writes the format to stdout
    (a buffered mp3 to a seekable temporary file, so its LAME header is filled in), flushes per
    packet only when streaming, and resamples opus input libopus cannot take."""
    _, _, _, argv, _ = ffmpeg_encoder("opus", NativeFormat(sample_rate=22050), streaming=True)
    split = argv.index("pipe:0") + 1
    inputs, outputs = argv[:split], argv[split:]
    assert inputs[0] == "/opt/ff"
    assert inputs[-8:] == ["-f", "s16le", "-ar", "22050", "-ac", "1", "-i", "pipe:0"]
    assert outputs == ["-c:a", "libopus", "-b:a", "32k", "-application", "voip", "-ar", "24000",
                       "-page_duration", "20000", "-f", "ogg", "-flush_packets", "1", "pipe:1"]
    _, _, _, argv, _ = ffmpeg_encoder("opus", MONO_24K, streaming=False)
    assert argv[argv.index("pipe:0") + 1:] == [
        "-c:a", "libopus", "-b:a", "32k", "-application", "voip", "-f", "ogg", "pipe:1"]
    encoder, _, _, argv, _ = ffmpeg_encoder("mp3", STEREO_22K, streaming=False)
    assert argv[argv.index("pipe:0") + 1:-1] == [
        "-c:a", "libmp3lame", "-b:a", "128k", "-f", "mp3", "-y"]
    assert argv[-1].endswith(".mp3") and os.path.exists(argv[-1])
    encoder.abort()
    assert not os.path.exists(argv[-1])
    _, _, _, argv, _ = ffmpeg_encoder("mp3", STEREO_22K, streaming=True)
    assert argv[argv.index("pipe:0") + 1:] == [
        "-c:a", "libmp3lame", "-b:a", "128k", "-f", "mp3", "-flush_packets", "1", "pipe:1"]
    _, _, _, argv, _ = ffmpeg_encoder("flac", MONO_24K, streaming=True)
    assert argv[argv.index("pipe:0") + 1:] == [
        "-c:a", "flac", "-f", "flac", "-flush_packets", "1", "pipe:1"]


def test_ffmpeg_wiring() -> None:
    """The encoder is the sink's streaming producer and forwards its pauses to the process; PCM
    and the PCM source go to ffmpeg's stdin."""
    encoder, sink, _, _, process = ffmpeg_encoder()
    assert sink.producer is encoder and sink.streaming
    verifyObject(IPushProducer, encoder)
    verifyObject(IConsumer, encoder)
    source = RecordingProducer()
    encoder.registerProducer(source, True)
    assert process.producer is source
    encoder.write(b"\x01\x00\x02\x00")
    assert process.stdin == b"\x01\x00\x02\x00" and encoder.pcm_bytes == 4
    sink.producer.pauseProducing()
    sink.producer.resumeProducing()
    assert process.calls == ["pause", "resume"]


def test_ffmpeg_finish_waits_for_exit_and_output() -> None:
    """finish unregisters the source and closes stdin, and fires only when ffmpeg has exited,
    after its output reached the sink; the sink's producer is unregistered by then."""
    encoder, sink, protocol, _, process = ffmpeg_encoder()
    source = RecordingProducer()
    encoder.registerProducer(source, True)
    done = encoder.finish()
    assert process.producer is None and process.calls == ["closeStdin"]
    assert not done.called
    protocol.childDataReceived(1, b"ID3-ish")
    protocol.childDataReceived(1, b" frames")
    assert not done.called
    process.pid = None
    protocol.processEnded(Failure(ProcessDone(0)))
    assert done.called and done.result is None
    assert sink.value() == b"ID3-ish frames" and sink.producer is None
    assert source.calls == []
    encoder.abort()
    assert process.calls == ["closeStdin"]
    assert encoder.finish().result is None


def test_ffmpeg_nonzero_exit_fails_with_stderr() -> None:
    """A non-zero exit errbacks finish with EncoderFailed carrying the tail of ffmpeg's stderr."""
    encoder, sink, protocol, _, process = ffmpeg_encoder()
    done = encoder.finish()
    protocol.childDataReceived(2, b"x" * 5000)
    protocol.childDataReceived(2, b"\nUnsupported channel layout\n")
    process.pid = None
    protocol.processEnded(Failure(ProcessTerminated(exitCode=234)))
    failure = failure_of(done)
    assert isinstance(failure.value, EncoderFailed)
    assert "Unsupported channel layout" in failure.value.stderr
    assert len(failure.value.stderr) <= 2000
    assert "234" in failure.value.message
    assert sink.producer is None


def test_ffmpeg_abort_kills_and_ignores_later_output() -> None:
    """abort kills ffmpeg, closes its pipes, unregisters from the sink and fails finish; output
    and the exit arriving afterwards are ignored, and abort twice is harmless."""
    encoder, sink, protocol, _, process = ffmpeg_encoder()
    source = RecordingProducer()
    encoder.registerProducer(source, True)
    waiting = encoder.finish()
    encoder.abort()
    encoder.abort()
    assert process.calls == ["closeStdin", "signal KILL", "loseConnection"]
    assert sink.producer is None
    failure_of(waiting).trap(EncodingAborted)
    encoder.write(b"\x00\x00")
    protocol.childDataReceived(1, b"late")
    process.pid = None
    protocol.processEnded(Failure(ProcessTerminated(signal=9)))
    assert sink.value() == b"" and process.stdin == b""
    failure_of(encoder.finish()).trap(EncodingAborted)


def test_ffmpeg_abort_after_exit_without_reap() -> None:
    """abort of a process that exited but whose pipes are still open tolerates ProcessExitedAlready."""
    encoder, sink, _, _, process = ffmpeg_encoder()
    process.pid = None
    encoder.abort()
    assert process.calls == ["loseConnection"]
    assert sink.producer is None


def test_sink_stop_stops_ffmpeg_and_source() -> None:
    """When the sink stops its producer (the client went away), ffmpeg is killed and the PCM
    source is stopped, as a passthrough sink would stop it directly."""
    encoder, sink, _, _, process = ffmpeg_encoder()
    source = RecordingProducer()
    encoder.registerProducer(source, True)
    sink.producer.stopProducing()
    assert source.calls == ["stop"]
    assert "signal KILL" in process.calls and process.producer is None


# -- float PCM from the adapter ----------------------------------------------------------


def _f32(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def _s16(data: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(data) // 2}h", data))


def test_float_pcm_is_clipped_scaled_and_truncated() -> None:
    """
    Float samples become 16-bit ones as Piper and Kokoro made theirs: clipped to
    [-1, 1], times 32767 in float32, truncated toward zero; a NaN is silence and an
    infinity full scale.
    """
    values = (0.0, 1.0, -1.0, 1.5, -7.0, 0.5, -0.5, 1 / 32767, -1.9 / 32767, float("nan"), float("inf"), float("-inf"))
    assert _s16(b"".join(pcm16_from_f32le(iter([_f32(*values)])))) == [
        0, 32767, -32767, 32767, -32767, 16383, -16383, 1, -1, 0, 32767, -32767,
    ]


def test_float32_rounding_is_kept_before_truncation() -> None:
    """
    The product is rounded to float32 before it is truncated, as numpy's float32
    arithmetic rounds it: 0.99999994 (the float32 below 1) times 32767 rounds to
    32766.998046875 in float32 and truncates to 32766.
    """
    below_one = struct.unpack("<f", struct.pack("<I", 0x3F7FFFFF))[0]
    assert _s16(b"".join(pcm16_from_f32le(iter([_f32(below_one, -below_one)])))) == [32766, -32766]
    # A value whose float64 product lies just under an integer that float32 rounds up to.
    tricky = struct.unpack("<f", struct.pack("<f", 12345.0 / 32767))[0]
    assert _s16(b"".join(pcm16_from_f32le(iter([_f32(tricky)])))) == [int(struct.unpack("<f", struct.pack("<f", tricky * 32767.0))[0])]


def test_a_sample_split_across_chunks_is_joined() -> None:
    """
    Chunks need not end on a sample: the bytes of one split across two are joined, and
    each chunk's whole samples go out as soon as it arrives.
    """
    data = _f32(0.25, -0.25, 0.75)
    out = list(pcm16_from_f32le(iter([data[:3], data[3:9], data[9:]])))
    assert [_s16(piece) for piece in out] == [[8191, -8191], [24575]]


def test_closing_the_conversion_closes_the_adapters_generator() -> None:
    """
    A job stopped mid-segment closes its step's generator; through the conversion, the
    adapter's own generator is closed too (its finally blocks run).
    """
    closed: list[bool] = []

    def adapter() -> Iterator[bytes]:
        try:
            while True:
                yield _f32(0.1)
        finally:
            closed.append(True)

    converted = pcm16_from_f32le(adapter())
    assert next(converted) == struct.pack("<h", 3276)
    converted.close()
    assert closed == [True]


def test_a_float_native_format_is_sent_as_16_bit() -> None:
    """
    pcm_f32le names four bytes a sample; what the SDK encodes from, and the
    capabilities name, is the 16-bit format at the same rate and channel count.
    """
    native = NativeFormat(sample_rate=22050, channels=2, encoding="pcm_f32le")
    assert native.bytes_per_frame == 8 and native.pcm16 == STEREO_22K
    assert STEREO_22K.pcm16 is STEREO_22K
    with pytest.raises(ValueError, match="pcm_s16le or pcm_f32le"):
        NativeFormat(sample_rate=16000, encoding="pcm_s24le")
