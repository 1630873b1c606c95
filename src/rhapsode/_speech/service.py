"""
The speech service (L{ISpeech}): one utterance from a checked body to the client,
whichever door it came in by (C{POST /speak}, dialogue, the OpenAI shim, the batch, MCP,
the WebSocket).

It resolves the effective variant from the variants it remembers (section 4's rule, never
from C{current}), runs every check that can refuse before a lease (L{preflight}, and the
voices a request names where finding out at the worker would first cost a load), then
hands the forwarded body to the relay, which speaks it into the door's sink; the request
is measured as one on its route.

A voice alias the operator set (C{voices.aliases}: C{alloy} is C{piper:joe}) is resolved
here, so every door honours it alike, and only on the engine it names: elsewhere the name
is refused as any unknown voice is.  An unknown voice is refused naming the voices and
aliases the engine has, whichever door asked and whether the core or the worker found it
out, so that a wrong pick in a client's list says what to pick instead.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from twisted.internet.defer import CancelledError
from zope.interface import implementer

from rhapsode_protocol import contract
from rhapsode_protocol.errors import SpeechError, UnknownVoice, Unsupported, as_speech_error

from .._fleet.registry import EngineHandle, Registry
from .._fleet.residency import Residency
from .._interfaces import IAudioSink, IClientSettings, ISpeech, Prepared, Utterance
from .metrics import Metrics
from .preflight import forward_dialogue, forward_speak, voices_to_check
from .relay import SpeechRelay, remote_server

__all__ = ["SpeechService", "aliases_of"]

#: The most voice ids an unknown voice's refusal lists: enough to pick from, never a
#: message the size of a catalogue.
_LISTED = 24


def aliases_of(clients: IClientSettings | None, engine_id: str) -> dict[str, str]:
    """
    The aliases that mean a voice of C{engine_id}: alias to voice id.
    """
    if clients is None:
        return {}
    return {name: voice for name, (engine, voice) in clients.voice_aliases().items() if engine == engine_id}


@implementer(ISpeech)
class SpeechService:
    """
    Speech over a registry of engines, their residency, the relay and the metrics.
    """

    def __init__(
        self,
        registry: Registry,
        residency: Residency,
        relay: SpeechRelay,
        metrics: Metrics,
        clients: IClientSettings | None = None,
    ) -> None:
        """
        @param clients: the operator's voice aliases, read each time one may apply.
        """
        self._registry = registry
        self._residency = residency
        self._relay = relay
        self._metrics = metrics
        self._clients = clients

    def _resolved(self, utterance: Utterance) -> Utterance:
        """
        The utterance with any voice alias of its engine replaced by the voice it means.
        """
        aliases = aliases_of(self._clients, utterance.engine_id)
        if not aliases:
            return utterance
        body = dict(utterance.body)
        if body.get("voice") in aliases:
            body["voice"] = aliases[body["voice"]]
        if isinstance(body.get("voices"), Mapping):
            body["voices"] = {label: aliases.get(v, v) for label, v in body["voices"].items()}
        return replace(utterance, body=body)

    async def _unknown_voice(self, engine: EngineHandle, refused: SpeechError, asked: Mapping[str, Any]) -> SpeechError:
        """
        An unknown voice's refusal, naming the voices the engine has and its aliases;
        C{refused} itself where the request named no voice or they cannot be read.
        """
        field = refused.field or "voice"
        name = asked.get("voice") if field == "voice" else None
        if name is None and field.startswith("voices."):
            name = (asked.get("voices") or {}).get(field[len("voices."):])
        if not isinstance(name, str):
            # The request named no voice here (a default the engine lacks, or a field
            # the worker named that the request did not send): the worker's own words.
            return refused
        try:
            client = await engine.ready()
            code, voices = await client.json(b"GET", "/voices")
        except Exception:
            return refused
        if code != 200 or not isinstance(voices, list):
            return refused
        ids = [v["id"] for v in voices if isinstance(v, dict) and isinstance(v.get("id"), str)]
        shown = ", ".join(ids[:_LISTED]) + (f" and {len(ids) - _LISTED} more" if len(ids) > _LISTED else "")
        message = f'no voice "{name}" on {engine.id} (its voices: {shown or "none"}'
        aliases = aliases_of(self._clients, engine.id)
        if aliases:
            message += "; aliases: " + ", ".join(f"{a} ({v})" for a, v in sorted(aliases.items())[:_LISTED])
        message += ")"
        elsewhere = self._clients.voice_aliases().get(name) if self._clients is not None else None
        if elsewhere is not None and elsewhere[0] != engine.id:
            message += f'; "{name}" is an alias of {elsewhere[0]}:{elsewhere[1]}, asked for with engine (model) "{elsewhere[0]}"'
        return UnknownVoice(message, field=field)

    def resident(self, engine_id: str) -> str | None:
        model = self._residency.state(engine_id)
        variant = model["variant"] if model["resident"] else None
        return variant

    async def prepare(self, utterance: Utterance) -> Prepared:
        utterance = self._resolved(utterance)
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
            try:
                prepared = await self.prepare(utterance)
                engine = self._registry.get(utterance.engine_id)
                path = "/dialogue" if utterance.dialogue else "/speak"
                await self._relay.dispatch(
                    sink, engine, path, prepared.forwarded, prepared.capabilities,
                    utterance.body.get("keepAliveSeconds"), measured,
                )
            except UnknownVoice as refused:
                if sink.started:
                    raise
                raise await self._unknown_voice(self._registry.get(utterance.engine_id), refused, utterance.body)
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
