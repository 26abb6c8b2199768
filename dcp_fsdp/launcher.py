"""Run N ranks on this machine without torchrun, with the embedded S3 server if needed.

The parent stays light (no torch import): it checks the storage (fast, clear
failures before any rank starts), starts SeaweedFS when no S3 is configured,
spawns the ranks with torchrun's environment variables, and stops everything
when a rank fails, on Ctrl-C, or at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from omegaconf import OmegaConf

from dcp_fsdp import records
from dcp_fsdp.config import BenchmarkConfig, Command, StorageKind
from dcp_fsdp.embedded_s3 import EmbeddedS3, free_ports
from dcp_fsdp.runner import (EMBEDDED_ENV, EXIT_FAILED, EXIT_INTERRUPTED, PREFLIGHT_DONE_ENV,
                             RUN_ID_ENV, config_dict)
from dcp_fsdp.storage import check_loadable, make_backend, resolve_endpoint

CONFIG_ENV = "DCP_FSDP_CONFIG"
EMBEDDED_BUCKET = "dcp-fsdp"
FAILURE_GRACE_S = 10.0  # after one rank fails, how long the others get to fail on their own


def needs_embedded_server(cfg: BenchmarkConfig) -> bool:
    return (cfg.storage.kind == StorageKind.s3 and cfg.storage.uri is None
            and resolve_endpoint(cfg.storage) is None)


@contextlib.contextmanager
def storage_environment(cfg: BenchmarkConfig):
    """Yield (cfg, extra env): the embedded server's when nothing is configured."""
    if not needs_embedded_server(cfg):
        yield cfg, {}
        return
    if cfg.command == Command.load:
        # A fresh embedded server is empty: there is nothing to load.
        from dcp_fsdp.errors import UserError
        raise UserError("storage.uri is not set: the embedded S3 server starts empty each run, so "
                        "there is nothing to load; use save-and-load, or point storage.uri "
                        "(and storage.endpoint) at the server that holds the checkpoint")
    server = EmbeddedS3(bucket=EMBEDDED_BUCKET)
    print("[dcp-fsdp] no S3 configured: starting the embedded SeaweedFS server on 127.0.0.1",
          flush=True)
    endpoint = server.start()
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cfg), {"storage": {
            "uri": f"s3://{endpoint.bucket}/checkpoints", "endpoint": endpoint.endpoint_url,
            "region": endpoint.region}}))
        yield cfg, {**endpoint.client_env(), EMBEDDED_ENV: "1"}
    finally:
        server.stop()


def launch_local(cfg: BenchmarkConfig) -> int:
    run_id = records.new_run_id(cfg.command.value)
    with storage_environment(cfg) as (cfg, server_env):
        env = {**os.environ, **server_env}
        # Pre-flight here, before any rank imports torch: bad input fails in about a second.
        with _patched_environ(server_env):
            backend = make_backend(cfg.storage)
            backend.preflight()
            if cfg.command == Command.load:
                check_loadable(backend, cfg.suffix)
        return _run_ranks(cfg, run_id, env)


@contextlib.contextmanager
def _patched_environ(extra: dict[str, str]):
    saved = {key: os.environ.get(key) for key in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _run_ranks(cfg: BenchmarkConfig, run_id: str, env: dict[str, str]) -> int:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="dcp-fsdp-", delete=False) as f:
        OmegaConf.save(OmegaConf.structured(cfg), f)
        config_path = f.name
    (master_port,) = free_ports(1)
    processes: list[subprocess.Popen] = []
    try:
        for rank in range(cfg.nproc):
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank),
                        "WORLD_SIZE": str(cfg.nproc), "LOCAL_WORLD_SIZE": str(cfg.nproc),
                        "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(master_port), CONFIG_ENV: config_path,
                        RUN_ID_ENV: run_id, PREFLIGHT_DONE_ENV: "1",
                        records.ARGV_ENV: json.dumps(records.command_line()),
                        # Each rank uses its share of the cores, as torchrun would arrange.
                        "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS",
                                                   str(max(1, (os.cpu_count() or 1) // cfg.nproc)))}
            processes.append(subprocess.Popen([sys.executable, "-m", "dcp_fsdp.worker"],
                                              env=rank_env))
        exit_code = _wait(processes)
    except KeyboardInterrupt:
        # Ctrl-C reached the ranks too (same process group): let them record it, then stop.
        _stop(processes, grace_s=FAILURE_GRACE_S)
        exit_code = EXIT_INTERRUPTED
    finally:
        _stop(processes, grace_s=0)
        Path(config_path).unlink(missing_ok=True)
    if exit_code != 0 and not records.record_path(cfg.results_dir, run_id).exists():
        _write_failure_record(cfg, run_id, exit_code, processes)
    return exit_code


def _wait(processes: list[subprocess.Popen]) -> int:
    failed_at = None
    while True:
        codes = [p.poll() for p in processes]
        if all(code is not None for code in codes):
            return next((code for code in codes if code != 0), 0)
        if failed_at is None and any(code not in (None, 0) for code in codes):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > FAILURE_GRACE_S:
            # The survivors are stuck in a collective with a dead peer.
            _stop(processes, grace_s=5)
            return next(code for code in codes if code not in (None, 0))
        time.sleep(0.1)


def _stop(processes: list[subprocess.Popen], grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    while grace_s > 0 and time.monotonic() < deadline and any(p.poll() is None for p in processes):
        time.sleep(0.1)
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _write_failure_record(cfg: BenchmarkConfig, run_id: str, exit_code: int,
                          processes: list[subprocess.Popen]) -> None:
    """Rank 0 died before writing its record: leave one that says the run failed."""
    codes = {rank: p.returncode for rank, p in enumerate(processes)}
    status = "interrupted" if exit_code == EXIT_INTERRUPTED else "failed"
    records.write_records(records.record_path(cfg.results_dir, run_id), {
        "run_id": run_id, "command": cfg.command.value, "argv": records.command_line(),
        "status": status, "error": f"rank exit codes {codes}", "finished_at": records.utc_now(),
        "config": config_dict(cfg), "world_size": cfg.nproc, "versions": records.versions(),
        "slurm": records.slurm_environment(),
    }, [])
    print(f"[dcp-fsdp] record: {records.record_path(cfg.results_dir, run_id)} ({status})",
          file=sys.stderr)
