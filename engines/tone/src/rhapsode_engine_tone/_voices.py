"""
The tone engine's voices: four built-ins and a store of created ones.

A voice here is two numbers, a base pitch and a brightness (how strong its upper
harmonics are).  Created voices are records in the SDK's L{VoiceStore}, in the voice
folder the worker's context names: one JSON file per voice, written whole or not at all.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from rhapsode_worker import Voice, VoiceStore


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


class ToneVoices:
    """
    The created voices, each a record in the SDK's store: the numbers, label, tags,
    description and origin of a L{ToneVoice}.
    """

    def __init__(self, directory: Path) -> None:
        self._store = VoiceStore(directory)

    @staticmethod
    def _voice(voice_id: str, record: Mapping[str, Any]) -> ToneVoice:
        return ToneVoice(
            id=voice_id,
            label=record["label"],
            pitch=record["pitch"],
            brightness=record["brightness"],
            tags=tuple(record["tags"]),
            description=record["description"],
            origin=record["origin"],
        )

    def created(self) -> list[ToneVoice]:
        return [self._voice(voice_id, record) for voice_id, record in self._store.records()]

    def find(self, voice_id: str, field: str) -> ToneVoice:
        """
        The built-in or created voice C{voice_id}; never a substitute.

        @param field: the request field to name if there is no such voice.
        """
        if voice_id in BUILTINS:
            return BUILTINS[voice_id]
        return self._voice(voice_id, self._store.record(voice_id, field))

    def save(self, voice: ToneVoice) -> None:
        """
        Store C{voice}, replacing one of the same id.
        """
        self._store.save(voice.id, {
            "label": voice.label,
            "pitch": voice.pitch,
            "brightness": voice.brightness,
            "tags": list(voice.tags),
            "description": voice.description,
            "origin": dict(voice.origin),
        })

    def delete(self, voice_id: str) -> None:
        self._store.delete(voice_id)
