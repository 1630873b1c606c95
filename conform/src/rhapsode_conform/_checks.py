"""
The checks: the worker rules of protocol.md sections 1 to 9, one function each, run in
the order of L{CHECKS} against a worker over its socket.

A result is pass, FAIL, or cannot be decided, and a check that could not have failed is
never a pass: a rule the worker gives no way to test (a seed on a variant that does not
claim reproducibility, a refusal of an undeclared format on a worker that declares all
five) is "cannot be decided", with the reason.  Every probe has a deadline, and one check
failing never stops the others.
"""

from __future__ import annotations

from typing import Any, Callable

from rhapsode_protocol import contract
from rhapsode_protocol.errors import ERROR_TABLE
from rhapsode_protocol.vocab import ALL_CUES

from ._audio import (
    MP3_PRIMING_SAMPLES,
    Pcm,
    decode_wav,
    decode_with_ffmpeg,
    mp3_slack_samples,
    pcm_from_s16le,
    tiny_wav,
)
from ._client import Response, Streamed
from ._context import SEED, Context
from ._expect import (
    audible,
    buffered_length,
    conforms,
    duration_header,
    l16_parameters,
    refused,
    reproducible,
)
from ._report import Failed, Outcome, Result, Undecidable
from ._wire import DURATION_HEADER, multipart

#: How far a decoded duration may stray from the duration header.
DURATION_TOLERANCE_MS = 50.0
#: An AAC frame's samples twice: the priming and the padding of the last frame.
AAC_SLACK_SAMPLES = 2 * 1024
BASE_TEXT = "Hello there and goodbye."
FORMAT_TEXT = "Hello there, this is how one sentence sounds in every format."
TEST_VOICE_PREFIX = "conform-"


# -- the checks ----------------------------------------------------------------------------

Check = Callable[[Context], list[Result]]


def check_health(ctx: Context) -> list[Result]:
    def test() -> None:
        unloaded = ctx.client.post("/unload", {})
        if unloaded.status != 200:
            raise Failed(f"POST /unload answered {unloaded.describe()}")
        conforms(contract.HEALTH, unloaded.json(), "the answer to POST /unload")
        response = ctx.client.get("/health")
        if response.status != 200:
            raise Failed(f"GET /health answered {response.describe()}")
        doc = response.json()
        conforms(contract.HEALTH, doc, "/health")
        if doc["process"] != "up" or doc["model"] != "unloaded":
            raise Failed(f'after /unload, /health says process {doc["process"]!r}, model {doc["model"]!r}')
        if "variant" in doc:
            raise Failed(f'/health names variant {doc["variant"]!r} with nothing loaded')

    return [ctx.probe("health answers while unloaded", test)]


def check_capabilities(ctx: Context) -> list[Result]:
    def test() -> None:
        unloaded = ctx.client.post("/unload", {})
        if unloaded.status != 200:
            raise Failed(f"POST /unload answered {unloaded.describe()}")
        response = ctx.client.get("/capabilities")
        if response.status != 200:
            raise Failed(f"GET /capabilities answered {response.describe()}")
        doc = response.json()
        conforms(contract.CAPABILITIES, doc, "/capabilities")
        if "current" in doc:
            raise Failed("current is present while nothing is loaded")
        if doc["defaultVariant"] not in doc["variants"]:
            raise Failed(f'defaultVariant {doc["defaultVariant"]!r} is not among the variants')

    return [ctx.probe("capabilities match the contract, without current while unloaded", test)]


def check_licences(ctx: Context) -> list[Result]:
    def test() -> None:
        response = ctx.client.get("/capabilities")
        doc = response.json()
        license = doc.get("license") if isinstance(doc, dict) else None
        if not isinstance(license, dict):
            raise Failed("/capabilities has no license object")
        code = license.get("code")
        if not isinstance(code, str) or not code.strip():
            raise Failed(f"license.code is {code!r}, not a licence name")
        if "weights" not in license:
            raise Failed("license.weights is absent (null says the engine has no weights)")
        weights = license["weights"]
        if weights is not None and (not isinstance(weights, str) or not weights.strip()):
            raise Failed(f"license.weights is {weights!r}, neither a licence name nor null")
        if "weightsCommercialUse" not in license:
            raise Failed("license.weightsCommercialUse is absent")
        commercial = license["weightsCommercialUse"]
        if commercial is not None and not isinstance(commercial, bool):
            raise Failed(f"license.weightsCommercialUse is {commercial!r}, not a boolean or null")
        if weights is None and commercial is not None:
            raise Failed("license.weights is null (no weights) but weightsCommercialUse says otherwise")

    return [ctx.probe("both licences are named", test)]


