"""Per-operation rows from raw samples (pandas), and the end-of-run table.

The headline figures are defined in telemetry/figures.py; here, per operation (docs/report.md):
  rank_mib_s        = bytes / MiB / duration_s, per rank
  end_skew_s        = max(end_wall_s) - min(end_wall_s)
  requests          = S3 requests of all ranks in their timed regions; empty unless all known
  X_span_s          = max(begin_wall_s + X_s) - min(begin_wall_s), X blocked, stall, persisted
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Iterable

import pandas as pd

from dcp_fsdp.units import MIB
from dcp_fsdp.telemetry.figures import (ABOVE_CEILING_LINE, KEYS, NOISE_HINT, NOISY_SPREAD,
                                        ceiling_lines, complete_sum, efficiency,
                                        efficiency_per_operation, egress_mib, headroom_lines,
                                        max_or_nan, noise_note, one_run_if_unnamed, operations,
                                        pooled)
from dcp_fsdp.analysis.columns import cell
from dcp_fsdp.analysis.tables import nan, row_note
from dcp_fsdp.telemetry.histograms import hist_quantile
from dcp_fsdp.telemetry.summaries import merge_by_type

if TYPE_CHECKING:
    from collections.abc import Hashable

__all__ = ["per_operation", "run_table", "run_figures", "samples_frame"]

# sample fields that older records (or hand-made samples) may lack; NaN when absent
OPTIONAL_COLUMNS = ("plan_s", "io_s", "commit_s", "metadata_s", "finish_s", "barrier_wait_s",
                    "requests", "save_mode", "blocked_s", "staged_s", "persisted_s",
                    "previous_wait_s", "train_steps", "train_step_slowdown", "fetched_bytes",
                    "io_wait_s", "copy_s", "stage_s", "upload_s", "peak_rss_bytes",
                    "storage_s", "deserialise_s", "target_copy_s", "minor_faults", "reader",
                    "cuda_max_allocated_bytes", "stall_s", "interval_s", "train_lost_s",
                    "train_lost_share", "train_wait_s")
REQUEST_COLUMNS = {"req_count": "count", "req_failed": "failed", "req_throttled": "throttled",
                   "req_retries": "retries", "req_misses": "misses",
                   "req_bytes_down": "bytes_down", "req_bytes_up": "bytes_up",
                   "req_broken": "broken", "req_broken_max_bytes": "bytes_down_broken_max"}


def _request_value(requests: Any, key: str) -> float:
    if not isinstance(requests, dict) or requests.get("unparsed"):
        return math.nan  # unknown; lines the parser could not read make every count short
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
    for column, key in REQUEST_COLUMNS.items():
        frame[column] = [_request_value(r, key) for r in frame["requests"]]
    return frame


def _complete_max(series: pd.Series) -> float:
    series = pd.to_numeric(series, errors="coerce")
    return float(series.max()) if len(series) and series.notna().all() else math.nan


def per_operation(samples: pd.DataFrame) -> pd.DataFrame:
    """One row per (run, op, iteration) of a samples_frame: totals over ranks and the spread
    across them."""
    samples = one_run_if_unnamed(samples)  # as operations() counts them
    begin = samples["begin_wall_s"].astype(float)
    samples = samples.assign(
        _blocked_end=begin + pd.to_numeric(samples["blocked_s"], errors="coerce"),
        _persisted_end=begin + pd.to_numeric(samples["persisted_s"], errors="coerce"),
        _stall_end=begin + pd.to_numeric(samples["stall_s"], errors="coerce"))
    frame = operations(
        samples,
        suffix=("suffix", "first"),
        ranks=("rank", "nunique"),
        first_end_wall_s=("end_wall_s", "min"),
        rank_s_min=("duration_s", "min"),
        rank_s_median=("duration_s", "median"),
        rank_mib_s_min=("rank_mib_s", "min"),
        rank_mib_s_median=("rank_mib_s", "median"),
        rank_mib_s_max=("rank_mib_s", "max"),
        barrier_wait_s_max=("barrier_wait_s", "max"),
        blocked_end=("_blocked_end", _complete_max),
        persisted_end=("_persisted_end", _complete_max),
        stall_end=("_stall_end", _complete_max),
        fetched_bytes=("fetched_bytes", complete_sum),
        peak_rss_bytes=("peak_rss_bytes", max_or_nan),
        cuda_max_allocated_bytes=("cuda_max_allocated_bytes", max_or_nan),
        **{column: (column, complete_sum) for column in REQUEST_COLUMNS},
    )  # with span_s, aggregate and slowest-rank MiB/s (telemetry/figures.py)
    frame["blocked_span_s"] = frame.pop("blocked_end") - frame["first_begin_wall_s"]
    frame["persisted_span_s"] = frame.pop("persisted_end") - frame["first_begin_wall_s"]
    frame["stall_span_s"] = frame.pop("stall_end") - frame["first_begin_wall_s"]
    frame["end_skew_s"] = frame["last_end_wall_s"] - frame["first_end_wall_s"]
    frame["req_per_s"] = frame["req_count"] / frame["span_s"]
    # a Series of objects (one dict per operation): pandas-stubs type a column assigned from
    # a plain list as scalars only
    frame["latency_by_type"] = pd.Series(
        [latency_by_type(group["requests"]) for _, group in samples.groupby(KEYS, sort=False)]
        if "requests" in samples else [{} for _ in range(len(frame))],
        index=frame.index, dtype=object)
    return frame


def latency_by_type(requests: Iterable[Any]) -> dict[str, dict[str, float]]:
    """{request type: {"count", "p50_ms", "p99_ms"}} over samples' `requests`, most frequent
    type first."""
    return {kind: {"count": entry["count"],
                   "p50_ms": nan(hist_quantile(entry["latency_hist"], 0.5)),
                   "p99_ms": nan(hist_quantile(entry["latency_hist"], 0.99))}
            for kind, entry in merge_by_type(requests).items()}


def _int_or_blank(value: float) -> str:
    return "" if pd.isna(value) else f"{int(value)}"


LATENCY_TYPES_SHOWN = 2  # the most frequent request types in the end-of-run table


def _latency_cell(by_type: dict[str, dict[str, float]]) -> str:
    return ", ".join(f"{kind} {cell(v['p50_ms'], '.1f')}/{cell(v['p99_ms'], '.1f')}"
                     for kind, v in list(by_type.items())[:LATENCY_TYPES_SHOWN])


def run_table(samples: Iterable[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """The end-of-run table (headers, rows); see run_figures."""
    headers, rows, _ = run_figures(samples)
    return headers, rows


_RUN_HEADERS = ["op", "iter", "suffix", "MiB", "egress MiB", "span s", "aggregate MiB/s",
                "efficiency", "slowest-rank MiB/s", "rank s min/med/max", "rank MiB/s min/med/max",
                "requests", "req/s", "failed/throttled", "latency p50/p99 ms by type", "note"]


def run_figures(samples: Iterable[dict[str, Any]]
                ) -> tuple[list[str], list[list[Any]], list[str]]:
    """The end-of-run table: one row per op and iteration, then a pooled "(all)" row per op
    with two or more iterations (the same figures as `report`); and the lines to print under
    it."""
    frame = samples_frame(samples)
    if frame.empty:
        return list(_RUN_HEADERS), [], []
    ops = per_operation(frame)
    ops["efficiency"] = efficiency_per_operation(ops)
    rows = [_operation_row(ops, index, row) for index, row in ops.iterrows()]
    noisy = False
    for op, group in ops.groupby("op", sort=False):
        if len(group) >= 2:
            pooled_row, group_noisy = _pooled_row(frame, ops, str(op), group)
            rows.append(pooled_row)
            noisy = noisy or group_noisy
    # a column empty in every row says nothing (efficiency without a ceiling, requests
    # without request statistics, a note nobody needed): left out
    shown = [i for i in range(len(_RUN_HEADERS)) if any(row[i] != "" for row in rows)]
    notes = []
    if (ops["efficiency"] > 1).any():
        notes.append(ABOVE_CEILING_LINE)
    notes += ceiling_lines(ops) + headroom_lines(ops, frame)
    if noisy:
        notes.append(f"NOISY: the iterations' aggregate MiB/s differ by more than "
                     f"{100 * NOISY_SPREAD:.0f} % of their median (spread); {NOISE_HINT}.")
    return [_RUN_HEADERS[i] for i in shown], [[row[i] for i in shown] for row in rows], notes


def _request_cells(count: float, span_s: float, failed: float, throttled: float,
                   by_type: dict[str, dict[str, float]]) -> list[str]:
    if pd.isna(count):
        return ["", "", "", ""]
    return [_int_or_blank(count), cell(count / span_s if span_s else math.nan, ".1f"),
            f"{_int_or_blank(failed)}/{_int_or_blank(throttled)}", _latency_cell(by_type)]


def _row_cells(op: str, iteration: int | str, suffix: str, figures: pd.Series | dict[str, float],
               egress: float, eff: float, rank_s: tuple[float, float, float],
               rank_mib_s: tuple[float, float, float], requests: list[str], note: str) -> list[Any]:
    return [op, iteration, suffix, f"{figures['bytes'] / MIB:.1f}", cell(egress, ".1f"),
            f"{figures['span_s']:.3f}", cell(figures["aggregate_mib_s"], ".1f"), cell(eff, ".2f"),
            cell(figures["slowest_rank_mib_s"], ".1f"),
            "/".join(f"{v:.3f}" for v in rank_s), "/".join(f"{v:.1f}" for v in rank_mib_s),
            *requests, note]


def _operation_row(ops: pd.DataFrame, index: Hashable, row: pd.Series) -> list[Any]:
    return _row_cells(
        row["op"], row["iteration"], row["suffix"], row, egress_mib(ops.loc[[index]]),
        row["efficiency"],
        (row["rank_s_min"], row["rank_s_median"], row["rank_s_max"]),
        (row["rank_mib_s_min"], row["rank_mib_s_median"], row["rank_mib_s_max"]),
        _request_cells(row["req_count"], row["span_s"], row["req_failed"],
                       row["req_throttled"], row["latency_by_type"]),
        row_note(ops.loc[[index]], row["efficiency"]))


def _pooled_row(frame: pd.DataFrame, ops: pd.DataFrame, op: str,
                group: pd.DataFrame) -> tuple[list[Any], bool]:
    """The "(all)" row of one op's iterations, and whether they were noisy."""
    figures = pooled(group)
    op_samples = frame[frame["op"] == op]
    noisy = bool(noise_note(figures["spread"]))
    spread = ("" if pd.isna(figures["spread"]) else
              f"spread {100 * figures['spread']:.0f} %" + (" NOISY" if noisy else ""))
    pooled_efficiency = efficiency(group, ops)
    durations, rates = op_samples["duration_s"], op_samples["rank_mib_s"]
    return _row_cells(
        f"{op} (all)", f"{len(group)}", "", figures, egress_mib(group), pooled_efficiency,
        (durations.min(), durations.median(), durations.max()),
        (rates.min(), rates.median(), rates.max()),
        _request_cells(complete_sum(group["req_count"]), figures["span_s"],
                       complete_sum(group["req_failed"]), complete_sum(group["req_throttled"]),
                       latency_by_type(op_samples["requests"])), row_note(group, pooled_efficiency, spread)), noisy

