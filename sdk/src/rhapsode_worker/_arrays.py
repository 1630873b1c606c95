"""
Voicepacks read as data (protocol.md section 7, "reference"): a .npy array, or a .pt file
as torch.save writes it, turned into float32 values without unpickling anything.

A .pt file is a zip whose data.pkl is a pickle, and loading that with pickle runs whatever
the uploader wrote.  Here the pickle is only walked, opcode by opcode, by a stack machine
that knows the few opcodes and names torch.save writes for one tensor and refuses every
other one, so nothing named in the file is ever imported or called.
"""

from __future__ import annotations

import ast
import io
import math
import pickletools
import struct
import sys
import zipfile
from array import array
from dataclasses import dataclass
from typing import Any, cast

from rhapsode_protocol.errors import BadRequest, Unsupported


@dataclass(frozen=True)
class FloatArray:
    """
    A float32 array in C order: the last index varies fastest through C{values}.
    """

    shape: tuple[int, ...]
    values: array[float]


# Element codes are struct's: "e" half, "f" single, "d" double.
_NPY_TYPES = {"f2": "e", "f4": "f", "f8": "d"}
_TORCH_STORAGES = {"HalfStorage": "e", "FloatStorage": "f", "DoubleStorage": "d"}
_REBUILD = ("torch._utils", "_rebuild_tensor_v2")
_ORDERED_DICT = ("collections", "OrderedDict")
# numpy refuses longer headers by default too; it bounds what literal_eval is given.
_MAX_HEADER = 10_000
#: The most values a voicepack may hold, checked from its header before any is decoded:
#: eight times a Kokoro voicepack (510 x 1 x 256).  Decoding goes through Python
#: floats, so an upload's worth of float16 would otherwise cost twenty times its size.
MAX_VALUES = 1 << 20
# Half floats decoded at a time, so no tuple of every value is ever built.
_HALVES_AT_ONCE = 1 << 16


def _bad(field: str, problem: str) -> BadRequest:
    return BadRequest(f'"{field}" {problem}', field=field)


def _floats(raw: bytes, code: str, little: bool, field: str) -> array[float]:
    """Decode packed elements of C{code}, in the given byte order, into float32."""
    if code == "e":
        halves = array("f")
        order = "<" if little else ">"
        for start in range(0, len(raw) - 1, 2 * _HALVES_AT_ONCE):
            piece = raw[start : start + 2 * _HALVES_AT_ONCE]
            halves.extend(struct.unpack(f"{order}{len(piece) // 2}e", piece))
        return halves
    wide = array(code, raw)
    if little != (sys.byteorder == "little"):
        wide.byteswap()
    if code == "f":
        return wide  # type: ignore[return-value]  # array("f") holds floats
    values = array("f", wide)
    # array() turns a double beyond float32's range into infinity without a word.
    if any(math.isinf(narrow) and not math.isinf(x) for x, narrow in zip(wide, values)):
        raise _bad(field, "holds float64 values beyond float32's range")
    return values


def _is_shape(value: object) -> bool:
    return isinstance(value, tuple) and all(type(n) is int and n >= 0 for n in value)


def _check_size(shape: tuple[int, ...], max_values: int, field: str) -> int:
    """
    The number of values C{shape} holds, refused over C{max_values}.  The count is never
    printed: a header's numbers can multiply past what Python will turn into a string.
    """
    count = math.prod(shape)
    if count > max_values:
        raise _bad(field, f"claims more than {max_values} values; a voicepack holds fewer")
    return count


