"""
Chatterbox at its real size with random weights, in the layout of ResembleAI/chatterbox,
for the tests and the GPU bench: run with the Chatterbox engine's interpreter.

    .venvs/chatterbox/bin/python tools/random_weights/build_chatterbox.py [--device cpu]

chatterbox-tts's loader builds C{VoiceEncoder()}, C{T3()} and C{S3Gen()} with their fixed
default configurations and loads the state dicts strictly (T3) or by name (S3Gen), so a
smaller checkpoint does not load: this one is built from those same constructors, 532M
parameters of T3 and 264M of S3Gen, 3.2 GB in float32.  The tokenizer is a character
vocabulary with T3's special ids (C{[STOP]} 0, C{[START]} 255), in the C{tokenizers} JSON
format C{EnTokenizer} reads.  C{conds.pt}, the built-in voice, is what
C{prepare_conditionals} makes of a two-second synthetic clip, saved by C{Conditionals.save}.

Built once into the test-weights cache (L{_cache}), keyed by this file and the versions
of chatterbox-tts, torch and safetensors; prints one JSON line naming the folder.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _cache  # noqa: E402

REPO = "ResembleAI/chatterbox"
RATE = 24_000
#: The built-in voice's clip: short, since S3Gen's cost grows with the prompt it
#: continues (6 s made each 3-token generation about 30 s on two cores, most of it S3Gen).
CLIP_SECONDS = 2.0


def _tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models

    specials = {"[STOP]": 0, "[UNK]": 1, "[SPACE]": 2, "[PAD]": 3, "[SEP]": 4, "[CLS]": 5, "[MASK]": 6,
                "[START]": 255}
    vocab = dict(specials)
    characters = [chr(c) for c in range(33, 127)] + list("àâäçéèêëîïôöùûüÿñ’“”—–…")
    free = (n for n in range(704) if n not in specials.values())
    for character in characters:
        vocab[character] = next(free)
    # Every id up to T3's 704 names a token, as in the real vocabulary: no holes.
    for number in free:
        vocab[f"[unused{number}]"] = number
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="[UNK]"))
    tokenizer.add_special_tokens(list(specials))
    tokenizer.save(str(path))


def _clip(path: Path, seconds: float = CLIP_SECONDS) -> None:
    import numpy as np
    import soundfile

    t = np.arange(int(seconds * RATE)) / RATE
    voice = sum(np.sin(2 * math.pi * f * t) / (i + 1) for i, f in enumerate((140, 280, 420, 700, 1100)))
    envelope = 0.5 + 0.5 * np.sin(2 * math.pi * 3.0 * t) ** 2
    soundfile.write(path, (0.2 * voice * envelope / 2).astype("float32"), RATE)


def build(folder: Path, device: str) -> dict[str, object]:
    import torch
    from safetensors.torch import save_file

    from rhapsode_engine_chatterbox import _torchaudio

    _torchaudio.install()
    from chatterbox.models.s3gen import S3Gen
    from chatterbox.models.t3 import T3
    from chatterbox.models.tokenizers import EnTokenizer
    from chatterbox.models.voice_encoder import VoiceEncoder
    from chatterbox.tts import ChatterboxTTS

    from rhapsode_worker.fakehub import write_manifest

    torch.manual_seed(20261201)
    repo = folder / "repos" / REPO.replace("/", "--")
    repo.mkdir(parents=True)
    timings: dict[str, float] = {}
    modules = {}
    for name, make in (("ve", VoiceEncoder), ("t3_cfg", T3), ("s3gen", S3Gen)):
        started = time.monotonic()
        module = make()
        save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(repo / f"{name}.safetensors"))
        modules[name] = module
        timings[name] = round(time.monotonic() - started, 1)
    _tokenizer(repo / "tokenizer.json")
    started = time.monotonic()
    model = ChatterboxTTS(modules["t3_cfg"].to(device).eval(), modules["s3gen"].to(device).eval(),
                          modules["ve"].to(device).eval(), EnTokenizer(str(repo / "tokenizer.json")), device)
    with tempfile.TemporaryDirectory() as scratch:
        clip = Path(scratch) / "voice.wav"
        _clip(clip)
        model.prepare_conditionals(str(clip))
    model.conds.save(repo / "conds.pt")
    timings["conds"] = round(time.monotonic() - started, 1)
    write_manifest(repo)
    parameters = {name: sum(p.numel() for p in module.parameters()) for name, module in modules.items()}
    return {"repos": {REPO: str(repo.relative_to(folder))}, "parameters": parameters, "seconds": timings,
            "bytes": sum(p.stat().st_size for p in repo.iterdir())}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--root", type=Path, default=None)
    args = parser.parse_args()
    root = args.root or _cache.cache_root()
    name = _cache.key("chatterbox", Path(__file__), ("chatterbox-tts", "torch", "safetensors", "tokenizers"), "real")
    folder = root / name
    if not _cache.done(folder):
        root.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        scratch = Path(tempfile.mkdtemp(dir=root, prefix=f".{name}."))
        info = build(scratch, args.device)
        info["built_seconds"] = round(time.monotonic() - started, 1)
        _cache.finish(scratch, folder, info)
    info = json.loads((folder / "build.json").read_text())
    print(json.dumps({"folder": str(folder), "commit": (folder / _cache.COMMIT_FILE).read_text(), **info}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
