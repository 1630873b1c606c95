"""
What both processes leave out of their logs at info (beside the HTTP server they share, in
the part of the protocol that may import Twisted): Twisted's own routine lines (a
factory or a port starting and stopping, twistd starting up, the main loop ending, an
idle client timed out), which say nothing a line of the core's or a worker's own does
not.  The core's log, a worker's and the web page's each filter with L{twisted_routine}
above debug; its warnings and errors always pass.
"""

from __future__ import annotations

from typing import Any, Mapping

from twisted.logger import LogLevel, PredicateResult

__all__ = ["twisted_routine"]

#: How the lines begin that Twisted logs about objects of this project's own classes,
#: under their namespace rather than Twisted's (a site is a twisted.web factory, its
#: channel an HTTPChannel).
_TWISTED_ROUTINE = ("Starting factory ", "Stopping factory ", "Timing out client: ")


def twisted_routine(event: Mapping[str, Any]) -> PredicateResult:
    """
    No to Twisted's own events below a warning: those in its namespaces, except the
    access lines twisted.web writes to C{twisted.python.log}'s file (C{log_io}); those
    of its older C{log.msg}, which carry no namespace (a port opening or closing); and
    the few it logs in the namespace of a subclass.  A worker's line, relayed by its
    supervisor, keeps the worker's namespace and carries its text as C{message}.
    """
    if event.get("log_level", LogLevel.info) >= LogLevel.warn:
        return PredicateResult.maybe
    namespace = event.get("log_namespace", "")
    if namespace.startswith("twisted.") and "log_io" not in event:
        return PredicateResult.no
    if namespace == "log_legacy":
        return PredicateResult.no
    text = event.get("message") if "engine" in event else event.get("log_format")
    if isinstance(text, str) and text.startswith(_TWISTED_ROUTINE):
        return PredicateResult.no
    return PredicateResult.maybe
