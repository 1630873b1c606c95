"""
rhapsode.testing under trial itself, as the programs it is for run it: the example of
docs/testing-your-program.md exactly as the page shows it, and what trial checks that
pytest does not (a global reactor left clean, errors left logged).

Run with C{python -m twisted.trial tests/trial/test_rhapsode_testing.py}; pytest collects
it too.
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

from twisted.internet.defer import Deferred
from twisted.trial.unittest import SynchronousTestCase, TestCase

from rhapsode.client import Internal, TruncatedResponse
from rhapsode.testing import FakeEngine, StubRhapsode

DOC = Path(__file__).resolve().parents[2] / "docs" / "testing-your-program.md"


def example(name: str) -> str:
    """
    The code block the page marks C{<!-- example: name -->}.
    """
    found = re.search(rf"<!-- example: {re.escape(name)} -->\n```python\n(.*?)```", DOC.read_text(), re.S)
    if found is None:
        raise LookupError(f"{DOC.name} has no example {name}")
    return found.group(1)


# The page's program, importable as its test imports it, and the page's test case,
# defined in this module for trial to find (AnnouncerTests).
_announcer = types.ModuleType("announcer")
_announcer.__file__ = f"{DOC}:announcer.py"
exec(compile(example("announcer.py"), _announcer.__file__, "exec"), _announcer.__dict__)
sys.modules["announcer"] = _announcer
exec(compile(example("test_announcer.py"), f"{DOC}:test_announcer.py", "exec"), globals())


class UnderTrialsReactor(TestCase):
    """
    A reactor-spinning trial test: its janitor fails the test if anything was left on
    the global reactor (a delayed call, a socket), which the stub never touches.
    """

    def test_a_stream_through_the_stub_leaves_the_global_reactor_clean(self) -> Deferred[None]:
        """
        A streamed request, answered and finished, returned as a Deferred for trial to
        wait on; the janitor then finds nothing left behind.
        """
        stub = StubRhapsode({"tone": FakeEngine(audio=b"\x00" * 1024)})
        self.addCleanup(stub.close)
        played: list[bytes] = []

        async def speak() -> None:
            size = await stub.client().speak_to(played.append, "tone", "Hello.")
            self.assertEqual((size, b"".join(played)), (1024, b"\x00" * 1024))

        return Deferred.fromCoroutine(speak())


class ErrorsUnderTrial(SynchronousTestCase):
    """
    What trial's log observer sees of failures the stub was told to make.
    """

    def test_a_cut_stream_is_truncated(self) -> None:
        """
        A worker that stops mid-stream reaches the program as TruncatedResponse, with
        the bytes that did arrive.
        """
        engine = FakeEngine(audio=[b"\x01" * 512, b"\x02" * 512])
        engine.cut_next(after=600)
        stub = StubRhapsode({"tone": engine})
        self.addCleanup(stub.close)
        done = Deferred.fromCoroutine(stub.client().speak_to(lambda piece: None, "tone", "Hello."))
        self.assertEqual(self.failureResultOf(done, TruncatedResponse).value.received, 600)
        # The aborted stream leaves nothing logged: trial fails the test otherwise.

    def test_an_internal_refusal_is_logged_by_the_core(self) -> None:
        """
        An engine that fails with internal: the program gets Internal, and the core
        logs the failure, as a real one does, for the test to expect.
        """
        engine = FakeEngine()
        engine.fail_next(Internal("the model fell over"))
        stub = StubRhapsode({"tone": engine})
        self.addCleanup(stub.close)
        done = Deferred.fromCoroutine(stub.client().speak("tone", "Hello."))
        self.assertEqual(self.failureResultOf(done, Internal).value.message, "the model fell over")
        self.assertEqual(len(self.flushLoggedErrors(Internal)), 1)
