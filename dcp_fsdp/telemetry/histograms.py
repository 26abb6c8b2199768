"""Latency histograms: log-spaced buckets (20 per decade), mergeable across ranks, runs
and iterations, stored in records as {bucket index: count}."""

from __future__ import annotations

import collections
import itertools
import math
from typing import Iterable

HIST_BUCKETS_PER_DECADE = 20  # bucket edges 10**(i/20) ms: values within +-6 % of the edge midpoint
HIST_MIN_MS = 1e-3
QUANTILES = {"p50": 0.50, "p90": 0.90, "p99": 0.99}


def hist_bucket(value_ms: float) -> int:
    value_ms = max(value_ms, HIST_MIN_MS)
    return math.floor(math.log10(value_ms) * HIST_BUCKETS_PER_DECADE + 1e-9)


def bucket_bounds_ms(index: int) -> tuple[float, float]:
    return (10 ** (index / HIST_BUCKETS_PER_DECADE), 10 ** ((index + 1) / HIST_BUCKETS_PER_DECADE))


def histogram(values_ms: Iterable[float]) -> dict[str, int]:
    counts = collections.Counter(hist_bucket(v) for v in values_ms)
    return {str(index): counts[index] for index in sorted(counts)}


def hist_merge(histograms: Iterable[dict[str, int] | None]) -> dict[str, int]:
    total: collections.Counter = collections.Counter()
    for hist in histograms:
        for index, count in (hist or {}).items():
            total[int(index)] += int(count)
    return {str(index): total[index] for index in sorted(total)}


def hist_quantile(hist: dict[str, int], q: float) -> float | None:
    """Approximate quantile (ms): the geometric middle of the bucket holding it."""
    items = sorted((int(index), count) for index, count in hist.items() if count)
    total = sum(count for _, count in items)
    if not total:
        return None
    running = itertools.accumulate(count for _, count in items)
    # the first bucket whose running count passes the quantile's rank (else the last)
    index = next((index for (index, _), seen in zip(items, running) if seen > q * (total - 1)),
                 items[-1][0])
    low, high = bucket_bounds_ms(index)
    return math.sqrt(low * high)


def percentiles_ms(values_s: list[float]) -> dict[str, float] | None:
    """QUANTILES of `values_s` in ms (numpy's linear interpolation) and the max."""
    if not values_s:
        return None
    import numpy as np

    values_ms = np.asarray(values_s, dtype=float) * 1e3
    found = {name: round(float(np.percentile(values_ms, 100 * q)), 4) for name, q in QUANTILES.items()}
    found["max"] = round(float(values_ms.max()), 4)
    return found