def check_load_on_demand(ctx: Context) -> list[Result]:
    def test() -> None:
        default = ctx.default_variant()
        unloaded = ctx.client.post("/unload", {})
        if unloaded.status != 200:
            raise Failed(f"POST /unload answered {unloaded.describe()}")
        response = ctx.speak(text=BASE_TEXT, format="wav", stream=False)
        if response.status != 200:
            raise Failed(f"/speak after /unload answered {response.describe()}")
        audible(decode_wav(response.body), "the audio")
        health = ctx.client.get("/health").json()
        if health.get("model") != "loaded" or health.get("variant") != default:
            raise Failed(
                f"after /speak, /health says model {health.get('model')!r}, variant "
                f"{health.get('variant')!r}; expected loaded, {default!r}"
            )
        caps = ctx.client.get("/capabilities").json()
        conforms(contract.CAPABILITIES, caps, "/capabilities while loaded")
        current = caps.get("current")
        if not isinstance(current, dict) or current.get("variant") != default:
            named = current.get("variant") if isinstance(current, dict) else None
            raise Failed(f"current names {named!r}, not the effective variant {default!r}")

    return [ctx.probe("speak loads on demand", test)]


def check_formats(ctx: Context) -> list[Result]:
    results = []
    variant = ctx.default_variant()
    seeded = reproducible(ctx.variants()[variant])
    native = ctx.native()
    for fmt in ctx.capabilities()["formats"]:
        name = f"format {fmt} decodes to audio of the stated length"
        if fmt == "mp3":
            name += f" (allowing mp3's {MP3_PRIMING_SAMPLES}-sample priming delay and one frame)"

        def test(fmt: str = fmt) -> None:
            extra = {"seed": SEED} if seeded else {}
            response = ctx.speak(text=FORMAT_TEXT, variant=variant, format=fmt, stream=False, **extra)
            if response.status != 200:
                raise Failed(f"answered {response.describe()}")
            ctype = response.header("content-type")
            if fmt == "pcm":
                l16_parameters(ctype, native)
            elif ctype != contract.MEDIA_TYPES[fmt]:
                raise Failed(f"Content-Type is {ctype!r}, not {contract.MEDIA_TYPES[fmt]}")
            buffered_length(response)
            stated = duration_header(response)
            pcm = _decode(ctx, fmt, response.body, native)
            slack = DURATION_TOLERANCE_MS
            if fmt == "mp3":
                slack += mp3_slack_samples(native[0]) * 1000.0 / native[0]
            elif fmt == "aac":
                # ADTS cannot say the encoder's priming (1024 samples) or the last
                # frame's padding, so a decoder plays both.
                slack += AAC_SLACK_SAMPLES * 1000.0 / native[0]
            if not (-DURATION_TOLERANCE_MS <= pcm.duration_ms - stated <= slack):
                raise Failed(f"decodes to {pcm.duration_ms:.0f} ms; the header says {stated} ms")
            audible(pcm, "the decoded audio")

        results.append(ctx.probe(name, test))
    return results


def _decode(ctx: Context, fmt: str, body: bytes, native: tuple[int, int]) -> Pcm:
    if fmt == "wav":
        pcm = decode_wav(body)
        if (pcm.rate, pcm.channels) != native:
            raise Failed(f"the WAV is {pcm.rate} Hz, {pcm.channels} channel(s); the native format is not")
        return pcm
    if fmt == "pcm":
        return pcm_from_s16le(body, *native)
    if ctx.ffmpeg is None:
        raise Undecidable(f"there is no ffmpeg here to decode {fmt}")
    return decode_with_ffmpeg(ctx.ffmpeg, body, native[0], native[1], ctx.client.remaining("decoding"))


def check_buffered_wav(ctx: Context) -> list[Result]:
    def test() -> None:
        response = ctx.speak(text=BASE_TEXT, variant=ctx.default_variant(), format="wav", stream=False)
        if response.status != 200:
            raise Failed(f"answered {response.describe()}")
        buffered_length(response)

    return [ctx.probe("a buffered wav carries Content-Length", test)]


