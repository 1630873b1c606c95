"""
Writing the core's own trailer at the end of a relayed chunked body.
"""

from __future__ import annotations

from types import SimpleNamespace

from twisted.web.test.requesthelper import DummyRequest

from rhapsode_worker.web import write_trailer


def test_core_trailer_ends_a_chunked_body() -> None:
    """
    The core ends a chunked body itself with the duration field, and a duration it does
    not know leaves the trailer empty but the body still properly ended.
    """
    written: list[bytes] = []
    request = DummyRequest([b""])
    request.chunked = 1
    request.channel = SimpleNamespace(write=written.append)
    write_trailer(request, 1234)
    assert written == [b"0\r\nX-Rhapsode-Duration-Ms: 1234\r\n\r\n"] and request.chunked == 0
    written.clear()
    request.chunked = 1
    write_trailer(request, None)
    assert written == [b"0\r\n\r\n"]
