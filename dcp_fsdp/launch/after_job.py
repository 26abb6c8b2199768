"""After a Slurm job's step (batch/common.sh; docs/slurm.md): what the local launcher does after
its ranks. Reads what the step left in the job's shared directory (per node task `node-<id>/`:
`agent.json`, `agent-exit`; `writing-suffix`; srun's `srun.err`), decides the first cause, then
`aftermath.settle`s; exits with the code of docs/reliability.md "How a run ends".
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
from pathlib import Path

from dcp_fsdp import contract, log
from dcp_fsdp.config.arguments import CommandArguments
from dcp_fsdp.errors import UserError
from dcp_fsdp.launch.aftermath import RanksOutcome, settle
from dcp_fsdp.launch.local import rank_failed

# srun's line for a task that ended badly: "srun: error: node2: task 1: Killed"
_SRUN_TASK_END = re.compile(r"^srun: error: (\S+): tasks? ([0-9,-]+): (.+)$")
# torch's --log-dir layout: <dir>/<rdzv run>_<random>/attempt_<n>/<local rank>/error.json
_ERROR_FILES = "*/attempt_*/*/error.json"


def node_reports(job_dir: Path) -> list[dict]:
    """One entry per node task that started (`agent_exit` None: the task itself was killed)."""
    reports = []
    for node in sorted(job_dir.glob("node-*")):
        entry: dict = {"node": node.name.removeprefix("node-"), "host": None, "summary": None,
                       "agent_exit": None, "ended_s": None, "error_files": {}}
        with contextlib.suppress(OSError, ValueError):
            entry["summary"] = json.loads((node / "agent.json").read_text())
        with contextlib.suppress(OSError, ValueError):
            code, ended, host = (node / "agent-exit").read_text().split()[:3]
            entry.update(agent_exit=int(code), ended_s=int(ended), host=host)
        if entry["host"] is None:
            entry["host"] = f"node task {entry['node']}"
            with contextlib.suppress(OSError):
                entry["host"] = (node / "host").read_text().strip()
        for path in node.glob(f"torchelastic/{_ERROR_FILES}"):
            try:
                data = json.loads(path.read_text())
                ours = data.get(contract.ERROR_FILE_KEY)
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(ours, dict):
                entry["error_files"][path.parent.name] = {**ours, "timestamp": data.get("timestamp")}
        reports.append(entry)
    return reports


def srun_task_ends(job_dir: Path) -> list[tuple[str, str]]:
    """srun's own account of tasks that ended badly, in its order: [(host, how)]."""
    lines: list[str] = []
    with contextlib.suppress(OSError):
        lines = (job_dir / "srun.err").read_text(errors="replace").splitlines()
    return [(m[1], m[3].strip()) for m in map(_SRUN_TASK_END.match, lines) if m]


def _signal_name(code: int) -> str:
    """An exit status of 128+N (a shell's report of a process killed by signal N)."""
    with contextlib.suppress(ValueError):
        return signal.Signals(code - 128).name
    return f"signal {code - 128}"


def _candidates(reports: list[dict], srun_ends: list[tuple[str, str]]) -> list[tuple]:
    """Every cause on offer, as (sort key, line, cause): a rank that ended on its own, or a
    node's agent that ended without saying why. Earliest first; within one second (torch's
    timestamps are whole seconds) a kill before an error, an error before a peer-stopped rank."""
    found: list[tuple] = []
    srun_order = {host: n for n, (host, _) in enumerate(srun_ends)}
    for report in reports:
        host, summary = report["host"], report["summary"]
        order = srun_order.get(host, len(srun_order))
        if summary is None:
            code, stamp = report["agent_exit"], report["ended_s"]
            if code is None:  # the task itself is gone: srun says how
                how = dict(srun_ends).get(host)
                line = (f"{host}: the node's task ended ({how}, says srun) and its torchrun "
                        "agent wrote no outcome" if how else
                        f"{host}: the node's torchrun agent and its task were killed (neither "
                        "wrote an outcome)")
                stamp = -1 if host in srun_order else float("inf")
            elif code > 128:
                line = f"{host}: the node's torchrun agent was killed by {_signal_name(code)}"
            else:
                line = f"{host}: the node's torchrun agent exited with {code} before any rank"
            found.append(((0, stamp, 0, order), line, contract.EndCause.KILLED))
            found.extend(_own_errors(report, order))
            continue
        for rank, failure in (summary.get("failures") or {}).items():
            stopped = failure.get("cause") in (contract.EndCause.PEER_ENDED.value,
                                               contract.EndCause.INTERRUPTED.value)
            killed = failure.get("exitcode", 0) < 0
            outcome = rank_failed({rank: failure})
            found.append(((int(stopped), failure.get("timestamp", 0), int(not killed), order),
                          outcome.error, outcome.cause))
        if summary.get("agent_error"):
            found.append(((1, report["ended_s"] or 0, 1, order),
                          f"{host}: {summary['agent_error']}", contract.EndCause.AGENT))
    return sorted(found, key=lambda item: item[0])