def check_refused_formats(ctx: Context) -> list[Result]:
    def undeclared() -> None:
        declared = ctx.capabilities()["formats"]
        missing = [f for f in contract.MEDIA_TYPES if f not in declared]
        if not missing:
            raise Undecidable("every format of the contract is declared")
        response = ctx.speak(text=BASE_TEXT, format=missing[0], stream=False)
        refused(response, 422, "unsupported", "format", names=missing[0])

    def unknown() -> None:
        # Outside the contract's six is unsupported too (section 6): a format this
        # worker does not do, like any other, not a malformed request.
        refused(ctx.speak(text=BASE_TEXT, format="wma", stream=False), 422, "unsupported", "format", names="wma")

    return [
        ctx.probe("an undeclared format is unsupported, naming it", undeclared),
        ctx.probe('a format outside the contract is unsupported, naming it', unknown),
    ]


def _long_text(segment: int | None, ceiling: int) -> str:
    """Sentences enough for several segments, within the ceiling."""
    wanted = min(ceiling, 3 * segment + 40 if segment else 600)
    sentences: list[str] = []
    while len(" ".join(sentences)) < wanted:
        sentences.append(f"Sentence {len(sentences) + 1} is here to make the stream run long.")
    text = " ".join(sentences)
    while len(text) > ceiling and " " in text:
        text = text.rsplit(" ", 1)[0]
    return text


def check_stream(ctx: Context) -> list[Result]:
    variant = ctx.default_variant()
    caps = ctx.variants()[variant]
    segmentation = caps["segmentation"]
    segment = segmentation.get("segmentCharacters") if segmentation.get("supported") else None
    text = _long_text(segment, caps["maxCharacters"])
    native = ctx.native()
    got: list[Streamed] = []

    def pieces() -> None:
        answer = ctx.client.stream("/speak", {"text": text, "variant": variant, "format": "pcm", "stream": True})
        got.append(answer)
        if answer.status != 200:
            raise Failed(f"answered {answer.status}: {answer.body[:160]!r}")
        l16_parameters(answer.headers.get("content-type"), native)
        if not answer.chunked:
            raise Failed("not sent with Transfer-Encoding: chunked")
        if "content-length" in answer.headers:
            raise Failed("a chunked response also carries Content-Length")
        if not answer.complete:
            raise Failed(f"the body ended without its last chunk, after {len(answer.body)} bytes")
        if len(answer.chunks) < 2 and answer.recvs < 2:
            if segment is None:
                raise Undecidable("the variant does not segment, and its audio came in one piece")
            raise Failed(f"{len(text)} characters over {segment}-character segments came in one piece")
        pcm_from_s16le(answer.body, *native)

    def trailer() -> None:
        if not got:
            raise Undecidable("the stream above was not received")
        answer = got[0]
        if answer.status != 200 or not answer.complete:
            raise Undecidable("the stream above did not end properly")
        declared = [n.strip().lower() for n in answer.headers.get("trailer", "").split(",")]
        if DURATION_HEADER not in declared:
            raise Failed("the Trailer header does not declare X-Rhapsode-Duration-Ms")
        value = answer.trailers.get(DURATION_HEADER)
        if value is None:
            raise Failed("the stream ended without an X-Rhapsode-Duration-Ms trailer")
        if not value.isdigit():
            raise Failed(f"the trailer is {value!r}, not a whole number")
        heard = pcm_from_s16le(answer.body, *native).duration_ms
        if abs(int(value) - heard) > 1:
            raise Failed(f"the trailer says {value} ms; the stream carried {heard:.1f} ms")

    return [
        ctx.probe("a stream arrives chunked, in pieces, and ends with a last chunk", pieces),
        ctx.probe("a stream ends with its duration as a trailer", trailer),
    ]


def check_seed(ctx: Context) -> list[Result]:
    results = []
    for variant, caps in ctx.variants().items():
        name = f"a seed reproduces audio in variant {variant}"
        if not reproducible(caps):
            results.append(Result(name, Outcome.UNDECIDED, "the variant does not claim it"))
            continue

        def test(variant: str = variant) -> None:
            first, second = ctx.twice(variant, BASE_TEXT, SEED)
            if first != second:
                raise Failed("two identical seeded requests gave different audio")
            # A different seed giving the same audio is not a failure: an engine with no
            # randomness reproduces under every seed, which is all the claim says.

        results.append(ctx.probe(name, test))
    return results


