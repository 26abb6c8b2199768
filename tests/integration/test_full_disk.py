"""A results_dir that fills up: the record goes to the fallback directory (said in a
warning) and nothing half-written stays behind. The full disk is a real 64 KiB tmpfs, in a
mount namespace of the test's own (unshare -m)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.kit.cli import REPO, clean_env

WRITE = """
import sys
from dcp_fsdp.telemetry.records import RunRecord, Sample, write_records
run = RunRecord(run_id="r-full", command="save")
samples = [Sample(op="save", iteration=i, suffix="s", rank=0, host="h", begin_wall_s=0.0,
                  end_wall_s=1.0, begin_mono_s=0.0, end_mono_s=1.0, duration_s=1.0, bytes=1,
                  barrier_wait_s=0.0) for i in range(2000)]  # ~1 MiB of lines: over 64 KiB
try:
    write_records(__import__("pathlib").Path(sys.argv[1]) / "r-full.jsonl", run, samples)
except OSError as error:
    print("ENOSPC" if error.errno == 28 else f"errno {error.errno}")
"""


def test_a_record_that_fills_the_disk_leaves_no_temporary_file(tmp_path):
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.fail("unshare -m is needed (root, util-linux): the full disk cannot be made")
    full = tmp_path / "full"
    full.mkdir()
    script = (f"mount -t tmpfs -o size=64k tmpfs {full} && "
              f"{sys.executable} -c '{WRITE}' {full} && ls -A {full}")
    result = subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=REPO, env=clean_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split()
    assert lines == ["ENOSPC"], f"left on the full disk: {lines[1:]}"


def test_a_rank_under_plain_torchrun_leaves_no_torch_cache_in_tmpdir(tmp_path):
    """torch makes $TMPDIR/torchinductor_$USER in every rank; ours is the rank's own and
    goes with it. (torchrun's own torchelastic_* directory is the batch scripts' to place.)"""
    from tests.kit.cli import run_cli

    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    result = run_cli(["save", "storage=fs", f"storage.path={tmp_path / 'store'}",
                      f"results_dir={tmp_path / 'results'}"], env={"TMPDIR": str(tmpdir)},
                     torchrun_nproc=1)
    assert result.returncode == 0, result.stderr
    left = sorted(p.name for p in tmpdir.iterdir() if not p.name.startswith("torchelastic_"))
    assert left == []


def test_a_save_to_a_full_file_system_names_the_full_disk(tmp_path):
    """DCP's error for a full disk is torch's zip writer's "unexpected pos": the rank probes
    the storage after the failure and the record leads with "No space left on device"."""
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.fail("unshare -m is needed (root, util-linux): the full disk cannot be made")
    full = tmp_path / "full"
    full.mkdir()
    results = tmp_path / "results"
    script = (f"mount -t tmpfs -o size=4m tmpfs {full} && exec {sys.executable} -m dcp_fsdp save "
              f"model=tiny_llama nproc=1 storage=fs storage.path={full}/store results_dir={results}")
    result = subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=REPO, env=clean_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    record = json.loads(next(results.glob("*.jsonl")).read_text().splitlines()[0])
    assert record["status"] == "failed" and "No space left on device" in record["error"], record["error"]
    assert "No space left on device" in result.stderr
