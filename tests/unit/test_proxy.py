"""
Reading a worker's trailer from the tail of its connection (the core cannot get it from
twisted.web's client), and writing the core's own.
"""

from __future__ import annotations

from types import SimpleNamespace

from twisted.web.test.requesthelper import DummyRequest

from rhapsode._proxy import trailers_of
from rhapsode_worker._http import write_trailer


def test_trailer_fields_read_from_the_tail() -> None:
    """
    The fields after the last chunk are parsed, names lower-cased.
    """
    tail = SimpleNamespace(tail=b"...audio\r\n0\r\nX-Rhapsode-Duration-Ms: 4756\r\nX-Other: a b\r\n\r\n")
    assert trailers_of(tail) == {b"x-rhapsode-duration-ms": b"4756", b"x-other": b"a b"}


def test_no_trailer_or_no_sniffer_reads_as_nothing() -> None:
    """
    A body ended without trailer fields, a tail that is not a chunked ending, or no
    sniffer at all, all read as no trailers: the duration is then best effort.
    """
    assert trailers_of(SimpleNamespace(tail=b"abc\r\n0\r\n\r\n")) == {}
    assert trailers_of(SimpleNamespace(tail=b"HTTP/1.1 200 OK\r\n\r\nxyz")) == {}
    assert trailers_of(None) == {}


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
