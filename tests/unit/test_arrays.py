"""
Tests for reading voicepacks as data (protocol.md section 7, "reference").

The fixtures under data/ were written by numpy.save and torch.save themselves (data/README.md
says how), so the readers are pinned against the real formats rather than against this
file's idea of them.  Larger and odder .pt files are built here by L{torch_zip} and
L{torch_pickle}, which reproduce torch.save's output byte for byte; that was checked against
torch 2.13's own output when they were written, since torch is not a dependency here.
"""

from __future__ import annotations

import io
import math
import pickle
import struct
import sys
import tracemalloc
import zipfile
import zlib
from functools import partial
from pathlib import Path
from typing import Any, Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rhapsode_protocol.errors import BadRequest, Unsupported
from rhapsode_worker._arrays import FloatArray, read_npy, read_pt, read_voicepack

DATA = Path(__file__).parent / "data"
GRID = [i / 4 - 1 for i in range(10)]
VOICE = [i / 4 - 1 for i in range(12)]
MARKER = Path("/tmp/rhapsode-voicepack-unpickled")
STRUCT_CODES = {"2": "e", "4": "f", "8": "d"}
Reader = Callable[..., FloatArray]


def fixture(name: str) -> bytes:
    return (DATA / name).read_bytes()


def torch_pickle(
    shape: tuple[int, ...],
    numel: int,
    *,
    offset: int = 0,
    kind: str = "FloatStorage",
    rebuild: tuple[str, str] = ("torch._utils", "_rebuild_tensor_v2"),
) -> bytes:
    """The data.pkl torch.save writes (pickle protocol 2) for one contiguous tensor."""
    out = bytearray(b"\x80\x02")
    memo = 0

    def put() -> None:
        nonlocal memo
        out.extend(b"q" + bytes([memo]))
        memo += 1

    def text(value: str) -> None:
        out.extend(b"X" + struct.pack("<I", len(value)) + value.encode())
        put()

    def integer(value: int) -> None:
        if value < 256:
            out.extend(b"K" + bytes([value]))
        elif value < 65536:
            out.extend(b"M" + struct.pack("<H", value))
        else:
            out.extend(b"J" + struct.pack("<i", value))

    def name(module: str, attribute: str) -> None:
        out.extend(f"c{module}\n{attribute}\n".encode())
        put()

    def numbers(values: tuple[int, ...]) -> None:
        if not values:
            out.extend(b")")
            return
        out.extend(b"" if len(values) <= 3 else b"(")
        for value in values:
            integer(value)
        out.extend(bytes([0x84 + len(values)]) if len(values) <= 3 else b"t")
        put()

    strides = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    name(*rebuild)
    out.extend(b"((")
    text("storage")
    name("torch", kind)
    text("0")
    text("cpu")
    integer(numel)
    out.extend(b"t")
    put()
    out.extend(b"Q")
    integer(offset)
    numbers(shape)
    numbers(strides)
    out.extend(b"\x89")
    name("collections", "OrderedDict")
    out.extend(b")R")
    put()
    out.extend(b"t")
    put()
    out.extend(b"R")
    put()
    out.extend(b".")
    return bytes(out)


def torch_zip(
    pickled: bytes,
    storage: bytes,
    *,
    prefix: str = "voice",
    byteorder: bytes = b"little",
    serialization_id: bytes = b"1" * 40,
) -> bytes:
    """
    A .pt laid out as torch.save's writer lays it out: members stored, each local header
    padded with an "FB" extra field so its data starts on a 64-byte boundary, sizes in a
    data descriptor, and a zip64 end record ahead of the ordinary one.
    """
    records = [
        ("data.pkl", pickled),
        (".format_version", b"1"),
        (".storage_alignment", b"64"),
        ("byteorder", byteorder),
        ("data/0", storage),
        ("version", b"3\n"),
        (".data/serialization_id", serialization_id),
    ]
    out = bytearray()
    central = bytearray()
    for member, payload in records:
        full = f"{prefix}/{member}".encode()
        offset = len(out)
        pad = -(offset + 30 + len(full) + 4) % 64
        crc = zlib.crc32(payload)
        out += struct.pack(
            "<IHHHHHIIIHH", 0x04034B50, 0, 0x808, 0, 0, 0, 0, 0, 0, len(full), 4 + pad
        )
        out += full + b"FB" + struct.pack("<H", pad) + b"Z" * pad + payload
        out += struct.pack("<IIII", 0x08074B50, crc, len(payload), len(payload))
        central += struct.pack(
            "<IHHHHHHIIIHHHHHII",
            0x02014B50, 0, 0, 0x808, 0, 0, 0, crc, len(payload), len(payload),
            len(full), 0, 0, 0, 0, 0, offset,
        ) + full
    start = len(out)
    out += central
    zip64 = len(out)
    count = len(records)
    out += struct.pack(
        "<IQHHIIQQQQ", 0x06064B50, 44, 0x31E, 0x2D, 0, 0, count, count, len(central), start
    )
    out += struct.pack("<IIQI", 0x07064B50, 0, zip64, 1)
    out += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, len(central), start, 0)
    return bytes(out)


