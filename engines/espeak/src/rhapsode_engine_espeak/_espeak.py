"""
libespeak-ng through ctypes: the library and the espeak-ng-data that the espeakng-loader
wheel ships, found through that package's own get_library_path and get_data_path.

libespeak-ng keeps all its state in globals and is not re-entrant, so L{Espeak} owns one
thread and makes every call into the library on it, from espeak_Initialize to the synthesis
callback; nothing else ever touches the library.

Synthesis runs in AUDIO_OUTPUT_SYNCHRONOUS mode: espeak_Synth returns when the text is
spoken, calling the synthesis callback with each L{BUFFER_MS} of PCM as it makes it.  The
callback hands each chunk to a bounded queue that the speaking generator reads, so audio
leaves while espeak is still speaking, and espeak waits when the reader falls behind.  PCM
comes in the machine's byte order, which is little-endian on every platform the wheel is
built for.
"""

from __future__ import annotations

import ctypes
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping, TypeVar

import espeakng_loader

from ._catalogue import VoiceRecord, dictionary_name
from ._timings import RAW_EVENT

SAMPLE_RATE = 22050
#: Audio per synthesis callback: few enough calls to cost nothing next to the synthesis,
#: and each still a small fraction of a second.
BUFFER_MS = 200
#: Chunks espeak may run ahead of its reader: about a second and a half of audio.
QUEUE_CHUNKS = 8
#: What every voice that really speaks can say, whatever its script: a letter "a".
PROBE_TEXT = "a"

_AUDIO_OUTPUT_SYNCHRONOUS = 2
_INITIALIZE_DONT_EXIT = 0x8000
# Phoneme events, named in IPA, beside the word and clause events espeak always sends:
# the callback is told more, the audio is the same bytes.
_INITIALIZE_PHONEME_EVENTS = 0x0001
_INITIALIZE_PHONEME_IPA = 0x0002
_POS_CHARACTER = 1
_CHARS_UTF8 = 0x1
_ENDPAUSE = 0x1000
_EE_OK = 0

_T = TypeVar("_T")
#: What the callback hands each buffer to, with its events when they were asked for.
_Sink = Callable[[bytes, "bytes | None"], bool]


class _Voice(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("languages", ctypes.c_void_p),
        ("identifier", ctypes.c_char_p),
        ("gender", ctypes.c_ubyte),
        ("age", ctypes.c_ubyte),
        ("variant", ctypes.c_ubyte),
        ("xx1", ctypes.c_ubyte),
        ("score", ctypes.c_int),
        ("spare", ctypes.c_void_p),
    ]


