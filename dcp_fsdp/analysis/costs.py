"""Dollars of a checkpoint, from a run's own request counts and bytes, and a prices file
(YAML; default conf/prices/s3-standard-us-east-1.yaml, dated and sourced). Formulas and
assumptions: docs/decisions.md "Dollars per checkpoint"."""

from __future__ import annotations

import collections
import dataclasses
import math
from pathlib import Path
from typing import Any

from dcp_fsdp.config.conf_dir import conf_dir

DEFAULT_PRICES = conf_dir() / "prices" / "s3-standard-us-east-1.yaml"  # source tree or wheel
SECONDS_PER_DAY = 86400.0
MONTHS_PER_DAY = 12 / 365
_NUMBERS = ("put_per_1000", "get_per_1000", "storage_per_gb_month", "gb_bytes")


class PricesError(ValueError):
    """A prices file that cannot be used: the message names the file and the fix."""


@dataclasses.dataclass(frozen=True)
class Prices:
    name: str
    source: str
    checked: str
    currency: str
    put_per_1000: float
    get_per_1000: float
    storage_per_gb_month: float
    gb_bytes: float
    put_class: frozenset[str]
    free: frozenset[str]
    path: str = ""

    def describe(self) -> str:
        return (f"{self.name} ({self.currency}; {self.source}, checked {self.checked}; "
                f"file {self.path})")


def load_prices(path: str | Path | None = None) -> Prices:
    """The prices in `path` (default: S3 Standard us-east-1); PricesError if unusable."""
    import yaml

    path = Path(path) if path is not None else DEFAULT_PRICES
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as error:
        raise PricesError(f"--prices {path}: cannot read it ({error.strerror or error}); "
                          f"give a YAML file like {DEFAULT_PRICES.name}") from None
    except yaml.YAMLError as error:
        raise PricesError(f"--prices {path}: not YAML ({str(error).splitlines()[0]}); "
                          f"copy {DEFAULT_PRICES} and edit it") from None
    if not isinstance(data, dict):
        raise PricesError(f"--prices {path}: not a mapping of prices; copy {DEFAULT_PRICES} "
                          "and edit it")
    missing = [key for key in (*_NUMBERS, "source", "checked") if key not in data]
    if missing:
        raise PricesError(f"--prices {path}: missing {', '.join(missing)}; every price needs "
                          f"its source and date (see {DEFAULT_PRICES.name})")
    numbers = {}
    for key in _NUMBERS:
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not math.isfinite(value) or value < 0 or (key == "gb_bytes" and value <= 0):
            raise PricesError(f"--prices {path}: {key}={value!r} must be a number >= 0"
                              + (" (> 0)" if key == "gb_bytes" else ""))
        numbers[key] = float(value)
    return Prices(name=str(data.get("name") or path.stem), source=str(data["source"]),
                  checked=str(data["checked"]), currency=str(data.get("currency") or "USD"),
                  put_class=frozenset(map(str, data.get("put_class") or [])),
                  free=frozenset(map(str, data.get("free") or [])), path=str(path), **numbers)


@dataclasses.dataclass
class RequestCharge:
    put_class: float  # requests per operation (summed over ranks)
    get_class: float
    free: float
    dollars: float


@dataclasses.dataclass
class RequestCounts:
    """One group's requests per operation by type, or None unless every count is known (a
    partial sum divided by every operation would price low)."""

    per_type: dict[str, float] | None  # {request type: requests per operation}
    samples: int  # the group's samples (rank x operation)
    missing: int  # samples without a request count (or in an operation showing none)


def _has_counts(requests: Any) -> bool:
    """A summary whose counts hold every request of its window: none left unparsed."""
    return (isinstance(requests, dict) and isinstance(requests.get("by_type"), dict)
            and not requests.get("unparsed"))


def late_runs(runs: list[dict[str, Any]]) -> set[str]:
    """The runs some of whose timed requests reached the log after their window was
    summarised (counted untimed, as `late`): their operations' counts lack them."""
    return {run["run_id"] for run in runs if (run["untimed_requests"] or {}).get("late")}


def request_counts(samples: Any, late: set[str] | frozenset[str] = frozenset()) -> RequestCounts:
    """From a group's samples (a frame); the samples of `late` runs (late_runs) count as missing."""
    if len(samples) == 0 or "requests" not in samples:
        return RequestCounts(None, len(samples), len(samples))
    missing = 0
    per_type: collections.Counter[str] = collections.Counter()
    operations = samples.groupby(["run_id", "iteration"], sort=False)
    for (run_id, _), op in operations:
        if str(run_id) in late:
            missing += len(op)
            continue
        summaries = list(op["requests"])
        known = [s for s in summaries if _has_counts(s)]
        counted = sum(entry.get("count") or 0 for s in known for entry in s["by_type"].values())
        if len(known) < len(summaries) or (counted == 0 and float(op["bytes"].sum()) > 0):
            missing += len(summaries) - (len(known) if counted else 0)
            continue
        for summary in known:
            per_type.update({kind: entry.get("count") or 0 for kind, entry in summary["by_type"].items()})
    if missing:
        return RequestCounts(None, len(samples), missing)
    count = operations.ngroups
    return RequestCounts({k: n / count for k, n in per_type.items()}, len(samples), 0)


def request_charge(counts: dict[str, float], prices: Prices) -> RequestCharge:
    """The charge for one operation's requests, `counts` = {request type: count}."""
    put = sum(n for kind, n in counts.items() if kind in prices.put_class)
    free = sum(n for kind, n in counts.items() if kind in prices.free)
    get = sum(counts.values()) - put - free
    dollars = put / 1000 * prices.put_per_1000 + get / 1000 * prices.get_per_1000
    return RequestCharge(put, get, free, dollars)


def storage_dollars_per_month(stored_bytes: float, prices: Prices) -> float:
    return stored_bytes / prices.gb_bytes * prices.storage_per_gb_month


def dollars_per_day(interval_s: float, job_mtbf_s: float, save_dollars: float,
                    load_dollars: float | None, checkpoint_month_dollars: float,
                    keep: int) -> dict[str, float]:
    """Saves, expected restarts (one load each) and K retained checkpoints, per day."""
    saves = SECONDS_PER_DAY / interval_s * save_dollars
    restarts = (SECONDS_PER_DAY / job_mtbf_s * load_dollars) if load_dollars is not None \
        else math.nan
    storage = keep * checkpoint_month_dollars * MONTHS_PER_DAY
    return {"saves": saves, "restarts": restarts, "storage": storage,
            "total": saves + (0.0 if math.isnan(restarts) else restarts) + storage}


def is_priced(storage_label: Any) -> bool:
    """S3 (AWS or any S3 server: priced as if on the prices file's S3); not a file system."""
    return str(storage_label).startswith("s3")
