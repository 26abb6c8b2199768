"""The report's tables as text: terminal, Markdown, or the wide CSV."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd


def _cell(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if spec == "int":
        return f"{int(round(value))}"
    if spec == "%":
        return f"{100 * value:.2f}"
    return format(value, spec)


# (column name or names joined by "/" in one cell, header, format)
THROUGHPUT_COLUMNS = [
    ("runs", "runs", "int"), ("iterations", "iters", "int"), ("checkpoint_gib", "GiB", ".3f"),
    ("duration_mean_s", "dur mean s", ".3f"), ("duration_p50_s", "dur p50 s", ".3f"),
    ("duration_p90_s", "dur p90 s", ".3f"), ("aggregate_mib_s", "agg MiB/s", ".1f"),
    ("mib_s_per_node", "MiB/s/node", ".1f"),
    (("rank_s_min", "rank_s_median", "rank_s_max"), "rank s min/med/max", ".3f"),
    ("requests_per_op", "req/op", ".1f"), ("req_per_s", "req/s", ".1f"),
    ("failures", "failures", "int"), ("throttles", "throttles", "int"),
    (("latency_p50_ms", "latency_p99_ms"), "lat p50/p99 ms", ".1f"),
    ("failed_runs", "failed runs", "int"),
]
REQUEST_COLUMNS = [
    ("requests_per_op", "req/op", ".1f"), ("req_per_s", "req/s", ".1f"),
    ("success_ratio", "success %", "%"), ("failures", "failures", "int"),
    ("throttles", "throttles", "int"), ("retries", "retries", "int"),
    ("misses", "misses", "int"), ("latency_p50_ms", "lat p50 ms", ".2f"),
    ("latency_p99_ms", "lat p99 ms", ".2f"), ("ttfb_p50_ms", "ttfb p50 ms", ".2f"),
    ("untimed_per_run", "untimed req/run", ".1f"),
]
PHASE_COLUMNS = [
    ("plan_s", "plan s", ".3f"), ("io_s", "io s", ".3f"), ("commit_s", "commit s", ".3f"),
    ("metadata_s", "metadata read s", ".3f"), ("finish_s", "metadata write s", ".3f"),
    (("barrier_wait_mean_s", "barrier_wait_max_s"), "barrier wait mean/max s", ".3f"),
    (("end_skew_mean_s", "end_skew_max_s"), "end skew mean/max s", ".3f"),
    ("slowest_rank", "slowest rank", "int"), ("slowest_lag_s", "slowest - median s", ".3f"),
]
TYPE_COLUMNS = [
    ("request_type", "request type", "s"), ("requests_per_op", "req/op", ".1f"),
    ("mib_per_op", "MiB/op", ".1f"), ("failures", "failures", "int"),
    ("misses", "misses", "int"), ("throttles", "throttles", "int"), ("retries", "retries", "int"),
    ("latency_p50_ms", "lat p50 ms", ".2f"), ("latency_p99_ms", "lat p99 ms", ".2f"),
    ("latency_max_ms", "lat max ms (<=)", ".1f"),
]


def key_cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _table(frame: pd.DataFrame, keys: list[str], columns) -> tuple[list[str], list[list[str]]]:
    headers = list(keys) + [header for _, header, _ in columns]
    rows = []
    for _, row in frame.iterrows():
        cells = [key_cell(row[k]) for k in keys]
        for names, _, spec in columns:
            if isinstance(names, tuple):
                parts = [_cell(row.get(name), spec) for name in names]
                cells.append("/".join(parts) if any(parts) else "")
            else:
                cells.append(_cell(row.get(names), spec))
        rows.append(cells)
    return headers, rows


def render(result: dict[str, Any], fmt: str, warnings: list[str]) -> str:
    from tabulate import tabulate

    keys = result["group_keys"]
    tablefmt = "github" if fmt == "md" else "simple"
    out: list[str] = []

    def heading(text: str) -> None:
        out.append(f"### {text}\n" if fmt == "md" else f"{text}\n{'-' * len(text)}")

    def table(frame, table_keys, columns) -> None:
        headers, rows = _table(frame, table_keys, columns)
        out.append(tabulate(rows, headers=headers, tablefmt=tablefmt, disable_numparse=True))
        out.append("")

    runs = result["runs"]
    ok = int((runs["status"] == "ok").sum()) if len(runs) else 0
    out.append(f"{len(runs)} run(s) read: {ok} ok, {len(runs) - ok} failed or interrupted "
               "(left out of every figure)." + ("\n" if fmt == "md" else ""))
    if result["throughput"].empty:
        out.append("no successful save or load to report.")
    else:
        heading("Throughput (one row per group)")
        table(result["throughput"], keys, THROUGHPUT_COLUMNS)
        heading("S3 requests in the timed regions (all ranks)")
        table(result["throughput"], keys, REQUEST_COLUMNS)
        heading("DCP phases and coordination (mean per rank and operation)")
        table(result["phases"], keys, PHASE_COLUMNS)
        if not result["types"].empty:
            heading("S3 requests by type (timed regions, all ranks)")
            table(result["types"], keys, TYPE_COLUMNS)
    not_ok = result["not_ok"]
    if len(not_ok):
        out.append(f"Left out of every figure: {len(not_ok)} run(s) that did not finish:"
                   + ("\n" if fmt == "md" else ""))
        for _, run in not_ok.iterrows():
            error = " ".join(str(run["error"] or "").split())[:160]
            out.append(f"{'- ' if fmt == 'md' else '  '}{run['run_id']} ({run['command']}, "
                       f"{run['status']}){': ' + error if error else ''}")
        out.append("")
    for warning in warnings:
        out.append(f"note: {warning}")
    return "\n".join(out).rstrip() + "\n"


def wide_csv(result: dict[str, Any]) -> pd.DataFrame:
    """Throughput and phase columns side by side, one row per group (raw numbers)."""
    if result["throughput"].empty:
        return pd.DataFrame(columns=result["group_keys"])
    return result["throughput"].merge(result["phases"], on=result["group_keys"], how="left")
