"""Process group and device for one rank, from torchrun's env:// variables."""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
from typing import Any, Callable

import torch
import torch.distributed as dist

from dcp_fsdp.config.schema import Backend
from dcp_fsdp.errors import BenchmarkFailure, UserError
from dcp_fsdp.rank.device import cuda_index, nccl_environment, one_device_per_task


@dataclasses.dataclass(frozen=True)
class RankContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device
    hostnames: tuple[str, ...]  # per rank, in rank order

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    @property
    def node_count(self) -> int:
        return len(set(self.hostnames))


def choose_backend(setting: Backend) -> str:
    if setting == Backend.auto:
        return "nccl" if torch.cuda.is_available() else "gloo"
    return setting.value


def rank_device(backend: str, local_rank: int, local_world_size: int) -> torch.device:
    """nccl: one of the CUDA devices this process sees (rank/device.py's cuda_index: all of
    the node's, or the one its task is bound to); gloo: the CPU (no CUDA context)."""
    if backend != "nccl":
        return torch.device("cpu")
    return torch.device("cuda", cuda_index(local_rank, local_world_size,
                                           torch.cuda.device_count(), one_device_per_task()))


def init_distributed(backend_setting: Backend, timeout_s: float) -> RankContext:
    """Join the process group torchrun (or our launcher) described in the environment.
    `timeout_s` (collective_timeout_s) bounds every collective: with nccl's async error
    handling on, a collective stuck on a dead peer ends the rank after it."""
    backend = choose_backend(backend_setting)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    device = rank_device(backend, local_rank, local_world_size)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.update(nccl_environment(backend))  # read when the nccl group is made
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend, init_method="env://",
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if backend == "nccl" else None,
        )
    hostnames = all_gather_object(socket.gethostname())
    return RankContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())),
        backend=backend,
        device=device,
        hostnames=tuple(hostnames),
    )


def all_gather_object(obj: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s object on every rank."""
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def rank0_decides(ctx: "RankContext", decide: Callable[[], Any]) -> Any:
    """Run `decide` on rank 0; every rank gets its result, or raises its UserError, or
    (any other exception on rank 0) a BenchmarkFailure with rank 0's error: the other
    ranks never wait in the broadcast for a rank 0 that has left it."""
    outcome: tuple[str, Any] = ("ok", None)
    if ctx.is_coordinator:
        try:
            outcome = ("ok", decide())
        except UserError as error:
            outcome = ("error", str(error))
        except Exception as error:
            from dcp_fsdp.process.failures import root_cause

            outcome = ("failed", f"rank 0: {root_cause(error)}")
    outcome = broadcast_object(outcome)
    if outcome[0] == "error":
        raise UserError(outcome[1])
    if outcome[0] == "failed":
        raise BenchmarkFailure(outcome[1])
    return outcome[1]


def shutdown(aligned: bool) -> None:
    """Tear the process group down. `aligned`: every rank got here (the run succeeded),
    so a barrier first keeps one rank from closing its connections while a peer is still
    using them (gloo across hosts then aborts the peer). After a failure a barrier could
    wait on a dead rank, so there is none."""
    if not dist.is_initialized():
        return
    if aligned:
        dist.barrier()
    dist.destroy_process_group()
