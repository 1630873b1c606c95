"""
Rhapsode's Chatterbox engine: Resemble AI's Chatterbox through chatterbox-tts on torch.
"""

from ._engine import ChatterboxEngine

__all__ = ["ChatterboxEngine"]
