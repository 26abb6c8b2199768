"""Record files for the report's tests, made from real ones.

tests/unit/data/ holds two records written by real 2-rank `save-and-load` runs of
tiny_llama on the embedded SeaweedFS: one iteration (schema 2, this round's writer) and
two iterations (schema 1, written before this round: no schema-2 fields).
`variant` copies one under another run id with other settings or samples, as a sweep
would have written it (same writer: telemetry.records.write_records).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Callable

from dcp_fsdp.telemetry.records import Sample, Settings, read_record_file, write_records

DATA = Path(__file__).parent / "data"
ONE_ITERATION = DATA / "two_rank_save_and_load.jsonl"
TWO_ITERATIONS = DATA / "two_rank_two_iterations.jsonl"


def set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    for key in keys[:-1]:
        tree = tree.setdefault(key, {})
    tree[keys[-1]] = value


def variant(directory: Path, run_id: str, source: Path = TWO_ITERATIONS, *,
            settings: dict[str, Any] | None = None, status: str = "ok",
            error: str | None = None, run: dict[str, Any] | None = None,
            sample: Callable[[dict[str, Any]], dict[str, Any] | list[dict] | None] | None = None
            ) -> Path:
    """A copy of a real record as run `run_id`: settings (dotted names) changed, run fields
    replaced, each sample line passed through `sample` (return None to drop it, a list to
    add lines)."""
    parsed = read_record_file(source)
    record = copy.deepcopy(parsed.runs[0])
    record.run_id, record.status, record.error = run_id, status, error
    config = record.config.model_dump()
    for name, value in (settings or {}).items():
        set_path(config, name, value)
    record.config = Settings.model_validate(config)
    for name, value in (run or {}).items():
        setattr(record, name, value)
    samples = []
    for original in parsed.samples:
        row = original.model_dump(exclude={"run_id"})
        changed = sample(copy.deepcopy(row)) if sample else row
        for line in changed if isinstance(changed, list) else [changed]:
            if line is not None:
                samples.append(Sample.model_validate(line))
    if status != "ok":  # a failed run keeps only rank 0's samples
        samples = [s for s in samples if s.rank == 0]
    return write_records(directory / f"{run_id}.jsonl", record, samples)


def cut_last_line(path: Path, keep_fraction: float = 0.5) -> None:
    """The record as a crash or a full disk leaves it: the last line cut part way."""
    text = path.read_text()
    last_start = text.rstrip("\n").rfind("\n") + 1
    last = text[last_start:]
    path.write_text(text[:last_start] + last[:int(len(last) * keep_fraction)])


def drop_last_line(path: Path) -> None:
    """The record cut exactly at a line boundary: no unreadable line, a sample missing."""
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-1]))


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
