"""Model presets (one per `conf/model/<name>.yaml`) and the one place a run's settings become
its shape (a preset, or `model.config=PATH`). No torch: the launcher checks the model with it.
"""

from __future__ import annotations

import hashlib
import json

from dcp_fsdp.config.schema import ModelConfig, MoeLayout
from dcp_fsdp.errors import UserError
from dcp_fsdp.models.hf_json import read_config_json
from dcp_fsdp.models.llama_model_config import (GPT_SHAPES, LLAMA_SHAPES, MLPERF_SHAPES,
                                                RELEASED_SHAPES, ModelShape, state_shapes)

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
    """The model's tensors (names and shapes) as 16 hex digits: the manifest's `model.shape`,
    so that a load identifies a model.config model by the file's content, not its path."""
    tensors = [[name, list(dims)] for name, dims in state_shapes(model_shape(model), "hf")]
    return hashlib.sha256(json.dumps(tensors).encode()).hexdigest()[:16]


DTYPE_BYTES = {"fp32": 4, "bf16": 2}


def tied_extra_bytes(shape: ModelShape, dtype: str) -> int:
    """What a save writes beyond parameters x dtype: with tied embeddings the state dict holds
    the one tensor under two keys, and DCP writes each (AdamW's state is per parameter: once)."""
    return shape.vocab_size * shape.hidden_size * DTYPE_BYTES[dtype] if shape.tie_embeddings else 0


def tied_words(shape: ModelShape, dtype: str) -> str:
    """'; tied embeddings: saved twice, +N MiB' beside a size, or ''."""
    extra = tied_extra_bytes(shape, dtype)
    return f"; tied embeddings: saved twice, +{extra / 2**20:,.1f} MiB" if extra else ""


def model_setting(key: str, value: object) -> str:
    """`key=value` as a user types it, for a manifest's entry (model `config:PATH`: model.config=PATH)."""
    if key == "model" and isinstance(value, str) and value.startswith("config:"):
        return f"model.config={value.removeprefix('config:')}"
    return f"{key}={value}"
