"""
The conformance checker's pure parts, module by module: chunked bodies with trailers,
response heads, media types and request bodies (_wire), targets and responses (_client),
decoded audio (_audio), expectations (_expect), long texts (_checks), and the report's
wording (_report).
"""

from __future__ import annotations

import io
import json
import math
import struct

import pytest

from rhapsode_conform import _audio, _checks, _client, _expect, _report, _wire
from rhapsode_protocol.http.form import read_form

BODY = (
    b"5\r\nhello\r\n"
    b"7;name=value\r\n, world\r\n"
    b"0\r\n"
    b"X-Rhapsode-Duration-Ms: 1234\r\n"
    b"X-Other:  two words \r\n"
    b"\r\n"
)


def test_chunked_body_at_once_gives_chunks_and_trailers() -> None:
    """
    A whole chunked body yields each chunk's data, ignores chunk extensions, and keeps
    the trailer fields with lower-cased names and trimmed values.
    """
    decoder = _wire.ChunkedDecoder()
    assert decoder.feed(BODY) == [b"hello", b", world"]
    assert decoder.done
    assert decoder.trailers == {"x-rhapsode-duration-ms": "1234", "x-other": "two words"}


def test_chunked_body_byte_by_byte_is_the_same_and_ends_only_at_the_blank_line() -> None:
    """
    Fed one byte at a time, the decoder gives the same chunks, each as soon as its CRLF
    arrives, and is not done until the blank line closing the trailer section.
    """
    decoder = _wire.ChunkedDecoder()
    completed = []
    for i in range(len(BODY)):
        completed += decoder.feed(BODY[i : i + 1])
        if i < len(BODY) - 1:
            assert not decoder.done
    assert completed == [b"hello", b", world"]
    assert decoder.chunks == completed
    assert decoder.done and decoder.trailers["x-rhapsode-duration-ms"] == "1234"


def test_chunk_data_may_contain_crlf_and_sizes_are_hex() -> None:
    """
    A chunk's data is taken by its size, CRLF and all, and the size is hexadecimal in
    either case.
    """
    data = b"a\r\nb" * 4
    decoder = _wire.ChunkedDecoder()
    decoder.feed(b"%X\r\n" % len(data) + data + b"\r\n1A\r\n" + b"z" * 26 + b"\r\n0\r\n\r\n")
    assert decoder.chunks == [data, b"z" * 26]
    assert decoder.done and decoder.trailers == {}


def test_repeated_trailer_fields_are_joined() -> None:
    """
    A trailer field given twice reads as one value joined by ", ", as a header would.
    """
    decoder = _wire.ChunkedDecoder()
    decoder.feed(b"0\r\nA: 1\r\na: 2\r\n\r\n")
    assert decoder.trailers == {"a": "1, 2"}


def test_a_body_cut_short_is_not_done() -> None:
    """
    A body that stops after the last chunk's size line, before its trailer section ends,
    is not complete: the checker tells a truncated stream from a finished one by this.
    """
    decoder = _wire.ChunkedDecoder()
    decoder.feed(b"5\r\nhello\r\n0\r\nX-Rhapsode-Duration-Ms: 1\r\n")
    assert decoder.chunks == [b"hello"]
    assert not decoder.done


@pytest.mark.parametrize(
    "body",
    [
        b"zz\r\nhello\r\n",  # a size that is not hex
        b"\r\n",  # no size at all
        b"5\r\nhelloXX0\r\n\r\n",  # data not followed by CRLF
        b"0\r\nnot a field\r\n\r\n",  # a trailer line without a colon
        b"0\r\n\r\nmore",  # bytes after the end
        b"5" * (_wire._MAX_LINE + 1),  # a size line that never ends
    ],
)
def test_malformed_chunked_bodies_are_refused(body: bytes) -> None:
    """
    Framing that breaks RFC 9112's chunked coding raises ChunkedError rather than being
    read as audio.
    """
    with pytest.raises(_wire.ChunkedError):
        _wire.ChunkedDecoder().feed(body)


def test_feeding_after_the_end_is_refused() -> None:
    """
    Once the message has ended, more bytes are an error, and no bytes are not.
    """
    decoder = _wire.ChunkedDecoder()
    decoder.feed(b"0\r\n\r\n")
    assert decoder.feed(b"") == []
    with pytest.raises(_wire.ChunkedError):
        decoder.feed(b"x")


def test_parse_head_reads_status_and_joins_headers() -> None:
    """
    A response head gives its status and its headers by lower-cased name, a repeated
    header joined.
    """
    status, headers = _wire.parse_head(
        b"HTTP/1.1 200 OK\r\nContent-Type: audio/L16; rate=24000; channels=1\r\n"
        b"Trailer: X-Rhapsode-Duration-Ms\r\nVary: a\r\nVary: b"
    )
    assert status == 200
    assert headers == {
        "content-type": "audio/L16; rate=24000; channels=1",
        "trailer": "X-Rhapsode-Duration-Ms",
        "vary": "a, b",
    }


