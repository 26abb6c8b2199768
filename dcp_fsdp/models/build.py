"""Build a model sharded with FSDP2, without any rank holding it whole: made on the meta device,
wrapped with `fully_shard` (after TP, with model.tp), and only then this rank's shards materialised
and filled with values any rank can recompute at any world size (models/values.py).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from dcp_fsdp.compat import flatten_state_dict, local_shape_and_global_offset
from dcp_fsdp.config.schema import CheckpointState, Dtype
from dcp_fsdp.models import values
from dcp_fsdp.models.llama_model_config import ModelShape
from dcp_fsdp.models.modules import module_tree
from dcp_fsdp.models.presets import PRESETS
from dcp_fsdp.models.tensor_parallel import DP_DIM, TP_DIM, tp_plan

if TYPE_CHECKING:
    from collections.abc import Iterator

TORCH_DTYPES = {Dtype.fp32: torch.float32, Dtype.bf16: torch.bfloat16}


@dataclasses.dataclass
class ShardedModel:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    param_count: int  # whole model, not this rank's shard
    param_bytes: int  # whole model
    mesh: Any = None  # device_meshes' whole mesh: a read_once load broadcasts along "replicate"
    replicas: int = 1
    fill_s: float | None = None  # filling the values (a restart loads them instead)
    host_group: dist.ProcessGroup | None = None  # replicate_host_group's
    load_group: dist.ProcessGroup | None = None  # first_replica_group's


REPLICATE_DIM, SHARD_DIM = "replicate", "shard"


def replica_of(rank: int, world_size: int, replicas: int) -> tuple[int, int]:
    """(replica index, shard index) of `rank` on the (replicas, world_size // replicas)
    mesh: ranks 0 .. S-1 are replica 0 (rank 0, DCP's coordinator, is always in it)."""
    shards = world_size // replicas
    return rank // shards, rank % shards


def build_sharded_model(model_shape: str | ModelShape, dtype: Dtype, state: CheckpointState,
                        device: torch.device, world_size: int, seed: int,
                        replicas: int = 1, moe_layout: str = "hf", tp: int = 1) -> ShardedModel:
    """`model_shape`: a preset's name or a shape (model.config's); `tp` > 1: tensor parallel
    over that many ranks inside each FSDP shard group (models/tensor_parallel.py)."""
    shape = PRESETS[model_shape] if isinstance(model_shape, str) else model_shape
    with torch.device("meta"):
        model = module_tree(shape, moe_layout).to(TORCH_DTYPES[dtype])

    param_count = sum(p.numel() for p in model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    mesh, fsdp_mesh = device_meshes(device.type, world_size, replicas, tp)
    blocks = model.get_submodule("transformer.h" if shape.family == "gpt2" else "model.layers")
    for block in blocks.children():  # the repeated transformer blocks: the units FSDP gathers
        if tp > 1:  # TP first: FSDP then shards the TP shards (FSDP2's 2-D composition)
            parallelize_module(block, mesh[TP_DIM], tp_plan(block))
        fully_shard(block, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)

    model.to_empty(device=device)
    optimizer = None
    if state == CheckpointState.model_and_optimizer:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        create_optimizer_state(optimizer)
    filling = time.monotonic()
    with torch.no_grad():  # every local shard gets its values (models.values)
        for key, local, global_shape, offset in unique_shards(dcp_state_dict(model, optimizer)):
            values.fill(local, seed, key, global_shape, offset)
    if device.type == "cuda":  # the fill's kernels are done, not only queued
        torch.cuda.synchronize(device)
    fill_s = time.monotonic() - filling
    host_group = replicate_host_group(mesh) if replicas > 1 and device.type != "cpu" else None
    load_group = first_replica_group(world_size, replicas) if replicas > 1 and tp > 1 else None
    return ShardedModel(model, optimizer, param_count, param_bytes, mesh, replicas,
                        fill_s=fill_s, host_group=host_group, load_group=load_group)


def first_replica_group(world_size: int, replicas: int) -> dist.ProcessGroup | None:
    """On replica 0's ranks (0 .. world / R - 1), a group of them all, else None: with TP they
    are no single mesh dimension's group, and a read_once load runs DCP over it."""
    ranks = list(range(world_size // replicas))
    return dist.new_group(ranks, use_local_synchronization=True) if dist.get_rank() in ranks else None


def device_meshes(device_type: str, world_size: int, replicas: int, tp: int) -> tuple[Any, Any]:
    """(the whole mesh, the mesh FSDP shards over: with replicas HSDP's 2-D one, which it shards
    along "shard" only). TP is the last (fastest) dimension, so its ranks are neighbours, on one
    node as TP wants."""
    if replicas == 1 and tp == 1:
        mesh = init_device_mesh(device_type, (world_size,))
        return mesh, mesh
    shards = world_size // (replicas * tp)
    fsdp = {REPLICATE_DIM: replicas, SHARD_DIM: shards} if replicas > 1 else {DP_DIM: shards}
    dims = {**fsdp, TP_DIM: tp} if tp > 1 else fsdp
    mesh = init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))
    return mesh, mesh[tuple(fsdp)] if tp > 1 else mesh


def replicate_host_group(mesh: Any) -> dist.ProcessGroup:
    """A gloo group over this rank's "replicate" ranks, for the state's CPU tensors (AdamW's
    `step`) in the read_once broadcast: NCCL moves CUDA tensors only."""
    ranks = dist.get_process_group_ranks(mesh.get_group(REPLICATE_DIM))
    return dist.new_group(ranks, backend="gloo", use_local_synchronization=True)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def dcp_state_dict(model: torch.nn.Module,
                   optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """What DCP saves: its flattened keys name the values a load must find."""
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def unique_shards(state_dict: dict[str, Any]
                  ) -> Iterator[tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]]:
    """(key, local, global shape, offset) per tensor of a DCP state dict, in key order, each
    storage once: a tied weight (GPT-2's lm_head and wte) holds the values of its first key."""
    flat, _ = flatten_state_dict(state_dict)
    seen = set()
    for key in sorted(flat):
        tensor = flat[key]
        if not isinstance(tensor, torch.Tensor):
            continue
        local = local_tensor(tensor)
        identity = (local.data_ptr(), local.numel(), local.dtype)
        if local.numel() == 0 or identity in seen:
            continue
        seen.add(identity)
        dtensor = isinstance(tensor, DTensor)
        offset = local_shape_and_global_offset(tensor)[1] if dtensor else (0,) * tensor.dim()
        yield key, local, tuple(tensor.shape), tuple(offset)


def create_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """AdamW's state as its first step makes it, for the fill to set, without gradients or a step (a full pass)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            optimizer.state[param] = {
                "step": torch.tensor(0.0, dtype=torch.float32),
                "exp_avg": torch.empty_like(param, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.empty_like(param, memory_format=torch.preserve_format),
            }
