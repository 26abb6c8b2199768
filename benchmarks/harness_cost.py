"""What the harness costs: the tool's figure against a bare barrier + dcp.save / dcp.load.

Alternates launches of
  bare      benchmarks/bare_dcp.py under torchrun: the same model, shapes and values, a
            barrier and dcp.save / dcp.load with DCP's (or the connector's) own writer and
            reader; its own timer (it imports none of the tool's timing code)
  tool      dcp-fsdp save-and-load (everything on, as a user runs it)
  and, with --toggles, the tool with one piece of instrumentation off at a time:
  no-hooks      the writer/reader hook and stream wrappers (storage/timed_dcp.py, storage/timeline.py)
  no-watchdog   the op_timeout_s timer thread
  no-memory     the peak-RSS marks around each operation (rank/memory.py)
  no-heartbeat  progress=false (rank 0's progress thread)
  no-reqlog     request_stats=false (s3: the connector's per-request debug log)
  all-off       all of the above
  and, with --torchrun, tool-torchrun: the tool's ranks started by a user's own
  `torchrun ... -m dcp_fsdp` instead of through `dcp-fsdp` (whose ranks run under the same
  elastic agent since the launcher moved to torchrun: the variant isolates the light parent)
(the pieces are switched off through the benchmark-only DCP_FSDP_HARNESS_OFF variable,
dcp_fsdp/contract.py; heartbeat and request log are settings.)

Every round runs each variant once, in an order that rotates every round, on the same
storage: tmpfs (--storage shm: /dev/shm, no server, no disk) or the embedded SeaweedFS
(--storage s3). A launch's figure per op is the slowest rank's seconds inside dcp.save /
dcp.load (the tool's duration_s). Per variant and op: the paired ratio variant / bare of
each round, their geometric mean with a 95 % confidence interval (t on the log-ratios),
and the ratio of the median seconds. 1.00 = no cost; a CI inside [0.99, 1.01] settles
"within 1 %". The 1-minute load average is printed beside every round: on a shared
machine, rounds run under very different loads are noise, not harness.

  python -m benchmarks.harness_cost --storage shm --pairs 10
  python -m benchmarks.harness_cost --storage s3 --pairs 10 --toggles
  python -m benchmarks.harness_cost --storage s3 --client msc --nproc 1 --pairs 10 --toggle no-reqlog
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.paired import PairedRatio, finally_on_sigterm, load_average, vacuum

REPO = Path(__file__).resolve().parents[1]
TOGGLES = {  # variant -> (settings, DCP_FSDP_HARNESS_OFF)
    "no-hooks": ([], "hooks"),
    "no-watchdog": ([], "watchdog"),
    "no-memory": ([], "memory"),
    "no-heartbeat": (["progress=false"], ""),
    "no-reqlog": (["request_stats=false"], ""),
    "all-off": (["progress=false", "request_stats=false"], "hooks,watchdog,memory"),
}


def pin_server_apart() -> set[int]:
    """This process (and so the server it starts next) on the last CPU it may use; returns
    the others, for the launches after the server started."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--pin needs 2 or more CPUs")
    os.sched_setaffinity(0, {cpus[-1]})
    return set(cpus[:-1])


def _env(extra: dict[str, str], nproc: int) -> dict[str, str]:
    env = {**os.environ, **extra, "PYTHONPATH": str(REPO),
           "OMP_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) // nproc))}
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DCP_FSDP_HARNESS_OFF"):
        env.pop(name, None)
    return env


def run_bare(args, location: str, env, log) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bare.json"
        # torch's agent logs and the ranks' inductor cache in tmp, as dcp-fsdp's launcher
        # keeps them in its run directory (not torchelastic_* / torchinductor_* in /tmp)
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc-per-node={args.nproc}", f"--log-dir={Path(tmp) / 'torchelastic'}",
                        "-m", "benchmarks.bare_dcp", args.model, args.dtype, location, str(out),
                        "1", args.client],
                       cwd=REPO, env={"TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "torchinductor"),
                                      **env},
                       stdout=log, stderr=log, check=True)
        result = json.loads(out.read_text())
    return {f"{op}_s": max(r[f"{op}_s"][0] for r in result["ranks"]) for op in ("save", "load")}


