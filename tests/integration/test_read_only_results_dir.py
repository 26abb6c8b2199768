"""A results_dir nobody can write in, root included: under root a read-only bind mount
(`mount`, a process), else mode 0555. Moved from tests/unit/test_checks.py."""

from __future__ import annotations

import os
import subprocess

import pytest

from dcp_fsdp.errors import UserError
from dcp_fsdp.launch import checks

ROOT = os.geteuid() == 0  # root writes into read-only directories


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory nobody can write in, root included: a read-only bind mount of it onto
    itself under root (permission bits do not stop root), mode 0555 otherwise."""
    locked = tmp_path / "locked"
    locked.mkdir()
    if not ROOT:
        locked.chmod(0o555)
        yield locked
        locked.chmod(0o755)
        return
    mount = subprocess.run(["mount", "--bind", str(locked), str(locked)], capture_output=True,
                           text=True)
    if mount.returncode:
        pytest.skip(f"root, and a read-only bind mount is not allowed here: {mount.stderr.strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(locked)], check=True)
        yield locked
    finally:
        subprocess.run(["umount", str(locked)], check=True)


def test_read_only_results_dir_is_refused(read_only_dir):
    with pytest.raises(UserError, match=f"cannot write in {read_only_dir}"):
        checks.check_results_dir(str(read_only_dir / "results"))
    assert list(read_only_dir.iterdir()) == []