def _own_errors(report: dict, order: int) -> list[tuple]:
    """A node whose agent wrote no outcome: its ranks' own errors (their --log-dir error files)."""
    errors = (contract.EndCause.ERROR.value, contract.EndCause.USER_ERROR.value)
    return [((0, ours.get("timestamp") or 0, 1, order),
             f"{report['host']} (local rank {local_rank}): {ours.get('error')}", contract.EndCause(ours["cause"]))
            for local_rank, ours in sorted(report["error_files"].items()) if ours.get("cause") in errors]


def job_outcome(reports: list[dict], srun_ends: list[tuple[str, str]], step_exit: int,
                signal_name: str | None) -> RanksOutcome:
    """How the job's step ended, with its first cause."""
    failures: dict[str, dict] = {}
    for report in reports:
        failures.update((report["summary"] or {}).get("failures") or {})
    cause = contract.EndCause
    if signal_name is not None:  # the batch script was signalled: scancel, the time limit
        why = {"SIGUSR1": "the job's time limit is near (Slurm's --signal)"}.get(
            signal_name, f"interrupted by {signal_name}")
        return RanksOutcome(contract.EXIT_INTERRUPTED, "interrupted", why, failures=failures,
                            cause=cause.INTERRUPTED)
    if step_exit == 0 and all(r["summary"] and r["summary"].get("outcome") == "ok"
                              for r in reports):
        return RanksOutcome(contract.EXIT_OK, "ok", cause=cause.OK)
    if not (candidates := _candidates(reports, srun_ends)):
        why = (f"the job step exited with {step_exit} and no torchrun agent reported why "
               "(see srun's lines above)")
        return RanksOutcome(contract.EXIT_FAILED, "failed", why, failures=failures,
                            cause=cause.AGENT)
    _, line, first_cause = candidates[0]
    exit_code = (contract.EXIT_USER_ERROR if first_cause is cause.USER_ERROR
                 else contract.EXIT_INTERRUPTED if first_cause is cause.INTERRUPTED
                 else contract.EXIT_FAILED)
    status = "interrupted" if first_cause is cause.INTERRUPTED else "failed"
    return RanksOutcome(exit_code, status, line, failures=failures, cause=first_cause)


def main(argv: list[str]) -> int:
    parser = CommandArguments(prog="python -m dcp_fsdp.launch.after_job")
    parser.add_argument("--job-dir", required=True, type=Path)
    parser.add_argument("--step-exit", required=True, type=int)
    parser.add_argument("--signal", default=None)
    parser.add_argument("--world-size", type=int, default=None)
    parser.add_argument("command")
    parser.add_argument("overrides", nargs="*")
    try:
        args = parser.parse_args(argv)
    except UserError as error:  # batch/*.sh called it wrong: one line, not a usage block
        log.error(str(error))
        return contract.EXIT_USER_ERROR
    reports = node_reports(args.job_dir)
    outcome = job_outcome(reports, srun_task_ends(args.job_dir), args.step_exit, args.signal)
    with contextlib.suppress(OSError):
        outcome.writing_suffix = (args.job_dir / "writing-suffix").read_text().strip() or None
    run_id = os.environ.get(contract.RUN_ID_ENV)
    if outcome.status == "ok" or not run_id or args.command == "wait":
        return outcome.exit_code
    from dcp_fsdp.config.compose import compose  # hydra: only where a record is written

    try:
        cfg = compose(args.command, args.overrides)
    except UserError as error:  # the ranks said it already, once
        log.info(f"no record written: {error}")
        return contract.EXIT_USER_ERROR
    if args.world_size:
        cfg.nproc = args.world_size
    settle(cfg, run_id, outcome)
    return outcome.exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
