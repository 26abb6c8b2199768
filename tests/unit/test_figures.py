"""One definition per figure (telemetry/figures.py): the end-of-run table, `report`, tune and
the benchmarks agree; slowest-rank MiB/s, efficiency per iteration, spread, read
amplification, request statistics that cannot go quietly to zero, and the report's groups."""

from __future__ import annotations

import math

import pytest

from dcp_fsdp.units import GIB, MIB
from dcp_fsdp.analysis import report
from dcp_fsdp.telemetry.figures import NOISY_SPREAD, summary
from dcp_fsdp.analysis.metrics import per_operation, run_figures, samples_frame
from dcp_fsdp.rank.tune_trials import figures_of
from dcp_fsdp.telemetry.records import read_record_file
from tests.unit.analysis_kit import ONE_ITERATION, TWO_ITERATIONS, lines, variant


def build(directory):
    runs, samples, _ = report.read_records(report.record_files([str(directory)]))
    return report.build(runs, samples)


def sample(rank, begin, end, nbytes, op="save", iteration=1, run_id="r", **extra):
    return {"run_id": run_id, "op": op, "iteration": iteration, "suffix": f"s{iteration}",
            "rank": rank, "begin_wall_s": begin, "end_wall_s": end, "duration_s": end - begin,
            "bytes": nbytes, "barrier_wait_s": 0.0, **extra}


def slower_second_iteration(row: dict) -> dict:
    """Iteration 2 takes three times as long: the median of the iterations' rates and the
    pooled rate differ."""
    if row["iteration"] == 2:
        length = row["end_wall_s"] - row["begin_wall_s"]
        row["end_wall_s"] = row["begin_wall_s"] + 3 * length
        row["end_mono_s"] = row["begin_mono_s"] + 3 * length
        row["duration_s"] = 3 * row["duration_s"]
    return row


def test_one_record_one_figure_in_the_run_table_the_report_and_tune(tmp_path):
    path = variant(tmp_path, "two", TWO_ITERATIONS, sample=slower_second_iteration)
    headers, rows, _ = run_figures(lines(path)[1:])
    table = build(tmp_path)["throughput"]
    tune = figures_of(read_record_file(path).samples)
    for op in ("save", "load"):
        (row,) = [r for r in rows if r[0] == f"{op} (all)"]
        cell = dict(zip(headers, row))["aggregate MiB/s"]
        reported = table.loc[table["op"] == op, "aggregate_mib_s"].iloc[0]
        assert cell == f"{reported:.1f}"
        assert tune[f"{op}_mib_s"] == pytest.approx(reported)
        assert tune[f"{op}_bytes"] / MIB / tune[f"{op}_s"] == pytest.approx(reported)
        assert summary(read_record_file(path).samples)[op]["aggregate_mib_s"] == \
            pytest.approx(reported)
        # pooled: every byte over every second (not the median of the iterations' rates)
        ops = [r for r in rows if r[0] == op]
        spans = sum(float(dict(zip(headers, r))["span s"]) for r in ops)
        mib = sum(float(dict(zip(headers, r))["MiB"]) for r in ops)
        assert float(cell) == pytest.approx(mib / spans, rel=0.01)


def test_slowest_rank_mib_s_is_the_checkpoint_over_the_slowest_rank():
    samples = [sample(0, 100.0, 102.0, 100 * MIB), sample(1, 100.5, 104.0, 100 * MIB)]
    row = per_operation(samples_frame(samples)).iloc[0]
    assert row["slowest_rank_mib_s"] == pytest.approx(200 / 3.5)
    assert row["aggregate_mib_s"] == pytest.approx(200 / 4.0)
    headers, rows, _ = run_figures(samples)
    assert dict(zip(headers, rows[0]))["slowest-rank MiB/s"] == f"{200 / 3.5:.1f}"


def test_a_rank_rate_of_no_time_is_unknown_not_infinite():
    """A rank's zero duration (a clock that did not move) gives no rate: NaN, shown empty, as
    every other rate of no time; inf would print "inf" and win every maximum."""
    frame = samples_frame([sample(0, 100.0, 100.0, 100 * MIB), sample(1, 100.0, 102.0, 100 * MIB)])
    assert frame["rank_mib_s"].iloc[0] != frame["rank_mib_s"].iloc[0]
    assert frame["rank_mib_s"].iloc[1] == pytest.approx(50.0)