def run_tool(args, storage_args: list[str], variant: str, env, log) -> dict[str, float]:
    settings, off = TOGGLES.get(variant, ([], ""))
    with tempfile.TemporaryDirectory() as results:
        # tool-torchrun: the same ranks started by a user's torchrun, without dcp-fsdp's
        # parent (its agent's logs in the temporary dir, not torchelastic_* in /tmp)
        launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                     f"--nproc-per-node={args.nproc}", f"--log-dir={Path(results) / 'torchelastic'}"]
                    if variant == "tool-torchrun" else [sys.executable])
        subprocess.run([*launcher, "-m", "dcp_fsdp", "save-and-load",
                        f"model={args.model}", f"model.dtype={args.dtype}", f"nproc={args.nproc}",
                        *storage_args, "iterations=1", f"results_dir={results}", *settings,
                        *([f"storage.client={args.client}"] if args.storage == "s3" else [])],
                       cwd=REPO, env={**env, "DCP_FSDP_HARNESS_OFF": off},
                       stdout=log, stderr=log, check=True)
        (record,) = Path(results).glob("*.jsonl")
        lines = [json.loads(line) for line in record.read_text().splitlines()]
    samples = [line for line in lines[1:] if line["record"] == "sample"]
    return {f"{op}_s": max(s["duration_s"] for s in samples if s["op"] == op)
            for op in ("save", "load")}


