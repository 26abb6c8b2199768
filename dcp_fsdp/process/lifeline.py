"""Processes die with the process that started them, whatever kills it (Linux's
PR_SET_PDEATHSIG, set in the child), and what a killed run could not remove is removed by the
next one: temporary directories carry their owner's pid and host in the name
(`dcp-fsdp-...-p<pid>-h<host>-...`), and `remove_stale()` deletes this host's whose owner is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import NoReturn

import psutil

from dcp_fsdp import contract

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
# `-p<pid>-h<host>-`: a pid means nothing on another host that shares TMPDIR (NFS, Lustre).
_OWNER = re.compile(r"-p(\d+)-(?:h([0-9a-f]{8})-)?")
SERVER_PID_FILE = "server.pid"  # a server using the directory: never removed under it
TEMP_PREFIX = "dcp-fsdp-"
SEAWEED_SOCKET_DIRS = ("/tmp",)
# The ceiling's DCP-alone rounds write a checkpoint to tmpfs (rank/ceiling.py): memory.
MEMORY_DIR = "/dev/shm"
# A socket nobody listens on is removed once this old (seconds since it was bound).
STALE_SOCKET_AGE_S = 60.0
# A server whose owner is gone was killed with it (SIGKILL): this long to end.
SERVER_END_WAIT_S = 3.0


def _prctl(option: int, value: int | ctypes.c_char_p) -> bool:
    """Linux's prctl(option, value); False where it failed or is not available (not Linux)."""
    try:
        return bool(ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def die_with_parent(signum: int = signal.SIGTERM) -> bool:
    """Ask Linux to send `signum` to this process when its parent ends; False where it cannot."""
    if not _prctl(_PR_SET_PDEATHSIG, int(signum)):
        return False
    # The parent may have died before the call: then nobody would send the signal.
    if os.getppid() == 1:
        os.kill(os.getpid(), signum)
    return True


def _unpickled_dying_with_parent(payload: object) -> object:
    """What unpickling a DiesWithParent runs in the child: SIGKILL when the parent dies."""
    die_with_parent(signal.SIGKILL)
    return payload


class DiesWithParent:
    """`payload`, pickled so that the child that unpickles it (getting the payload's own object)
    dies with its parent (torch's process checkpointer's daemon: orphaned, it would go on uploading)."""

    def __init__(self, payload: object) -> None:
        self.payload = payload

    def __reduce__(self) -> tuple:
        return _unpickled_dying_with_parent, (self.payload,)


def stop_child(child: subprocess.Popen, signum: int, grace_s: float, group: bool = False) -> None:
    """Send `child` (with `group`, its process group) `signum`; SIGKILL its group if not ended in `grace_s`."""
    try:
        if group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signum)
        else:
            child.send_signal(signum)
        child.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()


def name_process(name: str) -> bool:
    """Set this process's name (Linux's comm, cut to 15 bytes); False where it cannot."""
    return _prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]))


def host_tag() -> str:
    """8 hex digits naming this host (its hostname hashed), for temporary names."""
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def owned_tempdir(prefix: str, parent: str | None = None) -> Path:
    """A fresh directory in `parent` (default $TMPDIR) named with this process's pid and host."""
    return Path(tempfile.mkdtemp(prefix=f"{prefix}p{os.getpid()}-h{host_tag()}-", dir=parent))


