"""
Turning an adapter's native PCM into the response formats of protocol.md sections 6 and 8, as
it arrives.

An adapter that yields 32-bit float PCM has it converted to 16-bit first, on the synthesis
thread (L{pcm16_from_f32le}).  wav and pcm are passthrough in Python.  mp3, opus (Ogg Opus),
flac and aac (ADTS frames, ffmpeg's own encoder) go through one ffmpeg child per response, spawned with the reactor: the ffmpeg binary on PATH when there is one,
otherwise the one the imageio-ffmpeg wheel ships, so no system package is needed.

Backpressure is wiring, not buffering.  A passthrough encoder hands the PCM source to the sink
as the sink's producer.  The ffmpeg encoder is the sink's producer itself (pausing it stops
reading ffmpeg's stdout) and hands the PCM source to ffmpeg's stdin writer, a Twisted
FileDescriptor that pauses a streaming producer once more than its bufferSize (64 KiB) waits
unwritten.  A stalled reader therefore stalls ffmpeg, which stalls stdin, which pauses the
source.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from array import array
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol, cast

import imageio_ffmpeg
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.error import ProcessDone, ProcessExitedAlready, ProcessTerminated
from twisted.internet.interfaces import IConsumer, IProducer, IPushProducer, IReactorProcess
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.threads import deferToThreadPool
from twisted.python.failure import Failure
from zope.interface import implementer

from rhapsode_protocol.errors import Internal, Unsupported
from rhapsode_protocol.schemas import MEDIA_TYPES

from ._engine import NativeFormat
from ._folders import cache_home

FORMATS: tuple[str, ...] = tuple(MEDIA_TYPES)

_ENCODER_OF = {"mp3": "libmp3lame", "opus": "libopus", "flac": "flac", "aac": "aac"}
_OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
_UNKNOWN_SIZE = 0xFFFFFFFF
_HEADER_SIZE = 44
_STDERR_KEPT = 2000


def find_ffmpeg() -> str | None:
    """
    The ffmpeg to encode with: one on PATH first, then the one imageio-ffmpeg ships; None when
    neither exists.
    """
    on_path = shutil.which("ffmpeg")
    if on_path is not None:
        return on_path
    try:
        return str(imageio_ffmpeg.get_ffmpeg_exe())
    except RuntimeError:
        return None


def available_formats(ffmpeg: str | None) -> tuple[str, ...]:
    """
    The formats this machine can produce, in L{FORMATS} order: wav and pcm always, the others
    only when C{ffmpeg} lists their encoder.  Blocks while the probe runs (once per binary path),
    so call it at start-up, before the reactor runs.
    """
    encoders = _audio_encoders(ffmpeg) if ffmpeg is not None else frozenset()
    return tuple(f for f in FORMATS if f not in _ENCODER_OF or _ENCODER_OF[f] in encoders)


def probe_cache_dir(environ: Mapping[str, str]) -> Path:
    """
    Where a worker keeps what it learnt of this machine at start-up (L{probe_ffmpeg}):
    C{$XDG_CACHE_HOME/rhapsode/probes}, else C{~/.cache/rhapsode/probes}.
    """
    return cache_home(environ) / "probes"


def probe_ffmpeg(cache: Path | None) -> tuple[str | None, tuple[str, ...]]:
    """
    L{find_ffmpeg} and the L{available_formats} of what it finds, as the last start in
    this environment found them where nothing they depend on has changed since, else
    probed afresh and kept in the folder C{cache} (None: always probed).

    Probing runs two programs before a worker can listen (imageio-ffmpeg checks its
    binary with C{-version}, then C{-encoders} lists the encoders): 30-40 ms of every
    cold start here.  What they depend on makes the key: the ffmpeg on C{PATH},
    C{IMAGEIO_FFMPEG_EXE}, the imageio-ffmpeg installed and this interpreter; and the
    binary found must be the one probed, by its size and modification time.  Only a
    probe that found an ffmpeg with encoders is kept, so a machine that gains one is
    probed again.  Blocks (once per start), as the probes do.
    """
    key = json.dumps([
        shutil.which("ffmpeg"),
        os.environ.get("IMAGEIO_FFMPEG_EXE"),
        getattr(imageio_ffmpeg, "__version__", ""),
        imageio_ffmpeg.__file__,
        sys.prefix,
    ])
    record = None if cache is None else cache / f"ffmpeg-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    if record is not None:
        try:
            kept = json.loads(record.read_text(encoding="utf-8"))
            found = os.stat(kept["ffmpeg"])
            if kept["key"] == key and [found.st_size, found.st_mtime_ns] == kept["binary"]:
                return str(kept["ffmpeg"]), tuple(f for f in FORMATS if f in kept["formats"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # none kept, another start's, or unreadable: probe
    ffmpeg = find_ffmpeg()
    formats = available_formats(ffmpeg)
    if record is not None and ffmpeg is not None and set(formats) - {"wav", "pcm"}:
        partial = record.with_name(f".{record.name}.{os.getpid()}")
        try:
            found = os.stat(ffmpeg)
            record.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps({
                "key": key, "ffmpeg": ffmpeg, "binary": [found.st_size, found.st_mtime_ns], "formats": formats,
            }), encoding="utf-8")
            os.replace(partial, record)  # whole or not at all: another worker may read it now
        except OSError:
            # A cache that cannot be written: the next start probes again.
            with contextlib.suppress(OSError):
                partial.unlink()
    return ffmpeg, formats


@lru_cache(maxsize=None)
def _audio_encoders(ffmpeg: str) -> frozenset[str]:
    try:
        listing = subprocess.run(
            [ffmpeg, "-hide_banner", "-encoders"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return frozenset()
    # The legend above the "------" line has the same shape as an entry ("A..... = Audio").
    _, _, entries = listing.partition("------")
    return frozenset(
        fields[1] for fields in map(str.split, entries.splitlines())
        if len(fields) >= 2 and fields[0].startswith("A")
    )


_FULL_SCALE = 32767.0


def _f32_to_s16(data: bytes) -> bytes:
    """
    Little-endian float32 samples as little-endian int16: clipped to [-1, 1], scaled by
    32767 in float32 arithmetic and truncated toward zero, as Piper and Kokoro converted
    their own (so their bytes are unchanged); a NaN is silence.  Through numpy when the
    adapter has loaded it (the SDK never imports it), else in Python: the same bytes,
    the first about fifty times faster.
    """
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        values = numpy.nan_to_num(numpy.frombuffer(data, dtype="<f4"), nan=0.0)
        scaled = numpy.clip(values, -1.0, 1.0) * numpy.float32(_FULL_SCALE)
        return bytes(scaled.astype("<i2").tobytes())
    values = array("f")
    values.frombytes(data)
    if sys.byteorder == "big":
        values.byteswap()
    # array("f") rounds each product to float32, as numpy's float32 multiply does.
    scaled = array("f", [
        (v * _FULL_SCALE if -1.0 <= v <= 1.0 else (_FULL_SCALE if v > 1.0 else -_FULL_SCALE)) if v == v else 0.0
        for v in values
    ])
    samples = array("h", [int(v) for v in scaled])
    if sys.byteorder == "big":
        samples.byteswap()
    return samples.tobytes()


def pcm16_from_f32le(chunks: Iterator[Any]) -> Iterator[Any]:
    """
    An adapter's float32 PCM as 16-bit PCM, chunk by chunk; a sample split across two
    chunks is joined.  Anything that is not bytes (a timing) passes as it is, in its
    place.  Closing this closes the adapter's generator.
    """
    pending = b""
    try:
        for chunk in chunks:
            if not isinstance(chunk, (bytes, bytearray, memoryview)):
                yield chunk
                continue
            data = pending + bytes(chunk) if pending else bytes(chunk)
            whole = len(data) - len(data) % 4
            pending = data[whole:]
            if whole:
                yield _f32_to_s16(data[:whole])
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()


def content_type(fmt: str, native: NativeFormat) -> str:
    """
    The Content-Type of a response in C{fmt}.  For pcm it is audio/L16 with the rate and channel
    count, and the bytes are the native signed 16-bit I{little}-endian samples: RFC 2586 defines
    L16 as big-endian, but this contract sends s16le under that label, and a response's
    Content-Type is authoritative for what the contract means by it.  opus is Ogg Opus labelled
    audio/opus, as section 6 explains.
    """
    if fmt not in MEDIA_TYPES:
        raise ValueError(f"unknown format {fmt!r}")
    if fmt == "pcm":
        return f"{MEDIA_TYPES[fmt]}; rate={native.sample_rate}; channels={native.channels}"
    return MEDIA_TYPES[fmt]


def wav_header(native: NativeFormat, data_bytes: int | None) -> bytes:
    """
    A 44-byte RIFF/WAVE header for 16-bit PCM.  C{data_bytes} None means a stream of unknown
    length: the RIFF and data sizes are then 0xFFFFFFFF, which streaming players and ffmpeg read
    as "until the end".  A size too large for the 32-bit fields gets the same marker.
    """
    data = _UNKNOWN_SIZE if data_bytes is None else min(data_bytes, _UNKNOWN_SIZE)
    riff = _UNKNOWN_SIZE if data_bytes is None else min(data_bytes + 36, _UNKNOWN_SIZE)
    return struct.pack(
        "<4sI4s4sIHHIIHH4sI",
        b"RIFF", riff, b"WAVE",
        b"fmt ", 16, 1, native.channels, native.sample_rate,
        native.bytes_per_second, native.bytes_per_frame, 16,
        b"data", data,
    )


class EncoderFailed(Internal):
    """
    ffmpeg ended without delivering the whole stream.

    @ivar stderr: the tail of what it wrote on stderr.
    """

    def __init__(self, how: str, stderr: str) -> None:
        super().__init__(f"ffmpeg {how}: {stderr.strip() or '(no diagnostics)'}")
        self.stderr = stderr


class EncodingAborted(Exception):
    """
    The encoder was aborted before it delivered the whole stream.
    """


class _State(enum.Enum):
    OPEN = "open"  # accepting PCM
    FINISHING = "finishing"  # no more PCM; encoded bytes still draining
    DONE = "done"  # the outcome is known
    ABORTED = "aborted"


@implementer(IConsumer)
class Encoder:
    """
    A consumer of native PCM that writes one format's bytes to a sink.  This class is the pcm
    passthrough: the PCM source becomes the sink's producer, so the sink pauses it directly.
    Subclasses change what goes between the two.  PCM written after L{finish} or L{abort} is
    ignored.

    @ivar pcm_bytes: PCM bytes accepted so far.
    """

    def __init__(self, sink: IConsumer) -> None:
        self.pcm_bytes = 0
        self._sink = sink
        self._state = _State.OPEN
        self._outcome: Failure | None = None
        self._waiters: list[Deferred[None]] = []

    def registerProducer(self, producer: IProducer, streaming: bool) -> None:
        self._sink.registerProducer(producer, streaming)

    def unregisterProducer(self) -> None:
        self._sink.unregisterProducer()

    def write(self, data: bytes) -> None:
        if self._state is _State.OPEN:
            self.pcm_bytes += len(data)
            self._sink.write(data)

    def finish(self) -> Deferred[None]:
        """
        No more PCM.  Fires once every encoded byte has been written to the sink; errbacks with
        L{EncoderFailed} if ffmpeg failed and L{EncodingAborted} after L{abort}.
        """
        if self._state is _State.OPEN:
            self._state = _State.FINISHING
            self._close()
        if self._state is _State.FINISHING:
            waiter: Deferred[None] = Deferred()
            self._waiters.append(waiter)
            return waiter
        return succeed(None) if self._outcome is None else fail(self._outcome)

    def abort(self) -> None:
        """
        Stop now and drop whatever is still to come.  Safe in any state.
        """
        if self._state in (_State.OPEN, _State.FINISHING):
            self._state = _State.ABORTED
            self._stop()
            self._conclude(_State.ABORTED, Failure(EncodingAborted()))

    def finalize(self, chunks: list[bytes]) -> list[bytes]:
        """
        Given everything the sink received from a buffered (not streaming) encode, the body to
        send.  Only WAV has anything to fix.
        """
        return chunks

    def _close(self) -> None:
        self._conclude(_State.DONE, None)

    def _stop(self) -> None:
        pass

    def _conclude(self, state: _State, outcome: Failure | None) -> None:
        self._state = state
        self._outcome = outcome
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if outcome is None:
                waiter.callback(None)
            else:
                waiter.errback(outcome)


class _WavEncoder(Encoder):
    """
    A header with unknown sizes, then PCM.  The header goes out with the first PCM, in the
    same write, rather than at construction, so a request that fails before any audio can
    still answer an error.
    """

    def __init__(self, native: NativeFormat, sink: IConsumer) -> None:
        super().__init__(sink)
        self._native = native
        self._header = wav_header(native, None)

    def write(self, data: bytes) -> None:
        if self._header and data and self._state is _State.OPEN:
            # With the first PCM in one write: one send on the wire, not two.
            header, self._header = self._header, b""
            self.pcm_bytes += len(data)
            self._sink.write(header + data)
            return
        super().write(data)

    def _close(self) -> None:
        self._send_header()
        super()._close()

    def _send_header(self) -> None:
        if self._header:
            header, self._header = self._header, b""
            self._sink.write(header)

    def finalize(self, chunks: list[bytes]) -> list[bytes]:
        return _sized_wav(self._native, chunks)


def _sized_wav(native: NativeFormat, chunks: list[bytes]) -> list[bytes]:
    """
    A buffered WAV's chunks with its header's sizes filled in.
    """
    skip = _HEADER_SIZE
    body: list[bytes] = []
    for chunk in chunks:
        if skip >= len(chunk):
            skip -= len(chunk)
            continue
        body.append(chunk[skip:] if skip else chunk)
        skip = 0
    if skip:
        raise ValueError("fewer bytes than a WAV header")
    return [wav_header(native, sum(map(len, body))), *body]


class _Process(Protocol):
    """
    What the encoder uses of a POSIX process transport: IProcessTransport declares neither the
    producer nor the consumer half, which twisted.internet.process.Process has anyway.
    """

    def write(self, data: bytes) -> None: ...
    def closeStdin(self) -> None: ...
    def loseConnection(self) -> None: ...
    def signalProcess(self, signalID: str | int) -> None: ...
    def registerProducer(self, producer: IProducer, streaming: bool) -> None: ...
    def unregisterProducer(self) -> None: ...
    def pauseProducing(self) -> None: ...
    def resumeProducing(self) -> None: ...


class _FfmpegProtocol(ProcessProtocol):
    """
    Routes the child's stdout, stderr and exit to its encoder.
    """

    def __init__(self, encoder: _FfmpegEncoder) -> None:
        self._encoder = encoder

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        if childFD == 1:
            self._encoder._encoded(data)
        else:
            self._encoder._diagnostic(data)

    def processEnded(self, reason: Failure) -> None:
        self._encoder._ended(reason)


@implementer(IConsumer, IPushProducer)
class _FfmpegEncoder(Encoder):
    """
    One ffmpeg child: PCM to its stdin, its stdout to the sink, whose producer this is.
    """

    def __init__(self, argv: list[str], sink: IConsumer, reactor: IReactorProcess) -> None:
        super().__init__(sink)
        self._source: IProducer | None = None
        self._stderr = b""
        # env=None hands ffmpeg this process's environment (the default is an empty one).
        self._process = cast(
            _Process, reactor.spawnProcess(_FfmpegProtocol(self), argv[0], argv, env=None)
        )
        sink.registerProducer(self, True)

    def registerProducer(self, producer: IProducer, streaming: bool) -> None:
        self._source = producer
        self._process.registerProducer(producer, streaming)

    def unregisterProducer(self) -> None:
        self._source = None
        self._process.unregisterProducer()

    def write(self, data: bytes) -> None:
        if self._state is _State.OPEN:
            self.pcm_bytes += len(data)
            self._process.write(data)

    def pauseProducing(self) -> None:
        if self._state in (_State.OPEN, _State.FINISHING):
            self._process.pauseProducing()

    def resumeProducing(self) -> None:
        if self._state in (_State.OPEN, _State.FINISHING):
            self._process.resumeProducing()

    def stopProducing(self) -> None:
        """
        The sink is gone: kill ffmpeg and stop the PCM source, as a passthrough sink would.
        """
        source = self._source
        self.abort()
        if source is not None:
            source.stopProducing()

    def _close(self) -> None:
        # Unregister first: a writer that closes with a producer still registered stops it.
        self.unregisterProducer()
        self._process.closeStdin()

    def _stop(self) -> None:
        self.unregisterProducer()
        try:
            self._process.signalProcess("KILL")
        except ProcessExitedAlready:
            pass
        # processEnded waits for every pipe to close, and a paused stdout would never see EOF.
        self._process.loseConnection()
        self._sink.unregisterProducer()

    def _encoded(self, data: bytes) -> None:
        if data and self._state in (_State.OPEN, _State.FINISHING):
            self._sink.write(data)

    def _diagnostic(self, data: bytes) -> None:
        self._stderr = (self._stderr + data)[-_STDERR_KEPT:]

    def _ended(self, reason: Failure) -> None:
        if self._state is _State.ABORTED:
            return
        self._sink.unregisterProducer()
        if reason.check(ProcessDone):
            self._conclude(_State.DONE, None)
            return
        ended = cast(ProcessTerminated, reason.value)
        how = (f"exited with status {ended.exitCode}" if ended.signal is None
               else f"was killed by signal {ended.signal}")
        failed = EncoderFailed(how, self._stderr.decode("utf-8", "replace"))
        self._conclude(_State.DONE, Failure(failed))


class _ResampledWavEncoder(_FfmpegEncoder):
    """
    A WAV at a rate the engine does not speak at: ffmpeg resamples the PCM, and the
    header (at the rate asked for) goes out with its first resampled bytes.
    """

    def __init__(self, argv: list[str], target: NativeFormat, sink: IConsumer, reactor: IReactorProcess) -> None:
        self._target = target
        self._header = wav_header(target, None)
        super().__init__(argv, sink, reactor)

    def _encoded(self, data: bytes) -> None:
        if self._header and self._state in (_State.OPEN, _State.FINISHING):
            header, self._header = self._header, b""
            self._sink.write(header)
        super()._encoded(data)

    def _ended(self, reason: Failure) -> None:
        if reason.check(ProcessDone):
            self._encoded(b"")  # a WAV of no samples is still a header
        super()._ended(reason)

    def finalize(self, chunks: list[bytes]) -> list[bytes]:
        return _sized_wav(self._target, chunks)


class _FfmpegFileEncoder(_FfmpegEncoder):
    """
    A buffered MP3: ffmpeg writes to a seekable temporary file so that it can go back and
    fill in the LAME header, whose delay and padding let a decoder trim the encoder's
    priming (about 46 ms at 24 kHz).  A pipe cannot be rewound, so a streamed MP3 keeps it.
    The file is read back off the reactor thread once ffmpeg exits, and always removed.
    """

    def __init__(
        self, argv: list[str], path: str, sink: IConsumer, reactor: IReactorProcess, blocking: "Blocking"
    ) -> None:
        self._path = path
        self._blocking = blocking
        super().__init__(argv + [path], sink, reactor)

    def _stop(self) -> None:
        super()._stop()
        _discard(self._path)  # ffmpeg may still hold it open; POSIX lets it go regardless

    def _ended(self, reason: Failure) -> None:
        if self._state is _State.ABORTED or not reason.check(ProcessDone):
            _discard(self._path)
            super()._ended(reason)
            return
        self._sink.unregisterProducer()

        def read_back() -> bytes:
            try:
                with open(self._path, "rb") as f:
                    return f.read()
            finally:
                _discard(self._path)

        def deliver(data: bytes) -> None:
            if self._state is not _State.ABORTED:
                self._sink.write(data)
                self._conclude(_State.DONE, None)

        def failed(failure: Failure) -> None:
            if self._state is not _State.ABORTED:
                self._conclude(_State.DONE, Failure(EncoderFailed("output unreadable", str(failure.value))))

        self._blocking(read_back).addCallbacks(deliver, failed)


def _discard(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _ffmpeg_argv(
    ffmpeg: str, fmt: str, native: NativeFormat, streaming: bool, rate: int | None = None
) -> list[str]:
    """
    ffmpeg's command line from C{native} PCM on stdin to C{fmt} on stdout, resampled to
    C{rate} where one is given (pcm and wav come out as 16-bit PCM at that rate, which
    the caller frames).  swresample's default filter (32 taps of windowed sinc) does it.
    """
    channels = native.channels
    argv = [
        ffmpeg, "-hide_banner", "-loglevel", "error", "-nostdin",
        "-f", "s16le", "-ar", str(native.sample_rate), "-ac", str(channels), "-i", "pipe:0",
        "-c:a", _ENCODER_OF.get(fmt, "pcm_s16le"),
    ]
    if rate is not None and fmt != "opus":
        argv += ["-ar", str(rate)]
    if fmt in ("pcm", "wav"):
        argv += ["-f", "s16le"]
    elif fmt == "mp3":
        argv += ["-b:a", f"{64 * channels}k", "-f", "mp3"]
    elif fmt == "opus":
        argv += ["-b:a", f"{32 * channels}k", "-application", "voip"]
        # libopus takes only these rates; older ffmpeg builds do not resample on their own.
        if rate is None:
            rate = next((r for r in _OPUS_RATES if r >= native.sample_rate), _OPUS_RATES[-1])
        if rate != native.sample_rate:
            argv += ["-ar", str(rate)]
        if streaming:
            argv += ["-page_duration", "20000"]
        argv += ["-f", "ogg"]
    elif fmt == "aac":
        # ADTS: each frame carries its own header, so the stream can be cut and played
        # anywhere, as OpenAI's aac is; an MP4 container would need its index first.
        argv += ["-b:a", f"{64 * channels}k", "-f", "adts"]
    else:
        argv += ["-f", "flac"]
    if streaming:
        argv += ["-flush_packets", "1"]
    return argv


#: Runs a blocking call off the reactor thread: C{blocking(f, *args)} fires with its result.
Blocking = Callable[..., "Deferred[Any]"]


def _pool_of(reactor: Any) -> Blocking:
    """
    Blocking calls on C{reactor}'s own thread pool, looked up when one is made.
    """
    return lambda f, *args: deferToThreadPool(reactor, reactor.getThreadPool(), f, *args)


def make_encoder(
    fmt: str,
    native: NativeFormat,
    sink: IConsumer,
    *,
    reactor: IReactorProcess,
    ffmpeg: str | None,
    streaming: bool,
    blocking: Blocking | None = None,
    rate: int | None = None,
) -> Encoder:
    """
    An encoder from C{native} PCM to C{fmt}, writing to C{sink}.  For an ffmpeg format the child
    starts now and the encoder registers itself as the sink's producer; C{streaming} asks ffmpeg
    to flush every packet (and Ogg to cut 20 ms pages) so the first bytes leave early.
    C{blocking} runs the file work of a buffered MP3 off the reactor thread (by default on
    C{reactor}'s own thread pool).  C{rate}, where it is not C{native}'s, is the rate to
    answer in: ffmpeg resamples, for pcm and wav too (which then go through an ffmpeg
    child of their own rather than straight to the sink).

    @raise Unsupported: C{fmt} is not one this machine can produce, or C{rate} needs
        an ffmpeg it lacks.
    """
    if rate == native.sample_rate:
        rate = None
    if fmt in ("pcm", "wav") and rate is not None:
        if ffmpeg is None:
            raise Unsupported(f"resampling to {rate} Hz needs ffmpeg, which this machine lacks", field="sampleRate")
        argv = _ffmpeg_argv(ffmpeg, fmt, native, streaming, rate) + ["pipe:1"]
        if fmt == "pcm":
            return _FfmpegEncoder(argv, sink, reactor)
        return _ResampledWavEncoder(argv, NativeFormat(sample_rate=rate, channels=native.channels), sink, reactor)
    if fmt == "pcm":
        return Encoder(sink)
    if fmt == "wav":
        return _WavEncoder(native, sink)
    if fmt not in _ENCODER_OF:
        raise Unsupported(f"no format {fmt!r}", field="format")
    if ffmpeg is None:
        raise Unsupported(f"format {fmt!r} needs ffmpeg, which this machine lacks", field="format")
    argv = _ffmpeg_argv(ffmpeg, fmt, native, streaming, rate)
    if fmt == "mp3" and not streaming:
        handle, path = tempfile.mkstemp(prefix="rhapsode-", suffix=".mp3")
        os.close(handle)
        return _FfmpegFileEncoder(argv + ["-y"], path, sink, reactor, blocking or _pool_of(reactor))
    return _FfmpegEncoder(argv + ["pipe:1"], sink, reactor)
