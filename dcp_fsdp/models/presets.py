"""Model presets: the names `model=...` accepts, each a shape from `llama_model_config`.

One preset per `conf/model/<name>.yaml`; the shapes (and the transformers config built
from one, `hf_config`) live in `dcp_fsdp/models/llama_model_config.py`.
"""

from __future__ import annotations

from dcp_fsdp.models.llama_model_config import (GPT_SHAPES, LLAMA_COMMON, LLAMA_SHAPES,
                                                ModelShape, hf_config)

__all__ = ["LLAMA_COMMON", "PRESETS", "ModelShape", "hf_config"]

PRESETS: dict[str, ModelShape] = {**LLAMA_SHAPES, **GPT_SHAPES}
