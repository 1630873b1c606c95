"""
The speech service (L{ISpeech}): one utterance from a checked body to the client,
whichever door it came in by (C{POST /speak}, dialogue, the OpenAI shim, the batch, MCP,
the WebSocket).

It resolves the effective variant from the variants it remembers (section 4's rule, never
from C{current}), runs every check that can refuse before a lease (L{preflight}, and the
voices a request names where finding out at the worker would first cost a load), then
hands the forwarded body to the relay, which speaks it into the door's sink; the request
is measured as one on its route.
"""

from __future__ import annotations

from typing import Any, Mapping

from twisted.internet.defer import CancelledError
from zope.interface import implementer

from rhapsode_protocol import contract
from rhapsode_protocol.errors import UnknownVoice, Unsupported, as_speech_error

from .._fleet.registry import EngineHandle, Registry
from .._fleet.residency import Residency
from .._interfaces import IAudioSink, ISpeech, Prepared, Utterance
from .metrics import Metrics
from .preflight import forward_dialogue, forward_speak, voices_to_check
from .relay import SpeechRelay, remote_server

__all__ = ["SpeechService"]


@implementer(ISpeech)
class SpeechService:
    """
    Speech over a registry of engines, their residency, the relay and the metrics.
    """

    def __init__(self, registry: Registry, residency: Residency, relay: SpeechRelay, metrics: Metrics) -> None:
        self._registry = registry
        self._residency = residency
        self._relay = relay
        self._metrics = metrics

    def resident(self, engine_id: str) -> str | None:
        model = self._residency.state(engine_id)
        variant = model["variant"] if model["resident"] else None
        return variant

    async def prepare(self, utterance: Utterance) -> Prepared:
        engine = self._registry.get(utterance.engine_id)
        caps = await engine.capabilities()
        body = utterance.body
        variant = engine.effective_variant(body.get("variant"), self.resident(engine.id))
        forward = forward_dialogue if utterance.dialogue else forward_speak
        forwarded = forward(body, caps, variant)
        engine.check_reachable(forwarded["variant"])
        await self._check_voices(engine, forwarded, caps)
        return Prepared(utterance, caps, variant, forwarded)

    async def speak(self, sink: IAudioSink, utterance: Utterance) -> None:
        measured = self._metrics.begin(utterance.route, utterance.engine_id)
        try:
            prepared = await self.prepare(utterance)
            engine = self._registry.get(utterance.engine_id)
            path = "/dialogue" if utterance.dialogue else "/speak"
            await self._relay.dispatch(
                sink, engine, path, prepared.forwarded, prepared.capabilities,
                utterance.body.get("keepAliveSeconds"), measured,
            )
        except CancelledError:
            measured.end("cancelled")
            raise
        except Exception as exc:
            measured.end(as_speech_error(exc).code)
            raise
        measured.end("ok")

    async def forwarded(
        self, sink: IAudioSink, engine_id: str, body: Mapping[str, Any], dialogue: bool, keep_alive: int | None
    ) -> None:
        measured = self._metrics.begin("dialogue" if dialogue else "speak", engine_id)
        try:
            engine = self._registry.get(engine_id)
            contract.validate(contract.DIALOGUE_REQUEST if dialogue else contract.SPEAK_REQUEST, dict(body))
            caps = await engine.capabilities()
            forwarded = dict(body)
            forwarded.setdefault("variant", engine.effective_variant(None, self.resident(engine.id)))
            if forwarded["variant"] not in caps.get("variants", {}):
                known = ", ".join(sorted(caps.get("variants", {})))
                raise Unsupported(f'no variant "{forwarded["variant"]}" (variants: {known})', field="variant")
            await self._check_voices(engine, forwarded, caps)
            path = "/dialogue" if dialogue else "/speak"
            await self._relay.dispatch(sink, engine, path, forwarded, caps, keep_alive, measured)
        except CancelledError:
            measured.end("cancelled")
            raise
        except Exception as exc:
            measured.end(as_speech_error(exc).code)
            raise
        measured.end("ok")

    async def preview(self, sink: IAudioSink, engine_id: str, voice_id: str) -> None:
        contract.check_voice_id(voice_id, "voice")
        engine = self._registry.get(engine_id)
        caps = await engine.capabilities()
        variant = engine.effective_variant(None, self.resident(engine.id))
        engine.check_reachable(variant)
        # A preview speaks: an unknown voice is refused before it costs a load.
        await self._check_voices(engine, {"voice": voice_id, "variant": variant}, caps)
        await self._relay.preview(sink, engine, voice_id, caps, variant)

    async def _check_voices(self, engine: EngineHandle, forward: Mapping[str, Any], caps: Mapping[str, Any]) -> None:
        """
        Ask the worker whether the voices a request names exist, when finding out at
        the worker would first cost a load: a model that is already resident in the
        variant asked for loses nothing, and its worker refuses an unknown voice itself,
        as does one whose model is served elsewhere (its load costs nothing here).
        """
        wanted = voices_to_check(forward)
        model = self._residency.state(engine.id)
        if not wanted or engine.elsewhere or (model["resident"] and model["variant"] == forward["variant"]):
            # A cluster's node checks for itself, knowing what its card holds.
            return
        if remote_server(caps, forward["variant"]) is not None:
            return
        client = await engine.ready()
        code, voices = await client.json(b"GET", "/voices")
        if code != 200 or not isinstance(voices, list):
            return  # the worker will say, once it has its model
        known = {voice.get("id") for voice in voices if isinstance(voice, dict)}
        for field, voice_id in wanted.items():
            if voice_id not in known:
                raise UnknownVoice(f'no voice "{voice_id}"', field=field)
