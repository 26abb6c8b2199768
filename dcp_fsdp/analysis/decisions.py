"""How often to checkpoint, what it costs training, and in dollars: from a run's own figures.

`dcp-fsdp report DIR --node-mtbf-hours H [--nodes N] [--interval-minutes X] [--keep K]
[--prices FILE]`, per save group (definitions and assumptions: docs/decisions.md):

  M  = H x 3600 / N             the job's mean time between failures, seconds (N: --nodes,
                                default the run's node count)
  C  = what one checkpoint costs training: sync, the save (stall span); async, the training
       lost per save when steps ran between saves (train_lost_s), else the stall (the call
       and the staging)
  R  = restart: the load (the matching load group's mean span) + start-up (the slowest
       rank's untimed init, mean over runs)
  L  = async only: the upload lag, persisted - stall: the last durable checkpoint is that
       much older when a failure strikes
  Young (1974):  tau = sqrt(2 C M)
  Daly (2006):   tau = sqrt(2 C M) - C   (C < M / 2; else tau = M)
  share of training time lost at tau ~ C / tau + (tau / 2 + L) / M + R / M
                                     (stalls, expected rework, restarts)
An async interval below the upload time (persisted span) would queue saves: it is raised to
it, and said so.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pandas as pd

from dcp_fsdp.analysis import costs
from dcp_fsdp.analysis.metrics import GIB

MATCH_KEYS = ("nodes", "ranks", "model", "storage")


def job_mtbf_s(node_mtbf_hours: float, nodes: int) -> float:
    """Failures of N nodes, each with MTBF H, independent: the job fails N times as often."""
    return node_mtbf_hours * 3600.0 / nodes


def young_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


def daly_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's first-order optimum; beyond its range (C >= M/2) checkpoint every M."""
    if checkpoint_s >= mtbf_s / 2:
        return mtbf_s
    return math.sqrt(2.0 * checkpoint_s * mtbf_s) - checkpoint_s


@dataclasses.dataclass
class TimeLost:
    stalls: float  # C / tau
    rework: float  # (tau / 2 + L) / M
    restarts: float  # R / M
    total: float


def time_lost(interval_s: float, checkpoint_s: float, mtbf_s: float, restart_s: float,
              lag_s: float = 0.0) -> TimeLost:
    """Shares of training time lost at a checkpoint every `interval_s` (first order)."""
    stalls = checkpoint_s / interval_s
    rework = (interval_s / 2 + lag_s) / mtbf_s
    restarts = restart_s / mtbf_s
    return TimeLost(stalls, rework, restarts, stalls + rework + restarts)


@dataclasses.dataclass
class GroupInputs:
    labels: dict[str, Any]
    save_mode: str
    checkpoint_s: float  # C
    cost_is: str  # what C was measured as
    lag_s: float  # L (async), 0 for sync
    upload_s: float  # persisted span: the shortest async interval
    load_s: float | None
    startup_s: float | None
    stored_bytes: float
    save_counts: dict[str, float]
    load_counts: dict[str, float] | None

    @property
    def restart_s(self) -> float:
        return (self.load_s or 0.0) + (self.startup_s or 0.0)


def _select(frame: pd.DataFrame, labels: dict[str, Any], keys) -> pd.DataFrame:
    if frame is None or frame.empty:
        return pd.DataFrame()
    mask = pd.Series(True, index=frame.index)
    for key in keys:
        if key in frame:
            mask &= frame[key].astype(str) == str(labels[key])
    return frame[mask]


def _mean(series) -> float:
    series = pd.to_numeric(series, errors="coerce").dropna()
    return float(series.mean()) if len(series) else math.nan


def _counts(types: pd.DataFrame, labels: dict[str, Any], keys) -> dict[str, float]:
    rows = _select(types, labels, keys)
    return {str(r["request_type"]): float(r["requests_per_op"]) for _, r in rows.iterrows()}


def _startup_s(runs: list[dict[str, Any]], run_ids: set) -> float | None:
    per_run = []
    for run in runs:
        if run.get("run_id") in run_ids:
            init_s = [r.get("init_s") for r in run.get("init") or [] if isinstance(r, dict)]
            init = [s for s in init_s if s is not None]
            if init:
                per_run.append(max(init))
    return sum(per_run) / len(per_run) if per_run else None


