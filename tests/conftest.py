"""Shared test configuration."""

# tests/trial runs under `python -m twisted.trial` (make test), as a Twisted program's own
# suite would: trial checks the global reactor is clean after each test, which in one
# pytest process would also count what every earlier test left on it.
collect_ignore = ["trial"]
