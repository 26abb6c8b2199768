"""Memory high-water marks of one timed operation (per rank): resident memory (VmHWM, reset
through /proc/self/clear_refs before the operation; without a reset the lifetime peak, with a
warning) and CUDA (the caching allocator's peak of live tensors, not what the driver reserved).
"""

from __future__ import annotations

import re
import resource
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

CLEAR_REFS_PATH = "/proc/self/clear_refs"

_FIELD = re.compile(r"^(Vm\w+|Rss\w+):\s+(\d+)\s*kB\s*$", re.MULTILINE)


def parse_status(text: str) -> dict[str, int]:
    """The `Vm*` / `Rss*` lines of /proc/<pid>/status, in bytes (the kernel writes kB = KiB)."""
    return {name: int(value) * 1024 for name, value in _FIELD.findall(text)}


def read_status(path: str = "/proc/self/status") -> dict[str, int]:
    """This process's memory lines, or {} where there is no /proc."""
    try:
        with open(path) as status:
            return parse_status(status.read())
    except OSError:
        return {}


def reset_peak_rss(path: str = CLEAR_REFS_PATH) -> bool:
    """Reset VmHWM to the current RSS; False where the kernel does not allow it."""
    try:
        with open(path, "w") as clear_refs:
            clear_refs.write("5")  # 5: the peak RSS reset (see proc(5))
        return True
    except OSError:
        return False


def lifetime_peak_rss_bytes() -> int:
    """ru_maxrss: the process's peak since it started (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakMemory:
    """`begin()` right before an operation, `end()` right after: (peak_rss_bytes, cuda bytes).
    Both are cheap (one small /proc write or read), so they may sit next to a timer."""

    def __init__(self, device: torch.device | None = None,
                 warn: Callable[[str], None] | None = None) -> None:
        self.cuda = getattr(device, "type", None) == "cuda"
        self.device = device
        self.warn = warn
        self.per_op = True
        self._warned = False
        self._faults_before = 0
        self.minor_faults: int | None = None

    def begin(self) -> None:
        self._faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        if not reset_peak_rss():
            self.per_op = False
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)

    def end(self) -> tuple[int | None, int | None]:
        # minor page faults since begin(): fresh memory touched during the op
        self.minor_faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                             - self._faults_before)
        peak = read_status().get("VmHWM") if self.per_op else None
        if peak is None:
            peak = lifetime_peak_rss_bytes()
            if self.warn is not None and not self._warned:
                self._warned = True
                self.warn("peak_rss_bytes is the process's lifetime peak (ru_maxrss): this "
                          "kernel cannot reset VmHWM per operation (/proc/self/clear_refs)")
        cuda_peak = None
        if self.cuda:
            import torch

            cuda_peak = int(torch.cuda.max_memory_allocated(self.device))
        return peak, cuda_peak
