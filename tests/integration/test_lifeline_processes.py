"""Temporary files of dead owners, with a real ended process. Moved from tests/unit/test_lifeline.py."""

from __future__ import annotations

import os
import subprocess

from dcp_fsdp.process import lifeline


def test_remove_stale_takes_only_what_dead_owners_left(tmp_path, monkeypatch):
    sockets = tmp_path / "sockets"
    sockets.mkdir()
    monkeypatch.setattr(lifeline, "SEAWEED_SOCKET_DIRS", (str(sockets),))
    dead_pid = subprocess.Popen(["true"])  # a pid that has ended and been reaped
    dead_pid.wait()
    here = lifeline.host_tag()
    dead = tmp_path / f"dcp-fsdp-s3-p{dead_pid.pid}-h{here}-abc"
    dead.mkdir()
    (dead / "ports.txt").write_text("40001 40002")
    (sockets / "seaweedfs-filer-40001.sock").touch()
    (sockets / "seaweedfs-master-49999.sock").touch()  # another server's: kept
    live = tmp_path / f"dcp-fsdp-run-p{os.getpid()}-h{here}-xyz"
    live.mkdir()
    # the same dead pid on another host sharing this TMPDIR (NFS scratch): not ours to judge
    other_host = tmp_path / f"dcp-fsdp-run-p{dead_pid.pid}-h{'0' * 8 if here != '0' * 8 else '1' * 8}-x"
    other_host.mkdir()
    legacy = tmp_path / f"dcp-fsdp-run-p{dead_pid.pid}-old"  # before names carried the host
    legacy.mkdir()
    unrelated = tmp_path / "dcp-fsdp-results"  # no owner in its name: never touched
    unrelated.mkdir()
    removed = lifeline.remove_stale(str(tmp_path))
    assert sorted(removed) == sorted([dead, legacy])
    assert live.exists() and unrelated.exists() and other_host.exists() and not dead.exists()
    assert sorted(p.name for p in sockets.iterdir()) == ["seaweedfs-master-49999.sock"]


def test_a_killed_ceilings_tmpfs_checkpoint_is_reaped(tmp_path, monkeypatch):
    memory = tmp_path / "shm"
    memory.mkdir()
    monkeypatch.setattr(lifeline, "MEMORY_DIR", str(memory))
    dead_pid = subprocess.Popen(["true"])
    dead_pid.wait()
    left = memory / f"dcp-fsdp-mem-p{dead_pid.pid}-h{lifeline.host_tag()}-abc"
    (left / "dcp-alone-1").mkdir(parents=True)
    (left / "dcp-alone-1" / "__0_0.distcp").write_bytes(b"x" * 1024)
    mine = memory / f"dcp-fsdp-mem-p{os.getpid()}-h{lifeline.host_tag()}-def"
    mine.mkdir()
    assert lifeline.remove_stale(str(tmp_path / "tmp")) == [left]
    assert not left.exists() and mine.exists()
