"""
Timestamps in the core (protocol.md section 4), on fakes: the worker's frames read in
any pieces and relayed to a timed sink in their order, a stream that ends without its
end frame failed; preflight's refusal of an undeclared unit and the caller's text sent
on; and each door's timed sink: the contract's events (nothing before the floor, an
error event after), its JSON document, Kokoro-FastAPI's lines, memory and MCP's result,
and a node's frames for a cluster's front.
"""

from __future__ import annotations

import base64
from collections import deque
import json
from types import SimpleNamespace
from typing import Any

import pytest
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.test.requesthelper import DummyRequest

from rhapsode._doors.mcp import _audio
from rhapsode._http.sinks import CaptionedSink, FramedSink, TimedEventSink, TimedJsonSink, framed_sink, timed_sink
from rhapsode._speech.inprocess import MemorySink
from rhapsode._speech.limits import BufferBudget, Hold
from rhapsode._speech.preflight import forward_dialogue, forward_speak
from rhapsode._speech.relay import _TIMED_PIECE, FLOOR_BYTES, _TimedBuffered
from rhapsode._speech.timed import AUDIO_TYPE_HEADER, TimedStreamRelay, read_frames
from rhapsode._upstream.body import Stalls
from rhapsode_protocol import contract, frames
from rhapsode_protocol.errors import BadRequest, Internal, Unsupported

from _fakes import TimedRecordingSink
from test_relay import Limits

WORD = {"unit": "word", "text": "Hi", "start": 0.0, "end": 0.2, "textStart": 0, "textEnd": 2}
LATER = {"unit": "word", "text": "there", "start": 0.3, "end": 0.6, "textStart": 3, "textEnd": 8}


def timings(entries: list[dict[str, Any]]) -> bytes:
    return frames.frame(frames.TIMINGS, json.dumps(entries).encode())


STREAM = b"".join([
    timings([WORD]),
    frames.frame(frames.AUDIO, b"\x01" * 300),
    timings([LATER]),
    frames.frame(frames.AUDIO, b"\x02" * 300),
    frames.frame(frames.DONE, b'{"durationMs": 14}'),
])


def merged(found: list[tuple[bytes, Any]]) -> list[tuple[bytes, Any]]:
    """Audio given out in parts, each run of them joined."""
    out: list[tuple[bytes, Any]] = []
    for kind, payload in found:
        if kind == frames.AUDIO and out and out[-1][0] == frames.AUDIO:
            out[-1] = (kind, out[-1][1] + payload)
        else:
            out.append((kind, payload))
    return out


@pytest.mark.parametrize("size", [1, 7, 64, len(STREAM)])
def test_frames_are_read_whatever_pieces_they_arrive_in(size: int) -> None:
    """
    Frames split across any reads are read in order: audio given out as it arrives (in
    the parts it came in, all of it), timings and the end once whole, decoded from JSON;
    a frame of a kind not known is skipped.
    """
    reader = frames.FrameReader()
    found = []
    body = frames.frame(b"z", b"a newer worker's") + STREAM
    for at in range(0, len(body), size):
        found.extend(reader.feed(body[at:at + size]))
    if size == len(STREAM):
        assert (frames.AUDIO, b"\x01" * 300) in found  # a frame read whole is one part
    assert merged(found) == [
        (b"t", [WORD]), (b"a", b"\x01" * 300), (b"t", [LATER]), (b"a", b"\x02" * 300), (b"d", {"durationMs": 14}),
    ]
    assert not reader.holding


def test_a_frame_over_the_bound_or_json_that_is_not_is_refused() -> None:
    """
    A frame longer than the bound is refused from its head, before its bytes; a timings
    frame that is not JSON is refused.
    """
    with pytest.raises(frames.FrameError):
        frames.FrameReader(limit=100).feed(frames.frame(frames.AUDIO, b"x" * 200)[:5])
    with pytest.raises(frames.FrameError):
        frames.FrameReader().feed(frames.frame(frames.TIMINGS, b"[1,"))


def relayed(clock: Clock) -> tuple[TimedStreamRelay, TimedRecordingSink, StringTransport]:
    sink = TimedRecordingSink()
    relay = TimedStreamRelay(sink, Stalls(clock, 120.0))
    worker = StringTransport()
    relay.makeConnection(worker)
    return relay, sink, worker


