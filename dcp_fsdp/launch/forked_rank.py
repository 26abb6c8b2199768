"""Ranks forked from the agent instead of exec'd, for the test suite only: the imports done
once per node, not once per rank.

torchrun starts `-m dcp_fsdp` by exec: each rank a fresh interpreter that imports torch,
DCP and the package again before its first figure (about 5.6 CPU s a rank on a 2-core VM,
docs/measurements/2026-11-27-ci-cost.md). So does our agent for every measured run: a
benchmark measures the process its users run. Only where the test suite asks
(contract.FORK_RANKS_TEST_ONLY_ENV=1, tests/conftest.py; the product never sets it) our agent
(`python -m dcp_fsdp.launch.agent`) imports them once and has torchrun fork the ranks through
its own public entry for that, `--run-path SCRIPT` with `--start-method fork`; SCRIPT is this
file. A fork keeps what an exec would have reset, so the child first becomes the process
`python -u -m dcp_fsdp` would have been (`become_rank`), then runs the module exactly as `-m`
does (runpy). The run line's `rank_start` says `fork` (lifeline.rank_start).

What a fork keeps, and what is done about it:
- the parent-death signal is cleared by fork: set again first thing;
- the agent's signal handlers (torch's raise SignalException): Python's defaults again;
- torch's function entry turns on faulthandler, which an exec'd rank does not have: off;
- the logging levels the agent quietened: restored;
- buffered stdout/stderr: write-through, as `-u` makes them;
- torch's thread count, read before torchrun set OMP_NUM_THREADS: set from it;
- /proc/PID/environ is the agent's (os.environ changes after a fork are not shown there), so
  a forked rank is known by its process name, `dcp-fsdp-r<RANK>` (contract.rank_process_name:
  process/peers.py, tests);
- exit: torch's agent waits for each forked rank's return value, so a rank that succeeded
  returns (lifeline.end_process) instead of ending with os._exit(0); failures still end
  with their exit code.
Values computed when a module was imported (the process's start, its parent) are reset
by those modules' own fork hooks (cli.py, process/peers.py).

Plain `torchrun -m dcp_fsdp` (users' own launches) stays the exec start, and so does every
start on a host with CUDA devices (fork_instead says why).
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import importlib
import logging
import os
import runpy
import signal
import sys
from pathlib import Path

from dcp_fsdp import compat, contract
from dcp_fsdp.process import lifeline

# The package the agent forks for: the module torchrun would otherwise exec (`-m dcp_fsdp`).
MODULE = "dcp_fsdp"
# What a rank of a save or load imports before its first figure besides torch's modules
# (compat.RANK_TORCH_MODULES): the agent imports them once, before it forks. Named, not
# imported here: the agent is below the command line in the layers; a rank imports them.
RANK_MODULES = ("dcp_fsdp.cli", "dcp_fsdp.rank.session", "dcp_fsdp.rank.loop",
                "dcp_fsdp.models.build", "dcp_fsdp.analysis.metrics")
# Loggers whose level the agent lowers (its own lines repeat the launcher's one line).
QUIET_LOGGER_PREFIXES = ("torch.distributed", "torch.multiprocessing")

_agent_log_levels: dict[str, int] = {}  # logger name -> level before the agent quietened it


def forkable(args: argparse.Namespace) -> bool:
    """Whether torchrun's parsed arguments start this package's module (`-m dcp_fsdp`), the
    one start this file knows how to fork."""
    return (bool(args.module) and not args.no_python and not args.run_path
            and args.training_script == MODULE)


def requested() -> bool:
    """Whether the test suite asked for forked ranks (contract.FORK_RANKS_TEST_ONLY_ENV=1);
    any other value (none, "0") is the exec start of every measured run (a value that is
    neither is refused before any rank: launch/checks.py)."""
    return os.environ.get(contract.FORK_RANKS_TEST_ONLY_ENV) == "1"


def fork_instead(args: argparse.Namespace) -> bool:
    """The ranks' imports done here, once, so that every forked rank has them, and
    torchrun's arguments for `-m dcp_fsdp ARGS` made into `--run-path --start-method fork
    THIS-FILE dcp_fsdp ARGS` (torchrun's function entry, `run_script_path`). False, with
    the arguments as they were (exec'd ranks), on a host with CUDA devices or where CUDA is
    initialised in this process: a fork cannot use CUDA once its parent asked CUDA anything.
    torch.cuda.is_available(), which torch's own modules call as they are imported, marks
    every later fork "bad" without initialising CUDA, and the forked rank's first CUDA call
    raises (seen on the lent H100, torch 2.11: docs/measurements/2026-11-28-gpu.md). The
    device count read here is NVML's, which marks nothing."""
    import torch

    if torch.cuda.device_count() > 0:
        return False
    for name in (*compat.RANK_TORCH_MODULES, *RANK_MODULES):
        importlib.import_module(name)
    if torch.cuda.is_initialized():
        return False
    args.module = False
    args.run_path = True
    args.start_method = "fork"
    args.training_script_args = [args.training_script, *args.training_script_args]
    args.training_script = str(Path(__file__))
    # Nothing buffered may be written twice, by the agent and by each fork.
    sys.stdout.flush()
    sys.stderr.flush()
    # What the agent holds (a few hundred thousand objects of the imports) out of the ranks'
    # garbage collections: a collection writes to every object it visits, and in a forked
    # rank each such write copies a shared page, an exec'd rank's collection does not (a
    # 30 % slower save in the timed region, measured: docs/measurements/2026-11-27-ci-cost.md).
    gc.freeze()
    return True


def quiet_agent_logs() -> None:
    """torchrun's own log lines ("failed (exitcode: 1) ...", "Terminating process ...") off in
    the agent; their levels are kept so that a forked rank logs as an exec'd one would."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(QUIET_LOGGER_PREFIXES):
            logger = logging.getLogger(name)
            _agent_log_levels.setdefault(name, logger.level)
            logger.setLevel(logging.CRITICAL)


def become_rank(module: str, rank: int) -> None:
    """In the forked child, before anything else: undo what the fork kept (the module's
    docstring). `rank` names the process."""
    lifeline.die_with_parent(signal.SIGTERM)  # fork cleared it; the agent may be gone already
    lifeline.name_process(contract.rank_process_name(rank))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_DFL)
    faulthandler.disable()  # torch's entry (record) enables it; an exec'd rank has none
    for name, level in _agent_log_levels.items():
        logging.getLogger(name).setLevel(level)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(write_through=True)  # type: ignore[union-attr]
    _threads_from_environment()
    lifeline.return_on_success()
    sys.argv = [module, *sys.argv[2:]]


def _threads_from_environment() -> None:
    """torch's intra-op threads as an exec'd rank would have them: its OpenMP read
    OMP_NUM_THREADS when the agent imported torch, before torchrun set it for the ranks (1
    where the user set none, with more than one rank a node)."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) > 0:
        import torch

        torch.set_num_threads(int(value))


def run_forked(argv: list[str]) -> None:
    """This file run by torchrun's `run_script_path` in the child: argv is [THIS-FILE,
    MODULE, ARGS...]. An interrupt that reaches here ends the rank with 130: returning
    would tell the agent it succeeded."""
    try:
        become_rank(argv[1], int(os.environ["RANK"]))
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    except KeyboardInterrupt:
        lifeline.end_process(contract.EXIT_INTERRUPTED)


if __name__ == "__main__":
    # runpy runs this file as a fresh namespace: the agent's imported copy of this module
    # holds the levels it saved.
    from dcp_fsdp.launch import forked_rank

    forked_rank.run_forked(sys.argv)
