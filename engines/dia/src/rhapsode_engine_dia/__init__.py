"""
Rhapsode's Dia engine: Nari Labs' Dia-1.6B through transformers, dialogue in one take.
"""

from ._engine import DiaEngine

__all__ = ["DiaEngine"]