def test_a_timed_stream_reaches_the_sink_in_its_order_with_its_duration() -> None:
    """
    Timings and audio reach the sink in the order the worker sent them, as entries and
    as bytes; the relay is the sink's producer, pausing the worker's socket; the end's
    duration is kept and the audio's length counted.
    """
    relay, sink, worker = relayed(Clock())
    assert sink.producer is relay
    relay.pauseProducing()
    assert worker.producerState == "paused"
    relay.resumeProducing()
    for at in range(0, len(STREAM), 50):
        relay.dataReceived(STREAM[at:at + 50])
    relay.connectionLost(Failure(ResponseDone()))
    order = [(b"t" if name == "timestamps" else b"a", value) for name, value in sink.order]
    assert merged(order) == [(b"t", [WORD]), (b"a", b"\x01" * 300), (b"t", [LATER]), (b"a", b"\x02" * 300)]
    assert relay.done.result == 600 and relay.duration_ms == 14 and sink.producer is None


@pytest.mark.parametrize(
    "body",
    [
        STREAM[: STREAM.rindex(b"d")],  # cut before the end
        STREAM[:-5],  # cut inside the last frame
        frames.frame(frames.AUDIO, b"\x01" * 300) + timings([{"unit": "word"}]),
        frames.frame(frames.AUDIO, b"\x01" * 300) + frames.frame(frames.TIMINGS, b"{not json"),
        STREAM + frames.frame(frames.AUDIO, b"late"),
    ],
    ids=["no-end", "cut-frame", "not-timings", "not-json", "after-the-end"],
)
def test_a_timed_stream_that_is_not_whole_fails(body: bytes) -> None:
    """
    A stream that ends without its end frame, mid-frame, with timings that are not the
    contract's or not JSON, or with audio after its end fails, so the relay aborts a
    sink that has started.
    """
    relay, sink, _ = relayed(Clock())
    relay.dataReceived(body)
    relay.connectionLost(Failure(ResponseDone()))
    failure = relay.done.result
    relay.done.addErrback(lambda _: None)
    assert isinstance(failure, Failure) and failure.check(Internal)


def test_a_buffered_answer_is_read_against_the_contract() -> None:
    """
    A buffered timed answer gives its audio, its timings and what its end says of the
    audio; anything short of that is the worker's failure.
    """
    end = {"format": "wav", "contentType": "audio/wav", "sampleRate": 24000, "channels": 1, "durationMs": 0}
    body = timings([WORD]) + frames.frame(frames.AUDIO, b"abc") + frames.frame(frames.DONE, json.dumps(end).encode())
    audio, entries, rest = read_frames(body)
    assert (audio, entries, rest) == ([b"abc"], [WORD], end)
    for broken in (body[:-3], body[: body.rindex(b"d")], timings([{"unit": "syllable"}]) + body):
        with pytest.raises(Internal):
            read_frames(broken)


CAPS = {
    "formats": ["wav", "pcm"],
    "variants": {
        "timed": {"cues": ["laugh"], "dials": {}, "languages": ["en"], "maxCharacters": 100,
                  "dialogue": {"maxSpeakers": 2},
                  "timestamps": {"units": ["word"], "source": "synthesizer", "textOffsets": True}},
        "plain": {"cues": [], "dials": {}, "languages": ["en"], "maxCharacters": 100},
    },
}


def test_preflight_refuses_a_unit_the_variant_does_not_time_naming_the_field() -> None:
    """
    phoneme from a variant that times words, and word from one that times nothing, are
    unsupported naming timestamps, for speech and for dialogue.
    """
    for variant, unit in (("timed", "phoneme"), ("plain", "word")):
        with pytest.raises(Unsupported) as refused:
            forward_speak({"engine": "e", "text": "Hi.", "timestamps": unit}, CAPS, variant)
        assert refused.value.field == "timestamps"
    with pytest.raises(Unsupported) as refused:
        forward_dialogue({"turns": [{"speaker": "a", "text": "Hi."}], "timestamps": "phoneme"}, CAPS, "timed")
    assert refused.value.field == "timestamps"


