"""The report's scaling view and the per-prefix request-rate check, on a real 2-rank record
and a 4-rank copy of it (ranks 2 and 3 as ranks 0 and 1 did, half as fast)."""

from __future__ import annotations

import copy

import pytest

from dcp_fsdp.analysis import costs, report, scaling
from dcp_fsdp.analysis.groups import build
from dcp_fsdp.analysis.sources import read_records, record_files
from tests.unit.analysis_kit import ONE_ITERATION, variant


def four_ranks(sample: dict) -> list[dict]:
    """Ranks 0-3, each operation taking twice as long: per rank half the MiB/s of 2 ranks."""
    out = []
    for offset in (0, 2):
        s = copy.deepcopy(sample)
        s["rank"] += offset
        s["duration_s"] *= 2
        s["end_wall_s"] = s["begin_wall_s"] + s["duration_s"]
        out.append(s)
    return out


def result_of(directory):
    runs, samples, _ = read_records(record_files([str(directory)]))
    return build(runs, samples), runs


def test_scaling_view_per_size_with_efficiency_against_the_smallest(tmp_path, capsys):
    variant(tmp_path, "two", ONE_ITERATION)
    variant(tmp_path, "four", ONE_ITERATION, run={"world_size": 4}, sample=four_ranks)
    result, _ = result_of(tmp_path)
    frames = scaling.scaling_frames(result)
    assert [f.iloc[0]["op"] for f in frames] == ["save", "load"]
    for frame in frames:
        assert list(frame["ranks"]) == [2, 4]
        two, four = frame.iloc[0], frame.iloc[1]
        assert four["mib_s_per_rank"] == pytest.approx(four["aggregate_mib_s"] / 4)
        assert four["mib_s_per_node"] == pytest.approx(four["aggregate_mib_s"])  # one node
        assert four["scaling_efficiency"] == pytest.approx(
            (four["aggregate_mib_s"] / 4) / (two["aggregate_mib_s"] / 2))
        # twice the bytes in about twice the span (ranks begin a little apart): about the
        # same aggregate, half of it per rank
        assert four["scaling_efficiency"] == pytest.approx(0.5, rel=0.01)
        assert two["scaling_efficiency"] == 1.0
        assert 0 < two["plan_share"] < 1 and 0 < two["barrier_share"] < 1
    assert report.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Scaling across sizes" in out and "0.50" in out
    assert scaling.plot(result, tmp_path / "plots") == [tmp_path / "plots" / "scaling.png"]
    assert (tmp_path / "plots" / "scaling.png").stat().st_size > 0


def test_no_scaling_view_for_one_size(tmp_path):
    variant(tmp_path, "a", ONE_ITERATION)
    variant(tmp_path, "b", ONE_ITERATION)
    result, _ = result_of(tmp_path)
    assert scaling.scaling_frames(result) == [] and scaling.render(result) == ""
    assert scaling.plot(result, tmp_path / "plots") == []


def test_prefix_rate_multiplied_to_a_node_count_names_the_spreading_strategy(tmp_path):
    variant(tmp_path, "default", ONE_ITERATION)
    result, runs = result_of(tmp_path)
    prices = costs.load_prices()
    save = result["throughput"].query("op == 'save'").iloc[0]
    kinds = result["types"].query("op == 'save'")
    counts = dict(zip(kinds["request_type"], kinds["requests_per_op"]))
    charge = costs.request_charge(counts, prices)
    per_node_s = (charge.put_class + charge.free) / save["duration_mean_s"] / save["nodes"]
    quiet = int(scaling.PUT_LIMIT_PER_S / per_node_s)  # nodes that stay under the limit
    assert not [w for w in scaling.prefix_warnings(result, runs, quiet, prices)
                if w.startswith("save")]
    busy = quiet * 4
    (warning,) = [w for w in scaling.prefix_warnings(result, runs, busy, prices)
                  if w.startswith("save")]
    assert f"x {busy} nodes" in warning and "storage.prefix_strategy=default (1 prefix(es))" \
        in warning
    assert "storage.prefix_strategy=hex storage.prefix_count=" in warning
    # the same run with its keys spread over enough prefixes: no warning
    variant(tmp_path, "default", ONE_ITERATION, settings={
        "storage.prefix_strategy": "hex", "storage.prefix_count": 8})
    result, runs = result_of(tmp_path)
    assert not [w for w in scaling.prefix_warnings(result, runs, busy, prices)
                if w.startswith("save")]