def test_efficiency_divides_by_the_median_raw_round_of_the_run():
    samples = []
    # the raw rate differs between iterations (2, 0.5 and 1 MiB/s): the ceiling is their
    # median (1 MiB/s), neither the lucky round nor the stalled one
    for iteration, (dcp_s, raw_s) in enumerate(((2.0, 1.0), (4.0, 4.0), (4.0, 2.0)), start=1):
        base = 100.0 * iteration
        samples += [sample(r, base, base + dcp_s, MIB, iteration=iteration) for r in (0, 1)]
        samples += [sample(r, base + 10, base + 10 + raw_s, MIB, op="raw_put",
                           iteration=iteration) for r in (0, 1)]
    headers, rows, notes = run_figures(samples)
    cells = {(r[0], str(r[1])): dict(zip(headers, r)) for r in rows}
    assert cells[("save", "1")]["efficiency"] == "1.00"  # 1 MiB/s over 1 MiB/s
    assert cells[("save", "2")]["efficiency"] == "0.50"  # 0.5 MiB/s over 1 MiB/s
    # pooled: the 6 MiB would take 6 s at the ceiling; they took 10 s
    assert cells[("save (all)", "3")]["efficiency"] == f"{6 / 10:.2f}"
    assert cells[("raw_put", "1")]["efficiency"] == ""
    assert not any("above the ceiling" in line for line in notes)
    # the ceiling's line: its median with the rounds' spread, and the efficiency against it
    (line,) = [n for n in notes if n.startswith("save: DCP")]
    assert "raw PUT 1.0 (0.5-2.0, 3 rounds): efficiency 0.60" in line


def test_a_save_faster_than_the_median_raw_round_is_marked_above_the_ceiling():
    samples = []
    for iteration, (dcp_s, raw_s) in enumerate(((1.0, 2.0), (2.0, 2.0)), start=1):
        base = 100.0 * iteration
        samples += [sample(r, base, base + dcp_s, MIB, iteration=iteration) for r in (0, 1)]
        samples += [sample(r, base + 10, base + 10 + raw_s, MIB, op="raw_put",
                           iteration=iteration) for r in (0, 1)]
    headers, rows, notes = run_figures(samples)
    cells = {(r[0], str(r[1])): dict(zip(headers, r)) for r in rows}
    assert cells[("save", "1")]["efficiency"] == "2.00"
    assert cells[("save", "1")]["note"] == "above the ceiling (2.00)"
    assert cells[("save", "2")]["note"] == ""  # 1.00: at the ceiling, not above it
    assert any(line.startswith("above the ceiling:") for line in notes)


def test_a_ceiling_alone_has_no_efficiency_column():
    samples = [sample(r, 0.0, 1.0, MIB, op=op) for op in ("raw_put", "raw_get") for r in (0, 1)]
    headers, rows, _ = run_figures(samples)
    assert "efficiency" not in headers
    assert len(rows[0]) == len(headers)


def test_spread_is_shown_and_a_noisy_group_is_marked_with_a_hint(tmp_path):
    samples = [sample(r, 10.0 * i, 10.0 * i + length, MIB, iteration=i)
               for i, length in ((1, 1.0), (2, 2.0)) for r in (0, 1)]
    headers, rows, notes = run_figures(samples)
    (summary_row,) = [dict(zip(headers, r)) for r in rows if r[0] == "save (all)"]
    spread = (2.0 - 1.0) / 1.5  # (max - min) / median of 2 and 1 MiB/s
    assert spread > NOISY_SPREAD
    assert summary_row["note"] == f"spread {100 * spread:.0f} % NOISY"
    assert any("NOISY" in line and "delay_s" in line and "iterations" in line
               for line in notes)
    quiet = [sample(r, 10.0 * i, 10.0 * i + 1.0, MIB, iteration=i) for i in (1, 2)
             for r in (0, 1)]
    headers, rows, notes = run_figures(quiet)
    assert dict(zip(headers, rows[-1]))["note"] == "spread 0 %" and not notes

    path = variant(tmp_path, "noisy", TWO_ITERATIONS, sample=slower_second_iteration)
    result = build(tmp_path)
    table = result["throughput"]
    save = table[table["op"] == "save"].iloc[0]
    ops = per_operation(samples_frame(lines(path)[1:]))
    rates = sorted(ops.loc[ops["op"] == "save", "aggregate_mib_s"])
    assert save["spread"] == pytest.approx((rates[1] - rates[0]) / ((rates[0] + rates[1]) / 2))
    assert "noisy" in save["note"]
    assert "noisy" in report.render(result, "table", [], width=100)
    (hint,) = result["notes"]  # `report` prints it under the tables
    assert "noisy" in hint and "delay_s" in hint and "quieter machine" in hint


