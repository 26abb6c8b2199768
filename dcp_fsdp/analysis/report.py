"""`dcp-fsdp report [PATH ...]`: tables and plots over many runs' records.

Reads record files (JSON Lines, one per run: a run line, then one line per rank
per save/load), and groups the saves and loads by node count, world size, model,
operation, storage backend and every setting that differs between the runs.
Failed and interrupted runs are left out of every figure, but counted per group
and listed under the tables. Records from older versions that lack a field
report it empty.

Output: the terminal (default; fits the terminal's width, 100 columns when not a
terminal: a compact set of columns, `--wide` for all), Markdown (--format md, every
column) or CSV (--format csv, or --csv FILE besides another format; every figure);
PNG plots with --plot DIR. Runs whose record is not whole (cut off, a rank's sample
missing) are left out like failed ones, with the reason.
Metric definitions: the README's "Metrics".
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from dcp_fsdp.analysis.groups import build
from dcp_fsdp.analysis.plots import plot
from dcp_fsdp.analysis.render import DEFAULT_WIDTH, render, wide_csv
from dcp_fsdp.analysis.sources import read_records, record_files

RUN_DEFAULT_PATHS = ["results"]

__all__ = ["build", "plot", "render", "wide_csv", "read_records", "record_files", "main"]


class _Arguments(argparse.ArgumentParser):
    def error(self, message: str):  # one line, like every other bad input
        print(f"dcp-fsdp: error: report: {message} (dcp-fsdp report --help)", file=sys.stderr)
        raise SystemExit(2)


def parser() -> argparse.ArgumentParser:
    arguments = _Arguments(
        prog="dcp-fsdp report",
        description="Tables (and plots) over run records, grouped by node count, world size, "
                    "model, operation, storage and every setting that differs between runs.")
    arguments.add_argument("paths", nargs="*", default=RUN_DEFAULT_PATHS,
                           help="record files, directories (searched recursively) or globs "
                                "(default: results)")
    arguments.add_argument("--format", choices=("table", "md", "csv"), default="table",
                           help="table: terminal; md: Markdown; csv: the wide group table")
    arguments.add_argument("--columns", choices=("compact", "all"), default="compact",
                           help="table: compact (fits the terminal width) or all columns")
    arguments.add_argument("--wide", action="store_const", const="all", dest="columns",
                           help="the same as --columns all")
    arguments.add_argument("--csv", metavar="FILE", help="also write the wide group table as CSV")
    arguments.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR")
    return arguments


def output_problem(args: argparse.Namespace) -> str | None:
    """Where --plot and --csv would write, checked before any record is read."""
    from dcp_fsdp.launch.checks import writable_dir_problem

    if args.plot is not None:
        problem = writable_dir_problem(args.plot) if args.plot.strip() else "empty"
        if problem:
            return f"--plot {args.plot}: {problem}; give a directory for the PNG files"
    if args.csv is not None:
        target = Path(args.csv)
        problem = ("empty" if not args.csv.strip() else "it is a directory" if target.is_dir()
                   else _in_dir(target.parent, writable_dir_problem(target.parent)))
        if problem:
            return f"--csv {args.csv}: {problem}; give a file path you can write, e.g. groups.csv"
    return None


def _in_dir(directory: Path, problem: str | None) -> str | None:
    return f"its directory {directory}: {problem}" if problem else None


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
    except SystemExit as stop:
        return int(stop.code or 0)
    problem = output_problem(args)
    if problem:
        print(f"dcp-fsdp: error: report: {problem}", file=sys.stderr)
        return 2
    try:
        files = record_files(args.paths)
    except FileNotFoundError as error:
        print(f"dcp-fsdp: error: report: {error}", file=sys.stderr)
        return 2
    if not files:
        print(f"dcp-fsdp: error: report: no record files (*.jsonl) under {' '.join(args.paths)}",
              file=sys.stderr)
        return 2
    runs, samples, warnings = read_records(files)
    if not runs:
        print("dcp-fsdp: error: report: no dcp-fsdp records among "
              f"{len(files)} file(s)", file=sys.stderr)
        for warning in warnings:
            print(f"note: {warning}", file=sys.stderr)
        return 2
    result = build(runs, samples)
    warnings = [*warnings, *result.get("notes", [])]  # e.g. which groups are too noisy
    if args.format == "csv":
        sys.stdout.write(wide_csv(result).to_csv(index=False))
    else:
        width = shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns
        sys.stdout.write(render(result, args.format, warnings, width=width,
                                wide=args.columns == "all"))
    if args.csv:
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        wide_csv(result).to_csv(args.csv, index=False)
        print(f"csv: {args.csv}", file=sys.stderr if args.format == "csv" else sys.stdout)
    if args.plot:
        for path in plot(result, Path(args.plot)):
            print(f"plot: {path}", file=sys.stderr if args.format == "csv" else sys.stdout)
    return 0
