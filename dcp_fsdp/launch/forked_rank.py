"""Ranks forked instead of exec'd, for the test suite only (contract.FORK_RANKS_TEST_ONLY_ENV=1):
the imports done once per node, not once per rank (docs/architecture.md, "Forked ranks").

Our agent has torchrun start the ranks with `--run-path THIS-FILE --start-method forkserver`:
Python's fork server imports what a rank imports and forks each rank from its single thread.
Never the agent: its threads (torch's store server, the rendezvous keep-alive) may hold a lock
at the fork, and such a rank hung in its first store call (an 8-rank save, 1 in ~60 runs). A
forked rank is known by its process name (its /proc environ is its parent's).
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import logging
import multiprocessing
import os
import runpy
import signal
import sys
import tempfile
from pathlib import Path

from dcp_fsdp import compat, contract
from dcp_fsdp.process import lifeline

# The package forked for: the module torchrun would otherwise exec (`-m dcp_fsdp`).
MODULE = "dcp_fsdp"
# What a rank imports besides torch's modules (compat.RANK_TORCH_MODULES): named, not
# imported here (the agent is below the command line in the layers).
RANK_MODULES = ("dcp_fsdp.cli", "dcp_fsdp.rank.session", "dcp_fsdp.rank.loop",
                "dcp_fsdp.models.build", "dcp_fsdp.analysis.metrics")
# Imported by the fork server alone, first: the collector paused for the imports after it, and
# the fork server ends with the agent (its docstring says why).
FORK_SERVER_MODULE = "dcp_fsdp.launch.fork_server"
# The fork server's socket directory: SOCKET_DIR_PREFIX + lifeline.owned_tempdir's name, its
# pid the agent's (the fork server finds it by that, fork_server.py).
SOCKET_DIR_PREFIX = "dcp-fsdp-mp-"
# The longest TMPDIR that holds the fork server's socket in a directory of ours: 107 bytes
# less "/dcp-fsdp-mp-p<pid>-h<host>-<8>/listener-<8>" (~55).
SHORT_TMPDIR_CHARS = 50
# Loggers whose level the agent lowers (its own lines repeat the launcher's one line).
QUIET_LOGGER_PREFIXES = ("torch.distributed", "torch.multiprocessing")


def forkable(args: argparse.Namespace) -> bool:
    """Whether torchrun's arguments start `-m dcp_fsdp`, the one start this file can fork."""
    return (bool(args.module) and not args.no_python and not args.run_path
            and args.training_script == MODULE)


def requested() -> bool:
    """Whether the test suite asked for forked ranks (contract.FORK_RANKS_TEST_ONLY_ENV=1)."""
    return os.environ.get(contract.FORK_RANKS_TEST_ONLY_ENV) == "1"


def fork_instead(args: argparse.Namespace) -> bool:
    """torchrun's arguments for `-m dcp_fsdp ARGS` made into `--run-path --start-method
    forkserver THIS-FILE dcp_fsdp ARGS`, the fork server told to import what a rank imports.
    False, with the arguments as they were, on a host with CUDA devices: torch's modules call
    torch.cuda.is_available() as they are imported, which marks every later fork "bad"
    (docs/measurements/2026-11-28-gpu.md); the device count read here is NVML's, which does not."""
    import torch

    if torch.cuda.device_count() > 0:
        return False
    multiprocessing.set_forkserver_preload([FORK_SERVER_MODULE, *compat.RANK_TORCH_MODULES,
                                            *RANK_MODULES, __name__])
    # The fork server listens on a unix socket in multiprocessing's temporary directory (the
    # agent removes it as it ends, the fork server as a signal ends it): a path holds at most
    # 107 bytes, and under a deep TMPDIR (a Slurm test's job) the socket's did not fit.
    compat.use_multiprocessing_tempdir(str(lifeline.owned_tempdir(SOCKET_DIR_PREFIX,
                                                                  socket_dir_parent())))
    args.module = False
    args.run_path = True
    args.start_method = "forkserver"
    args.training_script_args = [args.training_script, *args.training_script_args]
    args.training_script = str(Path(__file__))
    # Nothing buffered may be written twice, by the agent and by each rank.
    sys.stdout.flush()
    sys.stderr.flush()
    return True


def socket_dir_parent() -> str | None:
    """Where the fork server's socket directory goes: TMPDIR (None) where the path fits."""
    return None if len(tempfile.gettempdir()) <= SHORT_TMPDIR_CHARS else "/tmp"


def quiet_agent_logs() -> None:
    """torchrun's own log lines off in the agent (the fork server's ranks keep torch's levels)."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(QUIET_LOGGER_PREFIXES):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def become_rank(module: str, rank: int) -> None:
    """In the forked child, first: undo what the fork kept. `rank` names the process."""
    # The fork server's imports out of the rank's collections: each write a collection makes
    # to one copies a shared page (a 30 % slower save, docs/measurements/2026-11-27-ci-cost.md).
    # Freezing moves whole lists: it writes to no object. The collector runs again, as in an
    # exec'd rank (the fork server paused it for its imports).
    gc.freeze()
    gc.enable()
    lifeline.die_with_parent(signal.SIGTERM)  # fork cleared it; the fork server exits with the agent
    lifeline.name_process(contract.rank_process_name(rank))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_DFL)
    faulthandler.disable()  # torch's entry (record) enables it; an exec'd rank has none
    # multiprocessing's default start method as an exec'd rank's (a fresh interpreter's), not
    # the "forkserver" the fork server's children inherit: what the rank starts with the
    # default context starts as it would for a user
    multiprocessing.set_start_method(None, force=True)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(write_through=True)  # type: ignore[union-attr]
    # torch's intra-op threads as an exec'd rank would have them: its OpenMP read
    # OMP_NUM_THREADS when the fork server imported torch, before torchrun set it for the ranks
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) > 0:
        import torch

        torch.set_num_threads(int(value))
    lifeline.return_on_success()
    sys.argv = [module, *sys.argv[2:]]


def run_forked(argv: list[str]) -> None:
    """This file run by torchrun in the child: argv is [THIS-FILE, MODULE, ARGS...]. An
    interrupt ends the rank with 130: returning would tell the agent it succeeded."""
    try:
        become_rank(argv[1], int(os.environ["RANK"]))
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    except KeyboardInterrupt:
        lifeline.end_process(contract.EXIT_INTERRUPTED)


if __name__ == "__main__":
    # runpy runs this file as a fresh namespace: the agent's imported copy holds the levels.
    from dcp_fsdp.launch import forked_rank

    forked_rank.run_forked(sys.argv)
