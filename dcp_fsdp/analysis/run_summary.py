"""The table a run prints when it ends (rank 0), from its typed records."""

from __future__ import annotations

import math
from typing import Any, Iterable

from tabulate import tabulate

from dcp_fsdp.analysis.metrics import per_operation, run_figures, samples_frame
from dcp_fsdp.telemetry.figures import mlperf_gib_s, operations, pooled
from dcp_fsdp.telemetry.records import ModelInfo, ModelSettings, RunRecord, Sample, StorageInfo
from dcp_fsdp.telemetry.time_split import split_lines
from dcp_fsdp.units import GIB, MIB


def print_run_summary(run: RunRecord, samples: list[Sample]) -> None:
    # the same figures as `report` gives for this record (telemetry/figures.py)
    headers, rows, notes = run_figures({**s.model_dump(), "run_id": run.run_id} for s in samples)
    model, storage = run.model or ModelInfo(), run.storage or StorageInfo()
    embedded = " (embedded SeaweedFS)" if storage.embedded else ""
    print(f"\n{run.command} of {model.preset} ({model.dtype}, {model.state}) "
          f"on {run.world_size} rank(s) / {run.node_count} node(s){replicas_words(run)}, "
          f"storage {storage.kind}{embedded}")
    print(tabulate(rows, headers=headers, tablefmt="github"))
    for line in [*notes, *split_lines(s.model_dump() for s in samples), *async_lines(samples),
                 *mlperf_lines(run, samples), *cache_lines(run, samples)]:
        print(line)
    init_s = [row.init_s for row in run.init if row.init_s is not None]
    if init_s:
        print(f"init (untimed, not in any figure above): {max(init_s):.1f} s max over ranks")
    print(flush=True)


STAGER_RENEWED = (
    "async saves on a torch whose stager stages only once (2.11, pytorch/pytorch#183413): "
    "each save ran on a fresh stager, so its staging allocated its pinned / shared host "
    "buffers again (inside staged_s and stall_s); with a torch that reuses its stager only "
    "the first save pays that (sample field stager_renewed)")


def stager_note(renewed: Iterable[object]) -> str | None:
    """The note when any async save's `stager_renewed` is true (None, NaN or false: none;
    a pandas column may hold numpy booleans)."""
    marked = any(bool(value) for value in renewed if value is not None and value == value)
    return STAGER_RENEWED if marked else None


def replicas_words(run: RunRecord) -> str:
    """" as 2 replicas (loads: read_once)" with model.replicas > 1, else ""."""
    model = run.config.model or ModelSettings()
    replicas = getattr(model, "replicas", None) or 1
    if replicas <= 1:
        return ""
    loads = f" (loads: {getattr(model, 'replica_load', None)})" if run.command != "save" else ""
    return f" as {replicas} replicas{loads}"


def async_lines(samples: list[Sample]) -> list[str]:
    """Async saves: what training paid (the stall; with steps between saves, the training time
    lost and its share of the interval) and how long until the save was durable."""
    saves = [s for s in samples if s.op == "save" and s.save_mode == "async"]
    if not saves:
        return []
    lines = []
    ops = per_operation(samples_frame(s.model_dump() for s in saves)).sort_values("iteration")
    for iteration, stall, persisted in zip(ops["iteration"], ops["stall_span_s"], ops["persisted_span_s"]):
        if math.isnan(stall) or math.isnan(persisted):  # a rank without the figures: no line
            continue
        ranks = [s for s in saves if s.iteration == iteration]
        line = f"async save {iteration}: training stalled {stall:.3f} s"
        waits = [s.previous_wait_s for s in ranks if s.previous_wait_s is not None]
        if waits and max(waits) >= 0.0005:  # shown to the millisecond
            line += f" (of which {max(waits):.3f} s waiting for the previous upload)"
        lost = [s for s in ranks if s.train_lost_s is not None and s.interval_s and s.train_lost_share is not None]
        if lost:  # the slowest rank's: the others wait for it at the next collective
            worst = max(lost, key=lambda s: s.train_lost_share or 0.0)
            line += (f", training lost {worst.train_lost_s:.3f} s = "
                     f"{worst.train_lost_share:.1%} of a {worst.interval_s:.3f} s interval "
                     f"(rank {worst.rank})")
        lines.append(line + f"; persisted {persisted:.3f} s")
    note = stager_note(s.stager_renewed for s in saves)
    return lines + ([note] if note else [])


# A load's page-cache policy (Sample.cache_policy, storage/pagecache.py names them; analysis
# reads records, not the store): where the drop could not leave the cache empty.
CACHE_KEPT = {
    "tmpfs-not-droppable": (
        "storage.path is on a memory file system (tmpfs or ramfs), whose files are the page "
        "cache itself: nothing could be dropped (cache_policy tmpfs-not-droppable), so every "
        "load read memory and the load figures above{mlperf} are memory's speed, not a storage "
        "device's; put storage.path on a disk or network file system to measure one"),
    "resident-after-drop": (
        "some of the checkpoint's pages stayed in the page cache after the drop (cache_policy "
        "resident-after-drop: mapped by another process, or a file system that ignores the "
        "advice), so the loads read partly from memory and the load figures above{mlperf} may "
        "overstate the storage"),
}


def cache_lines(run: RunRecord, samples: list[Sample]) -> list[str]:
    """Once: fs loads read (partly) from memory, the page cache not dropped, and what that means."""
    policies = {s.cache_policy for s in samples if s.op == "load"}
    mlperf = ", MLPerf's included," if getattr(run.config, "protocol", None) == "mlperf" else ""
    return [f"load: {CACHE_KEPT[policy].format(mlperf=mlperf)}" for policy in CACHE_KEPT
            if policy in policies]


MLPERF_DIFFERENCE = (
    "MLPerf's figure is what its DLIO code publishes: the mean over checkpoints of checkpoint "
    "GiB / rank 0's own seconds (its README says the slowest rank's); ours divide every byte by "
    "the slowest rank's seconds (what training waits for) and by first begin to last end "
    "(aggregate), every byte over every second of the operations: MLPerf's is higher when rank 0 "
    "is not the slowest and when the operations' times differ (a mean of rates; docs/mlperf.md).")


def mlperf_lines(run: RunRecord, samples: list[Sample]) -> list[str]:
    """protocol=mlperf: MLPerf Storage's figure per op beside ours, GiB/s, and why they differ."""
    if getattr(run.config, "protocol", None) != "mlperf":
        return []
    return ["MLPerf Storage v3.0 checkpointing (protocol=mlperf), GiB/s:",
            *mlperf_op_lines([s.model_dump() for s in samples]), MLPERF_DIFFERENCE]


def mlperf_op_lines(samples: Any) -> list[str]:
    """Per op of one run's samples: MLPerf's figure and ours (end-of-run lines and `report`)."""
    ops = operations(samples)
    lines = []
    for op in ("save", "load"):
        ours = pooled(ops[ops["op"] == op])
        lines.append(f"  {op}: MLPerf {mlperf_gib_s(samples, op):.4f} | ours: slowest-rank "
                     f"{ours['slowest_rank_mib_s'] * MIB / GIB:.4f}, aggregate "
                     f"{ours['aggregate_mib_s'] * MIB / GIB:.4f} ({ours['operations']} "
                     f"{op}s)")
    return lines