def summarise(figures: dict[str, list[dict[str, float]]], variants: list[str],
              ops: tuple[str, ...] = ("save", "load")) -> list[str]:
    lines = [f"{'variant':<13} {'op':<5} {'n':>3} {'geo-mean ratio':>14} {'95 % CI':>17} "
             f"{'median-s ratio':>15} {'min..max':>13}"]
    for variant in variants:
        if variant == "bare":
            continue
        for op in ops:
            seconds = [v[f"{op}_s"] for v in figures[variant]]
            bare_s = [b[f"{op}_s"] for b in figures["bare"]]
            paired = PairedRatio.of(seconds, bare_s)
            medians = statistics.median(seconds) / statistics.median(bare_s)
            lines.append(f"{variant:<13} {op:<5} {len(paired.ratios):>3} {paired.cells(14)} "
                         f"{medians:>15.4f} "
                         f"{f'{min(paired.ratios):.3f}..{max(paired.ratios):.3f}':>13}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--storage", choices=("shm", "s3"), default="shm")
    parser.add_argument("--client", choices=("s3torchconnector", "fsspec", "msc"),
                        default="s3torchconnector", help="storage.client (s3 only): the bare "
                        "script uses that client's own writer and reader")
    parser.add_argument("--model", default="L660m")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=10, help="rounds (each variant once)")
    parser.add_argument("--toggles", action="store_true",
                        help="add the tool with each instrumentation piece off")
    parser.add_argument("--toggle", action="append", default=[], choices=list(TOGGLES),
                        help="add the tool with this one piece off (repeatable; --toggles adds all)")
    parser.add_argument("--torchrun", action="store_true",
                        help="add the tool launched by torchrun (tool-torchrun)")
    parser.add_argument("--pin", action="store_true",
                        help="s3: the server on the last CPU, every launch on the others (a "
                             "2-core machine's rounds otherwise vary by the scheduler's mix)")
    parser.add_argument("--log", default="harness_cost.log", help="the launches' own output")
    parser.add_argument("--json", default=None, help="write every launch's figures here")
    parser.add_argument("--summarise", metavar="JSON", help="only print a --json file's summary")
    args = parser.parse_args()
    finally_on_sigterm()
    if args.summarise:
        return print_saved(args.summarise)
    variants = (["bare", "tool"] + (["tool-torchrun"] if args.torchrun else [])
                + (list(TOGGLES) if args.toggles else [t for t in TOGGLES if t in args.toggle]))
    if args.storage == "shm":
        variants = [v for v in variants if v != "no-reqlog"]  # no request log without S3

    server = client = None
    if args.storage == "s3":
        import boto3
        import botocore.config

        from dcp_fsdp.launch.embedded_s3 import EmbeddedS3

        server = EmbeddedS3(bucket="harness-cost")
        launch_cpus = pin_server_apart() if args.pin else None
        endpoint = server.start()
        if launch_cpus is not None:  # the server's threads keep the CPU they started on
            os.sched_setaffinity(0, launch_cpus)
        env = _env(endpoint.client_env(), args.nproc)
        msc_config = Path(tempfile.mkdtemp(prefix="dcp-fsdp-harness-msc-")) / "msc.json"
        msc_config.write_text(json.dumps({"profiles": {"bench": {"storage_provider": {
            "type": "s3", "options": {"base_path": endpoint.bucket, "region_name": endpoint.region,
                                      "endpoint_url": endpoint.endpoint_url,
                                      "s3": {"addressing_style": "path"}}}}}}))
        env["MSC_CONFIG"] = str(msc_config)  # the bare script's profile (no keys in it)
        client = boto3.client(
            "s3", endpoint_url=endpoint.endpoint_url, region_name=endpoint.region,
            aws_access_key_id=endpoint.access_key_id,
            aws_secret_access_key=endpoint.secret_access_key,
            config=botocore.config.Config(s3={"addressing_style": "path"}))
    else:
        shm = Path(tempfile.mkdtemp(prefix="dcp-fsdp-harness-cost-", dir="/dev/shm"))
        env = _env({}, args.nproc)
    figures: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    try:
        with open(args.log, "w") as log:
            for round_number in range(args.pairs):
                shift = round_number % len(variants)
                order = variants[shift:] + variants[:shift]
                # every len(variants) rounds the direction flips: with two variants the
                # orders run AB, BA, BA, AB (no variant always goes first)
                if (round_number // len(variants)) % 2:
                    order.reverse()
                load_before = load_average()
                for variant in order:
                    name = f"{variant}-{round_number}"
                    if args.storage == "s3":
                        uri = f"s3://{endpoint.bucket}/{name}"
                        if variant == "bare":
                            figure = run_bare(args, f"{uri}/ckpt", env, log)
                        else:
                            figure = run_tool(args, [f"storage.uri={uri}",
                                                     f"storage.endpoint={endpoint.endpoint_url}"],
                                              variant, env, log)
                        _delete_prefix(client, endpoint.bucket, name + "/")
                    else:
                        where = shm / name
                        if variant == "bare":
                            figure = run_bare(args, str(where / "ckpt"), env, log)
                        else:
                            figure = run_tool(args, ["storage=fs", f"storage.path={where}"],
                                              variant, env, log)
                        shutil.rmtree(where, ignore_errors=True)
                    figures[variant].append(figure)
                if server is not None:
                    vacuum(server)
                if args.json:  # after every round: a run cut short keeps whole rounds
                    Path(args.json).write_text(json.dumps({"args": vars(args),
                                                           "figures": figures}))
                print(f"round {round_number + 1:>2} load avg {load_before:5.2f}->"
                      f"{load_average():5.2f}  " + "  ".join(
                          f"{v} {figures[v][-1]['save_s']:.3f}/{figures[v][-1]['load_s']:.3f}"
                          for v in variants), flush=True)
    finally:
        if server is not None:
            server.stop()
            shutil.rmtree(msc_config.parent, ignore_errors=True)
        else:
            shutil.rmtree(shm, ignore_errors=True)
    print(f"\n{args.model} {args.dtype}, {args.nproc} ranks, storage={args.storage} "
          f"(client {args.client if args.storage == 's3' else '-'}), "
          f"{args.pairs} rounds from {started}{', server pinned apart' if args.pin else ''}; "
          "seconds of the slowest rank; ratio = variant / "
          "bare of the same round")
    print("\n".join(summarise(figures, variants)))
    return 0


def print_saved(path: str) -> int:
    """The summary of a --json file (whole rounds only), e.g. of a run cut short."""
    saved = json.loads(Path(path).read_text())
    figures = saved["figures"]
    rounds = min(len(v) for v in figures.values())
    figures = {k: v[:rounds] for k, v in figures.items()}
    args = saved["args"]
    print(f"{args['model']} {args['dtype']}, {args['nproc']} ranks, storage={args['storage']}, "
          f"{rounds} whole rounds; seconds of the slowest rank; ratio = variant / bare")
    print("\n".join(summarise(figures, list(figures))))
    return 0


def _delete_prefix(client, bucket: str, prefix: str) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys})


if __name__ == "__main__":
    sys.exit(main())
