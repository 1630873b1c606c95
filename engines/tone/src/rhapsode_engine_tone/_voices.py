"""
The tone engine's voices: four built-ins and a store of created ones.

A voice here is two numbers, a base pitch and a brightness (how strong its upper
harmonics are).  Created voices are JSON files in the directory the SDK hands the
adapter, one per voice, written whole or not at all.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from rhapsode_worker import BadRequest, UnknownVoice, Voice

# The protocol's voice id rule (section 7).  The SDK checks it first; checking again
# here is what keeps a path out of the store whoever calls it.
_VOICE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}\Z")


@dataclass(frozen=True)
class ToneVoice:
    """
    A voice and everything its rendering depends on.
    """

    id: str
    label: str
    pitch: float
    brightness: float
    tags: tuple[str, ...]
    description: str = ""
    origin: Mapping[str, Any] = field(default_factory=dict)
    builtin: bool = False

    def spec(self, version: str) -> str:
        """
        A token that changes whenever the rendering would: with the adapter's version
        or with the numbers, and never with the label.
        """
        minted = json.dumps([version, self.pitch, self.brightness]).encode()
        return f"{self.id}@{hashlib.sha256(minted).hexdigest()[:12]}"

    def listing(self, version: str) -> Voice:
        return Voice(
            id=self.id,
            label=self.label,
            spec=self.spec(version),
            description=self.description,
            tags=self.tags,
            builtin=self.builtin,
        )


def _builtin(voice_id: str, pitch: float, brightness: float, *tags: str) -> ToneVoice:
    description = f"{', '.join(tags).capitalize()}, {pitch:.0f} Hz"
    return ToneVoice(voice_id, voice_id.title(), pitch, brightness, tags, description, builtin=True)


BUILTINS: dict[str, ToneVoice] = {
    v.id: v
    for v in (
        _builtin("alto", 220.0, 0.6, "mid", "warm"),
        _builtin("bass", 110.0, 0.45, "low", "dark"),
        _builtin("tenor", 165.0, 0.7, "low", "bright"),
        _builtin("soprano", 330.0, 0.75, "high", "bright"),
    )
}

DEFAULT_VOICE = "alto"


class VoiceStore:
    """
    The created voices in one directory.
    """

    def __init__(self, directory: Path) -> None:
        self._directory = directory

    def _path(self, voice_id: str) -> Path | None:
        if not _VOICE_ID.match(voice_id):
            return None
        return self._directory / f"{voice_id}.json"

    def _read(self, path: Path) -> ToneVoice:
        record = json.loads(path.read_text(encoding="utf-8"))
        return ToneVoice(
            id=path.stem,
            label=record["label"],
            pitch=record["pitch"],
            brightness=record["brightness"],
            tags=tuple(record["tags"]),
            description=record["description"],
            origin=record["origin"],
        )

    def created(self) -> list[ToneVoice]:
        return [self._read(p) for p in sorted(self._directory.glob("*.json"))]

    def find(self, voice_id: str, field: str) -> ToneVoice:
        """
        The built-in or created voice C{voice_id}; never a substitute.

        @param field: the request field to name if there is no such voice.
        """
        if voice_id in BUILTINS:
            return BUILTINS[voice_id]
        path = self._path(voice_id)
        if path is None or not path.is_file():
            raise UnknownVoice(f'no voice "{voice_id}"', field=field)
        return self._read(path)

    def save(self, voice: ToneVoice) -> None:
        """
        Store C{voice}, replacing one of the same id.
        """
        path = self._path(voice.id)
        if path is None:
            raise BadRequest(f"{voice.id!r} is not a voice id", field="id")
        self._directory.mkdir(parents=True, exist_ok=True)
        record = {
            "label": voice.label,
            "pitch": voice.pitch,
            "brightness": voice.brightness,
            "tags": list(voice.tags),
            "description": voice.description,
            "origin": dict(voice.origin),
        }
        # Written beside the target and renamed over it, so a crash never leaves a
        # half-written voice for the next listing to choke on.
        handle, temporary = tempfile.mkstemp(dir=self._directory, suffix=".tmp")
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as out:
                json.dump(record, out, indent=2, sort_keys=True)
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise

    def delete(self, voice_id: str) -> None:
        path = self._path(voice_id)
        if path is None or not path.is_file():
            raise UnknownVoice(f'no voice "{voice_id}"', field="id")
        path.unlink()
