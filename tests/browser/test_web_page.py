"""
The web page (issue 15) in a real headless Chromium against a real core with the tone
engine: speech plays while it streams, voices are made and removed, a live setting
changes, the API reference draws from the core's document, and no page logs an error.
Each test saves a screenshot of its page under a temporary folder; `make screenshots`
has them saved in docs/screenshots/ for the README instead.
"""

from __future__ import annotations

import io
import time
import math
import os
import struct
import wave
from pathlib import Path
from typing import Any

from _browser import HANG_GUARD_MS, ROOT, SCREENSHOTS_VARIABLE, Page, Served, call

#: Long enough that its audio (minutes of it) cannot all have arrived before playback
#: starts: the page reads the stream no faster than it plays.
LONG_TEXT = ("The quick brown fox jumps over the lazy dog, and keeps on running down the lane. " * 60)[:4000]


def clip(seconds: float = 1.5, rate: int = 24000, hz: float = 180.0) -> bytes:
    """A WAV of a steady tone: a reference the tone engine reads a pitch from."""
    frames = b"".join(
        struct.pack("<h", int(9000 * math.sin(2 * math.pi * hz * i / rate))) for i in range(int(seconds * rate))
    )
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(frames)
    return out.getvalue()


def test_speech_plays_before_the_response_ends(served: Served, page: Page) -> None:
    """
    Speak on Try it: the AudioContext's clock advances past the first audio while the
    /speak response is still streaming; time to first audio and the realtime factor are
    shown; Stop ends it; a short line then completes and offers a WAV download.
    """
    p = page.open(served.web, "try")
    p.select_option("#main select >> nth=0", "tone")
    p.get_by_label("Text").fill(LONG_TEXT)
    assert p.locator("#counter").inner_text() == "4000 of 4096 characters"
    assert "laugh" in p.locator("#cues").inner_text()
    p.get_by_role("button", name="Speak").click()
    # Read in one evaluation so "still streaming" and "has played" are one observation.
    p.wait_for_function(
        """() => { const o = document.getElementById('playback');
                   return o.dataset.response === 'streaming' && Number(o.dataset.played) > 0.5; }""",
        timeout=HANG_GUARD_MS,
    )
    state = p.evaluate("() => ({...document.getElementById('playback').dataset})")
    assert state["response"] == "streaming", state
    assert p.locator("#ttfa").inner_text().endswith(" ms")
    assert p.locator("#rtf").inner_text().endswith("×")
    page.screenshot("try")
    p.get_by_role("button", name="Stop").click()
    p.wait_for_function("() => document.getElementById('playback').dataset.response === 'stopped'")

    p.get_by_label("Text").fill("Hello there. [sigh] That was short.")
    p.get_by_role("button", name="Speak").click()
    p.wait_for_function("() => document.getElementById('playback').dataset.response === 'ended'", timeout=HANG_GUARD_MS)
    download = p.locator("#download")
    assert download.is_visible()
    assert download.get_attribute("href", timeout=HANG_GUARD_MS).startswith("blob:")
    assert page.errors == []


def test_voices_are_created_blended_and_deleted(served: Served, page: Page) -> None:
    """
    On Voices: a voice made from an uploaded clip and one blended from two built-ins
    appear in the list and in GET /voices; deleting each (confirming) removes it.
    """
    p = page.open(served.web, "voices")
    p.on("dialog", lambda dialog: dialog.accept())
    create = p.locator("form", has_text="Create a voice from a reference")
    create.get_by_label("New voice id").fill("webclip")
    create.get_by_label("Label").fill("Web clip")
    create.get_by_label("Reference").set_input_files(
        {"name": "clip.wav", "mimeType": "audio/wav", "buffer": clip()}
    )
    create.get_by_role("button", name="Create voice").click()
    p.wait_for_selector("td >> text=webclip")

    blend = p.locator("form", has_text="Blend two voices")
    blend.get_by_label("New voice id").fill("webblend")
    blend.get_by_label("First voice").select_option("alto")
    blend.get_by_label("Second voice").select_option("bass")
    blend.get_by_role("button", name="Blend").click()
    p.wait_for_selector("td >> text=webblend")
    _, voices = call(served.core, "GET", "/engines/tone/voices")
    assert {"webclip", "webblend"} <= {v["id"] for v in voices}
    page.screenshot("voices")

    for voice in ("webclip", "webblend"):
        p.get_by_role("button", name=f"Delete voice {voice}").click()
        p.wait_for_selector(f"td >> text={voice}", state="detached")
    _, voices = call(served.core, "GET", "/engines/tone/voices")
    assert not {"webclip", "webblend"} & {v["id"] for v in voices}
    assert page.errors == []