def read_npy(data: bytes, *, field: str = "reference", max_values: int = MAX_VALUES) -> FloatArray:
    """
    Read a .npy file (format 1.0, 2.0 or 3.0) of float16, float32 or float64, either
    byte order, as float32.  A Fortran-order array is transposed into C order.

    @raise BadRequest: naming C{field}, for anything else or anything malformed, or for
        an array of more than C{max_values} values.
    """
    if data[:6] != b"\x93NUMPY":
        raise _bad(field, "is not a .npy file: it does not start with \\x93NUMPY")
    version = tuple(data[6:8])
    if version == (1, 0):
        start, length_format = 10, "<H"
    elif version in ((2, 0), (3, 0)):
        start, length_format = 12, "<I"
    else:
        raise _bad(field, f"is a .npy file of version {version}; 1.0, 2.0 and 3.0 are read")
    if len(data) < start:
        raise _bad(field, "is a .npy file cut off inside its preamble")
    (length,) = struct.unpack_from(length_format, data, 8)
    if length > _MAX_HEADER:
        raise _bad(field, f"has a .npy header of {length} bytes, over {_MAX_HEADER}")
    end = start + length
    if len(data) < end:
        raise _bad(field, "is a .npy file cut off inside its header")
    try:
        text = data[start:end].decode("utf-8" if version == (3, 0) else "latin-1")
        header = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        raise _bad(field, "has a .npy header that is not a Python literal") from None
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        raise _bad(field, "has a .npy header that is not a dict of descr, fortran_order, shape")
    descr, fortran, shape = header["descr"], header["fortran_order"], header["shape"]
    if not (isinstance(descr, str) and descr[:1] in "<>" and descr[1:] in _NPY_TYPES):
        raise _bad(field, f"has dtype {descr!r:.40}; float16, float32 or float64 is read")
    if not isinstance(fortran, bool) or not _is_shape(shape):
        raise _bad(field, "has a .npy header whose fortran_order or shape is malformed")
    code = _NPY_TYPES[descr[1:]]
    expected = _check_size(shape, max_values, field) * struct.calcsize(code)
    if len(data) - end != expected:
        raise _bad(field, f"has {len(data) - end} bytes of data where shape {shape} of "
                   f"{descr} needs {expected}")
    values = _floats(data[end:], code, descr[0] == "<", field)
    if fortran:
        values = _c_order(values, shape)
    return FloatArray(shape, values)


def _c_order(values: array[float], shape: tuple[int, ...]) -> array[float]:
    """Reorder the elements of a Fortran-order array of C{shape} into C order."""
    # Offsets in an array of machine integers: a list of Python ints costs five times
    # as much for every value.
    offsets = array("q", [0])
    stride = 1
    for n in shape:
        # Each axis in turn becomes the fastest-varying one of the offsets built so far,
        # which leaves the last axis fastest; its step in Fortran order is C{stride}.
        offsets = array("q", (offset + i * stride for offset in offsets for i in range(n)))
        stride *= n
    return array("f", (values[offset] for offset in offsets))


@dataclass(frozen=True)
class _Global:
    """A name the pickle refers to; only ever compared, never resolved."""

    module: str
    name: str


@dataclass(frozen=True)
class _Storage:
    kind: str
    key: str
    numel: int


@dataclass(frozen=True)
class _Tensor:
    storage: _Storage
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _allowed(module: str, name: str, field: str) -> _Global:
    storage_type = module == "torch" and name.endswith("Storage") and name.isidentifier()
    if (module, name) not in (_REBUILD, _ORDERED_DICT) and not storage_type:
        raise _bad(field, f"has a pickle that refers to {module}.{name}, which a single "
                   "tensor has no use for; it was refused and nothing in it was run")
    return _Global(module, name)


def _persistent(pid: object, field: str) -> _Storage:
    """Resolve the persistent id torch.save writes for a storage, without loading it."""
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
            and isinstance(pid[1], _Global) and pid[1].module == "torch"
            and isinstance(pid[2], str) and isinstance(pid[3], str)
            and type(pid[4]) is int and pid[4] >= 0):
        raise _bad(field, "has a pickle with a persistent id that is not a torch storage")
    return _Storage(pid[1].name, pid[2], pid[4])


