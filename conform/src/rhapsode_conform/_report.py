"""
The checker's results: one per rule, pass, FAIL or cannot be decided, and the report of
a run; and the exceptions a probe ends with, each turned into its result here.
"""

from __future__ import annotations

import enum
import http.client
from dataclasses import dataclass, field
from typing import Any, Callable


class Outcome(enum.Enum):
    PASS = "pass"
    FAIL = "FAIL"
    UNDECIDED = "cannot be decided"


@dataclass(frozen=True)
class Result:
    """
    The outcome of one rule; C{why} says what went wrong, or why it could not be decided.
    """

    name: str
    outcome: Outcome
    why: str = ""

    def line(self) -> str:
        if self.outcome is Outcome.PASS:
            return f"pass  {self.name}"
        if self.outcome is Outcome.FAIL:
            return f"FAIL  {self.name}: {self.why}"
        return f"cannot be decided {self.name}: {self.why}"


@dataclass
class Report:
    """
    Every result of a run, in order, and what could not be put back afterwards.
    """

    results: list[Result] = field(default_factory=list)
    cleanup_problems: list[str] = field(default_factory=list)

    def count(self, outcome: Outcome) -> int:
        return sum(1 for r in self.results if r.outcome is outcome)

    @property
    def exit_code(self) -> int:
        return 1 if self.count(Outcome.FAIL) else 0

    def summary(self) -> str:
        return (
            f"conformance: {self.count(Outcome.PASS)} pass, {self.count(Outcome.FAIL)} fail, "
            f"{self.count(Outcome.UNDECIDED)} cannot be decided"
        )

    def render(self) -> str:
        return "\n".join([*(r.line() for r in self.results), self.summary()]) + "\n"


class Failed(Exception):
    """The worker broke the rule a probe tests; the message says how."""


class Undecidable(Exception):
    """The rule cannot be tested against this worker; the message says why."""


class TimedOut(Exception):
    """A probe ran past its deadline."""


class Unreachable(Exception):
    """Nothing answered HTTP at the target."""


def outcome_of(name: str, test: Callable[[], Any]) -> Result:
    """Run C{test}; its ending, returned or raised, is the result named C{name}."""
    try:
        test()
    except Exception as exc:  # a worker can answer anything; the run must go on
        return result_of(name, exc)
    return Result(name, Outcome.PASS)


def result_of(name: str, exc: Exception) -> Result:
    """The result of a test that raised C{exc}."""
    if isinstance(exc, Undecidable):
        return Result(name, Outcome.UNDECIDED, str(exc))
    if isinstance(exc, (Failed, TimedOut)):
        return Result(name, Outcome.FAIL, str(exc))
    if isinstance(exc, (OSError, http.client.HTTPException)):
        return Result(name, Outcome.FAIL, f"the exchange failed: {type(exc).__name__}: {exc}")
    return Result(name, Outcome.FAIL, f"unexpected answer ({type(exc).__name__}: {exc})")
