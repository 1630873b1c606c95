"""
Audio as the checker hears it: 16-bit PCM decoded from what a worker sent (wav by the
standard library, the compressed formats by ffmpeg), its length and loudness, and a small
WAV to upload as a reference.
"""

from __future__ import annotations

import io
import math
import shutil
import subprocess
import sys
import wave
from array import array
from dataclasses import dataclass

from ._report import Failed, TimedOut

#: LAME's encoder delay plus the decoder's (576 + 529): samples of silence an mp3 decoder
#: emits before the audio, at the native rate.
MP3_PRIMING_SAMPLES = 1105


def mp3_slack_samples(sample_rate: int) -> int:
    """
    Extra samples an mp3 decoder may emit beyond the audio: the priming delay and one
    frame of padding (1152 samples in MPEG-1, at 32 kHz and up; 576 below).
    """
    return MP3_PRIMING_SAMPLES + (1152 if sample_rate >= 32000 else 576)


@dataclass(frozen=True)
class Pcm:
    """
    Decoded audio: interleaved signed 16-bit samples.
    """

    samples: array[int]
    rate: int
    channels: int

    @property
    def frames(self) -> int:
        return len(self.samples) // self.channels

    @property
    def duration_ms(self) -> float:
        return self.frames * 1000.0 / self.rate

    @property
    def rms(self) -> float:
        """Root mean square as a share of full scale; 0 for no samples."""
        if not self.samples:
            return 0.0
        return math.sqrt(sum(s * s for s in self.samples) / len(self.samples)) / 32768.0


def pcm_from_s16le(data: bytes, rate: int, channels: int) -> Pcm:
    if len(data) % (2 * channels):
        raise Failed(f"{len(data)} bytes is not a whole number of {channels}-channel 16-bit frames")
    samples = array("h")
    samples.frombytes(data)
    if sys.byteorder == "big":
        samples.byteswap()
    return Pcm(samples, rate, channels)


def decode_wav(data: bytes) -> Pcm:
    try:
        with wave.open(io.BytesIO(data)) as reader:
            width, channels, rate = reader.getsampwidth(), reader.getnchannels(), reader.getframerate()
            frames = reader.readframes(reader.getnframes())
    except (wave.Error, EOFError) as exc:
        raise Failed(f"the body is not a WAV file the wave module reads: {exc}") from None
    if width != 2:
        raise Failed(f"the WAV holds {8 * width}-bit samples, not 16-bit")
    return pcm_from_s16le(frames, rate, channels)


def decode_with_ffmpeg(ffmpeg: str, data: bytes, rate: int, channels: int, timeout: float) -> Pcm:
    """
    Decode any container ffmpeg reads to s16le at C{rate} and C{channels}.
    """
    argv = [
        ffmpeg, "-hide_banner", "-loglevel", "error", "-nostdin", "-i", "pipe:0",
        "-f", "s16le", "-acodec", "pcm_s16le", "-ar", str(rate), "-ac", str(channels), "pipe:1",
    ]
    try:
        done = subprocess.run(argv, input=data, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise TimedOut(f"ffmpeg took over {timeout:.0f} s to decode") from None
    if done.returncode != 0:
        why = done.stderr.decode("utf-8", "replace").strip().splitlines()
        raise Failed(f"ffmpeg cannot decode the body: {why[-1] if why else done.returncode}")
    return pcm_from_s16le(done.stdout, rate, channels)


def tiny_wav(seconds: float = 1.0, rate: int = 16000) -> bytes:
    """A sine at 220 Hz: a well-formed reference file for refusals to be about its type."""
    samples = array("h", (int(8000 * math.sin(2 * math.pi * 220 * i / rate)) for i in range(int(seconds * rate))))
    if sys.byteorder == "big":
        samples.byteswap()
    out = io.BytesIO()
    with wave.open(out, "wb") as writer:
        writer.setnchannels(1)
        writer.setsampwidth(2)
        writer.setframerate(rate)
        writer.writeframes(samples.tobytes())
    return out.getvalue()


def find_ffmpeg() -> str | None:
    """
    The ffmpeg that decodes what a worker encoded: one on PATH, else imageio-ffmpeg's.
    """
    found = shutil.which("ffmpeg")
    if found is None:
        # Imported here, so that importing the checker (for --help, say) stays light.
        import imageio_ffmpeg

        try:
            found = str(imageio_ffmpeg.get_ffmpeg_exe())
        except RuntimeError:
            return None
    return found
