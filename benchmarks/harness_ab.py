"""The harness's own cost, in one process: the tool's timed save/load (CheckpointLoop._timed:
hooks, byte counting, watchdog, memory marks, heartbeat, request-log window) against a bare
dcp.save / dcp.load with a plain writer/reader, alternated on the same state dict, server
and client settings; with --toggles, also the tool with one instrumentation piece off at a
time (no-hooks, no-watchdog, no-memory, no-heartbeat) and all of them off.

Process-level differences (imports, memory, what ran before) are the same for every
variant, so what remains is the harness in the timed path (benchmarks/harness_cost.py
compares whole launches instead). Printed: per variant and op, the paired ratio variant /
bare of each round (slowest rank), geometric mean and 95 % CI. Started by itself:

  python -m benchmarks.harness_ab --storage shm --model L660m --dtype bf16 --rounds 10 --toggles
  python -m benchmarks.harness_ab --storage s3 --rounds 10 --toggles   (embedded SeaweedFS)
  python -m benchmarks.harness_ab --storage shm --rounds 30 --variants tool,no-hooks
  python -m benchmarks.harness_ab --storage s3 --client msc --nproc 1 --rounds 30 --load-only --pin
  python -m benchmarks.harness_ab --storage s3 --nproc 1 --rounds 30 --load-only --pin --runs 8

--load-only saves one checkpoint before the rounds and only loads it (many short pairs);
--client picks the S3 client; --runs N repeats the launch N times, each on a fresh server, and
ends with the ratio's CI over the runs (two runs of one command differed by more than one
run's CI: docs/harness-cost.md). Beside the seconds, the ranks' process CPU in the same
regions. What is per process (the connector's request log, the botocore clients' GET hooks,
installed with the client) runs in both variants here: only the per-operation pieces differ
(the timed reader, the wire meter's watch, watchdog, memory marks, heartbeat).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
TOGGLES = {"tool": (), "no-hooks": ("hooks",), "no-watchdog": ("watchdog",),
           "no-memory": ("memory",), "no-heartbeat": (), "all-off": ("hooks", "watchdog", "memory")}


def remove(store, suffix: str) -> None:
    """A checkpoint of this benchmark, gone (1.26 GiB each at L660m bf16: /dev/shm fills)."""
    if store.kind == "fs":
        shutil.rmtree(store.location(suffix), ignore_errors=True)
        return
    client = store.control.client()
    prefix = store.target.key(suffix) + "/"
    for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=store.target.bucket, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=store.target.bucket, Delete={"Objects": keys})


def rank_main(args) -> None:
    from benchmarks.paired import finally_on_sigterm
    from dcp_fsdp.config.compose import compose
    from dcp_fsdp.rank.session import RankSession

    finally_on_sigterm()  # a stopped run (the agent's SIGTERM) still cleans up below
    session = RankSession(compose("save-and-load", args.overrides), time.monotonic())
    code = 1
    try:
        measure(session, args)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        # what the rank made in /tmp (MSC's profile, the request log's directory): os._exit
        # runs no clean-up of its own
        if session.store is not None:
            session.store.close()
        if session.request_log is not None:
            session.request_log.remove()
    os._exit(code)


def measure(session, args) -> None:
    """Every round of every variant; rank 0 writes the figures to AB_OUT."""
    session.start_telemetry()
    session.join()
    session.open_store()
    sharded, state_dict = session.build()
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dcp_fsdp.rank.loop import CheckpointLoop

    store, ctx = session.opened_store(), session.joined()
    loop = CheckpointLoop(session.cfg, ctx, store, sharded, state_dict,
                          request_log=session.request_log, say=session.say,
                          on_timeout=session.on_timeout)

    def bare(op: str, suffix: str) -> tuple[float, float]:
        """(seconds, the process's CPU seconds) of the bare call, clocked as the tool's region."""
        storage_io = store.writer(suffix) if op == "save" else store.reader(suffix)
        store.warm_up(storage_io)
        dist.barrier()
        begin, begin_cpu = time.monotonic(), time.process_time()
        if op == "save":
            dcp.save(state_dict, storage_writer=storage_io)
        else:
            dcp.load(state_dict, storage_reader=storage_io)
        return time.monotonic() - begin, time.process_time() - begin_cpu

    token = os.environ["AB_TOKEN"]
    variants = os.environ["AB_VARIANTS"].split(",")
    # --load-only: one checkpoint saved before the rounds (untimed), every variant loads it
    once = f"ab-{token}-once" if os.environ.get("AB_LOAD_ONLY") == "1" else None
    ops = ("load",) if once else ("save", "load")
    times: dict[str, list[float]] = {f"{v} {op}": [] for v in variants for op in ops}
    cpu: dict[str, list[float]] = {f"{v} {op}": [] for v in variants for op in ops}
    progress = loop.cfg.progress
    if once:
        bare("save", once)
    for round_number in range(args.rounds):
        shift = round_number % len(variants)
        order = variants[shift:] + variants[:shift]
        if (round_number // len(variants)) % 2:  # flip direction too (see harness_cost)
            order.reverse()
        for who in order:  # each variant saves then loads (as save-and-load does), then
            suffix = once or f"ab-{token}-{round_number}-{who}"  # its checkpoint goes (untimed)
            loop.harness_off = frozenset(TOGGLES.get(who, ()))
            loop.cfg.progress = progress and who not in ("no-heartbeat", "all-off")
            for op in ops:
                cpu_s: float | None
                if who == "bare":
                    seconds, cpu_s = bare(op, suffix)
                else:
                    # (an async save's result() waits for its upload)
                    sample = loop._timed(op, round_number, suffix).result()  # noqa: SLF001
                    seconds, cpu_s = sample.duration_s, sample.cpu_s
                times[f"{who} {op}"].append(seconds)
                cpu[f"{who} {op}"].append(math.nan if cpu_s is None else cpu_s)
            dist.barrier()
            if ctx.is_coordinator and not once:
                remove(store, suffix)
                if os.environ.get("AB_VACUUM_URL"):  # a deleted checkpoint's space, reclaimed
                    urllib.request.urlopen(os.environ["AB_VACUUM_URL"], timeout=300).read()
    if ctx.is_coordinator and once:
        remove(store, once)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"seconds": times, "cpu_s": cpu})
    if ctx.is_coordinator:
        Path(os.environ["AB_OUT"]).write_text(json.dumps(gathered))
    dist.barrier()


def main() -> int:
    if "RANK" in os.environ:
        parser = argparse.ArgumentParser()
        parser.add_argument("--rounds", type=int)
        parser.add_argument("overrides", nargs="*")
        rank_main(parser.parse_args())
        return 0
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="L660m")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--request-stats", default="true")
    parser.add_argument("--storage", choices=("s3", "shm"), default="s3")
    parser.add_argument("--client", choices=("s3torchconnector", "fsspec", "msc"),
                        default="s3torchconnector", help="storage.client (s3)")
    parser.add_argument("--load-only", action="store_true",
                        help="save once before the rounds; each round, each variant loads it")
    parser.add_argument("--pin", action="store_true", help="s3: as harness_cost --pin")
    parser.add_argument("--runs", type=int, default=1,
                        help="launches, each on a fresh server, and the ratio's CI over them")
    parser.add_argument("--toggles", action="store_true")
    parser.add_argument("--variants", help="comma-separated subset of "
                        f"{','.join(TOGGLES)} (default: tool, or all with --toggles)")
    args = parser.parse_args()
    chosen = args.variants.split(",") if args.variants else []
    unknown = [v for v in chosen if v not in TOGGLES]
    if unknown:
        print(f"harness_ab: error: --variants {','.join(unknown)}: not a variant; choose from "
              f"{','.join(TOGGLES)}", file=sys.stderr)
        return 2
    from benchmarks.paired import finally_on_sigterm

    finally_on_sigterm()  # a killed run stops its server and removes its files, as on Ctrl-C
    variants = ["bare", *(chosen or (TOGGLES if args.toggles else ["tool"]))]
    ops = ("load",) if args.load_only else ("save", "load")
    per_run = []
    for _ in range(args.runs):
        run = one_run(args, variants)
        print_run(args, variants, ops, run)
        per_run.append(run.slowest)
    if args.runs > 1:
        print_across_runs(variants, ops, per_run)
    return 0


class Run(NamedTuple):
    slowest: dict[str, list[float]]  # "variant op": per round, the slowest rank's seconds
    cpu_s: dict[str, list[float]]  # the same rounds: the ranks' process CPU seconds, summed
    started: str
    load_before: float


def one_run(args, variants: list[str]) -> Run:
    """One launch on a fresh server (and its own pinning), every round of every variant."""
    from benchmarks.harness_cost import pin_server_apart
    from benchmarks.paired import load_average, vacuum_url
    from dcp_fsdp.launch.embedded_s3 import EmbeddedS3

    server = None
    shm = None
    env = {**os.environ}
    own_cpus = os.sched_getaffinity(0)
    if args.storage == "s3":
        server = EmbeddedS3(bucket="harness-ab")
        launch_cpus = pin_server_apart() if args.pin else None
        endpoint = server.start()
        # its volumes fill after some tens of GiB written and deleted (benchmarks/paired.py):
        # a 30-round save run died after 11 minutes, with CRT error 14366 on a write
        env["AB_VACUUM_URL"] = vacuum_url(server)
        if launch_cpus is not None:  # the server's threads keep the CPU they started on
            os.sched_setaffinity(0, launch_cpus)
        env.update(endpoint.client_env())
        storage = [f"storage.uri=s3://{endpoint.bucket}/ckpt",
                   f"storage.endpoint={endpoint.endpoint_url}", f"storage.client={args.client}"]
    else:
        shm = tempfile.mkdtemp(prefix="dcp-fsdp-harness-ab-", dir="/dev/shm")
        storage = ["storage=fs", f"storage.path={shm}"]
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_before = load_average()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "ab.json"
            env.update({"PYTHONPATH": str(REPO), "AB_OUT": str(out),
                        "AB_TOKEN": os.urandom(3).hex(), "AB_VARIANTS": ",".join(variants),
                        "AB_LOAD_ONLY": "1" if args.load_only else "0",
                        "OMP_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) // args.nproc)),
                        # as dcp-fsdp's launcher: torch's per-rank inductor cache goes with tmp
                        "TORCHINDUCTOR_CACHE_DIR": env.get("TORCHINDUCTOR_CACHE_DIR",
                                                           str(Path(tmp) / "torchinductor"))})
            env.pop("DCP_FSDP_HARNESS_OFF", None)
            # torch's agent keeps its logs and error files here (not torchelastic_* in /tmp)
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       f"--nproc-per-node={args.nproc}", f"--log-dir={Path(tmp) / 'torchelastic'}",
                       "-m", "benchmarks.harness_ab",
                       "--rounds", str(args.rounds), f"model={args.model}",
                       f"model.dtype={args.dtype}", *storage,
                       f"request_stats={args.request_stats}"]
            with subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL) as agent:
                try:
                    agent.wait()
                except BaseException:  # SIGTERM, Ctrl-C: subprocess.run would SIGKILL the agent,
                    agent.terminate()  # orphaning its ranks; SIGTERM reaches them through it
                    agent.wait()
                    raise
            if agent.returncode:
                raise subprocess.CalledProcessError(agent.returncode, command)
            per_rank = json.loads(out.read_text())
    finally:
        if server is not None:
            server.stop()
            os.sched_setaffinity(0, own_cpus)  # the next run pins afresh
        if shm is not None:
            shutil.rmtree(shm, ignore_errors=True)
    slowest = {key: [max(rank["seconds"][key][i] for rank in per_rank) for i in range(args.rounds)]
               for key in per_rank[0]["seconds"]}
    cpu_s = {key: [sum(rank["cpu_s"][key][i] for rank in per_rank) for i in range(args.rounds)]
             for key in per_rank[0]["cpu_s"]}
    return Run(slowest, cpu_s, started, load_before)


def print_run(args, variants: list[str], ops: tuple[str, ...], run: Run) -> None:
    from benchmarks.harness_cost import summarise
    from benchmarks.paired import load_average

    slowest, cpu_s = run.slowest, run.cpu_s
    print(f"{args.model} {args.dtype}, {args.nproc} ranks, storage={args.storage}, "
          f"client={args.client if args.storage == 's3' else '-'}, "
          f"request_stats={args.request_stats}, {args.rounds} rounds in one process from "
          f"{run.started}, load average {run.load_before:.2f} -> {load_average():.2f} "
          "(slowest rank, seconds)")
    for key, values in slowest.items():
        print(f"  {key}: " + " ".join(f"{v:.3f}" for v in values))
    figures = {v: [{f"{op}_s": slowest[f"{v} {op}"][i] for op in ops}
                   for i in range(args.rounds)] for v in variants}
    print("\n".join(summarise(figures, variants, ops)))
    print("The ranks' process CPU seconds in the same regions (every thread), variant / bare:")
    cpu_figures = {v: [{f"{op}_s": cpu_s[f"{v} {op}"][i] for op in ops}
                       for i in range(args.rounds)] for v in variants}
    print("\n".join(summarise(cpu_figures, variants, ops)))
    for variant in variants[1:]:
        for op in ops:
            added = [c - b for c, b in zip(cpu_s[f"{variant} {op}"], cpu_s[f"bare {op}"])]
            bare_s = statistics.median(slowest[f"bare {op}"])
            print(f"  {variant} {op}: CPU added, mean {statistics.fmean(added) * 1e3:+.1f} ms "
                  f"(sd {statistics.stdev(added) * 1e3:.1f} ms) a round: "
                  f"{statistics.fmean(added) / bare_s:+.2%} of the median bare {op}'s {bare_s:.3f} s")


def print_across_runs(variants: list[str], ops: tuple[str, ...],
                      per_run: list[dict[str, list[float]]]) -> None:
    """Each run's geometric-mean ratio, and their geometric mean with a 95 % CI over runs."""
    from benchmarks.paired import PairedRatio, across_runs, ratio_ci

    print(f"Across {len(per_run)} runs (each a fresh server and process; the CI is over runs):")
    for variant in variants[1:]:
        for op in ops:
            each = [PairedRatio.of(run[f"{variant} {op}"], run[f"bare {op}"]).ratios
                    for run in per_run]
            mean, low, high = across_runs(each)
            runs = " ".join(f"{ratio_ci(ratios)[0]:.4f}" for ratios in each)
            print(f"  {variant} {op}: {mean:.4f} [{low:.4f}, {high:.4f}]; the runs: {runs}")

if __name__ == "__main__":
    sys.exit(main())
