"""
Rhapsode's Piper engine: the en_US joe voice, synthesised by Piper through onnxruntime.
"""

from ._engine import PiperEngine

__all__ = ["PiperEngine"]
