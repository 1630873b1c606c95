"""
The context of one run: what the checks share (the client, the capability document, the
ffmpeg to decode with, seeded audio already fetched, and the voices a check created and
must not leave behind).
"""

from __future__ import annotations

from typing import Any, Callable

from rhapsode_protocol import contract
from rhapsode_protocol.errors import SpeechError

from ._client import Client, Response
from ._expect import reproducible
from ._report import Failed, Result, Undecidable, outcome_of

SEED = 20260917


class Context:
    """
    What the checks share: the client, the capability document, the ffmpeg to decode with,
    seeded audio already fetched, and the voices a check created and must not leave behind.
    """

    def __init__(self, client: Client, ffmpeg: str | None) -> None:
        self.client = client
        self.ffmpeg = ffmpeg
        self.created: set[str] = set()
        self._caps: dict[str, Any] | None = None
        self._twice: dict[tuple[Any, ...], tuple[bytes, bytes]] = {}

    # The variants of a worker do not change while it runs, so one read serves every
    # check; only checks about current read /capabilities afresh.
    def capabilities(self) -> dict[str, Any]:
        if self._caps is None:
            response = self.client.get("/capabilities")
            try:
                doc = response.json()
                contract.validate(contract.CAPABILITIES, doc)
            except (Failed, SpeechError) as exc:
                raise Undecidable(f"/capabilities is unreadable ({exc}); see the capabilities check") from None
            self._caps = doc
        return self._caps

    def variants(self) -> dict[str, dict[str, Any]]:
        return dict(self.capabilities()["variants"])

    def default_variant(self) -> str:
        return str(self.capabilities()["defaultVariant"])

    def native(self) -> tuple[int, int]:
        native = self.capabilities()["nativeFormat"]
        return int(native["sampleRate"]), int(native["channels"])

    def voice_ids(self) -> list[str]:
        response = self.client.get("/voices")
        if response.status != 200:
            raise Undecidable(f"GET /voices answered {response.describe()}")
        doc = response.json()
        if not isinstance(doc, list):
            raise Undecidable("GET /voices is not a list")
        return [v["id"] for v in doc if isinstance(v, dict) and isinstance(v.get("id"), str)]

    def speak(self, **doc: Any) -> Response:
        return self.client.post("/speak", doc)

    def pcm(self, variant: str, text: str, **extra: Any) -> bytes:
        """Buffered pcm of a request that must succeed."""
        response = self.speak(text=text, variant=variant, format="pcm", stream=False, **extra)
        if response.status != 200:
            raise Failed(f"speaking {text!r} on {variant} answered {response.describe()}")
        return response.body

    def twice(self, variant: str, text: str, seed: int, **extra: Any) -> tuple[bytes, bytes]:
        """The same seeded request, made twice (once per run)."""
        key = (variant, text, seed, tuple(sorted(extra.items())))
        if key not in self._twice:
            self._twice[key] = (
                self.pcm(variant, text, seed=seed, **extra),
                self.pcm(variant, text, seed=seed, **extra),
            )
        return self._twice[key]

    def steady(self, variant: str, text: str) -> bytes:
        """
        Seeded audio shown to reproduce, as a baseline a change can be measured against.
        """
        if not reproducible(self.variants()[variant]):
            raise Undecidable("the variant does not claim seed reproducibility")
        first, second = self.twice(variant, text, SEED)
        if first != second:
            raise Undecidable("the same seeded request gave different audio twice (see the seed check)")
        return first

    def probe(self, name: str, test: Callable[[], None]) -> Result:
        """Run one test under a fresh deadline and turn its ending into a result."""
        self.client.start()
        return outcome_of(name, test)
