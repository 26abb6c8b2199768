"""`dcp-fsdp report` as a command: globs, failed runs, a missing path. Moved from
tests/unit/test_report.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.kit.cli import REPO, clean_env
from tests.unit.test_report import write_records


@pytest.fixture
def records(tmp_path):
    return write_records(tmp_path / "results")


def test_cli_report_on_globs_and_failures_only(records, tmp_path):
    command = [sys.executable, "-m", "dcp_fsdp", "report", str(records / "*.jsonl"),
               "--format", "md", "--csv", str(tmp_path / "out.csv"), "--plot",
               str(tmp_path / "plots")]
    result = subprocess.run(command, cwd=REPO, env=clean_env(), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "### Throughput" in result.stdout and (tmp_path / "out.csv").exists()
    assert "sub" not in result.stdout  # the glob named only the top-level files
    # the records span two world sizes: the scaling plot too
    assert len(list((tmp_path / "plots").glob("*.png"))) == 4
    assert (tmp_path / "plots" / "scaling.png").exists()
    only_failed = subprocess.run([sys.executable, "-m", "dcp_fsdp", "report",
                                  str(records / "failed.jsonl")], cwd=REPO, env=clean_env(),
                                 capture_output=True, text=True, timeout=120)
    assert only_failed.returncode == 0
    assert "no successful save or load" in only_failed.stdout
    assert "Left out of every figure: 1 run(s)" in only_failed.stdout
    missing = subprocess.run([sys.executable, "-m", "dcp_fsdp", "report", str(tmp_path / "nope")],
                             cwd=REPO, env=clean_env(), capture_output=True, text=True,
                             timeout=120)
    assert missing.returncode == 2 and "no such file or directory" in missing.stderr