def check_cues(ctx: Context) -> list[Result]:
    results = []
    for variant, caps in ctx.variants().items():
        claimed = list(caps["cues"])
        if not claimed:
            results.append(
                Result(f"claimed cues change the audio in variant {variant}", Outcome.UNDECIDED, "the variant claims none")
            )
        for cue in claimed:

            def changes(variant: str = variant, cue: str = cue) -> None:
                base = ctx.steady(variant, BASE_TEXT)
                if ctx.pcm(variant, f"Hello there [{cue}] and goodbye.", seed=SEED) == base:
                    raise Failed(f"[{cue}] left the audio byte for byte as it was without it")

            results.append(ctx.probe(f"cue [{cue}] changes the audio in variant {variant}", changes))
        unclaimed = [c for c in ALL_CUES if c not in claimed]

        def stripped(variant: str = variant) -> None:
            if not unclaimed:
                raise Undecidable("the variant claims every cue")
            base = ctx.steady(variant, BASE_TEXT)
            if ctx.pcm(variant, f"Hello there [{unclaimed[0]}] and goodbye.", seed=SEED) != base:
                raise Failed(f"the unclaimed [{unclaimed[0]}] changed the audio: it was not stripped")

        results.append(ctx.probe(f"an unclaimed cue is stripped in variant {variant}", stripped))
    return results


def check_deliveries(ctx: Context) -> list[Result]:
    results = []
    for variant, caps in ctx.variants().items():
        claimed = list(caps["deliveries"])
        if not claimed:
            results.append(
                Result(f"claimed deliveries change the audio in variant {variant}", Outcome.UNDECIDED, "the variant claims none")
            )
        for delivery in claimed:

            def changes(variant: str = variant, delivery: str = delivery) -> None:
                base = ctx.steady(variant, BASE_TEXT)
                if ctx.pcm(variant, BASE_TEXT, seed=SEED, delivery=delivery) == base:
                    raise Failed(f"delivery {delivery} left the audio byte for byte as it was without it")

            results.append(ctx.probe(f"delivery {delivery} changes the audio in variant {variant}", changes))
    return results


def check_dials(ctx: Context) -> list[Result]:
    def unknown() -> None:
        response = ctx.speak(text=BASE_TEXT, variant=ctx.default_variant(), params={"noSuchDial": 1}, stream=False)
        refused(response, 400, "bad_request", "params.noSuchDial", names="noSuchDial")

    def out_of_range() -> None:
        dialled = [(v, c["dials"]) for v, c in ctx.variants().items() if c["dials"]]
        if not dialled:
            raise Undecidable("no variant declares a dial")
        variant, dials = dialled[0]
        dial, bounds = next(iter(dials.items()))
        response = ctx.speak(
            text=BASE_TEXT, variant=variant, params={dial: bounds["max"] + 1}, stream=False
        )
        refused(response, 400, "bad_request", f"params.{dial}", names=dial)

    return [
        ctx.probe("an unknown dial is refused naming it", unknown),
        ctx.probe("a dial out of range is refused naming it", out_of_range),
    ]


def check_unknown_variant(ctx: Context) -> list[Result]:
    # A build the worker cannot load is unsupported, like a format it cannot make, and
    # the message names the variants it has.
    def speak() -> None:
        response = ctx.speak(text=BASE_TEXT, variant="no-such-variant", stream=False)
        refused(response, 422, "unsupported", "variant", names=ctx.default_variant())

    def fetch() -> None:
        response = ctx.client.post("/fetch", {"variant": "no-such-variant"})
        refused(response, 422, "unsupported", "variant", names=ctx.default_variant())

    return [
        ctx.probe("an unknown variant is unsupported, naming the variants", speak),
        ctx.probe("fetching an unknown variant is unsupported", fetch),
    ]


def check_voice_ids(ctx: Context) -> list[Result]:
    def malformed() -> None:
        for voice in ("../../x", "*", "", "a" * 65):
            response = ctx.speak(text=BASE_TEXT, voice=voice, stream=False)
            try:
                refused(response, 400, "bad_request", "voice")
            except Failed as exc:
                raise Failed(f"voice {voice!r}: {exc}") from None

    def unknown() -> None:
        voice = f"{TEST_VOICE_PREFIX}no-such-voice"
        if voice in ctx.voice_ids():
            raise Undecidable(f"the worker has a voice named {voice}")
        refused(ctx.speak(text=BASE_TEXT, voice=voice, stream=False), 404, "unknown_voice")

    def in_path() -> None:
        for path in ("/voices/..%2Fx", "/voices/..%2F..%2Fx", "/voices/%2A"):
            response = ctx.client.request("DELETE", path)
            if response.status not in (400, 404):
                raise Failed(f"DELETE {path} answered {response.describe()}; expected 400 or 404")

    return [
        ctx.probe("malformed voice ids are bad_request", malformed),
        ctx.probe("an unknown voice is unknown_voice", unknown),
        ctx.probe("a voice id in a path cannot climb out", in_path),
    ]


