"""`dcp-fsdp tune`: every trial in one launch, its answer accepted by a run, and stoppable."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from tests.integration.test_interrupts import INTERRUPT_DEADLINE_S
from tests.kit.cli import read_until, run_cli, s3_args, s3_env, start_cli

TRIALS = 6


def _records(results):
    (session,) = [p for p in results.iterdir() if p.name.startswith("tune-")]
    runs = [json.loads(p.read_text().splitlines()[0]) for p in session.glob("*.jsonl")]
    # In trial order: record names carry the start second and a random tag, and two short
    # trials can start within one second (a quiet machine), so the names do not order them.
    runs.sort(key=lambda run: (run.get("tune") or {}).get("trial", 0))
    return session, runs


def test_tune_runs_every_trial_in_one_launch_and_its_override_line_runs(s3, s3_uri, tmp_path):
    results = tmp_path / "results"
    # malloc held (test_tune_measures_malloc_in_paired_launches runs its launches)
    tuned = run_cli(["tune", *s3_args(s3, s3_uri), "nproc=2", f"tune.trials={TRIALS}",
                     "tune.repeats=2", "tune.budget_s=600", f"results_dir={results}",
                     "malloc=default"], env=s3_env(s3), timeout_s=600)
    assert tuned.returncode == 0, f"{tuned.stdout}\n{tuned.stderr}"
    # One launch: the model was built (and announced) once for all the trials.
    assert tuned.stdout.count(": save-and-load model=tiny_llama") == 1, tuned.stdout
    # the search's trials, then the recommendation's efficiency trial
    assert tuned.stdout.count("tune: trial ") == TRIALS + 1, tuned.stdout
    lines = [line for line in tuned.stdout.splitlines() if line.startswith("OVERRIDES=")]
    assert len(lines) == 1, tuned.stdout
    overrides = lines[0].removeprefix("OVERRIDES=").split()
    given = dict(o.split("=", 1) for o in overrides)
    # every tuned setting; the connector's own only with the connector, the reader's gap
    # size only with the reader that has one
    connector = ["storage.part_size_mib", "storage.prefix_strategy",
                 "storage.throughput_target_gbps"]
    with_connector = given["storage.client"] == "s3torchconnector"
    dcps_reader = given["storage.read_ahead"] == "0"  # the tool's own reader has no kind
    assert set(given) == {
        "storage.thread_count", "storage.client", "plan_caching", "storage.read_ahead", "malloc",
        *(connector if with_connector else []),
        *(["storage.reader"] if with_connector and dcps_reader else []),
        *(["storage.max_gap_size_mib"]
          if with_connector and dcps_reader and given["storage.reader"] == "dcp_optimized"
          else [])}
    assert given["malloc"] == "default"  # given: held, not measured
    assert "recommended: " in tuned.stdout and "noise seen: " in tuned.stdout
    # Every trial is a normal run record in one session directory, with its role.
    session, runs = _records(results)
    assert len(runs) == TRIALS + 1
    assert all(r["command"] == "save-and-load" and r["status"] == "ok" for r in runs)
    assert [r["tune"]["role"] for r in runs][:1] == ["defaults"]
    # The ceiling: the recommendation's own trial, last, with its settings and raw rounds
    # beside its DCP rounds (not the defaults' client settings measured once at the start).
    efficiency_run = runs[-1]
    assert efficiency_run["tune"]["role"] == "ceiling"
    assert [r["config"]["ceiling"] for r in runs] == [False] * TRIALS + [True]
    summary = json.loads((session / "tune.json").read_text())
    assert efficiency_run["tune"]["settings"] == summary["best"]
    assert efficiency_run["config"]["iterations"] == 3
    ceiling = summary["ceiling"]["trial"]
    assert ceiling["save_mib_s"] > 0 and ceiling["raw_put_mib_s"] > 0
    assert ceiling["save_efficiency"] == pytest.approx(
        ceiling["save_mib_s"] / ceiling["raw_put_mib_s"], rel=1e-6)
    assert "efficiency of the recommendation against the ceiling (its own trial" in tuned.stdout
    runs = runs[:TRIALS]
    trial_settings = {json.dumps(r["tune"]["settings"], sort_keys=True) for r in runs}
    assert len(trial_settings) >= 2  # the storage settings changed between trials...
    assert len({json.dumps(r["init"]) for r in runs}) == 1  # ... the ranks did not
    assert len(summary["trials"]) == TRIALS
    # ... and the trials' checkpoints are gone.
    listing = run_cli(["list", *s3_args(s3, s3_uri)], env=s3_env(s3))
    assert not any(r["suffixes"][0] in listing.stdout for r in runs)
    # The printed line is accepted as it is by a normal run.
    check = run_cli(["save-and-load", *s3_args(s3, s3_uri), "nproc=2", *overrides,
                     f"results_dir={tmp_path / 'check'}"], env=s3_env(s3))
    assert check.returncode == 0, f"{check.stdout}\n{check.stderr}"


def test_tune_measures_malloc_in_paired_launches_or_says_it_had_no_room(tmp_path):
    """On the embedded server: after the search's one launch, the recommendation launched
    with malloc=default then malloc=raised per round, records beside the trials'; the one
    OVERRIDES= line (malloc in it) is accepted by a run as it is."""
    results = tmp_path / "results"
    tuned = run_cli(["tune", "nproc=1", "tune.trials=2", "tune.repeats=2", "tune.budget_s=400",
                     f"results_dir={results}"], timeout_s=600)
    assert tuned.returncode == 0, f"{tuned.stdout}\n{tuned.stderr}"
    lines = [line for line in tuned.stdout.splitlines() if line.startswith("OVERRIDES=")]
    assert len(lines) == 1 and tuned.stdout.rstrip().endswith(lines[0]), tuned.stdout
    overrides = lines[0].removeprefix("OVERRIDES=").split()
    session, runs = _records(results)
    summary = json.loads((session / "tune.json").read_text())
    found = summary["malloc"]
    assert dict(o.split("=", 1) for o in overrides)["malloc"] == found["chosen"]
    assert summary["overrides"]["malloc"] == found["chosen"]
    if found["status"] == "no_room":  # a machine slow enough that its start-up ate the share
        assert "malloc: not measured: its paired launches" in tuned.stdout
        assert found["budget_needed_s"] > 0
    else:
        assert found["status"] == "measured", found
        # in launch order, as tune.json lists them (their names do not order them)
        launches = [json.loads(open(path).readline()) for path in found["records"]]
        assert len([r for r in runs if r.get("tune") is None]) == len(launches)
        assert [r["config"]["malloc"] for r in launches] == ["default", "raised"] * len(
            found["ratios"])
        assert len(found["ratios"]) >= 1 and all(r["status"] == "ok" for r in launches)
        assert all(r["command"] == "save-and-load" for r in launches)
        assert "malloc: " in tuned.stdout and "paired ratio raised/default" in tuned.stdout
        # one line per launch, what it measured and that tune deleted its checkpoint; none of
        # a whole run's output (its table, nor 'deleted with the embedded S3 server at exit':
        # the tune's server lived on)
        said = [line for line in tuned.stdout.splitlines() if "tune: malloc round" in line]
        assert len(said) == len(launches), tuned.stdout
        for line, launch in zip(said, launches):
            assert f"malloc={launch['config']['malloc']}: save " in line, line
            assert line.endswith(f"its checkpoint {launch['suffixes'][0]} deleted by tune"), line
        assert "embedded S3 server at exit" not in tuned.stdout + tuned.stderr
        assert "| op " not in tuned.stdout and not list(session.glob("*.log"))
    check = run_cli(["save-and-load", "nproc=1", *overrides, f"results_dir={tmp_path / 'check'}"])
    assert check.returncode == 0, f"{check.stdout}\n{check.stderr}"


@pytest.mark.parametrize("how", ["group-sigint", "launcher-sigterm"])
def test_an_interrupt_stops_the_whole_tune_without_a_recommendation(s3, s3_uri, tmp_path, how):
    """Ctrl-C (the terminal's whole group) or SIGTERM to the launcher (scancel, kill)."""
    results = tmp_path / "results"
    process = start_cli(["tune", *s3_args(s3, s3_uri), "nproc=2", "tune.budget_s=3000",
                         f"results_dir={results}"], s3_env(s3))
    # one trial recorded: mid-search now (start-up takes minutes on a loaded machine)
    read_until(process, "tune: trial 1 ", timeout_s=300)
    signalled_at = time.monotonic()
    if how == "group-sigint":
        os.killpg(process.pid, signal.SIGINT)
    else:
        process.send_signal(signal.SIGTERM)
    try:
        output, _ = process.communicate(timeout=INTERRUPT_DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise AssertionError(f"{how}: still running {INTERRUPT_DEADLINE_S} s after the signal") from None
    assert process.returncode == 130, output
    assert time.monotonic() - signalled_at < INTERRUPT_DEADLINE_S
    assert "OVERRIDES=" not in output and "recommended" not in output, output
    assert "no recommendation from a cut search" in output, output
    assert "Traceback" not in output, output
    # The finished trials' records stay; the cut one says interrupted.
    session, runs = _records(results)
    assert sum(r["status"] == "ok" for r in runs) >= 1, runs
    assert [r["status"] for r in runs if r["status"] != "ok"] in ([], ["interrupted"]), " | ".join(
        f"trial {(r.get('tune') or {}).get('trial')} {r['status']} ({r.get('end_cause')}): "
        f"{r.get('error')}" for r in runs if r["status"] != "ok")
    assert not (session / "tune.json").exists()
    leftover = subprocess.run(["pgrep", "-s", str(process.pid)], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", leftover.stdout


@pytest.mark.parametrize("budget", ["0", "1"])
def test_tune_refuses_a_budget_too_small_for_one_trial_in_one_line(tmp_path, budget):
    result = run_cli(["tune", f"tune.budget_s={budget}", f"results_dir={tmp_path}"])
    assert result.returncode == 2
    assert result.stderr.startswith(f"dcp-fsdp: error: tune.budget_s={budget}: ")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not any(tmp_path.iterdir())
