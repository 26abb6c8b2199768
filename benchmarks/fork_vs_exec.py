"""Forked ranks against exec'd ranks: the timings of the test suite's start against the users'.

Measured runs exec their ranks, as torchrun does; the test suite forks them from the agent
(DCP_FSDP_TEST_ONLY_FORK_RANKS=1, launch/forked_rank.py) to save about 5 CPU s a rank. The
figures apart from time are the same both ways (tests/integration/test_rank_start.py); this
says whether the times are too. Every round launches the same `dcp-fsdp save-and-load` once
each way, in an order that alternates (exec first, then fork first), on the same storage:
tmpfs (--storage shm: /dev/shm, no server, no disk) or the embedded SeaweedFS (--storage s3).
A launch's figure per op is the median over its iterations of the slowest rank's duration_s;
`init` is the slowest rank's init_s (imports included: the fork's saving shows there), and
`cpu` the launch's CPU seconds (its processes, reaped). Per figure: fork / exec of each round,
their geometric mean with a 95 % confidence interval (t on the log-ratios, benchmarks/paired),
and the ratio of the medians. Run it on an otherwise idle machine.

  python -m benchmarks.fork_vs_exec --pairs 10
  python -m benchmarks.fork_vs_exec --storage s3 --model L660m --dtype bf16 --pairs 10
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.paired import PairedRatio, load_average
from dcp_fsdp.contract import FORK_RANKS_TEST_ONLY_ENV

REPO = Path(__file__).resolve().parents[1]
STARTS = ("exec", "fork")
FIGURES = ("save", "load", "init", "cpu")


def _env(nproc: int, extra: dict[str, str]) -> dict[str, str]:
    env = {**os.environ, **extra, "PYTHONPATH": str(REPO),
           "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DCP_FSDP_HARNESS_OFF",
                 FORK_RANKS_TEST_ONLY_ENV):
        env.pop(name, None)
    return env


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(args, storage_args: list[str], start: str, env: dict[str, str], log) -> dict[str, float]:
    """One launch with ranks started `start`'s way: its figures, and the record's rank_start
    checked (a launch that did not start its ranks that way measures nothing here)."""
    cpu_before_s = _children_cpu_s()
    with tempfile.TemporaryDirectory() as results:
        subprocess.run([sys.executable, "-m", "dcp_fsdp", "save-and-load", f"model={args.model}",
                        f"model.dtype={args.dtype}", f"nproc={args.nproc}",
                        f"iterations={args.iterations}", *storage_args, f"results_dir={results}",
                        "progress=false"],
                       cwd=REPO, env={**env, FORK_RANKS_TEST_ONLY_ENV: "1" if start == "fork" else "0"},
                       stdout=log, stderr=log, check=True)
        (record,) = Path(results).glob("*.jsonl")
        lines = [json.loads(line) for line in record.read_text().splitlines()]
    run, samples = lines[0], [line for line in lines[1:] if line["record"] == "sample"]
    if run.get("rank_start") != start:
        raise SystemExit(f"a {start} launch recorded rank_start={run.get('rank_start')!r}")
    figures = {"init": max(row["init_s"] for row in run["init"]),
               "cpu": _children_cpu_s() - cpu_before_s}
    for op in ("save", "load"):
        slowest = [max(s["duration_s"] for s in samples if s["op"] == op and s["iteration"] == i)
                   for i in range(1, args.iterations + 1)]
        figures[op] = statistics.median(slowest)
    return figures


def summarise(figures: dict[str, list[dict[str, float]]]) -> list[str]:
    lines = [f"{'figure':<6} {'n':>3} {'fork/exec':>10} {'95 % CI':>17} {'median ratio':>13} "
             f"{'exec median':>12} {'fork median':>12}"]
    for name in FIGURES:
        execd = [f[name] for f in figures["exec"]]
        forked = [f[name] for f in figures["fork"]]
        paired = PairedRatio.of(forked, execd)
        lines.append(f"{name:<6} {len(paired.ratios):>3} {paired.cells(10)} "
                     f"{statistics.median(forked) / statistics.median(execd):>13.4f} "
                     f"{statistics.median(execd):>12.4f} {statistics.median(forked):>12.4f}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--storage", choices=("shm", "s3"), default="shm")
    parser.add_argument("--model", default="tiny_llama")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=10, help="rounds (each start once)")
    parser.add_argument("--log", default="fork_vs_exec.log", help="the launches' own output")
    args = parser.parse_args()

    server = None
    if args.storage == "s3":
        from dcp_fsdp.launch.embedded_s3 import EmbeddedS3

        server = EmbeddedS3(bucket="fork-vs-exec")
        endpoint = server.start()
        env = _env(args.nproc, endpoint.client_env())
    else:
        shm = Path(tempfile.mkdtemp(prefix="dcp-fsdp-fork-vs-exec-", dir="/dev/shm"))
        env = _env(args.nproc, {})
    figures: dict[str, list[dict[str, float]]] = {start: [] for start in STARTS}
    try:
        with open(args.log, "w") as log:
            for round_number in range(args.pairs):
                order = STARTS if round_number % 2 == 0 else STARTS[::-1]
                load_before = load_average()
                for start in order:
                    name = f"{start}-{round_number}"
                    if server is not None:
                        storage = [f"storage.uri=s3://{endpoint.bucket}/{name}",
                                   f"storage.endpoint={endpoint.endpoint_url}"]
                    else:
                        storage = ["storage=fs", f"storage.path={shm / name}"]
                    figures[start].append(run_once(args, storage, start, env, log))
                    if server is None:
                        shutil.rmtree(shm / name, ignore_errors=True)
                print(f"round {round_number + 1}/{args.pairs} ({'-'.join(order)}), load "
                      f"{load_before:.1f}: " + ", ".join(
                          f"{start} " + " ".join(f"{k} {v:.3f}" for k, v in figures[start][-1].items())
                          for start in STARTS), flush=True)
    finally:
        if server is not None:
            server.stop()
        else:
            shutil.rmtree(shm, ignore_errors=True)
    print("\n".join(summarise(figures)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
