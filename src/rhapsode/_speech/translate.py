"""
OpenAI's speech request as the native one (protocol.md section 11's table): what the
OpenAI shim, its batch and the WebSocket stream all speak through, so that a model name,
a voice object or a speed means the same whichever of them carried it.

A translation and nothing more: the body it makes is then checked and spoken exactly as a
C{/speak} body is.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from rhapsode_protocol import contract
from rhapsode_protocol.errors import UnknownEngine
from rhapsode_protocol.schemas import OPENAI_VOICE_OBJECT

from .._fleet.registry import EngineHandle, Registry
from .._interfaces import ISpeech

__all__ = ["OpenAITranslation"]


def _voice(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, dict):
        contract.validate(OPENAI_VOICE_OBJECT, value, path="voice")
        return str(value["id"])
    return str(value)


class OpenAITranslation:
    """
    OpenAI's request fields as a C{/speak} body, over the registry the models name.
    """

    def __init__(
        self, registry: Registry, speech: ISpeech, rates: Callable[[str], int | None] | None = None
    ) -> None:
        """
        @param rates: the sample rate the shim asks an engine for when a request names
            none (the operator's C{engines.<id>.openaiSampleRate}, read live), by engine.
        """
        self._registry = registry
        self._speech = speech
        self._rates = rates

    def resolve_model(self, model: str) -> tuple[str, str | None]:
        """
        The engine and variant C{model} names: an exact engine id first, so an id with a
        colon in it is still reachable, then C{engine:variant}, the longest engine id
        that leaves a variant first.

        @raise UnknownEngine: naming the engines there are (C{param} is C{model}).
        """
        registry = self._registry
        if model in registry:
            return model, None
        at = model.rfind(":")
        while at > 0:
            # The longest engine id first, as the exact id is tried first.
            if model[:at] in registry:
                return model[:at], model[at + 1 :]
            at = model.rfind(":", 0, at)
        known = ", ".join(handle.id for handle in registry) or "none"
        raise UnknownEngine(f'no engine "{model}" (engines: {known})', field="model")

    async def native(self, body: Mapping[str, Any], *, stream: bool) -> dict[str, Any]:
        """
        The C{/speak} body a checked OpenAI request becomes (section 11's table, and the
        additions docs/openai.md lists: a speed any variant that names its rate dial
        takes, and a C{sample_rate}, by default the operator's for the engine).

        Non-empty C{instructions} are passed on as the native field, which the preflight
        refuses (unsupported) for a variant that declares none; OpenAI's empty string is
        its default, nothing asked.
        """
        engine_id, variant = self.resolve_model(body["model"])
        fmt = body.get("response_format", "mp3")
        native: dict[str, Any] = {"engine": engine_id, "text": body["input"], "format": fmt, "stream": stream}
        if body.get("instructions"):
            native["instructions"] = body["instructions"]
        if variant is not None:
            native["variant"] = variant
        voice = _voice(body.get("voice"))
        if voice is not None:
            native["voice"] = voice
        speed = body.get("speed")
        if speed is not None and speed != 1:
            # Mapped onto the variant's rate dial by preflight, as /speak's speed is.
            native["speed"] = speed
        rate = body.get("sample_rate")
        if rate is None:
            # The operator's rate for the engine, where the format can carry it (an mp3
            # default of 24 kHz says nothing about an opus request).
            rate = self._default_rate(engine_id)
            if rate is not None and rate not in contract.FORMAT_RATES.get(fmt, (rate,)):
                rate = None
        if rate is not None:
            native["sampleRate"] = rate
        contract.validate(contract.PUBLIC_SPEAK_REQUEST, native)
        return native

    def _default_rate(self, engine_id: str) -> int | None:
        return self._rates(engine_id) if self._rates is not None else None

    def effective(self, engine: EngineHandle, variant: str | None) -> str:
        """
        The variant a request for C{engine} naming C{variant} (or none) speaks in.
        """
        return engine.effective_variant(variant, self._speech.resident(engine.id))
