"""The three clients like for like: the connector, torch's fsspec path (s3fs) and MSC, each
with its defaults and with the settings `tune` recommends for it, on the embedded SeaweedFS,
at a per-rank object of at least 1 GiB (L660m bf16 on one rank: 1,262.6 MiB, above MSC's
512 MiB switch to ranged reads).

  1. With --tune-budget-s S, `dcp-fsdp tune storage.client=C storage.read_ahead=0
     tune.budget_s=S` once per client (the client and DCP's own reader held): the best row
     of its table is that client's tuned settings (its search's best; this benchmark's
     paired rounds, not tune's finals, then tell it from the defaults).
  2. Rounds: every variant (client x defaults/tuned) launched once per round as
     `dcp-fsdp save-and-load`, in an order that rotates every round. A launch's figures
     are its last iteration's: the slowest rank's save and load duration_s, the load's
     split (inside the storage client, DCP's own work, the copy into the live tensors),
     peak RSS, requests by type and the bytes fetched.
  3. Per variant: medians, and the paired ratio of its save and load seconds to the
     connector's defaults of the same round (geometric mean, 95 % CI; above 1: slower).

  python -m benchmarks.clients_compare --pairs 4 --tune-budget-s 180
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

from benchmarks.harness_cost import _delete_prefix
from benchmarks.paired import PairedRatio, finally_on_sigterm, load_average, vacuum

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
CLIENTS = ("s3torchconnector", "fsspec", "msc")
BASELINE = "s3torchconnector/defaults"


def launch(command: list[str], env: dict[str, str], log: IO[str]) -> str:
    log.write(f"\n$ dcp-fsdp {' '.join(command)}\n")
    log.flush()
    done = subprocess.run([sys.executable, "-m", "dcp_fsdp", *command], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    log.write(done.stdout)
    if done.returncode != 0:
        raise RuntimeError(f"dcp-fsdp {' '.join(command)} exited {done.returncode} (see the log)")
    return done.stdout


def tuned_settings(args: argparse.Namespace, common: list[str], client: str,
                   env: dict[str, str], log: IO[str]) -> list[str]:
    """The settings `tune` found best for `client` (held; DCP's own reader held too:
    storage.read_ahead=0): the first row of its table, the settings it differs from the
    defaults by ("defaults": none). Its search's best, whether or not its finals could
    tell it from noise within the budget: this benchmark's paired rounds are the finals."""
    with tempfile.TemporaryDirectory() as results:
        output = launch(["tune", *common, f"storage.client={client}", "storage.read_ahead=0",
                         f"tune.budget_s={args.tune_budget_s}", f"results_dir={results}",
                         f"storage.uri=s3://clients-compare/tune-{client}"], env, log)
    rows = re.findall(r"^\|\s+1 \| ([^|]*?)\s*\*?\s*\|", output, flags=re.MULTILINE)
    best = rows[-1].strip() if rows else "defaults"
    return [] if best.startswith("defaults") else [s for s in best.split() if "=" in s]


def figures(records: Path) -> dict[str, float]:
    (record,) = records.glob("*.jsonl")
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    samples = [s for s in lines[1:] if s.get("record") == "sample"]
    last = max(s["iteration"] for s in samples)
    saves = [s for s in samples if s["op"] == "save" and s["iteration"] == last]
    loads = [s for s in samples if s["op"] == "load" and s["iteration"] == last]
    requests: dict[str, int] = {}
    for sample in loads + saves:
        for kind, summary in ((sample.get("requests") or {}).get("by_type") or {}).items():
            requests[kind] = requests.get(kind, 0) + int(summary.get("count") or 0)
    return {"save_s": max(s["duration_s"] for s in saves),
            "load_s": max(s["duration_s"] for s in loads),
            "storage_s": max(s["storage_s"] or 0.0 for s in loads),
            "deserialise_s": max(s["deserialise_s"] or 0.0 for s in loads),
            "target_copy_s": max(s["target_copy_s"] or 0.0 for s in loads),
            "peak_rss_mib": max(s["peak_rss_bytes"] or 0 for s in loads + saves) / MIB,
            "fetched_mib": sum(s["fetched_bytes"] or 0 for s in loads) / MIB,
            "bytes_mib": sum(s["bytes"] for s in loads) / MIB,
            **{f"requests {kind}": float(count) for kind, count in requests.items()}}


