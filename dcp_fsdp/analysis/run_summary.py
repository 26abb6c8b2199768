"""The table a run prints when it ends (rank 0), from its typed records."""

from __future__ import annotations

import dataclasses

from dcp_fsdp.telemetry.records import RunRecord, Sample


def print_run_summary(run: RunRecord, samples: list[Sample]) -> None:
    from tabulate import tabulate

    from dcp_fsdp.analysis.metrics import run_figures

    # the same figures as `report` gives for this record (analysis/figures.py)
    headers, rows, notes = run_figures({**dataclasses.asdict(s), "run_id": run.run_id}
                                       for s in samples)
    model = run.model or {}
    storage = run.storage or {}
    embedded = " (embedded SeaweedFS)" if storage.get("embedded") else ""
    print(f"\n{run.command} of {model.get('preset')} ({model.get('dtype')}, {model.get('state')}) "
          f"on {run.world_size} rank(s) / {run.node_count} node(s), "
          f"storage {storage.get('kind')}{embedded}")
    print(tabulate(rows, headers=headers, tablefmt="github"))
    for line in notes:
        print(line)
    for line in async_lines(samples):
        print(line)
    init_s = [row.init_s for row in run.init if row.init_s is not None]
    if init_s:
        print(f"init (untimed, not in any figure above): {max(init_s):.1f} s max over ranks")
    print(flush=True)


def async_lines(samples: list[Sample]) -> list[str]:
    """Async saves: how long training was blocked and how long until the save was durable,
    and the state bytes over each (the same spans as the report's MiB/s blocked/persisted)."""
    from dcp_fsdp.analysis.metrics import MIB

    lines = []
    saves = [s for s in samples if s.op == "save" and s.save_mode == "async"]
    for iteration in sorted({s.iteration for s in saves}):
        ranks = [s for s in saves if s.iteration == iteration]
        if any(s.blocked_s is None or s.persisted_s is None for s in ranks):
            continue
        begin = min(s.begin_wall_s for s in ranks)
        blocked = max(s.begin_wall_s + s.blocked_s for s in ranks) - begin
        persisted = max(s.begin_wall_s + s.persisted_s for s in ranks) - begin
        mib = sum(s.bytes for s in ranks) / MIB
        lines.append(f"async save {iteration}: blocked {blocked:.3f} s "
                     f"({mib / blocked if blocked else float('nan'):.1f} MiB/s), persisted "
                     f"{persisted:.3f} s ({mib / persisted if persisted else float('nan'):.1f} "
                     "MiB/s), first rank begin to last rank end of each")
    return lines
