"""The report at scale: what `dcp-fsdp report` costs as records grow, from one real record
cloned (the structure of a real run, nothing hand-written):

  python -m benchmarks.report_scale --files 2100            many small records (a long campaign)
  python -m benchmarks.report_scale --ranks 1024 --iterations 10   one record of a big job

A template record is made first by a real `dcp-fsdp save-and-load model=tiny_llama nproc=2
storage=fs` (about 20 s). Printed: the seconds the report took (in a fresh process, as a
user runs it) and that process's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def template(work: Path) -> tuple[dict, list[dict]]:
    result = subprocess.run([sys.executable, "-m", "dcp_fsdp", "save-and-load", "model=tiny_llama",
                             "nproc=2", "storage=fs", f"storage.path={work / 'store'}",
                             f"results_dir={work / 'template'}"], capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"template run failed:\n{result.stderr}")
    path = next((work / "template").glob("*.jsonl"))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return lines[0], lines[1:]


def write(path: Path, run: dict, samples: list[dict]) -> None:
    with open(path, "w") as out:
        out.write(json.dumps(run) + "\n")
        for sample in samples:
            out.write(json.dumps({**sample, "run_id": run["run_id"]}) + "\n")


def many_files(run: dict, samples: list[dict], count: int, into: Path) -> None:
    for number in range(count):
        clone = {**run, "run_id": f"{run['run_id']}-{number:05d}"}
        write(into / f"{clone['run_id']}.jsonl", clone, samples)


def one_big(run: dict, samples: list[dict], ranks: int, iterations: int, into: Path) -> None:
    by_op = {s["op"]: s for s in samples if s["rank"] == 0 and s["iteration"] == 1}
    big = [{**by_op[op], "rank": rank, "iteration": iteration}
           for iteration in range(1, iterations + 1) for op in by_op for rank in range(ranks)]
    write(into / f"{run['run_id']}-big.jsonl", {**run, "world_size": ranks}, big)


def timed_report(directory: Path) -> tuple[float, float]:
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", "import resource, sys\n"
                             "from dcp_fsdp.cli import main\n"
                             "code = main(['report', sys.argv[1]])\n"
                             "print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
                             "sys.exit(code)", str(directory)], capture_output=True, text=True)
    took_s = time.monotonic() - started
    if result.returncode != 0:
        sys.exit(f"report failed:\n{result.stderr[-2000:]}")
    peak_kib = int(result.stderr.rsplit("PEAK", 1)[1].split()[0])
    return took_s, peak_kib / 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report_scale")
    parser.add_argument("--files", type=int, default=0, help="small records to report together")
    parser.add_argument("--ranks", type=int, default=0, help="ranks of one big record")
    parser.add_argument("--iterations", type=int, default=10)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dcp-fsdp-report-scale-") as tmp:
        work = Path(tmp)
        run, samples = template(work)
        records = work / "records"
        records.mkdir()
        if args.files:
            many_files(run, samples, args.files, records)
        if args.ranks:
            one_big(run, samples, args.ranks, args.iterations, records)
        lines = sum(len(p.read_text().splitlines()) for p in records.glob("*.jsonl"))
        took_s, peak_mib = timed_report(records)
        print(f"report of {len(list(records.glob('*.jsonl')))} record file(s), {lines} lines: "
              f"{took_s:.1f} s, peak RSS {peak_mib:.0f} MiB (load average "
              f"{open('/proc/loadavg').read().split()[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
