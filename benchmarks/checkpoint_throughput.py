"""Save/load throughput and per-rank peak memory of one preset on this machine.

Runs `dcp-fsdp save-and-load` (embedded SeaweedFS unless storage settings are given)
and prints the figures from its record. Targets are checked, not asserted in unit tests:

  .venv/bin/python -m benchmarks.checkpoint_throughput model=GPT-4B model.dtype=bf16 nproc=2
  .venv/bin/python -m benchmarks.checkpoint_throughput model=L7b model.dtype=bf16 nproc=2 verify=true \
      --max-rank-rss-gib 11   # L7b in bf16 fits two CPU ranks on a 24 GiB machine

Exit status 1 when a given target is missed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from dcp_fsdp.units import GIB



def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-rank-rss-gib", type=float, help="fail above this peak RSS per rank")
    parser.add_argument("--min-save-mib-s", type=float, help="fail below this aggregate save MiB/s")
    parser.add_argument("--min-load-mib-s", type=float, help="fail below this aggregate load MiB/s")
    args, overrides = parser.parse_known_args()
    results = Path(tempfile.mkdtemp(prefix="dcp-fsdp-bench-"))
    started = time.monotonic()
    completed = subprocess.run([sys.executable, "-m", "dcp_fsdp", "save-and-load", *overrides,
                                f"results_dir={results}"])
    wall_s = time.monotonic() - started
    if completed.returncode != 0:
        print(f"run failed (exit {completed.returncode})")
        return 1
    lines = [json.loads(line) for path in results.glob("*.jsonl")
             for line in path.read_text().splitlines()]
    run = next(line for line in lines if line["record"] == "run")
    samples = [line for line in lines if line["record"] == "sample"]
    from dcp_fsdp.telemetry.figures import summary

    found = summary(samples)  # the report's definitions (telemetry/figures.py)
    figures = {op: found[op]["per_iteration_mib_s"] for op in ("save", "load") if op in found}
    rss = [row.get("peak_rss_bytes") for row in run["init"] if row.get("peak_rss_bytes")]
    model = run["model"]
    print(f"\nmodel {model['preset']} {model['dtype']} {model['state']}: "
          f"{model['param_count'] / 1e9:.3f} B params, {model['state_bytes'] / GIB:.2f} GiB; "
          f"world size {run['world_size']}; wall {wall_s:.0f} s")
    for op, values in figures.items():
        print(f"{op}: aggregate MiB/s {found[op]['aggregate_mib_s']:.1f} (all iterations "
              f"pooled), slowest-rank MiB/s {found[op]['slowest_rank_mib_s']:.1f}; per "
              "iteration " + ", ".join(f"{v:.1f}" for v in values))
    if rss:
        print(f"peak RSS per rank: max {max(rss) / GIB:.2f} GiB")
    failed = False
    if args.max_rank_rss_gib and rss and max(rss) / GIB > args.max_rank_rss_gib:
        print(f"MISSED: peak RSS {max(rss) / GIB:.2f} GiB > {args.max_rank_rss_gib} GiB")
        failed = True
    for op, target in (("save", args.min_save_mib_s), ("load", args.min_load_mib_s)):
        if target and min(figures[op]) < target:
            print(f"MISSED: {op} {min(figures[op]):.1f} MiB/s < {target} MiB/s")
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
