"""The headline figures, one definition each: the end-of-run table, `report`, `tune`,
efficiency and the benchmarks all compute them here (docs/metrics.md "Headline figures").

One *operation* = one op of one iteration of one run, over all its ranks: span_s =
max(end_wall_s) - min(begin_wall_s); aggregate_mib_s = sum(bytes) / MiB / span_s;
slowest_rank_mib_s = sum(bytes) / MiB / max(duration_s). *Pooled* operations: every byte
over every second, a second two operations of one run share counted once (union_s).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import pandas as pd
from pydantic import BaseModel

from dcp_fsdp.units import GIB, MIB

# the raw storage ceiling measured in the same run, per DCP operation (the efficiency column)
CEILING_OPS = {"save": "raw_put", "load": "raw_get"}
# every ceiling ceiling=true measures, per DCP operation (rank/ceiling.py), and its words
CEILINGS = {
    "save": (("raw_put", "raw PUT"), ("raw_put_tensors", "PUT from the live tensors"),
             ("mem_save", "DCP alone (tmpfs)")),
    "load": (("raw_get", "raw GET (bytes discarded)"), ("raw_get_tensors", "storage into tensors"),
             ("mem_load", "DCP alone (tmpfs)")),
}
NOISY_SPREAD = 0.10  # a group whose iterations differ by more is marked, with a hint
AMPLIFICATION_SHOWN = 0.05  # read amplification below this is not worth a word
NOISY_WORDS = (f"aggregate MiB/s differ by more than {100 * NOISY_SPREAD:.0f} % of their median "
               "(spread); more iterations, a delay_s between operations, or a quieter machine "
               "would narrow it")
KEYS = ["run_id", "op", "iteration"]


def as_frame(samples: Any) -> pd.DataFrame:
    """Samples (dicts, telemetry Sample records or a frame) as a frame."""
    return samples if isinstance(samples, pd.DataFrame) else pd.DataFrame(
        [s.model_dump() if isinstance(s, BaseModel) else dict(s) for s in samples])


def rate_mib_s(nbytes: Any, seconds: Any) -> Any:
    """bytes / MiB / seconds; NaN where seconds is 0 or missing (works on Series too)."""
    if isinstance(seconds, pd.Series):
        return nbytes / MIB / seconds.where(seconds > 0)
    return nbytes / MIB / seconds if seconds and seconds > 0 else math.nan


def one_run_if_unnamed(frame: pd.DataFrame) -> pd.DataFrame:
    """Samples with no run_id (hand-made, or an old record's) count as one run."""
    if "run_id" not in frame or frame["run_id"].isna().all():
        return frame.assign(run_id="")
    return frame


def operations(samples: Iterable[Any] | pd.DataFrame, **more: Any) -> pd.DataFrame:
    """One row per (run_id, op, iteration) with the per-operation figures: the one aggregation
    of ranks' samples into operations. `more`: further pandas named aggregations."""
    frame = as_frame(samples)
    if frame.empty:
        return pd.DataFrame(columns=[*KEYS, "bytes", "span_s", "aggregate_mib_s", *more])
    frame = one_run_if_unnamed(frame)
    ops = frame.groupby(KEYS, sort=False).agg(
        bytes=("bytes", "sum"), first_begin_wall_s=("begin_wall_s", "min"),
        last_end_wall_s=("end_wall_s", "max"), rank_s_max=("duration_s", "max"), **more,
    ).reset_index()
    span_s = ops["last_end_wall_s"] - ops["first_begin_wall_s"]
    return ops.assign(span_s=span_s, aggregate_mib_s=rate_mib_s(ops["bytes"], span_s),
                      slowest_rank_s=ops["rank_s_max"],
                      slowest_rank_mib_s=rate_mib_s(ops["bytes"], ops["rank_s_max"]))


def mlperf_gib_s(samples: Iterable[Any] | pd.DataFrame, op: str) -> float:
    """MLPerf Storage's figure for `op` (docs/mlperf.md): the mean over its operations of the
    checkpoint's GiB over rank 0's own seconds; NaN without a rank 0 sample of each."""
    frame = as_frame(samples)
    rows = frame[frame["op"] == op] if "op" in frame else frame.iloc[0:0]
    if rows.empty:
        return math.nan
    keys = [key for key in ("run_id", "iteration") if key in rows]
    rates = []
    for _, operation in rows.groupby(keys, sort=False, dropna=False):
        rank0_s = operation.loc[operation["rank"] == 0, "duration_s"]
        if rank0_s.empty or not rank0_s.iloc[0] > 0:
            return math.nan
        rates.append(float(operation["bytes"].sum()) / GIB / float(rank0_s.iloc[0]))
    return sum(rates) / len(rates)


def mlperf_shortfall(samples: Iterable[Any] | pd.DataFrame) -> str | None:
    """Why one run's operations are not MLPerf Storage's checkpointing protocol (exactly
    MLPERF_CHECKPOINTS saves and as many loads), in words; None when they are. A record
    saying protocol=mlperf is not enough: tune's 1- and 3-iteration trials were recorded so."""
    from dcp_fsdp.config.schema import MLPERF_CHECKPOINTS

    ops = operations(samples)
    saves, loads = (int((ops["op"] == op).sum()) for op in ("save", "load"))
    if saves == loads == MLPERF_CHECKPOINTS:
        return None
    return (f"{saves} saves and {loads} loads, not MLPerf's {MLPERF_CHECKPOINTS} + "
            f"{MLPERF_CHECKPOINTS}")


def mean_or_nan(series: pd.Series) -> float:
    """The mean of the values that are numbers (None, text: left out); NaN where none is."""
    return float(pd.to_numeric(series, errors="coerce").mean())


def max_or_nan(series: pd.Series) -> float:
    return float(pd.to_numeric(series, errors="coerce").max())


def first_text(frame: pd.DataFrame, field: str) -> str | None:
    """The first known value of `field` as text; None where no sample has one."""
    values = frame[field].dropna() if field in frame else pd.Series([], dtype=object)
    return str(values.iloc[0]) if len(values) else None


def complete_sum(series: pd.Series) -> float:
    """The sum, NaN unless every value is known (a partial sum would mislead)."""
    series = pd.to_numeric(series, errors="coerce")
    return float(series.sum()) if len(series) and series.notna().all() else math.nan


def spread(values: Iterable[float]) -> float:
    """(max - min) / median of per-operation rates; NaN with fewer than two."""
    series = pd.Series(list(values), dtype=float).dropna()
    if len(series) < 2 or not series.median():
        return math.nan
    return float((series.max() - series.min()) / series.median())


def union_s(begins: Iterable[float], ends: Iterable[float], runs: Iterable[Any]) -> float:
    """Seconds covered by the union of the intervals [begin, end] of each run, summed over
    runs (their clocks need not be comparable)."""
    per_run: dict[Any, list[tuple[float, float]]] = {}
    for begin, end, run in zip(begins, ends, runs):
        if not (pd.isna(begin) or pd.isna(end)):
            per_run.setdefault(run, []).append((float(begin), float(end)))
    covered = 0.0
    for intervals in per_run.values():
        stop = -math.inf  # the furthest end so far: each interval adds what lies beyond it
        for begin, end in sorted(intervals):
            covered += max(0.0, end - max(begin, stop))
            stop = max(stop, end)
    return covered


def pooled(ops: pd.DataFrame) -> dict[str, float]:
    """The pooled figures of some operations (of one op); their span is the plain sum where
    they carry no wall-clock bounds."""
    if ops.empty:
        return {"operations": 0, "bytes": math.nan, "span_s": math.nan,
                "aggregate_mib_s": math.nan, "slowest_rank_mib_s": math.nan,
                "spread": math.nan, "overlap_s": math.nan}
    if "first_begin_wall_s" not in ops or "last_end_wall_s" not in ops:
        span_s = float(ops["span_s"].sum())
    else:
        runs = ops["run_id"] if "run_id" in ops else pd.Series("", index=ops.index)
        span_s = union_s(ops["first_begin_wall_s"], ops["last_end_wall_s"], runs.fillna(""))
    overlap_s = max(0.0, float(ops["span_s"].sum()) - span_s)
    slowest_s = (float(ops["slowest_rank_s"].sum()) - overlap_s if "slowest_rank_s" in ops
                 else math.nan)
    nbytes = float(ops["bytes"].sum())
    return {"operations": len(ops), "bytes": nbytes, "span_s": span_s,
            "aggregate_mib_s": rate_mib_s(nbytes, span_s),
            "slowest_rank_mib_s": rate_mib_s(nbytes, slowest_s),
            "spread": spread(ops["aggregate_mib_s"]), "overlap_s": overlap_s}


def ceilings(all_ops: pd.DataFrame) -> dict[tuple[Any, str], float]:
    """(run_id, ceiling op) -> the median aggregate MiB/s of that run's rounds of it."""
    raw = all_ops[all_ops["op"].isin([op for kinds in CEILINGS.values() for op, _ in kinds])]
    typical = raw.groupby(["run_id", "op"], sort=False)["aggregate_mib_s"].median()
    return {(run, str(op)): float(value) for (run, op), value in zip(typical.index, typical)
            if value and not pd.isna(value)}


def ceiling_lines(all_ops: pd.DataFrame) -> list[str]:
    """Per DCP op with ceilings: its pooled MiB/s, each ceiling's median (min-max), efficiency."""
    lines = []
    for op, kinds in CEILINGS.items():
        dcp = all_ops[all_ops["op"] == op]
        cells = []
        for kind, words in kinds:
            rounds = all_ops[all_ops["op"] == kind]["aggregate_mib_s"].dropna()
            if dcp.empty or rounds.empty:
                continue
            value = efficiency(dcp, all_ops, kind)
            cells.append(f"{words} {rounds.median():.1f} ({rounds.min():.1f}-{rounds.max():.1f}, "
                         f"{len(rounds)} round{'s' if len(rounds) > 1 else ''}): "
                         f"efficiency {value:.2f}")
        if cells:
            lines.append(f"{op}: DCP {pooled(dcp)['aggregate_mib_s']:.1f} MiB/s; ceilings, MiB/s "
                         "median (min-max): " + "; ".join(cells))
    return lines


def headroom_lines(all_ops: pd.DataFrame, samples: pd.DataFrame) -> list[str]:
    """ceiling=true (rank/headroom.py): the load through the tool's reader beside DCP's; the
    save's serialising share and the save with twice the files per rank."""
    lines = []
    rate = {op: pooled(all_ops[all_ops["op"] == op])["aggregate_mib_s"]
            for op in ("load", "ra_load", "save", "tc_save")}
    tensors = all_ops[all_ops["op"] == "raw_get_tensors"]["aggregate_mib_s"].dropna()
    if not math.isnan(rate["load"]) and not math.isnan(rate["ra_load"]):
        reader = first_text(samples[samples["op"] == "ra_load"], "reader") or "read_ahead=?"
        line = (f"load headroom: DCP's reader {rate['load']:.1f} MiB/s; the tool's reader "
                f"({reader}, not DCP's) {rate['ra_load']:.1f} ({rate['ra_load'] / rate['load']:.2f}x)")
        if len(tensors):
            line += (f"; storage into tensors {tensors.median():.1f}: DCP's reader leaves "
                     f"{max(0.0, 1 - rate['load'] / tensors.median()):.2f} of this storage unused")
        lines.append(line)
    saves = samples[samples["op"] == "save"] if "op" in samples else samples.iloc[0:0]
    if not math.isnan(rate["save"]) and not math.isnan(rate["tc_save"]) and len(saves):
        share = (pd.to_numeric(saves["stage_s"], errors="coerce").sum()
                 / pd.to_numeric(saves["duration_s"], errors="coerce").sum())
        lines.append(f"save headroom: DCP's own serialising is {share:.0%} of the save; twice the "
                     f"files per rank (storage.thread_count x2): {rate['tc_save']:.1f} MiB/s, "
                     f"{rate['tc_save'] / rate['save']:.2f}x this run's saves")
    return lines


def _ceiling_of(ops: pd.DataFrame, typical: dict[tuple[Any, str], float],
                kind: str | None = None) -> pd.Series:
    """Each operation's run ceiling of `kind` (default: its op's raw one; NaN: none)."""
    return pd.Series([typical.get((run, kind or CEILING_OPS.get(op, "")), math.nan)
                      for run, op in zip(ops["run_id"], ops["op"])], index=ops.index, dtype=float)


def efficiency(ops: pd.DataFrame, all_ops: pd.DataFrame, kind: str | None = None) -> float:
    """Pooled efficiency of `ops` (one op) against their runs' ceilings of `kind` in `all_ops`:
    sum(bytes / ceiling) / MiB over the pooled span of the operations that have one."""
    if ops.empty:
        return math.nan
    ceiling = _ceiling_of(ops, ceilings(all_ops), kind)
    paired = ops[ceiling.notna()]
    if paired.empty:
        return math.nan
    at_ceiling_s = float((paired["bytes"] / MIB / ceiling[paired.index]).sum())
    span_s = pooled(paired)["span_s"]
    return at_ceiling_s / span_s if span_s else math.nan


def efficiency_per_operation(all_ops: pd.DataFrame) -> pd.Series:
    """Each save (load) operation's aggregate over its run's ceiling (median raw_put, raw_get)."""
    return all_ops["aggregate_mib_s"] / _ceiling_of(all_ops, ceilings(all_ops))


ABOVE_CEILING_LINE = (
    "above the ceiling: DCP beat the median raw round of its run (efficiency > 1), so that "
    "raw median is no ceiling here: the raw rounds met a stall DCP did not (compare their "
    "spread), or they were too few; more iterations give the raw side more chances.")


def above_ceiling_note(value: float) -> str:
    """Said where an operation beat its run's best raw round: that ceiling is not one."""
    if pd.isna(value) or value <= 1.0:
        return ""
    return f"above the ceiling ({value:.2f})"


def read_amplification(ops: pd.DataFrame) -> float:
    """sum(fetched_bytes) / sum(bytes) over the operations that know what they fetched."""
    if "fetched_bytes" not in ops:
        return math.nan
    known = ops[pd.to_numeric(ops["fetched_bytes"], errors="coerce").notna()]
    total = float(known["bytes"].sum()) if len(known) else 0.0
    return float(known["fetched_bytes"].astype(float).sum()) / total if total else math.nan


def egress_mib(ops: pd.DataFrame) -> float:
    """sum(fetched_bytes) / MiB over per-operation rows: NaN unless all know theirs."""
    return complete_sum(ops["fetched_bytes"]) / MIB if "fetched_bytes" in ops else math.nan


def amplification_note(value: float) -> str:
    """"reads 2.00x" when a load fetched noticeably more than the checkpoint, else ""."""
    if pd.isna(value) or value <= 1 + AMPLIFICATION_SHOWN:
        return ""
    return f"reads {value:.2f}x"


def broken_note(broken: float, broken_max_bytes: float, fetched_bytes: float,
                state_bytes: float) -> str:
    """Said where GETs broke mid-body: what came down of them, or its bound."""
    if pd.isna(broken) or broken <= 0 or pd.isna(broken_max_bytes):
        return ""
    if broken_max_bytes <= 0:  # what came down of them is known (fsspec: aiohttp's count)
        return f"{broken:.0f} GET(s) broke mid-body and were sent again (egress counts what came down)"
    note = f"{broken:.0f} GET(s) broke mid-body: up to {broken_max_bytes / MIB:.1f} MiB more came down"
    if not pd.isna(fetched_bytes) and state_bytes:
        note += f" (reads up to {(fetched_bytes + broken_max_bytes) / state_bytes:.2f}x)"
    return note


def noise_note(value: float) -> str:
    return f"noisy {100 * value:.0f}%" if not pd.isna(value) and value > NOISY_SPREAD else ""


def summary(samples: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """Per op: the pooled figures, the per-iteration aggregates (their best and median) and the
    mean operation (bytes, span_s: their ratio is the pooled aggregate), for tune and the benchmarks."""
    ops = operations(samples)
    found: dict[str, dict[str, Any]] = {}
    for op, group in ops.groupby("op", sort=False):
        figures: dict[str, Any] = pooled(group)
        figures["per_iteration_mib_s"] = [float(v) for v in group["aggregate_mib_s"]]
        figures["best_mib_s"] = max_or_nan(group["aggregate_mib_s"])
        figures["median_mib_s"] = float(group["aggregate_mib_s"].median())  # what ceilings() divides by
        figures["mean_bytes"] = figures["bytes"] / len(group)
        figures["mean_span_s"] = figures["span_s"] / len(group)
        figures["efficiency"] = efficiency(group, ops)
        found[str(op)] = figures
    return found
