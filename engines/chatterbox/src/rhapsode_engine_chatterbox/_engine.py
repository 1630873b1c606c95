"""
The Chatterbox engine's adapter: Resemble AI's Chatterbox, through chatterbox-tts on torch,
on the device the core gives the worker, as two variants: C{original} (English) and
C{multilingual} (the build of 23 languages, of which this stack speaks the 21 in
L{MULTILINGUAL_LANGUAGES}).

Each is three networks and a tokenizer, loaded by chatterbox-tts's own loader
(C{ChatterboxTTS.from_local}, C{ChatterboxMultilingualTTS.from_local}) from a snapshot of
C{ResembleAI/chatterbox} pinned to one commit, fetched through the hub's client
(L{rhapsode_worker.hub}): a 0.5B Llama (T3) makes speech tokens from text, S3Gen makes
24 kHz audio from them, a voice encoder and conditioning taken from a reference clip give
the voice.  The multilingual T3 reads a language token before the text; the request's
C{language} is that token.  Its tokenizer would reach the network while it is built
(L{_multilingual}): the load keeps it to the snapshot on the disk.  Every output passes
through Resemble's Perth watermarker inside C{generate()}: the watermark is imperceptible
and is in every file this engine makes.

Voices, in both variants: the repository's built-in voice (C{conds.pt}, which both
builds read) as C{default}, and clones from an uploaded clip of 5 to 20 seconds.  A clone
stores the clip only; its conditioning is computed by the loaded model at the clone's first
speak, under the model's lease (section 7), and kept while that model is loaded.

Dials: exaggeration, cfgWeight and temperature, passed to C{generate()} as they are.
Deliveries are relative to the request's own dials (section 5): hushed halves the
exaggeration, frantic raises it by half and lowers the CFG weight, which is what the
model's authors suggest for faster, more dramatic reading.

One generation stops at 1000 speech tokens (40 s), C{generate()}'s own limit;
C{RHAPSODE_CHATTERBOX_MAX_TOKENS} lowers it, which is how the tests bound a model of
random weights, whose stop token never comes.  Text is split at 300 characters (about
19 s at an ordinary pace) by the SDK.

T3's speech vocabulary (8194) is larger than S3Gen's (6561): the English generate() drops
the tokens S3Gen cannot decode before handing them over, the multilingual one does not,
and S3Gen's embedding then fails ("index out of range in self") on any such token T3
samples (a model of random weights does in about one token of five; a trained one at a
high temperature can).  The adapter drops them in both, as the English build does
(L{refuse_empty}).  A draw can end before its first speech token S3Gen can decode (T3
samples its stop token, or only tokens outside S3Gen's vocabulary), and S3Gen cannot make
audio of nothing: rather than the vocoder's own error, the tokens are drawn again, up to
L{DRAWS} times in all, and past that the request fails naming what happened.  A seeded
request stays reproducible: its later draws follow from the same seed.
"""

from __future__ import annotations

import os
import time
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence, TypeAlias

