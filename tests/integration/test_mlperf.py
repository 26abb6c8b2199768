"""protocol=mlperf: MLPerf Storage v3.0's checkpointing protocol on real gloo ranks (10 saves,
then 10 loads of the last checkpoint, the page cache dropped before each fs load), and the
figure it publishes (rank 0's mean) printed beside ours, each recomputed here from the record."""

from __future__ import annotations

import re

import pytest

from dcp_fsdp.units import GIB
from dcp_fsdp.storage import pagecache
from tests.kit.cli import read_run, run_cli, s3_args, s3_env



def printed_figures(stdout: str) -> dict[str, tuple[float, float, float]]:
    """{op: (MLPerf, ours slowest-rank, ours aggregate)} from the run's MLPerf lines."""
    found = {}
    for op, mlperf, slowest, aggregate in re.findall(
            r"^  (save|load): MLPerf ([\d.]+) \| ours: slowest-rank ([\d.]+), aggregate ([\d.]+)",
            stdout, flags=re.M):
        found[op] = (float(mlperf), float(slowest), float(aggregate))
    return found


def recomputed(samples: list[dict], op: str) -> tuple[float, float, float]:
    """The three figures from the record's samples, by hand (docs/metrics.md, docs/mlperf.md)."""
    rows = [s for s in samples if s["op"] == op]
    iterations = sorted({s["iteration"] for s in rows})
    rates, slowest_s, span_s, total = [], 0.0, 0.0, 0
    for iteration in iterations:
        ranks = [s for s in rows if s["iteration"] == iteration]
        nbytes = sum(s["bytes"] for s in ranks)
        rank0 = next(s for s in ranks if s["rank"] == 0)
        rates.append(nbytes / GIB / rank0["duration_s"])
        slowest_s += max(s["duration_s"] for s in ranks)
        span_s += max(s["end_wall_s"] for s in ranks) - min(s["begin_wall_s"] for s in ranks)
        total += nbytes
    return sum(rates) / len(rates), total / GIB / slowest_s, total / GIB / span_s


# 2 ranks on S3 (rank 0's mean and the pooled figures differ there); 1 on fs (the page cache)
@pytest.mark.parametrize("storage, nproc", [("s3", 2), ("fs", 1)])
def test_mlperf_protocol_saves_ten_then_loads_the_last_ten_times(tmp_path, storage, nproc,
                                                                  request):
    if storage == "s3":
        s3, uri = request.getfixturevalue("s3"), request.getfixturevalue("s3_uri")
        where, env = s3_args(s3, uri), s3_env(s3)
    else:
        where, env = ["storage=fs", f"storage.path={tmp_path / 'ckpt'}"], None
    result = run_cli(["save-and-load", "protocol=mlperf", "model=tiny_llama", f"nproc={nproc}",
                      "progress=false", *where, f"results_dir={tmp_path / 'results'}"], env=env)
    assert result.returncode == 0, result.stderr
    run, samples = read_run(tmp_path / "results")
    assert run["status"] == "ok" and run["config"]["iterations"] == 10
    saves = [s for s in samples if s["op"] == "save"]
    loads = [s for s in samples if s["op"] == "load"]
    assert sorted({s["iteration"] for s in saves}) == sorted({s["iteration"] for s in loads}) \
        == list(range(1, 11))
    assert len(saves) == len(loads) == 10 * nproc and len(run["suffixes"]) == 10
    # every load reads the last checkpoint, after every save ended, and is verified
    assert {s["suffix"] for s in loads} == {run["suffixes"][-1]}
    assert min(s["begin_wall_s"] for s in loads) > max(s["end_wall_s"] for s in saves)
    assert run["integrity"] == {run["suffixes"][-1]: {"checked": True, "reason": None}}
    if storage == "fs":  # the page cache dropped before each load (or tmpfs: it cannot be)
        assert {s["cache_policy"] for s in loads} <= {pagecache.DROPPED, pagecache.TMPFS}
    printed = printed_figures(result.stdout)
    assert set(printed) == {"save", "load"}, result.stdout
    for op in ("save", "load"):
        by_hand = recomputed(samples, op)
        # MLPerf's figure is rank 0's mean, not the slowest rank's; ours are the pooled ones
        assert printed[op] == tuple(float(f"{value:.4f}") for value in by_hand), (op, by_hand)
    assert "rank 0's own seconds" in result.stdout
    # `report` recomputes the same lines from the record
    report = run_cli(["report", str(tmp_path / "results")])
    assert report.returncode == 0, report.stderr
    assert printed_figures(report.stdout) == printed, report.stdout


@pytest.mark.parametrize("args, message", [
    (["save-and-load", "protocol=mlperf", "iterations=3"],
     "iterations=3: protocol=mlperf fixes 10 saves, then 10 loads of the last; drop "
     "iterations, or drop protocol=mlperf"),
    (["save", "protocol=mlperf"],
     "protocol=mlperf: MLPerf's checkpointing protocol saves then loads; run it with dcp-fsdp "
     "save-and-load (not save), or drop protocol"),
    (["save-and-load", "protocol=mlperf", "ceiling=true"],
     "ceiling=true: protocol=mlperf times only its saves and loads; drop ceiling, or drop "
     "protocol=mlperf"),
])
def test_a_setting_that_conflicts_with_the_protocol_is_refused_in_one_line(tmp_path, args,
                                                                           message):
    result = run_cli([*args, "storage=fs", f"storage.path={tmp_path / 'c'}",
                      f"results_dir={tmp_path / 'r'}"])
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [f"dcp-fsdp: error: {message}"]
    assert not (tmp_path / "c").exists() and not (tmp_path / "r").exists()


def test_an_mlperf_workload_this_machine_cannot_hold_is_refused_in_seconds(tmp_path):
    """mlperf_llama3_405b (756 GiB in bf16): the light parent's arithmetic refuses it before
    any rank (`plan` answers for it: tests/unit/test_models.py, docs/mlperf.md)."""
    result = run_cli(["save-and-load", "protocol=mlperf", "model=mlperf_llama3_405b", "nproc=1",
                      "storage=fs", f"storage.path={tmp_path / 'c'}",
                      f"results_dir={tmp_path / 'r'}"])
    errors = [line for line in result.stderr.splitlines() if line.startswith("dcp-fsdp: error:")]
    assert result.returncode != 0 and len(errors) == 1, result.stderr
    assert "model=mlperf_llama3_405b model.dtype=bf16" in errors[0] and "Traceback" not in result.stderr
    assert result.elapsed_s < 15, f"took {result.elapsed_s:.1f} s"
    assert not (tmp_path / "c").exists()
