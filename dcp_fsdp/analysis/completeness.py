"""Whether a run's record is whole: a cut-off or damaged record never enters a figure (a
run that says "ok" is then left out of every figure and listed, with the reason; the checks
below, docs/report.md)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

# the operations each command times, once per iteration
COMMAND_OPS = {"save": ("save",), "load": ("load",), "save-and-load": ("save", "load")}


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
    """The iterations every timed operation must have samples of (records of format 2 on, of
    a command that times operations), else None."""
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
    """{run_id: reason} for the runs with status ok whose record is not whole (run and
    samples: validated records' dumps, telemetry.records)."""
    ranks: dict[str, dict[tuple[str, int], set[int]]] = defaultdict(lambda: defaultdict(set))
    for sample in samples:  # per run, per (op, iteration)
        ranks[sample["run_id"]][(sample["op"], sample["iteration"])].add(sample["rank"])
    reasons = {run["run_id"]: (_lines_reason(run) or _ranks_reason(run, ranks[run["run_id"]])
                               or _iterations_reason(run, ranks[run["run_id"]]))
               for run in runs if run["status"] == "ok"}
    return {run_id: reason for run_id, reason in reasons.items() if reason}
