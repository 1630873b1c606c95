"""
The schemathesis run's one hook (tests/integration/test_openapi_live.py loads it through
SCHEMATHESIS_HOOKS): it leaves out the generated bodies whose words are refused by a rule
the document says in words but JSON Schema cannot state, so that every other refusal of
a schema-valid request still fails the run.

The rule: a text is spoken only if a letter or a digit of some script is left once the
cues the variant does not claim, other bracketed tags and control characters are removed
(bad_request otherwise).  JSON Schema's patterns have no Unicode classes that every
generator honours, and the cues depend on the variant.  The check is the server's own
(rhapsode_protocol.vocab), with the cues of the tone engine the run is served by: all.
"""

from __future__ import annotations

from typing import Any

import schemathesis
from rhapsode_protocol.vocab import ALL_CUES, clean_text, is_speakable


def _words(body: Any) -> list[str]:
    if not isinstance(body, dict):
        return []
    words = [body[key] for key in ("text", "input") if isinstance(body.get(key), str)]
    turns = body.get("turns")
    if isinstance(turns, list):
        words += [turn["text"] for turn in turns if isinstance(turn, dict) and isinstance(turn.get("text"), str)]
    return words


@schemathesis.hook
def filter_body(context: Any, body: Any) -> bool:
    """Keep a body unless one of its texts has nothing to speak."""
    return all(is_speakable(clean_text(words, ALL_CUES)) for words in _words(body))
