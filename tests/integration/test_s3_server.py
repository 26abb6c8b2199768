"""`dcp-fsdp s3-server`: a local S3 kept up across runs, for a save followed by a load."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from dcp_fsdp.process.lifeline import alive
from tests.kit.cli import REPO, clean_env, read_run, run_cli


def _exports(text: str) -> dict[str, str]:
    line = next(line for line in text.splitlines() if line.startswith("export "))
    return dict(word.split("=", 1) for word in shlex.split(line[len("export "):]))


def test_start_save_load_by_suffix_stop(tmp_path):
    # a short runtime directory, as /run/user/UID is: unix socket paths are short
    runtime = Path(tempfile.mkdtemp(prefix="s3t-", dir="/tmp"))
    try:
        _start_save_load_by_suffix_stop(tmp_path, runtime)
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


def _start_save_load_by_suffix_stop(tmp_path, runtime):
    own_tmp = tmp_path / "tmp"
    own_tmp.mkdir()
    env = {"XDG_RUNTIME_DIR": str(runtime), "TMPDIR": str(own_tmp)}
    start = run_cli(["s3-server", "start"], env=env, timeout_s=120)
    try:
        assert start.returncode == 0, start.stderr
        variables = _exports(start.stdout)
        assert set(variables) >= {"AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID",
                                  "AWS_SECRET_ACCESS_KEY", "AWS_REGION"}
        found = re.search(r"storage\.uri=(s3://\S+)", start.stdout)
        assert found is not None, start.stdout
        uri = found.group(1)
        state = json.loads((runtime / "dcp-fsdp-s3" / "state.json").read_text())
        assert oct((runtime / "dcp-fsdp-s3" / "state.json").stat().st_mode)[-3:] == "600"
        # `env` prints the same exports; `start` again finds it running
        assert _exports(run_cli(["s3-server", "env"], env=env).stdout) == variables
        again = run_cli(["s3-server", "start"], env=env)
        assert again.returncode == 0 and "already running" in again.stdout

        run_env = {**env, **variables}
        save = run_cli(["save", f"storage.uri={uri}", "nproc=1",
                        f"results_dir={tmp_path / 'save'}"], env=run_env)
        assert save.returncode == 0, save.stderr
        suffix = read_run(tmp_path / "save")[0]["suffixes"][0]
        assert f"SUFFIXES={suffix}" in save.stdout  # not the embedded server's: it persists
        load = run_cli(["load", f"storage.uri={uri}", f"suffix={suffix}", "nproc=1",
                        f"results_dir={tmp_path / 'load'}"], env=run_env)
        assert load.returncode == 0, load.stderr
        assert read_run(tmp_path / "load")[0]["status"] == "ok"
        status = run_cli(["s3-server", "status"], env=env)
        assert status.returncode == 0 and variables["AWS_ENDPOINT_URL"] in status.stdout
    finally:
        stop = run_cli(["s3-server", "stop"], env=env, timeout_s=60)
    assert stop.returncode == 0, stop.stderr
    assert "stopped" in stop.stdout
    deadline = time.monotonic() + 10
    while (alive(state["daemon_pid"]) or alive(state["server_pid"])) and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(state["daemon_pid"]) and not alive(state["server_pid"])
    assert not (runtime / "dcp-fsdp-s3").exists()
    # the server's files (ranks' torch caches are not the server's: the launcher's issue)
    assert not [p for p in own_tmp.iterdir() if p.name.startswith(("seaweedfs", "dcp-fsdp-s3"))]
    # none of this server's sockets in /tmp (other servers on the machine may have theirs)
    for port in state["ports"].values():
        assert not list(Path("/tmp").glob(f"seaweedfs-*-{port}.sock")), port
    status = run_cli(["s3-server", "status"], env=env)
    assert status.returncode == 3 and "not running" in status.stdout
    assert not (runtime / "dcp-fsdp-s3").exists()  # status creates nothing


def _serve_daemons(runtime: Path) -> list[int]:
    """The s3-server daemons whose state lives under `runtime` (one per server started)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            words = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"s3-server" in words and b"serve" in words \
                and str(runtime).encode() in b" ".join(words):
            found.append(int(entry.name))
    return found


