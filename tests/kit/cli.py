"""Running the CLI as a user would, in a clean environment, and reading what it recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from dcp_fsdp.launch.embedded_s3 import S3Endpoint

REPO = Path(__file__).resolve().parents[2]
# Variables that would point a test run at some other S3 or identity.
_SCRUBBED = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_ACCESS_KEY_ID",
             "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_DEFAULT_REGION",
             "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def run_cli(args: list[str], env: dict[str, str] | None = None, timeout_s: float = 300,
            torchrun_nproc: int | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`dcp-fsdp ARGS` (or under `torchrun --nproc-per-node N -m dcp_fsdp ARGS`)."""
    if torchrun_nproc:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={torchrun_nproc}", "-m", "dcp_fsdp", *args]
    else:
        command = [sys.executable, "-m", "dcp_fsdp", *args]
    started = time.monotonic()
    result = subprocess.run(command, env=clean_env(env), cwd=cwd, capture_output=True, text=True,
                            timeout=timeout_s, stdin=subprocess.DEVNULL)
    result.elapsed_s = time.monotonic() - started
    return result


def read_run(results_dir: Path) -> tuple[dict, list[dict]]:
    """The only record file in a results dir: (run line, sample lines)."""
    files = sorted(Path(results_dir).glob("*.jsonl"))
    assert len(files) == 1, f"expected one record file in {results_dir}, found {files}"
    lines = [json.loads(line) for line in files[0].read_text().splitlines() if line.strip()]
    return lines[0], lines[1:]


def s3_args(s3: S3Endpoint, uri: str) -> list[str]:
    return [f"storage.uri={uri}", f"storage.endpoint={s3.endpoint_url}"]


def s3_env(s3: S3Endpoint) -> dict[str, str]:
    """Credentials only (endpoint given as a setting)."""
    return {"AWS_ACCESS_KEY_ID": s3.access_key_id, "AWS_SECRET_ACCESS_KEY": s3.secret_access_key}
