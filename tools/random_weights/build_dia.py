"""
Dia and its codec with random weights, in the layout transformers saves them (what
C{nari-labs/Dia-1.6B-0626} and C{descript/dac_44khz} hold), for the tests and the GPU
bench: run with the Dia engine's interpreter.

    .venvs/dia/bin/python tools/random_weights/build_dia.py --size tiny|real

Built from transformers' own config classes: C{--size real} is C{DiaConfig()} and
C{DacConfig(sampling_rate=44100)}, Dia-1.6B's and the 44.1 kHz codec's architecture (6.4 GB in float32); C{--size
tiny} shrinks the widths and depths but keeps everything the loading and generation code
reads (the 1028-entry audio vocabulary, nine codebooks and their delays, the byte-level
text vocabulary, the codec's 44.1 kHz and hop of 512), which transformers'
C{from_pretrained} loads as it loads the real one.  The feature extractor and tokenizer
are Dia's own classes, saved beside the model.

Built once into the test-weights cache (L{_cache}), keyed by this file, the versions of
transformers, torch and safetensors, and the size; prints one JSON line naming the folder.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _cache  # noqa: E402

MODEL_REPO = "nari-labs/Dia-1.6B-0626"
CODEC_REPO = "descript/dac_44khz"


def _audible(codec: object) -> float:
    """
    Scale the codec's last convolution so that random codes decode to audible noise
    (about -20 dBFS): a random decoder, the tiny one most, is otherwise near silent, below
    the -60 dBFS that a checker calls silence.  The weights stay random, only larger.
    """
    import torch

    with torch.no_grad():
        codes = torch.randint(0, codec.config.codebook_size, (1, codec.config.n_codebooks, 64))  # type: ignore[attr-defined]
        audio = codec.decode(audio_codes=codes).audio_values  # type: ignore[attr-defined]
        rms = float(audio.pow(2).mean().sqrt())
        gain = min(1000.0, 0.1 / max(rms, 1e-6))
        codec.decoder.conv2.weight.mul_(gain)  # type: ignore[attr-defined]
        codec.decoder.conv2.bias.mul_(gain)  # type: ignore[attr-defined]
    return round(gain, 3)


def build(folder: Path, size: str) -> dict[str, object]:
    import torch
    from transformers import DacConfig, DacModel, DiaConfig, DiaFeatureExtractor, DiaForConditionalGeneration, DiaTokenizer
    from transformers.models.dia.configuration_dia import DiaDecoderConfig, DiaEncoderConfig

    from rhapsode_worker.fakehub import write_manifest

    torch.manual_seed(20261201)
    # descript/dac_44khz: DacConfig's defaults but its rate (the class defaults to 16 kHz).
    if size == "real":
        config, codec_config = DiaConfig(), DacConfig(sampling_rate=44100)
    else:
        encoder = DiaEncoderConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                   num_attention_heads=4, num_key_value_heads=4, head_dim=16)
        decoder = DiaDecoderConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   cross_num_attention_heads=4, cross_head_dim=16,
                                   cross_num_key_value_heads=4, cross_hidden_size=64)
        config = DiaConfig(encoder_config=encoder, decoder_config=decoder)
        codec_config = DacConfig(encoder_hidden_size=8, decoder_hidden_size=32, sampling_rate=44100)
    started = time.monotonic()
    model_dir = folder / "repos" / MODEL_REPO.replace("/", "--")
    codec_dir = folder / "repos" / CODEC_REPO.replace("/", "--")
    model = DiaForConditionalGeneration(config)
    model.save_pretrained(model_dir)
    DiaFeatureExtractor(sampling_rate=codec_config.sampling_rate, hop_length=codec_config.hop_length).save_pretrained(model_dir)
    DiaTokenizer().save_pretrained(model_dir)
    codec = DacModel(codec_config)
    gain = _audible(codec)
    codec.save_pretrained(codec_dir)
    write_manifest(model_dir)
    write_manifest(codec_dir)
    return {
        "repos": {MODEL_REPO: str(model_dir.relative_to(folder)), CODEC_REPO: str(codec_dir.relative_to(folder))},
        "parameters": {"dia": sum(p.numel() for p in model.parameters()),
                       "dac": sum(p.numel() for p in codec.parameters())},
        "seconds": {"build": round(time.monotonic() - started, 1)},
        "codec_gain": gain,
        "bytes": sum(p.stat().st_size for d in (model_dir, codec_dir) for p in d.iterdir()),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=("tiny", "real"), default="tiny")
    parser.add_argument("--root", type=Path, default=None)
    args = parser.parse_args()
    root = args.root or _cache.cache_root()
    name = _cache.key("dia", Path(__file__), ("transformers", "torch", "safetensors"), args.size)
    folder = root / name
    if not _cache.done(folder):
        root.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        scratch = Path(tempfile.mkdtemp(dir=root, prefix=f".{name}."))
        info = build(scratch, args.size)
        info["built_seconds"] = round(time.monotonic() - started, 1)
        _cache.finish(scratch, folder, info)
    info = json.loads((folder / "build.json").read_text())
    print(json.dumps({"folder": str(folder), "commit": (folder / _cache.COMMIT_FILE).read_text(), **info}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
