"""Paired rounds, summarised: a variant's figure over its baseline's of the same round,
the geometric mean of those ratios with a 95 % confidence interval (t on the log-ratios).
Shared by the benchmarks that alternate a variant and a baseline round by round
(harness_cost, harness_ab, request_log_cost), and the load average each prints beside a round.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import statistics
from dataclasses import dataclass
from typing import Any

# t quantiles (two-sided 95 %) by degrees of freedom; beyond 30, 1.96 is close enough
_T95 = {1: 12.71, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120,
        17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086, 25: 2.060, 30: 2.042}


def t95(df: int) -> float:
    known = [d for d in _T95 if d <= df]
    return _T95[max(known)] if df <= 30 else 1.96


def ratio_ci(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of paired ratios and its 95 % CI (t on the log-ratios)."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), float("nan"), float("nan")
    half = t95(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def across_runs(runs: list[list[float]]) -> tuple[float, float, float]:
    """The geometric mean over runs of each run's geometric-mean ratio, and its 95 % CI (t over
    the runs): what moves between runs of one command (the process's memory layout, the
    server's state) counts, which the pairs of one run cannot show (docs/harness-cost.md)."""
    return ratio_ci([ratio_ci(ratios)[0] for ratios in runs])


@dataclass(frozen=True)
class PairedRatio:
    """variant / baseline of each round, their geometric mean and its 95 % CI."""

    ratios: list[float]
    mean: float
    low: float
    high: float

    @classmethod
    def of(cls, variant: list[float], baseline: list[float]) -> PairedRatio:
        """Figures of the same rounds, in round order."""
        ratios = [v / b for v, b in zip(variant, baseline)]
        return cls(ratios, *ratio_ci(ratios))

    def cells(self, mean_width: int) -> str:
        """The geometric mean (`mean_width` wide) and the CI (17 wide), as table cells."""
        return f"{self.mean:>{mean_width}.4f} {f'[{self.low:.4f}, {self.high:.4f}]':>17}"


def vacuum(server: Any) -> None:
    """Reclaim the deleted objects' space of an embedded SeaweedFS now (between rounds, outside
    every timer): it frees a volume's deleted bytes only when it vacuums it (every 15 min by
    default), and its volumes fill after some tens of GiB written and deleted (then every PUT
    answers 500 InternalError: a harness_cost run died so at its 7th round of 3 variants)."""
    import urllib.request

    urllib.request.urlopen(vacuum_url(server), timeout=300).read()


def vacuum_url(server: Any) -> str:
    """The embedded SeaweedFS master's vacuum request (what `vacuum` sends; a rank sends it itself)."""
    return f"http://{server.host}:{server.ports['master.port']}/vol/vacuum?garbageThreshold=0.0001"


def load_average() -> float:
    return os.getloadavg()[0]


def finally_on_sigterm() -> None:
    """SIGTERM (kill, a job's end) raises SystemExit, so a benchmark's `finally` stops its
    server and removes its temporary files, as on Ctrl-C (Python's default dies at once)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