def summary(rounds: dict[str, list[dict[str, float]]]) -> list[str]:
    lines = [f"{'variant':<28} {'save s':>7} {'load s':>7} {'save / conn. (95% CI)':>25} "
             f"{'load / conn. (95% CI)':>25} {'in client':>9} {'DCP own':>7} {'copy':>6} "
             f"{'RSS MiB':>8} {'fetched/bytes':>13}"]
    base = rounds[BASELINE]
    for name, values in rounds.items():
        def median(key: str, values: list[dict[str, float]] = values) -> float:
            return statistics.median(v.get(key, 0.0) for v in values)

        cells = []
        for op in ("save_s", "load_s"):
            paired = PairedRatio.of([v[op] for v in values], [b[op] for b in base])
            cells.append(f"{paired.mean:.2f} ({paired.low:.2f}-{paired.high:.2f})")
        lines.append(f"{name:<28} {median('save_s'):>7.2f} {median('load_s'):>7.2f} "
                     f"{cells[0]:>25} {cells[1]:>25} {median('storage_s'):>9.2f} "
                     f"{median('deserialise_s'):>7.2f} {median('target_copy_s'):>6.2f} "
                     f"{max(v['peak_rss_mib'] for v in values):>8.0f} "
                     f"{median('fetched_mib') / median('bytes_mib'):>13.3f}")
        kinds = sorted(k for k in values[-1] if k.startswith("requests "))
        lines.append(f"{'':<28} " + ", ".join(f"{k[9:]} {values[-1][k]:.0f}" for k in kinds))
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="L660m")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=2, help="per launch; the last counts")
    parser.add_argument("--pairs", type=int, default=4, help="rounds (each variant once)")
    parser.add_argument("--tune-budget-s", type=int, default=0,
                        help="tune each client first with this budget (0: defaults only)")
    parser.add_argument("--tuned", default="",
                        help="CLIENT=SETTING,...;CLIENT=... (settings found by an earlier tune "
                        "phase: no tune here)")
    parser.add_argument("--log", default="clients_compare.log", help="the launches' own output")
    parser.add_argument("--json", default=None, help="write every launch's figures here")
    args = parser.parse_args()
    finally_on_sigterm()

    from dcp_fsdp.launch.embedded_s3 import EmbeddedS3

    server = EmbeddedS3(bucket="clients-compare")
    endpoint = server.start()
    env = {**os.environ, **endpoint.client_env(), "PYTHONPATH": str(REPO)}
    import boto3
    import botocore.config

    s3 = boto3.client(
        "s3", endpoint_url=endpoint.endpoint_url, region_name=endpoint.region,
        aws_access_key_id=endpoint.access_key_id, aws_secret_access_key=endpoint.secret_access_key,
        config=botocore.config.Config(s3={"addressing_style": "path"}))
    common = [f"model={args.model}", f"model.dtype={args.dtype}", f"nproc={args.nproc}",
              f"storage.endpoint={endpoint.endpoint_url}", "progress=false"]
    uri = f"storage.uri=s3://{endpoint.bucket}/compare"
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    try:
        with open(args.log, "w") as log:
            variants = {f"{c}/defaults": [f"storage.client={c}"] for c in CLIENTS}
            for part in filter(None, args.tuned.split(";")):
                client, _, settings_text = part.partition("=")
                variants[f"{client}/tuned"] = [f"storage.client={client}",
                                               *settings_text.split(",")]
            if args.tune_budget_s:
                for client in CLIENTS:
                    settings = tuned_settings(args, common, client, env, log)
                    _delete_prefix(s3, endpoint.bucket, f"tune-{client}/")
                    print(f"tuned {client}: {' '.join(settings) or '(its defaults)'}", flush=True)
                    if settings:
                        variants[f"{client}/tuned"] = [f"storage.client={client}", *settings]
            names = list(variants)
            rounds: dict[str, list[dict[str, float]]] = {n: [] for n in names}
            for number in range(args.pairs):
                order = names[number % len(names):] + names[:number % len(names)]
                before = load_average()
                for name in order:
                    with tempfile.TemporaryDirectory() as results:
                        launch(["save-and-load", *common, uri, *variants[name],
                                f"iterations={args.iterations}", f"results_dir={results}"], env, log)
                        rounds[name].append(figures(Path(results)))
                    _delete_prefix(s3, endpoint.bucket, "compare/")
                    vacuum(server)
                print(f"round {number + 1}/{args.pairs}: load average {before:.2f} -> "
                      f"{load_average():.2f}", flush=True)
    finally:
        server.stop()
    print(f"{args.model} {args.dtype}, {args.nproc} rank(s), embedded SeaweedFS, {started}; "
          f"settings: " + "; ".join(f"{n}: {' '.join(v)}" for n, v in variants.items()))
    print("\n".join(summary(rounds)))
    if args.json:
        Path(args.json).write_text(json.dumps({"variants": variants, "rounds": rounds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