def test_a_timed_request_sends_the_callers_text_so_offsets_are_into_it() -> None:
    """
    Untimed, the worker is sent the text stripped of what the variant does not claim;
    timed, as the caller wrote it (the worker strips by the same rule and maps its
    offsets back), checked all the same.
    """
    text = "Hi [cough] there [laugh]."
    assert forward_speak({"engine": "e", "text": text}, CAPS, "timed")["text"] == "Hi there [laugh]."
    assert forward_speak({"engine": "e", "text": text, "timestamps": "word"}, CAPS, "timed")["text"] == text
    turns = [{"speaker": "a", "text": text}]
    assert forward_dialogue({"turns": turns, "timestamps": "word"}, CAPS, "timed")["turns"] == turns
    with pytest.raises(BadRequest):
        forward_speak({"engine": "e", "text": "[cough]", "timestamps": "word"}, CAPS, "timed")


def request_with(accept: str | None) -> DummyRequest:
    request = DummyRequest([b""])
    if accept is not None:
        request.requestHeaders.setRawHeaders(b"accept", [accept.encode()])
    return request


def test_the_sink_follows_the_accept_and_raw_audio_is_refused() -> None:
    """
    With timestamps a stream needs Accept: text/event-stream and a buffered answer
    Accept: application/json (a wildcard is not enough); without the field no timed
    sink is made.
    """
    finished = request_with(None).notifyFinish()
    assert timed_sink(request_with(None), {"text": "x"}, finished) is None
    assert isinstance(timed_sink(request_with("text/event-stream"), {"timestamps": "word"}, finished), TimedEventSink)
    document = timed_sink(request_with("application/json"), {"timestamps": "word", "stream": False}, finished)
    assert isinstance(document, TimedJsonSink)
    for accept, stream in ((None, True), ("*/*", True), ("application/json", True), ("text/event-stream", False)):
        with pytest.raises(BadRequest) as refused:
            timed_sink(request_with(accept), {"timestamps": "word", "stream": stream}, finished)
        assert refused.value.field == "timestamps"


def sse_frames(written: list[bytes]) -> list[tuple[str, Any]]:
    found = []
    for frame in b"".join(written).decode().split("\n\n"):
        if frame:
            name, data = frame.split("\n")
            found.append((name[len("event: "):], json.loads(data[len("data: "):])))
    return found


