"""
What one variant is: its server's model, read from the server where it says and from the
catalog's table of known models (catalog.json's C{models}) where it does not, with the
operator's configuration over both; and, where neither says, from a probe.

Facts are never guessed.  A model the table does not know speaks the one language it is
told to ("mul": whatever the text is in), takes no instructions and clones nothing unless
the configuration says so, and its weights' licence is NOASSERTION, not for commercial
use, unless the configuration names one.  Its sample rate is read from the WAV header of
a short probe, because PCM says nothing about its own rate.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Mapping

from twisted.logger import Logger

from ._client import NotJSON, Server, ServerError, Unreachable, read_capped
from ._config import RemoteConfigError, ServerConfig

log = Logger(namespace="rhapsode_engine_remote")

#: What a probe speaks, where the rate can be had no other way.
PROBE_TEXT = "Hello."


def catalog() -> dict[str, Any]:
    """This package's catalog record, with its table of known models."""
    record: dict[str, Any] = json.loads((resources.files(__package__) / "catalog.json").read_text(encoding="utf-8"))
    return record


@dataclass
class Described:
    """
    One variant as this adapter speaks to it.

    @ivar languages: BCP 47 tag to the name the server takes (None: send no language).
    @ivar cloning: C{upload} (the server's voices API, falling back to the reference per
        request), C{reference} (ref_audio and ref_text per request) or C{none}.
    @ivar cues: the vocabulary's cues the model performs, each as the text it reads.
    @ivar presets: whether the server's voices list is this variant's voices.
    """

    name: str
    server: Server
    config: ServerConfig
    api: str
    model: str | None
    facts: Mapping[str, Any]
    sample_rate: int
    languages: dict[str, str | None]
    instructions: str | None
    cloning: str
    speed: bool
    cues: Mapping[str, str] = field(default_factory=dict)
    presets: bool = True
    default_voice: str | None = None
    catalogued: bool = False
    #: Why the server could not be asked at the start, if it could not.
    unreachable: str | None = None

    @property
    def task(self) -> str | None:
        task = self.facts.get("task")
        return task if isinstance(task, str) else None

    def license(self) -> dict[str, Any]:
        """
        This variant's weights licence: the configuration's, else the table's, else none
        asserted (and then not for commercial use).
        """
        told = self.config.license or self.facts.get("license")
        if isinstance(told, Mapping):
            return {"weights": told["weights"], "weightsCommercialUse": told["weightsCommercialUse"],
                    "notes": str(told.get("notes", ""))}
        model = self.model or "the model"
        return {"weights": "NOASSERTION", "weightsCommercialUse": False,
                "notes": f"{model} is not in this adapter's table and the configuration names no licence: "
                         "none is asserted, so commercial use is not claimed."}


def _models_of(server: Server, config: ServerConfig) -> list[str] | None:
    """What /v1/models lists, or None where the server has no such route."""
    try:
        listed = server.json("GET", "/v1/models", fresh=True)
    except NotJSON:
        return None
    except ServerError as error:
        if error.status in (404, 405):
            return None
        raise
    data = listed.get("data") if isinstance(listed, dict) else None
    if not isinstance(data, list):
        return None
    return [str(entry["id"]) for entry in data if isinstance(entry, dict) and "id" in entry]


def _voices_api(server: Server) -> dict[str, Any] | None:
    """
    GET /v1/audio/voices, or None where the server has no such route (or answers it with
    anything but a voices document: it is not the API's).
    """
    try:
        listed = server.json("GET", "/v1/audio/voices", fresh=True)
    except ServerError:
        return None
    return listed if isinstance(listed, dict) and isinstance(listed.get("voices"), list) else None


def _wav_rate(head: bytes) -> int:
    if len(head) < 28 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        raise RemoteConfigError("the probe's answer is not a WAV")
    at = 12
    while at + 8 <= len(head):
        chunk, size = head[at:at + 4], struct.unpack("<I", head[at + 4:at + 8])[0]
        if chunk == b"fmt " and at + 16 <= len(head):
            channels, rate, _, _, bits = struct.unpack("<HIIHH", head[at + 10:at + 24])
            if channels != 1 or bits != 16:
                raise RemoteConfigError(f"the server speaks {channels} channel(s) of {bits}-bit PCM; mono 16-bit is read")
            return int(rate)
        at += 8 + size
    raise RemoteConfigError("the probe's WAV has no fmt chunk")


