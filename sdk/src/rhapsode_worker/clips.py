"""
Cloned voices kept as their reference clips (protocol.md section 7), for engines that
condition on audio at speak time: Chatterbox and Dia read the clip, the model is not
touched when the voice is made.

A voice is two files in the directory the SDK gives the adapter: C{<id>.f32}, the clip
decoded once (L{rhapsode_worker.audioref}) to mono float32 at the engine's rate, and
C{<id>.json}, its label, transcript, rate and digest.  The record is written last and
deleted first, so a voice is listed only once both are whole.  The spec token is minted
from the clip's digest and transcript: re-recording a voice changes it.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rhapsode_protocol.errors import UnknownVoice, Unsupported

from ._engine import Voice
from .audioref import Clip

__all__ = ["ClipStore", "StoredClip"]


@dataclass(frozen=True)
class StoredClip:
    """
    A cloned voice as stored: its samples and what was said in them.
    """

    voice: Voice
    path: Path
    rate: int
    transcript: str | None

    def samples(self) -> "array[float]":
        samples = array("f")
        samples.frombytes(self.path.read_bytes())
        return samples


def _write(path: Path, data: bytes) -> None:
    handle = tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".partial",
                                         delete=False)
    try:
        with handle:
            handle.write(data)
        os.replace(handle.name, path)
    except BaseException:
        Path(handle.name).unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class ClipStore:
    """
    The clips of the voices made on this box; C{reserved} are ids of built-in voices.
    """

    directory: Path
    reserved: frozenset[str] = frozenset()

    def save(self, voice_id: str, label: str, clip: Clip, filename: str, transcript: str | None) -> Voice:
        if voice_id in self.reserved:
            raise Unsupported(f'"{voice_id}" is a built-in voice', field="id")
        self.directory.mkdir(parents=True, exist_ok=True)
        data = clip.f32le()
        digest = hashlib.sha256(data)
        digest.update((transcript or "").encode())
        _write(self.directory / f"{voice_id}.f32", data)
        record = {"label": label, "filename": filename, "rate": clip.rate, "transcript": transcript,
                  "seconds": round(clip.seconds, 3), "sha256": digest.hexdigest()}
        _write(self.directory / f"{voice_id}.json", json.dumps(record).encode())
        return self._listing(voice_id, record)

    def created(self) -> list[Voice]:
        if not self.directory.is_dir():
            return []
        voices = []
        for record in sorted(self.directory.glob("*.json")):
            if (self.directory / f"{record.stem}.f32").exists():
                try:
                    voices.append(self._listing(record.stem, json.loads(record.read_text())))
                except (ValueError, KeyError):
                    continue  # a record damaged by hand is not a voice
        return voices

    def get(self, voice_id: str) -> StoredClip:
        """
        @raise UnknownVoice: naming C{voice}, where there is no such created voice.
        """
        record_path = self.directory / f"{voice_id}.json"
        path = self.directory / f"{voice_id}.f32"
        try:
            record = json.loads(record_path.read_text())
        except (OSError, ValueError):
            raise UnknownVoice(f'no voice "{voice_id}"', field="voice") from None
        if voice_id in self.reserved or not path.exists():
            raise UnknownVoice(f'no voice "{voice_id}"', field="voice")
        return StoredClip(self._listing(voice_id, record), path, int(record["rate"]), record.get("transcript"))

    def delete(self, voice_id: str) -> None:
        if voice_id in self.reserved:
            raise Unsupported(f'"{voice_id}" is a built-in voice', field="id")
        if not (self.directory / f"{voice_id}.json").exists():
            raise UnknownVoice(f'no voice "{voice_id}"', field="id")
        (self.directory / f"{voice_id}.json").unlink(missing_ok=True)
        (self.directory / f"{voice_id}.f32").unlink(missing_ok=True)

    @staticmethod
    def _listing(voice_id: str, record: dict[str, Any]) -> Voice:
        return Voice(
            id=voice_id,
            label=record["label"],
            spec=f"{voice_id}@{record['sha256'][:16]}",
            description=f"Cloned from {record['filename']} ({record['seconds']:g} s)",
            tags=("cloned",),
            builtin=False,
        )
