"""What starting the ranks costs, in CPU seconds, by how torch's elastic agent starts them.

Plain torchrun starts `-m dcp_fsdp` by exec: each rank a fresh interpreter that imports
torch, DCP and the package (several CPU seconds a rank, before any figure). torch's agent can
instead start a function entrypoint by `fork` (from the agent, which has the imports already;
what our agent does since 2026-11-27: launch/forked_rank.py) or `forkserver` (from one
process that imports them once). This measures the three ways doing the same work per rank:
import what a rank imports, join a gloo group, build tiny_llama sharded as a run does
(models.build), save it with DCP to a temporary directory, leave the group. The figure is the
CPU time the machine spent while one launch ran in a child process (/proc/stat's busy time,
so run it on an otherwise idle machine): the forkserver is not a process its agent waits
for, so the agent's rusage misses it and its ranks.

  python -m benchmarks.rank_start --nproc 1 2 4 --repeat 3

It answered one question for issue 32 (the suite's CPU is its launches): how much of a
launch a forked start saves. It starts its own agents; the product's start is not used.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import uuid

import psutil

METHODS = ("exec", "fork", "forkserver")
MARK_ENV = "DCP_FSDP_RANK_START_BENCHMARK"  # every process of a measured launch inherits it
# What a rank of `dcp-fsdp save` imports before its first figure (python -X importtime of a
# rank, 2026-11-27): the package's rank side, DCP, and torch._dynamo (DTensor's first use).
RANK_IMPORTS = ("torch", "torch.distributed.checkpoint", "torch._dynamo", "dcp_fsdp.cli",
                "dcp_fsdp.rank.session", "dcp_fsdp.rank.loop", "dcp_fsdp.models.build",
                "dcp_fsdp.analysis.metrics")


def rank_work(checkpoint_dir: str) -> None:
    """One rank's share: imports, group, sharded build, one DCP save, teardown."""
    import importlib

    for name in RANK_IMPORTS:
        importlib.import_module(name)
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dcp_fsdp.config.schema import CheckpointState, Dtype
    from dcp_fsdp.models.build import build_sharded_model, dcp_state_dict

    dist.init_process_group("gloo")
    sharded = build_sharded_model("tiny_llama", Dtype.fp32, CheckpointState.model_and_optimizer,
                                  torch.device("cpu"), dist.get_world_size(), seed=0)
    dcp.save(dcp_state_dict(sharded.model, sharded.optimizer), checkpoint_id=checkpoint_dir)
    dist.destroy_process_group()


def agent(method: str, nproc: int, checkpoint_dir: str) -> None:
    """torch's elastic agent in this process, as `python -m dcp_fsdp.launch.agent` runs it."""
    import multiprocessing

    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc,
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",
                          run_id=uuid.uuid4().hex, max_restarts=0, monitor_interval=0.1,
                          start_method="spawn" if method == "exec" else method)
    if method == "exec":
        code = f"from benchmarks.rank_start import rank_work; rank_work({checkpoint_dir!r})"
        elastic_launch(config, sys.executable)("-c", code)
        return
    if method == "forkserver":
        multiprocessing.set_forkserver_preload(["benchmarks.rank_start", *RANK_IMPORTS])
    else:  # fork: the agent itself holds what the ranks would import
        import importlib

        for name in RANK_IMPORTS:
            importlib.import_module(name)
    elastic_launch(config, rank_work)(checkpoint_dir)


def _busy_s() -> float:
    times = psutil.cpu_times()
    return times.user + times.nice + times.system + times.irq + times.softirq


def _is_ours(process: psutil.Process) -> bool:
    return (process.info.get("environ") or {}).get(MARK_ENV) == "1"


def measure(method: str, nproc: int) -> dict:
    """One launch in a child process; its tree's CPU seconds and wall seconds."""
    import time

    with tempfile.TemporaryDirectory(prefix="dcp-fsdp-rank-start-") as tmp:
        before = _busy_s()
        started = time.monotonic()
        subprocess.run([sys.executable, "-m", "benchmarks.rank_start", "--agent", method,
                        "--nproc", str(nproc), "--checkpoint-dir", os.path.join(tmp, "ck")],
                       check=True, stdout=subprocess.DEVNULL,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": tmp,
                            MARK_ENV: "1"})
        wall_s = time.monotonic() - started
        # the forkserver and its ranks end after the agent: wait for the tree to be gone
        deadline = time.monotonic() + 60
        while any(_is_ours(p) for p in psutil.process_iter(["environ"])):
            if time.monotonic() > deadline:
                raise SystemExit(f"rank_start: {method} nproc={nproc}: processes of the "
                                 "launch still running 60 s after its agent ended")
            time.sleep(0.05)
        cpu_s = _busy_s() - before
    return {"method": method, "nproc": nproc, "cpu_s": round(cpu_s, 2),
            "wall_s": round(wall_s, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--method", choices=METHODS, nargs="+", default=list(METHODS))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--agent", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.agent:
        agent(args.agent, args.nproc[0], args.checkpoint_dir)
        return 0
    rows = []
    # Interleaved (method after method, then again) so the machine's drift hits all alike.
    for _ in range(args.repeat):
        for nproc in args.nproc:
            for method in args.method:
                rows.append(measure(method, nproc))
                print(json.dumps(rows[-1]), file=sys.stderr)
    print(f"{'method':<11} {'nproc':>5} {'CPU s (median)':>15} {'wall s (median)':>16}")
    for nproc in args.nproc:
        for method in args.method:
            mine = [r for r in rows if r["method"] == method and r["nproc"] == nproc]
            print(f"{method:<11} {nproc:>5} {statistics.median(r['cpu_s'] for r in mine):>15.2f} "
                  f"{statistics.median(r['wall_s'] for r in mine):>16.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
