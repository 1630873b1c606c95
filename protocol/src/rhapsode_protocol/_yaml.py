"""
A small deterministic YAML emitter, for writing the generated OpenAPI documents.

It writes block style, keeps dict insertion order, and double-quotes every string that
is not a plain, unambiguous word, so the same document always gives the same bytes and
any YAML loader reads back exactly what went in.  No third-party YAML library is needed
to generate the documents; tests check the output with one.
"""

from __future__ import annotations

import math
import re
from typing import Any

# A string written bare must read back as that string: no indicator characters, no
# ": " or " #", no leading or trailing space, and not starting the way a number, a
# date or an anchor does.  Anything else is quoted, which is always correct.
_PLAIN = re.compile(r"[A-Za-z_/$][A-Za-z0-9_/$.{}()',;+-]*(?: [A-Za-z0-9_/$.{}()',;+-]+)*")

# Words YAML 1.1 loaders (PyYAML among them) read as booleans or null.
_RESERVED = frozenset({"y", "n", "yes", "no", "on", "off", "true", "false", "null"})

_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _quote(text: str) -> str:
    out = ['"']
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ch.isprintable():
            out.append(ch)
        elif ord(ch) <= 0xFFFF:
            # Line separators and control characters would be folded or refused raw.
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    out.append('"')
    return "".join(out)


def _string(text: str) -> str:
    if _PLAIN.fullmatch(text) and text.lower() not in _RESERVED:
        return text
    return _quote(text)


def _float(value: float) -> str:
    if math.isnan(value):
        return ".nan"
    if math.isinf(value):
        return ".inf" if value > 0 else "-.inf"
    text = repr(value)
    # YAML 1.1 reads 1e+20 as a string: its float form needs a dot in the mantissa.
    if "e" in text and "." not in text:
        mantissa, exponent = text.split("e")
        text = f"{mantissa}.0e{exponent}"
    return text


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _float(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, dict) and not value:
        return "{}"
    if isinstance(value, list) and not value:
        return "[]"
    raise TypeError(f"cannot write {type(value).__name__} as YAML")


def _is_block(value: Any) -> bool:
    return isinstance(value, (dict, list)) and bool(value)


def _lines(value: Any, indent: int) -> list[str]:
    pad = " " * indent
    out: list[str] = []
    if isinstance(value, dict) and value:
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"mapping keys must be strings, not {type(key).__name__}")
            if _is_block(item):
                out.append(f"{pad}{_string(key)}:")
                out.extend(_lines(item, indent + 2))
            else:
                out.append(f"{pad}{_string(key)}: {_scalar(item)}")
    elif isinstance(value, list) and value:
        for item in value:
            if _is_block(item):
                nested = _lines(item, indent + 2)
                # The item's first line shares the dash's line; the rest keep its indent.
                out.append(f"{pad}- {nested[0][indent + 2:]}")
                out.extend(nested[1:])
            else:
                out.append(f"{pad}- {_scalar(item)}")
    else:
        out.append(pad + _scalar(value))
    return out


def dump_yaml(obj: Any) -> str:
    """
    Write C{obj} (dicts with string keys, lists, str, int, float, bool, None) as a
    block-style YAML document ending in a newline.

    @raise TypeError: for any other type, or a mapping key that is not a string.
    """
    return "\n".join(_lines(obj, 0)) + "\n"
