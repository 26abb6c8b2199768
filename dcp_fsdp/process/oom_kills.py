"""The kernel's count of OOM kills on this node (`oom_kill` in /proc/vmstat, Linux 4.13+; a
cgroup's memory limit counts too): whether a rank that died of SIGKILL met the OOM killer or a
person. The agent reads it at start and when ranks fail; each failure carries the difference."""

from __future__ import annotations

VMSTAT = "/proc/vmstat"


def oom_kills(path: str = VMSTAT) -> int | None:
    """The count now; None where the kernel does not say (no /proc, an older kernel)."""
    try:
        with open(path) as vmstat:
            return next((int(line.split()[1]) for line in vmstat if line.startswith("oom_kill ")), None)
    except (OSError, ValueError, IndexError):
        return None


def oom_kills_since(before: int | None, path: str = VMSTAT) -> int | None:
    """OOM kills on this node since `before` was read; None where either reading is not known."""
    after = oom_kills(path)
    if before is None or after is None:
        return None
    return max(0, after - before)
