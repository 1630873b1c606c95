"""
Rhapsode's eSpeak NG engine: libespeak-ng, as the espeakng-loader wheel ships it, driven
through ctypes.
"""

from ._engine import EspeakEngine

__all__ = ["EspeakEngine"]
