"""
Rhapsode, the core: a router, a registry, a supervisor and a residency manager.

It holds no engine knowledge and never imports torch, onnxruntime or numpy.
The worker SDK lives beside it in L{rhapsode_worker}.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
