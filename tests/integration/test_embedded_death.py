"""How the launcher names the end of its embedded server (the trial's cases 23/24)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from dcp_fsdp.launch.embedded_s3 import EmbeddedS3, S3Endpoint, free_ports
from tests.kit.cli import s3_client


def _server(process: subprocess.Popen, tmp_path) -> EmbeddedS3:
    # a real process in the server's place: its end is what death() reads
    server = EmbeddedS3()
    server.process, server.workdir = process, tmp_path
    (tmp_path / "data").mkdir(exist_ok=True)
    server.ports = {"s3.port": free_ports(1)[0]}
    server.endpoint = S3Endpoint(f"http://127.0.0.1:{server.ports['s3.port']}", "b", "k", "s")
    return server


@pytest.mark.parametrize("signum, said", [
    (signal.SIGKILL, "(killed by SIGKILL)"),
    (signal.SIGTERM, "(killed by SIGTERM)"),
])
def test_a_killed_server_is_named_with_its_signal_and_the_fix(tmp_path, signum, said):
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    process.send_signal(signum)
    process.wait()
    line = _server(process, tmp_path).death_line()
    assert line is not None and said in line, line
    assert line.startswith(f"the embedded S3 server (SeaweedFS, pid {process.pid}) died")
    assert "OOM" in line and "GiB free now" in line and str(tmp_path / "data") in line


def test_exit_codes_and_a_server_that_no_longer_answers(tmp_path):
    stopped = subprocess.Popen([sys.executable, "-c", "pass"])
    stopped.wait()
    assert "exited with code 0" in (_server(stopped, tmp_path).death() or "")
    failed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    failed.wait()
    assert _server(failed, tmp_path).death() == "exit code 3"
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:  # alive, but nothing listens on its S3 port
        assert "no longer answers" in (_server(running, tmp_path).death() or "")
    finally:
        running.kill()
        running.wait()


def test_a_start_whose_port_is_taken_before_weed_binds_it_retries_on_new_ports(monkeypatch):
    """Two runs (or test workers) starting servers at once: a port free_ports found can be
    taken before weed binds it, and weed exits ("Port allocation failed"). Seen in CI with 3
    workers. The start is retried on new ports; the lost attempt leaves nothing behind."""
    import os
    import socket
    import tempfile
    from pathlib import Path

    from dcp_fsdp.launch import embedded_s3

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    calls = []

    def ports_with_one_taken(count, host="127.0.0.1"):
        ports = free_ports(count, host)
        calls.append(ports)
        if len(calls) == 1:
            ports[2] = taken.getsockname()[1]  # volume.port: what CI's run lost
        return ports

    monkeypatch.setattr(embedded_s3, "free_ports", ports_with_one_taken)
    mine = f"dcp-fsdp-s3-p{os.getpid()}-*"  # this process's servers (a session fixture's too)
    tmp = Path(tempfile.gettempdir())
    before = set(tmp.glob(mine))
    server = EmbeddedS3(bucket="retry")
    try:
        with server as endpoint:
            client = s3_client(endpoint)
            client.put_object(Bucket="retry", Key="k", Body=b"v")
            assert client.get_object(Bucket="retry", Key="k")["Body"].read() == b"v"
            workdir = server.workdir
        assert len(calls) == 2 and calls[1][2] != taken.getsockname()[1]
        assert workdir is not None and not workdir.exists()
        assert set(tmp.glob(mine)) == before  # the lost attempt's directory is gone too
    finally:
        taken.close()
