"""DCP against the storage's ceiling: `dcp-fsdp save-and-load ceiling=true`, then per op
the aggregate MiB/s of DCP and of the raw PUT/GET of the same objects, and the efficiency
(DCP / raw). Settings are passed through (embedded SeaweedFS unless storage is given):

  python -m benchmarks.efficiency model=tiny_llama nproc=2 iterations=3
  python -m benchmarks.efficiency model=L660m model.dtype=bf16 nproc=2 iterations=2

Aggregate MiB/s = all ranks' bytes / (last rank end - first rank begin), per iteration;
the table shows the median over iterations and min/max.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MIB = 2**20
PAIRS = (("save", "raw_put"), ("load", "raw_get"))


def aggregate_mib_s(samples, op: str) -> list[float]:
    spans: dict[int, list[float]] = {}
    for s in samples:
        if s.op != op:
            continue
        span = spans.setdefault(s.iteration, [float("inf"), 0.0, 0.0])
        span[0], span[1] = min(span[0], s.begin_wall_s), max(span[1], s.end_wall_s)
        span[2] += s.bytes
    return [nbytes / MIB / (end - begin) for begin, end, nbytes in spans.values()]


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
    rows = []
    for dcp_op, raw_op in PAIRS:
        dcp, raw = aggregate_mib_s(parsed.samples, dcp_op), aggregate_mib_s(parsed.samples, raw_op)
        ratios = [d / r for d, r in zip(dcp, raw)]
        rows.append([dcp_op, f"{statistics.median(dcp):.1f} ({min(dcp):.1f}-{max(dcp):.1f})",
                     f"{statistics.median(raw):.1f} ({min(raw):.1f}-{max(raw):.1f})",
                     f"{statistics.median(ratios) * 100:.0f} % "
                     f"({min(ratios) * 100:.0f}-{max(ratios) * 100:.0f})"])
    model, storage = run.model, run.storage
    print(f"{model['preset']} {model['dtype']} {model['state']}, "
          f"{model['state_bytes'] / MIB:.1f} MiB, {run.world_size} ranks, storage "
          f"{storage['kind']}{' (embedded SeaweedFS)' if storage.get('embedded') else ''}, "
          f"{len(run.suffixes)} iteration(s); record {record}")
    print(tabulate(rows, headers=["op", "DCP MiB/s median (min-max)",
                                  "raw MiB/s median (min-max)", "efficiency median (min-max)"],
                   tablefmt="github"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