def voicepack(shape: tuple[int, ...], values: list[float], **zip_options: Any) -> bytes:
    """A float32 .pt of C{values} in C{shape}, as torch.save would write it."""
    storage = struct.pack(f"<{len(values)}f", *values)
    return torch_zip(torch_pickle(shape, len(values)), storage, **zip_options)


def npy(header: str, payload: bytes, version: int = 1) -> bytes:
    """A .npy file with a header written by hand, padded as numpy pads it."""
    encoded = header.encode("utf-8" if version == 3 else "latin-1")
    preamble = 10 if version == 1 else 12
    encoded += b" " * (-(preamble + len(encoded) + 1) % 64) + b"\n"
    length = struct.pack("<H" if version == 1 else "<I", len(encoded))
    return b"\x93NUMPY" + bytes([version, 0]) + length + encoded + payload


def head(descr: str = "'<f4'", fortran: str = "False", shape: str = "(1,)") -> str:
    """The text of a .npy header dict, each value given as the literal to write."""
    return f"{{'descr': {descr}, 'fortran_order': {fortran}, 'shape': {shape}}}"


def refusal(reader: Reader, data: bytes, **options: Any) -> str:
    """Read C{data}, expecting a BadRequest; its message."""
    with pytest.raises(BadRequest) as caught:
        reader(data, **options)
    assert caught.value.field == options.get("field", "reference")
    return caught.value.message


def survives(reader: Reader, data: bytes) -> None:
    """C{data} is either read into a consistent array or refused as BadRequest."""
    try:
        result = reader(data)
    except BadRequest:
        return
    assert result.values.typecode == "f"
    assert len(result.values) == math.prod(result.shape)


@pytest.mark.parametrize(
    "name", ["f4_2x5.npy", "f8_2x5.npy", "f2_2x5.npy", "be_f4_2x5.npy", "v2_2x5.npy", "v3_2x5.npy"]
)
def test_npy_fixtures_read_back(name: str) -> None:
    """Every float dtype, both byte orders and all three format versions read as float32."""
    result = read_npy(fixture(name))
    assert result.shape == (2, 5)
    assert result.values.typecode == "f"
    assert result.values.tolist() == GRID


def test_npy_fortran_order_is_transposed_into_c_order() -> None:
    """A Fortran-order array comes back in C order, so each index finds its own element."""
    result = read_npy(fixture("fortran_2x3x4.npy"))
    assert result.shape == (2, 3, 4)
    assert result.values.tolist() == [float(i) for i in range(24)]


def test_npy_integer_dtype_is_refused() -> None:
    """An integer array is bad_request naming its dtype."""
    assert "'<i4'" in refusal(read_npy, fixture("i4_2x5.npy"))


