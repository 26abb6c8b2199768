"""Finding record files and reading them (telemetry.records): which runs enter the report,
and what was skipped and why (docs/report.md). A results tree often holds a run twice (a
backup copy): counting both would double every figure of the run, so each run_id is read
once, of two copies the one with fewer unreadable lines."""

from __future__ import annotations

import dataclasses
import glob
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

from dcp_fsdp.log import printable
from dcp_fsdp.telemetry.records import SCHEMA_VERSION, SHOWN, RecordFile, read_record_file

RECORD_SUFFIX = ".jsonl"  # what a run writes (telemetry.records.record_path)
# places named per reason in a note; the rest are counted
EXAMPLES_PER_NOTE = 3
NO_RUN_LINE = "no run line: not a dcp-fsdp record"
# the operations each command times, once per iteration
COMMAND_OPS = {"save": ("save",), "load": ("load",), "save-and-load": ("save", "load")}


@dataclasses.dataclass
class _Copy:
    """One record file's copy of a run: its run row and its sample rows."""

    path: Path
    run: dict[str, Any]
    samples: list[dict[str, Any]]
    # (lines that lost a sample, lines not JSON that say nothing of what they were): of two
    # copies, the one with fewer (in that order) is the whole one
    bad_lines: tuple[int, int]


def first_few(places: list[str]) -> str:
    shown = ", ".join(places[:EXAMPLES_PER_NOTE])
    more = len(places) - EXAMPLES_PER_NOTE
    return f"{shown}, +{more} more" if more > 0 else shown


class Intake:
    """Runs read so far (one copy per run_id) and every item left out, with its reason."""

    def __init__(self) -> None:
        self._copies: dict[str, _Copy] = {}
        self._skipped_lines: dict[str, list[str]] = defaultdict(list)  # reason: ["file:line"]
        self._skipped_files: dict[str, list[str]] = defaultdict(list)  # reason: [file]
        self._duplicates: list[str] = []  # "copy (kept: other copy)"

    def add(self, parsed: RecordFile) -> None:
        """One record file's runs and samples, or the reason none of it can be used."""
        path = parsed.path
        if not parsed.runs:
            reason = next((s.reason for s in parsed.skipped if s.reason.startswith("run line")), NO_RUN_LINE)
            self._skipped_files[reason].append(str(path))
            return
        for skipped in parsed.skipped:
            self._skipped_lines[skipped.reason].append(f"{path}:{skipped.line}")
        samples: dict[str, list[dict[str, Any]]] = {run.run_id: [] for run in parsed.runs}
        for sample in parsed.samples:
            # every text printable (log.printable): a record is anyone's who can write the
            # results directory, and an ESC or newline must not reach the terminal
            row = {"record": "sample", **sample.model_dump(context=SHOWN)}
            if sample.run_id in samples:
                samples[sample.run_id].append(row)
            else:  # it could join another file's run of that id and double its bytes
                self._skipped_lines["sample line: its run_id names no run line of its "
                                    "file"].append(str(path))
        for run in parsed.runs:
            row = {**run.to_json(SHOWN), "record_file": printable(str(path)),
                   "unreadable_lines": parsed.bad_lines, "unknown_lines": parsed.unknown_lines}
            self._keep(_Copy(path, row, samples[run.run_id],
                             (parsed.bad_lines, parsed.unknown_lines)))

    def add_unreadable(self, path: Path, reason: str) -> None:
        """A file that could not be opened or read at all."""
        self._skipped_files[f"cannot be read ({reason})"].append(str(path))

    def _keep(self, copy: _Copy) -> None:
        run_id = copy.run["run_id"]
        kept = self._copies.get(run_id)
        if kept is None:
            self._copies[run_id] = copy
        elif copy.bad_lines < kept.bad_lines:  # the whole copy beats a cut-off one
            self._copies[run_id] = copy
            self._duplicates.append(f"{kept.path} (kept: {copy.path})")
        else:
            self._duplicates.append(f"{copy.path} (kept: {kept.path})")

    def runs(self) -> list[dict[str, Any]]:
        return [copy.run for copy in self._copies.values()]

    def samples(self) -> list[dict[str, Any]]:
        return [row for copy in self._copies.values() for row in copy.samples]

    def notes(self) -> list[str]:
        """One line per reason: what was skipped, how many, and where (the first few); each
        printable (a reason may quote a line's value, a place is a file's name)."""
        notes = [f"{len(files)} file(s) skipped, {reason}: {first_few(files)}"
                 for reason, files in self._skipped_files.items()]
        notes += [f"{len(places)} line(s) skipped, {reason}: {first_few(places)}"
                  for reason, places in self._skipped_lines.items()]
        if self._duplicates:
            notes.append(f"{len(self._duplicates)} duplicate record(s) skipped, a run_id "
                         f"already read from another file (a copy): {first_few(self._duplicates)}")
        newer: dict[int, list[str]] = defaultdict(list)  # schema_version: [file]
        for copy in self._copies.values():
            if copy.run["schema_version"] > SCHEMA_VERSION:
                newer[copy.run["schema_version"]].append(str(copy.path))
        for version, files in sorted(newer.items()):
            notes.append(f"{len(files)} record(s) of schema_version {version}, newer than this "
                         f"reader's {SCHEMA_VERSION}: read, fields it does not know left out "
                         f"(a newer dcp-fsdp reports them): {first_few(files)}")
        return [printable(note) for note in notes]


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
    """(runs, samples, notes): each run_id once, what cannot be read skipped (Intake)."""
    intake = Intake()
    for path in files:
        try:
            intake.add(read_record_file(path))
        except OSError as error:  # unreadable (permissions, a directory named *.jsonl)
            intake.add_unreadable(path, error.strerror or type(error).__name__)
    return intake.runs(), intake.samples(), intake.notes()


