"""DCP against the storage's ceiling: `dcp-fsdp save-and-load ceiling=true`, then per op
the aggregate MiB/s of DCP and of the raw PUT/GET of the same objects, and the efficiency
(DCP / raw). Settings are passed through (embedded SeaweedFS unless storage is given):

  python -m benchmarks.efficiency model=tiny_llama nproc=2 iterations=3
  python -m benchmarks.efficiency model=L660m model.dtype=bf16 nproc=2 iterations=2

Figures as the report defines them (telemetry/figures.py): aggregate MiB/s pooled over the
iterations (min-max of the iterations beside it); the ceiling = the best raw round;
efficiency = DCP / the ceiling, a ratio (pooled over the iterations).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path
from dcp_fsdp.units import MIB


PAIRS = (("save", "raw_put"), ("load", "raw_get"))


def main() -> int:
    from tabulate import tabulate

    from dcp_fsdp.telemetry.records import read_record_file

    overrides = sys.argv[1:]
    results = Path(tempfile.mkdtemp(prefix="dcp-fsdp-efficiency-"))
    completed = subprocess.run([sys.executable, "-m", "dcp_fsdp", "save-and-load", *overrides,
                                "ceiling=true", f"results_dir={results}"],
                               stdout=subprocess.DEVNULL)
    if completed.returncode != 0:
        print(f"run failed (exit {completed.returncode})")
        return 1
    (record,) = results.glob("*.jsonl")
    parsed = read_record_file(record)
    run = parsed.runs[0]
    from dcp_fsdp.telemetry.figures import summary

    found = summary(parsed.samples)
    rows = []
    for dcp_op, raw_op in PAIRS:
        if dcp_op not in found or raw_op not in found:
            continue
        dcp, raw = found[dcp_op], found[raw_op]

        def cell(figures):
            values = figures["per_iteration_mib_s"]
            return f"{figures['aggregate_mib_s']:.1f} ({min(values):.1f}-{max(values):.1f})"
        rows.append([dcp_op, cell(dcp), cell(raw), f"{max(raw['per_iteration_mib_s']):.1f}",
                     f"{dcp['efficiency']:.2f}"])
    model, storage = run.model, run.storage
    assert model is not None and storage is not None  # a record with operations has both
    print(f"{model.preset} {model.dtype} {model.state}, "
          f"{(model.state_bytes or 0) / MIB:.1f} MiB, {run.world_size} ranks, storage "
          f"{storage.kind}{' (embedded SeaweedFS)' if storage.embedded else ''}, "
          f"{len(run.suffixes)} iteration(s); record {record}")
    print(tabulate(rows, headers=["op", "DCP MiB/s (min-max)", "raw MiB/s (min-max)",
                                  "ceiling MiB/s", "efficiency"],
                   tablefmt="github"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