def _call(func: object, args: object, field: str) -> object:
    """The two calls a torch.save pickle of one tensor makes, done as data."""
    if func == _Global(*_ORDERED_DICT) and args == ():
        return {}
    if func != _Global(*_REBUILD):
        raise _bad(field, "has a pickle that calls something other than a tensor rebuild")
    if not (isinstance(args, tuple) and len(args) == 6 and isinstance(args[0], _Storage)
            and type(args[1]) is int and args[1] >= 0 and _is_shape(args[2])
            and isinstance(args[3], tuple) and len(args[3]) == len(args[2])
            and all(type(n) is int for n in args[3])
            and isinstance(args[4], bool) and args[5] == {}):
        raise _bad(field, "has a pickle whose tensor rebuild has arguments torch.save never writes")
    return _Tensor(args[0], args[1], args[2], args[3])


def _walk(pickle: bytes, field: str) -> _Tensor:
    """Interpret a data.pkl as far as torch.save's output for one tensor goes."""
    stack: list[Any] = []
    frames: list[list[Any]] = []
    memo: dict[int, Any] = {}

    def pop(n: int) -> list[Any]:
        if len(stack) < n:
            raise _bad(field, "has a pickle that pops more than it pushed")
        taken = stack[len(stack) - n:]
        del stack[len(stack) - n:]
        return taken

    def close_mark() -> list[Any]:
        nonlocal stack
        if not frames:
            raise _bad(field, "has a pickle that closes a mark it never opened")
        items, stack = stack, frames.pop()
        return items

    try:
        for opcode, arg, _ in pickletools.genops(pickle):
            name = opcode.name
            # genops itself ends the walk at STOP, and raises if it never comes.
            if name in ("PROTO", "FRAME", "STOP"):
                continue
            if name in ("BINUNICODE", "SHORT_BINUNICODE", "BININT", "BININT1", "BININT2"):
                stack.append(arg)
            elif name in ("NEWTRUE", "NEWFALSE"):
                stack.append(name == "NEWTRUE")
            elif name == "EMPTY_TUPLE":
                stack.append(())
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                stack.append(tuple(pop(int(name[-1]))))
            elif name == "MARK":
                frames.append(stack)
                stack = []
            elif name == "TUPLE":
                items = close_mark()
                stack.append(tuple(items))
            elif name == "EMPTY_DICT":
                stack.append({})
            elif name == "SETITEMS":
                items = close_mark()
                target = pop(1)[0]
                if not isinstance(target, dict) or len(items) % 2:
                    raise _bad(field, "has a pickle that sets items on something not a dict")
                for key, value in zip(items[::2], items[1::2]):
                    if not isinstance(key, str):
                        raise _bad(field, "has a pickle with a dict key that is not a string")
                    target[key] = value
                stack.append(target)
            elif name == "GLOBAL":
                module, _, attribute = str(arg).partition(" ")
                stack.append(_allowed(module, attribute, field))
            elif name == "STACK_GLOBAL":
                module, attribute = pop(2)
                if not (isinstance(module, str) and isinstance(attribute, str)):
                    raise _bad(field, "has a pickle naming a global with something not a string")
                stack.append(_allowed(module, attribute, field))
            elif name in ("BINPUT", "LONG_BINPUT", "MEMOIZE"):
                (value,) = pop(1)
                stack.append(value)
                memo[len(memo) if name == "MEMOIZE" else cast(int, arg)] = value
            elif name in ("BINGET", "LONG_BINGET"):
                if arg not in memo:
                    raise _bad(field, f"has a pickle that reads memo slot {arg} before writing it")
                stack.append(memo[arg])
            elif name == "BINPERSID":
                stack.append(_persistent(pop(1)[0], field))
            elif name == "REDUCE":
                func, args = pop(2)
                stack.append(_call(func, args, field))
            else:
                raise _bad(field, f"has a pickle using opcode {name}, which torch.save does "
                           "not write for a tensor; it was refused and nothing in it was run")
    # genops decodes a STRING argument with codecs.escape_decode, which warns about a bad
    # escape; where warnings are errors, that warning is how the malformed pickle shows.
    except (ValueError, DeprecationWarning) as error:
        raise _bad(field, f"has a data.pkl that is not a well-formed pickle ({error})") from None
    result = stack[0] if len(stack) == 1 and not frames else None
    if isinstance(result, dict):
        raise _bad(field, f"holds a dict of {len(result)} entries, not a single tensor; "
                   "save the voicepack tensor itself")
    if not isinstance(result, _Tensor):
        raise _bad(field, "holds something other than a single tensor")
    return result


