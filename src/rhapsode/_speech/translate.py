"""
OpenAI's speech request as the native one (protocol.md section 11's table): what the
OpenAI shim, its batch and the WebSocket stream all speak through, so that a model name,
a voice object or a speed means the same whichever of them carried it.

A translation and nothing more: the body it makes is then checked and spoken exactly as a
C{/speak} body is.
"""

from __future__ import annotations

from typing import Any, Mapping

from rhapsode_protocol import contract
from rhapsode_protocol.errors import UnknownEngine, Unsupported
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

    def __init__(self, registry: Registry, speech: ISpeech) -> None:
        self._registry = registry
        self._speech = speech

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
        The C{/speak} body a checked OpenAI request becomes (section 11's table).

        Non-empty C{instructions} are passed on as the native field, which the preflight
        refuses (unsupported) for a variant that declares none; OpenAI's empty string is
        its default, nothing asked.

        @raise Unsupported: aac, or a speed other than 1 on a variant with no speed dial.
        """
        engine_id, variant = self.resolve_model(body["model"])
        fmt = body.get("response_format", "mp3")
        if fmt == "aac":
            raise Unsupported('response_format "aac" is not produced by any engine here', field="response_format")
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
            await self._check_speed(self._registry.get(engine_id), variant)
            native["params"] = {"speed": speed}
        contract.validate(contract.PUBLIC_SPEAK_REQUEST, native)
        return native

    async def _check_speed(self, engine: EngineHandle, variant: str | None) -> None:
        caps = await engine.capabilities()
        effective = engine.effective_variant(variant, self._speech.resident(engine.id))
        performs = caps.get("variants", {}).get(effective)
        if performs is not None and "speed" not in performs.get("dials", {}):
            raise Unsupported(f'variant "{effective}" of "{engine.id}" has no speed dial', field="speed")

    def effective(self, engine: EngineHandle, variant: str | None) -> str:
        """
        The variant a request for C{engine} naming C{variant} (or none) speaks in.
        """
        return engine.effective_variant(variant, self._speech.resident(engine.id))
