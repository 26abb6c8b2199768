"""Running the CLI as a user would, in a clean environment, and reading what it recorded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dcp_fsdp import contract
from dcp_fsdp.launch.embedded_s3 import S3Endpoint

REPO = Path(__file__).resolve().parents[2]
# Variables that would point a test run at some other S3 or identity (tests/conftest.py
# removes them from the whole session, in-process tests included).
SCRUBBED_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_ACCESS_KEY_ID",
             "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_DEFAULT_REGION",
             "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED_ENV}
    env["PYTHONUNBUFFERED"] = "1"
    # Two test workers share two cores: a rank's intra-op threads (the launcher gives each
    # rank cpu_count // nproc of them) spin against the other worker's ranks, about 1.5 CPU
    # seconds more per 1-rank save-and-load here (2026-11-27). One each, unless a test says.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


def cli_command(args: list[str], torchrun_nproc: int | None = None) -> list[str]:
    """`dcp-fsdp ARGS` (or under `torchrun --nproc-per-node N -m dcp_fsdp ARGS`)."""
    if torchrun_nproc:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={torchrun_nproc}", "-m", "dcp_fsdp", *args]
    return [sys.executable, "-m", "dcp_fsdp", *args]


class CliResult(subprocess.CompletedProcess[str]):
    """A finished command and its wall time (the tests bound how long a refusal takes)."""

    elapsed_s: float = 0.0


def run_cli(args: list[str], env: dict[str, str] | None = None, timeout_s: float = 300,
            torchrun_nproc: int | None = None, cwd: Path = REPO) -> CliResult:
    """`dcp-fsdp ARGS` (or under `torchrun --nproc-per-node N -m dcp_fsdp ARGS`)."""
    started = time.monotonic()
    with subprocess.Popen(cli_command(args, torchrun_nproc), env=clean_env(env), cwd=cwd,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          stdin=subprocess.DEVNULL) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stdout, stderr = _stopped(process)
            raise AssertionError(f"dcp-fsdp {' '.join(args)} ran past {timeout_s:g} s; stopped "
                                 f"with SIGTERM, it said:\n{stdout}\n{stderr}") from None
    result = CliResult(process.args, process.returncode, stdout, stderr)
    result.elapsed_s = time.monotonic() - started
    return result


def _stopped(process: subprocess.Popen) -> tuple[str, str]:
    """What a command run past its time said: SIGTERM (the launcher stops its ranks and names
    the cause, as for Ctrl-C), SIGKILL if it has not ended a minute later (a hang's evidence
    was lost when the test killed it at once: CI, test_plan[8-1-model])."""
    process.terminate()
    try:
        return process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.communicate()


def start_cli(args: list[str], env: dict[str, str] | None = None,
              torchrun_nproc: int | None = None, unset: tuple[str, ...] = ()) -> subprocess.Popen:
    """run_cli's command, started and left running: stdout and stderr merged into
    `process.stdout`, in a session of its own (os.killpg(process.pid, ...) reaches every
    process below it). `unset`: variables of this environment the process must not see."""
    full_env = clean_env(env)
    for name in unset:
        full_env.pop(name, None)
    return subprocess.Popen(cli_command(args, torchrun_nproc), env=full_env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def read_until(process: subprocess.Popen, needle: str, timeout_s: float = 240) -> list[str]:
    """The lines of a start_cli process up to the first that holds `needle`; without one
    (it ended, or `timeout_s` passed between lines), its session is killed and reaped and
    the test fails with what it printed."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.stdout is not None
        line = process.stdout.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return seen
    stop(process)
    raise AssertionError(f"never saw {needle!r}:\n{''.join(seen)}")


def stop(process: subprocess.Popen) -> None:
    """SIGKILL a start_cli process's whole session (its ranks too) and reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # it had ended, with all of its session
    process.wait(timeout=30)


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


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, their children, ...), from /proc."""
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        listed = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True)
        for child in (int(p) for p in listed.stdout.split()):
            found.append(child)
            frontier.append(child)
    return found


