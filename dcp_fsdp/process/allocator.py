"""The memory allocator a rank runs, and glibc's thresholds raised on request (malloc=raised):
raised mmap and trim thresholds keep a load's large blocks on the heap with their pages mapped,
and one arena keeps the connector's threads from mapping each part afresh (docs/metrics.md
"The allocator"). The values go to the ranks' environment from the launcher (glibc reads them
as a process starts), and `mallopt` sets them again in the rank.
"""

from __future__ import annotations

import ctypes
import os
import platform
from pathlib import Path

MMAP_THRESHOLD_BYTES = 256 * 2**20
TRIM_THRESHOLD_BYTES = 2**30  # mallopt takes an int: at most 2 GiB - 1
ARENAS = 1
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc's malloc.h
ENVIRONMENT = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES),
               "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD_BYTES),
               "MALLOC_ARENA_MAX": str(ARENAS)}
# libraries that replace malloc when preloaded or linked, as /proc/self/maps names them
REPLACEMENTS = ("jemalloc", "tcmalloc", "mimalloc")


def loaded_allocator(maps_path: str = "/proc/self/maps") -> str:
    """The allocator this process runs: a replacement it has mapped, else its libc's."""
    try:
        maps = Path(maps_path).read_text(errors="replace")
    except OSError:
        maps = ""
    for name in REPLACEMENTS:
        if f"lib{name}" in maps:
            return name
    libc, version = platform.libc_ver()
    return f"{libc or 'unknown libc'} {version}".strip()


def allocator_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables that change the ranks' allocator (MALLOC_*, GLIBC_TUNABLES, LD_PRELOAD)."""
    environ = dict(os.environ if environ is None else environ)
    return {key: environ[key] for key in sorted(environ)
            if key.startswith("MALLOC_") or key in ("GLIBC_TUNABLES", "LD_PRELOAD")}


def preloaded_replacement(environ: dict[str, str] | None = None) -> str | None:
    """A malloc replacement LD_PRELOAD names (malloc=raised does not apply to it)."""
    preload = (os.environ if environ is None else environ).get("LD_PRELOAD", "")
    return next((name for name in REPLACEMENTS if name in preload), None)


def raise_glibc_thresholds() -> None:
    """glibc's thresholds raised and arenas limited, here and in children; OSError where glibc
    refuses (the launcher refused other allocators before any rank started)."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None or not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                               and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
                               and mallopt(_M_ARENA_MAX, ARENAS)):
        raise OSError("malloc=raised: glibc's mallopt refused the thresholds")
    os.environ.update(ENVIRONMENT)


def describe(raised: bool, environment: dict[str, str]) -> dict[str, object]:
    """The record's `allocator` block: what the ranks run, how it was set, and the
    variables the rank started with (`allocator_environment()` before raising)."""
    return {"name": loaded_allocator(), "thresholds": "raised" if raised else "default",
            "environment": environment}
