"""
Chatterbox at its real size with random weights, in the layout of ResembleAI/chatterbox,
for the tests and the GPU bench: run with the Chatterbox engine's interpreter.  Both builds
the repository holds are made: the English one (C{ChatterboxTTS.from_local}) and the
multilingual one (C{ChatterboxMultilingualTTS.from_local}).

    .venvs/chatterbox/bin/python tools/random_weights/build_chatterbox.py [--device cpu]

chatterbox-tts's loader builds C{VoiceEncoder()}, C{T3()} and C{S3Gen()} with their fixed
default configurations and loads the state dicts strictly (T3) or by name (S3Gen), so a
smaller checkpoint does not load: this one is built from those same constructors, 532M
parameters of T3 and 264M of S3Gen, 3.2 GB in float32.  The tokenizer is a character
vocabulary with T3's special ids (C{[STOP]} 0, C{[START]} 255), in the C{tokenizers} JSON
format C{EnTokenizer} reads.  C{conds.pt}, the built-in voice, is what
C{prepare_conditionals} makes of a two-second synthetic clip, saved by C{Conditionals.save};
both builds read it.

The multilingual build's files, in the names its loader reads: C{ve.pt} and C{s3gen.pt},
the same voice encoder and S3Gen as the English build's, saved as state dicts with
C{torch.save} (its loader reads them with C{weights_only=True}); C{t3_mtl23ls_v2.safetensors},
T3 for C{T3Config.multilingual()}, which differs from the English T3 only in its text
vocabulary (2454 entries): the English T3's tensors, with the two of the text vocabulary's
size (its embedding and head) drawn anew at the multilingual size; a grapheme vocabulary
C{grapheme_mtl_merged_expanded_v1.json} (T3's special ids, a token per language C{[xx]},
the letters of the scripts its languages are written in, decomposed as the tokenizer's
NFKD leaves them, and the Cangjie code tokens C{[cj_x]}); and C{Cangjie5_TC.json}, a small
Cangjie table in the file's format (C{"glyph<TAB>code"} entries), which the tokenizer
reads when it is built.

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


#: The language tokens of chatterbox-tts 0.1.7's multilingual model (its SUPPORTED_LANGUAGES).
LANGUAGES = ("ar", "da", "de", "el", "en", "es", "fi", "fr", "he", "hi", "it", "ja", "ko", "ms", "nl", "no",
             "pl", "pt", "ru", "sv", "sw", "tr", "zh")
#: T3's text vocabulary in T3Config.multilingual().
MTL_VOCABULARY = 2454
#: How many glyphs the small Cangjie table gives codes to, from U+4E00 on.
CANGJIE_GLYPHS = 400


def _mtl_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models

    specials = {"[STOP]": 0, "[UNK]": 1, "[SPACE]": 2, "[PAD]": 3, "[SEP]": 4, "[CLS]": 5, "[MASK]": 6,
                "[START]": 255}
    added = [f"[{code}]" for code in LANGUAGES] + [f"[cj_{c}]" for c in "abcdefghijklmnopqrstuvwxyz0123456789."]
    # Letters as NFKD leaves them (accents come apart into a letter and a combining
    # mark), so every block is a run of code points: ASCII, the combining marks, Latin
    # letters NFKD keeps whole (ß, ø, æ, ł, ı), Greek, Cyrillic, Hebrew, Arabic,
    # Devanagari, Hangul jamo (NFKD takes syllables apart), kana, CJK punctuation.
    blocks = [(0x21, 0x7E), (0x0300, 0x036F), (0x00A1, 0x00FF), (0x0100, 0x017F), (0x0370, 0x03FF),
              (0x0400, 0x04FF), (0x0590, 0x05FF), (0x0600, 0x06FF), (0x0900, 0x097F), (0x1100, 0x11FF),
              (0x3000, 0x303F), (0x3040, 0x30FF), (0xFF01, 0xFF5E)]
    characters = [chr(c) for low, high in blocks for c in range(low, high + 1)]
    vocab = dict(specials)
    free = (n for n in range(MTL_VOCABULARY) if n not in specials.values())
    for token in [*added, *dict.fromkeys(characters)]:
        vocab[token] = next(free)
    for number in free:
        vocab[f"[unused{number}]"] = number
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="[UNK]"))
    tokenizer.add_special_tokens([*specials, *added])
    tokenizer.save(str(path))


def _cangjie(path: Path) -> None:
    # Codes of one to five letters of the Cangjie alphabet (a to y), made up: the
    # tokenizer only reads the table's shape, and a model of random weights cannot
    # tell a right code from a wrong one.
    entries = []
    for index in range(CANGJIE_GLYPHS):
        letters, n = [], index
        while True:
            letters.append("abcdefghijklmnopqrstuvwxy"[n % 25])
            n //= 25
            if not n:
                break
        entries.append(f"{chr(0x4E00 + index)}\t{''.join(letters)}")
    path.write_text(json.dumps(entries, ensure_ascii=False), encoding="utf-8")


def _mtl_t3(english: dict[str, "torch.Tensor"]) -> dict[str, "torch.Tensor"]:
    """
    T3 for T3Config.multilingual(): the English T3's tensors where the shapes agree,
    drawn anew (with the English tensor's mean and spread) where they do not.
    """
    import torch
    from chatterbox.models.t3 import T3
    from chatterbox.models.t3.modules.t3_config import T3Config

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in T3(T3Config.multilingual()).state_dict().items()}
    if set(shapes) != set(english):
        raise RuntimeError(f"the multilingual T3 has other tensors: {sorted(set(shapes) ^ set(english))}")
    state = {}
    for name, tensor in english.items():
        if tensor.shape == shapes[name]:
            state[name] = tensor.contiguous()
        else:
            drawn = torch.randn(shapes[name], dtype=tensor.dtype) * tensor.float().std() + tensor.float().mean()
            state[name] = drawn.to(tensor.dtype).contiguous()
    return state


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
    started = time.monotonic()
    for name in ("ve", "s3gen"):
        torch.save(modules[name].state_dict(), repo / f"{name}.pt")
    mtl = _mtl_t3(modules["t3_cfg"].state_dict())
    save_file(mtl, str(repo / "t3_mtl23ls_v2.safetensors"))
    _mtl_tokenizer(repo / "grapheme_mtl_merged_expanded_v1.json")
    _cangjie(repo / "Cangjie5_TC.json")
    timings["multilingual"] = round(time.monotonic() - started, 1)
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
