"""Scaling across world sizes and node counts, and S3's per-prefix request limits (the
figures' definitions: docs/decisions.md "Scaling across world sizes and node counts")."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd
from tabulate import tabulate

from dcp_fsdp.analysis import costs
from dcp_fsdp.analysis.columns import cell
from dcp_fsdp.analysis.plots import save_png, subplots
from dcp_fsdp.analysis.tables import select
from dcp_fsdp.units import GET_LIMIT_PER_S, PUT_LIMIT_PER_S

SIZE_KEYS = ("nodes", "ranks")
# each share of the operation's span, from its phase column
SHARES = {"plan": "plan_s", "commit": "commit_s", "barrier": "barrier_wait_mean_s"}


def scaling_frames(result: dict[str, Any]) -> list[pd.DataFrame]:
    """One frame per (model, storage, op, other settings) that spans several sizes."""
    throughput = result["throughput"]
    if throughput.empty:
        return []
    phases, keys = result["phases"], result["group_keys"]
    same = [k for k in keys if k not in SIZE_KEYS]
    frames = []
    for _, rows in throughput[throughput["op"].isin(("save", "load"))].groupby(same, sort=False):
        if rows[list(SIZE_KEYS)].drop_duplicates().shape[0] < 2:
            continue
        rows = rows.sort_values(["ranks", "nodes"])
        table = []
        for _, row in rows.iterrows():
            phase = select(phases, row, keys)
            span = row["duration_mean_s"]
            table.append({
                **{k: row[k] for k in keys},
                "aggregate_mib_s": row["aggregate_mib_s"],
                "mib_s_per_rank": row["aggregate_mib_s"] / row["ranks"],
                "mib_s_per_node": row["mib_s_per_node"],
                **{f"{name}_share": float(phase[column].iloc[0]) / span if len(phase) and span else math.nan
                   for name, column in SHARES.items()},
            })
        frame = pd.DataFrame(table)
        smallest = frame.iloc[0]
        frame["scaling_efficiency"] = frame["mib_s_per_rank"] / smallest["mib_s_per_rank"]
        frames.append(frame)
    return frames


def prefixes_of(config: dict[str, Any]) -> tuple[str, int]:
    """(strategy, how many prefixes it spreads a checkpoint's keys over)."""
    storage = config.get("storage") or {}
    strategy = str(storage.get("prefix_strategy") or "default")
    if strategy in ("hex", "binary"):
        return strategy, int(storage.get("prefix_count") or 1)
    if strategy == "round_robin":
        return strategy, max(1, len(storage.get("round_robin_prefixes") or []))
    return strategy, 1


def prefix_warnings(result: dict[str, Any], runs: list[dict[str, Any]], target_nodes: int,
                    prices: costs.Prices) -> list[str]:
    """Per S3 save/load group whose per-prefix request rate at `target_nodes` passes S3's limit."""
    types, throughput = result["types"], result["throughput"]
    if throughput.empty or types.empty:
        return []
    keys = result["group_keys"]
    config_of = {r["run_id"]: r["config"] for r in runs}
    operations = result["operations"]
    warnings = []
    for _, row in throughput[throughput["op"].isin(("save", "load"))].iterrows():
        if not costs.is_priced(row["storage"]) or not row["duration_mean_s"]:
            continue
        kinds = select(types, row, keys)
        ops = select(operations, row, keys)
        per_op = dict(zip(kinds["request_type"].astype(str), kinds["requests_per_op"]))
        charge = costs.request_charge(per_op, prices)
        writes = row["op"] == "save"
        # DELETEs count against the write limit although they are free
        count = charge.put_class + charge.free if writes else charge.get_class
        limit = PUT_LIMIT_PER_S if writes else GET_LIMIT_PER_S
        per_node_s = count / row["duration_mean_s"] / row["nodes"]
        strategy, prefixes = prefixes_of(config_of.get(ops["run_id"].iloc[0], {})
                                         if len(ops) else {})
        per_prefix = per_node_s * target_nodes / prefixes
        if per_prefix <= limit:
            continue
        needed = math.ceil(per_node_s * target_nodes / limit)
        warnings.append(
            f"{row['op']} of {row['model']} ({row['ranks']} rank(s)/{row['nodes']} node(s)): "
            f"{per_node_s:.1f} {'write' if writes else 'read'} requests/s per node x "
            f"{target_nodes} nodes = {per_prefix:,.0f}/s per prefix with "
            f"storage.prefix_strategy={strategy} ({prefixes} prefix(es)), over S3's "
            f"{limit:,}/s per prefix: expect 503 SlowDown; spread the keys with "
            f"storage.prefix_strategy=hex storage.prefix_count={needed} or more")
    return warnings


def render(result: dict[str, Any], fmt: str = "table") -> str:
    frames = scaling_frames(result)
    if not frames:
        return ""
    heading = "## " if fmt == "md" else ""
    out = [f"\n{heading}Scaling across sizes (efficiency: MiB/s per rank against the smallest "
           "size; plan/commit/barrier: share of the operation's span)"]
    for frame in frames:
        first = frame.iloc[0]
        out.append(f"\n{first['op']} of {first['model']}, {first['storage']}")
        rows = [[r["nodes"], r["ranks"], f"{r['aggregate_mib_s']:.1f}",
                 f"{r['mib_s_per_rank']:.1f}", f"{r['mib_s_per_node']:.1f}",
                 f"{r['scaling_efficiency']:.2f}", cell(r["plan_share"], ".1%"),
                 cell(r["commit_share"], ".1%"), cell(r["barrier_share"], ".1%")]
                for _, r in frame.iterrows()]
        out.append(tabulate(rows, headers=["nodes", "ranks", "agg MiB/s", "MiB/s/rank",
                                           "MiB/s/node", "efficiency", "plan", "commit",
                                           "barrier"],
                            tablefmt="github" if fmt == "md" else "simple",
                            disable_numparse=True))
    return "\n".join(out) + "\n"


def plot(result: dict[str, Any], directory: str | Path) -> list[Path]:
    """scaling.png: scaling efficiency and plan/commit/barrier shares against ranks, per op of sizes."""
    frames = scaling_frames(result)
    if not frames:
        return []
    fig, axes = subplots(1, 2, figsize=(12, 4.5))
    for frame in frames:
        first = frame.iloc[0]
        label = f"{first['op']} {first['model']}"
        ranks = frame["ranks"].astype(float)
        axes[0].plot(ranks, frame["scaling_efficiency"], marker="o", label=label)
        for column, style in (("plan_share", ":"), ("commit_share", "--"),
                              ("barrier_share", "-.")):
            axes[1].plot(ranks, frame[column] * 100, style, marker=".",
                         label=f"{label} {column.split('_')[0]}")
    axes[0].set(xlabel="ranks", ylabel="scaling efficiency (MiB/s per rank / smallest size's)",
                title="scaling efficiency")
    axes[0].axhline(1.0, color="grey", linewidth=0.8)
    axes[1].set(xlabel="ranks", ylabel="% of the operation's span",
                title="coordination: plan, commit, barrier")
    for axis in axes:
        axis.legend(fontsize=7)
    Path(directory).mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    return [save_png(fig, Path(directory) / "scaling.png")]
