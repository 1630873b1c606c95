"""
A voice upload's form (protocol.md section 7): multipart/form-data decoded a chunk at a
time by werkzeug's sans-IO decoder, within bounds on the number of parts and on each
part's header block, so a hostile body is refused before it costs real work.

Blocking (it reads the body), so the worker runs it off the reactor thread.
"""

from __future__ import annotations

from typing import IO

from werkzeug.http import parse_options_header
from werkzeug.sansio.multipart import Data, Field, File, MultipartDecoder, NeedData, State

from ..errors import BadRequest

#: The most parts a form may have.  A create has five known fields at most; the rest of
#: the room is for a client that sends one it should not, to be refused by name.
MAX_PARTS = 16
#: The most bytes and lines a part's header block may have: a Content-Disposition and
#: a Content-Type take a few hundred bytes and two lines.
MAX_PART_HEAD_BYTES = 8 * 1024
MAX_PART_HEAD_LINES = 32
#: RFC 2046 allows a boundary of 1 to 70 characters.
MAX_BOUNDARY = 70
# What is fed to the decoder at a time.  A header block is looked at whenever the
# decoder asks for more, so one is parsed at most a chunk past its limit.
_CHUNK = 16 * 1024

#: Field name to (filename, or None for a plain field; the field's bytes).
Form = dict[str, tuple[str | None, bytes]]


def _refuse(problem: str) -> BadRequest:
    return BadRequest(f"body {problem}", field="body")


def _closed(decoder: MultipartDecoder) -> bool:
    # A function, so a type checker does not keep the state it saw before the last event.
    return decoder.state is State.EPILOGUE


def read_form(content_type: bytes, body: IO[bytes]) -> Form:
    """
    The fields of a multipart/form-data body, read from C{body} to its closing boundary.

    A part with no name is skipped; a name given twice is refused naming it.

    @raise BadRequest: naming C{body}, for a malformed form, more than L{MAX_PARTS}
        parts, or a part's header block over L{MAX_PART_HEAD_BYTES} bytes or
        L{MAX_PART_HEAD_LINES} lines.
    """
    mimetype, options = parse_options_header(content_type.decode("latin-1"))
    boundary = options.get("boundary", "")
    if mimetype != "multipart/form-data" or not 0 < len(boundary) <= MAX_BOUNDARY:
        raise _refuse(f"needs a multipart/form-data boundary of 1 to {MAX_BOUNDARY} characters")
    decoder = MultipartDecoder(boundary.encode("latin-1"))
    fields: Form = {}
    parts = 0
    # The part being read: its name (None for a nameless one), filename and bytes so far.
    name: str | None = None
    filename: str | None = None
    pieces: list[bytes] = []
    # Past the closing boundary there is only an epilogue, which nobody reads.
    while not _closed(decoder):
        try:
            chunk = body.read(_CHUNK)
        except (OSError, ValueError):
            # A client that hangs up closes the body under this read; nobody hears this.
            raise _refuse("could not be read") from None
        decoder.receive_data(chunk or None)
        while not _closed(decoder):
            in_head = decoder.state is State.PART
            if in_head:
                # The part's header block starts the buffer: kept to count its lines.
                window = bytes(decoder.buffer[: MAX_PART_HEAD_BYTES + 1])
                before = len(decoder.buffer)
            try:
                event = decoder.next_event()
            except ValueError:  # UnicodeDecodeError included: header lines are UTF-8
                raise _refuse("is not well-formed multipart/form-data") from None
            if isinstance(event, NeedData):
                if in_head and len(decoder.buffer) > MAX_PART_HEAD_BYTES:
                    raise _refuse(f"has a part whose headers are over {MAX_PART_HEAD_BYTES} bytes")
                break
            if isinstance(event, (Field, File)):
                parts += 1
                if parts > MAX_PARTS:
                    raise _refuse(f"has more than {MAX_PARTS} parts")
                size = before - len(decoder.buffer)
                if size > MAX_PART_HEAD_BYTES:
                    raise _refuse(f"has a part whose headers are over {MAX_PART_HEAD_BYTES} bytes")
                if len(window[:size].splitlines()) > MAX_PART_HEAD_LINES:
                    raise _refuse(f"has a part with over {MAX_PART_HEAD_LINES} header lines")
                # werkzeug gives None, whatever its annotation says, for a part with no name.
                name = event.name or None
                if name is not None and name in fields:
                    raise BadRequest(f'field "{name}" given twice', field=name)
                filename = event.filename if isinstance(event, File) else None
                pieces = []
            elif isinstance(event, Data):
                pieces.append(event.data)
                if not event.more_data and name is not None:
                    fields[name] = (filename, b"".join(pieces))
                    pieces = []
    return fields
