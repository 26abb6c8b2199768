"""What each rank of a world would hand DCP's planner, without a rank or a shard in memory: the
state dict of the model built on the meta device, and each rank's local plan as DefaultSavePlanner
makes it for FSDP2 (docs/plan.md, "How it is built").
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import (SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)

from dcp_fsdp.config.schema import CheckpointState, Dtype
from dcp_fsdp.models.llama_model_config import ModelShape
from dcp_fsdp.models.tensor_parallel import block_totals, shard_block, tp_split_dim


@dataclasses.dataclass(frozen=True)
class Entry:
    """One value of the flattened state dict."""

    fqn: str
    shape: tuple[int, ...] | None  # None: not a tensor (written as torch.save bytes)
    dtype: torch.dtype | None
    value: Any = None  # a non-tensor's value (its bytes are torch.save's)

    @property
    def sharded(self) -> bool:
        """FSDP2 shards every parameter (and its AdamW moments) along dim 0."""
        return self.shape is not None and len(self.shape) > 0


@dataclasses.dataclass(frozen=True)
class StateTemplate:
    entries: tuple[Entry, ...]
    mappings: dict[str, Any]  # DCP's flatten mapping: the plans' planner_data

    @property
    def state_bytes(self) -> int:
        """The whole state's tensor bytes (each tensor once, unsharded)."""
        return sum(math.prod(e.shape) * e.dtype.itemsize for e in self.entries
                   if e.shape is not None and e.dtype is not None)


@functools.lru_cache(maxsize=8)
def state_template(model_shape: str | ModelShape, dtype: Dtype, state: CheckpointState,
                   moe_layout: str = "hf") -> StateTemplate:
    """The flattened state dict a save of a model (a preset's name, or a shape) hands DCP."""
    from dcp_fsdp.compat import flatten_state_dict
    from dcp_fsdp.models.build import TORCH_DTYPES, create_optimizer_state, dcp_state_dict
    from dcp_fsdp.models.modules import module_tree
    from dcp_fsdp.models.presets import PRESETS

    shape = PRESETS[model_shape] if isinstance(model_shape, str) else model_shape
    with torch.device("meta"):
        model = module_tree(shape, moe_layout).to(TORCH_DTYPES[dtype])
    optimizer = None
    if state == CheckpointState.model_and_optimizer:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        create_optimizer_state(optimizer)
    flat, mappings = flatten_state_dict(dcp_state_dict(model, optimizer))
    entries = (Entry(fqn, tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor)
               else Entry(fqn, None, None, value) for fqn, value in flat.items())
    return StateTemplate(tuple(entries), dict(mappings))


@functools.lru_cache(maxsize=64)
def _properties(dtype: torch.dtype) -> TensorProperties:
    return TensorProperties.create_from_tensor(torch.empty(0, dtype=dtype, device="meta"))


def _tensor_item(fqn: str, global_shape: tuple[int, ...], dtype: torch.dtype,
                 offsets: tuple[int, ...], sizes: tuple[int, ...], kind: WriteItemType) -> WriteItem:
    """What DCP's planner_helpers make for one tensor chunk (fresh objects per item, as each
    rank's own plan has them)."""
    offset_size = torch.Size(offsets)
    fresh = TensorProperties.__new__(TensorProperties)  # its own copy (copy.copy: 10x slower)
    fresh.__dict__.update(_properties(dtype).__dict__)
    return WriteItem(
        index=MetadataIndex(fqn, offset_size), type=kind,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offset_size, sizes=torch.Size(sizes)),
            properties=fresh, size=torch.Size(global_shape)))


def own_copy(text: str) -> str:
    """A distinct str object of equal value: rank 0 works on unpickled copies of every rank's
    plan, and a shared key object would be pickled once, making `.metadata` smaller than DCP's."""
    return text.encode().decode()


def local_plan(template: StateTemplate, rank: int, world_size: int, replicas: int = 1,
               tp: int = 1) -> SavePlan:
    """DefaultSavePlanner.create_local_plan's plan on `rank`, its planner_data the flatten
    mapping keyed by the items' own key objects."""
    shards = world_size // (replicas * tp)
    # the mesh (replicate, shard[, tp]) is laid out row-major: tp is the fastest dimension
    shard, tp_rank = (rank // tp) % shards, rank % tp
    items = []
    mappings = {}
    for entry in template.entries:
        fqn = own_copy(entry.fqn)
        mappings[fqn] = template.mappings[entry.fqn]
        if entry.shape is None:
            items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
            continue
        assert entry.dtype is not None
        if not entry.sharded:
            items.append(_tensor_item(fqn, entry.shape, entry.dtype, (0,) * len(entry.shape),
                                      entry.shape, WriteItemType.TENSOR))
            continue
        offsets, sizes = shard_block(entry.shape, shards, shard,
                                     tp_split_dim(entry.fqn) if tp > 1 else None, tp, tp_rank)
        items.append(_tensor_item(fqn, entry.shape, entry.dtype, offsets, sizes,
                                  WriteItemType.SHARD))
    return SavePlan(items, planner_data=mappings)


def held_bytes(template: StateTemplate, world_size: int, replicas: int = 1,
               tp: int = 1) -> list[int]:
    """The state's bytes each rank holds (rank order): its block of every tensor, before DCP's
    deduplication decides who writes a shared one. What sizes a rank's memory: the largest."""
    return block_totals([(e.shape, tp_split_dim(e.fqn) if tp > 1 else None, e.dtype.itemsize)
                         for e in template.entries if e.shape is not None and e.dtype is not None],
                        tp, replicas, world_size)
