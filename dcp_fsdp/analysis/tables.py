"""One group's rows of the report's tables (raw numbers; definitions: docs/report.md). A
group = the operations of one op under one set of group keys."""

from __future__ import annotations

import collections
import math
from typing import Any, Iterable

import pandas as pd

from dcp_fsdp.analysis.columns import PHASES
from dcp_fsdp.units import GIB, MIB
from dcp_fsdp.telemetry.figures import (above_ceiling_note, amplification_note, broken_note,
                                        complete_sum, efficiency, egress_mib, max_or_nan, mean_or_nan,
                                        noise_note, pooled, read_amplification)
from dcp_fsdp.telemetry.time_split import fresh_pages_per_byte
from dcp_fsdp.telemetry.histograms import bucket_bounds_ms, hist_merge, hist_quantile
from dcp_fsdp.telemetry.records import Sample
from dcp_fsdp.telemetry.summaries import merge_by_type

# save, then its ceiling; load, then its ceiling; anything else after
OP_ORDER = {"save": 0, "raw_put": 1, "raw_put_tensors": 2, "mem_save": 3, "tc_save": 4,
            "load": 5, "raw_get": 6, "raw_get_tensors": 7, "mem_load": 8, "ra_load": 9}
# the phase columns that are sample fields, each a mean per rank and operation
PHASE_MEANS = [c.names for c in PHASES if isinstance(c.names, str) and c.names in Sample.model_fields]
# kinds of request that carry a rank's uploaded bytes (summaries only know bytes_up in all)
UPLOAD_KINDS = ("UploadPart", "PutObject")


def nan(value: float | None) -> float:
    return math.nan if value is None else value


def select(frame: pd.DataFrame, labels: dict[str, Any] | pd.Series | None,
           keys: Iterable[str]) -> pd.DataFrame:
    """The rows of `frame` whose `keys` read as `labels`' (compared as text)."""
    if frame is None or frame.empty or labels is None:
        return pd.DataFrame()
    mask = pd.Series(True, index=frame.index)
    for key in keys:
        if key in frame and key in labels:
            mask &= frame[key].astype(str) == str(labels[key])
    return frame[mask]


def _persisted_mib_s(group_ops: pd.DataFrame) -> float:
    """Bytes / MiB over the persisted spans of the operations with one, pooled as the aggregate is."""
    have = group_ops[group_ops["persisted_span_s"].notna()]
    ends = have["first_begin_wall_s"] + have["persisted_span_s"]
    return pooled(have.assign(last_end_wall_s=ends))["aggregate_mib_s"]


def slowest_mean(group_samples: pd.DataFrame, field: str) -> float:
    """The slowest rank's `field` (max over ranks) per operation, mean over operations."""
    values = pd.to_numeric(group_samples[field], errors="coerce")
    per_op = group_samples.assign(_v=values).groupby(["run_id", "iteration"])["_v"].max()
    return mean_or_nan(per_op)


def order_figures(group_ops: pd.DataFrame) -> dict[str, float]:
    """Mean span and pooled aggregate of the first operations (iteration 1: cold) and the later."""
    found = {}
    for order in ("first", "later"):
        ops = group_ops[group_ops["op_order"] == order]
        found[f"{order}_dur_s"] = float(ops["span_s"].mean())
        found[f"{order}_mib_s"] = pooled(ops)["aggregate_mib_s"]
    return found


def row_note(ops: pd.DataFrame, eff: float, spread: str = "") -> str:
    """A row's note (report, end-of-run table): read amplification, spread, broken GETs, ceiling."""
    broken = broken_note(complete_sum(ops["req_broken"]), complete_sum(ops["req_broken_max_bytes"]),
                         complete_sum(ops["fetched_bytes"]), float(ops["bytes"].sum()))
    return ", ".join(n for n in (amplification_note(read_amplification(ops)), spread, broken,
                                 above_ceiling_note(eff)) if n)


def throughput_row(labels: dict[str, Any], group_ops: pd.DataFrame,
                   group_samples: pd.DataFrame, untimed: pd.Series, failed_runs: float,
                   all_ops: pd.DataFrame) -> dict[str, Any]:
    """`all_ops`: every operation of the report (a save's efficiency divides by its run's
    best raw_put, in another group)."""
    nodes = labels["nodes"]
    figures = pooled(group_ops)
    span_total = figures["span_s"]
    aggregate = figures["aggregate_mib_s"]
    # a group with an operation whose requests are unknown (null: none parsed) has no
    # request figures: a partial count would read as fewer requests, or no failures
    count = complete_sum(group_ops["req_count"])
    known = {column: math.nan if math.isnan(count) else complete_sum(group_ops[f"req_{column}"])
             for column in ("failed", "throttled", "retries", "misses")}
    failed = known["failed"]
    ttfb = hist_merge(r.get("ttfb_hist") for r in group_samples["requests"]
                      if isinstance(r, dict))
    group_efficiency = efficiency(group_ops, all_ops)
    return {
        **labels,
        "runs": group_ops["run_id"].nunique(),
        "iterations": len(group_ops),
        "checkpoint_gib": group_ops["bytes"].mean() / GIB,
        "duration_mean_s": group_ops["span_s"].mean(),
        "duration_p50_s": group_ops["span_s"].quantile(0.5),
        "duration_p90_s": group_ops["span_s"].quantile(0.9),
        **order_figures(group_ops),
        "aggregate_mib_s": aggregate,
        "slowest_rank_mib_s": figures["slowest_rank_mib_s"],
        "spread": figures["spread"],
        "efficiency": group_efficiency,
        "mib_s_per_node": aggregate / nodes if nodes else math.nan,
        "stall_mean_s": mean_or_nan(group_ops["stall_span_s"]),
        # the slowest rank holds the others back: max over ranks, mean over saves
        "train_lost_share": slowest_mean(group_samples, "train_lost_share"),
        "persisted_mib_s": _persisted_mib_s(group_ops),
        "fetched_ratio": read_amplification(group_ops),
        "egress_mib_per_op": egress_mib(group_ops) / len(group_ops),
        "note": row_note(group_ops, group_efficiency, noise_note(figures["spread"])),
        "rank_s_min": group_samples["duration_s"].min(),
        "rank_s_median": group_samples["duration_s"].median(),
        "rank_s_max": group_samples["duration_s"].max(),
        "requests_per_op": count / len(group_ops),  # NaN where unknown
        "req_per_s": count / span_total if span_total else math.nan,
        "success_ratio": (count - failed) / count if count else math.nan,
        "failures": failed,
        "throttles": known["throttled"],
        "retries": known["retries"],
        "misses": known["misses"],
        "ttfb_p50_ms": nan(hist_quantile(ttfb, 0.5)),
        "untimed_per_run": mean_or_nan(untimed),
        "failed_runs": failed_runs,
    }


