"""How often to checkpoint and what it costs training, per save group of `dcp-fsdp report
--node-mtbf-hours H` (formulas and assumptions: docs/decisions.md): M, the job's MTBF; C, what
a checkpoint costs training (warm saves); R, a restart (the first load + start-up); L, the
async upload lag."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pandas as pd

from dcp_fsdp.units import GIB
from dcp_fsdp.analysis import costs
from dcp_fsdp.analysis.groups import FIRST, LATER
from dcp_fsdp.analysis.tables import select, slowest_mean
from dcp_fsdp.telemetry.figures import mean_or_nan

MATCH_KEYS = ("nodes", "ranks", "model", "storage")
# The first-order share drops terms of order x^2 / 2 beside x = (tau + C + L + R) / M (e^x - 1
# ~ x in Daly's exact waste): above x = 0.2 they exceed ~10 % of the share.
FIRST_ORDER_LIMIT = 0.2
# Plan.validity: where the model stands for these inputs
HOLDS, ROUGH, MEANINGLESS = "first order holds", "beyond first order", "meaningless"


def job_mtbf_s(node_mtbf_hours: float, nodes: int) -> float:
    """Failures of N nodes, each with MTBF H, independent: the job fails N times as often."""
    return node_mtbf_hours * 3600.0 / nodes


def young_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


def daly_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (FGCS 22 (2006) 303-312) for C < 2M; from C = 2M on,
    checkpoint every M (Daly's own boundary)."""
    if checkpoint_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = checkpoint_s / (2 * mtbf_s)
    return young_interval_s(checkpoint_s, mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - checkpoint_s


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


def validity(interval_s: float, checkpoint_s: float, mtbf_s: float, restart_s: float,
             lag_s: float, lost: TimeLost | None) -> tuple[str, float]:
    """(HOLDS, ROUGH or MEANINGLESS, x = (tau + C + L + R) / M) for one interval."""
    x = (interval_s + checkpoint_s + lag_s + restart_s) / mtbf_s
    if lost is not None and lost.total >= 1:
        return MEANINGLESS, x
    return (ROUGH if x > FIRST_ORDER_LIMIT else HOLDS), x


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
    save_requests: costs.RequestCounts
    load_requests: costs.RequestCounts | None
    save_from: str = LATER  # op_order of the saves C comes from (FIRST: no later save)
    load_from: str | None = None  # op_order of the loads R comes from (None: no load)
    fill_in_startup: bool = False  # a record without fill_s: start-up includes the fill

    @property
    def restart_s(self) -> float:
        return (self.load_s or 0.0) + (self.startup_s or 0.0)


def _startup_s(runs: list[dict[str, Any]], run_ids: set) -> tuple[float | None, bool]:
    """(mean over runs of the slowest rank's init less its value fill, whether some rank had
    no fill_s: its fill stays in)."""
    init_rows = [[row for row in run["init"] if row["init_s"] is not None]
                 for run in runs if run["run_id"] in run_ids]
    with_fill = any(row["fill_s"] is None for rows in init_rows for row in rows)
    per_run = [max(row["init_s"] - (row["fill_s"] or 0.0) for row in rows) for rows in init_rows if rows]
    return (sum(per_run) / len(per_run) if per_run else None), with_fill


def _of_order(frame: pd.DataFrame, order: str) -> tuple[pd.DataFrame, str]:
    """The rows of op_order `order`, else all of them and the order they are."""
    if frame.empty or "op_order" not in frame:
        return frame, order
    chosen = frame[frame["op_order"] == order]
    if not chosen.empty:
        return chosen, order
    return frame, str(frame["op_order"].iloc[0])


def _save_cost(mode: str, ops: pd.DataFrame, samples: pd.DataFrame
               ) -> tuple[float, str, float, float]:
    """(C, what it is, the persisted span, L) of some saves (a group's warm ones)."""
    span = mean_or_nan(ops["span_s"])
    stall = mean_or_nan(ops["stall_span_s"])
    persisted = mean_or_nan(ops["persisted_span_s"])
    if math.isnan(persisted):
        persisted = span
    if mode == "sync":  # records before stall_s: a sync save stalls for all of it
        return (span if math.isnan(stall) else stall), "save", persisted, 0.0
    lost = slowest_mean(samples, "train_lost_s")  # as the report's train lost %
    if math.isnan(lost):
        return stall, "stall (call + staging)", persisted, max(0.0, persisted - stall)
    return lost, "training lost per save", persisted, max(0.0, persisted - stall)


def gather(result: dict[str, Any], runs: list[dict[str, Any]]) -> list[GroupInputs]:
    """Per save group of a report: C (warm saves), L, R (first loads) and what dollars need."""
    throughput = result["throughput"]
    if throughput.empty:
        return []
    keys = result["group_keys"]
    others = [k for k in keys if k != "op"]
    late = costs.late_runs(runs)  # their counts lack requests: not priced
    found = []
    for _, row in throughput[throughput["op"] == "save"].iterrows():
        labels = {k: row[k] for k in keys}
        ops, save_from = _of_order(select(result["operations"], labels, keys), LATER)
        samples, _ = _of_order(select(result["samples"], labels, keys), save_from)
        mode = "async" if "async" in set(samples["save_mode"].dropna().astype(str)) else "sync"
        checkpoint_s, cost_is, persisted, lag_s = _save_cost(mode, ops, samples)
        loads = throughput[throughput["op"] == "load"]
        load = select(loads, labels, others)
        if load.empty:
            load = select(loads, labels, MATCH_KEYS)
        load_labels = {k: load.iloc[0][k] for k in keys} if not load.empty else None
        load_ops, load_from = _of_order(select(result["operations"], load_labels, keys), FIRST)
        load_samples, _ = _of_order(select(result["samples"], load_labels, keys), load_from)
        startup, with_fill = _startup_s(runs, set(ops["run_id"]))
        found.append(GroupInputs(
            labels=labels, save_mode=mode, checkpoint_s=checkpoint_s, cost_is=cost_is,
            lag_s=lag_s, upload_s=persisted,
            load_s=float(load_ops["span_s"].mean()) if not load_ops.empty else None,
            startup_s=startup, fill_in_startup=with_fill and startup is not None,
            stored_bytes=float(row["checkpoint_gib"]) * GIB,
            save_requests=costs.request_counts(samples, late),
            load_requests=costs.request_counts(load_samples, late) if load_labels else None,
            save_from=save_from, load_from=load_from if load_labels else None))
    return found


@dataclasses.dataclass
class Plan:
    inputs: GroupInputs
    nodes: int  # --nodes; else the run's own node count
    mtbf_s: float
    young_s: float
    daly_s: float
    raised: bool  # the Daly interval was below the upload time (async)
    at_daly: TimeLost | None  # None: no Daly interval (a checkpoint that cost nothing)
    user_interval_s: float | None
    at_user: TimeLost | None
    validity: str  # HOLDS, ROUGH or MEANINGLESS, the worse of the two intervals
    first_order_x: float  # (tau + C + L + R) / M at the larger interval


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
    judged = [validity(tau, c, mtbf, inputs.restart_s, inputs.lag_s, lost)
              for tau, lost in ((daly, at_daly), (user_s, at_user))
              if tau is not None and not math.isnan(tau)]
    order = (HOLDS, ROUGH, MEANINGLESS)
    worst = max(judged, key=lambda j: (order.index(j[0]), j[1]), default=(HOLDS, math.nan))
    return Plan(inputs, node_count, mtbf, young, daly, raised, at_daly, user_s, at_user, *worst)

