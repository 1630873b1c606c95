"""
Run in Chatterbox's virtualenv by test_engine_chatterbox: the adapter's answer to a draw of
speech tokens that S3Gen cannot decode, with torch and chatterbox-tts's own Conditionals,
and a model whose T3 is replaced by a list of draws (random weights cannot be made to end
early on purpose).  Prints one JSON line per case: what speak() gave, how many draws the
model was asked for, and the error's code and message where there was one.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from rhapsode_engine_chatterbox import _torchaudio
from rhapsode_engine_chatterbox._engine import VARIANT, ChatterboxEngine, refuse_empty
from rhapsode_worker import SpeakRequest, SpeechError
from rhapsode_worker.devices import TorchDevice

_torchaudio.install()  # as the adapter's load() does before chatterbox-tts is imported
from chatterbox.tts import Conditionals  # noqa: E402


class S3Gen:
    """What S3Gen's inference does with no tokens in the library: fails in its vocoder."""

    def inference(self, speech_tokens: Any, **_: Any) -> Any:
        if speech_tokens.numel() == 0:
            raise RuntimeError("Kernel size can't be greater than actual input size")
        return torch.zeros(1, 480 * speech_tokens.numel()), None


class Model:
    """
    generate() as chatterbox-tts's: T3's tokens (here the next of C{draws}), then S3Gen's
    inference with them; counts the draws.
    """

    def __init__(self, draws: list[int]) -> None:
        self.draws = draws
        self.drawn = 0
        self.s3gen = S3Gen()
        self.conds = Conditionals(None, {})

    def generate(self, text: str, **_: Any) -> Any:
        count = self.draws[self.drawn]
        self.drawn += 1
        wav, _ = self.s3gen.inference(speech_tokens=torch.zeros(count, dtype=torch.long))
        return wav


def case(draws: list[int]) -> dict[str, Any]:
    engine = ChatterboxEngine(device=TorchDevice.probe({}))
    model = Model(draws)
    refuse_empty(model)
    engine._model = model
    engine._builtin = model.conds
    request = SpeakRequest(text="Hello.", variant=VARIANT, voice=None, language="en",
                           params={"exaggeration": 0.5, "cfgWeight": 0.5, "temperature": 0.8})
    try:
        pcm = b"".join(engine.speak(request))
    except SpeechError as error:
        return {"drawn": model.drawn, "code": error.code, "message": str(error)}
    except Exception as error:  # what the adapter must not let through
        return {"drawn": model.drawn, "raised": type(error).__name__, "message": str(error)}
    return {"drawn": model.drawn, "samples": len(pcm) // 2}


if __name__ == "__main__":
    for argument in sys.argv[1:]:
        print(json.dumps(case([int(n) for n in argument.split(",")])), flush=True)
