"""`dcp-fsdp report [PATH ...]`: tables and plots over many runs' records (docs/report.md;
the groups: analysis.groups; what is read or skipped: analysis.sources)."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dcp_fsdp.analysis.groups import build
from dcp_fsdp.analysis.plots import plot
from dcp_fsdp.analysis.render import DEFAULT_WIDTH, render, wide_csv
from dcp_fsdp.analysis.sources import read_records, record_files
from dcp_fsdp.config.arguments import parse
from dcp_fsdp.errors import UserError
from dcp_fsdp.telemetry.results_dir import writable_dir_problem
from dcp_fsdp.telemetry.server_counters import RESENT_BELOW_CLIENT

if TYPE_CHECKING:
    from dcp_fsdp.analysis.costs import Prices

def _decision_prices(args: argparse.Namespace) -> Prices | None:
    """The decision options checked (their ranges: config/arguments.py) and the prices
    loaded (None without --node-mtbf-hours), before any record is read."""
    if args.node_mtbf_hours is None:
        given = [name for name, value in (("--nodes", args.nodes),
                                          ("--interval-minutes", args.interval_minutes),
                                          ("--prices", args.prices)) if value is not None]
        if args.keep != 1:
            given.append("--keep")
        if given:
            raise UserError(f"report: {', '.join(given)} needs --node-mtbf-hours H (one node's mean "
                            "time between failures, e.g. --node-mtbf-hours 6000)")
        return None
    from dcp_fsdp.analysis.costs import PricesError, load_prices

    try:
        return load_prices(args.prices)
    except PricesError as error:
        raise UserError(f"report: {error}") from None


def _check_outputs(args: argparse.Namespace) -> None:
    """Where --plot and --csv would write, checked before any record is read."""
    if args.plot is not None:
        problem = writable_dir_problem(args.plot) if args.plot.strip() else "empty"
        if problem:
            raise UserError(f"report: --plot {args.plot}: {problem}; give a directory for the PNG files")
    if args.csv is not None:
        target = Path(args.csv)
        problem = ("empty" if not args.csv.strip() else "it is a directory" if target.is_dir()
                   else _in_dir(target.parent, writable_dir_problem(target.parent)))
        if problem:
            raise UserError(f"report: --csv {args.csv}: {problem}; give a file path you can write, "
                            "e.g. groups.csv")


def _in_dir(directory: Path, problem: str | None) -> str | None:
    return f"its directory {directory}: {problem}" if problem else None


def checked_arguments(args: argparse.Namespace) -> tuple[Any, list[Path]]:
    """(prices, record files), every option checked before any record is read; else UserError."""
    _check_outputs(args)
    prices = _decision_prices(args)
    try:
        files = record_files(args.paths)
    except FileNotFoundError as error:
        raise UserError(f"report: {error}") from None
    if not files:
        raise UserError(f"report: no record files (*.jsonl) under {' '.join(args.paths)}")
    return prices, files


def main(argv: list[str]) -> int:
    """`dcp-fsdp report ARGV` in-process (the tests'): the CLI's one parser, then `run`."""
    try:
        return run(parse(["report", *argv]))
    except UserError as error:  # one line, like every other bad input
        print(f"dcp-fsdp: error: {error}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    """`dcp-fsdp report`, parsed (config/arguments.py)."""
    prices, files = checked_arguments(args)
    runs, samples, warnings = read_records(files)
    if not runs:
        print("dcp-fsdp: error: report: no dcp-fsdp records among "
              f"{len(files)} file(s)", file=sys.stderr)
        for warning in warnings:
            print(f"note: {warning}", file=sys.stderr)
        return 2
    result = build(runs, samples)
    # e.g. which groups are too noisy; runs whose request counts the server contradicts
    warnings = [*warnings, *result.get("notes", []), *server_check_notes(runs)]
    if args.format == "csv":
        sys.stdout.write(wide_csv(result).to_csv(index=False))
    else:
        _write_tables(args, result, runs, warnings, prices)
    _write_files(args, result)
    return 0


def server_check_notes(runs: list[dict[str, Any]]) -> list[str]:
    """A note per run whose request counts differ from its S3 server's own counters
    (`server_requests`, launch/server_check.py), and one for the runs checked that agree."""
    checked = [run for run in runs if run["server_requests"] is not None]
    differing = [run for run in checked if not run["server_requests"].get("match")]
    notes = []
    for run in differing:
        check = run["server_requests"]
        differences = ", ".join(f"{k} {v:+d}" for k, v in (check.get("differences") or {}).items())
        incomplete = "; ".join(check.get("incomplete") or [])
        notes.append(f"run {run['run_id']}: its request counts differ from the S3 server's "
                     f"own counters (record - server: {differences or 'none'}"
                     + (f"; {incomplete}" if incomplete else "") + f"): {_cause(check)}")
    if checked and not differing:
        notes.append(f"request counts of {len(checked)} run(s) checked against their S3 "
                     "server's own counters (storage.metrics_url): all match")
    return notes


def _cause(check: dict[str, Any]) -> str:
    """Why they differ, where the run shows it (server_counters.compare's `cause`)."""
    causes = {"server_restarted": "the server restarted during the run (its counters went back)",
              "unanswered_requests": (f"{check.get('unanswered')} request(s) got no answer before the "
                                      "client gave up (the server counts them when it answers: after "
                                      "the check, or under a status the client never saw)"),
              "resent_below_client": RESENT_BELOW_CLIENT}
    return causes.get(str(check.get("cause")), "another client of the bucket, or a misread request log")


def _write_tables(args: argparse.Namespace, result: dict[str, Any], runs: list[dict[str, Any]],
                  warnings: list[str], prices: Prices | None) -> None:
    """The terminal (or markdown) report: tables, scaling, the interval with --node-mtbf-hours."""
    from dcp_fsdp.analysis import decision_text, scaling

    width = shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns
    sys.stdout.write(render(result, args.format, warnings, width=width,
                            wide=args.columns == "all"))
    sys.stdout.write(scaling.render(result, args.format))
    if args.node_mtbf_hours is None:
        return
    # checked_arguments loaded them: --node-mtbf-hours without prices is refused there
    assert prices is not None
    sys.stdout.write(decision_text.render(result, runs, args.node_mtbf_hours, args.nodes,
                                          args.interval_minutes, args.keep, prices, args.format))
    if args.nodes:
        for line in scaling.prefix_warnings(result, runs, args.nodes, prices):
            print(f"warning: {line}")


def _write_files(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """--csv and --plot: each path written is named (on stderr when stdout is the csv)."""
    stream = sys.stderr if args.format == "csv" else sys.stdout
    if args.csv:
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        wide_csv(result).to_csv(args.csv, index=False)
        print(f"csv: {args.csv}", file=stream)
    if args.plot:
        from dcp_fsdp.analysis import scaling

        for path in [*plot(result, Path(args.plot)), *scaling.plot(result, Path(args.plot))]:
            print(f"plot: {path}", file=stream)