def check_voice_list(ctx: Context) -> list[Result]:
    listed: list[dict[str, Any]] = []

    def listing() -> None:
        response = ctx.client.get("/voices")
        if response.status != 200:
            raise Failed(f"GET /voices answered {response.describe()}")
        doc = response.json()
        conforms(contract.VOICE_LIST, doc, "/voices")
        ids = [v["id"] for v in doc]
        if len(set(ids)) != len(ids):
            raise Failed("a voice id is listed twice")
        for voice in doc:
            if voice["previewUrl"] != f"/voices/{voice['id']}/preview":
                raise Failed(f'voice {voice["id"]}: previewUrl is {voice["previewUrl"]!r}')
        listed.extend(doc)

    def preview() -> None:
        if not listed:
            raise Undecidable("no voices are listed (or the list is broken)")
        url = listed[0]["previewUrl"]
        response = ctx.client.get(url)
        if response.status != 200:
            raise Failed(f"GET {url} answered {response.describe()}")
        if response.header("content-type") != "audio/wav":
            raise Failed(f"GET {url} is {response.header('content-type')!r}, not audio/wav")
        audible(decode_wav(response.body), "the preview")

    return [
        ctx.probe("the voice list matches the contract", listing),
        ctx.probe("a voice preview is a wav that decodes", preview),
    ]


def check_language(ctx: Context) -> list[Result]:
    # Section 6: a variant that lists several languages reads the field, matching tags
    # without case as BCP 47 does; one that lists a single language ignores it.
    def several() -> tuple[str, list[str]]:
        for variant, caps in ctx.variants().items():
            if len(caps["languages"]) > 1:
                return variant, list(caps["languages"])
        raise Undecidable("no variant lists more than one language")

    def unlisted() -> None:
        variant, _ = several()
        response = ctx.speak(text=BASE_TEXT, variant=variant, language="xx-nope", stream=False)
        refused(response, 422, "unsupported", "language")

    def any_case() -> None:
        variant, languages = several()
        asked = languages[0].swapcase()
        response = ctx.speak(text=BASE_TEXT, variant=variant, language=asked, format="wav", stream=False)
        if response.status != 200:
            raise Failed(f"language {asked!r} (listed as {languages[0]!r}) answered {response.describe()}")

    def ignored() -> None:
        single = [v for v, caps in ctx.variants().items() if len(caps["languages"]) == 1]
        if not single:
            raise Undecidable("every variant lists more than one language")
        response = ctx.speak(text=BASE_TEXT, variant=single[0], language="xx-nope", format="wav", stream=False)
        if response.status != 200:
            raise Failed(f"variant {single[0]} lists one language, yet refused another: {response.describe()}")

    return [
        ctx.probe("an unlisted language is unsupported", unlisted),
        ctx.probe("a listed language is matched without case", any_case),
        ctx.probe("a variant of one language ignores the language asked for", ignored),
    ]


