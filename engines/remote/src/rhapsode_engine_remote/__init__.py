"""
Speech servers somebody else runs, as a Rhapsode engine: vLLM-Omni (Qwen3-TTS, Fish Speech
S2 Pro, Voxtral TTS, CosyVoice3, ...) and any server that answers OpenAI's
C{POST /v1/audio/speech}, one model per variant.  docs/engines/vllm-omni.md says how.
"""

from ._config import RemoteConfigError
from ._engine import RemoteEngine

__all__ = ["RemoteConfigError", "RemoteEngine"]
