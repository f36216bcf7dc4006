"""A Prometheus histogram that takes several equal observations in one call: the API's latency series.

The API process observes a token's latency as its events arrive — at hundreds of streams, tens of
thousands of tokens a second on one event loop. ``prometheus_client.Histogram.observe`` takes one
value per call (a lock, a Python loop over the buckets); a batch of ``n`` tokens that reached the API
together is one gap and ``n - 1`` zero gaps, so :meth:`CountedHistogram.observe` takes a count and
costs one bucket search whatever ``n`` is. The exposition is the standard histogram (``_bucket``
with ``le``, ``_sum``, ``_count``), collected at scrape time.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class CountedHistogram(Collector):
    """Histogram ``name`` with ``buckets`` (upper bounds, ascending; +Inf added), registered in ``registry``."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry) -> None:
        bounds = [float(b) for b in buckets]
        if not bounds or bounds != sorted(set(bounds)):
            raise ValueError(f"{name}: buckets must be ascending and distinct, got {list(buckets)}")
        if bounds[-1] != math.inf:
            bounds.append(math.inf)
        self.name = name
        self.documentation = documentation
        self._bounds = tuple(bounds)
        self._counts = [0] * len(bounds)
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        """Record ``count`` observations of ``value`` (seconds)."""
        if count <= 0:
            return
        index = bisect.bisect_left(self._bounds, value)  # the first bucket whose bound is >= value
        with self._lock:
            self._counts[index] += count
            self._sum += value * count

    def collect(self) -> Iterator[HistogramMetricFamily]:
        yield self.family(self.name, self.documentation)

    def family(self, name: str, documentation: str, labels: dict[str, str] | None = None) -> HistogramMetricFamily:
        """The histogram now, exposed as ``name`` (with ``labels``): the same counts under another name."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for bound, count in zip(self._bounds, counts, strict=True):
            running += count
            cumulative.append((floatToGoString(bound), running))
        family = HistogramMetricFamily(name, documentation, labels=list(labels or ()))
        family.add_metric(list((labels or {}).values()), cumulative, total)
        return family

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.documentation)