def test_the_event_sink_holds_everything_until_the_floor_then_keeps_the_order() -> None:
    """
    Nothing goes out before FLOOR_BYTES of audio (a body that is not audio can still be
    refused); then the head, with the audio's type, and every event in the order it
    came; the end is a done event with the duration.
    """
    request = request_with("text/event-stream")
    sink = TimedEventSink(request)
    sink.begin(200, [(b"Content-Type", b"audio/L16; rate=24000; channels=1")])
    sink.timestamps([WORD])
    sink.write(b"\x01" * (FLOOR_BYTES // 2))
    assert not sink.started and request.written == []
    sink.write(b"\x02" * FLOOR_BYTES)
    sink.timestamps([LATER])
    sink.end(40)
    assert sink.started and request.responseCode == 200
    assert request.responseHeaders.getRawHeaders(b"content-type") == [b"text/event-stream"]
    assert request.responseHeaders.getRawHeaders(b"x-rhapsode-audio-type") == [b"audio/L16; rate=24000; channels=1"]
    events = sse_frames(request.written)
    assert [name for name, _ in events] == [
        "speech.timestamps.delta", "speech.audio.delta", "speech.audio.delta", "speech.timestamps.delta",
        "speech.audio.done",
    ]
    for name, data in events:
        schema = {"speech.timestamps.delta": contract.TIMESTAMPS_EVENT, "speech.audio.delta": contract.AUDIO_DELTA_EVENT,
                  "speech.audio.done": contract.AUDIO_DONE_EVENT}[name]
        contract.validate(schema, data)
    assert events[-1][1]["durationMs"] == 40


def test_the_event_sink_says_a_late_failure_with_an_error_event() -> None:
    """
    A failure once events have gone is a speech.audio.error event, which a stream of
    events can say; the stream ends cleanly after it.
    """
    request = request_with("text/event-stream")
    sink = TimedEventSink(request)
    sink.begin(200, [])
    sink.write(b"\x01" * FLOOR_BYTES)
    sink.abort(Internal("the worker's stream broke off"))
    name, data = sse_frames(request.written)[-1]
    assert name == "speech.audio.error" and data["error"]["code"] == "internal"


def test_the_json_sink_writes_the_contracts_document() -> None:
    """
    A buffered timed answer is one TimedAudio document: the audio in base64, its type,
    rate, channels and duration, and every entry in order.  Nothing is written before
    the first audio; from there each piece goes out as it is written, encoded across
    pieces whose lengths are not whole base64 quanta.
    """
    request = request_with("application/json")
    sink = TimedJsonSink(request, "wav")
    sink.begin(200, [(b"Content-Type", b"audio/wav"), (b"X-Rhapsode-Sample-Rate", b"22050"),
                     (b"X-Rhapsode-Channels", b"1"), (b"X-Rhapsode-Duration-Ms", b"600")])
    sink.timestamps([WORD])
    sink.timestamps([LATER])
    assert request.written == []
    pieces = [b"RI", b"FF....", b"x", b"", b"abcdefg"]
    for piece in pieces:
        sink.write(piece)
    written = len(b"".join(request.written))
    sink.end(600)
    body = b"".join(request.written)
    assert len(body) > written
    document = json.loads(body)
    contract.validate(contract.TIMED_AUDIO, document)
    assert base64.b64decode(document["audio"], validate=True) == b"".join(pieces)
    assert {k: v for k, v in document.items() if k != "audio"} == {
        "format": "wav", "contentType": "audio/wav", "sampleRate": 22050, "channels": 1, "durationMs": 600,
        "alignment": [WORD, LATER],
    }
    assert request.responseHeaders.getRawHeaders(b"content-type") == [b"application/json"]
    assert request.responseHeaders.getRawHeaders(b"x-rhapsode-duration-ms") == [b"600"]


def test_a_buffered_timed_answer_is_written_in_slices_each_after_room() -> None:
    """
    The relay writes a buffered timed answer's audio to its sink in slices of at most
    _TIMED_PIECE bytes (a whole number of base64 quanta), each once the sink has room,
    after the timings and before the end: a worker's one large piece never reaches a
    sink whole, and a small one goes as it is.
    """
    sink = TimedRecordingSink()
    rooms: list[int] = []

    def room() -> Any:
        rooms.append(len(sink.written))
        return succeed(None)

    sink.room = room  # type: ignore[method-assign]
    large = bytes(range(256)) * ((_TIMED_PIECE * 2 + 1000) // 256)
    small = b"\x01" * 10
    held = _TimedBuffered([(b"Content-Type", b"audio/wav")], [WORD], deque([large, small]), 600)
    done = Deferred.fromCoroutine(held.deliver(sink))
    assert done.called
    assert [len(w) for w in sink.written] == [_TIMED_PIECE, _TIMED_PIECE, len(large) - 2 * _TIMED_PIECE, 10]
    assert _TIMED_PIECE % 3 == 0
    assert b"".join(sink.written) == large + small
    assert sink.written[-1] is small
    assert rooms == [0, 1, 2, 3]
    assert sink.order[0] == ("timestamps", [WORD]) and sink.ended == 600


def test_the_json_sink_aborts_once_its_document_has_begun() -> None:
    """
    A failure before any audio leaves the JSON sink untouched (the route answers the
    envelope); once its document has begun, a failure can only cut the connection,
    never end the document as if whole.
    """
    before = request_with("application/json")
    sink = TimedJsonSink(before, "wav")
    sink.begin(200, [(b"Content-Type", b"audio/wav")])
    sink.timestamps([WORD])
    assert sink.abort(Internal("the worker broke")).called
    assert before.written == [] and not sink.started
    during = request_with("application/json")
    during.channel = SimpleNamespace(transport=StringTransport())
    sink = TimedJsonSink(during, "wav")
    sink.begin(200, [(b"Content-Type", b"audio/wav")])
    sink.write(b"RIFF....")
    assert during.written and sink.started
    sink.abort(Internal("gone"))
    assert during.channel.transport.disconnecting
    assert not b"".join(during.written).endswith(b"}")


def test_the_framed_sink_writes_a_buffered_answer_as_its_pieces_come() -> None:
    """
    A node's buffered timed answer in frames: nothing before the first audio (a failure
    until then is the route's envelope), then the timings and each piece as written, and
    an end frame saying what the audio is, which the front reads back as a worker's.
    """
    request = request_with(frames.FRAMES)
    sink = FramedSink(request, "wav", False)
    sink.begin(200, [(b"Content-Type", b"audio/wav"), (b"X-Rhapsode-Sample-Rate", b"22050"),
                     (b"X-Rhapsode-Duration-Ms", b"40")])
    sink.timestamps([WORD])
    assert request.written == [] and not sink.started
    sink.write(b"RIFF")
    assert sink.started and request.written
    sink.write(b"....")
    sink.end(40)
    audio, entries, end = read_frames(b"".join(request.written))
    assert (b"".join(audio), entries) == (b"RIFF....", [WORD])
    assert end == {"format": "wav", "contentType": "audio/wav", "sampleRate": 22050, "channels": 1, "durationMs": 40}
    assert request.responseHeaders.getRawHeaders(b"x-rhapsode-duration-ms") == [b"40"]
    untouched = request_with(frames.FRAMES)
    sink = FramedSink(untouched, "wav", False)
    sink.begin(200, [(b"Content-Type", b"audio/wav")])
    sink.timestamps([WORD])
    assert sink.abort(Internal("gone")).called and untouched.written == []


def test_captioned_lines_carry_the_words_that_came_before_their_audio() -> None:
    """
    Kokoro-FastAPI's stream: one JSON object a line per piece of audio (once the floor
    is reached), each with the words timed before it, as word/start_time/end_time.
    """
    request = request_with(None)
    sink = CaptionedSink(request, stream=True, timed=True)
    sink.begin(200, [(b"Content-Type", b"audio/mpeg")])
    sink.timestamps([WORD, {"unit": "phoneme", "text": "h", "start": 0.0, "end": 0.1}])
    sink.write(b"\x01" * FLOOR_BYTES)
    sink.timestamps([LATER])
    sink.write(b"\x02" * 10)
    sink.end(600)
    lines = [json.loads(line) for line in b"".join(request.written).splitlines()]
    assert [(base64.b64decode(line["audio"]), line["audio_format"], line["timestamps"]) for line in lines] == [
        (b"\x01" * FLOOR_BYTES, "audio/mpeg", [{"word": "Hi", "start_time": 0.0, "end_time": 0.2}]),
        (b"\x02" * 10, "audio/mpeg", [{"word": "there", "start_time": 0.3, "end_time": 0.6}]),
    ]
    buffered = request_with(None)
    whole = CaptionedSink(buffered, stream=False, timed=False)
    whole.begin(200, [(b"Content-Type", b"audio/wav")])
    whole.write(b"RIFF")
    whole.end(5)
    assert json.loads(b"".join(buffered.written)) == {
        "audio": base64.b64encode(b"RIFF").decode(), "audio_format": "audio/wav", "timestamps": None,
    }


def test_a_buffered_captioned_answer_goes_out_as_its_pieces_come() -> None:
    """
    Kokoro-FastAPI's buffered shape is one object with every word and all the audio:
    nothing is written before the first audio (a failure until then is the route's
    envelope), then each piece's base64 as it comes, whatever its length, and the end
    closes the object.
    """
    request = request_with(None)
    sink = CaptionedSink(request, stream=False, timed=True)
    sink.begin(200, [(b"Content-Type", b"audio/wav"), (b"X-Rhapsode-Duration-Ms", b"600")])
    sink.timestamps([WORD, LATER])
    assert request.written == []
    pieces = [b"RI", b"FF....", b"x", b"abcde"]
    for piece in pieces:
        sink.write(piece)
    sink.end(600)
    assert json.loads(b"".join(request.written)) == {
        "audio": base64.b64encode(b"".join(pieces)).decode(), "audio_format": "audio/wav",
        "timestamps": [{"word": "Hi", "start_time": 0.0, "end_time": 0.2},
                       {"word": "there", "start_time": 0.3, "end_time": 0.6}],
    }
    assert request.responseHeaders.getRawHeaders(b"x-rhapsode-duration-ms") == [b"600"]
    untouched = request_with(None)
    untouched.channel = SimpleNamespace(transport=StringTransport())
    sink = CaptionedSink(untouched, stream=False, timed=True)
    sink.begin(200, [(b"Content-Type", b"audio/wav")])
    sink.timestamps([WORD])
    assert sink.abort(Internal("gone")).called
    assert untouched.written == [] and not untouched.channel.transport.disconnecting


def test_mcp_answers_the_alignment_beside_the_audio() -> None:
    """
    speak's result with timestamps holds the audio, a line saying what it is, the
    alignment as JSON text, and the same as structured content.
    """
    sink = MemorySink()
    sink.begin(200, [(b"Content-Type", b"audio/wav")])
    sink.timestamps([WORD, LATER])
    sink.write(b"RIFF")
    sink.end(600)
    hold = Hold(BufferBudget(Limits(buffered=10**6)))
    answer = _audio(sink.answer, "with engine tone", hold)
    result = json.loads(b"".join(answer.pieces))
    assert hold.size == sum(map(len, answer.pieces))  # the whole result counts against the budget
    assert [item["type"] for item in result["content"]] == ["audio", "text", "text"]
    assert "2 timings" in result["content"][1]["text"]
    assert json.loads(result["content"][2]["text"]) == {"alignment": [WORD, LATER]}
    assert result["structuredContent"] == {"alignment": [WORD, LATER]} and result["isError"] is False
    untimed = MemorySink()
    untimed.begin(200, [(b"Content-Type", b"audio/wav")])
    untimed.write(b"RIFF")
    untimed.end(1)
    plain = json.loads(b"".join(_audio(untimed.answer, "x", Hold(BufferBudget(Limits()))).pieces))
    assert len(plain["content"]) == 2 and "structuredContent" not in plain


def test_stall_watch_still_fails_a_silent_timed_stream() -> None:
    """
    A timed stream whose worker goes silent while its reader is ready fails as
    model_unavailable at the stall time, as a raw one does.
    """
    clock = Clock()
    relay, _, _ = relayed(clock)
    relay.dataReceived(frames.frame(frames.AUDIO, b"\x01" * 10))
    for _ in range(5):
        clock.advance(30)
    relay.connectionLost(Failure(ResponseDone()))
    failure = relay.done.result
    relay.done.addErrback(lambda _: None)
    assert isinstance(failure, Failure) and failure.value.code == "model_unavailable"


def test_the_framed_sink_is_for_frames_only_and_holds_a_stream_until_the_floor() -> None:
    """
    A node answers frames only to an Accept naming them, for a timed request; its
    stream sends nothing before the floor of audio (so a failure then is still the
    route's envelope, and aborting writes nothing), then the held frames in their order,
    each read back as it was given, and an end frame with the duration.
    """
    finished = request_with(None).notifyFinish()
    assert framed_sink(request_with(frames.FRAMES), {"text": "x"}, finished) is None
    assert framed_sink(request_with("text/event-stream"), {"timestamps": "word"}, finished) is None
    request = request_with(frames.FRAMES)
    sink = framed_sink(request, {"timestamps": "word", "format": "wav"}, finished)
    assert isinstance(sink, FramedSink)
    sink.begin(200, [(b"Content-Type", b"audio/wav")])
    sink.timestamps([WORD])
    sink.write(b"\x01" * (FLOOR_BYTES - 1))
    assert request.written == [] and not sink.started
    sink.write(b"\x02")
    sink.timestamps([LATER])
    sink.end(14)
    assert request.responseHeaders.getRawHeaders(b"content-type") == [frames.FRAMES.encode()]
    assert request.responseHeaders.getRawHeaders(AUDIO_TYPE_HEADER) == [b"audio/wav"]
    found = merged(frames.FrameReader().feed(b"".join(request.written)))
    assert found == [
        (b"t", [WORD]), (b"a", b"\x01" * (FLOOR_BYTES - 1) + b"\x02"), (b"t", [LATER]), (b"d", {"durationMs": 14}),
    ]
    early = request_with(frames.FRAMES)
    sink = FramedSink(early, "wav", True, finished)
    sink.write(b"\x01" * 10)
    sink.abort(Internal("gone"))
    assert early.written == [] and not sink.started
