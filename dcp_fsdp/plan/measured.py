"""The per-rank rate `plan` projects with: the median of bytes / duration_s over a record's
save (load) samples of finished runs, so one slow rank or iteration does not set it."""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

from dcp_fsdp.errors import UserError
from dcp_fsdp.telemetry.records import ModelInfo, StorageInfo, read_record_file


@dataclasses.dataclass(frozen=True)
class MeasuredRates:
    source: str  # the record files read
    save_bytes_s: float | None  # median per-rank save rate, None when no save was measured
    load_bytes_s: float | None
    samples: int
    world_sizes: tuple[int, ...]
    storage: tuple[str, ...]  # the storage kinds the record measured
    models: tuple[str, ...] = ()  # the models the record's runs saved or loaded


def read_rates(path: Path) -> MeasuredRates:
    """UserError (one line) when the record holds no finished save or load."""
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    if not path.exists() or not files:
        raise UserError(f"--record={path}: no record (.jsonl) there; give a run's record file or "
                        "its results directory (results_dir of a save or save-and-load)")
    rates: dict[str, list[float]] = {"save": [], "load": []}
    measured: set[tuple[str, int, str, str]] = set()  # (model, world size, storage, client)
    for file in files:
        parsed = read_record_file(file)
        finished = {run.run_id: run for run in parsed.runs if run.status == "ok"}
        for sample in parsed.samples:
            run = finished.get(sample.run_id or "")
            if run is None or sample.op not in rates or not sample.duration_s or not sample.bytes:
                continue
            rates[str(sample.op)].append(sample.bytes / sample.duration_s)
            storage, model = run.storage or StorageInfo(), run.model or ModelInfo()
            name = f"config:{model.config}" if model.config else model.preset or "?"
            measured.add((str(name), int(run.world_size or 0), str(storage.kind or "?"),
                          str(storage.client or "")))
    if not rates["save"] and not rates["load"]:
        raise UserError(f"--record={path}: no finished save or load samples in "
                        f"{len(files)} record file(s); give the record of a run that succeeded")
    _one_configuration(path, measured)
    return MeasuredRates(
        ", ".join(str(f) for f in files[:3]) + (f" (+{len(files) - 3})" if len(files) > 3 else ""),
        statistics.median(rates["save"]) if rates["save"] else None,
        statistics.median(rates["load"]) if rates["load"] else None,
        len(rates["save"]) + len(rates["load"]), tuple(sorted({m[1] for m in measured})),
        tuple(sorted({m[2] for m in measured})), tuple(sorted({m[0] for m in measured})))


def _one_configuration(path: Path, measured: set[tuple[str, int, str, str]]) -> None:
    """A per-rank rate is one configuration's (model, world size, storage, client): a record
    of several is refused, naming them."""
    if len(measured) <= 1:
        return
    shown = sorted(measured)
    said = "; ".join(f"model={model} on {world} ranks, storage={kind}"
                     + (f" storage.client={client}" if client else "")
                     for model, world, kind, client in shown[:4])
    more = f"; and {len(shown) - 4} more" if len(shown) > 4 else ""
    raise UserError(f"--record={path}: holds finished runs of {len(shown)} configurations "
                    f"({said}{more}); a per-rank rate is one configuration's: give the record "
                    "(.jsonl) of one of them")
