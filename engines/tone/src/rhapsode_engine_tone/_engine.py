"""
The tone engine's adapter: Rhapsode's arithmetic test engine.

It performs every part of the protocol for real, audibly and fast, with nothing but
arithmetic: cues in one variant, deliveries and dials in the other, dialogue, cloning
a pitch from a clip, blending, and reproducibility under a seed.
"""

from __future__ import annotations

import math
import random
import sys
import time
import zlib
from array import array
from dataclasses import dataclass, replace
from typing import Iterable, Iterator, Mapping, Sequence, cast

from rhapsode_worker import (
    ALL_CUES,
    Dial,
    DialogueRequest,
    Engine,
    NativeFormat,
    Reference,
    SpeakRequest,
    Timestamps,
    Timing,
    Unsupported,
    Variant,
    Voice,
)

from ._pitch import estimate
from ._render import CHARACTERS_PER_SECOND, PRIVATE_TAG, Reader, parse
from ._synth import SAMPLE_RATE, Palette, silence
from ._voices import BUILTINS, DEFAULT_VOICE, ToneVoice, ToneVoices

_LANGUAGES = ("en", "fr", "de", "es", "ja")
#: Exact: every word's tones and the gaps between them are counted out sample by sample.
#: A syllable's tone stands for a phoneme.
_TIMESTAMPS = Timestamps(units=("word", "phoneme"), source="synthesizer", text_offsets=True)

_VARIANTS: dict[str, Variant] = {
    "expressive": Variant(
        cues=ALL_CUES,
        languages=_LANGUAGES,
        max_speakers=0,
        seed_reproducible=True,
        timestamps=_TIMESTAMPS,
    ),
    "classic": Variant(
        deliveries=("hushed", "frantic"),
        dials={"pitch": (0.5, 2.0, 1.0), "rate": (0.5, 2.0, 1.0)},
        # A request's speed is the rate: characters a second, times the speed.
        speed="rate",
        languages=_LANGUAGES,
        max_speakers=2,
        seed_reproducible=True,
        timestamps=_TIMESTAMPS,
    ),
}

_LEVEL = 0.5  # a voice's own level, as a fraction of full scale
_TURN_GAP_SECONDS = 0.25
_CHUNK_BYTES = 9600  # 200 ms: few enough thread hops, and still a quick first byte


@dataclass(frozen=True)
class _Delivery:
    """
    How a delivery changes a voice, each factor relative to the voice's own.

    @ivar breath: breath noise under the tones, as a share of the delivered level.
    """

    gain: float
    pitch: float
    rate: float
    brightness: float
    breath: float = 0.0
    tremolo: tuple[float, float] | None = None


_ORDINARY = _Delivery(gain=1.0, pitch=1.0, rate=1.0, brightness=1.0)
_DELIVERIES: dict[str, _Delivery] = {
    # -12 dB of the voice's level, darker, a little slower and lower, over breath.
    "hushed": _Delivery(gain=0.25, pitch=0.94, rate=0.9, brightness=0.8, breath=0.3),
    # Faster, higher, louder (+3 dB at the tremolo's peak), shaking at 9 Hz.
    "frantic": _Delivery(gain=1.4, pitch=1.2, rate=1.4, brightness=1.1, tremolo=(9.0, 0.4)),
}


def _little_endian(pcm: bytes) -> bytes:
    if sys.byteorder == "little":
        return pcm
    swapped = array("h")
    swapped.frombytes(pcm)
    swapped.byteswap()
    return swapped.tobytes()


#: Seconds of wall time each second of audio takes, where the operator asked tone to be a
#: fixed-cost engine (engines.<id>.env); 0, the default, is as fast as arithmetic goes.
PACE_VARIABLE = "RHAPSODE_TONE_PACE"


def pace_of(environ: Mapping[str, str]) -> float:
    """
    The pace asked for in C{environ}: a number from 0 to 10.

    @raise ValueError: naming the variable, when it is anything else.
    """
    raw = environ.get(PACE_VARIABLE, "").strip()
    if not raw:
        return 0.0
    try:
        pace = float(raw)
    except ValueError:
        pace = -1.0
    if not 0.0 <= pace <= 10.0:
        raise ValueError(f"{PACE_VARIABLE} must be a number from 0 to 10, not {raw!r}")
    return pace