@pytest.mark.parametrize(
    ("data", "complaint"),
    [
        (b"PK\x03\x04" + b"\0" * 60, "\\x93NUMPY"),
        (npy(head(), b"", 4), "version (4, 0)"),
        (b"\x93NUMPY\x01\x00\xff\xff", "over 10000"),
        (b"\x93NUMPY\x02\x00\x10", "preamble"),
        (b"\x93NUMPY\x01\x00\x40\x00{'descr'", "cut off inside its header"),
        (npy("__import__('os').system('true')", b""), "not a Python literal"),
        (npy("[('descr', '<f4')]", b""), "not a dict"),
        (npy("{'descr': '<f4', 'shape': (1,)}", b"\0" * 4), "not a dict"),
        (npy(head(shape="(1,), 'x': 1"), b"\0" * 4), "not a dict"),
        (npy(head(descr="[('a', '<f4')]"), b"\0" * 4), "dtype"),
        (npy(head(descr="'|O'"), b"\0" * 8), "dtype"),
        (npy(head(fortran="0"), b"\0" * 4), "fortran_order or shape"),
        (npy(head(shape="(-1,)"), b""), "fortran_order or shape"),
        (npy(head(shape="(True,)"), b"\0" * 4), "fortran_order or shape"),
        (npy(head(shape="[2]"), b"\0" * 8), "fortran_order or shape"),
        (npy(head(shape="(2, 5)"), b"\0" * 39), "needs 40"),
        (npy(head(shape="(2, 5)"), b"\0" * 41), "needs 40"),
        (npy(head(shape=f"({10**30},)"), b"\0" * 4), "claims more than"),
        (npy(head(shape="(2,)"), b"\0" * 4), "needs"),
        (npy(head(descr="'<f8'"), struct.pack("<d", 1e300)), "range"),
    ],
)
def test_npy_malformed_is_refused_saying_why(data: bytes, complaint: str) -> None:
    """Each way a .npy can be wrong is bad_request with a message saying which way."""
    assert complaint in refusal(read_npy, data)


def test_npy_infinities_survive_conversion() -> None:
    """A float64 infinity or NaN is carried over; only a finite value out of range is refused."""
    header = "{'descr': '<f8', 'fortran_order': False, 'shape': (2,)}"
    values = read_npy(npy(header, struct.pack("<2d", math.inf, math.nan))).values
    assert values[0] == math.inf and math.isnan(values[1])


@pytest.mark.parametrize("name", ["f4_3x1x4.pt", "p4_3x1x4.pt", "f2_3x1x4.pt", "f8_3x1x4.pt"])
def test_pt_fixtures_read_back(name: str) -> None:
    """torch.save's float32, float16 and float64 tensors, pickle protocols 2 and 4, read back."""
    result = read_pt(fixture(name))
    assert result.shape == (3, 1, 4)
    assert result.values.typecode == "f"
    assert result.values.tolist() == VOICE


def test_pt_storage_offset_is_honoured() -> None:
    """A slice saved with its whole storage reads from its offset, not the storage's start."""
    result = read_pt(fixture("sliced_3x4.pt"))
    assert result.shape == (3, 4)
    assert result.values.tolist() == [i / 4 for i in range(8, 20)]


@pytest.mark.parametrize(
    ("name", "complaint"),
    [
        ("transposed_4x5.pt", "non-contiguous tensor (shape (4, 5), strides (1, 4))"),
        ("dict.pt", "dict of 2 entries, not a single tensor"),
        ("i64_3x1x4.pt", "torch.LongStorage"),
        ("parameter.pt", "torch._utils._rebuild_parameter"),
        ("legacy.pt", "not a zip archive"),
    ],
)
def test_pt_other_than_one_float_tensor_is_refused(name: str, complaint: str) -> None:
    """Real torch.save output that is not one contiguous float tensor is refused saying why."""
    assert complaint in refusal(read_pt, fixture(name))


