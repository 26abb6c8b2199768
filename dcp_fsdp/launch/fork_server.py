"""Imported only by the fork server that forks the test suite's ranks, first in its preload list
(forked_rank.fork_instead; docs/architecture.md, "Forked ranks").

The cyclic collector stays paused for the imports after it (process/collector.py: a quarter of
their CPU otherwise); each rank turns it on as it starts (forked_rank.become_rank). The fork
server ends with the agent that started it, even one killed by SIGKILL, and its ranks with it:
else they ran on, kept by the ranks (each holds the end of its `alive` pipe). Ended by a signal,
it removes its socket's directory, which a killed agent leaves behind.
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
