"""
Blend recipes (protocol.md section 7): C{name(weight)+name(weight)}, each weight optional
and 1 when absent, positive, normalised so the weights sum to 1.
"""

from __future__ import annotations

import math
import re

from rhapsode_protocol.errors import BadRequest
from rhapsode_protocol.schemas import VOICE_ID_PATTERN

_VOICE_ID = re.compile(VOICE_ID_PATTERN)

_TERM = re.compile(r"^\s*([^()+\s]+)\s*(?:\(\s*([^()]*?)\s*\))?\s*$")


def parse_blend(recipe: str, field: str = "blend") -> list[tuple[str, float]]:
    """
    Parse and normalise a recipe.  A name given twice has its weights added, so
    C{a+a+b} is two parts C{a} to one part C{b}.  Order is first appearance.

    @raise BadRequest: naming C{field}, for any malformed term, a name that breaks the
        voice id rule, or a weight that is not a positive finite number.
    """
    if not recipe.strip():
        raise BadRequest(f'"{field}" is empty', field=field)
    weights: dict[str, float] = {}
    for term in recipe.split("+"):
        match = _TERM.match(term)
        if match is None:
            raise BadRequest(f'"{field}" has a malformed term {term.strip()!r}', field=field)
        name, raw = match.group(1), match.group(2)
        if not _VOICE_ID.match(name):
            raise BadRequest(f'"{field}" names {name!r}, which is not a voice id', field=field)
        try:
            weight = 1.0 if raw is None else float(raw)
        except ValueError:
            raise BadRequest(f'"{field}" weight {raw!r} is not a number', field=field) from None
        if not (weight > 0 and math.isfinite(weight)):
            raise BadRequest(f'"{field}" weight for {name!r} must be positive', field=field)
        weights[name] = weights.get(name, 0.0) + weight
    total = sum(weights.values())
    return [(name, weight / total) for name, weight in weights.items()]
