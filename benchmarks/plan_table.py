"""docs/plan.md's table: `dcp-fsdp plan` at each world size, one markdown row each.

  python -m benchmarks.plan_table --sizes 8,16,32,64,128,256,512,1024,2048,4096 \\
      --ranks-per-node 8 model=L70b state=model_and_optimizer

Each size is planned in this process (plan/command.py's plan_world); the arguments other than
--sizes are the plan command's (its options and settings, config/arguments.py); the row holds
what the command prints for it. Rows built from a subset of the layers are marked.
"""

from __future__ import annotations

import argparse
import sys
import time

from dcp_fsdp.units import MIB
from dcp_fsdp.config.arguments import parse
from dcp_fsdp.config.schema import StorageKind
from dcp_fsdp.plan import requests as rq
from dcp_fsdp.plan.command import parse_request, plan_world
from dcp_fsdp.plan.render import prefixes


def row(request, plan, elapsed_s: float) -> str:
    storage = request.cfg.storage
    part = storage.part_size_mib * MIB
    sizes = [o.size_bytes for o in plan.objects]
    reqs = rq.count_requests(sizes, plan.metadata_bytes, plan.world_size, part)
    rate = storage.throughput_target_gbps * 1e9 / 8
    load = rq.prefix_load(plan.rank_objects(), prefixes(request, plan.world_size), part, rate,
                          reqs.metadata_gets_per_rank)
    s3 = storage.kind == StorageKind.s3
    cells = [
        f"{plan.world_size:,}", f"{plan.world_size // request.ranks_per_node:,}",
        f"{max(plan.rank_bytes()) / MIB:,.0f}", f"{len(sizes) + 1:,}",
        f"{reqs.save_put:,}" if s3 else "-", f"{reqs.load_get:,}" if s3 else "-",
        f"{plan.metadata_bytes / MIB:,.1f}", f"{plan.planning_s:.1f}",
        f"{plan.metadata_unpickle_s:.1f}", f"{plan.metadata_memory_bytes / MIB:,.0f}",
        f"{load.peak_put_per_s:,.0f} / {load.peak_get_per_s:,.0f}" if s3 else "-",
        f"{load.recommended_count}" if s3 and load.recommended_count else "-",
        f"{elapsed_s:.0f}" + (" (sampled)" if plan.sampled else ""),
    ]
    return "| " + " | ".join(cells) + " |"


HEADER = ("| ranks | nodes | MiB per rank | objects per save | PUT-class per save | GETs per load "
          "| .metadata MiB | rank 0 planning CPU s | unpickle CPU s per rank | .metadata in memory MiB "
          "| peak PUT/s / GET/s per prefix (default) | hex prefix_count for S3's limits "
          "| plan s here |\n|" + "---|" * 13)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plan_table",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8,16,32,64")
    args, plan_args = parser.parse_known_args(argv)
    print(HEADER, flush=True)
    for size in (int(s) for s in args.sizes.split(",")):
        request = parse_request(parse(["plan", f"--world-size={size}", *plan_args]))
        started = time.monotonic()
        _, plan = plan_world(request, size)
        print(row(request, plan, time.monotonic() - started), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
