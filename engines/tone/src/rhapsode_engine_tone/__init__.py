"""
Rhapsode's tone engine: arithmetic speech that performs the whole worker protocol.
"""

from ._engine import ToneEngine

__all__ = ["ToneEngine"]
