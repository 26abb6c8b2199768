"""malloc=raised in real processes: glibc's thresholds raised by mallopt stop the page faults
of large blocks allocated and freed again (the cliff docs/metrics.md describes), and a run
records the allocator its ranks ran."""

from __future__ import annotations

import subprocess
import sys

from tests.kit.cli import read_run, run_cli, s3_args, s3_env

FAULTS_PER_BYTE = """
import resource, sys
from dcp_fsdp.process import allocator
if sys.argv[1] == "raised":
    allocator.raise_glibc_thresholds()
size, rounds = 64 * 2**20, 8
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(rounds):
    block = bytearray(size)  # touched: zero-filled
    del block
after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
print((after - before) * resource.getpagesize() / (size * rounds))
"""


def faults_per_byte(mode: str) -> float:
    done = subprocess.run([sys.executable, "-c", FAULTS_PER_BYTE, mode], capture_output=True,
                          text=True, check=True, timeout=60)
    return float(done.stdout)


def test_raised_thresholds_keep_64_mib_blocks_mapped():
    # glibc's defaults map and unmap every block above 32 MiB: each round faults it afresh
    assert faults_per_byte("default") > 0.9
    assert faults_per_byte("raised") < 0.2  # the first round only


def test_a_run_records_its_allocator_and_the_threshold_setting(s3, s3_uri, tmp_path):
    result = run_cli(["save-and-load", *s3_args(s3, s3_uri), "malloc=raised",
                      f"results_dir={tmp_path}"], env={**s3_env(s3), "MALLOC_ARENA_MAX": "4"})
    assert result.returncode == 0, result.stderr
    run, _ = read_run(tmp_path)
    assert run["allocator"]["name"].startswith("glibc ")
    assert run["allocator"]["thresholds"] == "raised"
    assert run["allocator"]["environment"] == {"MALLOC_ARENA_MAX": "4"}  # as the rank started
    assert "fresh pages per byte" in result.stdout
