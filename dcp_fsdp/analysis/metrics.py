"""Per-operation rows from raw samples (pandas), and the end-of-run table.

The headline figures are defined in telemetry/figures.py; here, per operation (docs/report.md):
  rank_mib_s        = bytes / MiB / duration_s, per rank
  end_skew_s        = max(end_wall_s) - min(end_wall_s)
  requests          = S3 requests of all ranks in their timed regions; empty unless all known
  X_span_s          = max(begin_wall_s + X_s) - min(begin_wall_s), X blocked, stall, persisted
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import pandas as pd

from dcp_fsdp.units import MIB
from dcp_fsdp.telemetry.figures import (ABOVE_CEILING_LINE, KEYS, NOISY_WORDS,
                                        ceiling_lines, complete_sum, efficiency,
                                        efficiency_per_operation, egress_mib, headroom_lines,
                                        max_or_nan, noise_note, one_run_if_unnamed, operations,
                                        pooled, rate_mib_s)
from dcp_fsdp.analysis.columns import cell
from dcp_fsdp.analysis.tables import row_note
from dcp_fsdp.telemetry.histograms import hist_quantile
from dcp_fsdp.telemetry.records import Sample
from dcp_fsdp.telemetry.summaries import merge_by_type

# sample fields that older records (the optional ones) or hand-made samples may lack; None when absent
OPTIONAL_COLUMNS = ("barrier_wait_s", *(name for name, field in Sample.model_fields.items()
                                        if not field.is_required()))
REQUEST_COLUMNS = {"req_count": "count", "req_failed": "failed", "req_throttled": "throttled",
                   "req_retries": "retries", "req_misses": "misses",
                   "req_broken": "broken", "req_broken_max_bytes": "bytes_down_broken_max"}
SPANS = ("blocked", "persisted", "stall")  # each X_span_s of an operation (the docstring above)


def _request_value(requests: Any, key: str) -> float:
    if not isinstance(requests, dict) or requests.get("unparsed"):
        return math.nan  # unknown; lines the parser could not read make every count short
    value = requests.get(key)
    return math.nan if value is None else float(value)


def samples_frame(samples: Iterable[dict[str, Any]]) -> pd.DataFrame:
    frame = pd.DataFrame(list(samples))
    if frame.empty:
        return frame
    frame = frame.assign(**{column: None for column in OPTIONAL_COLUMNS if column not in frame})
    frame["rank_mib_s"] = rate_mib_s(frame["bytes"], frame["duration_s"])
    for column, key in REQUEST_COLUMNS.items():
        frame[column] = [_request_value(r, key) for r in frame["requests"]]
    return frame


def per_operation(samples: pd.DataFrame) -> pd.DataFrame:
    """One row per (run, op, iteration) of a samples_frame: totals and spread over ranks."""
    samples = one_run_if_unnamed(samples)  # as operations() counts them
    begin = samples["begin_wall_s"].astype(float)
    samples = samples.assign(**{f"_{span}_end": begin + pd.to_numeric(samples[f"{span}_s"], errors="coerce")
                                for span in SPANS})
    frame = operations(
        samples,
        suffix=("suffix", "first"),
        first_end_wall_s=("end_wall_s", "min"),
        rank_mib_s_min=("rank_mib_s", "min"),
        rank_mib_s_max=("rank_mib_s", "max"),
        # NaN unless every rank has the span (float columns: max keeps the NaN)
        **{f"{span}_end": (f"_{span}_end", lambda ends: ends.max(skipna=False)) for span in SPANS},
        fetched_bytes=("fetched_bytes", complete_sum),
        peak_rss_bytes=("peak_rss_bytes", max_or_nan),
        cuda_max_allocated_bytes=("cuda_max_allocated_bytes", max_or_nan),
        **{column: (column, complete_sum) for column in REQUEST_COLUMNS},
    )  # with span_s, aggregate and slowest-rank MiB/s (telemetry/figures.py)
    for span in SPANS:
        frame[f"{span}_span_s"] = frame.pop(f"{span}_end") - frame["first_begin_wall_s"]
    frame["end_skew_s"] = frame["last_end_wall_s"] - frame["first_end_wall_s"]
    return frame


LATENCY_TYPES_SHOWN = 2  # the most frequent request types in the end-of-run table


def _latency_cell(requests: Iterable[Any]) -> str:
    """p50/p99 ms of the most frequent request types over samples' `requests`."""
    by_type = list(merge_by_type(requests).items())[:LATENCY_TYPES_SHOWN]
    return ", ".join(f"{kind} {cell(hist_quantile(entry['latency_hist'], 0.5), '.1f')}/"
                     f"{cell(hist_quantile(entry['latency_hist'], 0.99), '.1f')}" for kind, entry in by_type)


