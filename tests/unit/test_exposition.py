"""
The core's own Prometheus text writer (rhapsode._speech.exposition), read back by
prometheus_client's parser, the reading Prometheus does: names, types, help, escaped
label values, cumulative buckets, and the same samples prometheus_client's own writer
gives for the same events.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rhapsode._speech.exposition import CounterFamily, GaugeFamily, HistogramFamily, number, render


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found = {}
    for family in text_string_to_metric_families(text.decode("utf-8")):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


@given(st.text(st.characters(blacklist_categories=("Cs",)), max_size=40), st.text(max_size=60))
def test_any_label_value_and_help_text_reads_back_as_written(value: str, documentation: str) -> None:
    """
    A label value with quotes, backslashes, newlines or anything else, and any help
    text, are escaped so the parser reads the value back exactly.
    """
    counter = CounterFamily("rhapsode_things", documentation, ["engine"])
    counter.labels(value).inc(2)
    [family] = text_string_to_metric_families(render([counter]).decode("utf-8"))
    assert family.name == "rhapsode_things" and family.type == "counter"
    [sample] = family.samples
    assert sample.labels == {"engine": value} and sample.value == 2.0


def test_a_histogram_s_buckets_are_cumulative_and_a_bound_is_inclusive() -> None:
    """
    An observation equal to a bound falls in that bound's bucket; every bucket counts
    all below it; +Inf, _count and _sum close the series.
    """
    histogram = HistogramFamily("rhapsode_seconds", "Seconds.", ["engine"], buckets=(0.5, 1.0, 2.5))
    for amount in (0.1, 0.5, 0.7, 1.0, 3.0):
        histogram.observe(("tone",), amount)
    read = samples(render([histogram]))
    bucket = {le: read[("rhapsode_seconds_bucket", (("engine", "tone"), ("le", le)))]
              for le in ("0.5", "1.0", "2.5", "+Inf")}
    assert bucket == {"0.5": 2.0, "1.0": 4.0, "2.5": 4.0, "+Inf": 5.0}
    assert read[("rhapsode_seconds_count", (("engine", "tone"),))] == 5.0
    assert math.isclose(read[("rhapsode_seconds_sum", (("engine", "tone"),))], 5.3)


def test_the_same_events_give_prometheus_client_s_samples() -> None:
    """
    Counters with and without labels, a histogram and a gauge written by this writer and
    by prometheus_client's generate_latest parse to the same samples.
    """
    disable_created_metrics()
    registry = CollectorRegistry(auto_describe=False)
    theirs_counter = Counter("rhapsode_requests", "Requests.", ["route", "engine"], registry=registry)
    theirs_histogram = Histogram("rhapsode_wait_seconds", "Wait.", ["engine"], buckets=(0.1, 1.0), registry=registry)
    ours_counter = CounterFamily("rhapsode_requests", "Requests.", ["route", "engine"])
    ours_histogram = HistogramFamily("rhapsode_wait_seconds", "Wait.", ["engine"], buckets=(0.1, 1.0))
    for route, engine, amount in (("speak", "tone", 1), ("openai", 'a "b"\\\n', 3), ("speak", "tone", 2)):
        theirs_counter.labels(route, engine).inc(amount)
        ours_counter.labels(route, engine).inc(amount)
    for engine, seconds in (("tone", 0.05), ("tone", 0.1), ("piper", 7.5)):
        theirs_histogram.labels(engine).observe(seconds)
        ours_histogram.observe((engine,), seconds)
    gauge = GaugeFamily("rhapsode_requests_in_flight", "In flight.")
    gauge.set((), 4)
    ours = samples(render([ours_counter, ours_histogram, gauge]))
    assert ours.pop(("rhapsode_requests_in_flight", ())) == 4.0
    assert ours == samples(generate_latest(registry))


def test_refusals_a_counter_going_down_and_labels_that_do_not_match() -> None:
    """
    A counter never goes down; label values must match the names; a histogram's
    bounds are distinct and finite; values are written as Prometheus reads them.
    """
    counter = CounterFamily("rhapsode_x", "X.", ["a", "b"])
    with pytest.raises(ValueError, match="2 label names, 1 values"):
        counter.labels("only one")
    with pytest.raises(ValueError, match="only goes up"):
        counter.labels("a", "b").inc(-1)
    for bounds in ((), (1.0, 1.0), (1.0, math.inf)):
        with pytest.raises(ValueError, match="distinct finite"):
            HistogramFamily("rhapsode_h", "H.", [], buckets=bounds)
    assert [number(v) for v in (math.inf, -math.inf, math.nan, 3, 0.25)] == ["+Inf", "-Inf", "NaN", "3.0", "0.25"]