def gather(result: dict[str, Any], runs: list[dict[str, Any]]) -> list[GroupInputs]:
    """Per save group of a report: C, L, R and what dollars need."""
    throughput = result["throughput"]
    if throughput.empty:
        return []
    keys = result["group_keys"]
    others = [k for k in keys if k != "op"]
    found = []
    for _, row in throughput[throughput["op"] == "save"].iterrows():
        labels = {k: row[k] for k in keys}
        ops = _select(result["operations"], labels, keys)
        samples = _select(result["samples"], labels, keys)
        modes: set[str] = (set(samples["save_mode"].dropna().astype(str))
                           if "save_mode" in samples else set())
        mode = "async" if "async" in modes else "sync"
        stall = _mean(ops.get("stall_span_s", pd.Series(dtype=float)))
        persisted = _mean(ops.get("persisted_span_s", pd.Series(dtype=float)))
        if math.isnan(stall):  # records before stall_s: a sync save stalls for all of it
            stall = float(row["duration_mean_s"]) if mode == "sync" else math.nan
        checkpoint_s, cost_is = stall, "save" if mode == "sync" else "stall (call + staging)"
        lost = samples.get("train_lost_s")
        if mode == "async" and lost is not None and lost.notna().any():
            per_op = samples.groupby(["run_id", "iteration"])["train_lost_s"].max()
            checkpoint_s, cost_is = float(per_op.mean()), "training lost per save"
        if math.isnan(persisted):
            persisted = float(row["duration_mean_s"])
        loads = throughput[throughput["op"] == "load"]
        load = _select(loads, labels, others)
        if load.empty:
            load = _select(loads, labels, MATCH_KEYS)
        load_labels = {k: load.iloc[0][k] for k in keys} if not load.empty else None
        found.append(GroupInputs(
            labels=labels, save_mode=mode, checkpoint_s=checkpoint_s, cost_is=cost_is,
            lag_s=max(0.0, persisted - stall) if mode == "async" else 0.0,
            upload_s=persisted,
            load_s=float(load["duration_mean_s"].mean()) if not load.empty else None,
            startup_s=_startup_s(runs, set(ops["run_id"])),
            stored_bytes=float(row["checkpoint_gib"]) * GIB,
            save_counts=_counts(result["types"], labels, keys),
            load_counts=_counts(result["types"], load_labels, keys) if load_labels else None))
    return found


@dataclasses.dataclass
class Plan:
    inputs: GroupInputs
    nodes: int
    mtbf_s: float
    young_s: float
    daly_s: float
    raised: bool  # the Daly interval was below the upload time (async)
    at_daly: TimeLost | None  # None: no Daly interval (a checkpoint that cost nothing)
    user_interval_s: float | None
    at_user: TimeLost | None


def plan(inputs: GroupInputs, node_mtbf_hours: float, nodes: int | None,
         interval_minutes: float | None) -> Plan:
    node_count = nodes or int(inputs.labels.get("nodes") or 1)
    mtbf = job_mtbf_s(node_mtbf_hours, node_count)
    c = inputs.checkpoint_s
    young = young_interval_s(c, mtbf) if c > 0 else math.nan
    daly = daly_interval_s(c, mtbf) if c > 0 else math.nan
    raised = inputs.save_mode == "async" and daly < inputs.upload_s
    if raised:
        daly = inputs.upload_s
    at_daly = time_lost(daly, c, mtbf, inputs.restart_s, inputs.lag_s) if daly > 0 else None
    user_s = interval_minutes * 60 if interval_minutes else None
    at_user = time_lost(user_s, c, mtbf, inputs.restart_s, inputs.lag_s) if user_s else None
    return Plan(inputs, node_count, mtbf, young, daly, raised, at_daly, user_s, at_user)


# -- what the report prints ---------------------------------------------------------------

def _group_name(labels: dict[str, Any], keys: list[str]) -> str:
    shown = [f"{labels['model']} {labels['ranks']} rank(s)/{labels['nodes']} node(s)",
             str(labels["storage"])]
    shown += [f"{k}={labels[k]}" for k in keys if k not in (*MATCH_KEYS, "op", "save_mode")
              and labels.get(k) not in ("", None)]
    return ", ".join(shown)


def _hours(seconds: float) -> str:
    hours = seconds / 3600
    return f"{hours:,.0f}" if hours >= 100 else f"{hours:.3g}"


def _minutes(seconds: float) -> str:
    return "" if seconds is None or math.isnan(seconds) else f"{seconds / 60:.1f}"


def _share(lost: TimeLost | None) -> str:
    if lost is None:
        return ""
    return (f"{lost.total:.2%} ({lost.stalls:.2%} stalls, {lost.rework:.2%} rework, "
            f"{lost.restarts:.2%} restarts)")


