"""The batch scripts run by bash. Moved from tests/unit/test_inputs_units.py."""

from __future__ import annotations

import subprocess

from tests.kit.cli import REPO


def test_savebatch_prints_a_load_command_that_keeps_the_settings():
    script = ('source batch/common.sh; NODES=2 URI="s3://b/my ckpt" MODEL=L7b REGION=us-east-2 '
              'OVERRIDES="state=model_and_optimizer storage.thread_count=4"; '
              'load_command "a-1,a-2" model=L7b iterations=2 suffix=a storage.part_size_mib=16')
    line = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()
    words = subprocess.run(["bash", "-c", f"printf '%s\\n' {line}"], capture_output=True,
                           text=True, check=True).stdout.splitlines()
    assert words == ["SUFFIX=a-2", "URI=s3://b/my ckpt", "REGION=us-east-2", "MODEL=L7b",
                     "OVERRIDES=state=model_and_optimizer storage.thread_count=4", "sbatch",
                     "--nodes", "2", "batch/loadbatch.sh", "model=L7b",
                     "storage.part_size_mib=16"]
    header = (REPO / "batch" / "loadbatch.sh").read_text()
    assert "cut -d, -f1" not in header and "tail -1" in header  # the last suffix, as savebatch
