"""
Kokoro's voices: the 54 built in, and the ones made here from a voicepack or a blend.

A Kokoro voice is a style array of 510 x 256 float32 values (one row per phoneme count),
kept as (510, 1, 256) so a row is the (1, 256) the graph takes.  A created voice is two
files in the voice folder, kept by the SDK's L{VoiceStore}: C{<id>.npy}, the array, and
C{<id>.json}, its label and where it came from, written last so that a listed voice
always has its array.  Uploads
are read as data by the SDK's reader, never unpickled.

Pure standard library: nothing here loads or needs the model.
"""

from __future__ import annotations

import hashlib
import math
import struct
import sys
from array import array
from pathlib import Path
from typing import Any, Sequence

from rhapsode_worker import BadRequest, UnknownVoice, Unsupported, Voice, VoiceStore
from rhapsode_worker.arrays import read_voicepack

STYLE_SHAPE = (510, 1, 256)
STYLE_VALUES = 510 * 256
STYLE_BYTES = STYLE_VALUES * 4
WEIGHTS_TAG = "kokoro-v1.0"

#: kokoro-js 1.2.1's voices, in the order the cache's voices file holds them.
BUILTIN_VOICES: tuple[str, ...] = (
    "af_alloy", "af_aoede", "af_bella", "af_heart", "af_jessica", "af_kore", "af_nicole",
    "af_nova", "af_river", "af_sarah", "af_sky", "am_adam", "am_echo", "am_eric",
    "am_fenrir", "am_liam", "am_michael", "am_onyx", "am_puck", "am_santa", "bf_alice",
    "bf_emma", "bf_isabella", "bf_lily", "bm_daniel", "bm_fable", "bm_george", "bm_lewis",
    "ef_dora", "em_alex", "em_santa", "ff_siwis", "hf_alpha", "hf_beta", "hm_omega",
    "hm_psi", "if_sara", "im_nicola", "jf_alpha", "jf_gongitsune", "jf_nezumi",
    "jf_tebukuro", "jm_kumo", "pf_dora", "pm_alex", "pm_santa", "zf_xiaobei", "zf_xiaoni",
    "zf_xiaoxiao", "zf_xiaoyi", "zm_yunjian", "zm_yunxi", "zm_yunxia", "zm_yunyang",
)
VOICES_SHAPE = (len(BUILTIN_VOICES), *STYLE_SHAPE)

#: The languages this build speaks, each with the espeak-ng voice that phonemizes it.
#: Japanese and Chinese are absent: espeak-ng reads kanji as "Chinese letter" and drops
#: Mandarin's tones from what the model's vocabulary keeps (kokoro's own route is misaki).
ESPEAK_LANGUAGES: dict[str, str] = {
    "en-US": "en-us",
    "en-GB": "en-gb",
    "es": "es",
    "fr": "fr-fr",
    "hi": "hi",
    "it": "it",
    "pt-BR": "pt-br",
}

#: The voice a request in each language gets when it names none.
DEFAULT_VOICES: dict[str, str] = {
    "en-US": "af_heart",
    "en-GB": "bf_emma",
    "es": "ef_dora",
    "fr": "ff_siwis",
    "hi": "hf_alpha",
    "it": "if_sara",
    "pt-BR": "pf_dora",
}

# Kokoro's naming: the first letter is the language, the second the gender.
_LANGUAGE_OF_PREFIX = {
    "a": ("en-US", "American English"),
    "b": ("en-GB", "British English"),
    "e": ("es", "Spanish"),
    "f": ("fr", "French"),
    "h": ("hi", "Hindi"),
    "i": ("it", "Italian"),
    "j": ("ja", "Japanese"),
    "p": ("pt-BR", "Brazilian Portuguese"),
    "z": ("zh", "Mandarin Chinese"),
}
_GENDER_OF_PREFIX = {"f": "female", "m": "male"}


def builtin_listing(name: str) -> Voice:
    """How C{GET /voices} lists a built-in voice, from its name alone."""
    language, language_name = _LANGUAGE_OF_PREFIX[name[0]]
    gender = _GENDER_OF_PREFIX[name[1]]
    description = f"{language_name}, {gender}"
    if language not in ESPEAK_LANGUAGES:
        description += "; this build cannot phonemize its language, so it reads the others"
    return Voice(
        id=name,
        label=name.partition("_")[2].capitalize(),
        spec=f"{name}@{WEIGHTS_TAG}",
        description=description,
        tags=(language, gender),
        builtin=True,
    )


