"""Run N ranks on this machine without torchrun, with the embedded S3 server if needed.

The parent stays light (no torch import): it checks the storage (fast, clear
failures before any rank starts), starts SeaweedFS when no S3 is configured,
spawns the ranks with torchrun's environment variables, and stops everything
when a rank fails, on Ctrl-C, or at the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from omegaconf import OmegaConf

from dcp_fsdp import contract, log
from dcp_fsdp.config.schema import BenchmarkConfig
from dcp_fsdp.launch.checks import check_launch, record_written, write_record
from dcp_fsdp.launch.embedded_s3 import free_ports
from dcp_fsdp.launch.preflight import preflight, storage_environment
from dcp_fsdp.telemetry import records
FAILURE_GRACE_S = 10.0  # after one rank fails, how long the others get to fail on their own
INTERRUPT_GRACE_S = 8.0  # after an interrupt, how long ranks get to record it and exit


class _LauncherTerminated(KeyboardInterrupt):
    """SIGTERM to the launcher: handled like Ctrl-C, passed on to the ranks as SIGTERM."""


def _raise_interrupt(signum, frame):
    raise _LauncherTerminated()


def launch_local(cfg: BenchmarkConfig) -> int:
    check_launch(cfg)  # results_dir, cores, CUDA devices, environment: before anything starts
    run_id = records.new_run_id(cfg.command.value)
    with storage_environment(cfg) as (cfg, server_env):
        env = {**os.environ, **server_env}
        preflight(cfg, server_env)
        return _run_ranks(cfg, run_id, env)


def _run_ranks(cfg: BenchmarkConfig, run_id: str, env: dict[str, str]) -> int:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="dcp-fsdp-", delete=False) as f:
        OmegaConf.save(OmegaConf.structured(cfg), f)
        config_path = f.name
    (master_port,) = free_ports(1)
    processes: list[subprocess.Popen] = []
    # SIGTERM to the launcher (kill, scancel of a batch step) ends the run like Ctrl-C.
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_interrupt)
    previous_sigint = signal.getsignal(signal.SIGINT)
    try:
        for rank in range(cfg.nproc):
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank),
                        "WORLD_SIZE": str(cfg.nproc), "LOCAL_WORLD_SIZE": str(cfg.nproc),
                        "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(master_port), contract.CONFIG_ENV: config_path,
                        contract.RUN_ID_ENV: run_id, contract.PREFLIGHT_DONE_ENV: "1",
                        contract.ARGV_ENV: json.dumps(records.command_line()),
                        # Each rank uses its share of the cores, as torchrun would arrange.
                        "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS",
                                                   str(max(1, (os.cpu_count() or 1) // cfg.nproc)))}
            # the same entry point as under torchrun (cli.py); the settings come as a file
            processes.append(subprocess.Popen([sys.executable, "-m", "dcp_fsdp",
                                               cfg.command.value],
                                              env=rank_env))
        exit_code = _wait(processes)
    except KeyboardInterrupt as interrupt:
        # A Ctrl-C in the terminal reaches the ranks too (same process group), but a signal
        # sent to the launcher alone does not: pass it on (ranks ignore a second one), let
        # them record `interrupted`, then stop any that linger.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        forwarded = (signal.SIGTERM if isinstance(interrupt, _LauncherTerminated)
                     else signal.SIGINT)
        for process in processes:
            if process.poll() is None:
                process.send_signal(forwarded)
        _stop(processes, grace_s=INTERRUPT_GRACE_S)
        exit_code = contract.EXIT_INTERRUPTED
    finally:
        _stop(processes, grace_s=0)
        signal.signal(signal.SIGTERM, previous_sigterm)
        signal.signal(signal.SIGINT, previous_sigint)
        Path(config_path).unlink(missing_ok=True)
    if exit_code != 0 and not record_written(cfg.results_dir, run_id):
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
            # The survivors are stuck in a collective with a dead peer: tell them why (they
            # record "failed"), then stop any that cannot get out of native code.
            peer_failed = getattr(signal, contract.PEER_FAILED_SIGNAL_NAME)
            for process in processes:
                if process.poll() is None:
                    process.send_signal(peer_failed)
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
    status = "interrupted" if exit_code == contract.EXIT_INTERRUPTED else "failed"
    run = records.RunRecord(
        run_id=run_id, command=cfg.command.value, argv=records.command_line(), status=status,
        error=f"rank exit codes {codes}", finished_at=records.utc_now(),
        config=records.config_for_record(cfg), world_size=cfg.nproc,
        versions=records.versions(), slurm=records.slurm_environment())
    path = write_record(cfg.results_dir, run, [])
    log.info(f"record: {path} ({status})")
