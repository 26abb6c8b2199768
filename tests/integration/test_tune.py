"""`dcp-fsdp tune`: a real search within its budget, and its answer accepted by a run."""

from __future__ import annotations

import json

from tests.kit.cli import run_cli, s3_args, s3_env

BUDGET_S = 120


def test_tune_stays_in_budget_and_its_override_line_runs(s3, s3_uri, tmp_path):
    results = tmp_path / "results"
    tuned = run_cli(["tune", *s3_args(s3, s3_uri), "nproc=2", f"tune.budget_s={BUDGET_S}",
                     f"results_dir={results}"], env=s3_env(s3), timeout_s=BUDGET_S * 2)
    assert tuned.returncode == 0, f"{tuned.stdout}\n{tuned.stderr}"
    assert tuned.elapsed_s <= BUDGET_S * 1.1, f"took {tuned.elapsed_s:.0f} s\n{tuned.stdout}"
    lines = [line for line in tuned.stdout.splitlines() if line.startswith("OVERRIDES=")]
    assert len(lines) == 1, tuned.stdout
    overrides = lines[0].removeprefix("OVERRIDES=").split()
    assert {o.split("=")[0] for o in overrides} == {
        "storage.thread_count", "storage.part_size_mib", "storage.reader",
        "storage.prefix_strategy", "storage.throughput_target_gbps"}
    assert "gain over the defaults" in tuned.stdout and "efficiency" in tuned.stdout
    # Every trial is a normal run with its record in one session directory.
    (session,) = [p for p in results.iterdir() if p.name.startswith("tune-")]
    records = sorted(session.glob("*.jsonl"))
    assert len(records) >= 2
    runs = [json.loads(p.read_text().splitlines()[0]) for p in records]
    assert all(r["command"] == "save-and-load" and r["status"] == "ok" for r in runs)
    assert sum(r["config"]["ceiling"] for r in runs) == 1  # the defaults, once
    # ... and the trials' checkpoints are gone.
    listing = run_cli(["list", *s3_args(s3, s3_uri)], env=s3_env(s3))
    assert not any(r["suffixes"][0] in listing.stdout for r in runs)
    # The printed line is accepted as it is by a normal run.
    check = run_cli(["save-and-load", *s3_args(s3, s3_uri), "nproc=2", *overrides,
                     f"results_dir={tmp_path / 'check'}"], env=s3_env(s3))
    assert check.returncode == 0, f"{check.stdout}\n{check.stderr}"


def test_tune_rejects_a_bad_budget_before_any_trial(tmp_path):
    result = run_cli(["tune", "tune.budget_s=0", f"results_dir={tmp_path}"])
    assert result.returncode == 2
    assert "tune.budget_s=0: must be more than 0" in result.stderr
    assert not any(tmp_path.iterdir())
