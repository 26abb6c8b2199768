"""Process group and device for one rank, from torchrun's env:// variables."""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import socket
import time
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from dcp_fsdp.config.schema import Backend
from dcp_fsdp.errors import BenchmarkFailure, UserError
from dcp_fsdp.process.failures import root_cause
from dcp_fsdp.rank.device import NCCL_ASYNC_ERROR_HANDLING_ENV, cuda_index, one_device_per_task
from dcp_fsdp.storage.pagecache import POLICY_ORDER

if TYPE_CHECKING:
    from dcp_fsdp.storage.base import CheckpointStore


@dataclasses.dataclass(frozen=True)
class RankContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device
    node_count: int
    hostnames: tuple[str, ...]  # per rank, in rank order: on the coordinator only (else ())

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0


def rank_device(backend: str, local_rank: int, local_world_size: int) -> torch.device:
    """nccl: one of the CUDA devices this process sees (rank/device.py's cuda_index: all of
    the node's, or the one its task is bound to); gloo: the CPU (no CUDA context)."""
    if backend != "nccl":
        return torch.device("cpu")
    return torch.device("cuda", cuda_index(local_rank, local_world_size,
                                           torch.cuda.device_count(), one_device_per_task()))


def init_distributed(backend_setting: Backend, timeout_s: float) -> RankContext:
    """Join the process group the environment describes; `timeout_s` bounds every collective."""
    backend = backend_setting.value
    if backend_setting == Backend.auto:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    device = rank_device(backend, local_rank, local_world_size)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if backend == "nccl":  # read when the group is made; a value the user exported is kept
        # async error handling: a dead peer ends the rank, not blocks it in C++ (where no Python handler runs)
        os.environ.setdefault(NCCL_ASYNC_ERROR_HANDLING_ENV, "1")
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend, init_method="env://",
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if backend == "nccl" else None,
        )
    hostnames = gather_to_keepers(socket.gethostname(), keepers=1)
    node_count, = sum_over_ranks(1 if local_rank == 0 else 0)  # one local rank 0 per node
    return RankContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())),
        backend=backend,
        device=device,
        node_count=node_count,
        hostnames=tuple(hostnames or ()),
    )


# -- collectives whose cost per rank does not grow with the world size ---------------------
# Nothing here hands a rank every other rank's objects: at 1,000 ranks that is the job
# moving gigabytes per operation. Rank 0, which writes the record, gathers; every other rank
# gets a fixed-size answer.

def gather_to_keepers(obj: Any, keepers: int = 2) -> list[Any] | None:
    """Every rank's `obj`, in rank order, on rank 0 (which records the run) and on rank 1
    (which records it when rank 0 has died: session.writes_record); None on the others.
    keepers=1: on rank 0 alone."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine: list[Any] | None = None
    for keeper in range(min(keepers, world)):
        gathered: list[Any] | None = [None] * world if rank == keeper else None
        dist.gather_object(obj, gathered, dst=keeper)
        if rank == keeper:
            mine = gathered
    return mine


def _reduce_device() -> torch.device:
    # NCCL reduces CUDA tensors only; gloo reduces CPU ones
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sum_over_ranks(*values: int, op: Any = dist.ReduceOp.SUM) -> tuple[int, ...]:
    """Each value summed (or reduced by `op`) over all ranks, on every rank."""
    tensor = torch.tensor(values, dtype=torch.int64, device=_reduce_device())
    dist.all_reduce(tensor, op=op)
    return tuple(int(v) for v in tensor.tolist())


def drop_cache_on_node(store: "CheckpointStore", suffix: str, ctx: RankContext) -> str | None:
    """The page cache dropped for checkpoint `suffix` once per node: the node's ranks share
    its files out by local rank; every rank gets the worst policy any rank met."""
    policy = store.drop_cache(suffix, share=(ctx.local_rank, ctx.local_world_size))
    if policy is None:  # no local cache (S3): the same on every rank, nothing to agree on
        return None
    return POLICY_ORDER[sum_over_ranks(POLICY_ORDER.index(policy), op=dist.ReduceOp.MAX)[0]]


def wall_clock_spread_s(rounds: int = 5) -> float:
    """How far apart the ranks' wall clocks read at one instant, at most: the spread of the
    readings after a barrier, whose exit jitter it includes, so the least of a few rounds."""
    best_s = math.inf
    device = _reduce_device()
    for _ in range(rounds):
        dist.barrier()
        now = time.time()
        extremes = torch.tensor([now, -now], dtype=torch.float64, device=device)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)  # the latest, and minus the earliest
        best_s = min(best_s, float(extremes[0] + extremes[1]))
    return best_s


def first_problem(problem: str | None) -> tuple[int, str] | None:
    """(the lowest rank with a problem, its text) on every rank, or None when no rank has one."""
    world = dist.get_world_size()
    rank, = sum_over_ranks(dist.get_rank() if problem is not None else world, op=dist.ReduceOp.MIN)
    if rank == world:
        return None
    return rank, broadcast_object(problem, src=rank)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s object on every rank."""
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def rank0_decides(ctx: "RankContext", decide: Callable[[], Any]) -> Any:
    """Run `decide` on rank 0; every rank gets its result, or raises its UserError, or (any
    other exception) a BenchmarkFailure with rank 0's error: no rank waits for a rank 0 gone."""
    return _raise_or_value(broadcast_object(_decided(ctx, decide)))


def rank0_scatters(ctx: "RankContext", decide: Callable[[], list[Any]]) -> Any:
    """Run `decide` on rank 0 (a list: one item per rank); each rank gets its own item, or
    every rank raises as in rank0_decides. Only the outcome's kind is broadcast."""
    outcome = _decided(ctx, decide)
    kind = broadcast_object(outcome[:1] if outcome[0] == "ok" else outcome)
    if kind[0] != "ok":
        _raise_or_value(kind)
    mine: list[Any] = [None]
    dist.scatter_object_list(mine, outcome[1] if ctx.is_coordinator else None, src=0)
    return mine[0]


def _decided(ctx: "RankContext", decide: Callable[[], Any]) -> tuple[str, Any]:
    if not ctx.is_coordinator:
        return ("ok", None)
    try:
        return ("ok", decide())
    except UserError as error:
        return ("error", str(error))
    except Exception as error:
        return ("failed", f"rank 0: {root_cause(error)}")


def _raise_or_value(outcome: tuple[str, Any]) -> Any:
    if outcome[0] == "error":
        raise UserError(outcome[1])
    if outcome[0] == "failed":
        raise BenchmarkFailure(outcome[1])
    return outcome[1]


def shutdown(aligned: bool) -> None:
    """Tear the process group down. `aligned` (the run succeeded): a barrier first, so no rank
    closes its connections while a peer still uses them (after a failure it could hang)."""
    if not dist.is_initialized():
        return
    if aligned:
        dist.barrier()
    dist.destroy_process_group()