def _dollars(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return f"${value:.3g}" if value < 1 else f"${value:,.2f}"


@dataclasses.dataclass
class Dollars:
    save: costs.RequestCharge
    load: costs.RequestCharge | None
    month: float  # one checkpoint stored for a month
    day: dict[str, float] | None  # at the chosen interval, K kept


def dollars(p: Plan, prices: costs.Prices, keep: int) -> Dollars | None:
    """None for a file system: no dollars rather than zero."""
    g = p.inputs
    if not costs.is_priced(g.labels["storage"]):
        return None
    save = costs.request_charge(g.save_counts, prices)
    load = costs.request_charge(g.load_counts, prices) if g.load_counts else None
    month = costs.storage_dollars_per_month(g.stored_bytes, prices)
    interval = p.user_interval_s or p.daly_s
    day = None
    if interval and not math.isnan(interval):
        day = costs.dollars_per_day(interval, p.mtbf_s, save.dollars,
                                    load.dollars if load else None, month, keep)
    return Dollars(save, load, month, day)


def _block(number: int, p: Plan, cost: Dollars | None, keys: list[str], keep: int,
           interval_minutes: float | None) -> list[str]:
    g = p.inputs
    load = "load: none in these records" if g.load_s is None else f"load {g.load_s:.2f} s"
    startup = "start-up unknown" if g.startup_s is None else f"start-up {g.startup_s:.1f} s"
    lines = [f"#{number} {_group_name(g.labels, keys)}, {g.save_mode}",
             f"  C = {g.checkpoint_s:.3f} s ({g.cost_is}); R = {g.restart_s:.2f} s ({load}; "
             f"{startup})" + (f"; L = {g.lag_s:.3f} s (upload after the stall)"
                              if g.save_mode == "async" else ""),
             f"  interval: Young {_minutes(p.young_s)} min, Daly {_minutes(p.daly_s)} min"
             + (" (raised to the upload time: saves would queue)" if p.raised else "")
             + f"; training lost there {_share(p.at_daly)}"]
    if p.at_user is not None:
        lines.append(f"  at {interval_minutes:g} min: training lost {_share(p.at_user)}")
    if cost is None:
        lines.append("  dollars: none (a file system: no request or storage charges)")
        return lines
    lines.append(f"  dollars: save {_dollars(cost.save.dollars)} ({cost.save.put_class:.0f} "
                 f"PUT-class + {cost.save.get_class:.0f} GET-class requests)"
                 + ("" if cost.load is None else
                    f", load {_dollars(cost.load.dollars)} ({cost.load.get_class:.0f} "
                    f"GET-class + {cost.load.put_class:.0f} PUT-class)")
                 + f"; {g.stored_bytes / GIB:.3f} GiB stored: {_dollars(cost.month)} per "
                 "checkpoint-month")
    if cost.day is not None:
        at = f"{interval_minutes:g} min" if interval_minutes else "the Daly interval"
        lines.append(f"  per day at {at}, {keep} kept: {_dollars(cost.day['total'])} (saves "
                     f"{_dollars(cost.day['saves'])}, restarts "
                     f"{_dollars(cost.day['restarts']) or 'not priced: no load measured'}"
                     f", storage {_dollars(cost.day['storage'])})")
    return lines


def render(result: dict[str, Any], runs: list[dict[str, Any]], node_mtbf_hours: float,
           nodes: int | None, interval_minutes: float | None, keep: int,
           prices: costs.Prices, fmt: str = "table") -> str:
    """The interval and dollars section of `report`: a side-by-side table of the save groups
    (sync and async next to each other), then each group's inputs and figures."""
    from tabulate import tabulate

    heading = "## " if fmt == "md" else ""
    groups = gather(result, runs)
    if not groups:
        return (f"\n{heading}Checkpoint interval: no save in these records (a save, and "
                "ideally a load, are needed)\n")
    plans = [plan(g, node_mtbf_hours, nodes, interval_minutes) for g in groups]
    costs_of = [dollars(p, prices, keep) for p in plans]
    keys = result["group_keys"]
    node_counts = sorted({p.nodes for p in plans})
    lines = [f"\n{heading}Checkpoint interval, training time lost, dollars",
             f"inputs: node MTBF {node_mtbf_hours:g} h (--node-mtbf-hours); "
             + ", ".join(f"{n} nodes: job MTBF M = {_hours(job_mtbf_s(node_mtbf_hours, n))} h"
                         for n in node_counts)
             + ("" if nodes else " (the run's node count; --nodes for the job's)")
             + (f"; your interval {interval_minutes:g} min" if interval_minutes else "")
             + f"; {keep} checkpoint(s) kept (--keep)",
             f"prices: {prices.describe()}",
             "C: what a checkpoint costs training; R: restart (load + start-up); L: async "
             "upload lag; training lost ~ C/tau + (tau/2 + L)/M + R/M", ""]
    headers = ["#", "mode", "C s", "R s", "Daly min", "lost at Daly"]
    if interval_minutes:
        headers.append(f"lost at {interval_minutes:g} min")
    headers += ["$ per save", "$ per day"]
    rows = []
    for number, (p, cost) in enumerate(zip(plans, costs_of), 1):
        row = [f"#{number}", p.inputs.save_mode, f"{p.inputs.checkpoint_s:.3f}",
               f"{p.inputs.restart_s:.2f}", _minutes(p.daly_s),
               "" if p.at_daly is None else f"{p.at_daly.total:.2%}"]
        if interval_minutes:
            row.append("" if p.at_user is None else f"{p.at_user.total:.2%}")
        row += ["no dollars (fs)" if cost is None else _dollars(cost.save.dollars),
                "" if cost is None or cost.day is None else _dollars(cost.day["total"])]
        rows.append(row)
    lines.append(tabulate(rows, headers=headers, tablefmt="github" if fmt == "md" else "simple",
                          disable_numparse=True))
    lines.append("")
    for number, (p, cost) in enumerate(zip(plans, costs_of), 1):
        lines += _block(number, p, cost, keys, keep, interval_minutes)
    if any(str(p.inputs.labels["storage"]).startswith("s3 (embedded") for p in plans):
        lines.append("(an embedded SeaweedFS run is priced as if its requests went to S3)")
    return "\n".join(lines) + "\n"
