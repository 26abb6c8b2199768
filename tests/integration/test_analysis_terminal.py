"""The report's terminal view fits the terminal; Markdown and CSV keep every column."""

from __future__ import annotations

import csv
import io
import os
import subprocess
import sys

import pytest

from dcp_fsdp.analysis import columns, report
from tests.kit.cli import REPO, clean_env
from tests.unit.analysis_kit import ONE_ITERATION, cut_last_line, variant

TABLES = {"Throughput": columns.THROUGHPUT, "S3 requests in the timed": columns.REQUESTS,
          "DCP phases": columns.PHASES, "S3 requests by type": columns.TYPES}


@pytest.fixture
def sweep(tmp_path):
    """A small sweep as it lands in results/: three settings that differ between the runs
    that succeeded (one with a long name), two failed runs that differ in settings nobody
    else changed (backend, delay_s), one record cut off, one older record."""
    root = tmp_path / "results"
    variant(root, "p8", settings={"storage.part_size_mib": 8})
    variant(root, "p16", settings={"storage.part_size_mib": 16})
    variant(root, "p16-t4", settings={"storage.part_size_mib": 16, "storage.thread_count": 4,
                                      "storage.throughput_target_gbps": 100.0})
    variant(root, "p8-new", ONE_ITERATION, settings={"storage.part_size_mib": 8})
    variant(root, "nccl", settings={"backend": "nccl", "delay_s": 5.0}, status="failed",
            error="rank 0: ProcessGroupNCCL is only supported with GPUs, no GPUs found! " * 4)
    variant(root, "slow", settings={"delay_s": 30.0}, status="interrupted")
    cut_last_line(variant(root, "cut", settings={"storage.part_size_mib": 32}))
    return root


def report_stdout(args: list[str], columns_env: str | None = None) -> str:
    env = {k: v for k, v in clean_env().items() if k not in ("COLUMNS", "LINES")}
    if columns_env:
        env["COLUMNS"] = columns_env
    done = subprocess.run([sys.executable, "-m", "dcp_fsdp", "report", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_default_view_fits_100_columns_when_not_a_terminal(sweep):
    text = report_stdout([str(sweep)])
    widths = [len(line) for line in text.splitlines()]
    assert max(widths) <= 100, [line for line in text.splitlines() if len(line) > 100]
    # the group keys that differ (op and the settings of the runs in the figures) lead,
    # shortened; a setting only failed runs changed is no column
    header = next(line for line in text.splitlines() if line.startswith("op "))
    assert header.split()[:5] == ["op", "part_size_mib", "thread_count", "throughput_ta~",
                                  "runs"]
    # no column for backend or delay_s (delay_s may be named by the noise hint's words)
    tables = "\n".join(line for line in text.splitlines() if line.startswith(("op ", "|")))
    assert "backend" not in tables and "delay_s" not in tables
    assert "backend=" not in text and "delay_s=" not in text
    assert "All groups: nodes=1, ranks=2, model=tiny_llama" in text  # constant keys: one line
    assert "throughput_ta~=storage.throughput_target_gbps" in text
    assert "3 failed or interrupted" not in text
    assert "7 run(s) read: 4 ok, 2 failed or interrupted, 1 incomplete record(s)" in text
    for run_id in ("nccl (save-and-load, failed)", "slow (save-and-load, interrupted)",
                   "cut (save-and-load, incomplete)"):
        assert run_id in text
    assert "nan" not in text
    # the upload rows carry bytes (bytes_up of the ranks' UploadPart requests)
    upload = [line.split() for line in text.splitlines() if " UploadPart " in line]
    assert upload and all(float(cells[6]) > 20 for cells in upload)  # MiB/op of 2 x 14 MB


def test_the_view_follows_the_terminal_width(sweep):
    for width in (80, 140):
        text = report_stdout([str(sweep)], columns_env=str(width))
        assert max(len(line) for line in text.splitlines()) <= width
    wide = report_stdout([str(sweep), "--wide"], columns_env="80")
    for title, table_columns in TABLES.items():
        section = wide.split(title)[1].splitlines()[2]
        for column in table_columns:
            assert column.header in section, (title, column.header)


def test_markdown_and_csv_keep_every_column(sweep):
    md = report_stdout([str(sweep), "--format", "md"])
    runs, samples, _ = report.read_records(report.record_files([str(sweep)]))
    result = report.build(runs, samples)
    keys = result["group_keys"]
    assert keys == ["nodes", "ranks", "model", "op", "storage", "storage.part_size_mib",
                    "storage.thread_count", "storage.throughput_target_gbps"]
    for title, table_columns in TABLES.items():
        header = md.split(f"### {title}")[1].split("\n| ")[1]
        cells = [cell.strip() for cell in header.split("|")]
        for name in keys + [c.header for c in table_columns]:
            assert name in cells, (title, name)
    text = report_stdout([str(sweep), "--format", "csv"])
    csv_header = next(csv.reader(io.StringIO(text)))
    expected = set(keys) | {name for table_columns in (columns.THROUGHPUT, columns.PHASES)
                            for column in table_columns
                            for name in ((column.names,) if isinstance(column.names, str)
                                         else column.names)}
    assert expected <= set(csv_header)


def test_the_throughput_rows_of_the_sweep(sweep):
    runs, samples, _ = report.read_records(report.record_files([str(sweep)]))
    result = report.build(runs, samples)
    table = result["throughput"]
    groups = list(zip(table["op"], table["storage.part_size_mib"], table["runs"]))
    # the part size splits loads as it splits saves (it cuts their ranged GETs)
    assert groups == [("save", "8", 2), ("save", "16", 1), ("save", "16", 1),
                      ("load", "8", 2), ("load", "16", 1), ("load", "16", 1)]
    assert os.fspath(sweep) not in report.render(result, "table", [], width=100)
