"""
The conformance checker for Rhapsode workers: the worker rules of protocol.md sections
1 to 9, run against a worker over its socket with a blocking standard-library client,
one result per rule.  C{python -m rhapsode_conform TARGET} or C{rhapsode-conform TARGET}.

It depends on the protocol alone, never on the SDK it checks: an independent
implementation of the client side of the contract.
"""

from ._checks import CHECKS
from ._report import Outcome, Report, Result, Unreachable
from ._run import DEFAULT_TIMEOUT, run_checks

__all__ = ["CHECKS", "DEFAULT_TIMEOUT", "Outcome", "Report", "Result", "Unreachable", "run_checks"]
