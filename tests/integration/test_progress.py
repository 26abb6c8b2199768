"""The progress heartbeat: rank 0 says how far a running save / load has got; off with
progress=false. (Its cost on the timed figures: README, "What the harness costs".)"""

from __future__ import annotations

import re

from tests.kit.cli import read_run, run_cli, s3_args, s3_env


def test_heartbeat_lines_during_operations_and_none_when_off(s3, s3_uri, tmp_path):
    on = run_cli(["save-and-load", "nproc=2", "model=tiny_gpt2", "progress_interval_s=0.05",
                  *s3_args(s3, s3_uri), f"results_dir={tmp_path / 'on'}"], env=s3_env(s3))
    assert on.returncode == 0, on.stdout + on.stderr
    beats = [line for line in on.stdout.splitlines() if "still running" in line]
    assert any(line.startswith("[dcp-fsdp] save iteration 1: still running, rank 0 moved ")
               for line in beats), on.stdout
    for line in beats:
        assert re.search(r"moved [\d.]+ of [\d.]+ MiB in [\d.]+ s \([\d.]+ MiB/s\)$", line), line
    assert read_run(tmp_path / "on")[0]["status"] == "ok"

    off = run_cli(["save-and-load", "nproc=2", "model=tiny_gpt2", "progress=false",
                   "progress_interval_s=0.05", *s3_args(s3, s3_uri),
                   f"results_dir={tmp_path / 'off'}"], env=s3_env(s3))
    assert off.returncode == 0, off.stdout + off.stderr
    assert "still running" not in off.stdout
