"""
What the core and its workers agree on, and nothing either side does alone: the error
taxonomy (L{errors}), the vocabulary of cues and deliveries (L{vocab}), the text rules
both cut by (L{text}), the contract's shapes (L{schemas}), their checks
(L{validation}) and documents (L{openapi}, L{contract}), the spawn contract's names
(L{spawn}), and the HTTP server both processes listen with (L{http}).

It imports neither side: the core (C{rhapsode}) and the worker SDK (C{rhapsode_worker})
both depend on it, released together at one version.
"""

#: The version of the release this contract belongs to: every distribution of the
#: repository carries it, and an engine's worker pins the SDK to it exactly.
__version__ = "0.1.0"

__all__ = ["__version__"]
