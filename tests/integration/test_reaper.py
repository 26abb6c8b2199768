"""A test session killed mid-run leaves no kept s3-server running (issue 31, WRONG 6: a
suite stopped by .ci/run's time limit left one, with its SeaweedFS, for an hour)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from tests.kit.cli import REPO, clean_env

INNER = '''
import subprocess, sys, time
from tests.kit.cli import cli_command, clean_env


def test_starts_a_kept_server_and_hangs():
    subprocess.run(cli_command(["s3-server", "start"]), env=clean_env(), check=True,
                   timeout=120, stdout=subprocess.DEVNULL)
    print("STARTED", flush=True)
    time.sleep(600)
'''


def _servers_of(runtime: Path) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if str(runtime) in " ".join(process.cmdline()) or any(
                    str(runtime) in value for value in process.environ().values()):
                found.append(process)
        except psutil.Error:
            continue
    return found


def test_a_killed_session_leaves_no_kept_server(tmp_path):
    runtime = Path(tempfile.mkdtemp(prefix="s3r-", dir="/tmp"))  # short: unix socket paths
    try:
        (tmp_path / "test_inner.py").write_text(INNER)
        # The inner session makes its own directory (its marker) under this test's TMPDIR
        inner_tmp = runtime / "tmp"
        inner_tmp.mkdir()
        env = clean_env({"XDG_RUNTIME_DIR": str(runtime), "PYTHONPATH": str(REPO),
                         "TMPDIR": str(inner_tmp)})
        env.pop("DCP_FSDP_TEST_SESSION", None)
        inner = subprocess.Popen(
            # tests/conftest.py as a plugin: the inner file is outside tests/
            [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-p", "tests.conftest",
             "--rootdir", str(REPO), "-c", str(REPO / "pyproject.toml"),
             str(tmp_path / "test_inner.py")],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert inner.stdout is not None
        deadline = time.monotonic() + 180
        for line in inner.stdout:
            if "STARTED" in line or time.monotonic() > deadline:
                break
        assert _servers_of(runtime), "the kept server did not start"
        inner.send_signal(signal.SIGKILL)  # no teardown, no sessionfinish
        inner.wait()
        deadline = time.monotonic() + 60
        while _servers_of(runtime) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _servers_of(runtime) == []
        # ... and the killed session's own directory is gone too (the reaper removes it last)
        while list(inner_tmp.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert list(inner_tmp.iterdir()) == []
    finally:
        for process in _servers_of(runtime):
            process.kill()
        shutil.rmtree(runtime, ignore_errors=True)
