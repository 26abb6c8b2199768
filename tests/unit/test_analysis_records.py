"""A cut-off or incomplete record never enters a figure as a whole one."""

from __future__ import annotations

import shutil

from dcp_fsdp.units import MIB
from dcp_fsdp.analysis import report
from tests.unit.analysis_kit import (ONE_ITERATION, TWO_ITERATIONS, cut_last_line,
                                     drop_last_line, lines, variant)


def build(directory):
    runs, samples, warnings = report.read_records(report.record_files([str(directory)]))
    return report.build(runs, samples), warnings


def test_the_real_record_whole_enters_the_figures_with_every_rank(tmp_path):
    shutil.copy(ONE_ITERATION, tmp_path / "run.jsonl")
    result, warnings = build(tmp_path)
    samples = lines(ONE_ITERATION)[1:]
    assert not warnings and result["not_ok"].empty
    table = result["throughput"].set_index("op")
    for op in ("save", "load"):
        total = sum(s["bytes"] for s in samples if s["op"] == op)
        assert table.loc[op, "checkpoint_gib"] * 2**30 == total  # both ranks' bytes


def test_a_record_whose_last_line_is_cut_is_left_out_and_listed(tmp_path):
    """rank 1's load sample is the last line: cut part way, the run said ok at half the bytes
    before; now it is in no figure, and the report says which run and why."""
    path = tmp_path / "run.jsonl"
    shutil.copy(ONE_ITERATION, path)
    run_id = lines(path)[0]["run_id"]
    assert lines(path)[-1]["rank"] == 1 and lines(path)[-1]["op"] == "load"
    cut_last_line(path)
    result, warnings = build(tmp_path)
    assert result["throughput"].empty  # neither its save nor its load
    left_out = result["not_ok"].set_index("run_id")
    assert left_out.loc[run_id, "status"] == "incomplete"
    assert "unreadable line" in left_out.loc[run_id, "error"]
    text = report.render(result, "table", warnings)
    assert "1 incomplete record(s)" in text and "no successful save or load" in text
    listed = text.split("Left out of every figure")[1]
    assert f"{run_id} (save-and-load, incomplete)" in " ".join(listed.split())


def test_a_record_cut_at_a_line_boundary_misses_a_rank_and_is_left_out(tmp_path):
    path = tmp_path / "run.jsonl"
    shutil.copy(ONE_ITERATION, path)
    drop_last_line(path)
    variant(tmp_path, "whole", ONE_ITERATION)  # a whole run beside it still reports
    result, warnings = build(tmp_path)
    assert not warnings  # nothing unreadable: only the rank count gives it away
    reason = result["not_ok"].set_index("status").loc["incomplete", "error"]
    assert reason == "load iteration 1: no sample of rank(s) 1 (world_size 2)"
    table = result["throughput"]
    assert list(table["op"]) == ["save", "load"] and set(table["runs"]) == {1}
    assert table["failed_runs"].tolist() == [0, 0]  # an incomplete record is not a failure
    whole_bytes = sum(s["bytes"] for s in lines(ONE_ITERATION)[1:] if s["op"] == "load")
    assert table.loc[table["op"] == "load", "checkpoint_gib"].item() * 2**30 == whole_bytes


def test_world_size_unknown_and_ranks_differing_between_operations(tmp_path):
    path = variant(tmp_path, "nows", ONE_ITERATION, run={"world_size": None})
    drop_last_line(path)
    result, _ = build(tmp_path)
    assert result["throughput"].empty
    assert result["not_ok"]["error"].tolist() == [
        "world_size unknown and the ranks differ between operations"]


def test_a_missing_iteration_of_a_schema_2_record_is_left_out(tmp_path):
    variant(tmp_path, "short", ONE_ITERATION,
            sample=lambda s: None if s["op"] == "load" else s)
    result, _ = build(tmp_path)
    assert result["not_ok"]["error"].tolist() == ["no load sample of iteration(s) 1 "
                                                  "(iterations=1)"]


def test_a_failed_run_keeps_rank_0_only_and_is_listed_as_failed_not_incomplete(tmp_path):
    variant(tmp_path, "ok", TWO_ITERATIONS)
    variant(tmp_path, "bad", TWO_ITERATIONS, status="failed", error="rank 1: boom")
    result, _ = build(tmp_path)
    assert result["not_ok"][["run_id", "status"]].values.tolist() == [["bad", "failed"]]
    assert result["throughput"]["failed_runs"].tolist() == [1, 1]
    ops = result["operations"]
    assert (ops["bytes"] > MIB).all() and set(ops["run_id"]) == {"ok"}
