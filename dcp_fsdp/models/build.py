"""Build a preset's model sharded with FSDP2, without any rank holding it whole.

The model is created on the meta device (no memory), each decoder block and
then the root are wrapped with `fully_shard`, and only then are this rank's
shards materialised (`to_empty`) and filled, on the rank's device and in the
target dtype, with values that are a pure function of (seed, tensor name, global
element index) (models/values.py): any rank can recompute what any shard of a
checkpoint holds, at any world size. Peak memory per rank is therefore about
(parameters / world size).

With `replicas` R > 1 the ranks form R replica groups over a 2-D mesh ("replicate",
"shard") of shape (R, world size / R): FSDP2's HSDP. Each replica holds the whole model,
sharded over its world size / R ranks; rank r is replica r // (world size / R), shard
r % (world size / R) (init_device_mesh lays ranks out row-major). Peak memory per rank is
then about (parameters x R / world size).

With `tp` T > 1 (model.tp) each block's attention and MLP projections are first split over T
ranks by torch's tensor parallel (models/tensor_parallel.py), and FSDP shards over the rest:
the mesh is (dp, tp), or (replicate, shard, tp) with replicas (device_meshes). The values are
still a function of the global index: a TP-split DTensor's shard knows its offsets as any
other does (compat.local_shape_and_global_offset, FSDP's strided split over TP included).
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
    # (replicate, shard) for HSDP (replicas > 1), else a 1-D mesh: the load's broadcast
    # along "replicate" needs its groups (rank/replicas.py)
    mesh: Any = None
    replicas: int = 1
    fill_s: float | None = None  # filling the values (a restart loads them instead)

    # replicas > 1 on an accelerator: gloo over this rank's "replicate" ranks, for the state's
    # CPU tensors in the read_once broadcast (replicate_host_group)
    host_group: dist.ProcessGroup | None = None
    # replicas > 1 with tp > 1, on replica 0's ranks: the group its read_once load runs over
    # (the replica spans the shard and tp dimensions; first_replica_group)
    load_group: dist.ProcessGroup | None = None


REPLICATE_DIM, SHARD_DIM = "replicate", "shard"


def replica_of(rank: int, world_size: int, replicas: int) -> tuple[int, int]:
    """(replica index, shard index) of `rank` on the (replicas, world_size // replicas)
    mesh: ranks 0 .. S-1 are replica 0 (rank 0, DCP's coordinator, is always in it)."""
    shards = world_size // replicas
    return rank // shards, rank % shards


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks: the units FSDP shards and gathers."""
    blocks: Any = None
    if hasattr(model, "model") and hasattr(model.model, "layers"):  # Llama
        blocks = model.model.layers
    elif hasattr(model, "transformer") and hasattr(model.transformer, "h"):  # GPT-2
        blocks = model.transformer.h
    if isinstance(blocks, torch.nn.ModuleList):
        return list(blocks)
    raise ValueError(f"no decoder blocks found in {type(model).__name__}")


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
    for block in decoder_blocks(model):
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
    fill_state(dcp_state_dict(model, optimizer), seed)
    if device.type == "cuda":  # the fill's kernels are done, not only queued
        torch.cuda.synchronize(device)
    fill_s = time.monotonic() - filling
    host_group = replicate_host_group(mesh) if replicas > 1 and device.type != "cpu" else None
    load_group = first_replica_group(world_size, replicas) if replicas > 1 and tp > 1 else None
    return ShardedModel(model, optimizer, param_count, param_bytes, mesh, replicas,
                        fill_s=fill_s, host_group=host_group, load_group=load_group)


def first_replica_group(world_size: int, replicas: int) -> dist.ProcessGroup | None:
    """On replica 0's ranks (0 .. world / R - 1: the mesh is row-major), a group of them all,
    else None. With TP they are a (shard, tp) block, no single mesh dimension's group: a
    read_once load runs DCP over this one (rank/replicas.py). Made once, untimed; only its
    own ranks take part."""
    ranks = list(range(world_size // replicas))
    if dist.get_rank() not in ranks:
        return None
    return dist.new_group(ranks, use_local_synchronization=True)


def device_meshes(device_type: str, world_size: int, replicas: int, tp: int) -> tuple[Any, Any]:
    """(the whole mesh, the mesh FSDP shards over). With tp > 1 the TP ranks are the mesh's
    last (fastest) dimension, so they are neighbouring ranks (one node, as TP wants):
    (dp, tp), or (replicate, shard, tp) with replicas > 1 (HSDP over the first two)."""
    if tp > 1 and replicas > 1:
        mesh = init_device_mesh(device_type, (replicas, world_size // (replicas * tp), tp),
                                mesh_dim_names=(REPLICATE_DIM, SHARD_DIM, TP_DIM))
        return mesh, mesh[REPLICATE_DIM, SHARD_DIM]
    if tp > 1:
        mesh = init_device_mesh(device_type, (world_size // tp, tp),
                                mesh_dim_names=(DP_DIM, TP_DIM))
        return mesh, mesh[DP_DIM]
    if replicas > 1:  # HSDP: fully_shard over a 2-D mesh shards along "shard" only
        mesh = init_device_mesh(device_type, (replicas, world_size // replicas),
                                mesh_dim_names=(REPLICATE_DIM, SHARD_DIM))
        return mesh, mesh
    mesh = init_device_mesh(device_type, (world_size,))
    return mesh, mesh


def replicate_host_group(mesh: Any) -> dist.ProcessGroup:
    """A gloo group over this rank's "replicate" ranks. NCCL moves CUDA tensors only, and a
    state dict holds CPU ones too (AdamW's `step` counters stay on the host): the read_once
    broadcast sends those over this group (rank/replicas.py). Made once, untimed; only the
    group's own ranks take part (its name is a hash of its ranks), so R ranks, not the world,
    synchronise for it."""
    ranks = dist.get_process_group_ranks(mesh.get_group(REPLICATE_DIM))
    return dist.new_group(ranks, backend="gloo", use_local_synchronization=True)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def shard_of(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(this rank's local shard, the whole tensor's shape, the shard's offset in it)."""
    if isinstance(tensor, DTensor):
        _, offset = local_shape_and_global_offset(tensor)
        return tensor.to_local(), tuple(tensor.shape), tuple(offset)
    return tensor, tuple(tensor.shape), (0,) * tensor.dim()


def dcp_state_dict(model: torch.nn.Module,
                   optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """What DCP saves, as every rank saves it: its flattened keys name the
    values (so a load at any world size knows what every shard must hold)."""
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
        local, global_shape, offset = shard_of(tensor)
        identity = (local.data_ptr(), local.numel(), local.dtype)
        if local.numel() == 0 or identity in seen:
            continue
        seen.add(identity)
        yield key, local, global_shape, offset


def fill_state(state_dict: dict[str, Any], seed: int) -> None:
    """Every local shard gets its values (models.values): on its device, in its dtype."""
    with torch.no_grad():
        for key, local, global_shape, offset in unique_shards(state_dict):
            values.fill(local, seed, key, global_shape, offset)


def create_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """AdamW's state as its first step would create it (step, exp_avg, exp_avg_sq), left for
    fill_state to set: no gradients and no optimizer step (a full pass over the model)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            optimizer.state[param] = {
                "step": torch.tensor(0.0, dtype=torch.float32),
                "exp_avg": torch.empty_like(param, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.empty_like(param, memory_format=torch.preserve_format),
            }
