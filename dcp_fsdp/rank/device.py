"""The rank's device: which CUDA device a rank takes, the synchronize that closes every timed region
(CUDA work is queued, not done, when the call that queued it returns: a clock read without it stops
before the copies end), and the environment a nccl group needs to fail in bounded time. No torch
import at module level: the rank's checks use `cuda_index` before torch is imported.
"""

from __future__ import annotations

import os
from typing import Any

from dcp_fsdp.errors import UserError

# 1 is TearDown (ProcessGroupNCCL's ErrorHandlingMode, torch 2.11-2.15): on a failed or
# timed-out collective torch's watchdog aborts the communicators and ends the process, instead
# of blocking until the job is killed; torchrun's agent sets 1 too.
NCCL_ASYNC_ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def sync_device(device: Any) -> None:
    """Wait until the work queued on `device` is done; nothing on CPU (nothing imported)."""
    kind = getattr(device, "type", "cpu")
    if kind == "cpu":
        return
    import torch

    if kind == "cuda":
        torch.cuda.synchronize(device)
    else:
        torch.accelerator.synchronize(device)


def one_device_per_task(environ: dict[str, str] | None = None) -> bool:
    """CUDA_VISIBLE_DEVICES names one device: a scheduler bound one GPU to this task (--gpus-per-task=1)."""
    value = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES", "")
    return len([entry for entry in value.split(",") if entry.strip()]) == 1


def cuda_index(local_rank: int, local_world_size: int, visible_count: int,
               bound_per_task: bool) -> int:
    """The CUDA device (an index into this process's visible devices) for a rank: LOCAL_RANK
    where each rank sees all of the node's, 0 where it sees the one bound to its task
    (`bound_per_task`); anything else would put two ranks on one device (NCCL refuses): UserError."""
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


RECORD_MARGIN_S = 60.0  # the op watchdog's time to write the record before the group's timeout


def process_group_timeout_s(collective_timeout_s: float, op_timeout_s: float) -> float:
    """collective_timeout_s, raised to op_timeout_s + RECORD_MARGIN_S if lower: a stuck operation
    must end by the op watchdog, with a record, not by NCCL's teardown in DCP's collectives."""
    return max(collective_timeout_s, op_timeout_s + RECORD_MARGIN_S)
