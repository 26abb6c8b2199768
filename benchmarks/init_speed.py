"""Init (build) time and verification throughput of one preset at one world size.

Spawns `--nproc` ranks on this machine (gloo on CPU, nccl with CUDA), each of which builds
the sharded model exactly as a run does (models.build: meta build, fully_shard, fill its
shards), then checks its shards as a verified load does (rank.state: recompute and compare,
bit for bit) and, with --sha256, hashes the same bytes with SHA-256 for comparison. No
storage is involved. Prints per-rank figures and the worst rank's:

  python -m benchmarks.init_speed --preset GPT-4B --dtype bf16 --nproc 2 --max-init-s 15 \\
      --min-verify-gb-s 5
  python -m benchmarks.init_speed --preset tiny_llama --nproc 2 --state model_and_optimizer

Exit status 1 when a given target is missed (the worst rank counts).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import socket
import subprocess
import sys
import time
from dcp_fsdp.units import GIB

GB = 1e9


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from dcp_fsdp.config.schema import Backend, CheckpointState, Dtype
    from dcp_fsdp.models.build import build_sharded_model, unique_shards
    from dcp_fsdp.rank import state as verify
    from dcp_fsdp.rank.distributed import init_distributed
    from dcp_fsdp.models.build import dcp_state_dict

    ctx = init_distributed(Backend.auto, 600)
    dist.barrier()
    t0, cpu0 = time.monotonic(), time.process_time()
    sharded = build_sharded_model(args.preset, Dtype(args.dtype), CheckpointState(args.state),
                                  ctx.device, ctx.world_size, args.seed)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
    build_s, build_cpu_s = time.monotonic() - t0, time.process_time() - cpu0
    t0 = time.monotonic()
    state_dict = dcp_state_dict(sharded.model, sharded.optimizer)
    state_dict_s = time.monotonic() - t0
    checked_bytes = sum(local.numel() * local.element_size()
                        for _, local, _, _ in unique_shards(state_dict))
    dist.barrier()
    t0, cpu0 = time.monotonic(), time.process_time()
    mismatch = verify.first_mismatch(state_dict, args.seed)
    verify_s, verify_cpu_s = time.monotonic() - t0, time.process_time() - cpu0
    # CPU seconds beside wall seconds: on a shared machine the wall figure measures the
    # neighbours too; bytes per CPU second is what a dedicated core would do
    row = {"rank": ctx.rank, "device": str(ctx.device), "build_s": build_s,
           "build_cpu_s": build_cpu_s, "verify_cpu_gb_s": checked_bytes / verify_cpu_s / GB,
           "state_dict_s": state_dict_s, "checked_bytes": checked_bytes, "verify_s": verify_s,
           "verify_gb_s": checked_bytes / verify_s / GB, "mismatch": mismatch,
           "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB}
    if args.sha256:
        dist.barrier()
        t0, cpu0 = time.monotonic(), time.process_time()
        for _, local, _, _ in unique_shards(state_dict):
            data = local.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            hashlib.sha256(data.numpy().data).digest()
        row["sha256_gb_s"] = checked_bytes / (time.monotonic() - t0) / GB
        row["sha256_cpu_gb_s"] = checked_bytes / (time.process_time() - cpu0) / GB
    print("ROW " + json.dumps(row), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny_llama")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--state", default="model", choices=["model", "model_and_optimizer"])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sha256", action="store_true", help="also time SHA-256 of the shards")
    parser.add_argument("--max-init-s", type=float, help="fail when a rank's build is slower")
    parser.add_argument("--min-verify-gb-s", type=float,
                        help="fail when a rank verifies slower (GB/s, 1e9 bytes)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0

    port = str(free_port())
    argv = [sys.executable, "-m", "benchmarks.init_speed", "--worker", *sys.argv[1:]]
    procs = []
    for rank in range(args.nproc):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(args.nproc), "LOCAL_WORLD_SIZE": str(args.nproc),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               # each rank its share of the cores, as dcp_fsdp's launcher and torchrun arrange
               "OMP_NUM_THREADS": os.environ.get(
                   "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))}
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True))
    rows = []
    for proc in procs:
        out, _ = proc.communicate()
        rows += [json.loads(line[4:]) for line in out.splitlines() if line.startswith("ROW ")]
        if proc.returncode != 0:
            print(f"a rank failed (exit {proc.returncode})")
            return 1
    rows.sort(key=lambda row: row["rank"])
    for row in rows:
        sha = (f", sha256 {row['sha256_gb_s']:.2f} GB/s ({row['sha256_cpu_gb_s']:.2f} per CPU "
               "s)" if "sha256_gb_s" in row else "")
        print(f"rank {row['rank']} ({row['device']}): build {row['build_s']:.2f} s "
              f"({row['build_cpu_s']:.2f} CPU s), state dict {row['state_dict_s']:.2f} s, verify "
              f"{row['checked_bytes'] / GIB:.2f} GiB in {row['verify_s']:.2f} s = "
              f"{row['verify_gb_s']:.2f} GB/s ({row['verify_cpu_gb_s']:.2f} per CPU s){sha}, "
              f"peak RSS {row['peak_rss_gib']:.2f} GiB")
    worst_build_s = max(row["build_s"] for row in rows)
    worst_verify = min(row["verify_gb_s"] for row in rows)
    worst_cpu = min(row["verify_cpu_gb_s"] for row in rows)
    print(f"\n{args.preset} {args.dtype} {args.state} nproc={args.nproc}: init (build) "
          f"{worst_build_s:.2f} s, verification {worst_verify:.2f} GB/s per rank "
          f"({worst_cpu:.2f} GB per CPU second; worst rank; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    failed = False
    if any(row["mismatch"] for row in rows):
        print("FAIL: freshly built shards do not hold their values")
        failed = True
    if args.max_init_s is not None and worst_build_s > args.max_init_s:
        print(f"FAIL: init {worst_build_s:.2f} s > {args.max_init_s:g} s")
        failed = True
    if args.min_verify_gb_s is not None and worst_verify < args.min_verify_gb_s:
        print(f"FAIL: verification {worst_verify:.2f} GB/s < {args.min_verify_gb_s:g} GB/s")
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