@pytest.mark.parametrize("head", [b"ICY 200 OK", b"HTTP/1.1 OK", b"HTTP/1.1 200 OK\r\nno colon"])
def test_parse_head_refuses_what_is_not_http(head: bytes) -> None:
    """
    A status line that is not HTTP's, or a header line without a colon, is refused.
    """
    with pytest.raises(ValueError):
        _wire.parse_head(head)


@pytest.mark.parametrize(
    ("text", "target"),
    [
        ("/run/x.sock", _client.Target(unix_path="/run/x.sock")),
        ("unix:/run/x.sock", _client.Target(unix_path="/run/x.sock")),
        ("relative.sock", _client.Target(unix_path="relative.sock")),
        ("http://127.0.0.1:8123", _client.Target(host="127.0.0.1", port=8123)),
        ("http://worker.lan:80/", _client.Target(host="worker.lan", port=80)),
    ],
)
def test_targets_parse(text: str, target: _client.Target) -> None:
    """
    A socket path with or without unix:, or http://host:port, names a target.
    """
    assert _client.parse_target(text) == target


@pytest.mark.parametrize(
    "text", ["", "unix:", "https://h:1", "http://h", "http://h:1/prefix", "http://h:1/?q=1", "http://u@h:1"]
)
def test_bad_targets_are_refused(text: str) -> None:
    """
    Another scheme, an http URL without a port, or one with a path, query or user is
    refused: a worker serves at its root.
    """
    with pytest.raises(ValueError):
        _client.parse_target(text)


def test_target_names_itself_and_its_host_header() -> None:
    """
    A target prints as it would be typed, and an http one sends host:port as Host.
    """
    assert str(_client.Target(unix_path="/x.sock")) == "unix:/x.sock"
    tcp = _client.Target(host="127.0.0.1", port=9)
    assert str(tcp) == "http://127.0.0.1:9"
    assert tcp.host_header == "127.0.0.1:9"


def test_media_type_parameters() -> None:
    """
    A media type is lower-cased and its parameters read by lower-cased name, unquoted.
    """
    assert _wire.parse_media_type('audio/L16; Rate=24000;channels="1"') == (
        "audio/l16",
        {"rate": "24000", "channels": "1"},
    )
    assert _wire.parse_media_type("audio/wav") == ("audio/wav", {})


def test_l16_parameters_must_match_the_native_format() -> None:
    """
    A pcm Content-Type passes only as audio/L16 with the native rate and channels.
    """
    assert _expect.l16_parameters("audio/L16; rate=24000; channels=1", (24000, 1)) == (24000, 1)
    for wrong in ("audio/L16; rate=16000; channels=1", "audio/L16", "audio/wav", None):
        with pytest.raises(_report.Failed):
            _expect.l16_parameters(wrong, (24000, 1))


def test_mp3_slack_is_priming_and_one_frame() -> None:
    """
    The mp3 allowance is 1105 priming samples plus a 576-sample frame below 32 kHz and
    a 1152-sample frame from 32 kHz up.
    """
    assert _audio.mp3_slack_samples(24000) == 1105 + 576
    assert _audio.mp3_slack_samples(44100) == 1105 + 1152


def test_pcm_duration_and_rms() -> None:
    """
    Interleaved s16le gives a duration from its frames and an RMS as a share of full
    scale; a half-scale square wave is 0.5 and silence is 0.
    """
    square = struct.pack("<4h", 16384, -16384, 16384, -16384) * 4000
    pcm = _audio.pcm_from_s16le(square, 8000, 2)
    assert pcm.frames == 8000 and pcm.duration_ms == 1000.0
    assert pcm.rms == pytest.approx(0.5)
    assert _audio.pcm_from_s16le(bytes(100), 8000, 1).rms == 0.0
    assert _audio.pcm_from_s16le(b"", 8000, 1).rms == 0.0


def test_pcm_of_a_partial_frame_fails() -> None:
    """
    A byte count that is not a whole number of frames is not the native format.
    """
    with pytest.raises(_report.Failed):
        _audio.pcm_from_s16le(b"\x00\x00\x00", 8000, 2)


def test_tiny_wav_decodes_to_an_audible_second() -> None:
    """
    The reference the checker uploads is a valid one-second 16-bit WAV, well above the
    silence floor.
    """
    pcm = _audio.decode_wav(_audio.tiny_wav())
    assert (pcm.rate, pcm.channels) == (16000, 1)
    assert pcm.duration_ms == 1000.0
    assert pcm.rms == pytest.approx(8000 / 32768 / math.sqrt(2), rel=0.01)


def test_a_body_that_is_not_wav_fails() -> None:
    """
    Bytes the wave module cannot read fail the check rather than raising out of it.
    """
    with pytest.raises(_report.Failed):
        _audio.decode_wav(b"RIFF\x00\x00\x00\x00nope")


