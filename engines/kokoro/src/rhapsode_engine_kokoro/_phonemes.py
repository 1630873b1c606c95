"""
Phonemes as Kokoro should get them: espeak-ng's language-switch flags taken out.

espeak-ng reads a stretch it takes for another language in that language's voice and
marks it, as in "ˈi mˈɛ (en)dʒˈɒn at ðə(fr) staʁbˈyk" for French with an English name in
it.  phonemizer keeps those flags unless told otherwise, kokoro-onnx does not tell it, and
the parentheses and letters are all in the model's vocabulary, so Kokoro would say "en"
and "fr" aloud in the middle of the sentence.
"""

from __future__ import annotations

import re

#: A language code in parentheses, as espeak-ng writes its switches: (en), (fr), (en-us).
_LANGUAGE_SWITCH = re.compile(r"\([a-z]{2,3}(?:-[a-z0-9]{2,8})*\)")


def without_language_switches(phonemes: str) -> str:
    """C{phonemes} with every language-switch flag removed and nothing else changed."""
    return _LANGUAGE_SWITCH.sub("", phonemes)