def _probe_rate(server: Server, model: str | None, voice: str | None) -> int:
    document: dict[str, Any] = {"input": PROBE_TEXT, "response_format": "wav"}
    if model:
        document["model"] = model
    if voice:
        document["voice"] = voice
    body = json.dumps(document).encode()
    with server.exchange("POST", "/v1/audio/speech", body, {"Content-Type": "application/json"}) as response:
        head = read_capped(response, 4096)
        if response.status != 200:
            raise RemoteConfigError(f"{server.origin} answered the probe with {response.status}")
    return _wav_rate(head)


def describe(name: str, config: ServerConfig, record: Mapping[str, Any]) -> Described:
    """
    Variant C{name} of the configuration, its facts gathered (blocking: before the
    worker binds).

    @raise RemoteConfigError: what cannot be known is needed (the server is down and
        neither the table nor the configuration says its model and rate), or the server
        serves several models and none is named.
    """
    server = Server(config)
    where = f"variant {name} ({server.origin})"
    model = config.model
    voices: dict[str, Any] | None = None
    reachable = True
    why: str | None = None
    try:
        listed = _models_of(server, config)
        if listed is not None:
            if model is None:
                if len(listed) != 1:
                    raise RemoteConfigError(
                        f"{where} serves {len(listed)} models ({', '.join(listed[:8])}): name one as model"
                    )
                model = listed[0]
            elif model not in listed:
                log.warn("{where}: /v1/models does not list {model} ({listed})", where=where, model=model,
                         listed=", ".join(listed[:8]))
    except (Unreachable, ServerError) as error:
        reachable = False
        why = str(error)
        log.warn("{where} cannot be asked about itself now: {error}", where=where, error=str(error))
    if reachable:
        try:
            voices = _voices_api(server)
        except Unreachable:
            voices = None
    facts: Mapping[str, Any] = record.get("models", {}).get(model or "", {})
    vllm = bool(facts) or (isinstance(voices, dict) and "uploaded_voices" in voices)
    api = config.api or ("vllm-omni" if vllm else "openai")
    sets: Mapping[str, Any] = record.get("languageSets", {})
    if config.languages is not None:
        if api == "openai" and len(config.languages) > 1:
            raise RemoteConfigError(
                f"{where}: OpenAI's request has no language field, so a choice among "
                f"{', '.join(config.languages)} would never reach the server: list one language"
            )
        named = sets.get(str(facts.get("languages")), {})
        # Sent as the family names it, else as written; never sent to an OpenAI server.
        languages = {tag: None if api == "openai" else named.get(tag, tag) for tag in config.languages}
    elif facts.get("languages") in sets:
        languages = dict(sets[facts["languages"]])
    else:
        languages = {"mul": None}
    default_voice = facts.get("voice") if isinstance(facts.get("voice"), str) else None
    rate = config.sample_rate or facts.get("sampleRate")
    if rate is None:
        if not reachable:
            raise RemoteConfigError(
                f"{where} does not answer, and its sample rate is known neither from the catalog nor the "
                "configuration: give sampleRate, or start the server first"
            )
        preset = (config.voices or (None,))[0] if voices is None else None
        try:
            rate = _probe_rate(server, model, preset or default_voice)
        except (Unreachable, ServerError) as error:
            raise RemoteConfigError(f"{where}: probing its sample rate failed: {error}") from None
        log.info("{where} speaks at {rate} Hz (read from a probe's WAV header)", where=where, rate=rate)
    cloning = config.cloning or str(facts.get("cloning", "none"))
    if cloning == "upload" and voices is not None and "uploaded_voices" not in voices:
        cloning = "reference"
    cues = facts.get("cues") if isinstance(facts.get("cues"), dict) else {}
    return Described(
        name=name,
        server=server,
        config=config,
        api=api,
        model=model,
        facts=facts,
        sample_rate=int(rate),
        languages=languages,
        instructions=config.instructions or facts.get("instructions"),
        cloning=cloning,
        speed=bool(config.speed if config.speed is not None else facts.get("speed", False)),
        cues=dict(cues or {}),
        presets=bool(facts.get("presets", True)),
        default_voice=default_voice,
        catalogued=bool(facts),
        unreachable=why,
    )