def _slowest_rank(group_samples: pd.DataFrame) -> tuple[Any, float]:
    """The rank slowest most often, and how much longer the slowest rank took than the median."""
    slowest, lags = [], []
    for _, op in group_samples.groupby(["run_id", "op", "iteration"]):
        # argmax: the position idxmax takes the label of (first maximum, NaN skipped)
        slowest.append(int(op["rank"].iloc[int(op["duration_s"].argmax())]))
        lags.append(float(op["duration_s"].max() - op["duration_s"].median()))
    mode = pd.Series(slowest).mode()
    return (int(mode.iloc[0]) if len(mode) else None), float(pd.Series(lags).mean())


def phase_row(labels: dict[str, Any], group_samples: pd.DataFrame, group_ops: pd.DataFrame
              ) -> dict[str, Any]:
    slowest, lag = _slowest_rank(group_samples)
    return {
        **labels,
        **{field: mean_or_nan(group_samples[field]) for field in PHASE_MEANS},
        "barrier_wait_mean_s": mean_or_nan(group_samples["barrier_wait_s"]),
        "barrier_wait_max_s": max_or_nan(group_samples["barrier_wait_s"]),
        "end_skew_mean_s": group_ops["end_skew_s"].mean(),
        "end_skew_max_s": group_ops["end_skew_s"].max(),
        "slowest_rank": slowest,
        "slowest_lag_s": lag,
        "peak_rss_gib": max_or_nan(group_ops["peak_rss_bytes"]) / GIB,
        "fresh_pages_per_byte": fresh_pages_per_byte(group_samples),
        "cuda_max_allocated_gib": max_or_nan(group_ops["cuda_max_allocated_bytes"]) / GIB,
    }


def _request_bytes(summary: dict[str, Any]) -> dict[str, int]:
    """Bytes per request type of one sample: the per-request sizes where the log has them
    (GETs), else the rank's bytes_up on its upload requests (UploadPart, else PutObject)."""
    by_type = summary.get("by_type") or {}
    found = {kind: entry["bytes"] for kind, entry in by_type.items()
             if entry.get("bytes") is not None}
    bytes_up = summary.get("bytes_up")
    if bytes_up is not None and not any(kind in found for kind in UPLOAD_KINDS):
        kind = next((k for k in UPLOAD_KINDS if k in by_type), None)
        if kind:
            found[kind] = bytes_up
    return found


def type_rows(labels: dict[str, Any], group_samples: pd.DataFrame, operations: int
              ) -> list[dict[str, Any]]:
    """Per request type, per operation: none unless every sample has all its requests (a
    partial sum would read as fewer requests)."""
    if not all(isinstance(r, dict) and not r.get("unparsed") for r in group_samples["requests"]):
        return []
    sizes: collections.Counter[str] = collections.Counter()
    for summary in group_samples["requests"]:
        sizes.update(_request_bytes(summary))
    rows = []
    for kind, into in merge_by_type(group_samples["requests"]).items():
        hist = into["latency_hist"]
        rows.append({**labels, "request_type": kind, "requests_per_op": into["count"] / operations,
                     "failures": into["failed"], "misses": into["misses"],
                     "throttles": into["throttled"], "retries": into["retries"],
                     "mib_per_op": sizes[kind] / MIB / operations if kind in sizes else math.nan,
                     "latency_p50_ms": nan(hist_quantile(hist, 0.5)),
                     "latency_p99_ms": nan(hist_quantile(hist, 0.99)),
                     "latency_max_ms": nan(_hist_max(hist))})
    return rows


def _hist_max(hist: dict[str, int]) -> float | None:
    indices = [int(i) for i, n in hist.items() if n]
    return bucket_bounds_ms(max(indices))[1] if indices else None


def ordered(frame: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Rows by node count, ranks, model, then OP_ORDER (stable for the rest)."""
    if frame.empty:
        return frame
    order = frame.assign(_op=frame["op"].map(OP_ORDER).fillna(9))
    sort_keys = ["nodes", "ranks", "model", "_op", *[k for k in keys if k not in
                                                     ("nodes", "ranks", "model", "op")]]
    order = order.sort_values(sort_keys, kind="stable", key=lambda c: c.map(_sortable))
    return order.drop(columns="_op").reset_index(drop=True)


def _sortable(value: Any) -> Any:
    """Numbers before text, numerically; blanks last."""
    if value == "" or value is None:
        return (2, "")
    try:
        return (0, float(value))
    except (TypeError, ValueError):
        return (1, str(value))