class _Event(ctypes.Structure):
    """espeak_EVENT (speak_lib.h); id is a union, read here as its 8-byte string."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("unique_identifier", ctypes.c_uint),
        ("text_position", ctypes.c_int),
        ("length", ctypes.c_int),
        ("audio_position", ctypes.c_int),
        ("sample", ctypes.c_int),
        ("user_data", ctypes.c_void_p),
        ("id", ctypes.c_char * 8),
    ]


_PHONEME = 7

# The samples (short *) and the events (espeak_EVENT *) come as plain addresses: a
# ctypes pointer object made for each of them on every call cost more than reading them.
_SYNTH_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)

assert RAW_EVENT.size == ctypes.sizeof(_Event), "espeak_EVENT's layout is not the one read"
_EVENT_TYPE = ctypes.c_int.from_address  # an event's first field, its type


def _events(address: int | None) -> bytes:
    """
    The callback's event list at C{address}, up to its terminator (type 0), copied out
    as its bytes (L{RAW_EVENT} each), which are read off espeak's thread: the callback
    only finds where the list ends.
    """
    if not address:
        return b""
    end = address
    while _EVENT_TYPE(end).value != 0:
        end += RAW_EVENT.size
    return ctypes.string_at(address, end - address) if end != address else b""


def _declare(lib: ctypes.CDLL) -> None:
    lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    lib.espeak_Initialize.restype = ctypes.c_int
    lib.espeak_Terminate.argtypes = []
    lib.espeak_Terminate.restype = ctypes.c_int
    lib.espeak_Info.argtypes = [ctypes.c_void_p]
    lib.espeak_Info.restype = ctypes.c_char_p
    lib.espeak_ListVoices.argtypes = [ctypes.POINTER(_Voice)]
    lib.espeak_ListVoices.restype = ctypes.POINTER(ctypes.POINTER(_Voice))
    lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
    lib.espeak_SetVoiceByName.restype = ctypes.c_int
    lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.espeak_SetParameter.restype = ctypes.c_int
    lib.espeak_SetSynthCallback.argtypes = [_SYNTH_CALLBACK]
    lib.espeak_SetSynthCallback.restype = None
    lib.espeak_Synth.argtypes = [
        ctypes.c_char_p,
        ctypes.c_size_t,
        ctypes.c_uint,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.c_uint,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    lib.espeak_Synth.restype = ctypes.c_int


def _languages(address: int | None) -> tuple[tuple[int, str], ...]:
    """
    espeak_VOICE.languages: a priority byte then a NUL-terminated code, repeated, ended
    by a zero priority.
    """
    found: list[tuple[int, str]] = []
    if not address:
        return ()
    while priority := ctypes.c_ubyte.from_address(address).value:
        code = ctypes.string_at(address + 1)
        found.append((priority, code.decode("utf-8")))
        address += len(code) + 2
    return tuple(found)


@dataclass(frozen=True)
class Survey:
    """
    What espeak offers: its version, the voices that speak (languages), and the variants.
    """

    version: str
    voices: tuple[VoiceRecord, ...]
    variants: tuple[VoiceRecord, ...]


@dataclass
class _Stream:
    """
    One synthesis on its way out: chunks for the reader (each with its events, when
    they were asked for), C{None} once espeak is done.
    """

    chunks: "queue.Queue[tuple[bytes, bytes | None] | None]"
    cancelled: threading.Event

    def deliver(self, pcm: bytes, events: bytes | None) -> bool:
        if self.cancelled.is_set():
            return False
        self.chunks.put((pcm, events))
        return True


class Espeak:
    """
    libespeak-ng, every call on one thread of its own.
    """

    def __init__(self) -> None:
        self._lib = ctypes.CDLL(espeakng_loader.get_library_path())
        _declare(self._lib)
        self._data = espeakng_loader.get_data_path().encode()
        self._owner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="espeak-ng")
        # Kept referenced: espeak holds only the C pointer.
        self._callback = _SYNTH_CALLBACK(self._on_audio)
        self._sink: _Sink | None = None
        # Whether the synthesis under way reports its events beside its audio.
        self._with_events = False
        self._initialised = False

    def _on(self, call: Callable[..., _T], *args: object) -> _T:
        return self._owner.submit(call, *args).result()

    def survey(self) -> Survey:
        """
        Blocking: espeak's version, its voices that really speak (each whose
        dictionary the wheel ships says L{PROBE_TEXT} aloud), and its variants.  Leaves
        the library as it found it.
        """
        return self._on(self._survey)

    def start(self) -> None:
        """
        Blocking: initialise the library (phoneme data, the synthesis callback).
        """
        self._on(self._initialise)

    def stop(self) -> None:
        """
        Blocking: release everything the library holds.
        """
        self._on(self._terminate)

    def stream(
        self, voice: str, text: str, settings: Mapping[int, int], end_pause: bool
    ) -> Iterator[bytes]:
        """
        Blocking: speak C{text} in the espeak voice named C{voice} ("gmw/en-US+f3"), with
        espeak_SetParameter C{settings}, yielding PCM as espeak makes it.  C{end_pause}
        ends the audio with the pause espeak puts after the text's last clause, scaled
        to the rate; without it the audio stops with the last sound.

        Closing the generator early stops espeak at its next chunk.
        """
        for pcm, _ in self._run(voice, text, settings, end_pause):
            yield pcm

    def stream_events(
        self, voice: str, text: str, settings: Mapping[int, int], end_pause: bool
    ) -> Iterator[tuple[bytes, bytes]]:
        """
        L{stream}, each buffer of PCM with the events espeak reported with it (the
        words, phonemes and clause ends whose first sample it holds), as their bytes
        (L{rhapsode_engine_espeak._timings.RAW_EVENT} each).
        """
        for pcm, events in self._run(voice, text, settings, end_pause, True):
            yield pcm, events or b""

    def _run(
        self, voice: str, text: str, settings: Mapping[int, int], end_pause: bool, events: bool = False
    ) -> Iterator[tuple[bytes, bytes | None]]:
        stream = _Stream(queue.Queue(maxsize=QUEUE_CHUNKS), threading.Event())
        flags = _CHARS_UTF8 | (_ENDPAUSE if end_pause else 0)
        job = self._owner.submit(self._stream, stream, voice, text, settings, flags, events)
        finished = False
        try:
            while (chunk := stream.chunks.get()) is not None:
                yield chunk
            finished = True
        finally:
            if not finished:
                stream.cancelled.set()
                # Draining frees a callback blocked on the full queue to see the cancel.
                while stream.chunks.get() is not None:
                    pass
        job.result()

    # -- on the owner thread ----------------------------------------------------------

    def _initialise(self) -> None:
        if self._initialised:
            self._terminate()
        options = _INITIALIZE_DONT_EXIT | _INITIALIZE_PHONEME_EVENTS | _INITIALIZE_PHONEME_IPA
        rate = self._lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, BUFFER_MS, self._data, options)
        if rate != SAMPLE_RATE:
            raise RuntimeError(f"espeak_Initialize answered {rate}, not {SAMPLE_RATE} Hz")
        self._lib.espeak_SetSynthCallback(self._callback)
        self._initialised = True

    def _terminate(self) -> None:
        if self._initialised:
            self._lib.espeak_Terminate()
            self._initialised = False

    def _survey(self) -> Survey:
        resident = self._initialised
        if not resident:
            self._initialise()
        try:
            version = (self._lib.espeak_Info(None) or b"").decode()
            voices = self._list(None)
            spec = _Voice()
            spec.languages = ctypes.cast(ctypes.c_char_p(b"variant"), ctypes.c_void_p)
            variants = self._list(spec)
            speaking = tuple(
                v for v in voices if self._has_dictionary(v.identifier) and self._speaks(v.identifier)
            )
        finally:
            if not resident:
                self._terminate()
        return Survey(version, speaking, variants)

    def _list(self, spec: _Voice | None) -> tuple[VoiceRecord, ...]:
        found = self._lib.espeak_ListVoices(ctypes.byref(spec) if spec is not None else None)
        records: list[VoiceRecord] = []
        i = 0
        while found[i]:
            v = found[i].contents
            records.append(
                VoiceRecord(
                    name=(v.name or b"").decode("utf-8").strip(),
                    identifier=(v.identifier or b"").decode("utf-8"),
                    gender=v.gender,
                    age=v.age,
                    languages=_languages(v.languages),
                )
            )
            i += 1
        return tuple(records)

    def _has_dictionary(self, voice: str) -> bool:
        """
        Whether the dictionary the voice loads is in the wheel's data.  The wheel lists
        voices whose dictionaries it does not ship (Faroese, Karakalpak, Xextan), and
        selecting one has libespeak-ng print "Can't read dictionary file" to the
        process's stderr, where nothing can catch it; so those are never probed.
        """
        data = Path(self._data.decode())
        for folder in ("voices", "lang"):
            path = data / folder / voice
            if path.is_file():
                name = dictionary_name(path.read_text(encoding="utf-8", errors="replace"))
                return name is None or (data / f"{name}_dict").is_file()
        return True  # a file it did not find where espeak keeps them: the probe decides

    def _speaks(self, voice: str) -> bool:
        heard = bytearray()

        def keep(pcm: bytes, events: bytes | None) -> bool:
            heard.extend(pcm)
            return True

        self._synthesise(voice, PROBE_TEXT, {}, _CHARS_UTF8, keep)
        return any(heard)

    def _stream(
        self, stream: _Stream, voice: str, text: str, settings: Mapping[int, int], flags: int, events: bool
    ) -> None:
        try:
            self._synthesise(voice, text, settings, flags, stream.deliver, events)
        finally:
            stream.chunks.put(None)

    def _synthesise(
        self, voice: str, text: str, settings: Mapping[int, int], flags: int, sink: _Sink, events: bool = False
    ) -> None:
        if not self._initialised:
            raise RuntimeError("eSpeak NG is not initialised")
        status = self._lib.espeak_SetVoiceByName(voice.encode("utf-8"))
        if status != _EE_OK:
            raise RuntimeError(f"espeak cannot select the voice {voice!r} (status {status})")
        # Parameters outlive a synthesis in espeak's globals: every one is set each time.
        for parameter, value in settings.items():
            self._lib.espeak_SetParameter(parameter, value, 0)
        data = text.encode("utf-8") + b"\0"
        self._sink = sink
        self._with_events = events
        try:
            status = self._lib.espeak_Synth(data, len(data), 0, _POS_CHARACTER, 0, flags, None, None)
        finally:
            self._sink = None
            self._with_events = False
        if status != _EE_OK:
            raise RuntimeError(f"espeak_Synth failed (status {status})")

    def _on_audio(self, wav: int | None, count: int, events: int | None) -> int:
        """
        espeak's synthesis callback: 0 to go on, 1 to stop.  It must not raise (ctypes
        would print the error and carry on).  Events are read only for a synthesis
        that asked for them.
        """
        sink = self._sink
        if sink is None:
            return 1
        found = _events(events) if self._with_events else None
        if count <= 0 or not wav:
            if found:
                return 0 if sink(b"", found) else 1
            return 0
        return 0 if sink(ctypes.string_at(wav, count * 2), found) else 1
