"""Finding record files and reading them (through the typed reader in telemetry.records)."""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Any, Iterable

from dcp_fsdp.analysis.intake import Intake
from dcp_fsdp.telemetry.records import read_record_file

RECORD_SUFFIX = ".jsonl"  # what a run writes (telemetry.records.record_path)


def _records_under(directory: Path) -> list[Path]:
    return sorted(directory.rglob(f"*{RECORD_SUFFIX}"))


def record_files(paths: Iterable[str]) -> list[Path]:
    """Record files named by files, directories (searched recursively) or globs: a directory
    or a glob yields its *.jsonl files; a file named on its own is read whatever its name."""
    found: dict[Path, None] = {}  # each file once, in order; a dict: thousands of records
    for text in paths:
        path = Path(text)
        if any(ch in text for ch in "*?["):
            for match in (Path(m) for m in sorted(glob.glob(text, recursive=True))):
                if match.is_dir():
                    found.update(dict.fromkeys(_records_under(match)))
                elif match.suffix == RECORD_SUFFIX:
                    found[match] = None
        elif path.is_dir():
            found.update(dict.fromkeys(_records_under(path)))
        elif path.is_file():
            found[path] = None
        else:
            raise FileNotFoundError(f"{text}: no such file or directory")
    return list(found)


def read_records(files: Iterable[Path]
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    """(runs, samples, notes) as plain rows for the tables: each run_id once, lines and files
    that cannot be read skipped, one note per reason (analysis.intake)."""
    intake = Intake()
    for path in files:
        try:
            intake.add(read_record_file(path))
        except OSError as error:  # unreadable (permissions, a directory named *.jsonl)
            intake.add_unreadable(path, error.strerror or type(error).__name__)
    return intake.runs(), intake.samples(), intake.notes()
