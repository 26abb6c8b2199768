"""Figures from raw samples (pandas). Definitions are in the README's "Metrics".

MiB = 2**20 bytes. For one operation (save or load) of one iteration:
  span_s            = max(end_wall_s) - min(begin_wall_s) over ranks
  aggregate_mib_s   = sum(bytes) / MiB / span_s
  rank_mib_s        = bytes / MiB / duration_s, per rank
  end_skew_s        = max(end_wall_s) - min(end_wall_s)
  requests          = S3 requests of all ranks inside their timed regions (HTTP attempts)
  req_per_s         = requests / span_s
  failed, throttled, retries, misses: see dcp_fsdp.telemetry.request_log
  latency p50/p99   = over every request of the operation (merged log-bucket histograms)
  blocked_span_s    = max(begin_wall_s + blocked_s) - min(begin_wall_s)    (async saves)
  stall_span_s      = max(begin_wall_s + stall_s) - min(begin_wall_s): until every rank may
                      update weights again (sync: the save; async: call + staging)
  persisted_span_s  = max(begin_wall_s + persisted_s) - min(begin_wall_s)
  efficiency        = aggregate_mib_s / the ceiling's aggregate MiB/s (raw_put for save,
                      raw_get for load; total raw bytes / MiB / total raw spans)
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import pandas as pd

from dcp_fsdp.telemetry.histograms import hist_merge, hist_quantile

MIB = 2**20
GIB = 2**30
OPERATION_KEYS = ["run_id", "op", "iteration"]
# flat sample columns taken from each sample's `requests` summary
# the raw storage ceiling measured in the same run, per DCP operation
CEILING_OPS = {"save": "raw_put", "load": "raw_get"}
# sample fields that older records (or hand-made samples) may lack; NaN when absent
OPTIONAL_COLUMNS = ("plan_s", "io_s", "commit_s", "metadata_s", "finish_s", "barrier_wait_s",
                    "requests", "save_mode", "blocked_s", "staged_s", "persisted_s",
                    "previous_wait_s", "train_steps", "train_step_slowdown", "fetched_bytes",
                    "io_wait_s", "copy_s", "stage_s", "upload_s", "peak_rss_bytes",
                    "cuda_max_allocated_bytes", "stall_s", "interval_s", "train_lost_s",
                    "train_lost_share")
REQUEST_COLUMNS = {"req_count": "count", "req_failed": "failed", "req_throttled": "throttled",
                   "req_retries": "retries", "req_misses": "misses",
                   "req_bytes_down": "bytes_down", "req_bytes_up": "bytes_up"}


def _request_value(requests: Any, key: str) -> float:
    if not isinstance(requests, dict):
        return math.nan
    value = requests.get(key)
    return math.nan if value is None else float(value)


def samples_frame(samples: Iterable[dict[str, Any]]) -> pd.DataFrame:
    frame = pd.DataFrame(list(samples))
    if frame.empty:
        return frame
    for column in OPTIONAL_COLUMNS:
        if column not in frame:
            frame[column] = None
    frame["rank_mib_s"] = frame["bytes"] / MIB / frame["duration_s"]
    requests = frame["requests"] if "requests" in frame else pd.Series([None] * len(frame),
                                                                      index=frame.index)
    for column, key in REQUEST_COLUMNS.items():
        frame[column] = [_request_value(r, key) for r in requests]
    return frame


def latency_histogram(requests: Iterable[Any], kinds: Iterable[str] | None = None
                      ) -> dict[str, int]:
    """Merged request-latency histogram of samples' `requests` (optionally some kinds only)."""
    wanted = set(kinds) if kinds is not None else None
    hists = []
    for summary in requests:
        if not isinstance(summary, dict):
            continue
        for kind, entry in (summary.get("by_type") or {}).items():
            if wanted is None or kind in wanted:
                hists.append(entry.get("latency_hist"))
    return hist_merge(hists)


def latency_quantiles_ms(requests: Iterable[Any], quantiles=(0.5, 0.99)) -> list[float]:
    hist = latency_histogram(requests)
    return [math.nan if (v := hist_quantile(hist, q)) is None else v for q in quantiles]


