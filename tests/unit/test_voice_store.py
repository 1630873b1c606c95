"""
The SDK's voice store (rhapsode_worker.VoiceStore): a record per voice and, where the
engine keeps one, a blob beside it, each written whole or not at all, the blob first;
ids outside the protocol's rule never become paths.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rhapsode_protocol.errors import BadRequest, UnknownVoice
from rhapsode_worker import VoiceStore, _store


def test_records_alone_are_saved_listed_replaced_and_deleted(tmp_path: Path) -> None:
    """
    A store of records makes its folder on the first save, lists voices in file-name
    order with their records, replaces a voice saved again, and forgets a deleted one.
    """
    store = VoiceStore(tmp_path / "voices")
    assert store.ids() == [] and store.records() == []
    store.save("b-voice", {"label": "B", "pitch": 110.0})
    store.save("a", {"label": "A"})
    store.save("a-b", {"label": "AB"})
    # File-name order: "a-b.json" sorts before "a.json".
    assert store.ids() == ["a-b", "a", "b-voice"]
    assert store.record("b-voice") == {"label": "B", "pitch": 110.0}
    store.save("b-voice", {"label": "B2"})
    assert dict(store.records())["b-voice"] == {"label": "B2"}
    assert "a" in store and "nobody" not in store and 3 not in store
    store.delete("a")
    assert store.ids() == ["a-b", "b-voice"]
    assert json.loads((tmp_path / "voices" / "b-voice.json").read_text()) == {"label": "B2"}


def test_a_blob_goes_beside_its_record_and_is_read_back(tmp_path: Path) -> None:
    """
    A store of blobs keeps each voice's bytes in <id><suffix>, gives them and their path
    back, and removes both on delete.
    """
    store = VoiceStore(tmp_path, blob=".npy")
    store.save("narrator", {"label": "Narrator"}, b"\x93NUMPY rest")
    assert store.blob("narrator") == b"\x93NUMPY rest"
    assert store.blob_path("narrator") == tmp_path / "narrator.npy"
    store.delete("narrator")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_voice_without_its_blob_or_record_is_not_a_voice(tmp_path: Path) -> None:
    """
    A blob whose record was never written (a save cut short), or a record whose blob is
    gone, is neither listed nor found.
    """
    store = VoiceStore(tmp_path, blob=".npy")
    (tmp_path / "orphan.npy").write_bytes(b"data")
    (tmp_path / "hollow.json").write_text("{}")
    assert store.ids() == []
    for voice_id in ("orphan", "hollow"):
        with pytest.raises(UnknownVoice):
            store.record(voice_id)
        with pytest.raises(UnknownVoice):
            store.blob(voice_id)


def test_the_blob_is_written_before_the_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """
    A save that fails writing the record leaves the new blob but no listed voice, and
    no temporary file: the record is what makes a voice, and it comes last.
    """
    store = VoiceStore(tmp_path, blob=".npy")
    written: list[str] = []
    real = _store.VoiceStore._write

    def failing_on_the_record(path: Path, data: bytes) -> None:
        written.append(path.name)
        if path.suffix == ".json":
            raise OSError("disk full")
        real(path, data)

    monkeypatch.setattr(_store.VoiceStore, "_write", staticmethod(failing_on_the_record))
    with pytest.raises(OSError, match="disk full"):
        store.save("late", {"label": "Late"}, b"blob")
    assert written == ["late.npy", "late.json"]
    assert store.ids() == [] and sorted(p.name for p in tmp_path.iterdir()) == ["late.npy"]


def test_an_interrupted_write_leaves_the_old_voice_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """
    A write cut short after its bytes went to the temporary file (the rename never
    happens) keeps the voice as it was, and the temporary file is removed.
    """
    store = VoiceStore(tmp_path)
    store.save("kept", {"label": "Old"})

    def no_rename(source: str, target: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(_store.os, "replace", no_rename)
    with pytest.raises(KeyboardInterrupt):
        store.save("kept", {"label": "New"})
    assert store.record("kept") == {"label": "Old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.json"]


@pytest.mark.parametrize("voice_id", ["../escape", "a/b", "*", "", "-lead", "x" * 65, ".hidden"])
def test_an_id_outside_the_rule_never_becomes_a_path(tmp_path: Path, voice_id: str) -> None:
    """
    Saving under an id the protocol refuses is a bad_request naming "id"; reading or
    deleting one is an unknown voice naming the field given; nothing is written.
    """
    folder = tmp_path / "voices"
    folder.mkdir()
    (tmp_path / "escape.json").write_text("{}")
    store = VoiceStore(folder)
    with pytest.raises(BadRequest) as refused:
        store.save(voice_id, {"label": "x"})
    assert refused.value.field == "id"
    with pytest.raises(UnknownVoice) as unknown:
        store.record(voice_id, field="voices.a")
    assert unknown.value.field == "voices.a"
    with pytest.raises(UnknownVoice) as unknown:
        store.delete(voice_id)
    assert unknown.value.field == "id"
    assert list(folder.iterdir()) == [] and voice_id not in store


def test_unknown_voices_name_the_field(tmp_path: Path) -> None:
    """
    A voice that is not stored is unknown_voice naming the field the caller gave
    (C{voice} by default for a read, C{id} for a delete).
    """
    store = VoiceStore(tmp_path, blob=".bin")
    with pytest.raises(UnknownVoice, match='no voice "ghost"') as raised:
        store.record("ghost")
    assert raised.value.field == "voice"
    with pytest.raises(UnknownVoice) as raised:
        store.blob_path("ghost", field="blend")
    assert raised.value.field == "blend"
    with pytest.raises(UnknownVoice) as raised:
        store.delete("ghost")
    assert raised.value.field == "id"


def test_a_blob_is_given_exactly_when_the_store_keeps_them(tmp_path: Path) -> None:
    """
    A store of blobs refuses a save without one, a store of records one with, and a
    blob suffix must be an extension other than the record's.
    """
    with pytest.raises(TypeError):
        VoiceStore(tmp_path, blob=".npy").save("a", {})
    with pytest.raises(TypeError):
        VoiceStore(tmp_path).save("a", {}, b"blob")
    with pytest.raises(TypeError):
        VoiceStore(tmp_path).blob_path("a")
    for suffix in ("npy", ".json", "./x"):
        with pytest.raises(ValueError):
            VoiceStore(tmp_path, blob=suffix)
    assert list(tmp_path.iterdir()) == []
