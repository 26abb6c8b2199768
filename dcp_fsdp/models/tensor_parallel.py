"""Tensor parallel with FSDP (`model.tp=N`) as torchtitan's Llama plan (docs/settings.md,
`model.tp`): the layouts the tool builds, checked before any rank starts, and the per-layer plan
models/build.py applies. torch is imported in `tp_plan` only: the launcher and `plan` check
without it.
"""

from __future__ import annotations

import math
import re
from typing import Any

from dcp_fsdp.errors import UserError
from dcp_fsdp.models.llama_model_config import ModelShape, state_shapes

TP_DIM, DP_DIM = "tp", "dp"


def check_tp(shape: ModelShape, tp: int, replicas: int, world_size: int, name: str) -> None:
    """UserError naming the fix when `world_size` ranks (from `name`) cannot hold `shape` at
    model.tp=`tp`: torch's plan splits heads and widths evenly only."""
    if tp < 1:
        raise UserError(f"model.tp={tp}: must be 1 or more")
    if tp == 1:
        return
    if shape.family == "gpt2":  # c_attn fuses q, k and v: a column split would mix them
        raise UserError(f"model.tp={tp}: tensor parallel is built for llama-like models (q/k/v, "
                        "gate/up, o/down projections), not gpt2; use a llama, qwen or mixtral "
                        "model, or model.tp=1")
    counts = _split_counts(shape)
    for what, count in counts:
        if count and count % tp:
            raise UserError(f"model.tp={tp}: the model's {count} {what} do not split evenly "
                            f"over {tp} ranks; use {_tp_choices(counts, replicas, world_size, name)}")
    group = tp * replicas
    if world_size % group:
        multiple = group * -(-world_size // group)
        times = f" x model.replicas={replicas}" if replicas > 1 else ""
        raise UserError(f"model.tp={tp}: {name}={world_size} is not a multiple of {group} "
                        f"(model.tp{times}); use {name}={multiple}, or "
                        f"{_tp_choices(counts, replicas, world_size, name)}")


def _split_counts(shape: ModelShape) -> list[tuple[str, int | None]]:
    """What TP splits, each a count model.tp must divide; the MLP width only where a layer is dense
    (torchtitan splits experts by expert parallel, not modelled here: FSDP shards them)."""
    dense = any(not shape.sparse(layer) for layer in range(shape.num_layers))
    return [("attention heads", shape.num_heads),
            ("KV heads", shape.num_kv_heads or shape.num_heads),
            ("intermediate size", shape.intermediate_size if dense else None)]


def _tp_choices(counts: list[tuple[str, int | None]], replicas: int, world_size: int,
                name: str) -> str:
    """The model.tp values that pass every check at this world size (a hint names no other)."""
    fits = [n for n in range(2, world_size // replicas + 1)
            if world_size % (n * replicas) == 0
            and all(not count or count % n == 0 for _, count in counts)]
    if not fits:
        return "model.tp=1"
    return (f"model.tp one of {', '.join(map(str, [1, *fits]))} (those that split the model "
            f"evenly and fit {name}={world_size})")


def tp_plan(layer: Any) -> dict[str, Any]:
    """parallelize_module's plan for one decoder layer: every projection tp_split_dim splits,
    column-wise or row-wise (an MoE layer's experts and router stay whole: see _split_counts)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = (ColwiseParallel, RowwiseParallel)
    return {name: styles[dim]() for name, _ in layer.named_modules()
            if (dim := tp_split_dim(f".layers.0.{name}.weight")) is not None}


# The tensors tp_plan splits, by their key in the flattened state dict (model and optimizer
# state alike): column-wise split dim 0 (weights and biases), row-wise dim 1 (weights only:
# RowwiseParallel keeps the bias whole). An MoE layer's mlp.experts.* and mlp.gate.* match
# neither (dense MLP names only).
_COLUMN = re.compile(r"\.layers\.\d+\.(self_attn\.[qkv]_proj|mlp\.(gate|up)_proj)\.(weight|bias)\b")
_ROW = re.compile(r"\.layers\.\d+\.(self_attn\.o_proj|mlp\.down_proj)\.weight\b")


def tp_split_dim(key: str) -> int | None:
    """The dimension TP splits tensor `key` along (0 column-wise, 1 row-wise), or None for a
    tensor every TP rank holds whole (`plan` lays out a TP save by it, plan/state.py)."""
    return next((dim for dim, split in enumerate((_COLUMN, _ROW)) if split.search(key)), None)


def shard_rows(rows: int, shards: int, index: int) -> tuple[int, int]:
    """(first row, row count) of shard `index` of `shards` along dim 0, as torch's Shard(0)
    splits (ceil(rows / shards) per shard; empty shards start at `rows`)."""
    size = -(-rows // shards)
    start = min(size * index, rows)
    return start, min(rows, start + size) - start


def shard_block(shape: tuple[int, ...], shards: int, shard: int, tp_dim: int | None, tp: int,
                tp_rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) of a rank's block of a tensor of `shape`: FSDP's Shard(0) inside TP's
    even split of `tp_dim`, if any (column-wise, FSDP splits the TP block's rows again)."""
    offsets, sizes = [0] * len(shape), list(shape)
    if tp_dim is not None:
        sizes[tp_dim] = shape[tp_dim] // tp
        offsets[tp_dim] = tp_rank * sizes[tp_dim]
    start, sizes[0] = shard_rows(sizes[0], shards, shard)
    offsets[0] += start  # an empty shard: past its block's end, as shard_rows places it
    return tuple(offsets), tuple(sizes)


def block_totals(tensors: list[tuple[tuple[int, ...], int | None, int]], tp: int, replicas: int,
                 world_size: int) -> list[int]:
    """Per rank, the sum over (shape, TP dim, weight) tensors of weight x the elements of its
    block (a 0-dim tensor whole); TP splits evenly, so a block depends on its dp shard only."""
    shards = world_size // (replicas * tp)
    per_shard = [sum(weight * math.prod(shard_block(dims, shards, shard, dim, tp, 0)[1] if dims else ())
                     for dims, dim, weight in tensors) for shard in range(shards)]
    return [per_shard[(rank // tp) % shards] for rank in range(world_size)]


def rank_holdings(shape: ModelShape, tp: int, replicas: int, world_size: int,
                  moe_layout: str = "hf") -> list[int]:
    """The parameters each rank holds, rank order. Not an average: a tensor with fewer rows
    than shards (an MoE's experts) is held by the first shards only."""
    return block_totals([(dims, tp_split_dim(f".{name}") if tp > 1 else None, 1)
                         for name, dims in state_shapes(shape, moe_layout)], tp, replicas, world_size)


def experts_over_shards(shape: ModelShape, tp: int, replicas: int, world_size: int) -> str | None:
    """A warning where FSDP's dp shards outnumber an MoE's experts (split along dim 0), else None."""
    shards = world_size // (replicas * tp)
    if not shape.num_experts or shards <= shape.num_experts:
        return None
    return (f"the model's {shape.num_experts} experts are split over {shards} FSDP shards (dp = "
            f"world / (replicas x tp)) along dim 0: ranks of shards 0-{shape.num_experts - 1} "
            f"hold a whole expert of every sparse layer, the other {shards - shape.num_experts} "
            "shards none; size nodes by the largest rank, or use a dp of at most the expert "
            "count (a larger model.tp or model.replicas)")
