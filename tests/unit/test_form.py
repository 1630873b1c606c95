"""
A voice upload's form (rhapsode_protocol.http.form): fields read as werkzeug's decoder gives
them, and a hostile body refused naming "body" after reading only its first pieces.
"""

from __future__ import annotations

import io

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rhapsode_protocol.http.form import MAX_PART_HEAD_BYTES, MAX_PART_HEAD_LINES, MAX_PARTS, read_form
from rhapsode_worker import BadRequest

CONTENT_TYPE = b"multipart/form-data; boundary=xyz"


def part(name: str, value: bytes, head: bytes = b"", filename: str | None = None) -> bytes:
    disposition = f'Content-Disposition: form-data; name="{name}"'
    if filename is not None:
        disposition += f'; filename="{filename}"'
    return b"--xyz\r\n" + disposition.encode() + b"\r\n" + head + b"\r\n" + value + b"\r\n"


def form(*parts: bytes) -> bytes:
    return b"".join(parts) + b"--xyz--\r\n"


class Reader(io.BytesIO):
    """
    A body that remembers how much of it was read.
    """

    taken = 0

    def read(self, size: int | None = -1) -> bytes:
        data = super().read(size)
        self.taken += len(data)
        return data


def refusal(body: bytes, content_type: bytes = CONTENT_TYPE) -> BadRequest:
    with pytest.raises(BadRequest) as caught:
        read_form(content_type, io.BytesIO(body))
    return caught.value


def test_fields_and_files_read_back_intact() -> None:
    """
    Plain fields and a file are read by name, the file's bytes intact (line breaks and
    text like the boundary included), with a preamble, a nameless part and the
    epilogue ignored.
    """
    clip = b"RIFF\r\n--xy\r\n--xyz-not\r\n\x00\xff" * 1000
    body = b"a preamble\r\n" + form(
        part("id", b"v1"),
        part("reference", clip, b"Content-Type: audio/wav\r\n", filename="clip.wav"),
        b'--xyz\r\nContent-Disposition: form-data\r\n\r\nnameless\r\n',
        part("transcript", "Grüß Gott".encode()),
    ) + b"an epilogue"
    fields = read_form(b'multipart/form-data; boundary="xyz"', io.BytesIO(body))
    assert fields == {
        "id": (None, b"v1"),
        "reference": ("clip.wav", clip),
        "transcript": (None, "Grüß Gott".encode()),
    }


def test_two_hundred_thousand_parts_are_refused_after_the_first_few() -> None:
    """
    A body of 200,000 empty parts (11 MB, and 13 s of CPU to the email parser) is
    refused naming "body" for its number of parts, having read a few tens of kilobytes.
    """
    body = Reader(form(*(part(f"p{i}", b"") for i in range(200_000))))
    with pytest.raises(BadRequest) as caught:
        read_form(CONTENT_TYPE, body)
    assert caught.value.field == "body" and f"more than {MAX_PARTS} parts" in caught.value.message
    assert body.taken <= 64 * 1024 < len(body.getvalue()) // 100


def test_a_name_given_twice_is_refused_naming_it() -> None:
    """
    A field given twice is refused naming that field, not the body.
    """
    error = refusal(form(part("id", b"a"), part("id", b"b")))
    assert (error.field, error.message) == ("id", 'field "id" given twice')


def test_a_part_with_too_many_header_lines_is_refused() -> None:
    """
    A part with more header lines than a form needs is refused naming "body".
    """
    lines = b"".join(b"X-Pad-%d: y\r\n" % i for i in range(MAX_PART_HEAD_LINES))
    error = refusal(form(part("id", b"v1", lines)))
    assert error.field == "body" and "header lines" in error.message
    # One line fewer is within the limit: the disposition is the last.
    fields = read_form(CONTENT_TYPE, io.BytesIO(form(part("id", b"v1", lines[lines.index(b"\n") + 1 :]))))
    assert fields == {"id": (None, b"v1")}


@pytest.mark.parametrize("tail", [b"\r\n\r\nv1\r\n--xyz--\r\n", b""], ids=["whole", "endless"])
def test_a_part_with_a_header_block_too_long_is_refused_reading_little(tail: bytes) -> None:
    """
    A header block over its limit is refused naming "body", whether it ends or goes on
    for the whole upload, having read little more than the limit.
    """
    body = Reader(b'--xyz\r\nContent-Disposition: form-data; name="id"\r\nX: ' + b"a" * 20_000_000 + tail)
    with pytest.raises(BadRequest) as caught:
        read_form(CONTENT_TYPE, body)
    assert caught.value.field == "body" and f"over {MAX_PART_HEAD_BYTES} bytes" in caught.value.message
    assert body.taken <= 64 * 1024


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        (CONTENT_TYPE, b""),
        (CONTENT_TYPE, b"not a form at all"),
        (CONTENT_TYPE, form(part("id", b"v1"))[:-9]),
        (CONTENT_TYPE, b"--xyz\r\nX-Other: y\r\n\r\nv1\r\n--xyz--\r\n"),
        (CONTENT_TYPE, form(part("id", b"v1")).replace(b'"id"', b'"\xff"')),
        (b"multipart/form-data", form(part("id", b"v1"))),
        (b"multipart/form-data; boundary=" + b"x" * 71, form(part("id", b"v1"))),
        (b"application/json; boundary=xyz", form(part("id", b"v1"))),
    ],
    ids=["empty", "junk", "unterminated", "no-disposition", "not-utf8", "no-boundary", "long-boundary", "not-a-form"],
)
def test_malformed_forms_are_refused_naming_body(content_type: bytes, body: bytes) -> None:
    """
    What is not a well-formed multipart/form-data body is bad_request naming "body".
    """
    assert refusal(body, content_type).field == "body"


_PIECES = st.sampled_from(
    [b"--xyz", b"--xyz--", b"--", b"\r\n", b"\r", b"\n", b"\r\n\r\n", b":", b" ", b"\xff", b"a",
     b'Content-Disposition: form-data; name="id"', b'; filename="a.wav"', b"Content-Disposition"]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_PIECES, max_size=30))
def test_any_body_is_read_or_refused_as_bad_request(pieces: list[bytes]) -> None:
    """
    Whatever the bytes, the form is read or refused as bad_request; the decoder's own
    failures never escape as anything else.
    """
    try:
        read_form(CONTENT_TYPE, io.BytesIO(b"".join(pieces)))
    except BadRequest:
        pass
