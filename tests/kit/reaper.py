"""After a test session's pytest process is gone, end every process that still carries the
session's marker in its environment.

A kept `dcp-fsdp s3-server` (and its SeaweedFS) outlives the command that started it, by
design; a test stops it at its end. A session killed mid-run (a time limit on .ci/run,
SIGKILL) never gets there: the server stayed up for an hour (issue 31). tests/conftest.py
sets the marker (MARKER_ENV) at session start, so every process a test starts inherits
it, and starts this reaper in a session of its own, watching pytest's pid.

  python -m tests.kit.reaper PYTEST_PID MARKER

The marker is the session's temporary directory (its TMPDIR): once the processes are ended,
the reaper removes it too, as the session's own finish would have.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from pathlib import Path

import psutil

MARKER_ENV = "DCP_FSDP_TEST_SESSION"
SESSION_DIR_PREFIX = "dcp-fsdp-tests-"  # tests/conftest.py's session directories
POLL_S = 0.5
TERM_GRACE_S = 5.0  # SIGTERM first (a kept server stops its SeaweedFS and removes its data)


def marked(marker: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        if process.pid == os.getpid():
            continue
        try:
            if process.environ().get(MARKER_ENV) == marker:
                found.append(process)
        except psutil.Error:
            continue  # gone meanwhile, or not ours to read
    return found


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def main(argv: list[str]) -> int:
    watched, marker = int(argv[1]), argv[2]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is pytest's to answer
    while not gone(watched):
        time.sleep(POLL_S)
    end_marked(marker)
    if Path(marker).name.startswith(SESSION_DIR_PREFIX):
        shutil.rmtree(marker, ignore_errors=True)
    return 0


def end_marked(marker: str) -> None:
    for signum in (signal.SIGTERM, signal.SIGKILL):
        left = marked(marker)
        if not left:
            return
        for process in left:
            try:
                process.send_signal(signum)
            except psutil.Error:
                pass
        psutil.wait_procs(left, timeout=TERM_GRACE_S)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