def _paced(chunks: Iterator[bytes | Timing], pace: float) -> Iterator[bytes | Timing]:
    # On the synthesis thread: each chunk costs its length in audio times the pace, as
    # a model would that runs at a fixed speed whatever the cores (bench/cluster.py); a
    # timing costs nothing.
    for chunk in chunks:
        if not isinstance(chunk, Timing):
            time.sleep(len(chunk) / 2 / SAMPLE_RATE * pace)
        yield chunk


def _chunked(pieces: Iterable[bytes | Timing]) -> Iterator[bytes | Timing]:
    buffer = bytearray()
    for piece in pieces:
        if isinstance(piece, Timing):
            # Ahead of the audio still buffered: a timing never trails its sound.
            yield piece
            continue
        buffer += piece
        if len(buffer) >= _CHUNK_BYTES:
            yield _little_endian(bytes(buffer))
            buffer.clear()
    if buffer:
        yield _little_endian(bytes(buffer))


def _generator(seed: int | None) -> random.Random:
    """
    The request's randomness: fixed by the seed when there is one, fresh from
    os.urandom when there is not, so that a seed matters.
    """
    if seed is None:
        return random.Random()
    # A string seed is hashed with SHA-512, the same in every process and platform.
    return random.Random(f"tone/{seed}")


