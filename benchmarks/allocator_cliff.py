"""The part-size cliff and what the allocator costs: a load of the same checkpoint with
8 and 64 MiB parts, under glibc's defaults and with malloc=raised, on the embedded SeaweedFS.

One checkpoint is saved once; every round launches `dcp-fsdp load` of it once per variant
(part size x malloc, and any environment a variant adds), in an order that rotates every
round (with --save-and-load, `dcp-fsdp save-and-load` per variant instead). A launch's
figure is its last load's slowest rank's duration_s, its split (inside the storage client,
DCP's own work) and its fresh pages per byte, from its record. Per variant: the paired
ratio to the baseline variant (the first of --variants) of each round, their geometric
mean with its 95 % CI (benchmarks/paired.py). The 1-minute load average is printed beside
every round.

  python -m benchmarks.allocator_cliff --pairs 5            # L660m bf16, 1 rank
  python -m benchmarks.allocator_cliff --pairs 8 --variants 64MiB-default,64MiB-raised,64MiB-raised-arena1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

from benchmarks.harness_cost import _delete_prefix
from benchmarks.paired import PairedRatio, finally_on_sigterm, load_average

REPO = Path(__file__).resolve().parents[1]
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
VARIANTS = {"8MiB-default": (8, "default"), "64MiB-default": (64, "default"),
            "64MiB-raised": (64, "raised"), "8MiB-raised": (8, "raised"),
            "64MiB-raised-arena1": (64, "raised")}
# variables a variant adds to its launch's environment (the ranks inherit them)
VARIANT_ENVIRONMENT = {"64MiB-raised-arena1": {"MALLOC_ARENA_MAX": "1"}}


def run_tool(args: argparse.Namespace, endpoint: str, uri: str, variant: str,
             env: dict[str, str], log: IO[str], suffix: str | None = None) -> dict[str, float]:
    """One launch of a variant: a load of `suffix`, else a save-and-load."""
    part_mib, malloc = VARIANTS[variant]
    command = ["load", f"suffix={suffix}"] if suffix else ["save-and-load"]
    with tempfile.TemporaryDirectory() as results:
        subprocess.run([sys.executable, "-m", "dcp_fsdp", *command,
                        f"model={args.model}", f"model.dtype={args.dtype}", f"nproc={args.nproc}",
                        f"storage.uri={uri}", f"storage.endpoint={endpoint}",
                        f"storage.part_size_mib={part_mib}", f"malloc={malloc}",
                        f"iterations={args.iterations}", f"results_dir={results}",
                        "progress=false"],
                       cwd=REPO, env={**env, **VARIANT_ENVIRONMENT.get(variant, {})},
                       stdout=log, stderr=log, check=True)
        (record,) = Path(results).glob("*.jsonl")
        lines = [json.loads(line) for line in record.read_text().splitlines()]
    loads = [s for s in lines[1:] if s["record"] == "sample" and s["op"] == "load"]
    last = [s for s in loads if s["iteration"] == max(x["iteration"] for x in loads)]  # warm
    return {"load_s": max(s["duration_s"] for s in last),
            "storage_s": max(s["storage_s"] for s in last),
            "dcp_s": max(s["deserialise_s"] for s in last),
            "pages_per_byte": sum(s["minor_faults"] for s in last) * PAGE_BYTES
            / sum(s["bytes"] for s in last)}


def save_once(args: argparse.Namespace, endpoint: str, uri: str, env: dict[str, str],
              log: IO[str]) -> str:
    """The checkpoint every load launch reads: its suffix."""
    with tempfile.TemporaryDirectory() as results:
        subprocess.run([sys.executable, "-m", "dcp_fsdp", "save", f"model={args.model}",
                        f"model.dtype={args.dtype}", f"nproc={args.nproc}", f"storage.uri={uri}",
                        f"storage.endpoint={endpoint}", f"results_dir={results}", "progress=false"],
                       cwd=REPO, env=env, stdout=log, stderr=log, check=True)
        (record,) = Path(results).glob("*.jsonl")
        (suffix,) = json.loads(record.read_text().splitlines()[0])["suffixes"]
    return str(suffix)


def summarise(figures: dict[str, list[dict[str, float]]], baseline: str) -> list[str]:
    lines = [f"{'variant':<20} {'load s (med)':>12} {'geo-mean / ' + baseline:>23} "
             f"{'95 % CI':>17} {'in client s':>14} {'DCP own s':>9} {'pages/B':>7}"]
    base = [f["load_s"] for f in figures[baseline]]
    for variant, rounds in figures.items():
        seconds = [f["load_s"] for f in rounds]
        paired = PairedRatio.of(seconds, base)
        median = sorted(seconds)[len(seconds) // 2]
        waits = sorted(f["storage_s"] for f in rounds)[len(rounds) // 2]
        dcp = sorted(f["dcp_s"] for f in rounds)[len(rounds) // 2]
        pages = sorted(f["pages_per_byte"] for f in rounds)[len(rounds) // 2]
        lines.append(f"{variant:<20} {median:>12.3f} {paired.cells(23)} {waits:>14.3f} "
                     f"{dcp:>9.3f} {pages:>7.2f}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="L660m")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=2, help="per launch; the last load counts")
    parser.add_argument("--save-and-load", action="store_true",
                        help="each launch saves its own checkpoint too (else one saved once)")
    parser.add_argument("--pairs", type=int, default=5, help="rounds (each variant once)")
    parser.add_argument("--log", default="allocator_cliff.log", help="the launches' own output")
    parser.add_argument("--json", default=None, help="write every launch's figures here")
    parser.add_argument("--variants", default=",".join(list(VARIANTS)[:4]),
                        help=f"comma-separated, of {', '.join(VARIANTS)}; the first is the baseline")
    args = parser.parse_args()
    finally_on_sigterm()

    from dcp_fsdp.launch.embedded_s3 import EmbeddedS3

    import boto3
    import botocore.config

    server = EmbeddedS3(bucket="allocator-cliff")
    endpoint = server.start()
    client = boto3.client(
        "s3", endpoint_url=endpoint.endpoint_url, region_name=endpoint.region,
        aws_access_key_id=endpoint.access_key_id, aws_secret_access_key=endpoint.secret_access_key,
        config=botocore.config.Config(s3={"addressing_style": "path"}))
    env = {**os.environ, **endpoint.client_env(), "PYTHONPATH": str(REPO)}
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "RANK", "WORLD_SIZE"):
        env.pop(name, None)
    names = args.variants.split(",")
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; use {', '.join(VARIANTS)}")
    figures: dict[str, list[dict[str, float]]] = {v: [] for v in names}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    try:
        with open(args.log, "w") as log:
            saved_uri = f"s3://{endpoint.bucket}/saved"
            suffix = None if args.save_and_load else save_once(args, endpoint.endpoint_url,
                                                               saved_uri, env, log)
            for round_number in range(args.pairs):
                shift = round_number % len(names)
                order = names[shift:] + names[:shift]
                load_before = load_average()
                for variant in order:
                    if suffix:
                        figures[variant].append(run_tool(args, endpoint.endpoint_url, saved_uri,
                                                         variant, env, log, suffix))
                        continue
                    uri = f"s3://{endpoint.bucket}/{variant}-{round_number}"
                    figures[variant].append(run_tool(args, endpoint.endpoint_url, uri, variant,
                                                     env, log))
                    _delete_prefix(client, endpoint.bucket, f"{variant}-{round_number}/")
                print(f"round {round_number + 1}/{args.pairs}: load average "
                      f"{load_before:.2f} -> {load_average():.2f}", flush=True)
    finally:
        server.stop()
    print(f"{args.model} {args.dtype}, {args.nproc} rank(s), embedded SeaweedFS, {started}")
    print("\n".join(summarise(figures, names[0])))
    if args.json:
        Path(args.json).write_text(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
