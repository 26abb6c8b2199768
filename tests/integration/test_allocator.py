"""malloc=raised in real processes: glibc's thresholds raised by mallopt stop the page faults
of large blocks allocated and freed again (the cliff docs/metrics.md describes), and a run
records the allocator its ranks ran."""

from __future__ import annotations

import os
import subprocess
import sys

from dcp_fsdp.process import allocator

from tests.kit.cli import read_run, run_cli, s3_args, s3_env

FAULTS_PER_BYTE = """
import resource, sys, threading
from dcp_fsdp.process import allocator
if sys.argv[1] == "raised":
    allocator.raise_glibc_thresholds()
size, rounds = 64 * 2**20, 8

def blocks():
    for _ in range(rounds):
        block = bytearray(size)  # touched: zero-filled
        del block

before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
if sys.argv[2] == "thread":  # as the connector's native client allocates its parts
    worker = threading.Thread(target=blocks)
    worker.start()
    worker.join()
else:
    blocks()
after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
print((after - before) * resource.getpagesize() / (size * rounds))
"""


def faults_per_byte(mode: str, where: str = "main", env: dict[str, str] | None = None) -> float:
    done = subprocess.run([sys.executable, "-c", FAULTS_PER_BYTE, mode, where],
                          capture_output=True, text=True, check=True, timeout=60,
                          env={**os.environ, **(env or {})})
    return float(done.stdout)


def test_raised_thresholds_keep_64_mib_blocks_mapped():
    # glibc's defaults map and unmap every block above 32 MiB: each round faults it afresh
    assert faults_per_byte("default") > 0.9
    assert faults_per_byte("raised") < 0.2  # the first round only


def test_a_thread_s_64_mib_blocks_stay_mapped_only_in_one_arena():
    """A thread's own arena grows in heaps of 64 MiB at most, so its 64 MiB blocks are mapped
    afresh whatever the threshold; in the one arena malloc=raised gives a rank (from its
    environment as it starts, and from mallopt before its threads allocate) they stay on the
    heap."""
    thresholds_only = {k: v for k, v in allocator.ENVIRONMENT.items() if "THRESHOLD" in k}
    assert faults_per_byte("default", "thread", thresholds_only) > 0.9
    assert faults_per_byte("default", "thread", allocator.ENVIRONMENT) < 0.2
    assert faults_per_byte("raised", "thread") < 0.2


def test_a_run_records_its_allocator_and_the_threshold_setting(s3, s3_uri, tmp_path):
    refused = run_cli(["save-and-load", *s3_args(s3, s3_uri), "malloc=raised",
                       f"results_dir={tmp_path}"], env={**s3_env(s3), "MALLOC_ARENA_MAX": "4"})
    assert refused.returncode != 0
    assert "malloc=raised: it sets MALLOC_ARENA_MAX=1 in the ranks" in refused.stderr
    result = run_cli(["save-and-load", *s3_args(s3, s3_uri), "malloc=raised",
                      f"results_dir={tmp_path}"], env=s3_env(s3))
    assert result.returncode == 0, result.stderr
    run, _ = read_run(tmp_path)
    assert run["allocator"]["name"].startswith("glibc ")
    assert run["allocator"]["thresholds"] == "raised"
    # as the rank started: the launcher's values, which glibc read before any thread ran
    assert run["allocator"]["environment"] == allocator.ENVIRONMENT
    assert "fresh pages per byte" in result.stdout