def test_fixture_pickles_are_really_malicious() -> None:
    """
    The malicious fixtures would run their payload if unpickled: an unpickler whose
    find_class only records (and so imports nothing) sees the call each one makes.
    """
    calls: list[tuple[str, str, tuple[Any, ...]]] = []

    class Recorder(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            return lambda *args: calls.append((module, name, args))

    for member in ("evil_os_system.pt", "evil_builtins_exec.pt"):
        with zipfile.ZipFile(DATA / member) as archive:
            Recorder(io.BytesIO(archive.read("voice/data.pkl"))).load()
    assert calls == [
        ("os", "system", (f"touch {MARKER}",)),
        ("builtins", "exec", (f"open({str(MARKER)!r}, 'w').close()",)),
    ]


@pytest.mark.parametrize(
    ("name", "forbidden"),
    [("evil_os_system.pt", "os.system"), ("evil_builtins_exec.pt", "builtins.exec")],
)
def test_malicious_pickle_is_refused_and_never_run(name: str, forbidden: str) -> None:
    """
    A pickle calling os.system or builtins.exec is refused naming the global; its marker
    file is never made, and no module is imported while it is read.
    """
    assert not MARKER.exists(), f"{MARKER} exists before the test; remove it and rerun"
    read_pt(fixture("f4_3x1x4.pt"))  # whatever a successful read imports lazily, first
    before = set(sys.modules)
    message = refusal(read_pt, fixture(name))
    assert set(sys.modules) == before
    assert forbidden in message
    assert not MARKER.exists()


@pytest.mark.parametrize(
    "forbidden",
    [
        ("os", "system"),
        ("posix", "system"),
        ("subprocess", "Popen"),
        ("builtins", "eval"),
        ("builtins", "getattr"),
        ("torch", "load"),
        ("torch._utils", "_rebuild_tensor_v3"),
        ("collections", "defaultdict"),
    ],
)
def test_any_other_global_is_refused(forbidden: tuple[str, str]) -> None:
    """Every global but the tensor rebuild, OrderedDict and torch storage types is refused."""
    data = torch_zip(torch_pickle((1,), 1, rebuild=forbidden), b"\0" * 4)
    assert ".".join(forbidden) in refusal(read_pt, data)


@pytest.mark.parametrize(
    ("pickled", "opcode"),
    [
        (b"\x80\x02(X\x04\x00\x00\x00trueios\nsystem\n.", "INST"),
        (b"\x80\x02(ccollections\nOrderedDict\no.", "OBJ"),
        (b"\x80\x02\x82\x01.", "EXT1"),
        (b"\x80\x02N.", "NONE"),
        (b"\x80\x02P0\n.", "PERSID"),
        (b"\x80\x02}q\x00b.", "BUILD"),
        (b"\x80\x02]q\x00.", "EMPTY_LIST"),
    ],
)
def test_opcodes_torch_never_writes_are_refused(pickled: bytes, opcode: str) -> None:
    """An opcode outside torch.save's subset is refused by name, INST and OBJ included."""
    assert f"opcode {opcode}" in refusal(read_pt, torch_zip(pickled, b""))


def test_forbidden_global_in_a_fresh_file_runs_nothing(tmp_path: Path) -> None:
    """A tensor pickle whose hooks come from os.system is refused before any call."""
    marker = tmp_path / "ran"
    command = f"touch {marker}".encode()
    hooks = b"cos\nsystem\n(X" + struct.pack("<I", len(command)) + command + b"tR"
    pickled = torch_pickle((1,), 1).replace(b"ccollections\nOrderedDict\nq\x08)R", hooks)
    assert pickled != torch_pickle((1,), 1)
    assert "os.system" in refusal(read_pt, torch_zip(pickled, b"\0" * 4))
    assert not marker.exists()


@pytest.mark.parametrize(
    ("data", "complaint"),
    [
        (torch_zip(b"\x80\x02K\x01K\x02.", b""), "other than a single tensor"),
        (torch_zip(b"\x80\x02t.", b""), "closes a mark it never opened"),
        (torch_zip(b"\x80\x02R.", b""), "pops more than it pushed"),
        (torch_zip(b"\x80\x02h\x07.", b""), "memo slot 7"),
        (torch_zip(b"\x80\x02K\x01(K\x02u.", b""), "not a dict"),
        (torch_zip(b"\x80\x02}(K\x01K\x02u.", b""), "not a string"),
        (torch_zip(b"\x80\x02K\x01)R.", b""), "other than a tensor rebuild"),
        (torch_zip(b"\x80\x02ctorch\nFloatStorage\n)R.", b""), "other than a tensor rebuild"),
        (torch_zip(b"\x80\x02K\x01Q.", b""), "not a torch storage"),
        (torch_zip(b"\x80\x02X\x01\x00\x00\x00a\x8c\x01b\x93.", b""), "a.b"),
        (torch_zip(b"\x80\x02K\x01K\x02\x93.", b""), "not a string"),
        (torch_zip(b"\x80\x02K\x01", b""), "not a well-formed pickle"),
        (torch_zip(b"\x80\x02\xff.", b""), "not a well-formed pickle"),
        (torch_zip(torch_pickle((3,), 3).replace(b"\x89", b"K\x05"), b"\0" * 12), "arguments"),
        (torch_zip(torch_pickle((4,), 3), b"\0" * 12), "past the end of its storage"),
        (torch_zip(torch_pickle((2,), 3, offset=2), b"\0" * 12), "past the end of its storage"),
        (torch_zip(torch_pickle((3,), 3), b"\0" * 8), "8 bytes where 3 elements"),
        (torch_zip(torch_pickle((3,), 3, kind="BFloat16Storage"), b"\0" * 6), "BFloat16Storage"),
        (torch_zip(torch_pickle((1,), 1), b"\0" * 4, byteorder=b"middle"), "little nor big"),
        (torch_zip(torch_pickle((1,), 1), b"\0" * 4)[:-22], "not a zip archive"),
        (b"", "not a zip archive"),
    ],
)
def test_pt_malformed_is_refused_saying_why(data: bytes, complaint: str) -> None:
    """Each way a .pt can be wrong is bad_request with a message saying which way."""
    assert complaint in refusal(read_pt, data)


def zipped(members: dict[str, bytes], method: int = zipfile.ZIP_STORED) -> bytes:
    """A zip of C{members} as Python's zipfile writes it, unlike torch's writer."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", method) as archive:
        for name, payload in members.items():
            archive.writestr(name, payload)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("members", "method", "complaint"),
    [
        ({"voice/version": b"3\n"}, zipfile.ZIP_STORED, "exactly one <name>/data.pkl"),
        ({"a/data.pkl": b".", "b/data.pkl": b"."}, zipfile.ZIP_STORED, "exactly one"),
        ({"voice/data.pkl": torch_pickle((1,), 1)}, zipfile.ZIP_STORED, "no voice/data/0"),
        ({"voice/data.pkl": torch_pickle((1,), 1)}, zipfile.ZIP_DEFLATED, "compressed"),
    ],
)
def test_pt_zip_layout_is_checked(members: dict[str, bytes], method: int, complaint: str) -> None:
    """The zip must hold one data.pkl and its storage, stored uncompressed as torch stores them."""
    assert complaint in refusal(read_pt, zipped(members, method))


def test_pt_without_byteorder_record_reads_as_little_endian() -> None:
    """Files from torch before the byteorder record was written read as little-endian."""
    storage = struct.pack("<2f", 1.5, -2)
    data = zipped({"archive/data.pkl": torch_pickle((2,), 2), "archive/data/0": storage})
    result = read_pt(data)
    assert (result.shape, result.values.tolist()) == ((2,), [1.5, -2.0])


def test_pt_big_endian_storage_is_swapped() -> None:
    """A storage written on a big-endian machine, as its byteorder record says, reads right."""
    data = torch_zip(torch_pickle((3,), 3), struct.pack(">3f", 0.5, 2, -8), byteorder=b"big")
    assert read_pt(data).values.tolist() == [0.5, 2.0, -8.0]


@pytest.mark.parametrize("shape", [(510, 1, 256), (510, 256)])
def test_full_size_voicepacks_read_back(shape: tuple[int, ...]) -> None:
    """A Kokoro-sized voicepack, in both layouts seen in the wild, reads back exactly."""
    values = [(i % 97) / 8 - 6 for i in range(math.prod(shape))]
    result = read_pt(voicepack(shape, values, prefix="af_heart"))
    assert result.shape == shape
    assert result.values.tolist() == values


def test_constructed_pack_matches_the_committed_torch_output() -> None:
    """The test's own constructor writes the committed torch.save fixture's exact bytes."""
    real = fixture("f4_3x1x4.pt")
    serial = zipfile.ZipFile(io.BytesIO(real)).read("f4_3x1x4/.data/serialization_id")
    assert voicepack((3, 1, 4), VOICE, prefix="f4_3x1x4", serialization_id=serial) == real


def test_voicepack_dispatches_on_extension() -> None:
    """.npy and .pt in any case go to their readers; contents of the wrong type are bad_request."""
    assert read_voicepack("af_bella.NPY", fixture("f4_2x5.npy")).shape == (2, 5)
    assert read_voicepack("dir.v1/af_bella.pt", fixture("f4_3x1x4.pt")).shape == (3, 1, 4)
    assert "not a zip" in refusal(partial(read_voicepack, "x.pt"), fixture("f4_2x5.npy"))
    assert "NUMPY" in refusal(partial(read_voicepack, "x.npy"), fixture("f4_3x1x4.pt"))


@pytest.mark.parametrize("filename", ["voice.wav", "voice", "voice.pt.zip", "voice.pth", ".npy."])
def test_voicepack_other_extensions_are_unsupported(filename: str) -> None:
    """A filename naming any other type is unsupported, naming the field, before any reading."""
    with pytest.raises(Unsupported) as caught:
        read_voicepack(filename, fixture("f4_3x1x4.pt"), field="voice")
    assert caught.value.field == "voice"
    assert repr(filename) in caught.value.message


def test_refusals_name_the_callers_field() -> None:
    """The field the caller passes is the one a refusal names, as its field and in its message."""
    assert refusal(read_pt, b"junk", field="style").startswith('"style" ')
    assert refusal(read_npy, b"junk", field="style").startswith('"style" ')


def its_own_warnings_are_errors(test: Any) -> Any:
    """
    Every warning the reader raises fails the test; but not a file or socket another
    test left for the garbage collector, which may be collected during this one (it is
    reported where it was dropped, and failed one of these tests at random on a busy box).
    """
    # The mark applied last is read first, so the narrower filters go on top of "error".
    test = pytest.mark.filterwarnings("error")(test)
    test = pytest.mark.filterwarnings("default::ResourceWarning")(test)
    return pytest.mark.filterwarnings("default::pytest.PytestUnraisableExceptionWarning")(test)


@its_own_warnings_are_errors
@pytest.mark.parametrize(
    "name", ["f4_3x1x4.pt", "sliced_3x4.pt", "f4_2x5.npy", "fortran_2x3x4.npy", "v3_2x5.npy"]
)
def test_every_truncation_is_refused(name: str) -> None:
    """Every proper prefix of a valid file is refused as bad_request, never anything else."""
    data = fixture(name)
    reader = read_pt if name.endswith(".pt") else read_npy
    for length in range(len(data)):
        with pytest.raises(BadRequest):
            reader(data[:length])


@its_own_warnings_are_errors
@pytest.mark.parametrize("name", ["f4_3x1x4.pt", "p4_3x1x4.pt", "f2_2x5.npy", "fortran_2x3x4.npy"])
def test_every_single_bit_flip_is_read_or_refused(name: str) -> None:
    """Flipping any one bit of a valid file gives an array or bad_request, never another error."""
    data = bytearray(fixture(name))
    reader = read_pt if name.endswith(".pt") else read_npy
    for bit in range(len(data) * 8):
        data[bit // 8] ^= 1 << bit % 8
        survives(reader, bytes(data))
        data[bit // 8] ^= 1 << bit % 8


@its_own_warnings_are_errors
@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2048), st.sampled_from(["x.npy", "x.pt"]))
def test_random_bytes_are_refused(data: bytes, filename: str) -> None:
    """Random bytes under either extension are bad_request, never another error or a hang."""
    with pytest.raises(BadRequest):
        read_voicepack(filename, data)


@its_own_warnings_are_errors
@settings(max_examples=400, deadline=None)
@given(st.data())
def test_mutated_pickles_in_a_sound_zip_are_read_or_refused(data: st.DataObject) -> None:
    """
    Corrupting data.pkl inside a zip with correct checksums reaches the pickle walker, which
    then reads an array or refuses; flips, overwrites, deletions and insertions all tried.
    """
    original, storage = data.draw(
        st.sampled_from([(torch_pickle((3, 1, 4), 12), 48), (torch_pickle((2,), 20, offset=3), 80)])
    )
    pickled = bytearray(original)
    for _ in range(data.draw(st.integers(1, 4))):
        where = data.draw(st.integers(0, len(pickled) - 1))
        action = data.draw(st.sampled_from(["flip", "set", "delete", "insert"]))
        if action == "flip":
            pickled[where] ^= 1 << data.draw(st.integers(0, 7))
        elif action == "set":
            pickled[where] = data.draw(st.integers(0, 255))
        elif action == "delete":
            del pickled[where]
        else:
            pickled[where:where] = data.draw(st.binary(min_size=1, max_size=8))
    survives(read_pt, torch_zip(bytes(pickled), b"\0" * storage))


@its_own_warnings_are_errors
@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200), st.binary(max_size=64), st.sampled_from([1, 2, 3]))
def test_arbitrary_npy_headers_are_read_or_refused(
    header: str, payload: bytes, version: int
) -> None:
    """Whatever the header text says, a .npy is read or refused as bad_request, never eval'd."""
    if version != 3:
        header = header.encode("utf-8").decode("latin-1")
    survives(read_npy, npy(header, payload, version))


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(["<f4", ">f4", "<f8", ">f8", "<f2", ">f2"]),
    st.booleans(),
    st.lists(st.integers(0, 4), max_size=4).map(tuple),
)
def test_npy_any_float_layout_round_trips(
    descr: str, fortran: bool, shape: tuple[int, ...]
) -> None:
    """Any float dtype, order and shape reads back each element at its C-order index."""
    count = math.prod(shape)
    c_order = [float(i % 64) for i in range(count)]
    # The Fortran-order file holds element (i0, i1, ...) at sum(i_k * prod(shape[:k])).
    strides = [math.prod(shape[k + 1 :]) for k in range(len(shape))]
    layout = c_order
    if fortran:
        layout = [0.0] * count
        for index, value in enumerate(c_order):
            position, step = 0, 1
            for n, stride in zip(shape, strides):
                position += (index // stride % n) * step
                step *= n
            layout[position] = value
    payload = struct.pack(f"{descr[0]}{count}{STRUCT_CODES[descr[2]]}", *layout)
    header = f"{{'descr': '{descr}', 'fortran_order': {fortran}, 'shape': {shape!r}, }}"
    result = read_npy(npy(header, payload))
    assert (result.shape, result.values.tolist()) == (shape, c_order)


def test_oversized_claims_are_refused_before_allocating() -> None:
    """Claims of huge sizes are refused from the header alone, before any allocation."""
    huge = npy(head(shape=f"({2**40}, {2**40})"), b"")
    assert "claims more than" in refusal(read_npy, huge)
    claim = torch_zip(torch_pickle((2**31 - 1,), 2**31 - 1), b"\0" * 4)
    assert "claims more than" in refusal(read_pt, claim)


def test_a_shape_whose_size_python_cannot_print_is_refused() -> None:
    """
    A shape of numbers that multiply past 4300 digits (more than Python will turn into
    a string) is refused as bad_request, not a ValueError from formatting the message.
    """
    assert "claims more than" in refusal(read_npy, npy(head(shape=f"({10**4000}, {10**4000})"), b""))


@pytest.mark.parametrize("reader", [read_npy, read_pt], ids=["npy", "pt"])
def test_more_values_than_a_voicepack_holds_are_refused_before_decoding(reader: Reader) -> None:
    """
    A file that honestly holds 2 million float16 values (4 MB: an upload of 25 MB holds
    12 million) is refused from its header, with next to nothing allocated; decoded,
    each value would be a Python float on the way, 64 MB for these.
    """
    count = 2_000_000
    if reader is read_npy:
        data = npy(head(descr="'<f2'", shape=f"({count},)"), bytes(2 * count))
    else:
        data = torch_zip(torch_pickle((count,), count, kind="HalfStorage"), bytes(2 * count))
    tracemalloc.start()
    try:
        message = refusal(reader, data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "claims more than" in message
    assert peak < 1_000_000


def test_float16_in_fortran_order_decodes_within_bounded_memory() -> None:
    """
    A quarter of a million float16 values in Fortran order (the costliest layout)
    decode with under 6 MB allocated at once: the float32 result and its source (1 MB
    each), the order's offsets (2 MB) and one bounded batch of Python floats, never a
    float or an int per value alive at once (that took 13 MB).
    """
    count = 1 << 18
    shape = (count // 512, 512)
    data = npy(head(descr="'<f2'", fortran="True", shape=repr(shape)), bytes(2 * count))
    tracemalloc.start()
    try:
        result = read_npy(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert result.shape == shape and len(result.values) == count
    assert peak < 6_000_000