def test_a_live_setting_changes_from_the_page(served: Served, page: Page) -> None:
    """
    On Settings: the keep-alive is marked as applying now and the port as waiting for
    a restart; saving a new keep-alive makes GET /settings report it, from the database.
    """
    p = page.open(served.web, "settings")
    keep = p.locator('input[name="residency.keepAliveSeconds"]')
    assert keep.input_value() == "300"
    fields = p.locator(".field", has=keep)
    assert "applies now" in fields.inner_text()
    assert "after a restart" in p.locator(".field", has=p.locator('input[name="server.port"]')).inner_text()
    keep.fill("123")
    p.get_by_role("button", name="Save changes").click()
    p.wait_for_function("() => document.getElementById('status').textContent.startsWith('Saved')")
    assert p.locator("#status").inner_text() == "Saved: 1 applied now, 0 wait for a restart"
    code, document = call(served.core, "GET", "/settings")
    assert code == 200
    assert document["values"]["residency"]["keepAliveSeconds"] == 123
    field = next(f for f in document["fields"] if f["key"] == "residency.keepAliveSeconds")
    assert (field["source"], field["applies"]) == ("database", "live")
    page.screenshot("settings")
    assert page.errors == []


def test_voice_aliases_are_edited_as_json_on_settings(served: Served, page: Page) -> None:
    """
    On Settings, voices.aliases (an object) is edited as JSON: text that is not JSON is
    refused on the page, naming the field; an object saved makes GET /settings report it
    and /v1/audio/voices list the alias at once (it applies live).
    """
    p = page.open(served.web, "settings")
    aliases = p.locator('input[name="voices.aliases"]')
    assert aliases.input_value() == "{}"
    aliases.fill('{"alloy": tone:alto}')
    p.get_by_role("button", name="Save changes").click()
    p.wait_for_function("() => document.getElementById('status').textContent.includes('not JSON')")
    assert p.locator("#status").inner_text() == "voices.aliases: not JSON"
    aliases.fill('{"alloy": "tone:alto"}')
    p.get_by_role("button", name="Save changes").click()
    p.wait_for_function("() => document.getElementById('status').textContent.startsWith('Saved')")
    assert p.locator("#status").inner_text() == "Saved: 1 applied now, 0 wait for a restart"
    code, document = call(served.core, "GET", "/settings")
    assert code == 200
    assert document["values"]["voices"]["aliases"] == {"alloy": "tone:alto"}
    code, listed = call(served.core, "GET", "/v1/audio/voices?model=tone")
    assert code == 200
    alias = next(v for v in listed["voices"] if v["id"] == "alloy")
    assert (alias["alias_of"], alias["engine"]) == ("alto", "tone")
    assert call(served.core, "PATCH", "/settings", {"voices": {"aliases": {}}})[0] == 200
    assert page.errors == []


def test_the_api_reference_is_the_cores_document(served: Served, page: Page) -> None:
    """
    On API: every operation of GET /openapi.json is listed, and the filter narrows it.
    """
    _, document = call(served.core, "GET", "/openapi.json")
    expected = sum(
        1 for item in document["paths"].values() for method in ("get", "post", "put", "patch", "delete") if method in item
    )
    p = page.open(served.web, "api")
    operations = p.locator("#operations > details")
    assert operations.count() == expected
    p.get_by_label("Filter operations").fill("/speak")
    visible = p.locator("#operations > details:visible")
    assert 0 < visible.count() < expected
    visible.first.locator("summary").click()
    page.screenshot("api")
    assert page.errors == []


