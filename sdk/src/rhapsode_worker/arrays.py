"""
For adapters whose voices are arrays of floats (a Kokoro voicepack): an uploaded .npy or
.pt file read as data, never unpickled (L{rhapsode_worker._arrays}).

Pure standard library: no numpy, no torch.
"""

from ._arrays import FloatArray, read_npy, read_pt, read_voicepack

__all__ = ["FloatArray", "read_npy", "read_pt", "read_voicepack"]
