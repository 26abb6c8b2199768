"""The sharded state dict DCP saves and loads, and what we measure of it."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_model_state_dict,
                                                     set_state_dict)

from dcp_fsdp.models.build import ShardedModel


def make_state_dict(sharded: ShardedModel) -> dict[str, Any]:
    """What DCP saves: {"model": ...} or {"model": ..., "optim": ...}, sharded (DTensors)."""
    if sharded.optimizer is None:
        return {"model": get_model_state_dict(sharded.model)}
    model_sd, optim_sd = get_state_dict(sharded.model, sharded.optimizer)
    return {"model": model_sd, "optim": optim_sd}


def apply_state_dict(sharded: ShardedModel, state_dict: dict[str, Any]) -> None:
    options = StateDictOptions(strict=True)
    if sharded.optimizer is None:
        set_model_state_dict(sharded.model, state_dict["model"], options=options)
    else:
        set_state_dict(sharded.model, sharded.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"], options=options)


def flat_tensors(state_dict: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Flattened "model.x.weight"-style keys (as DCP names them) to tensors."""
    from dcp_fsdp.compat import flatten_state_dict

    flat, _ = flatten_state_dict(state_dict)
    return {key: value for key, value in flat.items() if isinstance(value, torch.Tensor)}


def state_bytes(state_dict: dict[str, Any]) -> int:
    """Bytes of all tensors in the checkpoint (global shapes: the whole model's state)."""
    return sum(t.numel() * t.element_size() for t in flat_tensors(state_dict).values())
