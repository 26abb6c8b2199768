"""Checkpoint interval, training time lost and dollars (analysis/decisions.py, costs.py):
the formulas against cases worked by hand, and `report --node-mtbf-hours` on a real record."""

from __future__ import annotations

import math

import pytest

from dcp_fsdp.units import GIB
from dcp_fsdp.analysis import costs, decisions, report
from tests.unit.analysis_kit import ONE_ITERATION, lines, variant


def test_job_mtbf_young_and_daly_by_hand():
    # 6000 h per node over 512 nodes: 6000 x 3600 / 512 = 42,187.5 s
    assert decisions.job_mtbf_s(6000, 512) == 42187.5
    # C = 60 s: sqrt(2 x 60 x 42,187.5) = sqrt(5,062,500) = 2,250 s; Daly's higher order:
    # C / 2M = 1 / 1,406.25, its root 1 / 37.5: 2,250 x (1 + 1/112.5 + 1/12,656.25) - 60
    # = 2,250 + 20 + 0.1778 - 60 = 2,210.18 s
    assert decisions.young_interval_s(60, 42187.5) == pytest.approx(2250.0)
    assert decisions.daly_interval_s(60, 42187.5) == pytest.approx(2210.1778, abs=1e-4)
    # C >= 2M is beyond Daly's range: checkpoint every M
    assert decisions.daly_interval_s(2 * 42187.5, 42187.5) == 42187.5


@pytest.mark.parametrize("mtbf_s", [1.0, 42187.5])
def test_daly_has_no_step_at_half_the_mtbf_and_ends_at_eight_ninths_of_it(mtbf_s):
    """The first-order form's sqrt(2CM) - C is M/2 at C = M/2, where the old code jumped to M;
    the higher-order form goes smoothly through it: M (1 + 1/6 + 1/36) - M/2 = 25/36 M."""
    half = mtbf_s / 2
    below, at, above = (decisions.daly_interval_s(c, mtbf_s)
                        for c in (half * (1 - 1e-9), half, half * (1 + 1e-9)))
    assert at == pytest.approx(25 / 36 * mtbf_s)
    assert below == pytest.approx(at) and above == pytest.approx(at)
    # just below 2M: 2M (1 + 1/3 + 1/9) - 2M = 8/9 M; from 2M on, M
    assert decisions.daly_interval_s(2 * mtbf_s * (1 - 1e-12), mtbf_s) == \
        pytest.approx(8 / 9 * mtbf_s)
    assert decisions.daly_interval_s(2 * mtbf_s, mtbf_s) == mtbf_s


def test_the_model_says_where_it_stops_holding():
    m = 1000.0
    # x = (tau + C + L + R) / M: 0.2 is the first-order model's limit
    assert decisions.validity(150, 40, m, 10, 0, None) == (decisions.HOLDS, pytest.approx(0.2))
    assert decisions.validity(150, 40, m, 10.1, 0, None)[0] == decisions.ROUGH
    lost = decisions.time_lost(150, 40, m, 10)
    assert decisions.validity(150, 40, m, 10, 0, lost)[0] == decisions.HOLDS
    whole = decisions.time_lost(10, 9, m, 100)  # 90 % stalls + 0.5 % rework + 10 % restarts
    assert whole.total >= 1
    assert decisions.validity(10, 9, m, 100, 0, whole)[0] == decisions.MEANINGLESS


def test_llama3_failure_rate_is_about_6000_node_hours():
    """419 interruptions in 54 days on 2,048 nodes: the job's MTBF 54 x 24 / 419 = 3.09 h,
    i.e. 3.09 x 2,048 = 6,335 h per node."""
    node_hours = 54 * 24 / 419 * 2048
    assert node_hours == pytest.approx(6335, abs=1)
    assert decisions.job_mtbf_s(node_hours, 2048) / 3600 == pytest.approx(3.093, abs=1e-3)