def read_pt(data: bytes, *, field: str = "reference", max_values: int = MAX_VALUES) -> FloatArray:
    """
    Read a .pt file as torch.save writes it (a zip, torch 1.6 on) holding one contiguous
    tensor of float16, float32 or float64, as float32.  Nothing is unpickled.

    @raise BadRequest: naming C{field}, for anything else or anything malformed, or for
        a tensor of more than C{max_values} values.
    """
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
    except Exception as error:  # zipfile's failures on hostile input are not a closed set
        raise _bad(
            field, f"is not a zip archive as torch.save writes since torch 1.6 ({error})"
        ) from None
    if len(pickles) != 1:
        raise _bad(field, "is a zip without exactly one <name>/data.pkl, so not a torch.save file")
    prefix = pickles[0][: -len("data.pkl")]
    tensor = _walk(_member(archive, pickles[0], field), field)
    storage, shape = tensor.storage, tensor.shape
    code = _TORCH_STORAGES.get(storage.kind)
    if code is None:
        raise _bad(
            field, f"is a tensor of torch.{storage.kind}; float16, float32 or float64 is read"
        )
    count, expected = _check_size(shape, max_values, field), 1
    for n, step in reversed(list(zip(shape, tensor.stride))):
        if count and n != 1 and step != expected:
            raise _bad(field, f"is a non-contiguous tensor (shape {shape}, strides "
                       f"{tensor.stride}); save tensor.contiguous() instead")
        expected *= n
    if tensor.offset + count > storage.numel:
        raise _bad(field, "is a tensor that reaches past the end of its storage")
    order = b"little"
    if f"{prefix}byteorder" in archive.namelist():
        order = _member(archive, f"{prefix}byteorder", field)
        if order not in (b"little", b"big"):
            raise _bad(field, "has a byteorder record that is neither little nor big")
    raw = _member(archive, f"{prefix}data/{storage.key}", field)
    size = struct.calcsize(code)
    if len(raw) != storage.numel * size:
        raise _bad(field, f"has a storage of {len(raw)} bytes where {storage.numel} elements "
                   f"of torch.{storage.kind} need {storage.numel * size}")
    start = tensor.offset * size
    values = _floats(raw[start : start + count * size], code, order == b"little", field)
    return FloatArray(shape, values)


def _member(archive: zipfile.ZipFile, name: str, field: str) -> bytes:
    """A stored member's bytes; a compressed one is refused, so no entry can inflate."""
    try:
        info = archive.getinfo(name)
    except KeyError:
        raise _bad(field, f"is a torch.save zip with no {name}") from None
    if info.compress_type != zipfile.ZIP_STORED:
        raise _bad(field, f"has {name} compressed, which torch.save never does")
    try:
        return archive.read(info)
    except Exception as error:  # as in read_pt: a hostile zip fails in many ways
        raise _bad(field, f"has {name} unreadable ({error})") from None


def read_voicepack(
    filename: str, data: bytes, *, field: str = "reference", max_values: int = MAX_VALUES
) -> FloatArray:
    """
    Read a voicepack by the type its filename names: .npy or .pt.

    @raise Unsupported: for any other extension.
    @raise BadRequest: for a file of the right type and the wrong contents, or of more
        than C{max_values} values.
    """
    extension = filename.rpartition(".")[2].lower() if "." in filename else ""
    if extension == "npy":
        return read_npy(data, field=field, max_values=max_values)
    if extension == "pt":
        return read_pt(data, field=field, max_values=max_values)
    raise Unsupported(f'"{field}" {filename!r} is not a .npy or .pt voicepack', field=field)
