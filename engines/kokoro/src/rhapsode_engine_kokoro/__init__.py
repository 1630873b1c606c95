"""
Rhapsode's Kokoro engine: Kokoro-82M, int8 ONNX, through kokoro-onnx and espeak-ng.
"""

from ._engine import KokoroEngine

__all__ = ["KokoroEngine"]
