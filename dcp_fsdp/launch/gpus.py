"""The CUDA devices this process could use, counted without torch (whose CUDA start-up costs
5-20 s): the driver's list, narrowed by CUDA_VISIBLE_DEVICES as the CUDA runtime does. A MIG
slice named there counts as one device, as CUDA sees it.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

PROC_GPUS = Path("/proc/driver/nvidia/gpus")
_GPU_LINE = re.compile(r"^GPU \d+:", re.MULTILINE)
_NVIDIA_SMI_TIMEOUT_S = 30


def physical_gpu_count() -> int:
    """GPUs the driver lists: `nvidia-smi -L`, else /proc/driver/nvidia/gpus/*, else 0."""
    try:
        answer = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                timeout=_NVIDIA_SMI_TIMEOUT_S)
        if answer.returncode == 0:
            return len(_GPU_LINE.findall(answer.stdout))
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        return sum(1 for entry in PROC_GPUS.iterdir() if entry.is_dir())
    except OSError:
        return 0


def visible_count(physical: int, cuda_visible_devices: str | None) -> int:
    """How many of `physical` GPUs CUDA would enumerate under CUDA_VISIBLE_DEVICES: its
    entries in order, up to the first that is not a device (an index out of range or
    repeated, -1, garbage); UUIDs (GPU-..., MIG-...) are taken as given."""
    if cuda_visible_devices is None:
        return physical
    seen: set[str] = set()
    for raw in cuda_visible_devices.split(","):
        entry = raw.strip()
        if entry.isdigit():
            if int(entry) >= physical or str(int(entry)) in seen:
                break
            seen.add(str(int(entry)))
        elif entry.startswith(("GPU-", "MIG-")) and entry not in seen:
            seen.add(entry)
        else:
            break
    return len(seen)


def visible_gpu_count() -> int:
    """The CUDA devices this process would see, without importing torch."""
    physical = physical_gpu_count()
    return visible_count(physical, os.environ.get("CUDA_VISIBLE_DEVICES")) if physical else 0
