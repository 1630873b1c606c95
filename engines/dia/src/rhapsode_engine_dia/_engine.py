"""
The Dia engine's adapter: Nari Labs' Dia-1.6B, through transformers'
C{DiaForConditionalGeneration} on torch, on the device the core gives the worker.

Dia writes a conversation in one take from a script whose speakers are C{[S1]} and
C{[S2]}: a dialogue's speakers (section 6) become S1 and S2 in the order they first
speak, so a variant has two at most.  C{/speak} is one speaker, S1.  Its non-verbal
sounds are words in parentheses; the eight cues of the vocabulary (section 5) are
written as the ones Dia was trained on (L{CUE_TAGS}), and Dia's own syntax in a
request's text is taken out before that (L{PRIVATE_TAGS}), as every speaker tag is.

Weights: C{nari-labs/Dia-1.6B-0626} and its codec C{descript/dac_44khz}, fetched through
the hub's client (L{rhapsode_worker.hub}) and loaded by transformers' own
C{from_pretrained} from the snapshots: the model, its feature extractor and tokenizer,
and the codec, which becomes the processor's audio tokenizer.  The codec is loaded from
its own snapshot rather than through the processor's config, which would fetch it from
the hub at whatever revision is current.  On a card the model runs in bfloat16 (float16
where the card has no bfloat16), on the CPU in float32.

Voices: Dia has none of its own, so a request with no voice is read in one the model
picks, which a seed holds fixed.  A clone is a clip and what was said in it: Dia
continues from the clip, so a create without a transcript is refused (section 7).

A generation is bounded by C{max_new_tokens}: Dia's 86 frames a second, for the text's
length at a slow pace, at most its decoder's 3072 positions; C{RHAPSODE_DIA_MAX_TOKENS}
lowers it, which is how the tests bound a model of random weights (more than Dia's
15-step codebook delay, or no frame comes out at all).  Text is split at 250
characters by the SDK; each piece is a take of its own (no audio is carried from one
piece to the next yet).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

from rhapsode_worker import (
    BadRequest,
    DialogueRequest,
    Engine,
    ModelUnavailable,
    NativeFormat,
    Reference,
    SpeakRequest,
    Unsupported,
    Variant,
    Voice,
    WorkerContext,
)
from rhapsode_worker.audioref import decode_reference
from rhapsode_worker.clips import ClipStore, StoredClip
from rhapsode_worker.devices import TorchDevice, seeded
from rhapsode_worker.hub import HubSnapshot, fetch, local
from twisted.logger import Logger

if TYPE_CHECKING:
    from transformers import DiaForConditionalGeneration, DiaProcessor

log = Logger(namespace="rhapsode_engine_dia")

VARIANT = "1.6b"
SAMPLE_RATE = 44_100
#: Dia's decoder positions, and so the most frames one take can hold, prompt included.
MAX_TOKENS = 3072
MAX_TOKENS_VARIABLE = "RHAPSODE_DIA_MAX_TOKENS"
#: Frames a second of Dia's codec (44.1 kHz over a hop of 512).
FRAMES_PER_SECOND = SAMPLE_RATE / 512
#: A slow reader's characters a second: what a take's frame budget is sized for.
SLOW_CHARACTERS_PER_SECOND = 8.0
#: Dia's longest codebook delay: fewer new frames than this decode to nothing.
DELAY = 15
REFERENCE_SECONDS = (3.0, 20.0)
TOP_K = 45

#: The cues of the vocabulary as the sounds Dia was trained to make (its README's list).
CUE_TAGS: dict[str, str] = {
    "laugh": "(laughs)",
    "chuckle": "(chuckle)",
    "sigh": "(sighs)",
    "gasp": "(gasps)",
    "cough": "(coughs)",
    "clear throat": "(clears throat)",
    "sniff": "(sniffs)",
    "groan": "(groans)",
}
#: Dia's own non-verbal tags, which a client may not send past the vocabulary.
_DIA_SOUNDS = (
    "laughs", "clears throat", "sighs", "gasps", "coughs", "singing", "sings", "mumbles", "beep",
    "groans", "sniffs", "claps", "screams", "inhales", "exhales", "applause", "burps", "humming",
    "sneezes", "chuckle", "whistles",
)
PRIVATE_TAGS = (r"\(\s*(?:" + "|".join(re.escape(s) for s in _DIA_SOUNDS) + r")\s*\)",)
_CUE = re.compile(r"\[(" + "|".join(re.escape(c) for c in CUE_TAGS) + r")\]")

SNAPSHOTS: dict[str, tuple[HubSnapshot, HubSnapshot]] = {
    VARIANT: (
        HubSnapshot(repo="nari-labs/Dia-1.6B-0626", revision="main", files=("*.json", "*.safetensors")),
        HubSnapshot(repo="descript/dac_44khz", revision="main", files=("*.json", "*.safetensors")),
    ),
}

_VARIANTS: dict[str, Variant] = {
    VARIANT: Variant(
        cues=tuple(CUE_TAGS),
        dials={
            "temperature": (0.1, 2.5, 1.8),
            "cfgScale": (1.0, 5.0, 3.0),
            "topP": (0.5, 1.0, 0.9),
        },
        languages=("en",),
        max_speakers=2,
        blends=False,
        seed_reproducible=True,
        reference_seconds=REFERENCE_SECONDS,
    ),
}


def translate(text: str) -> str:
    """
    A segment's text with the vocabulary's cues written as Dia's sounds.
    """
    return _CUE.sub(lambda m: CUE_TAGS[m.group(1)], text)


def frame_budget(text: str, cap: int, prompt_frames: int = 0) -> int:
    """
    The new frames one take of C{text} may make: enough for a slow reading, within the
    decoder's positions after the prompt, within C{cap}, and more than the delay.
    """
    wanted = int(len(text) / SLOW_CHARACTERS_PER_SECOND * FRAMES_PER_SECOND) + DELAY + 1
    room = MAX_TOKENS - prompt_frames
    return max(DELAY + 1, min(wanted, room, cap))


def max_tokens(environ: Mapping[str, str]) -> int:
    raw = environ.get(MAX_TOKENS_VARIABLE, "").strip()
    if not raw:
        return MAX_TOKENS
    if not raw.isdigit() or not DELAY < int(raw) <= MAX_TOKENS:
        raise ValueError(f"{MAX_TOKENS_VARIABLE} must be {DELAY + 1} to {MAX_TOKENS}, not {raw!r}")
    return int(raw)


class DiaEngine(Engine):
    """
    Dia-1.6B: dialogue for two speakers in one take, eight cues, clones from a clip and
    its transcript.
    """

    native_format = NativeFormat(sample_rate=SAMPLE_RATE)
    upstream_distribution = "transformers"
    segment_characters = 250
    joint_silence_ms = 0
    reference_formats = ("wav", "flac", "mp3", "ogg")
    private_tag_patterns = PRIVATE_TAGS

    def __init__(self, context: WorkerContext | None = None, device: TorchDevice | None = None) -> None:
        super().__init__(context)
        self._environ: Mapping[str, str] = os.environ if context is None else context.environ
        self._cap = max_tokens(self._environ)
        self._device = device if device is not None else TorchDevice.probe(self._environ)
        self._model: DiaForConditionalGeneration | None = None
        self._processor: DiaProcessor | None = None

    # -- the model ------------------------------------------------------------------------

    def variants(self) -> Mapping[str, Variant]:
        return _VARIANTS

    def fetch(self, variant: str) -> None:
        for snapshot in self._snapshots(variant):
            fetch(snapshot, self._environ)

    def load(self, variant: str) -> None:
        model_snapshot, codec_snapshot = self._snapshots(variant)
        model_dir = local(model_snapshot, self._environ) or fetch(model_snapshot, self._environ)
        codec_dir = local(codec_snapshot, self._environ) or fetch(codec_snapshot, self._environ)
        import torch
        from transformers import (
            DacModel,
            DiaFeatureExtractor,
            DiaForConditionalGeneration,
            DiaProcessor,
            DiaTokenizer,
        )

        dtype = torch.float32
        if self._device.kind == "cuda":
            dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        started = time.monotonic()

        def build() -> tuple[Any, Any]:
            model = DiaForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).to(self._device.name)
            codec = DacModel.from_pretrained(codec_dir).to(self._device.name)
            processor = DiaProcessor(
                DiaFeatureExtractor.from_pretrained(model_dir), DiaTokenizer.from_pretrained(model_dir), codec
            )
            return model.eval(), processor

        with self._device.cores():
            self._model, self._processor = self._device.measured(build)
        log.info("{variant} loaded from {folder} on {device} ({dtype}) in {seconds:.1f} s, at most {cap} "
                 "frames a take", variant=variant, folder=str(model_dir), device=self._device.name,
                 dtype=str(dtype), seconds=time.monotonic() - started, cap=self._cap)

    def unload(self) -> None:
        def drop() -> None:
            self._model = None
            self._processor = None

        self._device.release(drop)

    def memory_bytes(self) -> int | None:
        return self._device.model_bytes

    # -- speaking -------------------------------------------------------------------------

    def speak(self, request: SpeakRequest) -> Iterator[bytes]:
        prompts = [self._store().get(request.voice)] if request.voice else []
        script = "[S1] " + translate(request.text)
        return iter((self._take(request.variant, script, prompts, request.params, request.seed),))

    def dialogue(self, request: DialogueRequest) -> Iterator[bytes]:
        speakers: list[str] = []
        for turn in request.turns:
            if turn.speaker not in speakers:
                speakers.append(turn.speaker)
        if len(speakers) > 2:
            raise Unsupported(f"Dia speaks for two speakers at most, not {len(speakers)}", field="turns")
        tag = {speaker: f"[S{number}]" for number, speaker in enumerate(speakers, start=1)}
        script = " ".join(f"{tag[turn.speaker]} {translate(turn.text)}" for turn in request.turns)
        prompts = []
        for speaker in speakers:
            voice = request.voices.get(speaker)
            if voice:
                prompts.append(self._store().get(voice))
        # A prompt's transcript speaks as the speaker whose voice it is.
        labels = [tag[s] for s in speakers if request.voices.get(s)]
        return iter((self._take(request.variant, script, prompts, request.params, request.seed, labels),))

    def _take(self, variant: str, script: str, prompts: Sequence[StoredClip], params: Mapping[str, float],
              seed: int | None, labels: Sequence[str] = ("[S1]",)) -> bytes:
        model, processor = self._loaded(variant)
        import numpy as np
        import torch

        audio = None
        spoken = script
        if prompts:
            script = " ".join(f"{label} {clip.transcript}" for label, clip in zip(labels, prompts)) + " " + script
            audio = np.concatenate([np.frombuffer(clip.samples().tobytes(), dtype="<f4") for clip in prompts])
        with self._device.cores():
            seeded(seed)
            inputs = processor(text=[script], audio=[audio] if audio is not None else None, padding=True,
                               return_tensors="pt").to(self._device.name)
            prompt = processor.get_audio_prompt_len(inputs["decoder_attention_mask"]) if audio is not None else None
            budget = frame_budget(spoken, self._cap, int(inputs["decoder_attention_mask"].shape[1]))
            with torch.inference_mode():
                frames = model.generate(
                    **inputs, max_new_tokens=budget, guidance_scale=float(params["cfgScale"]),
                    temperature=float(params["temperature"]), top_p=float(params["topP"]), top_k=TOP_K,
                    do_sample=True,
                )
                decoded = processor.batch_decode(frames, audio_prompt_len=prompt)
        samples = decoded[0].float().squeeze().detach().cpu().numpy() if decoded else np.zeros(0)
        return (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()

    # -- voices ---------------------------------------------------------------------------

    def voices(self) -> Sequence[Voice]:
        return self._store().created()

    def create_voice(self, voice_id: str, label: str, reference: Reference) -> Voice:
        if reference.extension not in self.reference_formats:
            raise Unsupported(f"a reference is one of {', '.join(self.reference_formats)}", field="reference")
        transcript = (reference.transcript or "").strip()
        if not transcript:
            raise BadRequest("a transcript is needed: Dia continues from the clip, so it must know the words said in it", field="transcript")
        if len(transcript) > 1000:
            raise BadRequest("a transcript is at most 1000 characters", field="transcript")
        clip = decode_reference(reference.data, SAMPLE_RATE, REFERENCE_SECONDS)
        return self._store().save(voice_id, label, clip, reference.filename, transcript)

    def delete_voice(self, voice_id: str) -> None:
        self._store().delete(voice_id)

    def _store(self) -> ClipStore:
        return ClipStore(self.context.voice_dir)

    # -- checks ---------------------------------------------------------------------------

    @staticmethod
    def _snapshots(variant: str) -> tuple[HubSnapshot, HubSnapshot]:
        if variant not in SNAPSHOTS:
            raise Unsupported(f"no variant {variant!r}", field="variant")
        return SNAPSHOTS[variant]

    def _loaded(self, variant: str) -> tuple[Any, Any]:
        if self._model is None or self._processor is None or variant != VARIANT:
            raise ModelUnavailable(f"variant {variant!r} is not loaded", field="variant")
        return self._model, self._processor
