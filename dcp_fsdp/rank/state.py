"""The sharded state dict DCP saves and loads, what we measure of it, and whether a load put
in it what the checkpoint must hold: DCP stores no checksum, so after a load each rank
recomputes the values its shards must hold (a pure function of seed, tensor name and global
index: models/values.py) and compares them bit for bit, outside the timed region.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                     set_state_dict)

from dcp_fsdp.compat import flatten_state_dict
from dcp_fsdp.errors import BenchmarkFailure, UserError
from dcp_fsdp.models import values
from dcp_fsdp.models.build import ShardedModel, local_tensor, unique_shards
from dcp_fsdp.models.presets import model_setting
from dcp_fsdp.rank.distributed import first_problem
from dcp_fsdp.storage.layout import extra_model_tensor
from dcp_fsdp.storage.metadata_peek import first_difference


def apply_state_dict(sharded: ShardedModel, state_dict: dict[str, Any]) -> None:
    options = StateDictOptions(strict=True)
    if sharded.optimizer is None:
        set_model_state_dict(sharded.model, state_dict["model"], options=options)
    else:
        set_state_dict(sharded.model, sharded.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"], options=options)


def flat_tensors(state_dict: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Flattened "model.x.weight"-style keys (as DCP names them) to tensors."""
    flat, _ = flatten_state_dict(state_dict)
    return {key: value for key, value in flat.items() if isinstance(value, torch.Tensor)}


def checkpoint_mismatch(stored: dict[str, Any], state_dict: dict[str, Any]) -> str | None:
    """How a checkpoint's tensors (`MetadataFacts.tensors`) differ from this state dict's; None when all
    of ours are there as here and all its model tensors are here (a model-only load loads its model)."""
    tensors = flat_tensors(state_dict)
    problem = first_difference(stored, ((key, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))
                                        for key, tensor in tensors.items()))
    return problem or extra_model_tensor(stored, tensors)


def mismatch_error(suffix: str, cfg: Any, problem: str, manifest: dict[str, Any] | None) -> UserError:
    """The one line for a checkpoint that does not match the settings; the fix: its manifest's."""
    manifest = manifest or {}
    # model.moe_layout=hf is the default: neither side need name it
    saved_with = " ".join(model_setting(k, manifest[k]) for k in MANIFEST_SETTINGS
                          if k in manifest and (k, manifest[k]) != ("model.moe_layout", "hf"))
    layout = cfg.model.moe_layout.value
    asked = (f"{model_setting('model', cfg.model.name)} "
             + (f"model.moe_layout={layout} " if layout != "hf" else "")
             + f"model.dtype={cfg.model.dtype.value} state={cfg.state.value}")
    fix = f"load it with {saved_with}" if saved_with else "load it with the settings it was saved with"
    if saved_with == asked:  # 'load it with' what was typed: the model they name changed since
        fix = ("the settings are those of the save, so the model they name changed since (was "
               "its config.json edited?); restore the file as it was at the save, or give a "
               "config.json of that shape")
    return UserError(f"suffix={suffix}: checkpoint does not match {asked} ({problem}); {fix}")


# The manifest's entries that are settings a load must repeat (a checkpoint saved before
# model.moe_layout existed has none: hf).
MANIFEST_SETTINGS = ("model", "model.moe_layout", "model.dtype", "state")


def state_bytes(state_dict: dict[str, Any]) -> int:
    """Bytes of all tensors in the checkpoint (global shapes: the whole model's state)."""
    return sum(t.numel() * t.element_size() for t in flat_tensors(state_dict).values())


def first_mismatch(state_dict: dict[str, Any], seed: int) -> tuple[str, list[int]] | None:
    """(key, global index) of the first element of this rank's shards that is not its value, or None."""
    for key, local, global_shape, offset in unique_shards(state_dict):
        index = values.first_mismatch(local, seed, key, global_shape, offset)
        if index is not None:
            return key, list(index)
    return None


def zero_local_tensors(state_dict: dict[str, Any]) -> None:
    """Zero every live tensor before a verified load: the model already holds the values
    a load must bring, so without this a load that read nothing would pass."""
    with torch.no_grad():
        for tensor in flat_tensors(state_dict).values():
            local_tensor(tensor).zero_()


def verify_values(state_dict: dict[str, Any], seed: int, what: str) -> None:
    """Every rank recomputes its shards' values and compares them bit for bit; all ranks
    raise together on a mismatch, naming the first one (a collective: every rank calls it)."""
    mismatch = first_mismatch(state_dict, seed)
    found = first_problem(None if mismatch is None else
                          f"tensor '{mismatch[0]}' element {mismatch[1]}")
    if found is not None:
        rank, where = found
        raise BenchmarkFailure(f"{what} ({where}, rank {rank}'s shard)")


def local_bytes(state_dict: dict[str, Any]) -> int:
    """Bytes of this rank's shards of every checkpointed tensor: what a load puts in memory."""
    return sum(local_tensor(t).nbytes for t in flat_tensors(state_dict).values())


def checkable_seed(manifest: dict[str, Any] | None) -> tuple[int | None, str | None]:
    """(seed to recompute with, None) when the checkpoint's values are known, else (None, why not)."""
    if manifest is None:
        return None, "no manifest stored with this checkpoint"
    generator = manifest.get("values")
    if generator != values.GENERATOR or not isinstance(manifest.get("seed"), int):
        return None, (f"its manifest names values={generator or 'none'}, not "
                      f"{values.GENERATOR}: saved by another version")
    return manifest["seed"], None
