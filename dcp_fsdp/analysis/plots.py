"""The report's PNG plots (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from dcp_fsdp.analysis.tables import OP_ORDER
from dcp_fsdp.analysis.render import key_cell
from dcp_fsdp.telemetry.figures import mean_or_nan, pooled
from dcp_fsdp.telemetry.histograms import bucket_bounds_ms, hist_quantile
from dcp_fsdp.telemetry.summaries import merge_by_type

if TYPE_CHECKING:  # matplotlib is imported only when plotting
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

MAX_PLOT_GROUPS = 6  # rows of the per-rank figure


def _series_label(row: pd.Series, keys: list[str]) -> str:
    """e.g. "save · nodes=2 · thread_count=4" (settings by their last name part)."""
    values = [key_cell(row[key]) or "?" for key in keys]
    return " · ".join(value if key in ("op", "model", "storage") else f"{key.rsplit('.', 1)[-1]}={value}"
                      for key, value in zip(keys, values))


def plot(result: dict[str, Any], directory: Path) -> list[Path]:
    """The report's figures as PNG files in `directory`; the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    if result["operations"].empty:
        return []
    samples = result["samples"]
    op_names = sorted(dict.fromkeys(samples["op"]), key=lambda op: OP_ORDER.get(op, 9))
    written = [_throughput_plot(result, directory / "throughput_vs_nodes.png"),
               _rank_durations_plot(result, op_names, directory / "rank_durations.png")]
    latency = _latency_plot(samples, op_names, directory / "request_latency.png")
    return written + ([latency] if latency else [])


def subplots(*args: Any, **kwargs: Any) -> Any:
    """pyplot.subplots on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def save_png(fig: Figure, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _throughput_plot(result: dict[str, Any], path: Path) -> Path:
    """Aggregate MiB/s vs node count (and vs ranks), one line per operation / setting."""
    ops = result["operations"]
    series_keys = [k for k in result["group_keys"] if k not in ("nodes", "ranks")]
    varying = [k for k in series_keys if ops[k].astype(str).nunique() > 1 or k == "op"]
    fig, axes = subplots(1, 2, figsize=(12, 4.8), sharey=True)
    for index, (_label, group) in enumerate(ops.groupby(varying, sort=True)):
        label = _series_label(group.iloc[0], varying)
        color = f"C{index}"  # the property cycle's colours, round again past its last
        for axis, x in zip(axes, ("nodes", "ranks")):
            xs = group[x].astype(float)
            axis.scatter(xs, group["aggregate_mib_s"], color=color, alpha=0.35, s=18)
            per_x = group.assign(_x=xs).groupby("_x").apply(
                lambda g: pooled(g)["aggregate_mib_s"], include_groups=False)
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
    return save_png(fig, path)


def _rank_durations_plot(result: dict[str, Any], op_names: list[str], path: Path) -> Path:
    """Per-rank durations and where they went: rows = groups, columns = operations."""
    samples, keys = result["samples"], result["group_keys"]
    other = [k for k in keys if k != "op" and samples[k].astype(str).nunique() > 1]
    groups = list(samples.groupby(other, sort=True)) if other else [(None, samples)]
    shown = groups[:MAX_PLOT_GROUPS]
    fig, axes = subplots(len(shown), len(op_names), squeeze=False,
                         figsize=(6.2 * len(op_names), 3.6 * len(shown) + 0.6))
    for row, (_, group) in enumerate(shown):
        label = _series_label(group.iloc[0], other) if other else ""
        for column, op in enumerate(op_names):
            _rank_panel(axes[row][column], group[group["op"] == op], f"{op}{' · ' + label if label else ''}")
    handles: dict[str, Artist] = {}
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
    return save_png(fig, path)


_PHASE_COLORS = {"plan": "#9ecae1", "io": "#3182bd", "commit": "#fd8d3c"}


def _rank_panel(axis: Axes, op_samples: pd.DataFrame, title: str) -> None:
    if op_samples.empty:
        axis.set_visible(False)
        return
    per_rank = op_samples.groupby("rank").agg(
        **{phase: (f"{phase}_s", mean_or_nan) for phase in _PHASE_COLORS}, duration=("duration_s", "mean"))
    ranks = per_rank.index.to_numpy()
    if per_rank[list(_PHASE_COLORS)].notna().all(axis=None):
        bottom: Any = 0.0
        for phase, color in _PHASE_COLORS.items():
            axis.bar(ranks, per_rank[phase], bottom=bottom, width=0.7, color=color,
                     label=f"{phase} (mean)")
            bottom = bottom + per_rank[phase]
    else:  # older records: no phase breakdown
        axis.bar(ranks, per_rank["duration"], width=0.7, color="#bdbdbd", label="duration (mean)")
    axis.scatter(op_samples["rank"], op_samples["duration_s"], color="black", s=14,
                 zorder=3, label="each iteration")
    axis.set_ylim(0, float(op_samples["duration_s"].max()) * 1.15)
    step = max(1, len(ranks) // 16)
    axis.set_xticks(ranks[::step])
    axis.set_xlabel("rank")
    axis.set_ylabel("seconds")
    axis.set_title(title, fontsize=10)
    axis.grid(alpha=0.3, axis="y")


def _latency_plot(samples: pd.DataFrame, op_names: list[str], path: Path) -> Path | None:
    """A latency CDF per request type, a panel per op with request statistics (raw ones: none)."""
    has_requests = samples["requests"].map(lambda r: isinstance(r, dict))
    request_ops = [op for op in op_names if has_requests[samples["op"] == op].any()]
    if not request_ops:
        return None
    fig, axes = subplots(1, len(request_ops), figsize=(6 * len(request_ops), 4.6), squeeze=False)
    for axis, op in zip(axes[0], request_ops):
        _latency_panel(axis, samples.loc[samples["op"] == op, "requests"], op)
    fig.tight_layout()
    return save_png(fig, path)


def _latency_panel(axis: Axes, requests: pd.Series, op: str) -> None:
    import matplotlib

    for index, (kind, entry) in enumerate(merge_by_type(requests).items()):
        hist = entry["latency_hist"]
        items = sorted((int(i), n) for i, n in hist.items())
        total = sum(n for _, n in items)
        xs, ys, seen = [], [], 0
        for bucket, n in items:
            low, high = bucket_bounds_ms(bucket)
            xs += [low, high]
            ys += [seen / total, (seen + n) / total]
            seen += n
        p50, p99 = hist_quantile(hist, 0.5), hist_quantile(hist, 0.99)
        axis.plot(xs, ys, color=f"C{index}",
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
