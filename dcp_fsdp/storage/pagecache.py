"""The page cache between a file-system checkpoint and the figures: drop it, and check it.

A load right after a save would otherwise read what the kernel still holds in memory.
Before every timed fs read the ranks of each node share the checkpoint's files out and each
fsyncs (dirty pages cannot be dropped) and posix_fadvise(DONTNEED)s its share (untimed), then
checks with mincore(2) how many pages stayed: the policy that held (docs/metrics.md says
each). On a shared file system (NFS, Lustre) DONTNEED drops this node's client cache, which
is what a reader on another node would start from.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
from pathlib import Path
from typing import Iterable

import psutil

DROPPED = "dropped"  # no page of these files is resident: the read goes to the device
TMPFS = "tmpfs-not-droppable"  # tmpfs / ramfs: memory *is* the storage, DONTNEED does nothing
RESIDENT = "resident-after-drop"  # some pages stayed (mapped, being written, advice ignored)
# Worst last: the ranks of a run record the worst policy any of them met.
POLICY_ORDER = (DROPPED, RESIDENT, TMPFS)

MEMORY_FS_TYPES = frozenset({"tmpfs", "ramfs"})  # the page cache is the storage itself


@functools.cache
def _c_library() -> ctypes.CDLL:
    # the process's own symbols, libc's among them: find_library would run `ldconfig -p`
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
    return libc


def resident_pages(path: str | os.PathLike) -> tuple[int, int]:
    """(pages of `path` in the page cache, pages in the file), by mincore(2) on a mapping
    that is never touched (so the check itself faults nothing in)."""
    size = os.stat(path).st_size
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    if pages == 0:
        return 0, 0
    libc = _c_library()
    with open(path, "rb", buffering=0) as file:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, file.fileno(), 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            vector = (ctypes.c_ubyte * pages)()
            if libc.mincore(address, size, vector) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            return sum(byte & 1 for byte in vector), pages
        finally:
            libc.munmap(address, size)


def file_system_type(path: str | os.PathLike) -> str | None:
    """The type of the mount holding `path`: the longest mount point above it, the last
    mounted of equals (/proc/self/mounts' order)."""
    target = os.path.realpath(path)
    try:
        mounts = [mount for mount in psutil.disk_partitions(all=True) if target == mount.mountpoint
                  or target.startswith(mount.mountpoint.rstrip("/") + "/")]
    except OSError:
        return None
    return max(reversed(mounts), key=lambda mount: len(mount.mountpoint)).fstype if mounts else None


def checkpoint_files(directory: str | os.PathLike) -> list[Path]:
    """Every file under `directory`, sorted: one list on every rank to share out (os.walk stats none)."""
    return sorted(Path(top, name) for top, _, names in os.walk(os.fspath(directory)) for name in names)


def drop(paths: Iterable[str | os.PathLike]) -> str:
    """Sync and evict `paths` from the page cache; the policy that held (DROPPED, TMPFS, RESIDENT).
    Untimed: call it before the aligning barrier of the read it prepares."""
    paths = list(paths)
    for path in paths:
        with open(path, "rb", buffering=0) as file:
            os.fsync(file.fileno())
            os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    if paths and file_system_type(paths[0]) in MEMORY_FS_TYPES:
        return TMPFS
    if any(resident_pages(path)[0] for path in paths):
        return RESIDENT
    return DROPPED
