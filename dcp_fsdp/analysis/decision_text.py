"""The interval and dollars section of `report` as text (figures: analysis/decisions.py)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from tabulate import tabulate

from dcp_fsdp.units import GIB
from dcp_fsdp.analysis import costs
from dcp_fsdp.analysis.decisions import (FIRST_ORDER_LIMIT, HOLDS, MATCH_KEYS, MEANINGLESS,
                                         GroupInputs, Plan, TimeLost, gather, job_mtbf_s, plan)
from dcp_fsdp.analysis.groups import FIRST


def _group_name(labels: dict[str, Any], keys: list[str]) -> str:
    shown = [f"{labels['model']} {labels['ranks']} rank(s)/{labels['nodes']} node(s)",
             str(labels["storage"])]
    shown += [f"{k}={labels[k]}" for k in keys
              if k not in (*MATCH_KEYS, "op", "op_order", "save_mode")
              and labels.get(k) not in ("", None)]
    return ", ".join(shown)


def _hours(seconds: float) -> str:
    hours = seconds / 3600
    return f"{hours:,.0f}" if hours >= 100 else f"{hours:.3g}"


def _minutes(seconds: float | None) -> str:
    if seconds is None or math.isnan(seconds):
        return ""
    minutes = seconds / 60
    return f"{minutes:.1f}" if minutes >= 1 else f"{minutes:.3g}"  # 0.0036, not 0.0


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
    save: costs.RequestCharge | None  # None: the save's request counts are not complete
    load: costs.RequestCharge | None  # None: no load, or its counts are not complete
    month: float  # one checkpoint stored for a month
    day: dict[str, float] | None  # at the chosen interval, K kept; None unless all priced
    # {"save"|"load": (samples without request counts, samples)}: not priced, and why
    unpriced: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)


def dollars(p: Plan, prices: costs.Prices, keep: int) -> Dollars | None:
    """None for a file system: no dollars rather than zero. Requests are priced only from
    complete counts (costs.RequestCounts); what is not is named in `unpriced`."""
    g = p.inputs
    if not costs.is_priced(g.labels["storage"]):
        return None
    unpriced, charges = {}, {}
    for op, counts in (("save", g.save_requests), ("load", g.load_requests)):
        if counts is not None and counts.per_type is not None:
            charges[op] = costs.request_charge(counts.per_type, prices)
        elif counts is not None:
            unpriced[op] = (counts.missing, counts.samples)
    save, load = charges.get("save"), charges.get("load")
    month = costs.storage_dollars_per_month(g.stored_bytes, prices)
    interval = p.user_interval_s or p.daly_s
    day = None
    if save is not None and "load" not in unpriced and interval and not math.isnan(interval):
        day = costs.dollars_per_day(interval, p.mtbf_s, save.dollars,
                                    load.dollars if load else None, month, keep)
    return Dollars(save, load, month, day, unpriced)


def warnings(p: Plan) -> list[str]:
    """One line each: inputs that make the figures meaningless, or beyond the model's range."""
    g, lines = p.inputs, []
    if p.validity == MEANINGLESS:
        what = ("the checkpoint (C) takes longer than the job's MTBF"
                if g.checkpoint_s >= p.mtbf_s else
                "the restart (R) takes longer than the job's MTBF" if g.restart_s >= p.mtbf_s
                else "the losses add up to all of it")
        lines.append(f"  WARNING: meaningless inputs: training lost >= 100 %: {what} "
                     f"(C {g.checkpoint_s:.3g} s, R {g.restart_s:.3g} s, M {p.mtbf_s:.3g} s"
                     + ("; C >= 2M: beyond Daly's form, the interval is M"
                        if g.checkpoint_s >= 2 * p.mtbf_s else "")
                     + "); the job would not progress: check --node-mtbf-hours and --nodes")
    elif p.validity != HOLDS:
        lines.append(f"  WARNING: beyond the first-order model: (tau + C + L + R) / M = "
                     f"{p.first_order_x:.2f} > {FIRST_ORDER_LIMIT:g}; the shares lost are rough "
                     "(the model assumes failures rare within an interval)")
    return lines


def _inputs_line(p: Plan) -> str:
    g = p.inputs
    load = ("load: none in these records" if g.load_s is None else
            f"{'first' if g.load_from == FIRST else 'later (no first)'} load {g.load_s:.2f} s")
    startup = ("start-up unknown" if g.startup_s is None else
               f"start-up {g.startup_s:.1f} s"
               + (" incl. the value fill (record without fill_s)" if g.fill_in_startup
                  else " less the value fill"))
    saves = "warm saves" if g.save_from != FIRST else "first save only: no warm one"
    return (f"  C = {g.checkpoint_s:.3f} s ({g.cost_is}, {saves}); R = {g.restart_s:.2f} s "
            f"({load}; {startup})"
            + (f"; L = {g.lag_s:.3f} s (upload after the stall)"
               if g.save_mode == "async" else ""))


def _dollar_lines(g: GroupInputs, cost: Dollars | None, keep: int, interval_minutes: float | None
                  ) -> list[str]:
    if cost is None:
        return ["  dollars: none (a file system: no request or storage charges)"]
    save = ("save not priced: request counts missing in "
            f"{cost.unpriced['save'][0]} of {cost.unpriced['save'][1]} samples"
            if cost.save is None else
            f"save {_dollars(cost.save.dollars)} ({cost.save.put_class:.0f} PUT-class + "
            f"{cost.save.get_class:.0f} GET-class requests)")
    load = ("" if "load" not in cost.unpriced and cost.load is None else
            f", load not priced: request counts missing in {cost.unpriced['load'][0]} of "
            f"{cost.unpriced['load'][1]} samples" if cost.load is None else
            f", load {_dollars(cost.load.dollars)} ({cost.load.get_class:.0f} GET-class + "
            f"{cost.load.put_class:.0f} PUT-class)")
    lines = [f"  dollars: {save}{load}; {g.stored_bytes / GIB:.3f} GiB stored: "
             f"{_dollars(cost.month)} per checkpoint-month"]
    if cost.day is not None:
        at = f"{interval_minutes:g} min" if interval_minutes else "the Daly interval"
        lines.append(f"  per day at {at}, {keep} kept: {_dollars(cost.day['total'])} (saves "
                     f"{_dollars(cost.day['saves'])}, restarts "
                     f"{_dollars(cost.day['restarts']) or 'not priced: no load measured'}"
                     f", storage {_dollars(cost.day['storage'])})")
    return lines


