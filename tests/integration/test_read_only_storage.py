"""A load reads: a checkpoint on a read-only file system (a snapshot, an NFS or FSx export)
loads; only what writes (a save, a load with the raw ceiling's PUTs) needs write access.
The read-only file system is a real read-only bind mount, in a mount namespace of the test's
own (unshare -m), so nothing outside the test sees it."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys

import pytest

from tests.kit.cli import REPO, clean_env, read_run, run_cli


def run_on_read_only(source, mount_point, args) -> subprocess.CompletedProcess:
    script = (f"mount --bind {shlex.quote(str(source))} {shlex.quote(str(mount_point))} && "
              f"mount -o remount,bind,ro {shlex.quote(str(mount_point))} && "
              f"exec {shlex.quote(sys.executable)} -m dcp_fsdp " + " ".join(map(shlex.quote, args)))
    return subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)


@pytest.fixture
def unshare_mounts():
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.fail("unshare -m is needed (root, util-linux): the read-only mount cannot be made")


def test_a_load_from_a_read_only_file_system_runs_and_a_ceiling_is_refused(tmp_path, unshare_mounts):
    store, mount_point = tmp_path / "store", tmp_path / "ro"
    mount_point.mkdir()
    save = run_cli(["save", "storage=fs", f"storage.path={store}", "model=tiny_llama", "nproc=1",
                    "suffix=snap", f"results_dir={tmp_path / 's'}"])
    assert save.returncode == 0, save.stderr
    load = run_on_read_only(store, mount_point, [
        "load", "storage=fs", f"storage.path={mount_point}", "model=tiny_llama", "nproc=1",
        "suffix=snap", f"results_dir={tmp_path / 'l'}"])
    assert load.returncode == 0, f"{load.stdout}\n{load.stderr}"
    run, samples = read_run(tmp_path / "l")
    assert run["status"] == "ok" and [s["op"] for s in samples] == ["load"]
    ceiling = run_on_read_only(store, mount_point, [
        "load", "storage=fs", f"storage.path={mount_point}", "model=tiny_llama", "nproc=1",
        "suffix=snap", "ceiling=true", f"results_dir={tmp_path / 'c'}"])
    assert ceiling.returncode == 2, ceiling.stderr
    errors = [line for line in ceiling.stderr.splitlines() if line.startswith("dcp-fsdp: error:")]
    assert len(errors) == 1 and "not writable" in errors[0] and "Read-only" in errors[0], ceiling.stderr