def amplified(row: dict) -> dict:
    if row["op"] == "load":
        row["fetched_bytes"] = 2 * row["bytes"]
    return row


def test_read_amplification_on_the_loads_own_line(tmp_path):
    path = variant(tmp_path, "reshard", ONE_ITERATION, sample=amplified)
    headers, rows, _ = run_figures(lines(path)[1:])
    cells = {r[0]: dict(zip(headers, r)) for r in rows}
    assert cells["load"]["note"] == "reads 2.00x" and cells["save"]["note"] == ""
    table = build(tmp_path)["throughput"]
    assert table.loc[table["op"] == "load", "note"].iloc[0] == "reads 2.00x"
    assert "note" not in run_figures(lines(ONE_ITERATION)[1:])[0]  # nothing to say: no column


def test_latency_is_per_request_type_never_pooled(tmp_path):
    headers, rows, _ = run_figures(lines(ONE_ITERATION)[1:])
    cells = {r[0]: dict(zip(headers, r)) for r in rows}
    assert cells["save"]["latency p50/p99 ms by type"].startswith("UploadPart ")
    assert cells["load"]["latency p50/p99 ms by type"].startswith("GetObject ")
    variant(tmp_path, "one", ONE_ITERATION)
    result = build(tmp_path)
    assert "latency_p50_ms" not in result["throughput"]
    assert set(result["types"]["request_type"]) >= {"UploadPart", "HeadObject", "GetObject"}


def unparsed(row: dict) -> dict:
    if row["op"] == "save" and row["rank"] == 1:
        row["requests"] = None  # none parsed: unknown
    return row


def test_an_operation_with_unknown_requests_shows_none_not_a_partial_count(tmp_path):
    path = variant(tmp_path, "unparsed", ONE_ITERATION, sample=unparsed)
    headers, rows, _ = run_figures(lines(path)[1:])
    cells = {r[0]: dict(zip(headers, r)) for r in rows}
    assert cells["save"]["requests"] == "" and cells["save"]["failed/throttled"] == ""
    assert cells["load"]["requests"] != ""
    table = build(tmp_path)["throughput"]
    save = table[table["op"] == "save"].iloc[0]
    assert math.isnan(save["requests_per_op"]) and math.isnan(save["failures"])


def test_versions_backend_and_device_split_groups_when_they_differ(tmp_path):
    variant(tmp_path, "old", ONE_ITERATION)
    variant(tmp_path, "new", ONE_ITERATION,
            run={"versions": {"torch": "2.14.0", "s3torchconnector": "1.6.0"}})
    variant(tmp_path, "gpu", ONE_ITERATION,
            run={"backend": "nccl", "device": "cuda", "gpus": {"model": "NVIDIA H100", "count": 1}})
    result = build(tmp_path)
    assert {"torch", "connector", "process_group", "device"} <= set(result["group_keys"])
    table = result["throughput"]
    saves = table[table["op"] == "save"]
    assert len(saves) == 3 and set(saves["runs"]) == {1}
    assert "cuda (NVIDIA H100)" in set(saves["device"])
    # nothing differs: no such columns
    only = tmp_path / "only"
    only.mkdir()
    variant(only, "a", ONE_ITERATION)
    variant(only, "b", ONE_ITERATION)
    assert not {"torch", "device"} & set(build(only)["group_keys"])


def test_a_save_only_setting_does_not_split_loads(tmp_path):
    variant(tmp_path, "plain", ONE_ITERATION, settings={"train_step_s": 0.0})
    variant(tmp_path, "steps", ONE_ITERATION, settings={"train_step_s": 0.5})
    table = build(tmp_path)["throughput"]
    assert len(table[table["op"] == "save"]) == 2
    loads = table[table["op"] == "load"]
    assert len(loads) == 1 and loads.iloc[0]["runs"] == 2
    assert loads.iloc[0]["train_step_s"] == ""