def _block(number: int, p: Plan, cost: Dollars | None, keys: list[str], keep: int,
           interval_minutes: float | None) -> list[str]:
    g = p.inputs
    lines = [f"#{number} {_group_name(g.labels, keys)}, {g.save_mode}", _inputs_line(p),
             f"  interval: Young {_minutes(p.young_s)} min, Daly {_minutes(p.daly_s)} min"
             + (" (raised to the upload time: saves would queue)" if p.raised else "")
             + f"; training lost there {_share(p.at_daly)}"]
    if p.at_user is not None:
        lines.append(f"  at {interval_minutes:g} min: training lost {_share(p.at_user)}")
    return lines + warnings(p) + _dollar_lines(g, cost, keep, interval_minutes)


def _header(plans: list[Plan], node_mtbf_hours: float, nodes: int | None,
            interval_minutes: float | None, keep: int, prices: costs.Prices,
            heading: str) -> list[str]:
    node_counts = sorted({p.nodes for p in plans})
    lines = [f"\n{heading}Checkpoint interval, training time lost, dollars",
             f"inputs: node MTBF {node_mtbf_hours:g} h (--node-mtbf-hours); "
             + ", ".join(f"{n} nodes: job MTBF M = {_hours(job_mtbf_s(node_mtbf_hours, n))} h"
                         for n in node_counts)
             + (f"; your interval {interval_minutes:g} min" if interval_minutes else "")
             + f"; {keep} checkpoint(s) kept (--keep)"]
    if not nodes:
        lines.append(f"NOTE: no --nodes: M is for the runs' own {', '.join(map(str, node_counts))}"
                     f" node(s), not the training job's; with one node M is one node's MTBF "
                     f"({node_mtbf_hours:g} h) and the intervals are a one-node job's: give "
                     "--nodes N for the job you will run")
    lines += [f"prices: {prices.describe()}",
              "C: what a checkpoint costs training (warm saves); R: restart (the first load "
              "+ start-up); L: async upload lag; training lost ~ C/tau + (tau/2 + L)/M + R/M "
              f"(first order: rough above (tau + C + L + R)/M = {FIRST_ORDER_LIMIT:g})", ""]
    return lines


def _row(number: int, p: Plan, cost: Dollars | None, interval_minutes: float | None
         ) -> list[str]:
    row = [f"#{number}", p.inputs.save_mode, f"{p.inputs.checkpoint_s:.3f}",
           f"{p.inputs.restart_s:.2f}", _minutes(p.daly_s),
           "" if p.at_daly is None else f"{p.at_daly.total:.2%}"]
    if interval_minutes:
        row.append("" if p.at_user is None else f"{p.at_user.total:.2%}")
    save = ("no dollars (fs)" if cost is None else
            "" if cost.save is None else _dollars(cost.save.dollars))
    # "save 4/4, load 2/4": samples without request counts of what is not priced
    unpriced = "" if cost is None else ", ".join(f"{op} {missing}/{samples}"
                                                  for op, (missing, samples) in cost.unpriced.items())
    return row + [p.validity, save,
                  "" if cost is None or cost.day is None else _dollars(cost.day["total"]), unpriced]


def render(result: dict[str, Any], runs: list[dict[str, Any]], node_mtbf_hours: float,
           nodes: int | None, interval_minutes: float | None, keep: int,
           prices: costs.Prices, fmt: str = "table") -> str:
    """The interval and dollars section: a table of the save groups, then each one's inputs."""
    heading = "## " if fmt == "md" else ""
    groups = gather(result, runs)
    if not groups:
        return (f"\n{heading}Checkpoint interval: no save in these records (a save, and "
                "ideally a load, are needed)\n")
    plans = [plan(g, node_mtbf_hours, nodes, interval_minutes) for g in groups]
    costs_of = [dollars(p, prices, keep) for p in plans]
    lines = _header(plans, node_mtbf_hours, nodes, interval_minutes, keep, prices, heading)
    headers = ["#", "mode", "C s", "R s", "Daly min", "lost at Daly"]
    if interval_minutes:
        headers.append(f"lost at {interval_minutes:g} min")
    headers += ["model", "$ per save", "$ per day", "no request counts (samples)"]
    rows = [_row(n, p, c, interval_minutes) for n, (p, c) in enumerate(zip(plans, costs_of), 1)]
    if not any(row[-1] for row in rows):  # every request counted: nothing to say
        headers, rows = headers[:-1], [row[:-1] for row in rows]
    lines += [tabulate(rows, headers=headers, tablefmt="github" if fmt == "md" else "simple",
                       disable_numparse=True), ""]
    for number, (p, cost) in enumerate(zip(plans, costs_of), 1):
        lines += _block(number, p, cost, result["group_keys"], keep, interval_minutes)
    if any(str(p.inputs.labels["storage"]).startswith("s3 (embedded") for p in plans):
        lines.append("(an embedded SeaweedFS run is priced as if its requests went to S3)")
    return "\n".join(lines) + "\n"