def test_multipart_body_reads_back_through_the_sdk_parser() -> None:
    """
    The voice-create body the checker builds is read by the worker's own multipart
    parser into the same fields, filename included.
    """
    body, content_type = _wire.multipart([("id", None, b"conform-x"), ("reference", "x.xyz", b"\x00\r\n\x01")])
    assert content_type.startswith("multipart/form-data; boundary=")
    fields = read_form(content_type.encode(), io.BytesIO(body))
    assert fields == {"id": (None, b"conform-x"), "reference": ("x.xyz", b"\x00\r\n\x01")}


def _error(status: int, code: str, message: str = "m", field: str | None = None) -> _client.Response:
    error: dict[str, object] = {"code": code, "message": message, "retryable": False}
    if field is not None:
        error["field"] = field
    return _client.Response("POST /speak", status, {}, json.dumps({"error": error}).encode())


def test_refused_accepts_the_envelope_asked_for() -> None:
    """
    The expectation passes for the right status, code, field and a message naming the
    thing refused.
    """
    _expect.refused(_error(400, "bad_request", 'no dial "x"', "params.x"), 400, "bad_request", "params.x", names="x")


@pytest.mark.parametrize(
    "response",
    [
        _error(422, "bad_request", field="params.x"),  # wrong status
        _error(400, "unsupported", field="params.x"),  # wrong code
        _error(400, "bad_request", field="params.y"),  # wrong field
        _error(400, "bad_request", "nothing named", "params.x"),  # message does not name it
        _client.Response("POST /speak", 400, {}, b"<html>"),  # not an envelope
    ],
)
def test_refused_fails_anything_else(response: _client.Response) -> None:
    """
    Any other status, code, field, message or body fails the expectation.
    """
    with pytest.raises(_report.Failed):
        _expect.refused(response, 400, "bad_request", "params.x", names="params.x")


def test_describe_summarises_an_envelope_or_a_body() -> None:
    """
    A failure message shows an error's code, field and message, or else the body's type
    and size.
    """
    assert _error(404, "unknown_voice", "no voice", "voice").describe() == '404 unknown_voice (field "voice"): no voice'
    plain = _client.Response("GET /x", 200, {"content-type": "audio/wav"}, b"1234")
    assert plain.describe() == "200 audio/wav, 4 bytes"


@pytest.mark.parametrize(
    ("exc", "outcome"),
    [
        (_report.Failed("f"), _report.Outcome.FAIL),
        (_report.TimedOut("t"), _report.Outcome.FAIL),
        (_report.Undecidable("u"), _report.Outcome.UNDECIDED),
        (ConnectionResetError("r"), _report.Outcome.FAIL),
        (KeyError("k"), _report.Outcome.FAIL),
    ],
)
def test_how_a_test_ends_decides_its_result(exc: Exception, outcome: _report.Outcome) -> None:
    """
    A test that raises is a FAIL unless it could not be decided; one that returns passes.
    """

    def test() -> None:
        raise exc

    assert _report.outcome_of("rule", test).outcome is outcome
    assert _report.outcome_of("rule", lambda: None) == _report.Result("rule", _report.Outcome.PASS)


def test_report_lines_and_summary() -> None:
    """
    Each result is one line in its own wording, and the summary counts them without the
    "N passed, N failed" phrasing; any FAIL makes the exit status 1.
    """
    report = _report.Report()
    report.results += [
        _report.Result("a", _report.Outcome.PASS),
        _report.Result("b", _report.Outcome.FAIL, "why b"),
        _report.Result("c", _report.Outcome.UNDECIDED, "why c"),
    ]
    assert report.render().splitlines() == [
        "pass  a",
        "FAIL  b: why b",
        "cannot be decided c: why c",
        "conformance: 1 pass, 1 fail, 1 cannot be decided",
    ]
    assert report.exit_code == 1
    report.results.pop(1)
    assert report.exit_code == 0


def test_long_text_spans_several_segments_within_the_ceiling() -> None:
    """
    The streaming text is over three segments long where the variant segments, and never
    over maxCharacters.
    """
    assert len(_checks._long_text(200, 4096)) > 600
    assert len(_checks._long_text(200, 300)) <= 300
    assert 600 <= len(_checks._long_text(None, 4096)) <= 700


def test_a_worker_answering_json_nested_past_the_parser_fails_the_check_not_the_checker() -> None:
    """
    A worker under test answering 1,100 nested brackets (past json.loads' recursion) is
    a failed check saying its body is not JSON, and its description falls back to the
    Content-Type and length, where RecursionError took the whole run down.
    """
    deep = b"[" * 1100 + b"]" * 1100
    response = _client.Response("GET /voices", 200, {"content-type": "application/json"}, deep)
    with pytest.raises(_report.Failed, match="not JSON"):
        response.json()
    assert "application/json, 2200 bytes" in response.describe()
