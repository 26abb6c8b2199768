"""Ceiling rows and efficiency; async saves, memory, load-time breakdown and read
amplification in the report and the end-of-run table."""

from __future__ import annotations

import math

import pytest

from dcp_fsdp.units import GIB, MIB
from dcp_fsdp.analysis import report
from dcp_fsdp.analysis.metrics import run_figures
from dcp_fsdp.analysis.run_summary import async_lines
from dcp_fsdp.telemetry.records import read_record_file
from tests.unit.analysis_kit import ONE_ITERATION, lines, variant


def with_ceiling(sample: dict) -> list[dict]:
    """The real sample, and after it the same bytes moved raw (PUT after a save, GET after a
    load) in a tenth of the time, starting 1 s after the DCP operation ended."""
    raw = {**{k: v for k, v in sample.items() if not k.endswith("_s")},
           "op": {"save": "raw_put", "load": "raw_get"}[sample["op"]], "requests": None,
           "begin_wall_s": sample["end_wall_s"] + 1.0, "barrier_wait_s": 0.0,
           "begin_mono_s": sample["begin_mono_s"], "end_mono_s": sample["end_mono_s"]}
    raw["end_wall_s"] = raw["begin_wall_s"] + sample["duration_s"] / 10
    raw["duration_s"] = raw["end_wall_s"] - raw["begin_wall_s"]
    return [sample, raw]


def aggregate(samples: list[dict]) -> float:
    """total bytes / MiB / total of (last end - first begin) per operation."""
    ops: dict = {}
    for s in samples:
        ops.setdefault((s["run_id"], s["iteration"]), []).append(s)
    span_s = sum(max(s["end_wall_s"] for s in g) - min(s["begin_wall_s"] for s in g)
                 for g in ops.values())
    return sum(s["bytes"] for s in samples) / MIB / span_s


def build(directory):
    runs, samples, _ = report.read_records(report.record_files([str(directory)]))
    return report.build(runs, samples)


def test_raw_rows_and_efficiency_per_group(tmp_path):
    ceil = variant(tmp_path, "ceil", ONE_ITERATION, settings={"ceiling": True},
                   sample=with_ceiling)
    plain = variant(tmp_path, "plain", ONE_ITERATION, settings={"ceiling": False})
    variant(tmp_path, "t4", ONE_ITERATION, settings={"storage.thread_count": 4})
    result = build(tmp_path)
    assert result["varying"] == ["storage.thread_count"]  # ceiling splits no group
    table = result["throughput"]
    rows = list(zip(table["op"], table["storage.thread_count"], table["runs"]))
    assert rows == [("save", "1", 2), ("save", "4", 1), ("raw_put", "1", 1),
                    ("load", "1", 2), ("load", "4", 1), ("raw_get", "1", 1)]
    samples = [s for s in lines(ceil)[1:] + lines(plain)[1:]]
    by = {(op, part): row for (op, part, _), (_, row) in zip(rows, table.iterrows())}
    for op, raw in (("save", "raw_put"), ("load", "raw_get")):
        dcp = aggregate([s for s in samples if s["op"] == op])
        ceiling = aggregate([s for s in samples if s["op"] == raw])
        assert by[(op, "1")]["aggregate_mib_s"] == pytest.approx(dcp)
        assert by[(raw, "1")]["aggregate_mib_s"] == pytest.approx(ceiling)
        assert by[(op, "1")]["efficiency"] == pytest.approx(dcp / ceiling)
        assert 0 < by[(op, "1")]["efficiency"] < 1
        assert math.isnan(by[(op, "4")]["efficiency"])  # no ceiling measured there
    text = report.render(result, "table", [], width=100)
    header = next(line for line in text.splitlines() if line.startswith("op "))
    assert "efficiency" in header.split()
    assert any(line.startswith("raw_put ") for line in text.splitlines())


def test_end_of_run_table_gains_efficiency_with_a_ceiling(tmp_path):
    path = variant(tmp_path, "ceil", ONE_ITERATION, sample=with_ceiling)
    samples = lines(path)[1:]
    headers, rows, _ = run_figures(samples)
    assert headers[5:7] == ["aggregate MiB/s", "efficiency"]
    cells = {row[0]: dict(zip(headers, row)) for row in rows}
    assert list(cells) == ["save", "raw_put", "load", "raw_get"]
    expected = (aggregate([s for s in samples if s["op"] == "save"])
                / aggregate([s for s in samples if s["op"] == "raw_put"]))
    assert cells["save"]["efficiency"] == f"{expected:.2f}"
    assert cells["raw_put"]["efficiency"] == ""
    assert "efficiency" not in run_figures(lines(ONE_ITERATION)[1:])[0]  # no ceiling, no column


