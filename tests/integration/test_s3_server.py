"""`dcp-fsdp s3-server`: a local S3 kept up across runs, for a save followed by a load."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import tempfile
import time
from pathlib import Path

from tests.kit.cli import read_run, run_cli


def _exports(text: str) -> dict[str, str]:
    line = next(line for line in text.splitlines() if line.startswith("export "))
    return dict(word.split("=", 1) for word in shlex.split(line[len("export "):]))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


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
        uri = re.search(r"storage\.uri=(s3://\S+)", start.stdout).group(1)
        state = json.loads((runtime / "dcp-fsdp-s3" / "state.json").read_text())
        assert oct((runtime / "dcp-fsdp-s3" / "state.json").stat().st_mode)[-3:] == "600"
        # `env` prints the same exports; `start` again finds it running
        assert _exports(run_cli(["s3-server", "env"], env=env).stdout) == variables
        again = run_cli(["s3-server", "start"], env=env)
        assert again.returncode == 0 and "already running" in again.stdout

        run_env = {**env, **variables}
        save = run_cli(["save", f"storage.uri={uri}", "nproc=2",
                        f"results_dir={tmp_path / 'save'}"], env=run_env)
        assert save.returncode == 0, save.stderr
        suffix = read_run(tmp_path / "save")[0]["suffixes"][0]
        assert f"SUFFIXES={suffix}" in save.stdout  # not the embedded server's: it persists
        load = run_cli(["load", f"storage.uri={uri}", f"suffix={suffix}", "nproc=2",
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
    while (_alive(state["daemon_pid"]) or _alive(state["server_pid"])) and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(state["daemon_pid"]) and not _alive(state["server_pid"])
    assert not (runtime / "dcp-fsdp-s3").exists()
    # the server's files (ranks' torch caches are not the server's: the launcher's issue)
    assert not [p for p in own_tmp.iterdir() if p.name.startswith(("seaweedfs", "dcp-fsdp-s3"))]
    # none of this server's sockets in /tmp (other servers on the machine may have theirs)
    for port in state["ports"].values():
        assert not list(Path("/tmp").glob(f"seaweedfs-*-{port}.sock")), port
    status = run_cli(["s3-server", "status"], env=env)
    assert status.returncode == 3 and "not running" in status.stdout
    assert not (runtime / "dcp-fsdp-s3").exists()  # status creates nothing
