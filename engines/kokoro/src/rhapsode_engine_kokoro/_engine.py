"""
The Kokoro engine's adapter: Kokoro-82M, int8 ONNX, on the CPU through kokoro-onnx.

Text becomes phonemes through kokoro-onnx's own route, phonemizer driving espeak-ng, in
the seven languages that route really reads (L{ESPEAK_LANGUAGES}), with espeak-ng's
language-switch flags taken out (L{_phonemes}); the model makes 24 kHz audio from the
phonemes, a voice's style array and a speed.

Threads: the session is the SDK's L{BudgetedSession}: a generation alone runs on every
core of the worker's budget, and generations that overlap, in this worker (up to two at
once, C{concurrency = 2}) or another of the same core, run one thread each, so the
threads busy at once do not outnumber the cores (requests arriving together share the
cores from the start, even the first).  Measured on 2 cores with an 87-character segment: alone, 2.3-2.6 s on two threads against 4.0-4.2 s on one; two at
once, 4.0-4.9 s for both on one thread each, 5.0-5.7 s on one two-thread session.
Sharing a session is safe: onnxruntime runs one session from several threads, and
kokoro-onnx phonemizes under a lock, espeak-ng's state being global.

Segments: the SDK hands speak() up to 400 characters at a time and puts 250 ms of
silence at each joint.  The graph has no streaming output, and a call has no fixed cost
worth the name: of a 30-character piece's 1.08 s, phonemes take 0.3 ms, trimming and
conversion 1 ms, and the rest is the onnxruntime run (70% of it ConvInteger), which costs
about 0.5 s for each second of audio it renders.  What makes short pieces dear is that the
graph renders about 0.55 s of silence around every piece (0.26 s before, 0.30 s after, for
its start and end tokens), which kokoro-onnx trims away: about 0.28 s of compute a piece.
400 characters are about as many phonemes in English, within the 510 the graph reads at
once (a piece that phonemizes longer, numbers say, kokoro-onnx cuts in two), and near the
batches kokoro-onnx's own create() makes of a long text.  With 200-character pieces a
~2000-character text took 1.13-1.16x that create() in bench/side_by_side.py; with 400,
0.94-1.10x (median 1.01, four rounds; 450, which cuts that text into exactly create()'s
batches, read 1.02-1.11x in six).  The price is a run's working memory, about 1.5 MiB a
character while it runs: the worker's peak over that text was 583-614 MiB with 200 and
939-974 MiB with 400 (a kokoro-onnx process peaks at 1.11 GiB and keeps 1.10), given back when
the request's last segment ends, or by L{KokoroEngine.rest} once the worker is idle if the
request was cut short (L{_session.Shrinking}).

A streamed answer's first segment is kept to 30 characters, out in about 1.1 s on one
thread alone and 1.35-1.5 s on one of two busy cores; four requests arriving together get
first audio after one or two first segments (1.34, 1.36, 2.75, 2.77 s through a core at
best).  Each later segment holds at most twice the one before (30, 60, 120, 240, then
400: C{segment_growth}), so that on two cores each is made while the one before it plays
(the graph renders about 2.5 s of audio a second there).  With 200 characters straight
after the first 30, a listener heard the first piece's 2 s of audio and then waited
2.3 s for the second; with the growing pieces, not at all (the same text streamed through
a core, in three runs, the last with bench/stalls.py).

Weights are fetched into a cache outside the virtualenv (L{_fetch}); a load with no
weights fetches them first.  The same phonemes, voice and speed give the same bytes, so
the variant claims seed reproducibility, and the seed itself changes nothing.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Iterator, Mapping, Sequence

import numpy as np
from rhapsode_worker import (
    BadRequest,
    Engine,
    NativeFormat,
    Reference,
    SpeakRequest,
    Variant,
    Voice,
    WorkerContext,
)
from twisted.logger import Logger

from ._fetch import MODEL, VOICES, cache_dir, ensure
from ._phonemes import without_language_switches
from ._voices import (
    BUILTIN_VOICES,
    DEFAULT_VOICES,
    ESPEAK_LANGUAGES,
    StyleStore,
    blend_styles,
    builtin_listing,
    builtin_style,
    style_from_voicepack,
)

if TYPE_CHECKING:
    from kokoro_onnx import Kokoro

    from ._session import Shrinking

log = Logger(namespace="rhapsode_engine_kokoro")


def _not_word_count_noise(record: logging.LogRecord) -> bool:
    # phonemizer warns of a word-count mismatch on every text whose punctuation is kept,
    # which is how kokoro-onnx always calls it; the counts are never used, so the warning
    # would be one line of noise per segment spoken.
    return not record.getMessage().startswith("words count mismatch")


logging.getLogger("phonemizer").addFilter(_not_word_count_noise)

VARIANT = "v1.0-int8"
SAMPLE_RATE = 24_000
#: What rest() has the model say to give the arena back: one phoneme, the least it takes.
_A_SOUND = "ə"

_VARIANTS: dict[str, Variant] = {
    VARIANT: Variant(
        dials={"speed": (0.5, 2.0, 1.0)},
        languages=tuple(ESPEAK_LANGUAGES),
        max_speakers=0,
        seed_reproducible=True,
    ),
}


class KokoroEngine(Engine):
    """
    Kokoro-82M, int8 ONNX: 54 built-in voices, blends of them, and uploaded voicepacks.
    """

    # The graph makes float samples; the SDK converts them to 16-bit on the synthesis thread.
    native_format = NativeFormat(sample_rate=SAMPLE_RATE, encoding="pcm_f32le")
    upstream_distribution = "kokoro-onnx"
    segment_characters = 400
    first_segment_characters = 30
    segment_growth = 2
    joint_silence_ms = 250
    concurrency = 2
    reference_formats = ("npy", "pt")

    #: The loaded model, set by load(): the SDK calls speak() only once load() has
    #: succeeded, and variants() has only the one variant.
    _kokoro: Kokoro

    def __init__(self, context: WorkerContext | None = None) -> None:
        super().__init__(context)
        self._environ = self.context.environ
        self._shrinking: Shrinking | None = None
        self._cache = cache_dir(self._environ, self.context.cache_dir)

    def variants(self) -> Mapping[str, Variant]:
        return _VARIANTS

    def fetch(self, variant: str) -> None:
        ensure(self._cache)

    def load(self, variant: str) -> None:
        # Imported here so that a worker answers its handshake, lists and makes voices
        # without paying for onnxruntime and espeak-ng until a model is wanted.
        from kokoro_onnx import Kokoro

        from ._session import Shrinking, shrinking_session

        ensure(self._cache)
        started = time.monotonic()
        shrinking = Shrinking()
        session = shrinking_session(self._cache / MODEL.name, self._environ, shrinking)
        self._kokoro = Kokoro.from_session(session, str(self._cache / VOICES.name))
        self._shrinking = shrinking
        log.info("{variant} loaded in {seconds:.2f} s with sessions of {threads} intra-op thread(s)",
                 variant=variant, seconds=time.monotonic() - started,
                 threads=" and ".join(map(str, session.counts)))

    def unload(self) -> None:
        # Also called after a failed load, which may have set nothing.
        if hasattr(self, "_kokoro"):
            del self._kokoro
        self._shrinking = None

    def voices(self) -> Sequence[Voice]:
        return [builtin_listing(name) for name in BUILTIN_VOICES] + self._store().created()

    def speak(self, request: SpeakRequest) -> Iterator[bytes]:
        kokoro = self._kokoro
        voice = request.voice or DEFAULT_VOICES[request.language]
        if voice in BUILTIN_VOICES:
            style = kokoro.voices[BUILTIN_VOICES.index(voice)]
        else:
            style = np.load(self._store().style_path(voice))
        phonemes = without_language_switches(
            kokoro.tokenizer.phonemize(request.text, ESPEAK_LANGUAGES[request.language])
        )
        if not phonemes:
            if request.segment_count == 1:
                raise BadRequest(
                    f"nothing in the text can be pronounced in {request.language}", field="text"
                )
            # One unpronounceable piece of a longer text is silence, not a failure.
            return iter(())
        shrinking = self._shrinking
        assert shrinking is not None
        with shrinking.segment(request.segment_index == request.segment_count - 1):
            audio, _ = kokoro.create(phonemes, style, speed=request.params["speed"], is_phonemes=True)
        return iter((audio.astype("<f4", copy=False).tobytes(),))

    def rest(self) -> None:
        # A request cut short between its segments (or a failed run) left the arena at
        # its largest: one small run that shrinks gives it back, about a quarter second
        # of CPU here, once per such idle spell.
        kokoro, shrinking = getattr(self, "_kokoro", None), self._shrinking
        if kokoro is None or shrinking is None or not shrinking.owed:
            return
        with shrinking.segment(True):
            kokoro.create(_A_SOUND, kokoro.voices[0], speed=1.0, is_phonemes=True)

    def create_voice(self, voice_id: str, label: str, reference: Reference) -> Voice:
        style = style_from_voicepack(reference.filename, reference.data)
        origin = {"kind": "voicepack", "filename": reference.filename}
        return self._store().save(voice_id, label, style, origin)

    def blend_voice(
        self, voice_id: str, label: str, components: Sequence[tuple[str, float]]
    ) -> Voice:
        store = self._store()
        if any(name in BUILTIN_VOICES for name, _ in components):
            # The voices file, not the graph: a blend never loads the model.
            ensure(self._cache, (VOICES,))
        parts = [
            (builtin_style(self._cache / VOICES.name, name) if name in BUILTIN_VOICES
             else store.style(name), weight)
            for name, weight in components
        ]
        origin = {"kind": "blend", "components": [[name, weight] for name, weight in components]}
        return store.save(voice_id, label, blend_styles(parts), origin)

    def delete_voice(self, voice_id: str) -> None:
        self._store().delete(voice_id)

    def _store(self) -> StyleStore:
        return StyleStore(self.context.voice_dir)

