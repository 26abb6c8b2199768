"""`dcp-fsdp report [PATH ...]`: tables and plots over many runs' records.

Reads record files (JSON Lines, one per run: a run line, then one line per rank
per save/load), and groups the saves and loads by node count, world size, model,
operation, storage backend and every setting that differs between the runs.
Failed and interrupted runs are left out of every figure, but counted per group
and listed under the tables. Records from older versions that lack a field
report it empty.

Output: the terminal (default), Markdown (--format md) or CSV (--format csv, or
--csv FILE besides another format); PNG plots with --plot DIR.
Metric definitions: docs/report.md.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import sys
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from dcp_fsdp.metrics import GIB, MIB, latency_histogram, per_operation, samples_frame
from dcp_fsdp.s3_requests import bucket_bounds_ms, hist_merge, hist_quantile

FIXED_KEYS = ["nodes", "ranks", "model", "op", "storage"]
# Settings never used to split groups: they name places or runs, not how a run behaves.
NOT_SETTINGS = {
    "command", "suffix", "results_dir", "nproc", "iterations", "seed", "op_timeout_s",
    "collective_timeout_s", "model.preset", "storage.kind", "storage.uri", "storage.endpoint",
    "storage.path", "storage.region", "storage.connect_timeout_s", "keep_request_log",
}
RUN_DEFAULT_PATHS = ["results"]
MAX_PLOT_GROUPS = 6  # rows of the per-rank figure


# -- reading -----------------------------------------------------------------------------

def record_files(paths: Iterable[str]) -> list[Path]:
    """Record files named by files, directories (searched recursively) or globs."""
    found: list[Path] = []
    for text in paths:
        path = Path(text)
        if any(ch in text for ch in "*?["):
            matches = [Path(m) for m in sorted(glob.glob(text, recursive=True))]
            for match in matches:
                found.extend(sorted(match.rglob("*.jsonl")) if match.is_dir() else [match])
        elif path.is_dir():
            found.extend(sorted(path.rglob("*.jsonl")))
        elif path.is_file():
            found.append(path)
        else:
            raise FileNotFoundError(f"{text}: no such file or directory")
    unique = []
    for path in found:
        if path not in unique and path.suffix == ".jsonl":
            unique.append(path)
    return unique


def read_records(files: Iterable[Path]) -> tuple[list[dict], list[dict], list[str]]:
    """(runs, samples, warnings). Bad lines and files without a run line are skipped."""
    runs: list[dict] = []
    samples: list[dict] = []
    warnings: list[str] = []
    for path in files:
        file_runs, file_samples, bad = [], [], 0
        with open(path, errors="replace") as source:
            for line in source:
                line = line.strip()
                if not line:
                    continue
                try:
                    row = json.loads(line)
                except ValueError:
                    bad += 1
                    continue
                if not isinstance(row, dict):
                    bad += 1
                elif row.get("record") == "run":
                    file_runs.append(row)
                elif row.get("record") == "sample":
                    file_samples.append(row)
        if bad:
            warnings.append(f"{path}: {bad} unreadable line(s) skipped")
        if not file_runs:
            warnings.append(f"{path}: no run line; not a dcp-fsdp record, skipped")
            continue
        runs.extend(file_runs)
        samples.extend(file_samples)
    return runs, samples, warnings


# -- run attributes ----------------------------------------------------------------------

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


def _mean(series: pd.Series) -> float:
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
            "untimed_per_run": _mean(untimed),
            "failed_runs": len(same_group),
        })
        slowest, lag = _slowest_rank(group_samples)
        phases.append({
            **labels,
            "plan_s": _mean(group_samples["plan_s"].astype(float)),
            "io_s": _mean(group_samples["io_s"].astype(float)),
            "commit_s": _mean(group_samples["commit_s"].astype(float)),
            "metadata_s": _mean(group_samples["metadata_s"].astype(float)),
            "finish_s": _mean(group_samples["finish_s"].astype(float)),
            "barrier_wait_mean_s": _mean(group_samples["barrier_wait_s"].astype(float)),
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


# -- formatting --------------------------------------------------------------------------

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


def _key_cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _table(frame: pd.DataFrame, keys: list[str], columns) -> tuple[list[str], list[list[str]]]:
    headers = list(keys) + [header for _, header, _ in columns]
    rows = []
    for _, row in frame.iterrows():
        cells = [_key_cell(row[k]) for k in keys]
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


# -- plots -------------------------------------------------------------------------------

def _series_label(row: pd.Series, keys: list[str]) -> str:
    """e.g. "save · nodes=2 · thread_count=4" (settings by their last name part)."""
    parts = []
    for key in keys:
        value = _key_cell(row[key])
        if key in ("op", "model", "storage"):
            parts.append(value or "?")
        else:
            parts.append(f"{key.rsplit('.', 1)[-1]}={value or '?'}")
    return " · ".join(parts)


def plot(result: dict[str, Any], directory: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    ops = result["operations"]
    samples = result["samples"]
    keys = result["group_keys"]
    if ops.empty:
        return written
    series_keys = [k for k in keys if k not in ("nodes", "ranks")]
    varying = [k for k in series_keys if ops[k].astype(str).nunique() > 1 or k == "op"]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    # 1. aggregate MiB/s vs node count (and vs ranks), one line per operation / setting
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    for index, (label_key, group) in enumerate(ops.groupby(varying, sort=True)):
        label = _series_label(group.iloc[0], varying)
        color = colors[index % len(colors)]
        for axis, x in zip(axes, ("nodes", "ranks")):
            xs = group[x].astype(float)
            axis.scatter(xs, group["aggregate_mib_s"], color=color, alpha=0.35, s=18)
            per_x = group.assign(_x=xs).groupby("_x").apply(
                lambda g: g["bytes"].sum() / MIB / g["span_s"].sum(), include_groups=False)
            axis.plot(per_x.index, per_x.values, marker="o", color=color, label=label)
    for axis, x, title in zip(axes, ("nodes", "ranks"), ("node count", "ranks (world size)")):
        axis.set_xlabel(title)
        values = sorted(ops[x].astype(float).unique())
        axis.set_xticks(values)
        axis.set_xlim(min(values) - 0.5, max(values) + 0.5)
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("aggregate MiB/s (total bytes / first begin to last end)")
    axes[0].set_ylim(bottom=0)
    axes[1].legend(fontsize=8, loc="best")
    fig.suptitle("Checkpoint throughput: line = group aggregate, dots = single operations")
    fig.tight_layout()
    path = directory / "throughput_vs_nodes.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    # 2. per-rank durations and where they went: rows = groups, columns = operations
    op_names = sorted(dict.fromkeys(samples["op"]), key=lambda op: OP_ORDER.get(op, 9))
    other = [k for k in keys if k != "op" and samples[k].astype(str).nunique() > 1]
    groups = list(samples.groupby(other, sort=True)) if other else [(None, samples)]
    shown = groups[:MAX_PLOT_GROUPS]
    fig, axes = plt.subplots(len(shown), len(op_names), squeeze=False,
                             figsize=(6.2 * len(op_names), 3.6 * len(shown) + 0.6))
    phase_colors = {"plan": "#9ecae1", "io": "#3182bd", "commit": "#fd8d3c"}
    for row, (_, group) in enumerate(shown):
        label = _series_label(group.iloc[0], other) if other else ""
        for column, op in enumerate(op_names):
            axis = axes[row][column]
            op_samples = group[group["op"] == op]
            if op_samples.empty:
                axis.set_visible(False)
                continue
            per_rank = op_samples.groupby("rank").agg(
                plan=("plan_s", lambda v: _mean(v.astype(float))),
                io=("io_s", lambda v: _mean(v.astype(float))),
                commit=("commit_s", lambda v: _mean(v.astype(float))),
                duration=("duration_s", "mean"))
            ranks = per_rank.index.to_numpy()
            if per_rank[["plan", "io", "commit"]].notna().all(axis=None):
                bottom = 0.0
                for phase in ("plan", "io", "commit"):
                    axis.bar(ranks, per_rank[phase], bottom=bottom, width=0.7,
                             color=phase_colors[phase], label=f"{phase} (mean)")
                    bottom = bottom + per_rank[phase]
            else:  # older records: no phase breakdown
                axis.bar(ranks, per_rank["duration"], width=0.7, color="#bdbdbd",
                         label="duration (mean)")
            axis.scatter(op_samples["rank"], op_samples["duration_s"], color="black", s=14,
                         zorder=3, label="each iteration")
            axis.set_ylim(0, float(op_samples["duration_s"].max()) * 1.15)
            step = max(1, len(ranks) // 16)
            axis.set_xticks(ranks[::step])
            axis.set_xlabel("rank")
            axis.set_ylabel("seconds")
            axis.set_title(f"{op}{' · ' + label if label else ''}", fontsize=10)
            axis.grid(alpha=0.3, axis="y")
    handles = {}
    for axis in axes.flat:
        for handle, name in zip(*axis.get_legend_handles_labels()):
            handles.setdefault(name, handle)
    title = "Per-rank duration (dots: each iteration) and its DCP phases (bars: mean)"
    if len(groups) > MAX_PLOT_GROUPS:
        title += f"; first {MAX_PLOT_GROUPS} of {len(groups)} groups"
    fig.suptitle(title)
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=len(handles),
               fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.05 if len(shown) == 1 else 0.03, 1, 1))
    path = directory / "rank_durations.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    # 3. request latency distribution: CDF per request type, one panel per operation
    if samples["requests"].map(lambda r: isinstance(r, dict)).any():
        fig, axes = plt.subplots(1, len(op_names), figsize=(6 * len(op_names), 4.6),
                                 squeeze=False)
        for axis, op in zip(axes[0], op_names):
            requests = samples.loc[samples["op"] == op, "requests"]
            kinds: dict[str, int] = {}
            for summary in requests:
                for kind, entry in ((summary or {}).get("by_type") or {}).items() \
                        if isinstance(summary, dict) else []:
                    kinds[kind] = kinds.get(kind, 0) + (entry.get("count") or 0)
            for index, kind in enumerate(sorted(kinds, key=lambda k: -kinds[k])):
                hist = latency_histogram(requests, kinds=[kind])
                items = sorted((int(i), n) for i, n in hist.items())
                total = sum(n for _, n in items)
                xs, ys, seen = [], [], 0
                for bucket, n in items:
                    low, high = bucket_bounds_ms(bucket)
                    xs += [low, high]
                    ys += [seen / total, (seen + n) / total]
                    seen += n
                p50, p99 = hist_quantile(hist, 0.5), hist_quantile(hist, 0.99)
                axis.plot(xs, ys, color=colors[index % len(colors)],
                          label=f"{kind} (n={total}, p50 {p50:.1f} ms, p99 {p99:.1f} ms)")
            axis.set_xscale("log")
            # decade labels only: minor labels overlap on a narrow span
            axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            axis.set_xlabel("request latency ms (log scale)")
            axis.set_ylabel("fraction of requests at or below")
            axis.set_ylim(0, 1.02)
            axis.axhline(0.5, color="grey", linewidth=0.6, linestyle=":")
            axis.axhline(0.99, color="grey", linewidth=0.6, linestyle=":")
            axis.set_title(f"{op}: S3 request latency by type (all groups)")
            axis.grid(alpha=0.3, which="both")
            axis.legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        path = directory / "request_latency.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


# -- command -----------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    arguments = argparse.ArgumentParser(
        prog="dcp-fsdp report",
        description="Tables (and plots) over run records, grouped by node count, world size, "
                    "model, operation, storage and every setting that differs between runs.")
    arguments.add_argument("paths", nargs="*", default=RUN_DEFAULT_PATHS,
                           help="record files, directories (searched recursively) or globs "
                                "(default: results)")
    arguments.add_argument("--format", choices=("table", "md", "csv"), default="table",
                           help="table: terminal; md: Markdown; csv: the wide group table")
    arguments.add_argument("--csv", metavar="FILE", help="also write the wide group table as CSV")
    arguments.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR")
    return arguments


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        files = record_files(args.paths)
    except FileNotFoundError as error:
        print(f"dcp-fsdp: error: report: {error}", file=sys.stderr)
        return 2
    if not files:
        print(f"dcp-fsdp: error: report: no record files (*.jsonl) under {' '.join(args.paths)}",
              file=sys.stderr)
        return 2
    runs, samples, warnings = read_records(files)
    if not runs:
        print("dcp-fsdp: error: report: no dcp-fsdp records among "
              f"{len(files)} file(s)", file=sys.stderr)
        for warning in warnings:
            print(f"note: {warning}", file=sys.stderr)
        return 2
    result = build(runs, samples)
    if args.format == "csv":
        sys.stdout.write(wide_csv(result).to_csv(index=False))
    else:
        sys.stdout.write(render(result, args.format, warnings))
    if args.csv:
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        wide_csv(result).to_csv(args.csv, index=False)
        print(f"csv: {args.csv}", file=sys.stderr if args.format == "csv" else sys.stdout)
    if args.plot:
        for path in plot(result, Path(args.plot)):
            print(f"plot: {path}", file=sys.stderr if args.format == "csv" else sys.stdout)
    return 0