def test_end_of_run_summary_prints_the_notes(tmp_path, capsys):
    from dcp_fsdp.analysis.run_summary import print_run_summary

    path = variant(tmp_path, "noisy", TWO_ITERATIONS, sample=slower_second_iteration)
    parsed = read_record_file(path)
    print_run_summary(parsed.runs[0], parsed.samples)
    out = capsys.readouterr().out
    assert "slowest-rank MiB/s" in out and "NOISY" in out and "quieter machine" in out


@pytest.mark.parametrize("policy, says", [
    ("tmpfs-not-droppable", "load: storage.path is on a memory file system (tmpfs or ramfs)"),
    ("resident-after-drop", "load: some of the checkpoint's pages stayed in the page cache"),
])
def test_end_of_run_summary_says_when_the_loads_read_the_page_cache(tmp_path, capsys, policy, says):
    """Issue 49: protocol=mlperf on tmpfs recorded cache_policy tmpfs-not-droppable but said
    nothing on the console, while its figure was memory's. One line now says it, and what it
    means for the figures (MLPerf's named under protocol=mlperf)."""
    from dcp_fsdp.analysis.run_summary import print_run_summary

    def kept(row: dict) -> dict:
        return {**row, "cache_policy": policy} if row["op"] == "load" else row

    for protocol in ("mlperf", "default"):
        path = variant(tmp_path, f"cache-{protocol}", TWO_ITERATIONS, sample=kept,
                       settings={"protocol": protocol})
        parsed = read_record_file(path)
        print_run_summary(parsed.runs[0], parsed.samples)
        said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("load: ")]
        assert len(said) == 1 and said[0].startswith(says), said
        assert ("MLPerf's included" in said[0]) == (protocol == "mlperf"), said
    dropped = read_record_file(variant(tmp_path, "dropped", TWO_ITERATIONS, sample=lambda row: {
        **row, "cache_policy": "dropped" if row["op"] == "load" else None}))
    print_run_summary(dropped.runs[0], dropped.samples)
    assert "load: " not in capsys.readouterr().out


def test_mlperf_figure_is_rank_0s_mean_not_the_slowest_rank():
    """MLPerf Storage's published figure (DLIO): per checkpoint, its GiB over rank 0's own
    seconds, then the mean; ours take the slowest rank and pool every byte over every second."""
    from dcp_fsdp.telemetry.figures import mlperf_gib_s

    gib = 2**30
    rows = [sample(0, 0.0, 1.0, gib, iteration=1), sample(1, 0.0, 2.0, gib, iteration=1),
            sample(0, 10.0, 14.0, gib, iteration=2), sample(1, 10.0, 14.0, gib, iteration=2)]
    assert GIB == gib
    assert mlperf_gib_s(rows, "save") == (2 / 1 + 2 / 4) / 2  # 1.25 GiB/s
    figures = summary(rows)["save"]
    assert figures["slowest_rank_mib_s"] * MIB / gib == 4 / (2 + 4)  # 0.67 GiB/s
    assert math.isnan(mlperf_gib_s(rows, "load"))
    assert math.isnan(mlperf_gib_s([sample(1, 0.0, 1.0, gib)], "save"))  # no rank 0


def test_gets_broken_mid_body_are_said_with_the_most_that_came_down():
    """Issue 31 item 2: egress counts whole GET bodies; a GET that broke mid-body adds an
    unknown part of its range, said as a bound (and none said where none broke, or where
    an older record has no such count)."""
    from dcp_fsdp.telemetry.figures import broken_note

    assert broken_note(2, 16 * MIB, 29.5 * MIB, 29.5 * MIB) == (
        "2 GET(s) broke mid-body: up to 16.0 MiB more came down (reads up to 1.54x)")
    assert broken_note(0, 0, 29.5 * MIB, 29.5 * MIB) == ""
    assert broken_note(math.nan, math.nan, 29.5 * MIB, 29.5 * MIB) == ""
    # fsspec: what came down of the broken GETs is counted (aiohttp's own count), no bound
    assert broken_note(2, 0, 29.5 * MIB, 29.5 * MIB) == (
        "2 GET(s) broke mid-body and were sent again (egress counts what came down)")
