"""What S3 faults cost a checkpoint: save-and-load through the fault-injecting proxy.

Starts SeaweedFS on 127.0.0.1 (the embedded server), puts tests.kit.fault_proxy in
front of it, and runs `dcp-fsdp save-and-load` (2 ranks, tiny_llama, 10
iterations by default) once per scenario:

  direct    no proxy (what the proxy itself costs)
  clean     through the proxy, no faults (the baseline)
  faults    through the proxy, --error-rate 503 SlowDown + --reset-rate connection
            resets on the data plane (UploadPart, ranged GET)

and prints, per scenario and op, the overall MiB/s (all bytes over the sum of the
iterations' spans: a fault slows one iteration, which a median would hide), the
slowdown against the clean baseline, the median aggregate MiB/s, the slowest span,
the faults the proxy injected per kind and request type, and what the connector's
own request log recorded (throttled attempts, retries), when the records carry it. Every
run must succeed: a fault the run did not absorb fails the benchmark.

    .venv/bin/python -m benchmarks.fault_tolerance                  # defaults below
    .venv/bin/python -m benchmarks.fault_tolerance --iterations 5 --error-rate 0.2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dcp_fsdp.telemetry.figures import pooled
from dcp_fsdp.analysis.metrics import per_operation, samples_frame
from dcp_fsdp.launch.embedded_s3 import EmbeddedS3
from tests.kit.fault_proxy import DATA_PLANE, FaultProxy

REPO = Path(__file__).resolve().parent.parent

SCRUBBED = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_DEFAULT_REGION")


def run_save_and_load(endpoint: str, server, uri: str, results_dir: Path, args) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED}
    env.update(AWS_ACCESS_KEY_ID=server.access_key_id,
               AWS_SECRET_ACCESS_KEY=server.secret_access_key, PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", "dcp_fsdp", "save-and-load", f"model={args.model}",
               f"nproc={args.nproc}", f"iterations={args.iterations}", f"storage.uri={uri}",
               f"storage.endpoint={endpoint}", f"storage.max_attempts={args.max_attempts}",
               f"results_dir={results_dir}", *args.overrides]
    started = time.monotonic()
    result = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True,
                            timeout=args.timeout_s, stdin=subprocess.DEVNULL)
    elapsed = time.monotonic() - started
    if result.returncode != 0:
        raise SystemExit(f"fault_tolerance: save-and-load through {endpoint} failed "
                         f"(exit {result.returncode}):\n{result.stderr[-3000:]}")
    (path,) = sorted(results_dir.glob("*.jsonl"))
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    run, samples = lines[0], lines[1:]
    ops = per_operation(samples_frame({"run_id": run["run_id"], **s} for s in samples))
    figures = {}
    for op in ("save", "load"):
        rows = ops[ops["op"] == op]
        figures[op] = {
            "aggregate_mib_s": [round(v, 1) for v in rows["aggregate_mib_s"]],
            "median_mib_s": round(statistics.median(rows["aggregate_mib_s"]), 1),
            # pooled, the report's figure: a fault slows one iteration, which a median hides
            "overall_mib_s": round(pooled(rows)["aggregate_mib_s"], 1),
            "total_span_s": round(rows["span_s"].sum(), 3),
            "max_span_s": round(rows["span_s"].max(), 3),
        }
        windows = [s["requests"] for s in samples if s["op"] == op and s.get("requests")]
        if windows:
            figures[op]["connector"] = {key: sum(w.get(key, 0) for w in windows)
                                        for key in ("count", "failed", "throttled", "retries")}
    return {"status": run["status"], "wall_s": round(elapsed, 1), "record": str(path),
            "ops": figures}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny_llama")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--error-rate", type=float, default=0.10, help="503 SlowDown fraction")
    parser.add_argument("--reset-rate", type=float, default=0.02, help="connection reset fraction")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-attempts", type=int, default=10, help="storage.max_attempts")
    parser.add_argument("--no-direct", action="store_true", help="skip the run without proxy")
    parser.add_argument("--timeout-s", type=float, default=600, help="per run")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("overrides", nargs="*", help="more dcp-fsdp settings (key=value)")
    args = parser.parse_args()

    report: dict = {"settings": {k: (str(v) if isinstance(v, Path) else v)
                                 for k, v in vars(args).items()}, "scenarios": {}}
    with tempfile.TemporaryDirectory(prefix="dcp-fsdp-faults-") as tmp, \
            EmbeddedS3(bucket="bench") as server:
        # (name, the fault proxy's settings; None: no proxy)
        scenarios: list[tuple[str, dict | None]] = [] if args.no_direct else [("direct", None)]
        scenarios += [("clean", {}), ("faults", {"error_503_rate": args.error_rate,
                                                  "reset_rate": args.reset_rate})]
        for name, faults in scenarios:
            uri = f"s3://bench/{name}"
            results = Path(tmp) / name
            print(f"[fault_tolerance] {name}: save-and-load {args.model} x{args.iterations}, "
                  f"{args.nproc} ranks" + (f", faults {faults}" if faults else ""), flush=True)
            if faults is None:
                entry = run_save_and_load(server.endpoint_url, server, uri, results, args)
            else:
                with FaultProxy(server.endpoint_url, seed=args.seed, targets=DATA_PLANE,
                                **faults) as proxy:
                    entry = run_save_and_load(proxy.url, server, uri, results, args)
                entry["injected"] = proxy.injected()
                entry["injected_by_type"] = {k: v for k, v in proxy.counts.items()
                                             if k in ("503", "reset") and v}
                entry["requests_seen"] = proxy.counts["requests"]
            report["scenarios"][name] = entry

    clean = report["scenarios"]["clean"]["ops"]
    print()
    print(f"{'scenario':<8} {'op':<5} {'overall MiB/s':>13} {'vs clean':>8} "
          f"{'median MiB/s':>12} {'max span s':>10} {'connector throttled/retries':>28}")
    for name, entry in report["scenarios"].items():
        for op, fig in entry["ops"].items():
            ratio = fig["overall_mib_s"] / clean[op]["overall_mib_s"]
            conn = fig.get("connector")
            conn_text = f"{conn['throttled']}/{conn['retries']}" if conn else "n/a"
            print(f"{name:<8} {op:<5} {fig['overall_mib_s']:>13.1f} {ratio:>7.2f}x "
                  f"{fig['median_mib_s']:>12.1f} {fig['max_span_s']:>10.3f} {conn_text:>28}")
    faults = report["scenarios"]["faults"]
    print(f"\nabsorbed by the faults run (all {args.iterations} iterations succeeded, verified "
          f"bit-exact): {faults['injected']['503']} x 503 SlowDown, "
          f"{faults['injected']['reset']} x connection reset")
    for kind, by_type in faults["injected_by_type"].items():
        print(f"  {kind}: " + ", ".join(f"{t} {n}" for t, n in sorted(by_type.items())))
    seen = faults["requests_seen"]
    print("  data-plane requests the proxy saw: "
          + ", ".join(f"{t} {seen.get(t, 0)}" for t in DATA_PLANE))
    for op in ("save", "load"):
        slowdown = clean[op]["overall_mib_s"] / faults["ops"][op]["overall_mib_s"]
        print(f"  {op}: {slowdown:.2f}x the time of clean (overall MiB/s, all bytes over all "
              f"spans: {clean[op]['overall_mib_s']} -> {faults['ops'][op]['overall_mib_s']})")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"figures: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