def async_save(sample: dict) -> dict:
    """The real sample as an async save would have reported it: blocked for a fifth of the
    time, stalled (call + staging) for a quarter, a tenth of a 2 s training interval lost,
    persisted at the end; loads with read amplification and a wait/copy split."""
    sample["peak_rss_bytes"] = (1 + sample["rank"]) * GIB // 2
    if sample["op"] == "save":
        sample.update(save_mode="async", blocked_s=sample["duration_s"] / 5,
                      staged_s=sample["duration_s"] / 5, persisted_s=sample["duration_s"],
                      stall_s=sample["duration_s"] / 4, interval_s=2.0, train_lost_s=0.2,
                      train_lost_share=0.1, stage_s=0.01, upload_s=sample["io_s"] - 0.01)
    else:
        sample.update(fetched_bytes=sample["bytes"] * 3 // 2, storage_s=sample["io_s"] * 0.75,
                      deserialise_s=sample["io_s"] * 0.25)
    return sample


def sync_save(sample: dict) -> dict:
    if sample["op"] == "save":
        sample.update(save_mode="sync", blocked_s=sample["duration_s"],
                      persisted_s=sample["duration_s"], stall_s=sample["duration_s"])
    return sample


def test_async_and_sync_side_by_side_with_memory_and_read_amplification(tmp_path):
    a = variant(tmp_path, "async", ONE_ITERATION, sample=async_save,
                settings={"save_mode": "async", "progress": False, "progress_interval_s": 1.0})
    variant(tmp_path, "sync", ONE_ITERATION, sample=sync_save, settings={"save_mode": "sync"})
    result = build(tmp_path)
    assert result["varying"] == ["save_mode"]  # progress settings split nothing
    table = result["throughput"]
    # save_mode applies to saves only: the loads of both runs are one row
    assert list(zip(table["op"], table["save_mode"], table["runs"])) == [
        ("save", "async", 1), ("save", "sync", 1), ("load", "", 2)]
    saves = [s for s in lines(a)[1:] if s["op"] == "save"]
    begin = min(s["begin_wall_s"] for s in saves)
    mib = sum(s["bytes"] for s in saves) / MIB
    stall = max(s["begin_wall_s"] + s["stall_s"] for s in saves) - begin
    persisted = max(s["begin_wall_s"] + s["persisted_s"] for s in saves) - begin
    row = table.iloc[0]
    # What training pays is seconds (and a share of its interval), never bytes / a hand-off
    assert "blocked_mib_s" not in table
    assert row["stall_mean_s"] == pytest.approx(stall)
    assert row["train_lost_share"] == pytest.approx(0.1)
    assert row["persisted_mib_s"] == pytest.approx(mib / persisted)
    assert table.iloc[1]["stall_mean_s"] > 0 and math.isnan(table.iloc[1]["train_lost_share"])
    # over the loads that know what they fetched (the async run's)
    assert table.iloc[2]["fetched_ratio"] == pytest.approx(1.5, rel=1e-6)
    assert table.iloc[2]["note"] == "reads 1.50x"
    phases = result["phases"]
    assert phases.iloc[0]["blocked_s"] == pytest.approx(sum(s["blocked_s"] for s in saves) / 2)
    assert phases.iloc[0]["peak_rss_gib"] == pytest.approx(1.0)  # the larger rank's
    assert phases.iloc[0]["upload_s"] > phases.iloc[0]["stage_s"] > 0
    assert phases.iloc[2]["storage_s"] == pytest.approx(3 * phases.iloc[2]["deserialise_s"])
    assert math.isnan(phases.iloc[1]["peak_rss_gib"]) and math.isnan(phases.iloc[1]["stage_s"])
    text = report.render(result, "table", [], width=100)
    assert max(len(line) for line in text.splitlines()) <= 100
    assert "MiB/s blocked" not in text
    for header in ("stall s", "train lost %", "MiB/s persisted", "fetched/bytes", "blocked s",
                   "persisted s", "peak RSS GiB", "in client s", "upload s"):
        assert header in text, header
    assert "CUDA max GiB" not in text  # no value in any row: no column
    (line,) = async_lines(read_record_file(a).samples)
    assert f"training stalled {stall:.3f} s" in line and "MiB/s" not in line
    assert "training lost 0.200 s = 10.0% of a 2.000 s interval" in line


def test_request_stats_splits_groups_keep_request_log_does_not(tmp_path):
    # two embedded servers: two metrics URLs (new ports each run), one setup
    variant(tmp_path, "on", ONE_ITERATION, settings={
        "request_stats": True, "keep_request_log": True,
        "storage.metrics_url": "http://127.0.0.1:40001/metrics"})
    variant(tmp_path, "off", ONE_ITERATION, settings={
        "request_stats": False, "tune.budget_s": 5.0,
        "storage.metrics_url": "http://127.0.0.1:40002/metrics"})
    result = build(tmp_path)
    assert result["varying"] == ["request_stats"]
    assert list(result["throughput"]["runs"]) == [1, 1, 1, 1]
