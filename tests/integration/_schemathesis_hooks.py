"""
The schemathesis run's hooks (tests/integration/test_openapi_live.py loads them through
SCHEMATHESIS_HOOKS), for two rules the document says in words but JSON Schema cannot
state, so that every other refusal of a schema-valid request still fails the run: the
generated bodies whose words have nothing to speak are left out, and a request asking
for timestamps is sent with the Accept the document says it needs.

The first rule: a text is spoken only if a letter or a digit of some script is left once the
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


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: Any) -> None:
    """
    A request that asks for timestamps says which answer carries them, as the document
    says a client must (raw audio has no place for them): server-sent events for a
    stream, a JSON document otherwise.  A cross-field and header rule the schema cannot
    state; without it every such request would be a schema-valid bad_request.
    """
    body = case.body
    if isinstance(body, dict) and "timestamps" in body:
        accept = "application/json" if body.get("stream", True) is False else "text/event-stream"
        case.headers = {**(case.headers or {}), "Accept": accept}