_RUN_HEADERS = ["op", "iter", "suffix", "MiB", "egress MiB", "span s", "aggregate MiB/s",
                "efficiency", "slowest-rank MiB/s", "rank s min/med/max", "rank MiB/s min/med/max",
                "requests", "req/s", "failed/throttled", "latency p50/p99 ms by type", "note"]


def run_figures(samples: Iterable[dict[str, Any]]
                ) -> tuple[list[str], list[list[Any]], list[str]]:
    """The end-of-run table: one row per op and iteration, then a pooled "(all)" row per op
    with two or more iterations (the same figures as `report`); and the lines under it."""
    frame = one_run_if_unnamed(samples_frame(samples))
    if frame.empty:
        return list(_RUN_HEADERS), [], []
    ops = per_operation(frame)
    ops["efficiency"] = efficiency_per_operation(ops)
    samples_of = dict(list(frame.groupby(KEYS, sort=False)))
    rows = [_row_cells(row["op"], row["iteration"], row["suffix"], row, ops.loc[[index]],
                       row["efficiency"], samples_of[tuple(row[KEYS])])
            for index, row in ops.iterrows()]
    noisy = False
    for op, group in ops.groupby("op", sort=False):  # the "(all)" row of an op's iterations
        if len(group) < 2:
            continue
        figures = pooled(group)
        group_noisy = bool(noise_note(figures["spread"]))
        spread = ("" if pd.isna(figures["spread"]) else
                  f"spread {100 * figures['spread']:.0f} %" + (" NOISY" if group_noisy else ""))
        rows.append(_row_cells(f"{op} (all)", f"{len(group)}", "", figures, group, efficiency(group, ops),
                               frame[frame["op"] == op], spread))
        noisy = noisy or group_noisy
    # a column empty in every row says nothing (efficiency without a ceiling, requests
    # without request statistics, a note nobody needed): left out
    shown = [i for i in range(len(_RUN_HEADERS)) if any(row[i] != "" for row in rows)]
    notes = []
    if (ops["efficiency"] > 1).any():
        notes.append(ABOVE_CEILING_LINE)
    notes += ceiling_lines(ops) + headroom_lines(ops, frame)
    if noisy:
        notes.append(f"NOISY: the iterations' {NOISY_WORDS}.")
    return [_RUN_HEADERS[i] for i in shown], [[row[i] for i in shown] for row in rows], notes


def _row_cells(label: str, iteration: int | str, suffix: str, figures: pd.Series | dict[str, float],
               ops: pd.DataFrame, eff: float, op_samples: pd.DataFrame, spread: str = "") -> list[Any]:
    """One row: the `figures` of `ops` (one operation, or an op's pooled) and their samples."""
    count = complete_sum(ops["req_count"])
    requests = ["", "", "", ""]
    if not pd.isna(count):
        per_s = count / figures["span_s"] if figures["span_s"] else math.nan
        requests = [cell(count, "int"), cell(per_s, ".1f"),
                    "/".join(cell(complete_sum(ops[c]), "int") for c in ("req_failed", "req_throttled")),
                    _latency_cell(op_samples["requests"])]
    durations, rates = op_samples["duration_s"], op_samples["rank_mib_s"]
    return [label, iteration, suffix, f"{figures['bytes'] / MIB:.1f}", cell(egress_mib(ops), ".1f"),
            f"{figures['span_s']:.3f}", cell(figures["aggregate_mib_s"], ".1f"), cell(eff, ".2f"),
            cell(figures["slowest_rank_mib_s"], ".1f"),
            "/".join(f"{v:.3f}" for v in (durations.min(), durations.median(), durations.max())),
            "/".join(f"{v:.1f}" for v in (rates.min(), rates.median(), rates.max())),
            *requests, row_note(ops, eff, spread)]
