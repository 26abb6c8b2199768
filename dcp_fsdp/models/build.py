"""Build a preset's model sharded with FSDP2, without any rank holding it whole.

The model is created on the meta device (no memory), each decoder block and
then the root are wrapped with `fully_shard`, and only then are this rank's
shards materialised (`to_empty`) and filled with random values. Peak memory
per rank is therefore about (parameters / world size).
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dcp_fsdp.config.schema import CheckpointState, Dtype
from dcp_fsdp.models.presets import PRESETS, hf_config

TORCH_DTYPES = {Dtype.fp32: torch.float32, Dtype.bf16: torch.bfloat16}


@dataclasses.dataclass
class ShardedModel:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    param_count: int  # whole model, not this rank's shard
    param_bytes: int  # whole model


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks: the units FSDP shards and gathers."""
    if hasattr(model, "model") and hasattr(model.model, "layers"):  # Llama
        return list(model.model.layers)
    if hasattr(model, "transformer") and hasattr(model.transformer, "h"):  # GPT-2
        return list(model.transformer.h)
    raise ValueError(f"no decoder blocks found in {type(model).__name__}")


def build_sharded_model(preset: str, dtype: Dtype, state: CheckpointState,
                        device: torch.device, world_size: int, seed: int) -> ShardedModel:
    shape = PRESETS[preset]
    config = hf_config(shape)
    with torch.device("meta"):
        if shape.family == "llama":
            from transformers import LlamaForCausalLM as model_class
        else:
            from transformers import GPT2LMHeadModel as model_class
        model = model_class(config).to(TORCH_DTYPES[dtype])

    param_count = sum(p.numel() for p in model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    mesh = init_device_mesh(device.type, (world_size,))
    for block in decoder_blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)

    model.to_empty(device=device)
    _randomise_local_shards(model, seed)

    optimizer = None
    if state == CheckpointState.model_and_optimizer:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        _populate_optimizer_state(model, optimizer, seed)
    return ShardedModel(model, optimizer, param_count, param_bytes)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _randomise_local_shards(model: torch.nn.Module, seed: int) -> None:
    """Random values in this rank's shards only (no rank builds the full tensor)."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed * 1_000_003 + torch.distributed.get_rank())
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            local = local_tensor(tensor)
            values = torch.randn(local.shape, generator=generator, dtype=torch.float32) * 0.02
            local.copy_(values.to(local.dtype))


def _populate_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                              seed: int) -> None:
    """One AdamW step on random gradients, so moments hold real, non-zero values."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed * 7_919 + torch.distributed.get_rank() + 1)
    for param in model.parameters():
        local = local_tensor(param)
        grad = (torch.randn(local.shape, generator=generator) * 1e-3).to(local.dtype)
        grad = grad.to(local.device)
        if isinstance(param, DTensor):
            param.grad = DTensor.from_local(grad, param.device_mesh, param.placements,
                                            shape=param.shape, stride=param.stride())
        else:
            param.grad = grad
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
