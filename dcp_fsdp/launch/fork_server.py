"""Imported only by the fork server that forks the test suite's ranks (forked_rank.fork_instead
names it first in the fork server's preload list).

The cyclic collector stays paused for the imports after it, a rank's (process/collector.py: a
quarter of their CPU otherwise), and in the fork server; each rank turns it on as it starts
(forked_rank.become_rank).

The fork server ends with the agent that started it, even one killed by SIGKILL, and its ranks
with it (each rank's own parent-death signal), as exec'd ranks end with their agent. Without it
a killed agent's fork server ran on, kept by its ranks (each holds the end of its `alive` pipe),
and so did the ranks: a Slurm test's node whose agent was killed mid-save left no record of the
checkpoint it cut short. Ended by a signal, it removes its socket's directory, which a killed
agent leaves behind.
"""

import gc
import os
import shutil
import signal
import tempfile
from pathlib import Path
from types import FrameType
from typing import NoReturn

from dcp_fsdp.launch import forked_rank
from dcp_fsdp.process import lifeline

_AGENT_PID = os.getppid()


def _end(signum: int, frame: FrameType | None) -> NoReturn:
    place = Path(forked_rank.socket_dir_parent() or tempfile.gettempdir())
    for path in place.glob(f"{forked_rank.SOCKET_DIR_PREFIX}p{_AGENT_PID}-h{lifeline.host_tag()}-*"):
        shutil.rmtree(path, ignore_errors=True)
    os._exit(128 + signum)


gc.disable()
signal.signal(signal.SIGTERM, _end)  # a rank resets it as it starts (become_rank)
lifeline.die_with_parent(signal.SIGTERM)
