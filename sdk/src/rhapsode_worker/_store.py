"""
L{VoiceStore}: the voices an engine made, kept in the folder its L{WorkerContext} names.

A voice is a JSON record, C{<id>.json}, and for an engine that keeps one, a blob beside it
(C{<id>.npy}, say: a style array, an embedding).  Each file is written to a hidden
temporary name in the same folder, flushed to disk and renamed over its target, the blob
before the record and the record first to go on delete, so a voice that is listed always
has its blob and a crash never leaves half a voice for the next listing to choke on.

Ids are checked against the protocol's voice id rule here too (the SDK checks them before
an adapter sees one): it is what keeps a path out of the folder whoever calls.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping

from rhapsode_protocol.errors import BadRequest, UnknownVoice
from rhapsode_protocol.validation import check_voice_id

_RECORD = ".json"


def _is_voice_id(voice_id: str) -> bool:
    try:
        check_voice_id(voice_id)
    except BadRequest:
        return False
    return True


class VoiceStore:
    """
    The created voices in one folder: a record each, and a blob each when C{blob} names
    the blob's suffix.  Blocking (file work): call it from the adapter's methods, which
    the SDK runs off the reactor thread.

    @param directory: the folder, usually C{self.context.voice_dir}; made on the first
        save.
    @param blob: the suffix of each voice's blob, e.g. C{".npy"}; None for an engine
        whose record is the whole voice.
    """

    def __init__(self, directory: Path, blob: str | None = None) -> None:
        if blob is not None and (not blob.startswith(".") or blob == _RECORD or "/" in blob):
            raise ValueError(f"a blob suffix is a file extension other than {_RECORD}, not {blob!r}")
        self.directory = directory
        self._blob = blob

    def _path(self, voice_id: str, suffix: str) -> Path:
        return self.directory / f"{voice_id}{suffix}"

    def _complete(self, voice_id: str) -> bool:
        if not _is_voice_id(voice_id) or not self._path(voice_id, _RECORD).is_file():
            return False
        return self._blob is None or self._path(voice_id, self._blob).is_file()

    def __contains__(self, voice_id: object) -> bool:
        return isinstance(voice_id, str) and self._complete(voice_id)

    def ids(self) -> list[str]:
        """
        Every stored voice's id, in the order of their records' file names.
        """
        if not self.directory.is_dir():
            return []
        return [p.stem for p in sorted(self.directory.glob(f"*{_RECORD}")) if self._complete(p.stem)]

    def records(self) -> list[tuple[str, dict[str, Any]]]:
        """
        Every stored voice as C{(id, record)}, in L{ids} order.
        """
        return [(voice_id, self._read(voice_id)) for voice_id in self.ids()]

    def record(self, voice_id: str, field: str = "voice") -> dict[str, Any]:
        """
        The record of the stored voice C{voice_id}.

        @param field: the request field to name if there is no such voice.
        @raise UnknownVoice: naming C{field}, when no complete voice has that id.
        """
        self._known(voice_id, field)
        return self._read(voice_id)

    def blob_path(self, voice_id: str, field: str = "voice") -> Path:
        """
        Where the stored voice C{voice_id} keeps its blob, for a library that opens it.

        @raise UnknownVoice: naming C{field}, when no complete voice has that id.
        """
        if self._blob is None:
            raise TypeError("this store keeps no blobs")
        self._known(voice_id, field)
        return self._path(voice_id, self._blob)

    def blob(self, voice_id: str, field: str = "voice") -> bytes:
        """
        The stored voice C{voice_id}'s blob, as it was saved.

        @raise UnknownVoice: naming C{field}, when no complete voice has that id.
        """
        return self.blob_path(voice_id, field).read_bytes()

    def save(self, voice_id: str, record: Mapping[str, Any], blob: bytes | None = None) -> None:
        """
        Store a voice, replacing one of the same id: its blob first (when the store keeps
        blobs, and then C{blob} is required), then its record.

        @raise BadRequest: naming C{id}, for an id outside the protocol's rule.
        """
        check_voice_id(voice_id, "id")
        if (blob is None) != (self._blob is None):
            raise TypeError("a voice has a blob exactly when its store keeps blobs")
        self.directory.mkdir(parents=True, exist_ok=True)
        if blob is not None and self._blob is not None:
            self._write(self._path(voice_id, self._blob), blob)
        encoded = json.dumps(dict(record), indent=2, sort_keys=True).encode("utf-8")
        self._write(self._path(voice_id, _RECORD), encoded)

    def delete(self, voice_id: str, field: str = "id") -> None:
        """
        Remove a stored voice: its record first, so it is no longer listed, then its blob.

        @raise UnknownVoice: naming C{field}, when no voice has that id.
        """
        self._known(voice_id, field)
        self._path(voice_id, _RECORD).unlink(missing_ok=True)
        if self._blob is not None:
            self._path(voice_id, self._blob).unlink(missing_ok=True)

    def _known(self, voice_id: str, field: str) -> None:
        if not self._complete(voice_id):
            raise UnknownVoice(f'no voice "{voice_id}"', field=field)

    def _read(self, voice_id: str) -> dict[str, Any]:
        record = json.loads(self._path(voice_id, _RECORD).read_text(encoding="utf-8"))
        if not isinstance(record, dict):
            raise ValueError(f"{self._path(voice_id, _RECORD)} holds no record")
        return record

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
        try:
            with os.fdopen(handle, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