def test_engines_page_shows_the_catalog_and_what_is_resident(served: Served, page: Page) -> None:
    """
    On Engines: the catalog lists every engine with its code and weights licences, a
    weights licence not for commercial use is marked and must be accepted in a dialog
    that shows it (cancelling starts nothing), and a model loaded by a /speak is listed
    as resident with its deadline and unloaded from the page.
    """
    code, _ = call(served.core, "POST", "/speak", {"engine": "tone", "text": "Warm it up.", "stream": False})
    assert code == 200
    p = page.open(served.web, "engines")
    _, catalog = call(served.core, "GET", "/catalog")
    rows = p.locator("section[aria-labelledby=catalog-heading] tbody tr")
    assert rows.count() == len(catalog)
    for entry in catalog:
        row = rows.filter(has_text=entry["displayName"])
        assert entry["license"]["code"] in row.inner_text()
        assert entry["license"]["weights"] in row.inner_text()
    research = [e for e in catalog if e["license"]["weightsCommercialUse"] is False and e["installed"] == "no"]
    if research:
        entry = research[0]
        assert "not for commercial use" in rows.filter(has_text=entry["displayName"]).inner_text()
        p.get_by_role("button", name=f"Install {entry['displayName']}").click()
        dialog = p.locator("#licence-dialog")
        assert dialog.is_visible()
        assert entry["license"]["weights"] in dialog.inner_text()
        dialog.get_by_role("button", name="Cancel").click()
        assert not dialog.is_visible()
        _, jobs = call(served.core, "GET", "/installs")
        assert not [j for j in jobs if j["engine"] == entry["id"]]
    resident = p.locator("section[aria-labelledby=resident-heading]")
    assert "tone" in resident.locator("tbody").inner_text()
    page.screenshot("engines")
    p.get_by_role("button", name="Unload tone and end its worker").click()
    p.wait_for_selector("text=Nothing is resident.")
    _, residency = call(served.core, "GET", "/residency")
    assert residency["resident"] == 0
    assert page.errors == []


def test_keyboard_alone_and_a_phone_sized_screen(served: Served, browser: Any, shots: Path) -> None:
    """
    On a phone-sized screen no page scrolls sideways; with the keyboard alone the first
    Tab reaches the skip link, the next ones the page links, and Enter on one opens it
    with the current page marked for screen readers.
    """
    context = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
    p = context.new_page()
    errors: list[str] = []
    p.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    p.on("pageerror", lambda e: errors.append(str(e)))
    try:
        for name in ("try", "voices", "engines", "settings", "api"):
            p.goto(f"{served.web}/#{name}")
            p.wait_for_selector(f'main[data-ready="{name}"]')
            wide = p.evaluate("() => document.documentElement.scrollWidth - window.innerWidth")
            assert wide <= 0, f"{name} is {wide} px wider than the screen"
        p.screenshot(path=str(shots / "phone-api.png"))
        # A fresh load: a hash change alone moves focus to the page it opens.
        p.goto("about:blank")
        p.goto(f"{served.web}/#try")
        p.wait_for_selector('main[data-ready="try"]')
        p.keyboard.press("Tab")
        assert p.evaluate("() => document.activeElement.textContent") == "Skip to the page"
        p.keyboard.press("Tab")
        p.keyboard.press("Tab")
        assert p.evaluate("() => document.activeElement.textContent") == "Voices"
        p.keyboard.press("Enter")
        p.wait_for_selector('main[data-ready="voices"]')
        assert p.get_attribute('nav a[href="#voices"]', "aria-current") == "page"
        assert errors == []
    finally:
        context.close()