def _ranks_text(ranks: set[int]) -> str:
    return ", ".join(str(r) for r in sorted(ranks))


def _lines_reason(run: dict[str, Any]) -> str | None:
    """Lines of the record file that could not be read."""
    if run["unreadable_lines"]:
        return (f"{run['unreadable_lines']} unreadable line(s) in its record file: cut off or "
                "damaged, a rank's sample is lost")
    if run["unknown_lines"] and not (run["world_size"] and _iterations(run)):
        return (f"{run['unknown_lines']} unreadable line(s) in its record file, and it has no "
                "sample count to show whether a rank's sample is lost")
    return None


def _ranks_reason(run: dict[str, Any], ranks_per_op: dict[tuple[str, int], set[int]]) -> str | None:
    """A rank missing from an operation, or one outside the world."""
    world_size = run["world_size"]
    if not world_size:
        if len({frozenset(ranks) for ranks in ranks_per_op.values()}) > 1:
            return "world_size unknown and the ranks differ between operations"
        return None
    expected = set(range(world_size))
    for (op, iteration), ranks in sorted(ranks_per_op.items()):
        if ranks - expected:
            return (f"{op} iteration {iteration}: rank(s) {_ranks_text(ranks - expected)} "
                    f"outside world_size {world_size}")
        if expected - ranks:
            return (f"{op} iteration {iteration}: no sample of rank(s) "
                    f"{_ranks_text(expected - ranks)} (world_size {world_size})")
    return None


def _iterations(run: dict[str, Any]) -> int | None:
    """The iterations every timed operation must have samples of (format 2 on), else None."""
    iterations = run["config"].get("iterations")  # a setting: of any kind in a record
    if run["schema_version"] < 2 or run["command"] not in COMMAND_OPS \
            or not isinstance(iterations, int) or iterations <= 0:
        return None
    return iterations


def _iterations_reason(run: dict[str, Any],
                       ranks_per_op: dict[tuple[str, int], set[int]]) -> str | None:
    """An iteration of a timed operation with no sample at all."""
    iterations = _iterations(run)
    if iterations is None:
        return None
    for op in COMMAND_OPS[run["command"]]:
        missing = set(range(1, iterations + 1)) - {i for o, i in ranks_per_op if o == op}
        if missing:
            return (f"no {op} sample of iteration(s) {_ranks_text(missing)} "
                    f"(iterations={iterations})")
    return None


def incomplete_runs(runs: list[dict[str, Any]], samples: list[dict[str, Any]]
                    ) -> dict[str, str]:
    """{run_id: reason} for the runs with status ok whose record is not whole."""
    ranks: dict[str, dict[tuple[str, int], set[int]]] = defaultdict(lambda: defaultdict(set))
    for sample in samples:  # per run, per (op, iteration)
        ranks[sample["run_id"]][(sample["op"], sample["iteration"])].add(sample["rank"])
    reasons = {run["run_id"]: (_lines_reason(run) or _ranks_reason(run, ranks[run["run_id"]])
                               or _iterations_reason(run, ranks[run["run_id"]]))
               for run in runs if run["status"] == "ok"}
    return {run_id: reason for run_id, reason in reasons.items() if reason}
