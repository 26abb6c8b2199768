"""The timer against clocks it does not own, on a model of any size (docs/metrics.md, "The
timer against clocks it does not own"; the suite's small versions are
tests/integration/test_outside_clock*.py).

  python -m benchmarks.outside_clock --storage s3 model=L660m model.dtype=bf16 nproc=2 iterations=3
  python -m benchmarks.outside_clock --storage fs model=L660m model.dtype=bf16 nproc=2 iterations=3

s3: an embedded SeaweedFS behind the test kit's proxy (tests/kit/fault_proxy.py, no faults),
which stamps every request on its own wall clock: when its head arrived and when its
response had been relayed. Per operation, the data requests (save: the writes of `.distcp`
objects and `.metadata`; load: the GETs of `.distcp` objects) must lie inside the tool's
[begin_wall_s, end_wall_s] over all ranks.
fs (saves only): the kernel's birth time (statx, `stat %W`) and modification time of every
file the save wrote must lie inside it.

Printed per operation: the timer's span, the outside span (first request or file creation
to the last response or write), `lead ms` (timer begin to the first outside event: planning
and the collectives before the first byte), `slack ms` (the last outside event to the
timer's end: the commit and the closing barrier), and whether the outside events lie inside
the timer (allowing `TOLERANCE_S` of clock granularity). The timer may be longer than the
bytes (DCP's own work is in it) but never shorter.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOLERANCE_S = 0.02  # the kernel's coarse clock stamps file times up to a tick late
SAVE_TYPES = {"PutObject", "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload"}
LOAD_TYPES = {"GetObject", "GetObjectRanged"}


def _run(overrides: list[str], storage: list[str], results: Path, env: dict[str, str]) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "dcp_fsdp", "save-and-load", *storage, *overrides,
         f"results_dir={results}"], cwd=REPO, env=env, stdout=subprocess.DEVNULL)
    if completed.returncode != 0:
        raise SystemExit(f"outside_clock: the run failed (exit {completed.returncode})")


def _operations(results: Path) -> list[tuple[str, int, str, float, float]]:
    """(op, iteration, suffix, begin_wall_s, end_wall_s) of every save and load, all ranks."""
    from dcp_fsdp.telemetry.records import read_record_file

    (record,) = results.glob("*.jsonl")
    found: dict[tuple[str, int, str], list[float]] = {}
    for sample in read_record_file(record).samples:
        if sample.op in ("save", "load"):
            key = (sample.op, sample.iteration, sample.suffix)
            bounds = found.setdefault(key, [sample.begin_wall_s, sample.end_wall_s])
            bounds[0] = min(bounds[0], sample.begin_wall_s)
            bounds[1] = max(bounds[1], sample.end_wall_s)
    return [(*key, begin, end) for key, (begin, end) in sorted(found.items(), key=lambda kv: kv[1][0])]


def _s3_events(timeline, op: str, suffix: str) -> list[tuple[float, float]]:
    types = SAVE_TYPES if op == "save" else LOAD_TYPES
    names = (".distcp", ".metadata") if op == "save" else (".distcp",)
    return [(e.head_s, e.end_s) for e in timeline
            if e.request_type in types and f"/{suffix}/" in e.target
            and e.target.split("?", 1)[0].endswith(names) and e.end_s is not None]


def _fs_events(store: Path, suffix: str) -> list[tuple[float, float]]:
    files = [p for p in (store / suffix).iterdir() if p.suffix == ".distcp" or p.name == ".metadata"]
    stamps = subprocess.run(["stat", "-c", "%.9W %.9Y", *map(str, files)], check=True,
                            capture_output=True, text=True).stdout.split()
    # a file system without birth times reports 0: its mtime then stands for both ends
    return [(float(born) if float(born) > 0 else float(written), float(written))
            for born, written in zip(stamps[::2], stamps[1::2])]


def _rows(operations, events_of) -> list[list[str]]:
    rows = []
    for op, iteration, suffix, begin, end in operations:
        events = events_of(op, suffix)
        if not events:  # nothing seen is no check: a failure, never a silent pass
            rows.append([op, str(iteration), f"{end - begin:.3f}", "", "", "", "0", "NO"])
            continue
        first, last = min(e[0] for e in events), max(e[1] for e in events)
        inside = begin - TOLERANCE_S <= first and last <= end + TOLERANCE_S
        rows.append([op, str(iteration), f"{end - begin:.3f}", f"{last - first:.3f}",
                     f"{(first - begin) * 1e3:.1f}", f"{(end - last) * 1e3:.1f}",
                     str(len(events)), "yes" if inside else "NO"])
    return rows


def main() -> int:
    from tabulate import tabulate

    from benchmarks.harness_cost import load_average

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--storage", choices=("s3", "fs"), default="s3")
    args, overrides = parser.parse_known_args()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_before = load_average()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with tempfile.TemporaryDirectory(prefix="dcp-fsdp-outside-clock-") as tmp:
        results = Path(tmp) / "results"
        if args.storage == "s3":
            rows = _s3(overrides, results, env)
        else:
            store = Path(tmp) / "store"
            _run(overrides, ["storage=fs", f"storage.path={store}"], results, env)
            rows = _rows([o for o in _operations(results) if o[0] == "save"],
                         lambda op, suffix: _fs_events(store, suffix))
    print(f"storage={args.storage} {' '.join(overrides)}; from {started}, load average "
          f"{load_before:.2f} -> {load_average():.2f}")
    print(tabulate(rows, headers=["op", "iter", "timer s", "outside s", "lead ms", "slack ms",
                                  "events", "inside"], tablefmt="github"))
    return 0 if all(row[-1] == "yes" for row in rows) else 1


def _s3(overrides: list[str], results: Path, env: dict[str, str]) -> list[list[str]]:
    from dcp_fsdp.launch.embedded_s3 import EmbeddedS3
    from tests.kit.fault_proxy import FaultProxy

    server = EmbeddedS3(bucket="outside-clock")
    endpoint = server.start()
    try:
        with FaultProxy(endpoint.endpoint_url, targets=()) as proxy:
            proxy.record_timeline()
            _run(overrides, [f"storage.uri=s3://{endpoint.bucket}/ckpt",
                             f"storage.endpoint={proxy.url}"], results,
                 {**env, **endpoint.client_env()})
            timeline = list(proxy.timeline or [])
    finally:
        server.stop()
    return _rows(_operations(results), lambda op, suffix: _s3_events(timeline, op, suffix))


if __name__ == "__main__":
    sys.exit(main())
