"""The elastic agent of a local run and of each Slurm node's task: torchrun, run in this process
(`python -m dcp_fsdp.launch.agent TORCHRUN-ARGS`). Where torchrun ends a failed or interrupted
run with a traceback, this writes the outcome as JSON (per-rank exit codes, signals, the ranks'
error files) to the file DCP_FSDP_AGENT_SUMMARY names, and the light parent prints the one line.
DCP_FSDP_DEBUG=1 keeps torchrun's log lines.
"""

import contextlib
import json
import os
import signal
import sys
from types import FrameType
from typing import Any, NoReturn

# How the agent's interpreter is started (the local launcher, batch/node_task.sh).
# frozen_modules=off: torch's rendezvous calls inspect.stack(), which searches every imported
# module for a frozen frame's file (runpy's) (docs/architecture.md).
PYTHON_FLAGS = ("-X", "frozen_modules=off")


def _quiet_exit(signum: int, frame: FrameType | None) -> NoReturn:
    # A signal while torch is still importing: no workers yet, and no traceback wanted.
    os._exit(130)


def main(argv: list[str]) -> int:
    from dcp_fsdp import contract
    from dcp_fsdp.process.collector import paused_for_imports
    from dcp_fsdp.process.lifeline import die_with_parent
    from dcp_fsdp.process.oom_kills import oom_kills, oom_kills_since

    oom_kills_at_start = oom_kills()  # before any rank: a SIGKILL'd rank's cause, below

    die_with_parent(signal.SIGTERM)  # the launcher killed (even by SIGKILL): stop the ranks
    parent = os.getppid()
    summary_path = os.environ.get(contract.AGENT_SUMMARY_ENV)
    debug = bool(os.environ.get(contract.DEBUG_ENV))
    with paused_for_imports():  # torch's: a quarter of the agent's CPU otherwise
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import parse_args, run

        from dcp_fsdp.launch import forked_rank

    if not debug:  # torchrun's own lines repeat what the launcher says in one line
        forked_rank.quiet_agent_logs()
    summary: dict = {"outcome": "ok", "signal": None, "failures": {}}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, raise_terminated)
    try:
        args = parse_args(argv)
        # The test suite's switch and `-m dcp_fsdp`: forked ranks, the imports done once
        if forked_rank.requested() and forked_rank.forkable(args):
            forked_rank.fork_instead(args)
        run(args)
    except ChildFailedError as error:
        summary["outcome"] = "failed"
        node_oom_kills = oom_kills_since(oom_kills_at_start)
        for rank, failure in error.failures.items():
            summary["failures"][str(rank)] = {
                "local_rank": failure.local_rank, "pid": failure.pid,
                "exitcode": failure.exitcode,
                "signal": failure.signal_name() if failure.exitcode < 0 else None,
                "message": _message(failure.message), "timestamp": failure.timestamp,
                "node_oom_kills": node_oom_kills,  # the kernel's OOM kills on this node
                # our rank's own fields (status, error, cause), when it wrote its error file
                **_ours(failure.error_file_data, contract.ERROR_FILE_KEY)}
    except SignalException as error:
        summary["outcome"], summary["signal"] = "interrupted", error.sigval.name
    except KeyboardInterrupt as error:  # before the workers started (rendezvous)
        summary.update(outcome="interrupted", signal="SIGTERM" if isinstance(error, Terminated) else "SIGINT")
    except Exception as error:  # the agent itself (rendezvous, ports): one line, not a trace
        summary["outcome"] = "failed"
        summary["agent_error"] = f"{type(error).__name__}: {' '.join(str(error).split())[:400]}"
        if debug:
            raise
    _finish(summary, summary_path, parent)
    return {"ok": 0, "failed": 1, "interrupted": 130}[summary["outcome"]]


def _finish(summary: dict, summary_path: str | None, parent: int) -> None:
    """The outcome to the launcher's file; if the launcher was killed, the last of its
    processes removes what it could not (lifeline.remove_stale)."""
    if summary_path:
        with contextlib.suppress(OSError), open(summary_path, "w") as f:  # OSError: launcher gone
            json.dump(summary, f)
    from dcp_fsdp.process.lifeline import remove_multiprocessing_tempdir, remove_stale

    remove_multiprocessing_tempdir()  # the fork server's socket's (os._exit skips its finalizer)
    if os.getppid() != parent:
        remove_stale()


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C (here and in the launcher, which passes it on as SIGTERM)."""


def raise_terminated(signum: int, frame: FrameType | None) -> NoReturn:
    raise Terminated()


def _ours(error_file_data: Any, key: str) -> dict:
    ours = error_file_data.get(key) if isinstance(error_file_data, dict) else None
    if not isinstance(ours, dict):
        return {}
    return {name: ours.get(name) for name in ("status", "error", "cause")}


def _message(message: Any) -> str:
    """The text of a rank's error file (ours is a string; torch's record() a dict)."""
    if isinstance(message, dict):
        message = message.get("message", "")
    return " ".join(str(message).split())[:1000]


if __name__ == "__main__":
    signal.signal(signal.SIGINT, _quiet_exit)
    signal.signal(signal.SIGTERM, _quiet_exit)
    exit_code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
