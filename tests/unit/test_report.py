"""`dcp-fsdp report`: grouping, metric definitions, old and failed records, md/csv/plots."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from dcp_fsdp.units import MIB
from dcp_fsdp.analysis import report
from dcp_fsdp.analysis.metrics import run_figures
from dcp_fsdp.telemetry.request_log import Request
from dcp_fsdp.telemetry.summaries import summarize


def requests_summary(count: int, latency_ms: float, seconds: float, throttled: int = 0,
                     kind: str = "UploadPart") -> dict:
    items = [Request(end_wall_s=0.0, kind=kind, outcome="ok", status=200,
                     duration_s=latency_ms / 1e3, ttfb_s=latency_ms / 2e3)
             for _ in range(count - throttled)]
    items += [Request(end_wall_s=0.0, kind=kind, outcome="failed", status=503,
                      duration_s=latency_ms / 1e3, retryable=True, retried=True)
              for _ in range(throttled)]
    return summarize(items, seconds)


def run_line(run_id: str, *, nodes=1, ranks=2, command="save", status="ok", thread_count=1,
             error=None, model="tiny_llama", extra_config=None, drop=()) -> dict:
    config = {"command": command, "model": {"preset": model, "dtype": "fp32"}, "state": "model",
              "iterations": 2, "results_dir": f"/r/{run_id}", "nproc": ranks,
              "storage": {"kind": "s3", "uri": f"s3://b/{run_id}", "thread_count": thread_count,
                          "endpoint": f"http://127.0.0.1:{1000 + len(run_id)}"}}
    config.update(extra_config or {})
    line = {"record": "run", "schema_version": 1, "run_id": run_id, "command": command,
            "status": status, "error": error, "config": config, "node_count": nodes,
            "world_size": ranks, "model": {"preset": model},
            "storage": {"kind": "s3", "embedded": True},
            "untimed_requests": {"count": 1, "control_plane": {"PutObject": {"200": 2}}}}
    for key in drop:
        line.pop(key, None)
    return line


def sample_line(run_id: str, op: str, iteration: int, rank: int, begin: float, end: float,
                nbytes: int, with_requests=True, with_phases=True, **requests_kw) -> dict:
    line = {"record": "sample", "run_id": run_id, "op": op, "iteration": iteration,
            "suffix": f"s{iteration}", "rank": rank, "host": "h", "begin_wall_s": begin,
            "end_wall_s": end, "begin_mono_s": begin, "end_mono_s": end,
            "duration_s": end - begin, "bytes": nbytes, "barrier_wait_s": 0.01 * rank}
    if with_phases:
        line.update(plan_s=0.1, io_s=end - begin - 0.3, commit_s=0.2, metadata_s=None,
                    finish_s=0.05 if rank == 0 else None)
    if with_requests:
        line["requests"] = requests_summary(seconds=end - begin, **requests_kw)
    return line


def write(path: Path, lines: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture
def records(tmp_path) -> Path:
    return write_records(tmp_path / "results")


def write_records(root: Path) -> Path:
    """Two settings (thread_count 1 and 4), 1 and 2 nodes, an old record, a failed run."""
    write(root / "a.jsonl", [run_line("a", nodes=1, ranks=2)]
          + [sample_line("a", "save", i, r, 10.0 * i, 10.0 * i + 2 + r, 100 * MIB,
                         count=10, latency_ms=50, throttled=1)
             for i in (1, 2) for r in (0, 1)])
    write(root / "b.jsonl", [run_line("b", nodes=2, ranks=4)]
          + [sample_line("b", "save", 1, r, 0.0, 2.0, 100 * MIB, count=10, latency_ms=80)
             for r in range(4)])
    write(root / "sub" / "c.jsonl", [run_line("c", nodes=1, ranks=2, thread_count=4)]
          + [sample_line("c", "save", 1, r, 0.0, 1.0, 100 * MIB, count=20, latency_ms=20)
             for r in (0, 1)])
    # an old record: no request statistics, no phases, no thread_count setting
    old = run_line("old", nodes=1, ranks=2, drop=("untimed_requests",))
    del old["config"]["storage"]["thread_count"]
    write(root / "old.jsonl", [old] + [
        sample_line("old", "save", 1, r, 0.0, 4.0, 100 * MIB, with_requests=False,
                    with_phases=False) for r in (0, 1)])
    write(root / "failed.jsonl", [run_line("failed", nodes=1, ranks=2, status="failed",
                                           error="rank 1: S3Exception: boom")]
          + [sample_line("failed", "save", 1, 0, 0.0, 100.0, 100 * MIB, count=10,
                         latency_ms=5)])
    (root / "notes.jsonl").write_text("not json\n")
    return root


def test_groups_by_node_count_and_the_setting_that_differs(records):
    runs, samples, warnings = report.read_records(report.record_files([str(records)]))
    result = report.build(runs, samples)
    assert result["varying"] == ["storage.thread_count"]
    table = result["throughput"]
    keys = list(zip(table["nodes"], table["ranks"], table["storage.thread_count"]))
    assert keys == [(1, 2, "1"), (1, 2, "4"), (1, 2, ""), (2, 4, "1")]  # blanks last
    by_key = {k: row for k, (_, row) in zip(keys, table.iterrows())}
    first = by_key[(1, 2, "1")]
    # aggregate = total bytes / total of (last rank end - first rank begin): 2 x 200 MiB / 2 x 3 s
    assert first["aggregate_mib_s"] == pytest.approx(400 / 6)
    assert first["iterations"] == 2 and first["runs"] == 1
    assert first["duration_mean_s"] == pytest.approx(3.0)
    assert first["requests_per_op"] == 20 and first["req_per_s"] == pytest.approx(40 / 6)
    assert first["throttles"] == 4 and first["failures"] == 4
    assert first["success_ratio"] == pytest.approx(36 / 40)
    (upload,) = [row for _, row in result["types"].iterrows()
                 if row["storage.thread_count"] == "1" and row["nodes"] == 1
                 and row["request_type"] == "UploadPart"]
    assert upload["latency_p50_ms"] == pytest.approx(50, rel=0.07)  # per type, not pooled
    assert first["rank_s_min"] == 2.0 and first["rank_s_max"] == 3.0
    assert first["failed_runs"] == 1  # the failed run had the same nodes, ranks and setting
    two_nodes = by_key[(2, 4, "1")]
    assert two_nodes["mib_s_per_node"] == pytest.approx(two_nodes["aggregate_mib_s"] / 2)
    old = by_key[(1, 2, "")]
    assert old["aggregate_mib_s"] == pytest.approx(50.0)
    for column in ("requests_per_op", "req_per_s", "failures"):
        assert old[column] != old[column]  # NaN: shown empty
    phases = result["phases"].iloc[0]  # the first group: 1 node, thread_count=1
    assert (phases["nodes"], phases["storage.thread_count"]) == (1, "1")
    assert phases["plan_s"] == pytest.approx(0.1) and phases["commit_s"] == pytest.approx(0.2)
    assert phases["end_skew_mean_s"] == pytest.approx(1.0)
    assert phases["barrier_wait_max_s"] == pytest.approx(0.01)
    assert phases["slowest_rank"] == 1 and phases["slowest_lag_s"] == pytest.approx(0.5)
    assert any("notes.jsonl" in w for w in warnings)


def test_terminal_markdown_csv_and_plots(records, tmp_path):
    runs, samples, warnings = report.read_records(report.record_files([str(records)]))
    result = report.build(runs, samples)
    text = report.render(result, "table", warnings)
    assert "Throughput" in text and "failed runs" in text and "req/s" in text
    assert "failed (save, failed): rank 1: S3Exception: boom" in text
    assert "5 run(s) read: 4 ok, 1 failed or interrupted" in text
    md = report.render(result, "md", warnings)
    throughput = md.split("### Throughput")[1].split("###")[0]
    rows = [line for line in throughput.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 4  # header + one row per group
    assert rows[1].split("|")[1].strip() == "1"
    cells = [[cell.strip() for cell in line.split("|")[1:-1]] for line in rows]
    header = cells[0]
    by_group = {row[header.index("storage.thread_count")]: dict(zip(header, row))
                for row in cells[1:] if row[0] == "1"}
    assert by_group["1"]["req/op"] == "20.0" and by_group["1"]["throttles"] == "4"
    old = by_group[""]  # the old record: throughput yes, request columns empty
    assert old["agg MiB/s"] == "50.0"
    assert old["req/op"] == old["req/s"] == ""
    frame = list(csv.DictReader(io.StringIO(report.wide_csv(result).to_csv(index=False))))
    assert len(frame) == 4 and "aggregate_mib_s" in frame[0] and "plan_s" in frame[0]
    written = report.plot(result, tmp_path / "plots")
    assert [p.name for p in written] == ["throughput_vs_nodes.png", "rank_durations.png",
                                         "request_latency.png"]
    assert all(p.stat().st_size > 10_000 for p in written)


def test_run_table_gains_request_columns_and_tolerates_old_samples():
    samples = [sample_line("r", "save", 1, r, 0.0, 2.0, MIB, count=5, latency_ms=10)
               for r in (0, 1)]
    headers, rows, _ = run_figures(samples)
    assert headers[:6] == ["op", "iter", "suffix", "MiB", "span s", "aggregate MiB/s"]
    cells = dict(zip(headers, rows[0]))
    assert cells["requests"] == "10" and cells["req/s"] == "5.0"
    assert cells["failed/throttled"] == "0/0"
    old = [{k: v for k, v in s.items() if k != "requests"} for s in samples]
    headers, rows, _ = run_figures(old)
    assert "requests" not in headers and len(rows[0]) == len(headers)  # nothing to show


def mlperf_run(root: Path, run_id: str, iterations: int) -> None:
    """A protocol=mlperf record with `iterations` saves and as many loads on 2 ranks."""
    write(root / f"{run_id}.jsonl",
          [run_line(run_id, command="save-and-load", extra_config={"protocol": "mlperf"})]
          + [sample_line(run_id, op, i, r, 10.0 * i, 10.0 * i + 1 + r, 100 * MIB,
                         with_requests=False)
             for op in ("save", "load") for i in range(1, iterations + 1) for r in (0, 1)])


def test_only_runs_of_mlperfs_counts_are_labelled_mlperf_storage(tmp_path):
    """Issue 49 item 7: tune's 1-iteration trials, recorded with protocol=mlperf, were
    printed as "MLPerf Storage v3.0" figures. Only 10 saves + 10 loads are; the others are
    named in a note."""
    mlperf_run(tmp_path / "both", "whole", 10)
    for root in (tmp_path / "both", tmp_path / "trial"):
        mlperf_run(root, "trial", 1)
    heading = "MLPerf Storage v3.0 checkpointing"
    for root, labelled in ((tmp_path / "both", ["whole"]), (tmp_path / "trial", [])):
        runs, samples, warnings = report.read_records(report.record_files([str(root)]))
        text = report.render(report.build(runs, samples), "table", warnings)
        section = text.split(heading)[1].split("\n\n")[0] if labelled else ""
        assert (heading in text) == bool(labelled), text
        assert [run for run in ("whole", "trial") if f"{run}:" in section] == labelled
        assert ("1 run(s) recorded with protocol=mlperf are not shown as MLPerf Storage "
                "figures") in " ".join(text.split())
        assert "trial: 1 saves and 1 loads, not MLPerf's 10 + 10" in " ".join(text.split())


def test_a_group_with_an_operation_of_unknown_requests_has_no_request_counts(tmp_path):
    """One run of the group recorded its requests (a throttle in each operation), the other
    none: every count is unknown (empty), as in the end-of-run table, never the known part's
    sum (which would read as fewer throttles, retries or misses than there were)."""
    write(tmp_path / "x.jsonl", [run_line("x")] + [
        sample_line("x", "save", 1, r, 0.0, 2.0, 100 * MIB, count=10, latency_ms=50, throttled=1)
        for r in (0, 1)])
    write(tmp_path / "y.jsonl", [run_line("y")] + [
        sample_line("y", "save", 1, r, 0.0, 2.0, 100 * MIB, with_requests=False) for r in (0, 1)])
    runs, samples, _ = report.read_records(report.record_files([str(tmp_path)]))
    (row,) = [row for _, row in report.build(runs, samples)["throughput"].iterrows()]
    assert row["iterations"] == 2
    for column in ("requests_per_op", "failures", "throttles", "retries", "misses"):
        assert row[column] != row[column], column  # NaN: shown empty
