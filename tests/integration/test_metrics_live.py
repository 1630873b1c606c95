"""
GET /metrics on a real `rhapsode serve` with a real tone worker: what a Prometheus
scrape sees after speech through /speak and the OpenAI shim.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from _worker import serving_core


def test_a_scrape_after_speech(tmp_path: Path) -> None:
    """
    After one /speak and one shim request, a loopback scrape counts each under its route
    as ok, with bytes, a time to first audio per request, the worker up, the model
    resident and loaded, and one load.
    """
    with serving_core(tmp_path, {"tone": {"module": "rhapsode_engine_tone"}}) as (_, port):
        for path, body in (("/speak", {"engine": "tone", "text": "Hello there.", "format": "pcm"}),
                           ("/v1/audio/speech", {"model": "tone", "input": "Hello there.", "response_format": "wav"})):
            request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as response:
                assert len(response.read()) > 10_000
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = response.read().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("rhapsode_requests_total", (("code", "ok"), ("engine", "tone"), ("route", "speak")))] == 1
    assert samples[("rhapsode_requests_total", (("code", "ok"), ("engine", "tone"), ("route", "openai")))] == 1
    assert samples[("rhapsode_audio_bytes_total", (("engine", "tone"), ("route", "speak")))] > 10_000
    assert samples[("rhapsode_time_to_first_audio_seconds_count", (("engine", "tone"),))] == 2
    assert samples[("rhapsode_worker_up", (("engine", "tone"), ("state", "up")))] == 1
    assert samples[("rhapsode_model_loads_total", (("engine", "tone"),))] == 1
    assert samples[("rhapsode_model_resident", (("engine", "tone"), ("loaded", "true"), ("variant", "expressive")))] == 1
