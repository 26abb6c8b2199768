"""Figures from raw samples (pandas). Definitions are in the README's "Metrics".

MiB = 2**20 bytes. For one operation (save or load) of one iteration:
  span_s            = max(end_wall_s) - min(begin_wall_s) over ranks
  aggregate_mib_s   = sum(bytes) / MiB / span_s
  rank_mib_s        = bytes / MiB / duration_s, per rank
  end_skew_s        = max(end_wall_s) - min(end_wall_s)
"""

from __future__ import annotations

from typing import Any, Iterable

import pandas as pd

MIB = 2**20
GIB = 2**30
OPERATION_KEYS = ["run_id", "op", "iteration"]


def samples_frame(samples: Iterable[dict[str, Any]]) -> pd.DataFrame:
    frame = pd.DataFrame(list(samples))
    if frame.empty:
        return frame
    frame["rank_mib_s"] = frame["bytes"] / MIB / frame["duration_s"]
    return frame


def per_operation(samples: pd.DataFrame) -> pd.DataFrame:
    """One row per (run, op, iteration): totals over ranks and the spread across them."""
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
    ).reset_index()
    frame["span_s"] = frame["last_end_wall_s"] - frame["first_begin_wall_s"]
    frame["aggregate_mib_s"] = frame["bytes"] / MIB / frame["span_s"]
    frame["end_skew_s"] = frame["last_end_wall_s"] - frame["first_end_wall_s"]
    return frame


def run_table(samples: Iterable[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """The end-of-run table: one row per op and iteration, then a summary per op."""
    frame = samples_frame(samples)
    headers = ["op", "iter", "suffix", "MiB", "span s", "aggregate MiB/s",
               "rank s min/med/max", "rank MiB/s min/med/max"]
    if frame.empty:
        return headers, []
    ops = per_operation(frame)
    rows: list[list[Any]] = []
    for _, row in ops.iterrows():
        rows.append([row["op"], row["iteration"], row["suffix"], f"{row['bytes'] / MIB:.1f}",
                     f"{row['span_s']:.3f}", f"{row['aggregate_mib_s']:.1f}",
                     f"{row['rank_s_min']:.3f}/{row['rank_s_median']:.3f}/{row['rank_s_max']:.3f}",
                     f"{row['rank_mib_s_min']:.1f}/{row['rank_mib_s_median']:.1f}/"
                     f"{row['rank_mib_s_max']:.1f}"])
    for op, group in ops.groupby("op", sort=False):
        if len(group) < 2:
            continue
        op_samples = frame[frame["op"] == op]
        rows.append([f"{op} (all)", f"{len(group)}", "", f"{group['bytes'].sum() / MIB:.1f}",
                     f"{group['span_s'].median():.3f} med",
                     f"{group['aggregate_mib_s'].min():.1f}/{group['aggregate_mib_s'].median():.1f}"
                     f"/{group['aggregate_mib_s'].max():.1f}",
                     f"{op_samples['duration_s'].min():.3f}/{op_samples['duration_s'].median():.3f}/"
                     f"{op_samples['duration_s'].max():.3f}",
                     f"{op_samples['rank_mib_s'].min():.1f}/{op_samples['rank_mib_s'].median():.1f}/"
                     f"{op_samples['rank_mib_s'].max():.1f}"])
    return headers, rows