def test_time_lost_by_hand():
    # tau 2,190 s, C 60 s, M 42,187.5 s, R 300 s: stalls 60/2190 = 2.7397 %,
    # rework 1,095/42,187.5 = 2.5956 %, restarts 300/42,187.5 = 0.7111 %; 6.0464 % in all
    lost = decisions.time_lost(2190, 60, 42187.5, 300)
    assert lost.stalls == pytest.approx(0.027397, abs=1e-6)
    assert lost.rework == pytest.approx(0.025956, abs=1e-6)
    assert lost.restarts == pytest.approx(0.0071111, abs=1e-7)
    assert lost.total == pytest.approx(0.060464, abs=1e-6)
    # async: the last durable checkpoint is older by the upload lag (60 s more rework)
    lagged = decisions.time_lost(2190, 60, 42187.5, 300, lag_s=60)
    assert lagged.rework - lost.rework == pytest.approx(60 / 42187.5)
    # the optimum is the minimum: a little shorter or longer loses more
    best = decisions.young_interval_s(60, 42187.5)
    at_best = decisions.time_lost(best, 60, 42187.5, 300).total
    assert at_best < decisions.time_lost(best * 0.8, 60, 42187.5, 300).total
    assert at_best < decisions.time_lost(best * 1.25, 60, 42187.5, 300).total


def test_request_and_storage_dollars_by_hand():
    prices = costs.load_prices()
    assert prices.checked and prices.source.startswith("https://")
    # the field notes' 2-rank save + load: 28 PUT-class, 4 HEAD (GET-class), 1 delete (free)
    charge = costs.request_charge({"CreateMultipartUpload": 5, "UploadPart": 17,
                                   "CompleteMultipartUpload": 5, "CopyObject": 1,
                                   "Default": 1, "HeadObject": 4}, prices)
    assert (charge.put_class, charge.get_class, charge.free) == (28, 4, 1)
    assert charge.dollars == pytest.approx(28 / 1000 * 0.005 + 4 / 1000 * 0.0004)  # $0.0001416
    assert costs.storage_dollars_per_month(10 * GIB, prices) == pytest.approx(0.23)
    # hourly saves of $0.001, one failure a day (a $0.002 load), 3 x $0.23 a month kept:
    # 0.024 + 0.002 + 3 x 0.23 x 12 / 365 = 0.0486849
    day = costs.dollars_per_day(3600, 86400, 0.001, 0.002, 0.23, 3)
    assert day["saves"] == pytest.approx(0.024)
    assert day["restarts"] == pytest.approx(0.002)
    assert day["total"] == pytest.approx(0.0486849, abs=1e-7)


def test_a_bad_prices_file_is_one_line(tmp_path):
    broken = tmp_path / "p.yaml"
    broken.write_text("put_per_1000: cheap\n")
    with pytest.raises(costs.PricesError, match="missing .*source"):
        costs.load_prices(broken)
    broken.write_text("put_per_1000: -1\nget_per_1000: 0\nstorage_per_gb_month: 0\n"
                      "gb_bytes: 1\nsource: me\nchecked: today\n")
    with pytest.raises(costs.PricesError, match="put_per_1000=-1 must be a number >= 0"):
        costs.load_prices(broken)


