"""Grouping runs' samples into the report's tables (DataFrames of raw numbers).

Groups: node count, world size, model, operation, storage, and every setting that
differs between the runs. Failed and interrupted runs are left out of every figure,
but counted per group.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pandas as pd

from dcp_fsdp.analysis.metrics import GIB, MIB, latency_histogram, per_operation, samples_frame
from dcp_fsdp.telemetry.histograms import bucket_bounds_ms, hist_merge, hist_quantile

FIXED_KEYS = ["nodes", "ranks", "model", "op", "storage"]
# Settings never used to split groups: they name places or runs, not how a run behaves.
NOT_SETTINGS = {
    "command", "suffix", "results_dir", "nproc", "iterations", "seed", "op_timeout_s",
    "collective_timeout_s", "model.preset", "storage.kind", "storage.uri", "storage.endpoint",
    "storage.path", "storage.region", "storage.connect_timeout_s", "keep_request_log",
}


def _flatten(prefix: str, value: Any, into: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), inner, into)
    else:
        into[prefix] = json.dumps(value) if isinstance(value, list) else value


def storage_label(run: dict[str, Any]) -> str:
    storage = run.get("storage") or {}
    config = (run.get("config") or {}).get("storage") or {}
    kind = storage.get("kind") or config.get("kind") or "?"
    if kind != "s3":
        return kind
    if storage.get("embedded"):
        return "s3 (embedded SeaweedFS)"
    endpoint = storage.get("endpoint") or config.get("endpoint")
    if endpoint:
        host = endpoint.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0]
        return f"s3 ({host})"
    return f"s3 (AWS {storage.get('region') or config.get('region') or ''})".replace(" )", ")")


def _untimed_count(summary: dict[str, Any] | None) -> int | None:
    """Requests outside the timed regions: the connector's plus boto3 control-plane calls."""
    if not summary:
        return None
    control = sum(n for per_status in (summary.get("control_plane") or {}).values()
                  for n in per_status.values())
    return (summary.get("count") or 0) + control


def runs_frame(runs: list[dict[str, Any]]) -> tuple[pd.DataFrame, list[str]]:
    """One row per run with the group columns; and the names of the varying settings."""
    rows = []
    settings_per_run = []
    for run in runs:
        model = run.get("model") or {}
        config = run.get("config") or {}
        settings: dict[str, Any] = {}
        _flatten("", config, settings)
        settings_per_run.append(settings)
        rows.append({
            "run_id": run.get("run_id"),
            "status": run.get("status") or "unknown",
            "error": run.get("error"),
            "command": run.get("command"),
            "started_at": run.get("started_at"),
            "nodes": run.get("node_count"),
            "ranks": run.get("world_size"),
            "model": model.get("preset") or (config.get("model") or {}).get("preset"),
            "storage": storage_label(run),
            "untimed_requests": _untimed_count(run.get("untimed_requests")),
        })
    varying = []
    keys = sorted({key for settings in settings_per_run for key in settings} - NOT_SETTINGS)
    for key in keys:
        # a setting older records lack does not split groups by itself
        values = {json.dumps(s[key], sort_keys=True, default=str)
                  for s in settings_per_run if key in s}
        if len(values) > 1:
            varying.append(key)
    frame = pd.DataFrame(rows)
    for key in varying:
        frame[key] = [("" if key not in s else
                       str(s[key]).lower() if isinstance(s[key], bool) else str(s[key]))
                      for s in settings_per_run]
    return frame, varying


# -- tables ------------------------------------------------------------------------------

def _q(series: pd.Series, q: float) -> float:
    series = series.dropna()
    return float(series.quantile(q)) if len(series) else math.nan


def _sum(series: pd.Series) -> float:
    return series.sum(min_count=1)


def mean_or_nan(series: pd.Series) -> float:
    series = series.dropna()
    return float(series.mean()) if len(series) else math.nan


