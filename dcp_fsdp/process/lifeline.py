"""Processes die with the process that started them, whatever kills it (even SIGKILL),
and what a killed run could not remove is removed by the next one.

Linux's PR_SET_PDEATHSIG delivers a signal to a process when its parent ends; it is set
in the child (after fork, or first thing in a rank), so it holds for the embedded server,
torch's elastic agent and the agent's ranks. Temporary directories carry their owner's pid
and host in the name (`dcp-fsdp-...-p<pid>-h<host>-...`); `remove_stale()` deletes this
host's whose owner is gone, never another host's.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import signal
import socket
import tempfile
from pathlib import Path
from typing import NoReturn

import psutil

_PR_SET_PDEATHSIG = 1
# `-p<pid>-h<host>-`: a pid means nothing on another host, and a shared TMPDIR (NFS or
# Lustre scratch) is seen by many. Names without the host tag are from older versions.
_OWNER = re.compile(r"-p(\d+)-(?:h([0-9a-f]{8})-)?")
SERVER_PID_FILE = "server.pid"  # a server using the directory: never removed under it
# Every temporary directory of ours starts with this (run dirs, the server's data dir,
# per-rank request logs).
TEMP_PREFIX = "dcp-fsdp-"
# SeaweedFS's gRPC servers put unix sockets in /tmp whatever TMPDIR says.
SEAWEED_SOCKET_DIRS = ("/tmp",)


def die_with_parent(signum: int = signal.SIGTERM) -> bool:
    """Ask Linux to send `signum` to this process when its parent ends. False where the
    call is not available (not Linux): the process then outlives a killed parent."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    # The parent may have died before the call: then nobody would send the signal.
    if os.getppid() == 1:
        os.kill(os.getpid(), signum)
    return True


def host_tag() -> str:
    """8 hex digits naming this host (its hostname hashed): in temporary names, so that one
    node never judges another node's directory by a pid of its own."""
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def owned_tempdir(prefix: str, parent: str | None = None) -> Path:
    """A fresh directory in `parent` (default $TMPDIR) whose name carries this process's
    pid and host."""
    return Path(tempfile.mkdtemp(prefix=f"{prefix}p{os.getpid()}-h{host_tag()}-", dir=parent))


def alive(pid: int) -> bool:
    """Whether process pid runs (a zombie counts as gone)."""
    try:  # a zombie is gone for our purposes
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # another user's process: it exists
        return True


def remove_stale(tmpdir: str | None = None) -> list[Path]:
    """Remove our temporary directories whose owner process is gone (a launcher or rank
    killed before it could clean up), and the SeaweedFS sockets named in them."""
    removed, here = [], host_tag()
    places = dict.fromkeys([tmpdir or tempfile.gettempdir(), *SEAWEED_SOCKET_DIRS])
    for path in (p for place in places for p in Path(place).glob(TEMP_PREFIX + "*")):
        owner = _OWNER.search(path.name[len(TEMP_PREFIX):])
        if owner is None or owner.group(2) not in (None, here) or alive(int(owner.group(1))):
            continue  # not ours, another host's (its pid means nothing here), or alive
        try:
            if alive(int((path / SERVER_PID_FILE).read_text())):
                continue  # its server is still stopping: the next run removes it
        except (OSError, ValueError):
            pass
        for ports_file in path.glob("**/ports.txt"):
            remove_seaweed_sockets(int(p) for p in ports_file.read_text().split())
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def remove_seaweed_sockets(ports) -> None:
    """SeaweedFS leaves `seaweedfs-*-<port>.sock` for its gRPC ports, in /tmp even when
    TMPDIR points elsewhere."""
    dirs = {*SEAWEED_SOCKET_DIRS, tempfile.gettempdir()}
    for port in ports:
        for where in dirs:
            for leftover in Path(where).glob(f"seaweedfs-*-{port}.sock"):
                leftover.unlink(missing_ok=True)


def end_process(exit_code: int) -> NoReturn:
    """End a rank's process now, skipping interpreter teardown. The native libraries'
    threads (gloo, the CRT S3 client) are still about at exit, and their destructors
    can abort a process that has already succeeded ("terminate called without an
    active exception", exit 134), which would turn a good run into a failed job.
    Everything we keep is written and flushed by then. No torch import here: a rank
    stopped while torch was still importing ends through this too."""
    import logging
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(exit_code)
