"""Model presets: the names `model=...` accepts, each a shape from `llama_model_config`, and
the one place a run's settings become its shape (a preset, or `model.config=PATH`).

One preset per `conf/model/<name>.yaml`; the shapes (and the transformers config built
from one, `hf_config`) live in `dcp_fsdp/models/llama_model_config.py`. No torch here: the
launcher checks the model with it before any rank starts.
"""

from __future__ import annotations

from dcp_fsdp.config.schema import ModelConfig, MoeLayout
from dcp_fsdp.errors import UserError
from dcp_fsdp.models.hf_json import read_config_json
from dcp_fsdp.models.llama_model_config import (GPT_SHAPES, LLAMA_COMMON, LLAMA_SHAPES,
                                                MLPERF_SHAPES, RELEASED_SHAPES, ModelShape,
                                                hf_config)

__all__ = ["LLAMA_COMMON", "PRESETS", "ModelShape", "hf_config", "model_setting", "model_shape",
           "tied_extra_bytes", "tied_words"]

PRESETS: dict[str, ModelShape] = {**LLAMA_SHAPES, **GPT_SHAPES, **RELEASED_SHAPES, **MLPERF_SHAPES}


def model_shape(model: ModelConfig) -> ModelShape:
    """The shape the settings name: model.config's file when given, else the preset. Raises
    UserError (one line: the setting and the fix) for a preset or file it cannot build."""
    if model.config:
        shape = read_config_json(model.config)
    elif model.preset in PRESETS:
        shape = PRESETS[model.preset]
    else:
        raise UserError(f"model.preset={model.preset}: no such model shape; choose one of "
                        f"{', '.join(PRESETS)} (dcp_fsdp/models/llama_model_config.py)")
    if model.moe_layout != MoeLayout.hf and not shape.num_experts:
        raise UserError(f"model.moe_layout={model.moe_layout.value}: model={model.name} has no "
                        "experts (the layout is for qwen3_moe and mixtral models); leave "
                        "model.moe_layout at hf")
    return shape


def shape_digest(model: ModelConfig) -> str:
    """The model's tensors (each name and shape, in the hf layout) as 16 hex digits: what a
    checkpoint's manifest records as `model.shape`, so that a load identifies a model.config
    model by the file's content, not its path (issue 49 item 1): an identical copy, or the
    same file by another path, is the same model; the file edited is another."""
    import hashlib
    import json

    from dcp_fsdp.models.llama_model_config import state_shapes

    tensors = [[name, list(dims)] for name, dims in state_shapes(model_shape(model), "hf")]
    return hashlib.sha256(json.dumps(tensors).encode()).hexdigest()[:16]


DTYPE_BYTES = {"fp32": 4, "bf16": 2}


def tied_extra_bytes(shape: ModelShape, dtype: str) -> int:
    """What a save writes beyond parameters x dtype: with tied embeddings the state dict holds
    the one tensor under two keys (`lm_head.weight` and the embedding's), and DCP writes each
    (Qwen2.5-0.5B in bf16: 1,202 MiB, where its parameters make 942). AdamW's state is per
    parameter, so once."""
    return shape.vocab_size * shape.hidden_size * DTYPE_BYTES[dtype] if shape.tie_embeddings else 0


def tied_words(shape: ModelShape, dtype: str) -> str:
    """'; tied embeddings: saved twice, +N MiB' beside a size, or '' (issue 49)."""
    extra = tied_extra_bytes(shape, dtype)
    return f"; tied embeddings: saved twice, +{extra / 2**20:,.1f} MiB" if extra else ""


def model_setting(key: str, value: object) -> str:
    """`key=value` as a user types it for a manifest's entry: its model `config:PATH` (what
    ModelConfig.name calls a config.json model) is the setting model.config=PATH."""
    if key == "model" and isinstance(value, str) and value.startswith("config:"):
        return f"model.config={value.removeprefix('config:')}"
    return f"{key}={value}"
