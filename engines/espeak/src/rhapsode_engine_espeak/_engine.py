"""
The eSpeak NG adapter: formant synthesis in every language the bundled libespeak-ng
speaks, with its variants as voices.

What it claims, and why:
  - Languages and voices are what espeak_ListVoices lists when the worker starts (see
    L{_catalogue} for the mapping), less any language voice that says nothing: the wheel
    lists voices whose dictionaries it does not ship, and those are left out.
  - Dials are espeak's own parameters, deliveries move them relative to the request's
    settings, and no cue is claimed: espeak performs none of the eight.
  - No seed reproducibility.  espeak has no randomness a seed could fix, but its wave
    generator keeps state from one utterance to the next (the pitch-flutter index and
    gain control are statics that espeak_Initialize does not reset), so the same request
    twice in one worker gives slightly different bytes.

Concurrency 1, the SDK's default: libespeak-ng is not re-entrant, and L{Espeak} makes
every call into it on one thread.  A synthesis uses that one thread and no pool, so
two engines speaking at once on two cores do not oversubscribe them.

Segments of 400 characters: espeak needs no limit of its own (it speaks a clause at a
time), so the size only sets how long another request waits for its turn, about 20 ms
of synthesis, and how much audio a paused reader can leave in memory, about 25 seconds
(1.1 MB).  No joint silence: every segment but the last ends with espeak's own pause
for its last clause (espeakENDPAUSE), which follows the punctuation and the rate as the
pauses inside a segment do, so a joint sounds like any other sentence boundary.
"""

from __future__ import annotations

from typing import Iterator, Mapping, Sequence

from rhapsode_worker import (
    Engine,
    NativeFormat,
    SpeakRequest,
    Timestamps,
    Timing,
    UnknownVoice,
    Unsupported,
    Variant,
    Voice,
    WorkerContext,
)

from ._catalogue import (
    DELIVERIES,
    DIALS,
    EMBEDDED_COMMAND,
    espeak_settings,
    language_voices,
    timbres,
)
from ._espeak import SAMPLE_RATE, Espeak
from ._timings import Aligner

VARIANT = "default"
_GENDERS = {1: "male", 2: "female"}
#: Words and phonemes from espeak's own synthesis events, each word with its place in
#: the text (L{_timings}).
TIMESTAMPS = Timestamps(units=("word", "phoneme"), source="synthesizer", text_offsets=True)


class EspeakEngine(Engine):
    """
    eSpeak NG through libespeak-ng.
    """

    native_format = NativeFormat(sample_rate=SAMPLE_RATE)
    max_characters = 4096
    segment_characters = 400
    joint_silence_ms = 0
    private_tag_patterns = (EMBEDDED_COMMAND,)

    def __init__(self, context: WorkerContext | None = None) -> None:
        super().__init__(context)
        self._espeak = Espeak()
        survey = self._espeak.survey()
        self.upstream_version = survey.version
        self._languages = language_voices(survey.voices)
        self._timbres = {t.id: t for t in timbres(survey.variants)}
        self._variants = {
            VARIANT: Variant(
                deliveries=tuple(DELIVERIES),
                dials=DIALS,
                # A request's speed is espeak's words a minute, 175 times the speed.
                speed="rate",
                languages=tuple(self._languages),
                timestamps=TIMESTAMPS,
            )
        }

    def variants(self) -> Mapping[str, Variant]:
        return self._variants

    def load(self, variant: str) -> None:
        self._espeak.start()

    def unload(self) -> None:
        self._espeak.stop()

    def voices(self) -> Sequence[Voice]:
        return [
            Voice(
                id=t.id,
                label=t.label,
                spec=f"{t.variant}@espeak-ng-{self.upstream_version}/{self.adapter_version}",
                description=f"eSpeak NG's {t.variant} variant, in whichever language is asked for",
                tags=tuple(g for g in [_GENDERS.get(t.gender)] if g),
            )
            for t in self._timbres.values()
        ]

    def speak(self, request: SpeakRequest) -> Iterator[bytes | Timing]:
        # The SDK speaks only once load() has started the synthesis thread.
        voice = self._languages.get(request.language)
        if voice is None:
            raise Unsupported(f"eSpeak NG does not speak {request.language!r}", field="language")
        if request.voice is not None:
            timbre = self._timbres.get(request.voice)
            if timbre is None:
                raise UnknownVoice(f"no voice {request.voice!r}", field="voice")
            voice = f"{voice}+{timbre.variant}"
        if request.delivery is not None and request.delivery not in DELIVERIES:
            raise Unsupported(f"no delivery {request.delivery!r}", field="delivery")
        settings = espeak_settings(request.params, request.delivery)
        last = request.segment_index == request.segment_count - 1
        if request.timestamps is None:
            return self._espeak.stream(voice, request.text, settings, end_pause=not last)
        return self._timed(voice, request.text, settings, not last, request.timestamps)

    def _timed(
        self, voice: str, text: str, settings: Mapping[int, int], end_pause: bool, unit: str
    ) -> Iterator[bytes | Timing]:
        aligner = Aligner(SAMPLE_RATE, unit, text)
        for pcm, events in self._espeak.stream_events(voice, text, settings, end_pause):
            yield from aligner.feed(pcm, events)
        yield from aligner.close()
