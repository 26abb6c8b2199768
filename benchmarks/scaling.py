"""Scaling across world sizes on one machine: `dcp-fsdp save-and-load` at each rank count
(one run each, the same settings otherwise; embedded SeaweedFS unless storage is given), then
the report's scaling view over their records (analysis/scaling.py: aggregate MiB/s, per rank,
per node, scaling efficiency against the smallest size, plan/commit/barrier shares):

  python -m benchmarks.scaling --sizes 1,2,4 model=tiny_llama iterations=3
  python -m benchmarks.scaling --sizes 1,2,4,8 --results results/scaling model=L660m

The records stay in --results (default a new temporary directory), so `dcp-fsdp report DIR`
can show them again with every other table. On Slurm, run `batch/` at 1, 2 and 4 nodes into
one results directory and `dcp-fsdp report` it: the same view appears per node count.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scaling",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,2,4", help="rank counts, comma-separated")
    parser.add_argument("--results", help="directory for the records (default: a temporary one)")
    args, overrides = parser.parse_known_args(argv)
    try:
        sizes = [int(size) for size in args.sizes.split(",")]
    except ValueError:
        print(f"scaling: error: --sizes {args.sizes}: give rank counts like 1,2,4",
              file=sys.stderr)
        return 2
    results = Path(args.results) if args.results else \
        Path(tempfile.mkdtemp(prefix="dcp-fsdp-scaling-"))
    for size in sizes:
        print(f"nproc={size} ...", flush=True)
        completed = subprocess.run(
            [sys.executable, "-m", "dcp_fsdp", "save-and-load", *overrides, f"nproc={size}",
             f"results_dir={results}", "progress=false"], stdout=subprocess.DEVNULL)
        if completed.returncode != 0:
            print(f"nproc={size}: run failed (exit {completed.returncode}); the sizes before "
                  f"it are in {results}", file=sys.stderr)
            return 1
    from dcp_fsdp.analysis import scaling
    from dcp_fsdp.analysis.groups import build
    from dcp_fsdp.analysis.sources import read_records, record_files

    runs, samples, _ = read_records(record_files([str(results)]))
    print(f"records: {results}")
    print(scaling.render(build(runs, samples), "md") or "no scaling view: fewer than two sizes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