def _slowest_rank(group_samples: pd.DataFrame) -> tuple[Any, float]:
    """The rank slowest most often, and how much longer the slowest rank took than the median."""
    if group_samples.empty:
        return None, math.nan
    slowest = []
    lags = []
    for _, op in group_samples.groupby(["run_id", "op", "iteration"]):
        worst = op.loc[op["duration_s"].idxmax()]
        slowest.append(int(worst["rank"]))
        lags.append(float(op["duration_s"].max() - op["duration_s"].median()))
    mode = pd.Series(slowest).mode()
    return (int(mode.iloc[0]) if len(mode) else None), float(pd.Series(lags).mean())


def build(runs: list[dict], samples: list[dict]) -> dict[str, Any]:
    """Every table the report prints, as DataFrames of raw numbers."""
    run_rows, varying = runs_frame(runs)
    group_keys = FIXED_KEYS + varying
    ok_ids = set(run_rows.loc[run_rows["status"] == "ok", "run_id"])
    ok_samples = [s for s in samples if s.get("run_id") in ok_ids]
    empty = pd.DataFrame()
    result: dict[str, Any] = {"group_keys": group_keys, "varying": varying, "runs": run_rows,
                              "throughput": empty, "phases": empty, "types": empty,
                              "samples": empty, "operations": empty}
    not_ok = run_rows[run_rows["status"] != "ok"]
    result["not_ok"] = not_ok
    if not ok_samples:
        return result
    frame = samples_frame(ok_samples)
    for column in ("plan_s", "io_s", "commit_s", "metadata_s", "finish_s", "barrier_wait_s",
                   "requests"):
        if column not in frame:
            frame[column] = None
    attributes = run_rows[["run_id", *[k for k in group_keys if k != "op"]]]
    frame = frame.merge(attributes, on="run_id", how="left")
    for key in group_keys:
        frame[key] = frame[key].astype(object).where(frame[key].notna(), "")
    ops = per_operation(frame).drop(columns=["ranks"]).merge(attributes, on="run_id", how="left")
    for key in group_keys:
        ops[key] = ops[key].astype(object).where(ops[key].notna(), "")
    result["samples"], result["operations"] = frame, ops

    throughput, phases, types = [], [], []
    failed_runs = not_ok.copy()
    for key, group_ops in ops.groupby(group_keys, sort=True, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        labels = dict(zip(group_keys, key))
        mask = pd.Series(True, index=frame.index)
        for name, value in labels.items():
            mask &= frame[name] == value
        group_samples = frame[mask]
        nodes = labels["nodes"]
        span_total = group_ops["span_s"].sum()
        aggregate = group_ops["bytes"].sum() / MIB / span_total if span_total else math.nan
        count = _sum(group_ops["req_count"])
        failed = _sum(group_ops["req_failed"])
        hist = latency_histogram(group_samples["requests"])
        ttfb = hist_merge(r.get("ttfb_hist") for r in group_samples["requests"]
                          if isinstance(r, dict))
        untimed = run_rows.loc[run_rows["run_id"].isin(set(group_ops["run_id"])),
                               "untimed_requests"].astype(float)
        same_group = failed_runs
        for name in ("nodes", "ranks", "model", "storage", *varying):
            same_group = same_group[same_group[name].astype(str) == str(labels[name])]
        same_group = same_group[same_group["command"].isin(
            ["save", "save-and-load"] if labels["op"] == "save" else ["load", "save-and-load"])]
        throughput.append({
            **labels,
            "runs": group_ops["run_id"].nunique(),
            "iterations": len(group_ops),
            "checkpoint_gib": group_ops["bytes"].mean() / GIB,
            "duration_mean_s": group_ops["span_s"].mean(),
            "duration_p50_s": _q(group_ops["span_s"], 0.5),
            "duration_p90_s": _q(group_ops["span_s"], 0.9),
            "aggregate_mib_s": aggregate,
            "mib_s_per_node": aggregate / nodes if nodes else math.nan,
            "rank_s_min": group_samples["duration_s"].min(),
            "rank_s_median": group_samples["duration_s"].median(),
            "rank_s_max": group_samples["duration_s"].max(),
            "requests_per_op": count / len(group_ops) if not pd.isna(count) else math.nan,
            "req_per_s": count / span_total if span_total and not pd.isna(count) else math.nan,
            "success_ratio": (count - failed) / count if count else math.nan,
            "failures": failed,
            "throttles": _sum(group_ops["req_throttled"]),
            "retries": _sum(group_ops["req_retries"]),
            "misses": _sum(group_ops["req_misses"]),
            "latency_p50_ms": _nan(hist_quantile(hist, 0.5)),
            "latency_p99_ms": _nan(hist_quantile(hist, 0.99)),
            "ttfb_p50_ms": _nan(hist_quantile(ttfb, 0.5)),
            "untimed_per_run": mean_or_nan(untimed),
            "failed_runs": len(same_group),
        })
        slowest, lag = _slowest_rank(group_samples)
        phases.append({
            **labels,
            "plan_s": mean_or_nan(group_samples["plan_s"].astype(float)),
            "io_s": mean_or_nan(group_samples["io_s"].astype(float)),
            "commit_s": mean_or_nan(group_samples["commit_s"].astype(float)),
            "metadata_s": mean_or_nan(group_samples["metadata_s"].astype(float)),
            "finish_s": mean_or_nan(group_samples["finish_s"].astype(float)),
            "barrier_wait_mean_s": mean_or_nan(group_samples["barrier_wait_s"].astype(float)),
            "barrier_wait_max_s": group_samples["barrier_wait_s"].astype(float).max(),
            "end_skew_mean_s": group_ops["end_skew_s"].mean(),
            "end_skew_max_s": group_ops["end_skew_s"].max(),
            "slowest_rank": slowest,
            "slowest_lag_s": lag,
        })
        types.extend(_type_rows(labels, group_samples, len(group_ops)))
    result["throughput"] = _ordered(pd.DataFrame(throughput), group_keys)
    result["phases"] = _ordered(pd.DataFrame(phases), group_keys)
    result["types"] = _ordered(pd.DataFrame(types), group_keys)
    return result


OP_ORDER = {"save": 0, "load": 1}


def _ordered(frame: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Rows by node count, ranks, model, then save before load (stable for the rest)."""
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


def _nan(value: float | None) -> float:
    return math.nan if value is None else value


def _type_rows(labels: dict[str, Any], group_samples: pd.DataFrame, operations: int
               ) -> list[dict[str, Any]]:
    per_kind: dict[str, dict[str, Any]] = {}
    for summary in group_samples["requests"]:
        if not isinstance(summary, dict):
            continue
        for kind, entry in (summary.get("by_type") or {}).items():
            into = per_kind.setdefault(kind, {"count": 0, "failed": 0, "misses": 0,
                                              "throttled": 0, "retries": 0, "bytes": None,
                                              "hists": []})
            for key in ("count", "failed", "misses", "throttled", "retries"):
                into[key] += entry.get(key) or 0
            if entry.get("bytes") is not None:
                into["bytes"] = (into["bytes"] or 0) + entry["bytes"]
            into["hists"].append(entry.get("latency_hist"))
    rows = []
    for kind, into in sorted(per_kind.items(), key=lambda item: -item[1]["count"]):
        hist = hist_merge(into["hists"])
        rows.append({**labels, "request_type": kind, "requests_per_op": into["count"] / operations,
                     "failures": into["failed"], "misses": into["misses"],
                     "throttles": into["throttled"], "retries": into["retries"],
                     "mib_per_op": (into["bytes"] / MIB / operations
                                    if into["bytes"] is not None else math.nan),
                     "latency_p50_ms": _nan(hist_quantile(hist, 0.5)),
                     "latency_p99_ms": _nan(hist_quantile(hist, 0.99)),
                     "latency_max_ms": _nan(_hist_max(hist))})
    return rows


def _hist_max(hist: dict[str, int]) -> float | None:
    indices = [int(i) for i, n in hist.items() if n]
    return bucket_bounds_ms(max(indices))[1] if indices else None
