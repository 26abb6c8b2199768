"""Shared fixtures: a real SeaweedFS S3 server on loopback, one per test session."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from dcp_fsdp.contract import CONFIG_ENV, FORK_RANKS_TEST_ONLY_ENV
from dcp_fsdp.launch.embedded_s3 import EmbeddedS3, S3Endpoint
from tests.kit.cli import SCRUBBED_ENV

# The Ctrl-C tests signal the commands they start as a terminal would. A suite started in the
# background by a non-interactive shell (`make test &`, a CI wrapper) inherits SIGINT ignored,
# and an ignored signal stays ignored across exec: every command it starts would ignore Ctrl-C
# and those tests would fail for the harness's sake. A handled signal is reset to the default
# at exec, so the commands get a terminal's Ctrl-C whatever started the suite.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# A developer's shell may point at another S3 (an exported AWS_ENDPOINT_URL: `dcp-fsdp
# s3-server start` prints one) or hold the connector's log switch: the suite runs against its
# own servers, so they are gone for the whole session. In-process tests compose settings that
# read them (6 unit tests failed under an exported AWS_ENDPOINT_URL); subprocesses get
# clean_env's copy as before.
for _name in (*SCRUBBED_ENV, "S3_TORCH_CONNECTOR_DEBUG_LOGS", CONFIG_ENV):
    os.environ.pop(_name, None)

# The suite's launches fork their ranks from the agent (launch/forked_rank.py): ~5 CPU s less
# per rank, which CI's 15 minutes need (docs/measurements/2026-11-27-ci-cost.md). The product
# never sets it: measured runs exec their ranks. Tests of the exec start unset it
# (tests/integration/test_rank_start.py); `DCP_FSDP_TEST_ONLY_FORK_RANKS=0 pytest ...` runs
# the whole suite on exec'd ranks.
os.environ.setdefault(FORK_RANKS_TEST_ONLY_ENV, "1")

# Marked by directory (markers registered in pyproject.toml): `pytest -m unit` is the fast set.
_DIRECTORY_MARKS = {"unit": "unit", "integration": "integration", "gpu": "gpu"}


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    no_cuda = None
    for item in items:
        parts = item.path.parts
        for directory, mark in _DIRECTORY_MARKS.items():
            if directory in parts[-3:-1]:
                item.add_marker(getattr(pytest.mark, mark))
        if item.path.name == "test_slurm.py":
            item.add_marker(pytest.mark.slurm)
        if item.get_closest_marker("gpu") is not None:
            if no_cuda is None:
                no_cuda = _cuda_devices() == 0
            if no_cuda:
                item.add_marker(pytest.mark.skip(
                    reason="gpu: no CUDA device here (torch.cuda.is_available() is False); "
                           "tests/gpu runs wherever CUDA is"))


def _cpu_s() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """DCP_FSDP_TEST_CPU_LOG=FILE: one JSON line per test with its wall seconds and the CPU
    seconds of its worker and of the processes it started and reaped (launchers, their agents
    and ranks): where the suite's time goes, which --durations (wall time under load) hides;
    with its worker and start time (wall clock), which show how the workers were packed."""
    path = os.environ.get("DCP_FSDP_TEST_CPU_LOG")
    if not path:
        return (yield)
    started_s, started_at, cpu_before_s = time.monotonic(), time.time(), _cpu_s()
    try:
        return (yield)
    finally:
        line = {"test": item.nodeid, "wall_s": round(time.monotonic() - started_s, 2),
                "cpu_s": round(_cpu_s() - cpu_before_s, 2), "started_at": round(started_at, 2),
                "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")}
        with open(path, "a") as log:
            log.write(json.dumps(line) + "\n")


@pytest.fixture(scope="session")
def s3_server():
    """One SeaweedFS for the session (bucket `bench`), stopped at the end."""
    server = EmbeddedS3(bucket="bench")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server) -> S3Endpoint:
    return s3_server.endpoint


@pytest.fixture
def s3_uri(s3) -> str:
    """A fresh prefix in the session's bucket for one test."""
    return f"s3://{s3.bucket}/t-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def moto_s3():
    """moto's S3 (server mode, in this process) with bucket `bench`: a second S3
    implementation for tests/integration/test_moto.py. Same S3Endpoint as `s3`."""
    from tests.kit.moto_server import MotoS3

    server = MotoS3(bucket="bench")
    endpoint = server.start()
    yield endpoint
    server.stop()


@pytest.fixture
def moto_uri(moto_s3) -> str:
    """A fresh prefix in moto's bucket for one test."""
    return f"s3://{moto_s3.bucket}/t-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def tmpfs_dir():
    """A fresh directory on tmpfs (/dev/shm: a file there is memory), removed after."""
    path = Path(tempfile.mkdtemp(prefix="dcp-test-shm-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


# -- the suite leaves nothing behind -------------------------------------------------------
# Every process the tests start writes its temporary files under a directory of this
# session (TMPDIR); at the end it must hold none of ours, and /tmp none of the sockets of
# the servers this session started.
_LEFTOVER_PATTERNS = ("dcp-fsdp-*", "seaweedfs-*.sock")


def pytest_sessionstart(session):
    import os
    import tempfile

    from dcp_fsdp.process.lifeline import owned_tempdir
    from tests.kit.reaper import SESSION_DIR_PREFIX

    # An xdist worker started inside the controller's: no second level (AF_UNIX socket
    # paths under TMPDIR, e.g. the process checkpointer's, must stay under 108 bytes).
    if os.path.basename(os.environ.get("TMPDIR", "")).startswith(SESSION_DIR_PREFIX):
        return
    # Named after this process: if the session is killed, its reaper (or the next dcp-fsdp
    # run) removes it.
    session_tmp = str(owned_tempdir(SESSION_DIR_PREFIX))
    session.config._dcp_fsdp_tmp = session_tmp
    session.config._dcp_fsdp_tmp_before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = session_tmp
    tempfile.tempdir = None  # tempfile reads TMPDIR again
    _start_reaper(session_tmp)


def _start_reaper(marker: str) -> None:
    """Whatever a test starts inherits the marker; once this pytest is gone, killed or not,
    the reaper ends what still carries it (a kept s3-server outlives its starter)."""
    import os
    import subprocess
    import sys

    from tests.kit.reaper import MARKER_ENV

    os.environ[MARKER_ENV] = marker
    subprocess.Popen([sys.executable, "-m", "tests.kit.reaper", str(os.getpid()), marker],
                     cwd=Path(__file__).resolve().parents[1], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)


def pytest_sessionfinish(session, exitstatus):
    import os
    import shutil
    import tempfile
    from pathlib import Path

    session_tmp = getattr(session.config, "_dcp_fsdp_tmp", None)
    if session_tmp is None:
        return
    before = session.config._dcp_fsdp_tmp_before
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    tempfile.tempdir = None
    left = sorted(str(p) for pattern in _LEFTOVER_PATTERNS
                  for p in Path(session_tmp).glob(pattern))
    shutil.rmtree(session_tmp, ignore_errors=True)
    if left:
        print(f"\ndcp-fsdp: the test session left temporary files behind: {left}")
        session.exitstatus = 1