def alive(pid: int | None) -> bool:
    """Whether process pid runs (a zombie counts as gone); None, 0 or a non-int is no process."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # another user's process: it exists
        return True


def remove_stale(tmpdir: str | None = None) -> list[Path]:
    """Remove our temporary directories whose owner is gone, and the SeaweedFS sockets in them."""
    removed, here = [], host_tag()
    places = dict.fromkeys([tmpdir or tempfile.gettempdir(), *SEAWEED_SOCKET_DIRS, MEMORY_DIR])
    for path in (p for place in places for p in Path(place).glob(TEMP_PREFIX + "*")):
        owner = _OWNER.search(path.name[len(TEMP_PREFIX):])
        if owner is None or owner.group(2) not in (None, here) or alive(int(owner.group(1))):
            continue  # not ours, another host's (its pid means nothing here), or alive
        if _server_runs_in(path):
            continue  # its server is still stopping: the next run removes it
        for ports_file in path.glob("**/ports.txt"):
            remove_seaweed_sockets(int(p) for p in ports_file.read_text().split())
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    removed += remove_dead_seaweed_sockets(places)
    return removed


def _server_runs_in(path: Path, wait_s: float = SERVER_END_WAIT_S) -> bool:
    """Whether the server `path`'s server.pid names still runs there (its command line names
    the directory), after `wait_s` to end: it was killed with its owner."""
    try:
        pid = int((path / SERVER_PID_FILE).read_text())
    except (OSError, ValueError):
        return False
    deadline = time.monotonic() + wait_s
    while True:
        try:
            process = psutil.Process(pid)
            running = (process.status() != psutil.STATUS_ZOMBIE
                       and any(str(path) in arg for arg in process.cmdline()))
        except psutil.NoSuchProcess:
            return False
        except psutil.Error:  # another user's: it is not ours to judge
            return True
        if not running or time.monotonic() >= deadline:
            return running
        time.sleep(0.1)


def remove_dead_seaweed_sockets(places: Iterable[str],
                                min_age_s: float = STALE_SOCKET_AGE_S) -> list[Path]:
    """SeaweedFS's gRPC sockets no server listens on any more, whatever left them: this user's,
    older than `min_age_s` (one bound this moment is not yet listening), refusing a connection."""
    removed = []
    for path in (p for place in places for p in Path(place).glob("seaweedfs-*.sock")):
        try:
            info = path.lstat()
        except OSError:
            continue
        if (not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.getuid()
                or time.time() - info.st_mtime < min_age_s or _listened_on(path)):
            continue
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def _listened_on(path: Path) -> bool:
    """False only when connecting is refused: nobody listens (a busy server may time out)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError as error:
            return not isinstance(error, (ConnectionRefusedError, FileNotFoundError))
    return True


def remove_seaweed_sockets(ports: Iterable[int]) -> None:
    """SeaweedFS's `seaweedfs-*-<port>.sock` for its gRPC ports (in /tmp whatever TMPDIR says)."""
    dirs = {*SEAWEED_SOCKET_DIRS, tempfile.gettempdir()}
    for port in ports:
        for where in dirs:
            for leftover in Path(where).glob(f"seaweedfs-*-{port}.sock"):
                leftover.unlink(missing_ok=True)


_success_returns = False  # return_on_success(): this process was forked by torch's agent


def return_on_success() -> None:
    """This rank was forked by torch's agent, which waits for the forked function's return
    value: from now on end_process(0) raises SystemExit(0) instead of ending the process."""
    global _success_returns
    _success_returns = True


def rank_start() -> str:
    """How this rank's process started, for the run line: forked (the test suite's), or exec'd."""
    return contract.RANK_START_FORK if _success_returns else contract.RANK_START_EXEC


def end_process(exit_code: int) -> NoReturn:
    """End a rank's process now, skipping interpreter teardown: the native libraries' threads
    (gloo, the CRT S3 client) are still about, and their destructors can abort a process
    that has succeeded (exit 134). No torch import: a rank stopped while torch was importing
    ends through this too. A forked rank that succeeded returns instead (return_on_success)."""
    import logging

    returns = exit_code == 0 and _success_returns
    if not returns:
        remove_multiprocessing_tempdir()  # else multiprocessing's own exit, after the return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    if returns:
        raise SystemExit(0)
    os._exit(exit_code)


def remove_multiprocessing_tempdir() -> None:
    """Before os._exit, which skips the finalizer that removes it: multiprocessing's `pymp-*`
    directory in TMPDIR (the process checkpointer's listener socket), if it was imported."""
    util = sys.modules.get("multiprocessing.util")
    if util is not None:  # get_temp_dir() names the one made (making one if none was: removed as well)
        shutil.rmtree(util.get_temp_dir(), ignore_errors=True)