def test_screenshots_go_under_a_temporary_folder_not_the_tree(served: Served, page: Page) -> None:
    """
    A test run never writes into the checkout: a screenshot lands under the run's
    temporary folder, and docs/screenshots/ is written only when `make screenshots`
    names it in $RHAPSODE_SCREENSHOTS.
    """
    tracked = ROOT / "docs" / "screenshots"
    before = {path.name: path.stat().st_mtime_ns for path in tracked.glob("*.png")}
    page.open(served.web, "try")
    if not os.environ.get(SCREENSHOTS_VARIABLE):
        saved = page.screenshot("probe")
        assert saved.exists() and ROOT not in saved.parents, saved
        assert not (tracked / "probe.png").exists()
        assert {path.name: path.stat().st_mtime_ns for path in tracked.glob("*.png")} == before


def test_played_counts_audio_time_not_the_wall_time_of_an_underrun(served: Served, page: Page) -> None:
    """
    The player's "Played" is the audio heard: one second, then four seconds with
    nothing to play (the stream ran dry), then another second, is 2 s played, not 6.
    Driven on the page's own player module with a clock the test moves.
    """
    p = page.open(served.web, "try")
    played = p.evaluate(
        """async () => {
          const { StreamPlayer } = await import('/js/player.js');
          const context = {
            currentTime: 0, destination: {},
            createBuffer: (channels, frames, rate) => ({ duration: frames / rate, getChannelData: () => new Float32Array(frames) }),
            createBufferSource: () => ({ connect() {}, start() {}, stop() {}, onended: null, buffer: null }),
          };
          const player = new StreamPlayer(context, 1000, 1, true);
          const second = new Uint8Array(2000);
          const seen = [];
          player.push(second);                  // plays from 0.05 to 1.05
          context.currentTime = 1.05; seen.push(player.played());
          context.currentTime = 5.0; seen.push(player.played());   // ran dry for four seconds
          player.push(second);                  // plays from 5.05 to 6.05
          context.currentTime = 5.55; seen.push(player.played());
          context.currentTime = 6.05; seen.push(player.played());
          return seen;
        }"""
    )
    assert [round(x, 2) for x in played] == [1.0, 1.0, 1.5, 2.0], played
def test_words_light_up_as_they_are_spoken(served: Served, page: Page) -> None:
    """
    Try it, for a variant that times words (tone): the page asks for word timings and
    marks each word of the text while the audio plays it; the word marked is always the
    one whose span holds the playback position, the marks follow the text's order, and
    every word has been spoken once the audio has played.
    """
    text = "One two three, four five six. Seven eight nine ten!"
    p = page.open(served.web, "try")
    p.select_option("#main select >> nth=0", "tone")
    assert p.get_by_label("Light up the words as they are spoken").is_checked()
    p.get_by_label("Text").fill(text)
    p.get_by_role("button", name="Speak").click()
    seen: list[str] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        # One evaluation: the word marked, its span, and where playback is, together.
        state = p.evaluate(
            """() => { const w = document.getElementById('words');
                       const c = w.querySelector('.word.current');
                       return {current: c ? c.textContent : null, start: c ? Number(c.dataset.start) : null,
                               end: c ? Number(c.dataset.end) : null, position: Number(w.dataset.position || 0),
                               spoken: Number(w.dataset.spoken || 0), words: w.querySelectorAll('.word').length,
                               response: document.getElementById('playback').dataset.response}; }"""
        )
        if state["current"] is not None:
            assert state["start"] <= state["position"] < state["end"] + 0.05, state
            if not seen or seen[-1] != state["current"]:
                seen.append(state["current"])
        if state["response"] in ("ended", "failed", "stopped") and state["words"] and state["spoken"] == state["words"]:
            break
        time.sleep(0.03)
    assert state["response"] == "ended", state
    order = [word.strip(",.!") for word in text.split()]
    assert len(seen) >= 5, seen
    assert seen == sorted(seen, key=order.index), seen
    spans = p.locator("#words .word")
    assert spans.count() == len(order) and spans.all_inner_texts() == order
    assert p.locator("#words").inner_text() == text
    page.screenshot("try-words")
    assert page.errors == []