def rank_pids(launcher_pid: int) -> dict[int, int]:
    """{RANK: pid} of the ranks below a launcher (they run under torch's elastic agent)."""
    pids = {}
    for pid in descendants(launcher_pid):
        rank = rank_of(pid)
        if rank is not None:
            pids[rank] = pid
    return pids


def rank_of(pid: int) -> int | None:
    """The global rank process `pid` runs, or None. Forked ranks (the fork server's) are named
    (contract.rank_process_name); plain torchrun's exec'd ranks carry RANK in their
    environment, and so does a rank's own child (the async process checkpointer's daemon
    inherits it), whose parent is a rank."""
    named = _named_rank(pid)
    if named is not None:
        return named
    environ = _environ(pid)
    if environ is None or "RANK" not in environ:
        return None
    parent = parent_of(pid)
    if _named_rank(parent) is not None or "RANK" in (_environ(parent) or {}):
        return None
    return int(environ["RANK"])


def _named_rank(pid: int) -> int | None:
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
    return contract.rank_of_process_name(name)


def _environ(pid: int) -> dict[str, str] | None:
    try:
        entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return dict(entry.decode(errors="replace").split("=", 1) for entry in entries if b"=" in entry)


def _cmdline_words(pid: int) -> list[bytes]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")


def parent_of(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def assert_under_elastic_agent(ranks: dict[int, int]) -> None:
    """Each rank is a child of torch's elastic agent (a forked one of the fork server the
    agent started): one parent for all, running torch.distributed.run's agent; a rank is
    named (forked) or carries the variables only torch's agent sets (exec'd)."""
    parents = {parent_of(pid) for pid in ranks.values()}
    assert len(parents) == 1, parents
    parent = parents.pop()
    if any(b"multiprocessing.forkserver" in word for word in _cmdline_words(parent)):
        parent = parent_of(parent)
    agent_cmdline = _cmdline_words(parent)
    assert b"dcp_fsdp.launch.agent" in agent_cmdline or b"torch.distributed.run" in agent_cmdline, \
        agent_cmdline
    for pid in ranks.values():
        assert _named_rank(pid) is not None or "TORCHELASTIC_RUN_ID" in (_environ(pid) or {}), pid


def wait_for_committed_object(s3: S3Endpoint, held_path: str, key_pattern: str,
                              timeout_s: float = 120) -> None:
    """Wait until an object matching key_pattern (a regex) is committed in the same
    checkpoint as the held object (held_path: "/bucket/prefix/suffix/object", path-style)."""
    import re

    bucket, key = held_path.lstrip("/").split("/", 1)
    checkpoint_prefix = key.rsplit("/", 1)[0] + "/"
    client = s3_client(s3)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        listing = client.list_objects_v2(Bucket=bucket, Prefix=checkpoint_prefix)
        if any(re.search(key_pattern, obj["Key"]) for obj in listing.get("Contents", [])):
            return
        time.sleep(0.1)
    raise AssertionError(f"no object matching {key_pattern} under {checkpoint_prefix} "
                         f"after {timeout_s:.0f} s")


def s3_client(s3: S3Endpoint):
    """A boto3 S3 client of the endpoint, as a user outside the tool would have one."""
    import boto3

    return boto3.client("s3", endpoint_url=s3.endpoint_url, region_name=s3.region,
                        aws_access_key_id=s3.access_key_id,
                        aws_secret_access_key=s3.secret_access_key)


def copy_checkpoint(client, source_uri: str, suffix: str, target_uri: str) -> None:
    """Every object of checkpoint `suffix` under source_uri copied to the same suffix under
    target_uri (a test that damages a checkpoint damages its own copy)."""
    source_bucket, source_prefix = source_uri.removeprefix("s3://").split("/", 1)
    bucket, prefix = target_uri.removeprefix("s3://").split("/", 1)
    listed = client.list_objects_v2(Bucket=source_bucket, Prefix=f"{source_prefix}/{suffix}/")
    for obj in listed.get("Contents", []):
        client.copy_object(Bucket=bucket, Key=prefix + obj["Key"][len(source_prefix):],
                           CopySource={"Bucket": source_bucket, "Key": obj["Key"]})
