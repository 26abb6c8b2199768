"""The rank's device: which CUDA device a rank takes, the synchronize that closes every timed
region, and the environment a nccl process group needs to fail in bounded time.

No torch import at module level: the torchrun rank's checks (cli.py, launch/checks.py) use
`cuda_index` before torch is imported.

Why a synchronize before the clock: CUDA work is queued, not done, when the call that queued
it returns. A load's host-to-device copies, a non-blocking staging copy or an NCCL broadcast
(`work.wait()` only makes the current stream wait) may still run when Python reads the
clock; the figure would stop before the work ends. So every clock read that closes a timed
region is preceded by `sync_device(device)` (a no-op on CPU).
"""

from __future__ import annotations

import os
from typing import Any

from dcp_fsdp.errors import UserError

# torch's name (2.2 onwards; NCCL_ASYNC_ERROR_HANDLING before). 1 is TearDown (ProcessGroupNCCL's
# ErrorHandlingMode, torch 2.11-2.15): on a failed or timed-out collective torch's watchdog
# aborts the communicators and ends the process (no exception the rank's Python could catch),
# instead of blocking until the job is killed; torchrun's agent sets 1 too. (2 CleanUpOnly
# aborts without ending the process; 3 SkipCleanUp, torch's own default, ends it without
# aborting the communicators; 0 does nothing.)
NCCL_ASYNC_ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def sync_device(device: Any) -> None:
    """Wait until the work queued on `device` is done (CUDA, or torch's other
    accelerators); nothing on CPU (and nothing imported)."""
    kind = getattr(device, "type", "cpu")
    if kind == "cpu":
        return
    import torch

    if kind == "cuda":
        torch.cuda.synchronize(device)
        return
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "synchronize"):
        accelerator.synchronize(device)


def one_device_per_task(environ: dict[str, str] | None = None) -> bool:
    """CUDA_VISIBLE_DEVICES names exactly one device: the scheduler bound one GPU to this
    task (Slurm's --gpus-per-task=1 sets it per task)."""
    value = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return False
    return len([entry for entry in value.split(",") if entry.strip()]) == 1


def cuda_index(local_rank: int, local_world_size: int, visible_count: int,
               bound_per_task: bool) -> int:
    """The CUDA device (an index into this process's visible devices) for a rank.

    - each rank sees all of the node's devices (visible >= ranks on the node): LOCAL_RANK
    - each rank sees exactly one, bound to its task (`bound_per_task`): device 0
    - anything else would put two ranks on one device (NCCL refuses that): UserError
    """
    if visible_count >= local_world_size and visible_count > 0:
        return local_rank % visible_count
    if visible_count == 1 and bound_per_task:
        return 0
    if visible_count <= 1:
        raise UserError(
            f"nproc={local_world_size}: only {visible_count} CUDA device(s) visible here and "
            "backend nccl gives each rank its own; use nproc="
            f"{max(visible_count, 1)} (or LOCAL_WORLD_SIZE) or fewer, bind one GPU per task "
            "(srun --gpus-per-task=1), or backend=gloo for CPU ranks")
    raise UserError(
        f"LOCAL_WORLD_SIZE={local_world_size}: each rank sees {visible_count} CUDA devices "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')!r}), fewer than the "
        "ranks on this node; give every rank all of the node's GPUs or exactly one "
        "(srun --gpus-per-task=1), or start fewer ranks per node")


# How long after op_timeout_s the process group's own timeout may fire: the op watchdog
# (process/watchdog.py) fires at op_timeout_s and writes the record (rank 0) before it ends
# the process; this is that write's time, and more.
RECORD_MARGIN_S = 60.0


def process_group_timeout_s(collective_timeout_s: float, op_timeout_s: float) -> float:
    """The process group's timeout: collective_timeout_s, raised to op_timeout_s +
    RECORD_MARGIN_S when lower. A save or load waits in DCP's collectives for its slowest
    rank; if the group timed out first, NCCL's async error handling (torchrun's default)
    would tear the process down there, before the op watchdog writes the failed record. A
    stuck operation therefore ends by the watchdog, with a record; a collective between
    operations still ends after this timeout."""
    return max(collective_timeout_s, op_timeout_s + RECORD_MARGIN_S)


def nccl_environment(backend: str) -> dict[str, str]:
    """What a rank's environment needs before its process group is made: with nccl, async
    error handling, so that a dead peer or a timed-out collective ends the rank (after
    collective_timeout_s) instead of blocking it in C++, where no Python signal handler
    runs. A value the user exported is kept."""
    if backend != "nccl":
        return {}
    return {NCCL_ASYNC_ERROR_HANDLING_ENV: os.environ.get(NCCL_ASYNC_ERROR_HANDLING_ENV, "1")}
