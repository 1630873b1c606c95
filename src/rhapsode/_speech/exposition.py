"""
The core's own writer of Prometheus's text format (version 0.0.4): counters, gauges and
histograms, each series' label set escaped once when it is first seen, so that a scrape
is string joins and no more (bench/metrics.py; prometheus_client's generate_latest
builds a sample object per line and re-escapes every label on every scrape).

Checked against prometheus_client's own parser (tests/unit/test_exposition.py), which
is how Prometheus reads it.  Label values are bounded by the callers (see
L{rhapsode._speech.metrics}): nothing here limits how many series a family grows.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from typing import Iterable, Sequence

__all__ = ["CounterFamily", "Family", "GaugeFamily", "HistogramFamily", "escape", "number", "render"]


def escape(value: str) -> str:
    """
    A label value as the text format writes it between quotes.
    """
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def number(value: float) -> str:
    """
    A sample's value: Go's float syntax, as Prometheus reads it (C{+Inf}, C{NaN}).
    """
    if value == math.inf:
        return "+Inf"
    if value == -math.inf:
        return "-Inf"
    if value != value:
        return "NaN"
    return repr(float(value))


def _label_text(names: Sequence[str], values: Sequence[str]) -> str:
    if len(names) != len(values):
        raise ValueError(f"{len(names)} label names, {len(values)} values")
    return ",".join(f'{name}="{escape(str(value))}"' for name, value in zip(names, values))


class Family:
    """
    One metric's name, help and label names; its series keyed by their label values.
    """

    kind = "untyped"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.labelnames = tuple(labelnames)
        self._head = f"# HELP {name} {_escape_help(documentation)}\n# TYPE {name} {self.kind}\n"

    def lines(self) -> Iterable[str]:
        raise NotImplementedError

    def text(self) -> str:
        body = "".join(self.lines())
        return self._head + body


class _Value:
    __slots__ = ("labels", "value")

    def __init__(self, labels: str) -> None:
        self.labels = labels
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        self.value += amount


class CounterFamily(Family):
    """
    A counter: C{<name>_total}, each series only ever going up.
    """

    kind = "counter"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name + "_total", documentation, labelnames)
        self._series: dict[tuple[str, ...], _Value] = {}

    def labels(self, *values: str) -> _Value:
        series = self._series.get(values)
        if series is None:
            series = self._series[values] = _Value(_label_text(self.labelnames, values))
        return series

    def set(self, values: Sequence[str], value: float) -> None:
        """
        A counter read from elsewhere at scrape time (a worker's restarts), as it is now.
        """
        self.labels(*values).value = float(value)

    def lines(self) -> Iterable[str]:
        name = self.name
        for series in self._series.values():
            yield f"{name}{{{series.labels}}} {number(series.value)}\n" if series.labels else \
                f"{name} {number(series.value)}\n"


class GaugeFamily(CounterFamily):
    """
    A gauge, set at scrape time from what the core holds.
    """

    kind = "gauge"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        Family.__init__(self, name, documentation, labelnames)
        self._series = {}


class _Buckets:
    __slots__ = ("labels", "counts", "total", "count")

    def __init__(self, labels: str, width: int) -> None:
        self.labels = labels
        self.counts = [0] * width
        self.total = 0.0
        self.count = 0


class HistogramFamily(Family):
    """
    A histogram with fixed upper bounds (and +Inf), each series' buckets cumulative when
    written.
    """

    kind = "histogram"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float]) -> None:
        super().__init__(name, documentation, labelnames)
        bounds = sorted(float(b) for b in buckets)
        if not bounds or len(set(bounds)) != len(bounds) or math.inf in bounds:
            raise ValueError("a histogram's buckets are distinct finite bounds")
        self._bounds = bounds
        self._le = [f'le="{number(b)}"' for b in bounds] + ['le="+Inf"']
        self._series: dict[tuple[str, ...], _Buckets] = {}

    def observe(self, values: Sequence[str], amount: float) -> None:
        key = tuple(values)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = _Buckets(_label_text(self.labelnames, key), len(self._le))
        # The first bound at or above the amount (a bucket is "less than or equal").
        series.counts[bisect_left(self._bounds, amount)] += 1
        series.total += amount
        series.count += 1

    def lines(self) -> Iterable[str]:
        name = self.name
        les = self._le
        for series in self._series.values():
            prefix = series.labels + "," if series.labels else ""
            running = 0
            for le, count in zip(les, series.counts):
                running += count
                yield f"{name}_bucket{{{prefix}{le}}} {running}.0\n"
            labels = f"{{{series.labels}}}" if series.labels else ""
            yield f"{name}_count{labels} {series.count}.0\n"
            yield f"{name}_sum{labels} {number(series.total)}\n"


def render(families: Iterable[Family]) -> bytes:
    """
    Every family's text, in order, as the bytes of one scrape.
    """
    return "".join(family.text() for family in families).encode("utf-8")