def npy_header(shape: tuple[int, ...]) -> bytes:
    """A .npy (format 1.0) header for a little-endian float32 C-order array of C{shape}."""
    text = f"{{'descr': '<f4', 'fortran_order': False, 'shape': {shape!r}, }}"
    # numpy pads the header with spaces and a newline so the data starts 64-byte aligned.
    padding = -(10 + len(text) + 1) % 64
    encoded = (text + " " * padding + "\n").encode("latin-1")
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(encoded)) + encoded


def builtin_style(voices_file: Path, name: str) -> bytes:
    """A built-in voice's style bytes, read out of the cache's voices file alone."""
    with voices_file.open("rb") as handle:
        handle.seek(len(npy_header(VOICES_SHAPE)) + BUILTIN_VOICES.index(name) * STYLE_BYTES)
        return handle.read(STYLE_BYTES)


def _little_endian(values: array[float]) -> bytes:
    if sys.byteorder == "big":
        values = array("f", values)
        values.byteswap()
    return values.tobytes()


def _values(raw: bytes) -> array[float]:
    values = array("f")
    values.frombytes(raw)
    if sys.byteorder == "big":
        values.byteswap()
    return values


def style_from_voicepack(filename: str, data: bytes) -> bytes:
    """
    The little-endian float32 bytes of a voicepack's style array, read as data.

    @raise Unsupported: for a file that is not .npy or .pt.
    @raise BadRequest: naming C{reference}, for any other shape than 510 x 1 x 256 or
        510 x 256, for values that are not finite, or for a malformed file.
    """
    found = read_voicepack(filename, data, field="reference")
    if found.shape not in (STYLE_SHAPE, (510, 256)):
        raise BadRequest(
            f'"reference" holds an array of shape {found.shape}; a Kokoro voicepack is '
            "510 x 1 x 256 (or 510 x 256)",
            field="reference",
        )
    if not all(math.isfinite(v) for v in found.values):
        raise BadRequest('"reference" holds values that are not finite numbers', field="reference")
    return _little_endian(found.values)


def blend_styles(parts: Sequence[tuple[bytes, float]]) -> bytes:
    """The weighted sum of style arrays; the weights already sum to 1."""
    total = [0.0] * STYLE_VALUES
    for raw, weight in parts:
        for i, value in enumerate(_values(raw)):
            total[i] += weight * value
    return _little_endian(array("f", total))


class StyleStore:
    """
    The voices made on this box: each a style array (the blob, a .npy) and a record of
    its label, where it came from and its hash, in the SDK's L{VoiceStore}.
    """

    def __init__(self, directory: Path) -> None:
        self._store = VoiceStore(directory, blob=".npy")

    def created(self) -> list[Voice]:
        return [self._listing(voice_id, record) for voice_id, record in self._store.records()]

    def save(self, voice_id: str, label: str, style: bytes, origin: dict[str, Any]) -> Voice:
        """Store a style array and its record; an existing voice of that id is replaced."""
        if voice_id in BUILTIN_VOICES:
            raise Unsupported(f'"{voice_id}" is a built-in voice', field="id")
        record = {
            "label": label,
            "origin": origin,
            "sha256": hashlib.sha256(style).hexdigest(),
        }
        self._store.save(voice_id, record, npy_header(STYLE_SHAPE) + style)
        return self._listing(voice_id, record)

    def style_path(self, voice_id: str) -> Path:
        """The .npy of a created voice.  @raise UnknownVoice: if there is none."""
        if voice_id in BUILTIN_VOICES:
            raise UnknownVoice(f'no created voice "{voice_id}"', field="voice")
        return self._store.blob_path(voice_id)

    def style(self, voice_id: str) -> bytes:
        """A created voice's style bytes, without the .npy header this store wrote."""
        return self.style_path(voice_id).read_bytes()[len(npy_header(STYLE_SHAPE)):]

    def delete(self, voice_id: str) -> None:
        if voice_id in BUILTIN_VOICES:
            raise Unsupported(f'"{voice_id}" is a built-in voice', field="id")
        self._store.delete(voice_id)

    @staticmethod
    def _listing(voice_id: str, record: dict[str, Any]) -> Voice:
        origin = record["origin"]
        if origin["kind"] == "blend":
            description = "Blend of " + ", ".join(f"{name} {weight:.0%}" for name, weight in origin["components"])
        else:
            description = f"Voicepack from {origin['filename']}"
        return Voice(
            id=voice_id,
            label=record["label"],
            spec=f"{voice_id}@{record['sha256'][:16]}",
            description=description,
            tags=(origin["kind"],),
            builtin=False,
        )