def _lock_held(path: Path) -> bool:
    import fcntl

    with open(path, "a") as probe:
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        return False


def _answers(variables: dict[str, str], bucket: str = "dcp-fsdp") -> bool:
    import boto3

    client = boto3.client("s3", endpoint_url=variables["AWS_ENDPOINT_URL"],
                          region_name=variables["AWS_REGION"],
                          aws_access_key_id=variables["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=variables["AWS_SECRET_ACCESS_KEY"])
    try:
        client.head_bucket(Bucket=bucket)
        return True
    except Exception:
        return False


def _cli(args: list[str], env: dict[str, str], merged: bool = False):
    import subprocess
    import sys

    from tests.kit.cli import REPO, clean_env

    return subprocess.Popen([sys.executable, "-m", "dcp_fsdp", *args], env=clean_env(env),
                            cwd=REPO, stdout=subprocess.PIPE, text=True,
                            stderr=subprocess.STDOUT if merged else subprocess.PIPE)


def test_starts_and_stops_at_once_leave_one_server_and_no_orphan(tmp_path):
    """Two starts at once: one server, the same endpoint and keys for both callers (they
    were two servers, one an orphan whose data the next stop deleted). A start during a
    stop waits for it and starts a fresh server that answers."""
    runtime = Path(tempfile.mkdtemp(prefix="s3l-", dir="/tmp"))
    env = {"XDG_RUNTIME_DIR": str(runtime), "TMPDIR": str(tmp_path)}
    try:
        starts = [_cli(["s3-server", "start"], env) for _ in range(2)]
        outputs = [start.communicate(timeout=240) for start in starts]
        assert [start.returncode for start in starts] == [0, 0], outputs
        first, second = (_exports(out) for out, _ in outputs)
        assert first == second, outputs
        assert len(_serve_daemons(runtime)) == 1
        assert _answers(first)

        stop = _cli(["s3-server", "stop"], env)
        deadline = time.monotonic() + 30
        while not _lock_held(runtime / "dcp-fsdp-s3.lock") and time.monotonic() < deadline:
            time.sleep(0.02)
        start = _cli(["s3-server", "start"], env)
        stopped, started = stop.communicate(timeout=120), start.communicate(timeout=240)
        assert stop.returncode == 0 and start.returncode == 0, (stopped, started)
        assert "waiting for it" in started[0], started
        fresh = _exports(started[0])
        assert fresh["AWS_ENDPOINT_URL"] != first["AWS_ENDPOINT_URL"] and _answers(fresh)
        assert len(_serve_daemons(runtime)) == 1
    finally:
        run_cli(["s3-server", "stop", "--force"], env=env, timeout_s=60)
        shutil.rmtree(runtime, ignore_errors=True)
    deadline = time.monotonic() + 10
    while _serve_daemons(runtime) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _serve_daemons(runtime) == []


def test_stop_refuses_while_a_run_uses_the_server(tmp_path):
    runtime = Path(tempfile.mkdtemp(prefix="s3u-", dir="/tmp"))
    env = {"XDG_RUNTIME_DIR": str(runtime), "TMPDIR": str(tmp_path)}
    try:
        start = run_cli(["s3-server", "start"], env=env, timeout_s=240)
        assert start.returncode == 0, start.stderr
        variables = _exports(start.stdout)
        found = re.search(r"storage\.uri=(s3://\S+)", start.stdout)
        assert found is not None, start.stdout
        uri = found.group(1)
        run = _cli(["save", f"storage.uri={uri}", "model=tiny_llama", "nproc=1",
                    "iterations=3", "delay_s=5", f"results_dir={tmp_path / 'run'}"],
                   {**env, **variables}, merged=True)
        seen: list[str] = []
        while not any("saved suffix=" in line for line in seen):  # it is writing there
            seen.append(run.stdout.readline())
            assert seen[-1] or run.poll() is None, seen
        refused = run_cli(["s3-server", "stop"], env=env)
        output = run.communicate(timeout=240)
        assert run.returncode == 0, output  # its server was left running
        assert refused.returncode == 2, refused.stdout + refused.stderr
        line = refused.stderr.strip()
        assert "1 run(s) use the server" in line and f"pid {run.pid}:" in line, line
        assert "dcp-fsdp s3-server stop --force" in line and "\n" not in line
        assert _answers(variables)
        stop = run_cli(["s3-server", "stop"], env=env)  # the run has ended
        assert stop.returncode == 0 and "stopped" in stop.stdout, stop.stderr
    finally:
        run_cli(["s3-server", "stop", "--force"], env=env, timeout_s=60)
        shutil.rmtree(runtime, ignore_errors=True)


def test_a_killed_daemon_takes_its_server_with_it_and_leaves_no_socket_in_tmp(tmp_path):
    """kill -9 of the s3-server daemon: SeaweedFS ends at once (it dies with the daemon),
    and the next s3-server command finds the daemon gone and removes what it left: the
    state directory and the server's gRPC sockets, which SeaweedFS puts in /tmp whatever
    TMPDIR says."""
    runtime = Path(tempfile.mkdtemp(prefix="s3k-", dir="/tmp"))
    env = {"XDG_RUNTIME_DIR": str(runtime), "TMPDIR": str(runtime)}
    try:
        start = run_cli(["s3-server", "start"], env=env, timeout_s=120)
        assert start.returncode == 0, start.stderr
        state = json.loads((runtime / "dcp-fsdp-s3" / "state.json").read_text())
        ports = state["ports"].values()
        assert _sockets(ports), "SeaweedFS made no socket in /tmp: nothing to check"
        os.kill(state["daemon_pid"], 9)
        deadline = time.monotonic() + 5
        while alive(state["server_pid"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(state["server_pid"]), "SeaweedFS outlived its daemon"
        status = run_cli(["s3-server", "status"], env=env)
        assert status.returncode == 3 and "not running" in status.stdout, status.stdout
        assert _sockets(ports) == []
        assert not (runtime / "dcp-fsdp-s3").exists()
    finally:
        run_cli(["s3-server", "stop", "--force"], env=env, timeout_s=60)
        shutil.rmtree(runtime, ignore_errors=True)


def _sockets(ports) -> list[Path]:
    return [p for port in ports for p in Path("/tmp").glob(f"seaweedfs-*-{port}.sock")]


def _unshare_works() -> bool:
    """A user and mount namespace of our own (unprivileged on most Linux kernels): a real
    read-only file system for HOME without root's permission to remount anything."""
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-rm", "true"], capture_output=True).returncode == 0


def test_start_with_a_read_only_home_and_no_runtime_dir_is_one_line():
    """Issue 31 WRONG 6: `OSError: Read-only file system` traceback. HOME is a read-only
    tmpfs (EROFS, as root too: permission bits would not stop root), XDG_RUNTIME_DIR unset."""
    if not _unshare_works():
        pytest.skip("unshare -rm (a user and mount namespace) is not allowed here")
    # short, as a real HOME is: the state path must fit SeaweedFS's socket names
    with tempfile.TemporaryDirectory(dir="/tmp") as short:
        home = Path(short)
        env = {k: v for k, v in clean_env({"HOME": short}).items() if k != "XDG_RUNTIME_DIR"}
        done = subprocess.run(
            ["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o ro tmpfs "$HOME" && exec "$@"',
             "sh", sys.executable, "-m", "dcp_fsdp", "s3-server", "start"],
            env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert not list(home.iterdir())  # the tmpfs was over it; nothing was written under it
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and done.stderr.strip().count("\n") == 0, done.stderr
    assert f"cannot create {home}/.cache/dcp-fsdp-s3.lock (Read-only file system)" in done.stderr
    assert "set XDG_RUNTIME_DIR to a short writable directory" in done.stderr