from rhapsode_worker import (
    Engine,
    Internal,
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
from rhapsode_worker.clips import ClipStore
from rhapsode_worker.devices import TorchDevice, seeded
from rhapsode_worker.hub import HubSnapshot, fetch, local
from twisted.logger import Logger

if TYPE_CHECKING:
    from chatterbox.mtl_tts import ChatterboxMultilingualTTS
    from chatterbox.tts import ChatterboxTTS

    Model: TypeAlias = ChatterboxTTS | ChatterboxMultilingualTTS

log = Logger(namespace="rhapsode_engine_chatterbox")

VARIANT = "original"
MULTILINGUAL = "multilingual"
#: What the multilingual variant speaks: chatterbox-tts 0.1.7's SUPPORTED_LANGUAGES, whose
#: codes are BCP 47's, English first (the default where a request names none), less
#: Japanese (its kanji reach the model only through pykakasi, GPL-3.0-or-later and not
#: installed) and Chinese (its text is segmented into words by spacy-pkuseg, whose model
#: would be downloaded from GitHub at load, which the load does not do: L{_multilingual}).
#: Hebrew and Russian are spoken as a plain install of chatterbox-tts speaks them, without
#: the optional packages that add niqqud and stress marks, which it does not depend on.
MULTILINGUAL_LANGUAGES = ("en", "ar", "da", "de", "el", "es", "fi", "fr", "he", "hi", "it", "ko", "ms", "nl",
                          "no", "pl", "pt", "ru", "sv", "sw", "tr")
SAMPLE_RATE = 24_000
DEFAULT_VOICE = "default"
#: The speech tokens one generate() may make: its own hard-coded limit (40 s of audio).
MAX_TOKENS = 1000
MAX_TOKENS_VARIABLE = "RHAPSODE_CHATTERBOX_MAX_TOKENS"
REFERENCE_SECONDS = (5.0, 20.0)
#: How many times one generation draws its speech tokens when a draw has none that
#: S3Gen can decode.
DRAWS = 3

REPO = "ResembleAI/chatterbox"
#: The commit chatterbox-tts 0.1.7's English files were published with.  The
#: multilingual files are taken from the same commit: that it holds them (the library's
#: from_pretrained reads them from "main") is assumed, not checked against the hub.
REVISION = "5bb1f6ee58e50c3b8d408bc82a6d3740c2db6e18"

SNAPSHOTS: dict[str, HubSnapshot] = {
    VARIANT: HubSnapshot(
        repo=REPO, revision=REVISION,
        files=("ve.safetensors", "t3_cfg.safetensors", "s3gen.safetensors", "tokenizer.json", "conds.pt"),
    ),
    # The files ChatterboxMultilingualTTS.from_pretrained names.
    MULTILINGUAL: HubSnapshot(
        repo=REPO, revision=REVISION,
        files=("ve.pt", "t3_mtl23ls_v2.safetensors", "s3gen.pt", "grapheme_mtl_merged_expanded_v1.json",
               "conds.pt", "Cangjie5_TC.json"),
    ),
}


def _variant(languages: Sequence[str]) -> Variant:
    return Variant(
        deliveries=("hushed", "frantic"),
        dials={
            "exaggeration": (0.25, 2.0, 0.5),
            "cfgWeight": (0.0, 1.0, 0.5),
            "temperature": (0.05, 5.0, 0.8),
        },
        languages=languages,
        max_speakers=0,
        blends=False,
        seed_reproducible=True,
        reference_seconds=REFERENCE_SECONDS,
    )


_VARIANTS: dict[str, Variant] = {
    VARIANT: _variant(("en",)),
    MULTILINGUAL: _variant(MULTILINGUAL_LANGUAGES),
}


def delivered(delivery: str | None, params: Mapping[str, float]) -> tuple[float, float]:
    """
    The exaggeration and CFG weight a delivery reads at, relative to the request's.
    """
    exaggeration, cfg = float(params["exaggeration"]), float(params["cfgWeight"])
    if delivery == "hushed":
        return max(0.25, exaggeration * 0.5), cfg
    if delivery == "frantic":
        return min(2.0, exaggeration * 1.5), cfg * 0.6
    return exaggeration, cfg


class NoSpeech(Exception):
    """
    T3's draw ended before any speech token that S3Gen can decode.
    """


def refuse_empty(model: Any) -> None:
    """
    Make C{model}'s S3Gen take only the speech tokens it can decode, those below its
    vocabulary's size (the English generate() hands it only those, the multilingual one
    every token T3 drew), and raise L{NoSpeech} when none is left, before its vocoder
    fails on nothing: on this model object, not in the library's files.
    """
    from chatterbox.models.s3tokenizer import SPEECH_VOCAB_SIZE

    real = model.s3gen.inference

    def checked(*args: Any, **kwargs: Any) -> Any:
        if "speech_tokens" in kwargs:
            drawn = kwargs["speech_tokens"]
            tokens = kwargs["speech_tokens"] = drawn[drawn < SPEECH_VOCAB_SIZE]
        else:
            tokens = args[0][args[0] < SPEECH_VOCAB_SIZE]
            args = (tokens, *args[1:])
        if tokens.numel() == 0:
            raise NoSpeech()
        return real(*args, **kwargs)

    model.s3gen.inference = checked


def max_tokens(environ: Mapping[str, str]) -> int:
    raw = environ.get(MAX_TOKENS_VARIABLE, "").strip()
    if not raw:
        return MAX_TOKENS
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_TOKENS:
        raise ValueError(f"{MAX_TOKENS_VARIABLE} must be 1 to {MAX_TOKENS}, not {raw!r}")
    return int(raw)


class ChatterboxEngine(Engine):
    """
    Chatterbox, English and multilingual: its built-in voice, clones from a clip, three
    dials, two deliveries; watermarked.
    """

    native_format = NativeFormat(sample_rate=SAMPLE_RATE)
    upstream_distribution = "chatterbox-tts"
    segment_characters = 300
    joint_silence_ms = 100
    reference_formats = ("wav", "flac", "mp3", "ogg")

    def __init__(self, context: WorkerContext | None = None, device: TorchDevice | None = None) -> None:
        super().__init__(context)
        self._environ: Mapping[str, str] = os.environ if context is None else context.environ
        self._cap = max_tokens(self._environ)
        # Before serving: the device is resolved once, and /health never asks it again.
        self._device = device if device is not None else TorchDevice.probe(self._environ)
        self._model: Model | None = None
        #: The variant of the loaded model (meaningful while there is one).
        self._variant = VARIANT
        self._conds: dict[str, Any] = {}
        self._builtin: Any = None

    # -- the model ------------------------------------------------------------------------

    def variants(self) -> Mapping[str, Variant]:
        return _VARIANTS

    def fetch(self, variant: str) -> None:
        fetch(self._snapshot(variant), self._environ)

    def load(self, variant: str) -> None:
        snapshot = self._snapshot(variant)
        folder = local(snapshot, self._environ) or fetch(snapshot, self._environ)
        # Imported here: a worker answers its handshake and lists voices without torch's
        # model code, and torchaudio must be told first that it runs without its native half.
        from . import _torchaudio

        if _torchaudio.install():
            log.info("torchaudio {audio} does not match torch {torch}: its native extensions are left "
                     "out, and the Python half chatterbox-tts uses is what runs",
                     audio=version("torchaudio"), torch=version("torch"))

        started = time.monotonic()
        with self._device.cores():
            model = self._device.measured(lambda: self._from_local(variant, folder))
        if model.watermarker is None:
            raise Internal("resemble-perth gave no watermarker (it needs setuptools<81 for pkg_resources)")
        self._cap_tokens(model)
        refuse_empty(model)
        self._model = model
        self._variant = variant
        self._builtin = model.conds
        log.info("{variant} loaded from {folder} on {device} in {seconds:.1f} s, at most {cap} speech "
                 "tokens a generation", variant=variant, folder=str(folder), device=self._device.name,
                 seconds=time.monotonic() - started, cap=self._cap)

    def _from_local(self, variant: str, folder: Path) -> "Model":
        if variant == VARIANT:
            from chatterbox.tts import ChatterboxTTS

            return ChatterboxTTS.from_local(folder, self._device.name)
        from chatterbox.mtl_tts import ChatterboxMultilingualTTS

        from ._multilingual import offline_tokenizer

        with offline_tokenizer(SNAPSHOTS[variant], self._environ) as served:
            model = ChatterboxMultilingualTTS.from_local(folder, self._device.name)
        # The converter swallows a table it could not read (Chinese alone needs it,
        # and Chinese is not declared): said here, where the worker's log shows it.
        glyphs = len(model.tokenizer.cangjie_converter.word2cj)
        if glyphs:
            log.info("the tokenizer's Cangjie table, {glyphs} glyphs, read from {files} (the pinned snapshot "
                     "in the hub's cache, without asking the hub)",
                     glyphs=glyphs, files=", ".join(served.files))
        else:
            log.warn("the tokenizer read no Cangjie table (asked for {files}, refused {refused})",
                     files=", ".join(served.files) or "none", refused=", ".join(served.refused) or "none")
        return model

    def _cap_tokens(self, model: "Model") -> None:
        # generate() passes max_new_tokens=1000 itself, so a lower cap has to be applied
        # where T3 receives it: on this model object, not in the library's files.
        if self._cap >= MAX_TOKENS:
            return
        real, cap = model.t3.inference, self._cap

        def capped(*args: Any, **kwargs: Any) -> Any:
            kwargs["max_new_tokens"] = min(int(kwargs.get("max_new_tokens", cap)), cap)
            return real(*args, **kwargs)

        model.t3.inference = capped

    def unload(self) -> None:
        def drop() -> None:
            self._model = None
            self._builtin = None
            self._conds.clear()

        self._device.release(drop)

    def memory_bytes(self) -> int | None:
        return self._device.model_bytes

    # -- speaking -------------------------------------------------------------------------

    def speak(self, request: SpeakRequest) -> Iterator[bytes]:
        model = self._loaded(request.variant)
        import numpy as np
        import torch

        exaggeration, cfg = delivered(request.delivery, request.params)
        # The multilingual T3 reads the language as a token: the declared codes are
        # chatterbox-tts's own language ids.
        language = {"language_id": request.language} if self._variant == MULTILINGUAL else {}
        with self._device.cores():
            seeded(request.seed)
            conds = self._conditionals(model, request.voice or DEFAULT_VOICE, exaggeration)
            for draw in range(1, DRAWS + 1):
                # generate() replaces conds.t3 when the exaggeration changes: a copy each
                # time (of the loaded build's own Conditionals class), so a voice's stored
                # conditioning is never altered by a request.
                model.conds = type(conds)(conds.t3, conds.gen)
                try:
                    with torch.inference_mode():
                        wav = model.generate(request.text, exaggeration=exaggeration, cfg_weight=cfg,
                                             temperature=float(request.params["temperature"]), **language)
                    break
                except NoSpeech:
                    log.warn("draw {draw} of {draws} ended before any speech token", draw=draw, draws=DRAWS)
            else:
                raise Internal(f"Chatterbox ended its speech before any sound in {DRAWS} draws "
                               "(none of them gave a speech token S3Gen can decode)")
        samples = wav.squeeze(0).detach().cpu().numpy()
        pcm = (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2")
        return iter((pcm.tobytes(),))

    def _conditionals(self, model: "Model", voice: str, exaggeration: float) -> Any:
        if voice == DEFAULT_VOICE:
            if self._builtin is None:
                raise Internal("the snapshot has no built-in voice (conds.pt)")
            return self._builtin
        stored = self._store().get(voice)
        key = stored.voice.spec
        if key not in self._conds:
            import numpy as np
            import soundfile

            # prepare_conditionals() reads a file with librosa; the clip as stored, 24 kHz.
            folder = self._device_scratch()
            path = folder / f"{voice}.wav"
            soundfile.write(path, np.frombuffer(stored.samples().tobytes(), dtype="<f4"), stored.rate)
            try:
                model.prepare_conditionals(str(path), exaggeration=exaggeration)
            finally:
                path.unlink(missing_ok=True)
            self._conds[key] = model.conds
            log.info("conditioning for {voice} computed from its {seconds:.1f} s clip", voice=voice,
                     seconds=len(stored.samples()) / stored.rate)
        return self._conds[key]

    def _device_scratch(self) -> Path:
        folder = self.context.voice_dir / ".scratch"
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    # -- voices ---------------------------------------------------------------------------

    def voices(self) -> Sequence[Voice]:
        builtin = Voice(id=DEFAULT_VOICE, label="Chatterbox default",
                        spec=f"{DEFAULT_VOICE}@{SNAPSHOTS[VARIANT].revision[:12]}",
                        description="The voice ResembleAI/chatterbox ships (conds.pt)", tags=("en",))
        return [builtin, *self._store().created()]

    def create_voice(self, voice_id: str, label: str, reference: Reference) -> Voice:
        if reference.extension not in self.reference_formats:
            raise Unsupported(f"a reference is one of {', '.join(self.reference_formats)}", field="reference")
        clip = decode_reference(reference.data, SAMPLE_RATE, REFERENCE_SECONDS)
        return self._store().save(voice_id, label, clip, reference.filename, reference.transcript)

    def delete_voice(self, voice_id: str) -> None:
        self._store().delete(voice_id)

    def _store(self) -> ClipStore:
        return ClipStore(self.context.voice_dir, frozenset({DEFAULT_VOICE}))

    # -- checks ---------------------------------------------------------------------------

    @staticmethod
    def _snapshot(variant: str) -> HubSnapshot:
        if variant not in SNAPSHOTS:
            raise Unsupported(f"no variant {variant!r}", field="variant")
        return SNAPSHOTS[variant]

    def _loaded(self, variant: str) -> "Model":
        if self._model is None or variant != self._variant:
            raise ModelUnavailable(f"variant {variant!r} is not loaded", field="variant")
        return self._model
