"""Run N ranks on this machine under our elastic agent (launch/agent.py), as `torchrun
--standalone` does on a cluster node; the light parent (no torch) settles their end (aftermath.py).
The agent runs in its own session: a terminal's Ctrl-C reaches only this parent, which passes it
on once; if this parent is killed outright, the parent-death signal stops the agent (lifeline.py).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from dcp_fsdp import contract
from dcp_fsdp.process import allocator, lifeline
from dcp_fsdp.storage import layout
from dcp_fsdp.storage.metadata_peek import MetadataFacts
from dcp_fsdp.config.schema import BenchmarkConfig, Malloc
from dcp_fsdp.launch.aftermath import RanksOutcome, find_record, lead_the_record, settle
from dcp_fsdp.launch.agent import PYTHON_FLAGS as AGENT_PYTHON_FLAGS, Terminated, raise_terminated
from dcp_fsdp.launch.checks import check_launch
from dcp_fsdp.launch.preflight import claim_save_suffixes, preflight, storage_environment
from dcp_fsdp.launch.server_check import ServerCheck
from dcp_fsdp.telemetry import records

# After the agent has been told to stop: how long it gets to stop its ranks (they record
# `interrupted`) before it is killed. torch's own grace for the ranks is shorter.
AGENT_STOP_GRACE_S = 45.0
RANK_STOP_GRACE_S = 20  # TORCH_ELASTIC_SHUTDOWN_TIMEOUT: ranks' time to record and exit


def launch_local(cfg: BenchmarkConfig) -> int:
    """`dcp-fsdp COMMAND nproc=N`: checks, storage, the ranks under torchrun; exit code."""
    check_launch(cfg)  # results_dir, cores, CUDA devices, environment: before anything starts
    lifeline.remove_stale()  # what a killed run could not remove
    run_id = records.new_run_id(cfg.command.value)
    with storage_environment(cfg) as (cfg, server_env, server):
        env = {**os.environ, **server_env}
        if (check := ServerCheck.for_run(cfg)) is not None:  # storage.metrics_url: the server's own counters
            check.begin()
        facts = preflight(cfg, server_env)
        claimed, claim_env = claim_save_suffixes(cfg, server_env, run_id)
        code = run_ranks(cfg, run_id, {**env, **claim_env}, facts, claimed)
        died = server.death_line() if server is not None and code not in (
            contract.EXIT_OK, contract.EXIT_INTERRUPTED) else None
        if died is not None:  # the first cause: the ranks saw only its connection errors
            lead_the_record(cfg.results_dir, run_id, died)
        if check is not None and code == 0:
            check.end(find_record(cfg.results_dir, run_id))
        return code


def run_ranks(cfg: BenchmarkConfig, run_id: str, env: dict[str, str],
              metadata_facts: MetadataFacts | None, claimed_suffixes: list[str]) -> int:
    """cfg.nproc ranks (`python -m dcp_fsdp`) under torch's elastic agent with `env`, and a record
    of how they ended (a claim in `claimed_suffixes` left with no data is removed); exit code."""
    run_dir = lifeline.owned_tempdir("dcp-fsdp-run-")
    try:
        if metadata_facts is not None and cfg.suffix:  # the load's, screened: rank 0 needs no GET
            facts_path = run_dir / "metadata-facts.json"
            layout.write_metadata_facts(facts_path, cfg.suffix, metadata_facts)
            env = {**env, contract.METADATA_FACTS_ENV: str(facts_path)}
        outcome = _run_agent(cfg, run_id, env, run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    settle(cfg, run_id, outcome, env, claimed_suffixes)
    return outcome.exit_code


def _agent_command(cfg: BenchmarkConfig, run_dir: Path) -> list[str]:
    return [sys.executable, *AGENT_PYTHON_FLAGS, "-m", "dcp_fsdp.launch.agent", "--standalone",
            f"--nproc-per-node={cfg.nproc}", "--max-restarts=0",
            f"--log-dir={run_dir / 'torchelastic'}", "-m", "dcp_fsdp"]


def _run_agent(cfg: BenchmarkConfig, run_id: str, env: dict[str, str], run_dir: Path) -> RanksOutcome:
    config_path = run_dir / "config.yaml"
    OmegaConf.save(OmegaConf.structured(cfg), config_path)
    summary_path = run_dir / "agent.json"
    writing_path = run_dir / "writing-suffix"
    agent_env = {**env, contract.CONFIG_ENV: str(config_path), contract.RUN_ID_ENV: run_id,
                 contract.PREFLIGHT_DONE_ENV: "1", contract.AGENT_SUMMARY_ENV: str(summary_path),
                 contract.WRITING_SUFFIX_FILE_ENV: str(writing_path),
                 contract.ARGV_ENV: json.dumps(records.command_line()),
                 "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(RANK_STOP_GRACE_S),
                 # torch makes $TMPDIR/torchinductor_$USER in every rank: inside the run's
                 # own directory it goes with it (unless the user points it elsewhere)
                 "TORCHINDUCTOR_CACHE_DIR": env.get("TORCHINDUCTOR_CACHE_DIR",
                                                    str(run_dir / "torchinductor")),
                 # Each rank uses its share of the cores (torchrun would say 1, with a warning).
                 "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS",
                                            str(max(1, (os.cpu_count() or 1) // cfg.nproc)))}
    if cfg.malloc == Malloc.raised:  # read by glibc as each rank starts (process/allocator.py)
        agent_env.update(allocator.ENVIRONMENT)
    # SIGTERM to the launcher (kill, scancel of a batch step) ends the run like Ctrl-C.
    previous_sigterm = signal.signal(signal.SIGTERM, raise_terminated)
    previous_sigint = signal.getsignal(signal.SIGINT)
    agent = None
    interrupted_by = None
    try:
        agent = subprocess.Popen(_agent_command(cfg, run_dir), env=agent_env,
                                 start_new_session=True,
                                 preexec_fn=functools.partial(lifeline.die_with_parent, signal.SIGTERM))
        agent.wait()
    except KeyboardInterrupt as interrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the stop
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        interrupted_by = signal.SIGTERM if isinstance(interrupt, Terminated) else signal.SIGINT
        if agent is not None:
            lifeline.stop_child(agent, interrupted_by, AGENT_STOP_GRACE_S)  # it stops its ranks
    finally:
        if agent is not None and agent.poll() is None:
            lifeline.stop_child(agent, signal.SIGTERM, AGENT_STOP_GRACE_S)
        signal.signal(signal.SIGTERM, previous_sigterm)
        signal.signal(signal.SIGINT, previous_sigint)
    summary: dict[str, Any] = {}  # stays so if the agent died before writing it
    with contextlib.suppress(OSError, ValueError):
        summary = json.loads(summary_path.read_text())
    outcome = _outcome(agent.returncode if agent is not None else None, summary, interrupted_by)
    with contextlib.suppress(OSError):
        outcome.writing_suffix = writing_path.read_text().strip() or None
    return outcome


def _outcome(agent_code: int | None, summary: dict[str, Any],
             interrupted_by: int | None) -> RanksOutcome:
    failures: dict[str, dict[str, Any]] = summary.get("failures") or {}
    cause = contract.EndCause
    name = signal.Signals(interrupted_by).name if interrupted_by is not None else None
    if name is None and agent_code == 0:
        return RanksOutcome(contract.EXIT_OK, "ok", cause=cause.OK)
    if name is None and summary.get("outcome") == "interrupted":  # the agent itself was signalled
        name = summary.get("signal") or "SIGTERM"
    if name is not None:
        return RanksOutcome(contract.EXIT_INTERRUPTED, "interrupted", f"interrupted by {name}",
                            failures=failures, cause=cause.INTERRUPTED)
    if not failures:
        why = summary.get("agent_error") or f"torch's elastic agent exited with {agent_code}"
        return RanksOutcome(contract.EXIT_FAILED, "failed", why, cause=cause.AGENT)
    return rank_failed(failures)


def rank_failed(failures: dict[str, dict[str, Any]]) -> RanksOutcome:
    """The outcome named by the rank that ended first on its own (not stopped for a peer)."""
    rank, first = min(failures.items(), key=lambda item: (
        item[1].get("cause") == contract.EndCause.PEER_ENDED.value, item[1].get("timestamp", 0),
        int(item[0])))
    code = first["exitcode"]
    if code == contract.EXIT_INTERRUPTED:  # a rank alone was sent SIGINT / SIGTERM
        return RanksOutcome(code, "interrupted", f"rank {rank}: {first['message']}",
                            failures=failures, cause=contract.EndCause.INTERRUPTED)
    if code < 0:
        line = f"rank {rank} was killed by {first['signal'] or f'signal {-code}'}"
        if code == -signal.SIGKILL:  # nobody of ours sends it
            line += _sigkill_cause(first.get("node_oom_kills"))
        return RanksOutcome(contract.EXIT_FAILED, "failed", line, failures=failures,
                            cause=contract.EndCause.KILLED)
    said, message = first.get("error"), first["message"]  # our rank's own line, or torch's text
    line = (f"rank {rank}: {said}" if said
            else f"rank {rank} exited with {code}" + (f": {message}" if message else ""))
    rank_cause = first.get("cause")
    known = rank_cause in {c.value for c in contract.EndCause}
    return RanksOutcome(code if code in (contract.EXIT_FAILED, contract.EXIT_USER_ERROR)
                        else contract.EXIT_FAILED, "failed", line, failures=failures,
                        cause=contract.EndCause(rank_cause) if known else contract.EndCause.ERROR)


def _sigkill_cause(node_oom_kills: int | None) -> str:
    """Who sent a rank's SIGKILL, as far as its node's kernel says (process/oom_kills.py)."""
    if node_oom_kills is None:  # no count on that node
        return " (out of memory is the likely cause: `dmesg` or the job's memory record says)"
    if node_oom_kills:
        return (" (out of memory: the kernel's OOM killer killed "
                f"{node_oom_kills} process(es) on its node during the run; `dmesg` names them)")
    return (" (not the kernel's OOM killer: it killed nothing on that node during the run, "
            "/proc/vmstat oom_kill; a person or another process sent it)")
