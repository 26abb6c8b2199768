"""What the connector's per-request DEBUG log (request_stats=true) costs, at the highest
request rate and throughput reachable here: the connector's own CRT client against the
embedded SeaweedFS, log on vs off, in paired rounds.

The connector configures its logger once, when its native module is first imported, so a
variant is a fresh process: `on` sets S3_TORCH_CONNECTOR_DEBUG_LOGS="debug,awscrt=off" and a
log directory of its own (exactly what telemetry/request_log.py sets for a rank), `off`
sets neither. Each process builds its client (untimed), then times, with --threads
threads, two workloads on objects of its own:

  large   PUT then GET of --large-mib MiB in 32 MiB objects (8 MiB parts: the throughput
          ceiling of the client; one log line per part)
  small   PUT then GET of --small-count 16 KiB objects (one multipart upload each: three
          log lines per PUT; the request rate where a per-line cost shows most)

Every round runs `on` and `off` once, in an order that alternates round by round. Per
workload and direction: the paired ratio on / off of each round, their geometric mean
with a 95 % confidence interval (t on the log-ratios), the requests the `on` process
logged, the `off` process's request rate, the same ratio of the process's CPU seconds (all
its threads: the log lines are formatted and written on the CRT's threads) and the median
extra CPU time per logged request. 1.00 = no cost. On a shared machine the CPU figures are
the steadier ones: wall time moves with whatever else runs. The 1-minute load average is printed per round: on a
shared machine a round under another load is noise, not logging.

  python -m benchmarks.request_log_cost --rounds 10            (~4 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from dcp_fsdp.units import MIB

REPO = Path(__file__).resolve().parents[1]
LARGE_OBJECT_BYTES = 32 * MIB
SMALL_OBJECT_BYTES = 16 * 1024
PART_BYTES = 8 * MIB


def _timed(threads: int, work, items) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the whole process: every thread, the CRT's included)."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, items))
    return time.perf_counter() - t0, time.process_time() - cpu0


def worker(args) -> None:
    """One variant's process (started by main): figures as JSON on stdout."""
    from s3torchconnector import S3ClientConfig

    from dcp_fsdp.compat import object_chunks, s3_client

    client = s3_client(os.environ["AWS_REGION"], S3ClientConfig(part_size=PART_BYTES))
    bucket, prefix = args.bucket, f"{args.prefix}/{os.getpid()}"
    payload = memoryview(os.urandom(LARGE_OBJECT_BYTES))

    def put(item: tuple[str, int]) -> None:
        writer = client.put_object(bucket, item[0])
        view = payload[:item[1]]
        for start in range(0, len(view), PART_BYTES):
            writer.write(view[start:start + PART_BYTES])
        writer.close()

    def get(item: tuple[str, int]) -> None:
        received = sum(len(chunk) for chunk in object_chunks(client, bucket, item[0]))
        assert received == item[1], (item, received)

    put((f"{prefix}/warm", SMALL_OBJECT_BYTES))  # first request: connection set-up
    large = [(f"{prefix}/large/{i}", LARGE_OBJECT_BYTES)
             for i in range(max(1, args.large_mib * MIB // LARGE_OBJECT_BYTES))]
    small = [(f"{prefix}/small/{i}", SMALL_OBJECT_BYTES) for i in range(args.small_count)]
    figures: dict[str, float] = {}
    for name, items in (("large", large), ("small", small)):
        for direction, work in (("put", put), ("get", get)):
            lines_before = _logged_lines()
            wall_s, cpu_s = _timed(args.threads, work, items)
            figures[f"{name} {direction}_s"], figures[f"{name} {direction} cpu_s"] = wall_s, cpu_s
            figures[f"{name} {direction} requests"] = _logged_lines() - lines_before
    figures["large_bytes"] = sum(size for _, size in large)
    print(json.dumps(figures))


def _logged_lines() -> int:
    """Request lines the connector has logged so far (0 with the log off)."""
    directory = os.environ.get("S3_TORCH_CONNECTOR_LOGS_DIR_PATH")
    if not directory:
        return 0
    return sum(p.read_bytes().count(b" S3 request ") for p in Path(directory).iterdir()
               if p.is_file())


def run_variant(args, variant: str, env: dict[str, str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="dcp-fsdp-reqlog-cost-") as logs:
        extra = ({"S3_TORCH_CONNECTOR_DEBUG_LOGS": "debug,awscrt=off",
                  "S3_TORCH_CONNECTOR_LOGS_DIR_PATH": logs} if variant == "on" else {})
        done = subprocess.run([sys.executable, "-m", "benchmarks.request_log_cost", "--worker",
                               "--bucket", args.bucket, "--prefix", variant,
                               "--threads", str(args.threads), "--large-mib", str(args.large_mib),
                               "--small-count", str(args.small_count)],
                              cwd=REPO, env={**env, **extra}, check=True, capture_output=True,
                              text=True)
        return json.loads(done.stdout.strip().splitlines()[-1])


WORKLOADS = ("large put", "large get", "small put", "small get")


def summarise(rounds: list[dict[str, dict[str, float]]]) -> list[str]:
    """Per workload: requests (the `on` process's logged lines), the paired on/off ratio,
    the `off` median rate, and the median extra time per logged request."""
    import statistics

    from benchmarks.paired import PairedRatio

    lines = [f"{'workload':<10} {'n':>2} {'requests':>8} {'off req/s':>9} {'off MiB/s':>9} "
             f"{'wall on/off':>11} {'95 % CI':>17} {'CPU on/off':>10} {'95 % CI':>17} "
             f"{'+CPU/request':>12}"]
    for name in WORKLOADS:
        key = f"{name}_s"
        wall = PairedRatio.of([r["on"][key] for r in rounds], [r["off"][key] for r in rounds])
        requests = statistics.median(r["on"][f"{name} requests"] for r in rounds)
        off_s = statistics.median(r["off"][key] for r in rounds)
        mib_s = (f"{rounds[0]['off']['large_bytes'] / MIB / off_s:9.1f}"
                 if name.startswith("large") else f"{'':>9}")
        cpu = f"{name} cpu_s"
        cpu_ratio = PairedRatio.of([r["on"][cpu] for r in rounds], [r["off"][cpu] for r in rounds])
        extra_us = statistics.median((r["on"][cpu] - r["off"][cpu]) / max(1, requests) * 1e6
                                     for r in rounds)
        lines.append(f"{name:<10} {len(wall.ratios):>2} {requests:>8.0f} {requests / off_s:>9.0f} "
                     f"{mib_s} {wall.cells(11)} {cpu_ratio.cells(10)} {extra_us:>9.1f} us")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--large-mib", type=int, default=256)
    parser.add_argument("--small-count", type=int, default=300)
    parser.add_argument("--json", help="write every round's figures here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bucket", default="reqlog-cost", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", default="x", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    from benchmarks.paired import load_average
    from dcp_fsdp.launch.embedded_s3 import EmbeddedS3

    server = EmbeddedS3(bucket=args.bucket)
    endpoint = server.start()
    env = {**os.environ, **endpoint.client_env(), "PYTHONPATH": str(REPO)}
    for name in ("S3_TORCH_CONNECTOR_DEBUG_LOGS", "S3_TORCH_CONNECTOR_LOGS_DIR_PATH"):
        env.pop(name, None)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rounds: list[dict[str, dict[str, float]]] = []
    try:
        for index in range(args.rounds):
            order = ("on", "off") if index % 2 == 0 else ("off", "on")
            load = load_average()
            rounds.append({variant: run_variant(args, variant, env) for variant in order})
            print(f"round {index + 1}: load {load:.2f}  " + "  ".join(
                f"{v} " + " ".join(f"{rounds[-1][v][f'{k}_s']:.3f}" for k in WORKLOADS)
                for v in ("on", "off")), flush=True)
    finally:
        server.stop()
    print(f"{args.rounds} rounds from {started}, {args.threads} threads, "
          f"{args.large_mib} MiB large, {args.small_count} small objects; "
          f"load average now {load_average():.2f}")
    print("\n".join(summarise(rounds)))
    if args.json:
        Path(args.json).write_text(json.dumps(rounds, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
