"""Where a run's record is written: `results_dir`, or, when that fails mid-run, a fallback
directory (a run's measurement is never lost to a path problem). Shared by the launcher's
checks, the ranks that write records and `report` (its output directories)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from dcp_fsdp import log
from dcp_fsdp.telemetry.records import RunRecord, Sample, record_path, write_records


def writable_dir_problem(path: str | Path) -> str | None:
    """Why a directory could not be created or written at `path` (None: it can), by a probe
    file in the nearest existing ancestor (permission bits mislead for root, ACLs, mounts)."""
    target = Path(path).expanduser()
    if target.exists() and not target.is_dir():
        return "it is a file, not a directory"
    ancestor = next((p for p in (target, *target.parents) if p.exists()), Path("."))
    if not ancestor.is_dir():
        return f"{ancestor} is a file, not a directory"
    try:
        handle, probe = tempfile.mkstemp(prefix=".dcp-fsdp-probe-", dir=ancestor)
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        return f"cannot write in {ancestor} ({error.strerror or error})"
    return None


def fallback_results_dir() -> Path:
    return Path(tempfile.gettempdir()) / "dcp-fsdp-results"


def record_written(results_dir: str, run_id: str) -> bool:
    return any(record_path(str(where), run_id).exists()
               for where in (results_dir, fallback_results_dir()))


def write_record(results_dir: str, run: RunRecord, samples: Iterable[Sample]) -> Path:
    """The record under results_dir, else under the fallback directory, said in a warning."""
    try:
        return write_records(record_path(results_dir, run.run_id), run, samples)
    except OSError as error:
        path = write_records(record_path(str(fallback_results_dir()), run.run_id), run, samples)
        log.warning(f"results_dir={results_dir}: cannot write the record "
                    f"({error.strerror or error}); it is at {path} instead")
        return path
