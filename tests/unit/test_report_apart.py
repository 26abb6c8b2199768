"""Figures that must not be pooled or priced wrongly, through the real report on synthetic
records: overlapping (cadenced) async saves count a second once; first (cold) and later
(warm) operations shown apart and each decision figure from the right one; dollars only from
complete request counts; the interval model says where it stops holding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dcp_fsdp.units import MIB
from dcp_fsdp.analysis import decision_text, decisions, report
from dcp_fsdp.analysis.costs import load_prices
from dcp_fsdp.analysis.metrics import run_figures
from tests.unit.analysis_kit import ONE_ITERATION, TWO_ITERATIONS, lines, variant


def build(directory: Path):
    runs, samples, _ = report.read_records(report.record_files([str(directory)]))
    return report.build(runs, samples), runs


def report_out(paths, capsys, *argv) -> str:
    assert report.main([*map(str, paths), *argv]) == 0
    return capsys.readouterr().out


def cadenced(directory: Path, begins=(0.0, 2.0, 4.0), length_s=4.0) -> Path:
    """Async saves with a cadence: each persists 4 s after it began, the next begins 2 s
    after it: saves 1-2 and 2-3 overlap by 2 s."""
    base = 1_795_000_000.0
    run = {"record": "run", "schema_version": 5, "run_id": "cad", "command": "save",
           "status": "ok", "config": {"command": "save", "save_mode": "async",
                                      "model": {"preset": "tiny_llama"},
                                      "storage": {"kind": "fs", "path": "/x"}},
           "node_count": 1, "world_size": 2, "model": {"preset": "tiny_llama"},
           "storage": {"kind": "fs"}}
    rows = [run]
    for iteration, begin in enumerate(begins, 1):
        for rank in (0, 1):
            start = base + begin + 0.01 * rank
            rows.append({"record": "sample", "run_id": "cad", "op": "save",
                         "iteration": iteration,
                         "suffix": f"s{iteration}", "rank": rank, "host": "h",
                         "begin_wall_s": start, "end_wall_s": start + length_s - 0.01 * rank,
                         "begin_mono_s": start, "end_mono_s": start + length_s - 0.01 * rank,
                         "duration_s": length_s - 0.01 * rank, "bytes": 100 * MIB,
                         "barrier_wait_s": 0.0, "save_mode": "async", "stall_s": 0.5,
                         "blocked_s": 0.1, "persisted_s": length_s - 0.01 * rank})
    path = directory / "cad.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# -- 9: pooled spans with a cadence ------------------------------------------------------

def test_overlapping_async_saves_count_each_second_once(tmp_path):
    cadenced(tmp_path)
    result, _ = build(tmp_path)
    (row,) = result["throughput"].to_dict("records")
    # 6 x 100 MiB over the union 0 .. 8 s, not over 3 x 4 = 12 s
    assert row["aggregate_mib_s"] == pytest.approx(600 / 8)
    assert row["persisted_mib_s"] == pytest.approx(600 / 8)
    # slowest rank: 3 x 4 s less the 2 x 2 s counted twice
    assert row["slowest_rank_mib_s"] == pytest.approx(600 / 8)
    # iteration 1 alone; the later ones over their own union 2 .. 8 s
    assert row["first_mib_s"] == pytest.approx(200 / 4)
    assert row["later_mib_s"] == pytest.approx(400 / 6)
    # the end-of-run table's "(all)" row: the same definition
    headers, rows, _ = run_figures(lines(tmp_path / "cad.jsonl")[1:])
    pooled_row = dict(zip(headers, rows[-1]))
    assert pooled_row["op"] == "save (all)" and pooled_row["aggregate MiB/s"] == "75.0"


def test_saves_apart_in_time_still_add_their_spans(tmp_path):
    cadenced(tmp_path, begins=(0.0, 10.0, 20.0))
    result, _ = build(tmp_path)
    assert result["throughput"]["aggregate_mib_s"].iloc[0] == pytest.approx(600 / 12)


# -- issue 31 WRONG 7: the part size splits loads too -------------------------------------

def test_loads_of_different_part_sizes_are_rows_apart(tmp_path):
    """A load's ranged GETs are cut by storage.part_size_mib (5 vs 3 GETs in docs/report.md's
    example): loads of two part sizes are two rows, as saves are; a save-only setting
    (train_step_s) still leaves the load rows whole."""
    for run_id, part_size_mib in (("ps8", 8), ("ps16", 16)):
        variant(tmp_path, run_id, settings={"storage.part_size_mib": part_size_mib,
                                            "train_step_s": part_size_mib / 8})
    table = build(tmp_path)[0]["throughput"]
    rows = sorted(zip(table["op"], table["storage.part_size_mib"], table["train_step_s"]))
    assert rows == [("load", "16", ""), ("load", "8", ""),
                    ("save", "16", "2.0"), ("save", "8", "1.0")], rows
    assert list(table["runs"]) == [1, 1, 1, 1]


# -- 10: first and later operations apart -------------------------------------------------

def test_first_and_later_operations_are_shown_apart_and_used_where_they_belong(tmp_path,
                                                                                  capsys):
    samples = lines(TWO_ITERATIONS)[1:]

    def span(op, iteration):
        rows = [s for s in samples if s["op"] == op and s["iteration"] == iteration]
        return (max(s["end_wall_s"] for s in rows) - min(s["begin_wall_s"] for s in rows),
                sum(s["bytes"] for s in rows))

    result, runs = build(TWO_ITERATIONS)
    table = result["throughput"].set_index("op")
    for op in ("save", "load"):
        (first_s, nbytes), (later_s, _) = span(op, 1), span(op, 2)
        assert table.loc[op, "first_mib_s"] == pytest.approx(nbytes / MIB / first_s)
        assert table.loc[op, "later_mib_s"] == pytest.approx(nbytes / MIB / later_s)
        assert table.loc[op, "first_dur_s"] == pytest.approx(first_s)
    (group,) = decisions.gather(result, runs)
    assert group.checkpoint_s == pytest.approx(span("save", 2)[0])  # warm: the later save
    assert group.save_from == "later" and group.load_from == "first"
    assert group.load_s == pytest.approx(span("load", 1)[0])  # a restart: the first load
    out = report_out([TWO_ITERATIONS], capsys, "--node-mtbf-hours", "6000", "--wide")
    assert "MiB/s first/later" in out
    assert f"C = {span('save', 2)[0]:.3f} s (save, warm saves)" in out
    assert f"first load {span('load', 1)[0]:.2f} s" in out


def test_one_iteration_prices_its_first_save_and_says_so(tmp_path, capsys):
    out = report_out([ONE_ITERATION], capsys, "--node-mtbf-hours", "6000")
    assert "first save only: no warm one" in out


# -- 8: restart without our value fill; where the model stops holding ----------------------

def test_restart_leaves_out_the_value_fill(tmp_path):
    init = lines(ONE_ITERATION)[0]["init"]
    filled = [{**row, "fill_s": 1.5 + row["rank"]} for row in init]
    variant(tmp_path, "fill", ONE_ITERATION, run={"init": filled})
    result, runs = build(tmp_path)
    (group,) = decisions.gather(result, runs)
    assert group.startup_s == pytest.approx(max(r["init_s"] - r["fill_s"] for r in filled))
    assert not group.fill_in_startup
    old, old_runs = build(ONE_ITERATION)  # a record before fill_s: said so
    (before,) = decisions.gather(old, old_runs)
    assert before.fill_in_startup and before.startup_s == max(r["init_s"] for r in init)


def test_inputs_beyond_the_model_are_warned_in_one_line(capsys):
    out = report_out([ONE_ITERATION], capsys, "--node-mtbf-hours", "6000",
                     "--nodes", "100000000")
    warned = [line for line in out.splitlines() if "WARNING" in line]
    assert len(warned) == 1 and "meaningless inputs: training lost >= 100 %" in warned[0]
    assert "the checkpoint (C) takes longer than the job's MTBF" in warned[0]
    assert "C >= 2M: beyond Daly's form, the interval is M" in warned[0]
    assert not any(line.startswith("  (") for line in out.splitlines())
    row = next(line for line in out.splitlines() if line.startswith("#1 "))
    assert decisions.MEANINGLESS in row
    quiet = report_out([ONE_ITERATION], capsys, "--node-mtbf-hours", "6000",
                       "--nodes", "512")
    assert "WARNING" not in quiet and decisions.HOLDS in quiet


def test_the_first_order_limit_is_flagged_between_holding_and_meaningless():
    result, runs = build(ONE_ITERATION)
    (group,) = decisions.gather(result, runs)
    c, r = group.checkpoint_s, group.restart_s
    # M where (tau + C + R) / M is about 0.3 at Daly's tau: above the limit, below 100 %
    mtbf_s = 4 * (c + r)
    p = decisions.plan(group, node_mtbf_hours=mtbf_s / 3600, nodes=1, interval_minutes=None)
    assert p.at_daly is not None
    assert p.first_order_x > decisions.FIRST_ORDER_LIMIT and p.at_daly.total < 1
    assert p.validity == decisions.ROUGH
    (line,) = decision_text.warnings(p)
    assert "beyond the first-order model" in line
    far = decisions.plan(group, node_mtbf_hours=1000 * (c + r) / 3600, nodes=1,
                         interval_minutes=None)
    assert far.validity == decisions.HOLDS and decision_text.warnings(far) == []


# -- 5: dollars only from complete request counts ------------------------------------------

def without_requests(ranks=(0, 1), ops=("save", "load"), empty=False):
    def change(s):
        if s["op"] in ops and s["rank"] in ranks:
            s["requests"] = ({**s["requests"], "count": 0, "by_type": {}} if empty else None)
        return s
    return change


def with_unparsed(rank=1, op="save"):
    def change(s):
        if s["op"] == op and s["rank"] == rank:
            s["requests"] = {**s["requests"], "unparsed": 2}  # lines the counts lack
        return s
    return change


@pytest.mark.parametrize("change, unpriced", [
    (without_requests(), "save 2/2, load 2/2"),  # request_stats=false
    (with_unparsed(), "save 1/2"),  # issue 31: priced from counts that lacked requests
    (without_requests(ranks=(1,), ops=("save",)), "save 1/2"),  # one rank's log unparsed
    (without_requests(ops=("save",), empty=True), "save 2/2"),  # none parsed, bytes moved
])
def test_partial_request_counts_are_not_priced_and_named(tmp_path, capsys, change, unpriced):
    path = variant(tmp_path, "partial", ONE_ITERATION, sample=change)
    out = report_out([path], capsys, "--node-mtbf-hours", "6000")
    assert "$0 " not in out and "(0 PUT-class" not in out
    assert "save not priced: request counts missing in" in out
    assert "per day at" not in out  # no total from part of the charges
    header = next(line for line in out.splitlines() if line.startswith("#    mode"))
    assert "no request counts (samples)" in header
    row = next(line for line in out.splitlines() if line.startswith("#1 "))
    assert row.rstrip().endswith(unpriced)
    result, runs = build(path)
    (group,) = decisions.gather(result, runs)
    cost = decision_text.dollars(decisions.plan(group, 6000, None, None), load_prices(), 1)
    assert cost is not None and cost.save is None and cost.day is None
    assert "save" in cost.unpriced and (cost.load is None) == ("load" in cost.unpriced)
    # the by-type table has no rows for a group with a sample missing (a partial sum)
    types = result["types"]
    assert types.empty or types[types["op"] == "save"].empty


def test_a_run_with_late_requests_is_not_priced(tmp_path, capsys):
    """Issue 31: requests of a timed operation whose lines reached the log after its window
    (counted untimed, as `late`) are charged too: counts without them would price low."""
    untimed = {"count": 3, "by_type": {"GetObject": {"count": 3}}, "late": 3}
    path = variant(tmp_path, "late", ONE_ITERATION, run={"untimed_requests": untimed})
    out = report_out([path], capsys, "--node-mtbf-hours", "6000")
    assert "save not priced: request counts missing in" in out and "per day at" not in out


def test_complete_counts_are_priced_and_the_column_left_out(capsys):
    out = report_out([ONE_ITERATION], capsys, "--node-mtbf-hours", "6000")
    assert "no request counts" not in out and "per day at the Daly interval" in out


# -- clock spread across nodes (issue 23, item 6) -----------------------------------------

def test_a_run_whose_nodes_clocks_disagree_is_named_and_one_node_is_not(tmp_path):
    path = cadenced(tmp_path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[0].update(node_count=2, clock_spread_s=0.08)  # 80 ms: 2 % of a 4 s span
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result, _ = build(tmp_path)
    skew = [note for note in result["notes"] if "wall clocks" in note]
    assert len(skew) == 1 and "run cad" in skew[0] and "80 ms" in skew[0]
    rows[0].update(node_count=1)  # one host: one clock, whatever the barrier jitter
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result, _ = build(tmp_path)
    assert not [note for note in result["notes"] if "wall clocks" in note]


# -- ranks forked (the test suite's switch) or exec'd (issue 47, item 4) --------------------

@pytest.mark.parametrize("starts, apart", [(("exec", "fork"), True), (("exec", "exec"), False),
                                           (("exec", None), False)])
def test_forked_runs_are_never_pooled_with_execd_ones_and_are_named(tmp_path, starts, apart):
    """Two runs of the same work, one whose ranks were exec'd and one whose ranks were forked
    from the agent (run line rank_start): two rows per operation and a caution line, never
    one pooled row. An older record (no rank_start) splits nothing."""
    for number, start in enumerate(starts):
        variant(tmp_path, f"r{number}", run={"rank_start": start})
    result, _ = build(tmp_path)
    saves = result["throughput"][result["throughput"]["op"] == "save"]
    assert ("rank_start" in result["varying"]) is apart
    assert len(saves) == (2 if apart else 1)
    if apart:
        assert sorted(saves["rank_start"]) == ["exec", "fork"]
    forked = [note for note in result["notes"] if "rank_start=fork" in note]
    assert len(forked) == (1 if "fork" in starts else 0)
    if forked:
        assert forked[0].startswith("1 run(s) with forked ranks")