def test_report_prints_interval_share_and_dollars_with_inputs(tmp_path, capsys):
    record = lines(ONE_ITERATION)
    run, samples = record[0], record[1:]
    code = report.main([str(ONE_ITERATION), "--node-mtbf-hours", "6000", "--nodes", "512",
                        "--interval-minutes", "30", "--keep", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "node MTBF 6000 h (--node-mtbf-hours); 512 nodes: job MTBF M = 11.7 h" in out
    # C (sync) = the save's span over its ranks; R = the load's span + the slowest init
    saves = [s for s in samples if s["op"] == "save"]
    loads = [s for s in samples if s["op"] == "load"]
    c = max(s["end_wall_s"] for s in saves) - min(s["begin_wall_s"] for s in saves)
    r = (max(s["end_wall_s"] for s in loads) - min(s["begin_wall_s"] for s in loads)
         + max(i["init_s"] for i in run["init"]))
    m = 6000 * 3600 / 512
    daly = decisions.daly_interval_s(c, m)
    assert f"{daly / 60:.1f}" in out and f"{math.sqrt(2 * c * m) / 60:.1f}" in out
    assert f"{decisions.time_lost(daly, c, m, r).total:.2%}" in out
    assert f"{decisions.time_lost(1800, c, m, r).total:.2%}" in out
    # dollars: the save's own requests by type, priced
    prices = costs.load_prices()
    counts: dict[str, float] = {}
    for s in saves:
        for kind, entry in s["requests"]["by_type"].items():
            counts[kind] = counts.get(kind, 0) + entry["count"]
    assert f"${costs.request_charge(counts, prices).dollars:.3g}" in out
    assert "S3 Standard, us-east-1" in out and "checked 2026-11" in out
    assert f"{sum(s['bytes'] for s in saves) / GIB:.3f}" in out
    assert "2 checkpoint(s) kept" in out


def test_a_file_system_shows_no_dollars(tmp_path, capsys):
    fs = variant(tmp_path, "fs", ONE_ITERATION, run={"storage": {"kind": "fs"}},
                 settings={"storage.kind": "fs"}, sample=lambda s: {**s, "requests": None})
    assert report.main([str(fs), "--node-mtbf-hours", "6000"]) == 0
    out = capsys.readouterr().out
    assert "dollars: none (a file system: no request or storage charges)" in out
    row = next(line for line in out.splitlines() if line.startswith("#1 "))
    assert "no dollars (fs)" in row and "$" not in row
    assert "1 nodes: job MTBF M = 6,000 h" in out
    assert "NOTE: no --nodes: M is for the runs' own 1 node(s), not the training job's" in out


@pytest.mark.parametrize("argv, message", [
    (["--nodes", "512"], "--nodes needs --node-mtbf-hours H"),
    (["--node-mtbf-hours", "0"], "--node-mtbf-hours 0: give a number of hours above 0"),
    (["--node-mtbf-hours", "6000", "--keep", "0"], "--keep 0: give a whole number, 1 or more"),
    (["--node-mtbf-hours", "6000", "--keep", "abc"], "--keep abc: give a whole number, 1 or more"),
    (["--nodes", "1.5", "--node-mtbf-hours", "6000"], "--nodes 1.5: give a whole number, 1 or more"),
    (["--node-mtbf-hours", "6000", "--prices", "/nonexistent.yaml"],
     "--prices /nonexistent.yaml: cannot read it"),
])
def test_bad_decision_options_are_one_line(argv, message, capsys):
    assert report.main([str(ONE_ITERATION), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("dcp-fsdp: error: report:")


def test_async_cost_is_the_training_lost_and_the_upload_lag_adds_rework(tmp_path):
    """Async next to sync: C is the slowest rank's training lost per save, L the upload after
    the stall (persisted span - stall span)."""
    def as_async(s):
        if s["op"] == "save":
            s.update(save_mode="async", stall_s=0.1 + s["rank"] * 0.05, staged_s=0.1,
                     blocked_s=0.01, persisted_s=s["duration_s"], interval_s=5.0,
                     train_lost_s=0.3 + s["rank"] * 0.1, train_lost_share=0.06)
        return s

    variant(tmp_path, "async", ONE_ITERATION, settings={"save_mode": "async"}, sample=as_async)
    variant(tmp_path, "sync", ONE_ITERATION, settings={"save_mode": "sync"})
    from dcp_fsdp.analysis.groups import build
    from dcp_fsdp.analysis.sources import read_records, record_files

    runs, samples, _ = read_records(record_files([str(tmp_path)]))
    groups = {g.save_mode: g for g in decisions.gather(build(runs, samples), runs)}
    saves = [s for s in lines(tmp_path / "async.jsonl")[1:] if s["op"] == "save"]
    begin = min(s["begin_wall_s"] for s in saves)
    stall = max(s["begin_wall_s"] + s["stall_s"] for s in saves) - begin
    persisted = max(s["begin_wall_s"] + s["persisted_s"] for s in saves) - begin
    assert groups["async"].checkpoint_s == pytest.approx(0.4)  # rank 1's 0.3 + 0.1
    assert groups["async"].cost_is == "training lost per save"
    assert groups["async"].lag_s == pytest.approx(persisted - stall)
    assert groups["sync"].lag_s == 0 and groups["sync"].cost_is == "save"
    # an interval shorter than the upload would queue saves: raised to the upload time
    short = decisions.plan(groups["async"], node_mtbf_hours=0.0002, nodes=1,
                           interval_minutes=None)
    assert short.raised and short.daly_s == pytest.approx(persisted)
