"""What a measured run says about per-rank throughput: the rate `plan` projects with.

A record (`record=PATH`: one `.jsonl` or a results directory of them) holds one sample per
rank per operation. A rank's rate is its bytes over its duration_s (the same clock as every
figure: docs/metrics.md); the rate used is the median over the record's save (load) samples
of finished runs, so one slow rank or iteration does not set it.
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

from dcp_fsdp.errors import UserError
from dcp_fsdp.telemetry.records import read_record_file


@dataclasses.dataclass(frozen=True)
class MeasuredRates:
    source: str  # the record files read
    save_bytes_s: float | None  # median per-rank save rate, None when no save was measured
    load_bytes_s: float | None
    samples: int
    world_sizes: tuple[int, ...]
    storage: tuple[str, ...]  # the storage kinds the record measured


def record_files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(path.glob("*.jsonl"))
    return [path] if path.exists() else []


def read_rates(path: Path) -> MeasuredRates:
    """UserError (one line) when the record holds no finished save or load."""
    files = record_files(path)
    if not files:
        raise UserError(f"record={path}: no record (.jsonl) there; give a run's record file or "
                        "its results directory (results_dir of a save or save-and-load)")
    rates: dict[str, list[float]] = {"save": [], "load": []}
    worlds, kinds = set(), set()
    for file in files:
        parsed = read_record_file(file)
        finished = {run.run_id: run for run in parsed.runs if run.status == "ok"}
        for sample in parsed.samples:
            run = finished.get(sample.run_id or "")
            if run is None or sample.op not in rates or not sample.duration_s or not sample.bytes:
                continue
            rates[str(sample.op)].append(sample.bytes / sample.duration_s)
            worlds.add(int(run.world_size or 0))
            kinds.add(str((run.storage or {}).get("kind", "?")))
    if not rates["save"] and not rates["load"]:
        raise UserError(f"record={path}: no finished save or load samples in "
                        f"{len(files)} record file(s); give the record of a run that succeeded")
    return MeasuredRates(
        ", ".join(str(f) for f in files[:3]) + (f" (+{len(files) - 3})" if len(files) > 3 else ""),
        statistics.median(rates["save"]) if rates["save"] else None,
        statistics.median(rates["load"]) if rates["load"] else None,
        len(rates["save"]) + len(rates["load"]), tuple(sorted(worlds)), tuple(sorted(kinds)))
