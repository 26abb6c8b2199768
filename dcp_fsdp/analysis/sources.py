"""Finding record files and reading them (through the typed reader in telemetry.records)."""

from __future__ import annotations

import dataclasses
import glob
from pathlib import Path
from typing import Iterable

from dcp_fsdp.telemetry.records import read_record_file


def record_files(paths: Iterable[str]) -> list[Path]:
    """Record files named by files, directories (searched recursively) or globs."""
    found: list[Path] = []
    for text in paths:
        path = Path(text)
        if any(ch in text for ch in "*?["):
            matches = [Path(m) for m in sorted(glob.glob(text, recursive=True))]
            for match in matches:
                found.extend(sorted(match.rglob("*.jsonl")) if match.is_dir() else [match])
        elif path.is_dir():
            found.extend(sorted(path.rglob("*.jsonl")))
        elif path.is_file():
            found.append(path)
        else:
            raise FileNotFoundError(f"{text}: no such file or directory")
    unique = []
    for path in found:
        if path not in unique and path.suffix == ".jsonl":
            unique.append(path)
    return unique


def read_records(files: Iterable[Path]) -> tuple[list[dict], list[dict], list[str]]:
    """(runs, samples, warnings) as plain rows for the tables. Bad lines and files without
    a run line are skipped, and said so; each run row carries `unreadable_lines`, its file's
    count, so that a cut-off record is left out of the figures (analysis.completeness)."""
    runs: list[dict] = []
    samples: list[dict] = []
    warnings: list[str] = []
    for path in files:
        parsed = read_record_file(path)
        if parsed.bad_lines:
            warnings.append(f"{path}: {parsed.bad_lines} unreadable line(s) skipped")
        if not parsed.runs:
            warnings.append(f"{path}: no run line; not a dcp-fsdp record, skipped")
            continue
        runs.extend({**run.to_json(), "record_file": str(path),
                     "unreadable_lines": parsed.bad_lines} for run in parsed.runs)
        samples.extend({"record": "sample", **dataclasses.asdict(sample)}
                       for sample in parsed.samples)
    return runs, samples, warnings