def _sum_or_nan(series: pd.Series) -> float:
    return series.sum(min_count=1)


def _complete_sum(series: pd.Series) -> float:
    """Sum over ranks, NaN unless every rank has the figure (a partial sum would mislead)."""
    series = pd.to_numeric(series, errors="coerce")
    return float(series.sum()) if len(series) and series.notna().all() else math.nan


def _complete_max(series: pd.Series) -> float:
    series = pd.to_numeric(series, errors="coerce")
    return float(series.max()) if len(series) and series.notna().all() else math.nan


def _max_or_nan(series: pd.Series) -> float:
    series = pd.to_numeric(series, errors="coerce").dropna()
    return float(series.max()) if len(series) else math.nan


def per_operation(samples: pd.DataFrame) -> pd.DataFrame:
    """One row per (run, op, iteration): totals over ranks and the spread across them."""
    for column in (*REQUEST_COLUMNS, *OPTIONAL_COLUMNS):
        if column not in samples:
            samples = samples.assign(**{column: math.nan})
    begin = samples["begin_wall_s"].astype(float)
    samples = samples.assign(
        _blocked_end=begin + pd.to_numeric(samples["blocked_s"], errors="coerce"),
        _persisted_end=begin + pd.to_numeric(samples["persisted_s"], errors="coerce"),
        _stall_end=begin + pd.to_numeric(samples["stall_s"], errors="coerce"))
    grouped = samples.groupby(OPERATION_KEYS, sort=False)
    frame = grouped.agg(
        suffix=("suffix", "first"),
        ranks=("rank", "nunique"),
        bytes=("bytes", "sum"),
        first_begin_wall_s=("begin_wall_s", "min"),
        last_end_wall_s=("end_wall_s", "max"),
        first_end_wall_s=("end_wall_s", "min"),
        rank_s_min=("duration_s", "min"),
        rank_s_median=("duration_s", "median"),
        rank_s_max=("duration_s", "max"),
        rank_mib_s_min=("rank_mib_s", "min"),
        rank_mib_s_median=("rank_mib_s", "median"),
        rank_mib_s_max=("rank_mib_s", "max"),
        barrier_wait_s_max=("barrier_wait_s", "max"),
        blocked_end=("_blocked_end", _complete_max),
        persisted_end=("_persisted_end", _complete_max),
        stall_end=("_stall_end", _complete_max),
        fetched_bytes=("fetched_bytes", _complete_sum),
        peak_rss_bytes=("peak_rss_bytes", _max_or_nan),
        cuda_max_allocated_bytes=("cuda_max_allocated_bytes", _max_or_nan),
        **{column: (column, _sum_or_nan) for column in REQUEST_COLUMNS},
    ).reset_index()
    frame["blocked_span_s"] = frame.pop("blocked_end") - frame["first_begin_wall_s"]
    frame["persisted_span_s"] = frame.pop("persisted_end") - frame["first_begin_wall_s"]
    frame["stall_span_s"] = frame.pop("stall_end") - frame["first_begin_wall_s"]
    frame["span_s"] = frame["last_end_wall_s"] - frame["first_begin_wall_s"]
    frame["aggregate_mib_s"] = frame["bytes"] / MIB / frame["span_s"]
    frame["end_skew_s"] = frame["last_end_wall_s"] - frame["first_end_wall_s"]
    frame["req_per_s"] = frame["req_count"] / frame["span_s"]
    if "requests" in samples:
        quantiles = [latency_quantiles_ms(group["requests"]) for _, group in grouped]
        frame["latency_p50_ms"] = [q[0] for q in quantiles]
        frame["latency_p99_ms"] = [q[1] for q in quantiles]
    else:
        frame["latency_p50_ms"] = math.nan
        frame["latency_p99_ms"] = math.nan
    return frame


def _int_or_blank(value: float) -> str:
    return "" if pd.isna(value) else f"{int(value)}"


def _fmt(value: float, spec: str = ".1f") -> str:
    return "" if pd.isna(value) else format(value, spec)