class ToneEngine(Engine):
    """
    Rhapsode's arithmetic test engine.
    """

    native_format = NativeFormat(sample_rate=SAMPLE_RATE)
    upstream_version = None
    max_characters = 4096
    segment_characters = 200
    first_segment_characters = 60
    joint_silence_ms = 120
    reference_formats = ("wav",)
    private_tag_patterns = (PRIVATE_TAG,)

    #: The loaded variant's tables, set by load(): the SDK calls speak() and dialogue()
    #: only once load() has succeeded for the request's variant.
    _palette: Palette

    def variants(self) -> Mapping[str, Variant]:
        return _VARIANTS

    def load(self, variant: str) -> None:
        pace_of(self.context.environ)  # a pace that cannot be read fails the load, not a request
        brightnesses = tuple(sorted({v.brightness for v in BUILTINS.values()}))
        self._palette = Palette(tuple(_VARIANTS[variant].languages), brightnesses)

    def _pace(self, chunks: Iterator[bytes | Timing]) -> Iterator[bytes | Timing]:
        pace = pace_of(self.context.environ)
        return _paced(chunks, pace) if pace else chunks

    def unload(self) -> None:
        # Also called after a failed load, which may have set nothing.
        if hasattr(self, "_palette"):
            del self._palette

    def voices(self) -> Sequence[Voice]:
        voices = list(BUILTINS.values()) + self._store().created()
        return [v.listing(self.adapter_version) for v in voices]

    def speak(self, request: SpeakRequest) -> Iterator[bytes | Timing]:
        palette = self._palette
        variant = _VARIANTS[request.variant]
        if request.delivery is None:
            delivery = _ORDINARY
        elif request.delivery in variant.deliveries:
            delivery = _DELIVERIES[request.delivery]
        else:
            raise Unsupported(
                f"variant {request.variant!r} has no delivery {request.delivery!r}",
                field="delivery",
            )
        voice = self._store().find(request.voice or DEFAULT_VOICE, field="voice")
        reader = self._reader(
            palette, request.variant, voice, request.language, request.params, delivery
        )
        events = parse(request.text, frozenset(variant.cues))
        rng = _generator(request.seed)
        # Everything that can refuse the request has run by now, before the first byte.
        return self._pace(_chunked(reader.perform(events, rng, request.timestamps)))

    def dialogue(self, request: DialogueRequest) -> Iterator[bytes | Timing]:
        palette = self._palette
        variant = _VARIANTS[request.variant]
        if variant.max_speakers == 0:
            raise Unsupported(
                f"variant {request.variant!r} does not perform dialogue", field="turns"
            )
        store = self._store()
        cast = self._cast(request, store)
        readers = {
            speaker: self._reader(
                palette, request.variant, voice, request.language, request.params, _ORDINARY
            )
            for speaker, voice in cast.items()
        }
        cues = frozenset(variant.cues)
        scripts = [(readers[t.speaker], parse(t.text, cues)) for t in request.turns]
        rng = _generator(request.seed)

        def conversation() -> Iterator[bytes | Timing]:
            samples = 0  # the conversation's audio so far, which each turn's timings follow
            for i, (reader, events) in enumerate(scripts):
                if i:
                    gap = silence(round(_TURN_GAP_SECONDS * SAMPLE_RATE))
                    samples += len(gap) // 2
                    yield gap
                offset = samples / SAMPLE_RATE
                for piece in reader.perform(events, rng, request.timestamps):
                    if isinstance(piece, Timing):
                        yield replace(piece, start=piece.start + offset, end=piece.end + offset, turn=i)
                    else:
                        samples += len(piece) // 2
                        yield piece

        return self._pace(_chunked(conversation()))

    def create_voice(self, voice_id: str, label: str, reference: Reference) -> Voice:
        if reference.extension.lower() != "wav":
            raise Unsupported(
                f"the tone engine reads WAV references, not {reference.extension!r}",
                field="reference",
            )
        self._refuse_builtin(voice_id)
        found = estimate(reference.data)
        voice = ToneVoice(
            id=voice_id,
            label=label,
            pitch=found.pitch,
            brightness=found.brightness,
            tags=("cloned",),
            description=f"Cloned from {reference.filename}: {found.pitch:.0f} Hz",
            origin={
                "kind": "cloned",
                "filename": reference.filename,
                "seconds": round(found.seconds, 3),
            },
        )
        self._store().save(voice)
        return voice.listing(self.adapter_version)

    def blend_voice(
        self, voice_id: str, label: str, components: Sequence[tuple[str, float]]
    ) -> Voice:
        self._refuse_builtin(voice_id)
        store = self._store()
        parts = [(store.find(c, field="blend"), weight) for c, weight in components]
        # Pitch mixes on a log scale, as the ear hears it; brightness mixes linearly.
        pitch = math.exp(sum(w * math.log(v.pitch) for v, w in parts))
        brightness = sum(w * v.brightness for v, w in parts)
        voice = ToneVoice(
            id=voice_id,
            label=label,
            pitch=pitch,
            brightness=brightness,
            tags=("blend",),
            description="Blend of " + ", ".join(f"{v.id} {w:.0%}" for v, w in parts),
            origin={"kind": "blend", "components": [[v.id, w] for v, w in parts]},
        )
        store.save(voice)
        return voice.listing(self.adapter_version)

    def delete_voice(self, voice_id: str) -> None:
        self._refuse_builtin(voice_id)
        self._store().delete(voice_id)

    def _store(self) -> ToneVoices:
        return ToneVoices(self.context.voice_dir)

    @staticmethod
    def _refuse_builtin(voice_id: str) -> None:
        if voice_id in BUILTINS:
            raise Unsupported(f'"{voice_id}" is a built-in voice', field="id")

    @staticmethod
    def _reader(
        palette: Palette,
        variant: str,
        voice: ToneVoice,
        language: str,
        params: Mapping[str, float],
        delivery: _Delivery,
    ) -> Reader:
        if language not in _VARIANTS[variant].languages:
            raise Unsupported(f"variant {variant!r} does not speak {language!r}", field="language")
        # Variant.__post_init__ made every value a Dial.
        declared = cast("Mapping[str, Dial]", _VARIANTS[variant].dials)
        dials = {name: params.get(name, dial.default) for name, dial in declared.items()}
        rate = dials.get("rate", 1.0) * delivery.rate
        return Reader(
            palette=palette,
            language=language,
            brightness=min(0.95, voice.brightness * delivery.brightness),
            pitch=voice.pitch * dials.get("pitch", 1.0) * delivery.pitch,
            gain=_LEVEL * delivery.gain,
            seconds_per_character=1.0 / (CHARACTERS_PER_SECOND * rate),
            tremolo=delivery.tremolo,
            breath=_LEVEL * delivery.gain * delivery.breath,
        )

    def _cast(self, request: DialogueRequest, store: ToneVoices) -> dict[str, ToneVoice]:
        """
        Each speaker's voice: the one the request maps it to, or a built-in picked from
        the speaker's label and the seed, unused by any other speaker while one is left.
        """
        speakers = list(dict.fromkeys(t.speaker for t in request.turns))
        mapped = [s for s in speakers if s in request.voices]
        cast = {s: store.find(request.voices[s], field="voices") for s in mapped}
        taken = {v.id for v in cast.values()}
        for speaker in speakers:
            if speaker in cast:
                continue
            ranked = sorted(
                BUILTINS, key=lambda v: zlib.crc32(f"{request.seed}/{speaker}/{v}".encode())
            )
            choice = next((v for v in ranked if v not in taken), ranked[0])
            cast[speaker] = BUILTINS[choice]
            taken.add(choice)
        return cast