def check_text(ctx: Context) -> list[Result]:
    def empty() -> None:
        refused(ctx.speak(text="", stream=False), 400, "bad_request", "text")

    def nothing_to_say() -> None:
        # Control characters, zero-width and direction marks, emoji: nothing to read.
        for text in ("\x01\x02\x07", "\u200b\u200f\u2066\ufeff", "\U0001f600\U0001f389"):
            try:
                refused(ctx.speak(text=text, stream=False), 400, "bad_request", "text")
            except Failed as exc:
                raise Failed(f"text {text!r}: {exc}") from None

    def too_long() -> None:
        variant = ctx.default_variant()
        ceiling = int(ctx.variants()[variant]["maxCharacters"])
        text = ("Hello there. " * (ceiling // 13 + 2))[: ceiling + 1]
        text = text[:-1] + "x"
        response = ctx.speak(text=text, variant=variant, stream=False)
        refused(response, 400, "bad_request", "text")

    return [
        ctx.probe('empty text is refused naming "text"', empty),
        ctx.probe('text with no letter or digit is refused naming "text"', nothing_to_say),
        ctx.probe('text over maxCharacters is refused naming "text"', too_long),
    ]


def check_unknown_field(ctx: Context) -> list[Result]:
    def test() -> None:
        response = ctx.speak(text=BASE_TEXT, noSuchField=1, stream=False)
        refused(response, 400, "bad_request", "noSuchField", names="noSuchField")

    return [ctx.probe("an unknown request field is refused naming it", test)]


def check_dialogue(ctx: Context) -> list[Result]:
    results = []
    two_turns = [{"speaker": "a", "text": "Hello there."}, {"speaker": "b", "text": "Hello to you."}]
    for variant, caps in ctx.variants().items():
        dialogue = caps.get("dialogue")
        if dialogue is None:

            def undeclared(variant: str = variant) -> None:
                response = ctx.client.post("/dialogue", {"turns": two_turns, "variant": variant, "stream": False})
                refused(response, 422, "unsupported")

            results.append(ctx.probe(f"dialogue is unsupported in variant {variant}, which does not declare it", undeclared))
            continue

        def speaks(variant: str = variant) -> None:
            response = ctx.client.post(
                "/dialogue", {"turns": two_turns, "variant": variant, "format": "wav", "stream": False}
            )
            if response.status != 200:
                raise Failed(f"answered {response.describe()}")
            buffered_length(response)
            audible(decode_wav(response.body), "the dialogue")

        def crowded(variant: str = variant, most: int = int(dialogue["maxSpeakers"])) -> None:
            turns = [{"speaker": f"s{i}", "text": "Hello there."} for i in range(most + 1)]
            response = ctx.client.post("/dialogue", {"turns": turns, "variant": variant, "stream": False})
            refused(response, 422, "unsupported")

        def unused_label(variant: str = variant) -> None:
            voices = ctx.voice_ids()
            if not voices:
                raise Undecidable("no voices are listed to map a label to")
            response = ctx.client.post(
                "/dialogue",
                {"turns": two_turns, "voices": {"nobody": voices[0]}, "variant": variant, "stream": False},
            )
            refused(response, 400, "bad_request", names="nobody")

        results += [
            ctx.probe(f"dialogue of two turns speaks in variant {variant}", speaks),
            ctx.probe(f"dialogue over maxSpeakers is unsupported in variant {variant}", crowded),
            ctx.probe(f"dialogue refuses a voices label no turn uses in variant {variant}", unused_label),
        ]
    return results


def check_instructions(ctx: Context) -> list[Result]:
    # Section 4: a variant that declares instructions takes them, within its ceiling
    # (and refuses their absence where it requires them); every other refuses them as
    # unsupported rather than dropping what the client believes it asked for.
    results = []
    words = "Read it warmly, a little slowly."
    for variant, caps in ctx.variants().items():
        declared = caps.get("instructions")
        if not isinstance(declared, dict):

            def refused_here(variant: str = variant) -> None:
                response = ctx.speak(text=BASE_TEXT, variant=variant, instructions=words, stream=False)
                refused(response, 422, "unsupported", "instructions")

            results.append(ctx.probe(f"instructions are unsupported in variant {variant}, which takes none",
                                     refused_here))
            continue

        def taken(variant: str = variant) -> None:
            response = ctx.speak(text=BASE_TEXT, variant=variant, instructions=words, format="wav", stream=False)
            if response.status != 200:
                raise Failed(f"answered {response.describe()}")
            audible(decode_wav(response.body), "the audio")

        def too_long(variant: str = variant, most: int = int(declared.get("maxCharacters", 0))) -> None:
            response = ctx.speak(text=BASE_TEXT, variant=variant, instructions="x" * (most + 1), stream=False)
            refused(response, 400, "bad_request", "instructions")

        results += [
            ctx.probe(f"instructions are taken in variant {variant}", taken),
            ctx.probe(f"instructions over maxCharacters are refused in variant {variant}", too_long),
        ]
        if declared.get("required"):

            def missing(variant: str = variant) -> None:
                refused(ctx.speak(text=BASE_TEXT, variant=variant, stream=False), 400, "bad_request", "instructions")

            results.append(ctx.probe(f"a request without instructions is refused in variant {variant}, "
                                     "which requires them", missing))
    return results


def _create_voice(ctx: Context, voice_id: str, part: tuple[str, str | None, bytes]) -> Response:
    """POST /voices; a voice it creates is remembered, to be deleted however the check ends."""
    body, content_type = multipart([("id", None, voice_id.encode()), part])
    response = ctx.client.request("POST", "/voices", body, content_type)
    if 200 <= response.status < 300:
        ctx.created.add(voice_id)
    return response


def check_cloning(ctx: Context) -> list[Result]:
    cloning = [c["cloning"] for c in ctx.variants().values() if "cloning" in c]
    clones = [c for c in cloning if c["supported"]]
    voice_id = f"{TEST_VOICE_PREFIX}clone"

    def odd_type() -> None:
        if any("xyz" in c.get("formats", ()) for c in clones):
            raise Undecidable("the worker lists xyz as a reference type")
        response = _create_voice(ctx, voice_id, ("reference", "x.xyz", tiny_wav()))
        refused(response, 422, "unsupported", "reference")

    def no_cloning() -> None:
        response = _create_voice(ctx, voice_id, ("reference", "x.wav", tiny_wav()))
        refused(response, 422, "unsupported")

    if clones:
        return [ctx.probe("a clone from a reference of an unlisted type is unsupported", odd_type)]
    name = "a clone is unsupported where no variant clones"
    if len(cloning) < len(ctx.variants()):
        # Section 4: a variant without cloning has not said, so nothing is promised.
        return [Result(name, Outcome.UNDECIDED, "a variant does not say whether it clones")]
    return [ctx.probe(name, no_cloning)]


def check_blending(ctx: Context) -> list[Result]:
    # Section 4: blending absent means no, since only an adapter that says so blends.
    blends = [v for v, c in ctx.variants().items() if c.get("blending", {}).get("supported")]
    voice_id = f"{TEST_VOICE_PREFIX}blend"

    def listed_pair() -> list[str]:
        voices = ctx.voice_ids()
        if voice_id in voices:
            raise Undecidable(f"a voice {voice_id} exists already, and the checker will not replace it")
        return [v for v in voices if not v.startswith(TEST_VOICE_PREFIX)][:2]

    def round_trip() -> None:
        pair = listed_pair()
        if len(pair) < 2:
            raise Undecidable("fewer than two voices are listed to blend")
        recipe = f"{pair[0]}(1)+{pair[1]}(1)"
        response = _create_voice(ctx, voice_id, ("blend", None, recipe.encode()))
        if response.status != 201:
            raise Failed(f"creating a blend answered {response.describe()}; expected 201")
        doc = response.json()
        conforms(contract.VOICE, doc, "the created voice")
        if doc["id"] != voice_id:
            raise Failed(f"the created voice is {doc['id']!r}, not {voice_id!r}")
        if voice_id not in ctx.voice_ids():
            raise Failed("the blend is not in GET /voices")
        spoken = ctx.speak(text=BASE_TEXT, voice=voice_id, variant=blends[0], format="wav", stream=False)
        if spoken.status != 200:
            raise Failed(f"speaking with the blend answered {spoken.describe()}")
        audible(decode_wav(spoken.body), "the blend's audio")
        deleted = ctx.client.request("DELETE", f"/voices/{voice_id}")
        if deleted.status != 204 or deleted.body:
            raise Failed(f"DELETE /voices/{voice_id} answered {deleted.describe()}; expected 204, no body")
        ctx.created.discard(voice_id)
        if voice_id in ctx.voice_ids():
            raise Failed("the blend is still listed after DELETE")

    def no_blending() -> None:
        # Listed voices where there are two, so only the blending itself is refused;
        # a worker that blends nothing refuses any recipe.
        pair = listed_pair()
        if len(pair) < 2:
            pair = [f"{TEST_VOICE_PREFIX}a", f"{TEST_VOICE_PREFIX}b"]
        response = _create_voice(ctx, voice_id, ("blend", None, "+".join(pair).encode()))
        refused(response, 422, "unsupported")

    if blends:
        return [ctx.probe("a blend is created, listed, spoken and deleted", round_trip)]
    return [ctx.probe("a blend is unsupported where no variant blends", no_blending)]


_MESSAGE_STATUSES = frozenset({404, 405, 408, 413, 414, 431})


TIMED_TEXT = "Hello there, it was 3:45 pm and time to go."


def check_timestamps(ctx: Context) -> list[Result]:
    """
    A variant that declares timestamps answers each unit it lists in the contract's
    document: entries of a unit in order and within the audio, words with offsets the
    request's text at them where it claims offsets and none where it does not; a unit it
    does not list is unsupported, and timings without the Accept of their framing are
    bad_request, both naming timestamps.
    """
    results = []
    json_accept = {"Accept": contract.TIMED_JSON}
    for variant, caps in ctx.variants().items():
        declared = caps.get("timestamps")
        units = list(declared["units"]) if isinstance(declared, dict) else []
        claims_offsets = bool(declared.get("textOffsets")) if isinstance(declared, dict) else False
        for unit in units:

            def timed(variant: str = variant, unit: str = unit, offsets: bool = claims_offsets) -> None:
                body = {"text": TIMED_TEXT, "variant": variant, "format": "wav", "stream": False, "timestamps": unit}
                response = ctx.client.post("/speak", body, json_accept)
                if response.status != 200:
                    raise Failed(f"timestamps {unit} answered {response.describe()}")
                doc = response.json()
                conforms(contract.TIMED_AUDIO, doc, "the timed answer")
                seconds = doc["durationMs"] / 1000
                entries = doc["alignment"]
                if not any(e["unit"] == unit for e in entries):
                    raise Failed(f"no {unit} was timed")
                for name in {e["unit"] for e in entries}:
                    timed_ = [e for e in entries if e["unit"] == name]
                    if any(a["end"] > b["start"] + 1e-6 for a, b in zip(timed_, timed_[1:])):
                        raise Failed(f"{name} entries overlap or are out of order")
                    if timed_[-1]["end"] > seconds + DURATION_TOLERANCE_MS / 1000:
                        raise Failed(f"a {name} ends at {timed_[-1]['end']} s, after the audio ({seconds} s)")
                for entry in entries:
                    if entry["unit"] != "word":
                        continue
                    if offsets and "textStart" in entry:
                        if TIMED_TEXT[entry["textStart"]:entry["textEnd"]] != entry["text"]:
                            raise Failed(f"{entry['text']!r} is not the text at {entry['textStart']}:{entry['textEnd']}")
                    elif not offsets and "textStart" in entry:
                        raise Failed("a word carries offsets, which the variant does not claim")

            results.append(ctx.probe(f"timestamps {unit} are timed in variant {variant}", timed))
        others = [u for u in contract.TIMESTAMP_UNITS if u not in units]

        def undeclared(variant: str = variant) -> None:
            if not others:
                raise Undecidable("the variant times every unit")
            body = {"text": BASE_TEXT, "variant": variant, "stream": False, "timestamps": others[0]}
            refused(ctx.client.post("/speak", body, json_accept), 422, "unsupported", "timestamps")

        results.append(ctx.probe(f"an undeclared timestamps unit is unsupported in variant {variant}", undeclared))
        if units:

            def without_accept(variant: str = variant, unit: str = units[0]) -> None:
                body = {"text": BASE_TEXT, "variant": variant, "stream": False, "timestamps": unit}
                refused(ctx.client.post("/speak", body), 400, "bad_request", "timestamps")

            results.append(ctx.probe(f"timestamps without their Accept are refused in variant {variant}",
                                     without_accept))
    return results


def check_error_envelopes(ctx: Context) -> list[Result]:
    def test() -> None:
        if not ctx.client.errors:
            raise Undecidable("no error responses were collected")
        for response in ctx.client.errors:
            doc = response.json()
            conforms(contract.ERROR, doc, f"the {response.status} answer to {response.label}")
            code = doc["error"]["code"]
            status, retryable, _ = ERROR_TABLE[code]
            # A refusal of the HTTP message itself (no such route, a wrong method, a head
            # or body over its limit) is bad_request under HTTP's own status for it.
            allowed = {status} | (_MESSAGE_STATUSES if code == "bad_request" else set())
            if response.status not in allowed:
                raise Failed(f"{response.label} answered {code} with {response.status}, not {status}")
            if doc["error"]["retryable"] is not retryable:
                raise Failed(f"{response.label} answered {code} with retryable {not retryable}")

    return [ctx.probe("every error carries code, message and retryable, as the table says", test)]


#: Every check, in the order they run, under the name a result takes when the check
#: cannot even begin.  The envelope check comes last: it reads the error responses every
#: other check collected.
CHECKS: tuple[tuple[str, Check], ...] = (
    ("health answers while unloaded", check_health),
    ("capabilities match the contract", check_capabilities),
    ("both licences are named", check_licences),
    ("speak loads on demand", check_load_on_demand),
    ("every declared format decodes", check_formats),
    ("a buffered wav carries Content-Length", check_buffered_wav),
    ("formats not produced are refused", check_refused_formats),
    ("a stream arrives in pieces", check_stream),
    ("a seed reproduces audio", check_seed),
    ("claimed cues change the audio", check_cues),
    ("claimed deliveries change the audio", check_deliveries),
    ("dials are checked", check_dials),
    ("an unknown variant is unsupported", check_unknown_variant),
    ("bad voice ids are refused", check_voice_ids),
    ("the voice list matches the contract", check_voice_list),
    ("languages are as declared", check_language),
    ("text is checked", check_text),
    ("an unknown request field is refused", check_unknown_field),
    ("dialogue is as declared", check_dialogue),
    ("instructions are as declared", check_instructions),
    ("cloning is as declared", check_cloning),
    ("blending is as declared", check_blending),
    ("timestamps are as declared", check_timestamps),
    ("every error carries code, message and retryable", check_error_envelopes),
)