def aggregate_mib_s(ops: pd.DataFrame) -> float:
    """Total bytes / MiB / total spans of some operations (NaN when none)."""
    span_s = ops["span_s"].sum()
    return float(ops["bytes"].sum() / MIB / span_s) if len(ops) and span_s else math.nan


def ceilings_mib_s(ops: pd.DataFrame) -> dict[str, float]:
    """{"save": raw_put aggregate MiB/s, "load": raw_get ...} for the ceilings present."""
    found = {}
    for op, raw in CEILING_OPS.items():
        raw_ops = ops[ops["op"] == raw]
        if len(raw_ops):
            found[op] = aggregate_mib_s(raw_ops)
    return found


def run_table(samples: Iterable[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """The end-of-run table: one row per op and iteration, then a summary per op.
    With a ceiling measured (raw_put / raw_get samples), an efficiency column follows the
    aggregate: the save's (load's) aggregate MiB/s / the run's raw_put (raw_get) one."""
    frame = samples_frame(samples)
    headers = ["op", "iter", "suffix", "MiB", "span s", "aggregate MiB/s",
               "rank s min/med/max", "rank MiB/s min/med/max",
               "requests", "req/s", "failed/throttled", "latency p50/p99 ms"]
    if frame.empty:
        return headers, []
    ops = per_operation(frame)
    ceilings = ceilings_mib_s(ops)
    if ceilings:
        headers.insert(6, "efficiency")
    rows: list[list[Any]] = []

    def efficiency_cells(op: str, aggregate: float) -> list[str]:
        if not ceilings:
            return []
        return [_fmt(aggregate / ceilings[op], ".2f") if op in ceilings else ""]

    def request_cells(count, span_s, failed, throttled, p50, p99) -> list[str]:
        if pd.isna(count):
            return ["", "", "", ""]
        return [_int_or_blank(count), _fmt(count / span_s if span_s else math.nan),
                f"{_int_or_blank(failed)}/{_int_or_blank(throttled)}",
                f"{_fmt(p50)}/{_fmt(p99)}"]

    for _, row in ops.iterrows():
        rows.append([row["op"], row["iteration"], row["suffix"], f"{row['bytes'] / MIB:.1f}",
                     f"{row['span_s']:.3f}", f"{row['aggregate_mib_s']:.1f}",
                     *efficiency_cells(row["op"], row["aggregate_mib_s"]),
                     f"{row['rank_s_min']:.3f}/{row['rank_s_median']:.3f}/{row['rank_s_max']:.3f}",
                     f"{row['rank_mib_s_min']:.1f}/{row['rank_mib_s_median']:.1f}/"
                     f"{row['rank_mib_s_max']:.1f}",
                     *request_cells(row["req_count"], row["span_s"], row["req_failed"],
                                    row["req_throttled"], row["latency_p50_ms"],
                                    row["latency_p99_ms"])])
    for op, group in ops.groupby("op", sort=False):
        if len(group) < 2:
            continue
        op_samples = frame[frame["op"] == op]
        p50, p99 = (latency_quantiles_ms(op_samples["requests"]) if "requests" in op_samples
                    else (math.nan, math.nan))
        rows.append([f"{op} (all)", f"{len(group)}", "", f"{group['bytes'].sum() / MIB:.1f}",
                     f"{group['span_s'].median():.3f} med",
                     f"{group['aggregate_mib_s'].min():.1f}/{group['aggregate_mib_s'].median():.1f}"
                     f"/{group['aggregate_mib_s'].max():.1f}",
                     *efficiency_cells(op, aggregate_mib_s(group)),
                     f"{op_samples['duration_s'].min():.3f}/{op_samples['duration_s'].median():.3f}/"
                     f"{op_samples['duration_s'].max():.3f}",
                     f"{op_samples['rank_mib_s'].min():.1f}/{op_samples['rank_mib_s'].median():.1f}/"
                     f"{op_samples['rank_mib_s'].max():.1f}",
                     *request_cells(_sum_or_nan(group["req_count"]), group["span_s"].sum(),
                                    _sum_or_nan(group["req_failed"]),
                                    _sum_or_nan(group["req_throttled"]), p50, p99)])
    return headers, rows
