"""The models' module trees in plain torch, built from `state_shapes`: the state of transformers'
*ForCausalLM and GPT2LMHeadModel (parameter names, shapes, registration order, tied embeddings)
without importing transformers, which cost every rank ~1.5 s of CPU for classes it never runs
(tests/unit/test_models.py holds the trees to transformers' own, every preset and family). The
projections are nn.Linear: torch's tensor parallel splits no other module.
"""

from __future__ import annotations

import torch
from torch import nn

from dcp_fsdp.models.llama_model_config import ModelShape, state_shapes
from dcp_fsdp.models.tensor_parallel import tp_split_dim


def _child(path: str, part: str, weight: tuple[int, ...], names: set[str]) -> nn.Module:
    """The module at `path` (its last name `part`), made when its first parameter comes
    (`weight`'s shape, where it is a projection TP splits)."""
    if part in ("layers", "h"):  # the decoder blocks' lists (Llama-like, GPT-2)
        return nn.ModuleList()
    if tp_split_dim(f".{path}.weight") is not None:
        return nn.Linear(weight[1], weight[0], bias=f"{path}.bias" in names)
    return nn.Module()


def module_tree(shape: ModelShape, moe_layout: str = "hf") -> nn.Module:
    """The module tree of a shape, built on the current default device (meta for a rank)."""
    root = nn.Module()
    tensors = state_shapes(shape, moe_layout)
    names = {name for name, _ in tensors}
    for name, dims in tensors:
        *path, leaf = name.split(".")
        owner = root
        for depth, part in enumerate(path):
            if getattr(owner, part, None) is None:
                owner.add_module(part, _child(".".join(path[:depth + 1]), part, dims, names))
            owner = owner.get_submodule(part)
        if getattr(owner, leaf, None) is None:  # (a Linear made its own)
            owner.register_parameter(leaf, nn.Parameter(torch.empty(dims)))
    if shape.tie_embeddings:  # lm_head.weight is the embedding's: state_shapes lists it once
        root.add_module("lm_head", nn.Module())
        root.get_submodule("lm_head").register_parameter("weight", root.get_parameter(
            "transformer.wte.weight" if shape.family == "gpt2" else "model.embed_tokens.weight"))
    return root
