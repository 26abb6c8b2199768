"""What the harness costs: the tool's timed figure against a bare dcp.save / dcp.load.

On one SeaweedFS server (started here, on 127.0.0.1) and the same settings, alternates
`--alternations` rounds of three launches, in an order that rotates every round:
  bare        benchmarks/bare_dcp.py under torchrun: barrier + dcp.save / dcp.load only
  tool        dcp-fsdp save-and-load (request_stats=true, the default)
  tool-nostats  dcp-fsdp save-and-load request_stats=false
Each launch's figure per op is the awslabs peer's: whole model bytes / the slowest rank's
seconds inside dcp.save (dcp.load); with --iterations N, the quickest of its N. Printed: every launch, then per op the ratios
tool seconds / bare seconds of each round, min / median / max. 1.00 = no cost.

  python -m benchmarks.overhead --model L660m --dtype bf16 --alternations 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20


def _env(extra: dict[str, str], nproc: int) -> dict[str, str]:
    env = {**os.environ, **extra, "PYTHONPATH": str(REPO),
           "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def run_bare(args, uri: str, env, log) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bare.json"
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc-per-node={args.nproc}", "-m", "benchmarks.bare_dcp",
                        args.model, args.dtype, uri, str(out), str(args.iterations)],
                       cwd=REPO, env=env, stdout=log, stderr=log, check=True)
        result = json.loads(out.read_text())
    # per iteration the slowest rank; per launch the quickest iteration (see --iterations)
    return {"model_bytes": result["model_bytes"],
            **{f"{op}_s": min(max(r[f"{op}_s"][i] for r in result["ranks"])
                              for i in range(args.iterations)) for op in ("save", "load")}}


def run_tool(args, uri: str, endpoint: str, stats: bool, env, log) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as results:
        subprocess.run([sys.executable, "-m", "dcp_fsdp", "save-and-load",
                        f"model={args.model}", f"model.dtype={args.dtype}", f"nproc={args.nproc}",
                        f"storage.uri={uri}", f"storage.endpoint={endpoint}",
                        f"request_stats={str(stats).lower()}", f"iterations={args.iterations}",
                        f"results_dir={results}"],
                       cwd=REPO, env=env, stdout=log, stderr=log, check=True)
        (record,) = Path(results).glob("*.jsonl")
        lines = [json.loads(line) for line in record.read_text().splitlines()]
    run = lines[0]
    samples = [line for line in lines[1:] if line["record"] == "sample"]
    return {"model_bytes": run["model"]["state_bytes"],
            **{f"{op}_s": min(max(s["duration_s"] for s in samples
                                  if s["op"] == op and s["iteration"] == i)
                              for i in range(1, args.iterations + 1)) for op in ("save", "load")}}


def delete_prefix(client, bucket: str, prefix: str) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys})


def spread(values: list[float]) -> str:
    return f"{min(values):.4f} / {statistics.median(values):.4f} / {max(values):.4f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="L660m")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--alternations", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=1,
                        help="saves/loads per launch; a launch's figure is its quickest "
                             "(interference from other processes only ever adds time)")
    parser.add_argument("--log", default="overhead.log", help="the launches' own output")
    args = parser.parse_args()

    import boto3
    import botocore.config

    from dcp_fsdp.launch.embedded_s3 import EmbeddedS3

    server = EmbeddedS3(bucket="overhead")
    endpoint = server.start()
    env = _env(endpoint.client_env(), args.nproc)
    client = boto3.client("s3", endpoint_url=endpoint.endpoint_url, region_name=endpoint.region,
                          aws_access_key_id=endpoint.access_key_id,
                          aws_secret_access_key=endpoint.secret_access_key,
                          config=botocore.config.Config(s3={"addressing_style": "path"}))
    variants = ["bare", "tool", "tool-nostats"]
    figures: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    try:
        with open(args.log, "w") as log:
            for round_number in range(args.alternations):
                order = variants[round_number % 3:] + variants[:round_number % 3]
                for variant in order:
                    prefix = f"{variant}-{round_number}"
                    uri = f"s3://{endpoint.bucket}/{prefix}"
                    if variant == "bare":
                        figure = run_bare(args, f"{uri}/ckpt", env, log)
                    else:
                        figure = run_tool(args, uri, endpoint.endpoint_url,
                                          variant == "tool", env, log)
                    delete_prefix(client, endpoint.bucket, prefix + "/")
                    figures[variant].append(figure)
                    mib = figure["model_bytes"] / MIB
                    print(f"round {round_number + 1} {variant:<12} save {figure['save_s']:7.3f} s "
                          f"({mib / figure['save_s']:6.1f} MiB/s)  load {figure['load_s']:7.3f} s "
                          f"({mib / figure['load_s']:6.1f} MiB/s)", flush=True)
    finally:
        server.stop()
    model_gib = figures["bare"][0]["model_bytes"] / 2**30
    print(f"\n{args.model} {args.dtype}, {model_gib:.2f} GiB, {args.nproc} ranks, "
          f"{args.alternations} alternations; ratio = tool seconds / bare seconds of the same "
          "round (slowest rank), min / median / max")
    for variant in ("tool", "tool-nostats"):
        for op in ("save", "load"):
            ratios = [t[f"{op}_s"] / b[f"{op}_s"]
                      for t, b in zip(figures[variant], figures["bare"])]
            medians = (statistics.median(t[f"{op}_s"] for t in figures[variant]) /
                       statistics.median(b[f"{op}_s"] for b in figures["bare"]))
            print(f"{variant:<12} {op}: per-round ratio {spread(ratios)}; "
                  f"median seconds ratio {medians:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
