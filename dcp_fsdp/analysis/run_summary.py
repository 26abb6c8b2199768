"""The table a run prints when it ends (rank 0), from its typed records."""

from __future__ import annotations

import dataclasses

from dcp_fsdp.telemetry.records import RunRecord, Sample


def print_run_summary(run: RunRecord, samples: list[Sample]) -> None:
    from tabulate import tabulate

    from dcp_fsdp.analysis.metrics import run_table

    headers, rows = run_table({**dataclasses.asdict(s), "run_id": run.run_id} for s in samples)
    model = run.model or {}
    storage = run.storage or {}
    embedded = " (embedded SeaweedFS)" if storage.get("embedded") else ""
    print(f"\n{run.command} of {model.get('preset')} ({model.get('dtype')}, {model.get('state')}) "
          f"on {run.world_size} rank(s) / {run.node_count} node(s), "
          f"storage {storage.get('kind')}{embedded}")
    print(tabulate(rows, headers=headers, tablefmt="github"))
    init_s = [row.init_s for row in run.init if row.init_s is not None]
    if init_s:
        print(f"init (untimed, not in any figure above): {max(init_s):.1f} s max over ranks")
    print(flush=True)
