"""
The adapter contract: what an engine author writes, and the shapes the SDK hands them.

An adapter is one class implementing L{IEngine}, usually by subclassing L{Engine}, which
supplies every optional part.  What a variant can do beyond speaking (clone, blend,
dialogue) is derived from which methods the class overrides, so an adapter cannot
declare a capability it did not write.

Facts: an adapter's package ships its C{catalog.json} (the record the core shows before
the worker has ever run), and L{Engine} takes the engine's id, display name, licences and
default variant from it, and its adapter version from the installed distribution it
names, so that nothing says them twice (L{catalog_facts}).

Threading: every method that touches the model (C{load}, C{unload}, C{speak},
C{dialogue}, C{fetch}, C{create_voice}, C{blend_voice}, C{delete_voice}) is called on a
worker thread, never on the reactor thread, and may block.  The SDK never calls C{load},
C{unload} or C{speak} concurrently unless C{concurrency} says it may, and it calls
C{speak} and C{dialogue} only once C{load} has succeeded for the request's variant, with
no C{load} or C{unload} running beside them (L{rhapsode_worker._schedule}); a variant,
voice, language, delivery or dial reaches the adapter only once the routes checked it.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from importlib import metadata, resources
from typing import Any, Iterator, Mapping, Sequence

from zope.interface import Attribute, Interface, implementer

from rhapsode_protocol.errors import Unsupported
from rhapsode_protocol.schemas import TIMESTAMP_SOURCES, TIMESTAMP_UNITS
from rhapsode_protocol.schemas import INSTRUCTION_KINDS, MAX_INSTRUCTION_CHARACTERS
from rhapsode_protocol.vocab import ALL_CUES, ALL_DELIVERIES

from ._context import WorkerContext


@dataclass(frozen=True)
class Dial:
    """
    A number the variant really varies, with its range and default.
    """

    min: float
    max: float
    default: float

    def __post_init__(self) -> None:
        if not (self.min <= self.default <= self.max):
            raise ValueError(f"dial default {self.default} outside [{self.min}, {self.max}]")


@dataclass(frozen=True)
class Speed:
    """
    Which of a variant's dials is its speaking rate, and how a request's C{speed} (1 is
    the voice's own rate) becomes that dial's value: its default times the speed for a
    rate (words a minute, a multiplier), divided by it for a length (C{inverse}, as
    Piper's lengthScale is).
    """

    dial: str
    inverse: bool = False

    @property
    def scale(self) -> str:
        """The capability document's word for how it maps."""
        return "inverse" if self.inverse else "proportional"


#: The PCM an adapter may yield, by name, with the bytes of one sample.
PCM_ENCODINGS = {"pcm_s16le": 2, "pcm_f32le": 4}


@dataclass(frozen=True)
class NativeFormat:
    """
    The PCM an adapter yields, interleaved, little-endian: signed 16-bit samples
    (C{pcm_s16le}, the default), or 32-bit floats in [-1, 1] (C{pcm_f32le}, what most
    models make), which the SDK converts to 16-bit on the synthesis thread (clipped to
    [-1, 1], scaled by 32767 and truncated toward zero; a NaN becomes silence).  The SDK
    encodes, and the protocol carries, 16-bit PCM either way (L{pcm16}).
    """

    sample_rate: int
    channels: int = 1
    encoding: str = "pcm_s16le"

    def __post_init__(self) -> None:
        if self.encoding not in PCM_ENCODINGS:
            raise ValueError(f"the SDK takes PCM as {' or '.join(PCM_ENCODINGS)}, not {self.encoding!r}")

    @property
    def bytes_per_frame(self) -> int:
        """One frame of what the adapter yields: a sample per channel."""
        return PCM_ENCODINGS[self.encoding] * self.channels

    @property
    def pcm16(self) -> "NativeFormat":
        """The 16-bit PCM the SDK encodes from, at this rate and channel count."""
        if self.encoding == "pcm_s16le":
            return self
        return NativeFormat(sample_rate=self.sample_rate, channels=self.channels)

    @property
    def bytes_per_second(self) -> int:
        return self.sample_rate * self.bytes_per_frame

    def duration_ms(self, byte_count: int) -> int:
        """
        How long C{byte_count} bytes of this PCM last, to the nearest millisecond.
        """
        return round((byte_count // self.bytes_per_frame) * 1000 / self.sample_rate)


@dataclass(frozen=True)
class License:
    """
    The licences of what the worker process runs and of the weights it loads (section 4).

    C{code} is the most restrictive licence among everything the worker loads, and
    C{notes} names the dependency responsible.  C{weights} is always a licence: an
    engine with no weights names the licence of the data it speaks from (a formant
    engine's voice data, an arithmetic engine's own tables), and says so in C{notes}.
    """

    code: str
    weights: str
    weights_commercial_use: bool
    notes: str = ""


@dataclass(frozen=True)
class Timestamps:
    """
    What a variant can time (protocol.md section 4, "timestamps"), declared only where
    the engine really knows: its synthesizer's events or arithmetic, or the durations
    its model predicted.  Nothing estimates timings on an engine's behalf.

    @ivar units: what a request may ask for, among C{"word"} and C{"phoneme"}.
    @ivar source: C{"synthesizer"} or C{"model"}.
    @ivar text_offsets: whether the adapter gives each word's place in the text it was
        handed (L{Timing.text_start}); the SDK takes them back to the caller's text.
    """

    units: Sequence[str]
    source: str
    text_offsets: bool = False

    def __post_init__(self) -> None:
        units = tuple(self.units)
        if not units or any(unit not in TIMESTAMP_UNITS for unit in units):
            raise ValueError(f"timestamp units are some of {', '.join(TIMESTAMP_UNITS)}, not {units}")
        if self.source not in TIMESTAMP_SOURCES:
            raise ValueError(f"a timestamp source is one of {', '.join(TIMESTAMP_SOURCES)}, not {self.source!r}")
        object.__setattr__(self, "units", units)


@dataclass(frozen=True)
class Timing:
    """
    One timed word or phoneme, which an adapter yields among its PCM when the request
    asks for timestamps (L{SpeakRequest.timestamps}): before the audio that holds its
    first sample, and the words of one expansion (eSpeak's "3:45") together, before the
    audio of the first of them.  The SDK offsets it by the segments and pauses before
    it, takes its offsets back to the caller's text, merges the words spoken for one
    stretch of it, and frames it; an adapter never sees the wire.

    @ivar unit: C{"word"} or C{"phoneme"}.
    @ivar start: seconds from the start of the audio this call of C{speak} (or
        C{dialogue}) yields, as the adapter's own samples count it.
    @ivar end: likewise; at least C{start}.
    @ivar text: what was timed, where there are no offsets: a phoneme's IPA, or the
        phonemes of a word the engine cannot place in the text.
    @ivar text_start: where the word begins in C{request.text} (a dialogue's
        C{request.turns[turn].text}), in code points; only from a variant whose
        L{Timestamps.text_offsets} is true.
    @ivar text_end: where it ends, exclusive.
    @ivar turn: in a dialogue, the index of the turn it belongs to.
    """

    unit: str
    start: float
    end: float
    text: str = ""
    text_start: int | None = None
    text_end: int | None = None
    turn: int | None = None


@dataclass(frozen=True)
class Instructions:
    """
    That a variant takes a request's C{instructions}, words for the model (section 4).

    @ivar kind: C{"style"}, how the voice reads (emotion, pace, emphasis: Qwen3-TTS
        CustomVoice, OpenAI's gpt-4o-mini-tts), or C{"design"}, the voice itself
        described in words, for a build with no voices of its own (Qwen3-TTS VoiceDesign).
    @ivar max_characters: the most one request may carry.
    @ivar required: whether a request without them is refused (a design build that has
        no voice to fall back on).
    """

    kind: str = "style"
    max_characters: int = 1000
    required: bool = False

    def __post_init__(self) -> None:
        if self.kind not in INSTRUCTION_KINDS:
            raise ValueError(f"instructions are {' or '.join(INSTRUCTION_KINDS)}, not {self.kind!r}")
        if not 1 <= self.max_characters <= MAX_INSTRUCTION_CHARACTERS:
            raise ValueError(f"instructions max_characters must be from 1 to {MAX_INSTRUCTION_CHARACTERS}")


@dataclass(frozen=True)
class Remote:
    """
    That a variant's model is served elsewhere, by a server the adapter calls: it takes
    no room on this box, so the SDK measures nothing across its load and the core counts
    it against no budget, never expires it and does not pretend to unload it.

    @ivar server: the server's origin (scheme, host and port), never a key or a path.
    @ivar model: the model as that server names it, where it names one.
    """

    server: str
    model: str | None = None


@dataclass(frozen=True)
class Variant:
    """
    One loadable build of an engine and what it performs.

    @ivar dials: name to L{Dial}, or to a C{(min, max, default)} tuple.
    @ivar speed: the dial that is the speaking rate (a L{Speed}, or its name for a
        proportional one); a dial named C{speed} is it by default.  None where no dial
        is: a request's speed is then refused.
    @ivar languages: the first is the default when a request names none.
    @ivar max_characters: what one request may carry; C{None} takes the engine's.
    @ivar clones: whether this build can use a cloned voice, where the adapter
        implements C{create_voice} at all.
    @ivar blends: likewise for C{blend_voice}.
    @ivar max_speakers: speakers one dialogue may have, where the adapter implements
        C{dialogue}; 0 means this variant does not perform dialogue.
    @ivar seed_reproducible: whether the same seed gives the same audio.  Claim it
        only if it is true: the conformance checker tests it.
    @ivar timestamps: what it can time, if anything (L{Timestamps}); a request asking
        for a unit it does not list is refused before the adapter sees it.
    @ivar instructions: whether, and how, the variant takes a request's instructions
        (L{Instructions}); None refuses them.
    @ivar remote: where the variant's model is served, for an adapter that fronts a
        server elsewhere (L{Remote}); None for a model this worker loads.
    """

    cues: Sequence[str] = ()
    deliveries: Sequence[str] = ()
    dials: Mapping[str, Dial | tuple[float, float, float]] = field(default_factory=dict)
    languages: Sequence[str] = ("en",)
    max_characters: int | None = None
    clones: bool = True
    blends: bool = True
    max_speakers: int = 2
    seed_reproducible: bool = False
    reference_seconds: tuple[float, float] | None = None
    speed: Speed | str | None = None
    timestamps: Timestamps | None = None
    instructions: Instructions | None = None
    remote: Remote | None = None

    def __post_init__(self) -> None:
        unknown = [c for c in self.cues if c not in ALL_CUES]
        if unknown:
            raise ValueError(f"not cues of the vocabulary: {unknown}")
        unknown = [d for d in self.deliveries if d not in ALL_DELIVERIES]
        if unknown:
            raise ValueError(f"not deliveries of the vocabulary: {unknown}")
        if not self.languages:
            raise ValueError("a variant speaks at least one language")
        dials = {
            name: d if isinstance(d, Dial) else Dial(*d) for name, d in self.dials.items()
        }
        object.__setattr__(self, "dials", dials)
        speed = Speed(self.speed) if isinstance(self.speed, str) else self.speed
        if speed is None and "speed" in dials:
            speed = Speed("speed")
        if speed is not None and speed.dial not in dials:
            raise ValueError(f"speed names dial {speed.dial!r}, which the variant does not have")
        object.__setattr__(self, "speed", speed)
        object.__setattr__(self, "cues", tuple(self.cues))
        object.__setattr__(self, "deliveries", tuple(self.deliveries))
        object.__setattr__(self, "languages", tuple(self.languages))


@dataclass(frozen=True)
class Voice:
    """
    A voice as C{GET /voices} lists it.  C{spec} changes whenever the rendering would.
    """

    id: str
    label: str
    spec: str
    description: str = ""
    tags: Sequence[str] = ()
    builtin: bool = True


@dataclass(frozen=True)
class SpeakRequest:
    """
    One generation: a segment of a request's text, already validated and cleaned.

    C{params} holds every dial of the variant, defaults filled in.  C{text} carries only
    cues the variant claims, written C{[cue]}; the adapter translates them.
    C{instructions} reaches only a variant that declares L{Instructions}, checked.
    """

    text: str
    variant: str
    voice: str | None = None
    language: str = "en"
    delivery: str | None = None
    params: Mapping[str, float] = field(default_factory=dict)
    seed: int | None = None
    instructions: str | None = None
    segment_index: int = 0
    segment_count: int = 1
    #: The unit the request asks to have timed ("word" or "phoneme"), only ever one
    #: the variant's L{Timestamps} lists; None when it asks for none.
    timestamps: str | None = None


@dataclass(frozen=True)
class Turn:
    speaker: str
    text: str


@dataclass(frozen=True)
class DialogueRequest:
    """
    A conversation in one take.  C{voices} maps speaker labels to voice ids; a speaker
    missing from it is read in a voice the model picks, which a seed holds fixed.
    """

    turns: Sequence[Turn]
    variant: str
    voices: Mapping[str, str] = field(default_factory=dict)
    language: str = "en"
    params: Mapping[str, float] = field(default_factory=dict)
    seed: int | None = None
    #: As L{SpeakRequest.timestamps}; each L{Timing} names its C{turn}.
    timestamps: str | None = None


@dataclass(frozen=True)
class Reference:
    """
    An uploaded reference for cloning: its bytes and the type its filename names.
    """

    filename: str
    extension: str
    data: bytes
    transcript: str | None = None


class IEngine(Interface):
    """
    An engine adapter.  Methods marked blocking run on a worker thread.
    """

    id = Attribute("Engine id, as the core names it")
    display_name = Attribute("Human name")
    license = Attribute("L{License}")
    native_format = Attribute("L{NativeFormat} of the PCM speak() yields")
    default_variant = Attribute("Variant loaded when a request names none")
    adapter_version = Attribute("Version of the adapter package")
    upstream_version = Attribute("Version of the upstream library, or None")
    max_characters = Attribute("Most text one request may carry")
    segment_characters = Attribute("Most text one generation gets; None: the whole text")
    first_segment_characters = Attribute("A shorter first segment of a streamed answer, or None")
    segment_growth = Attribute(
        "With first_segment_characters, how many times the one before each later segment of a"
        " streamed answer may hold, up to segment_characters; None: segment_characters at once"
    )
    joint_silence_ms = Attribute("Silence inserted between segments, where one ends a sentence")
    concurrency = Attribute("Generations that may run at once (default 1)")
    reference_formats = Attribute("File types create_voice reads, e.g. ('wav',)")
    private_tag_patterns = Attribute("Regexes of the engine's own tag syntax, stripped")
    relays = Attribute("Whether speak() relays audio made elsewhere, paced by the reader")

    def variants() -> Mapping[str, Variant]:
        """Every variant this worker can load on this machine."""

    def load(variant: str) -> None:
        """Blocking: put C{variant} on the device."""

    def unload() -> None:
        """Blocking: release the model."""

    def voices() -> Sequence[Voice]:
        """Built-in and created voices; cheap, no model needed."""

    def speak(request: SpeakRequest) -> Iterator[bytes | Timing]:
        """
        Blocking: yield native PCM for one segment (and L{Timing}s, when asked); only after
        load(request.variant).  Or, for an adapter that relays (L{Engine.relays}), an
        asynchronous generator of 16-bit PCM, drawn on the reactor thread: it must not block.
        """

    def dialogue(request: DialogueRequest) -> Iterator[bytes | Timing]:
        """Blocking: yield native PCM for a conversation (and L{Timing}s); only after load(request.variant). Optional."""

    def create_voice(voice_id: str, label: str, reference: Reference) -> Voice:
        """Blocking: store a voice made from a reference; loads no model. Optional."""

    def blend_voice(voice_id: str, label: str, components: Sequence[tuple[str, float]]) -> Voice:
        """Blocking: store a mix of existing voices, weights summing to 1. Optional."""

    def delete_voice(voice_id: str) -> None:
        """Blocking: remove a created voice."""

    def fetch(variant: str) -> None:
        """Blocking: download a variant's weights without loading them. Optional."""

    def memory_bytes() -> int | None:
        """What the loaded model holds, when the adapter knows better than a delta."""

    def rest() -> None:
        """
        Blocking, on a worker thread: the worker has had nothing to do for a while (the
        SDK's idle trim, L{rhapsode_worker._heap}); give back what the last requests left
        held beyond the model, if anything.  Called with or without a model loaded, and
        possibly while a new request starts.  Optional.
        """

    def unreachable() -> Mapping[str, str]:
        """
        Variants whose model, served elsewhere, cannot be reached now, with why.  Called
        on the reactor thread for every C{/health}: it reads state and never blocks.
        """


#: The catalog record's file, in an adapter's package.
CATALOG = "catalog.json"
#: What the catalog gives an L{Engine}, by attribute.
CATALOGUED = ("id", "display_name", "license", "default_variant", "adapter_version")


class CatalogError(Exception):
    """
    An adapter's C{catalog.json} cannot give its facts: unreadable, missing a field, or
    naming a distribution that is not installed.
    """


def catalog_facts(package: str) -> dict[str, Any] | None:
    """
    The facts L{CATALOGUED} names, from the C{catalog.json} that the top-level package
    C{package} ships; None when C{package} is no package or ships none (an adapter
    written inside a test, which states its facts itself).

    @raise CatalogError: naming the file and the field, for a record that is not one.
    """
    module = sys.modules.get(package)
    if module is None or not hasattr(module, "__path__"):
        return None
    source = resources.files(package) / CATALOG
    if not source.is_file():
        return None
    where = f"{package}/{CATALOG}"
    try:
        record = json.loads(source.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CatalogError(f"{where} cannot be read: {exc}") from exc

    def text(doc: Any, key: str, prefix: str = "") -> str:
        value = doc.get(key) if isinstance(doc, dict) else None
        if not isinstance(value, str) or not value:
            raise CatalogError(f'{where} needs "{prefix}{key}", a non-empty string')
        return value

    if text(record, "module") != package:
        raise CatalogError(f'{where} names module "{record["module"]}", not {package}')
    licence = record.get("license")
    commercial = licence.get("weightsCommercialUse") if isinstance(licence, dict) else None
    if not isinstance(commercial, bool):
        raise CatalogError(f'{where} needs "license.weightsCommercialUse", true or false')
    notes = licence.get("notes", "") if isinstance(licence, dict) else ""
    if not isinstance(notes, str):
        raise CatalogError(f'{where} has "license.notes" that is not a string')
    distribution = text(record, "distribution")
    try:
        version = metadata.version(distribution)
    except metadata.PackageNotFoundError:
        raise CatalogError(
            f'{where} names distribution "{distribution}", which is not installed '
            "(install the engine, e.g. pip install -e engines/<id>, to give it a version)"
        ) from None
    return {
        "id": text(record, "id"),
        "display_name": text(record, "displayName"),
        "license": License(
            code=text(licence, "code", "license."),
            weights=text(licence, "weights", "license."),
            weights_commercial_use=commercial,
            notes=notes,
        ),
        "default_variant": text(record, "defaultVariant"),
        "adapter_version": version,
    }


@implementer(IEngine)
class Engine:
    """
    Defaults for every optional part of L{IEngine}.  Subclass it and write what you have.

    A subclass defined in a package that ships a C{catalog.json} takes L{CATALOGUED}
    from it as it is created, and may not set them itself: one place says each fact.
    One defined elsewhere (in a test) sets those it needs and keeps these defaults for
    the rest.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        upstream = cls.__dict__.get("upstream_distribution")
        if upstream is not None and "upstream_version" not in cls.__dict__:
            try:
                cls.upstream_version = metadata.version(upstream)
            except metadata.PackageNotFoundError:
                raise CatalogError(f'{cls.__qualname__}\'s upstream "{upstream}" is not installed') from None
        facts = catalog_facts(cls.__module__.partition(".")[0])
        if facts is None:
            return
        twice = [name for name in CATALOGUED if name in cls.__dict__]
        if twice:
            raise CatalogError(
                f"{cls.__qualname__} sets {', '.join(twice)}, which its package's "
                f"{CATALOG} gives: say each fact in one place"
            )
        for name, value in facts.items():
            setattr(cls, name, value)

    id: str = ""
    display_name: str = ""
    license: License = License(code="UNKNOWN", weights="UNKNOWN", weights_commercial_use=False)
    native_format: NativeFormat = NativeFormat(sample_rate=24000)
    default_variant: str = "default"
    adapter_version: str = "0.1.0"
    #: The upstream library's distribution, whose installed version becomes
    #: C{upstream_version} as the class is created (unless the class sets that itself).
    upstream_distribution: str | None = None
    upstream_version: str | None = None
    max_characters: int = 4096
    segment_characters: int | None = None
    first_segment_characters: int | None = None
    segment_growth: int | None = None
    joint_silence_ms: int = 0
    concurrency: int = 1
    reference_formats: Sequence[str] = ()
    private_tag_patterns: Sequence[str] = ()
    #: An adapter that relays audio made elsewhere (a remote server's stream) says so:
    #: while its reader is paused the SDK stops drawing from speak(), whose thread waits,
    #: so the audio waits where it is made and the reader's pause reaches that server.
    #: An engine that computes leaves it off: its segment runs on into memory, so that a
    #: slow reader never holds the model from the others.  A relaying adapter may also
    #: write speak() as an asynchronous generator of 16-bit PCM: it is then drawn on the
    #: reactor thread, a chunk at a time as the reader takes them, and must never block.
    relays: bool = False

    def __init__(self, context: WorkerContext | None = None) -> None:
        """
        @param context: what the worker was given at spawn; L{serve} makes the engine
            with it.  An engine made without one (in a test that never needs it) says so
            when L{context} is read.
        """
        self._context = context

    @property
    def context(self) -> WorkerContext:
        """
        The worker's L{WorkerContext}: its voice folder, cache folder and cores.
        """
        context: WorkerContext | None = getattr(self, "_context", None)
        if context is None:
            raise RuntimeError(
                f"{type(self).__name__} was made without a WorkerContext; "
                "serve() gives one, and a test passes its own"
            )
        return context

    def variants(self) -> Mapping[str, Variant]:
        return {self.default_variant: Variant()}

    def load(self, variant: str) -> None:
        pass

    def unload(self) -> None:
        pass

    def voices(self) -> Sequence[Voice]:
        return []

    def speak(self, request: SpeakRequest) -> Iterator[bytes | Timing]:
        raise NotImplementedError

    def dialogue(self, request: DialogueRequest) -> Iterator[bytes | Timing]:
        raise Unsupported("this engine does not perform dialogue", field="turns")

    def create_voice(self, voice_id: str, label: str, reference: Reference) -> Voice:
        raise Unsupported("this engine does not make voices from a reference", field="reference")

    def blend_voice(
        self, voice_id: str, label: str, components: Sequence[tuple[str, float]]
    ) -> Voice:
        raise Unsupported("this engine does not blend voices", field="blend")

    def delete_voice(self, voice_id: str) -> None:
        raise Unsupported("this engine does not make voices", field="id")

    def fetch(self, variant: str) -> None:
        raise Unsupported("this engine has nothing to fetch", field="variant")

    def memory_bytes(self) -> int | None:
        return None

    def rest(self) -> None:
        pass

    def unreachable(self) -> Mapping[str, str]:
        return {}


def overrides(engine: object, name: str) -> bool:
    """
    Whether C{engine}'s class supplies its own C{name} rather than L{Engine}'s default.

    An adapter that does not subclass L{Engine} overrides whatever it has.
    """
    method = getattr(type(engine), name, None)
    if method is None:
        return False
    return method is not getattr(Engine, name, None)
