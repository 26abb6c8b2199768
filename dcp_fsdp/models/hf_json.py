"""`model.config=PATH`: a model's shape from a local Hugging Face config.json (never a download),
read without torch or transformers so that the light parent refuses a bad file. A field the shape
needs whose class default is no trained model's (num_key_value_heads) must be in the file; optional
fields take transformers 5.x's class defaults (tests/unit/test_models.py).
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

from dcp_fsdp.errors import UserError
from dcp_fsdp.models.llama_model_config import (FAMILIES, LLAMA_RMS_NORM_EPS, MOE_LAYOUTS,
                                                ModelShape, state_shapes)

# torch refuses a tensor of 2^63 bytes or more ("Storage size calculation overflowed"):
# this many elements at 4 bytes (fp32, the widest dtype the tool builds)
MAX_TENSOR_ELEMENTS = 2**63 // 4 - 1

# Fields without which the shape is unknown, per family.
LLAMA_LIKE_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "vocab_size", "intermediate_size")
REQUIRED: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("llama", "mistral", "qwen2", "qwen3"), LLAMA_LIKE_REQUIRED),
    "qwen3_moe": LLAMA_LIKE_REQUIRED + ("num_experts", "moe_intermediate_size"),
    "mixtral": LLAMA_LIKE_REQUIRED + ("num_local_experts",),
    "gpt2": ("n_embd", "n_layer", "n_head", "vocab_size", "n_positions"),
}
# The rope types transformers 5.x builds (its ROPE_INIT_FUNCTIONS, and "default"; a test checks).
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional")


class _Fields:
    """The config's fields, each refused in one line naming the file and the field."""

    def __init__(self, where: str, data: dict[str, Any]) -> None:
        self.where, self.data = where, data

    def whole(self, name: str, default: int | None = None, minimum: int = 1) -> int:
        value = self.data.get(name)
        if value is None:
            if default is None:
                family = self.data["model_type"]
                what = f"'{name}' is null" if name in self.data else f"no '{name}' field"
                raise UserError(f"{self.where}: {what}; a {family} config.json needs "
                                f"{', '.join(REQUIRED[family])}, each a whole number")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise UserError(f"{self.where}: '{name}' is {json.dumps(value)}; it must be a whole "
                            f"number, {minimum} or more")
        return value

    def flag(self, name: str, default: bool) -> bool:
        value = self.data.get(name, default)
        if not isinstance(value, bool):
            raise UserError(f"{self.where}: '{name}' is {json.dumps(value)}; it must be true or "
                            "false")
        return value

    def number(self, name: str, default: float) -> float:
        value = self.data.get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"{self.where}: '{name}' is {json.dumps(value)}; it must be a number")
        return float(value)

    def layers(self, name: str) -> tuple[int, ...]:
        value = self.data.get(name) or []
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                  for v in value):
            raise UserError(f"{self.where}: '{name}' is {json.dumps(value)}; it must be a list "
                            "of layer numbers")
        return tuple(sorted(set(value)))


def _load(path: str) -> dict[str, Any]:
    where = f"model.config={path}"
    folder = Path(path).is_dir()
    file = Path(path) / "config.json" if folder else Path(path)
    try:
        text = file.read_text()
    except FileNotFoundError:
        if folder:
            raise UserError(f"{where}: a folder without a config.json; give the folder of a "
                            "downloaded model (it holds config.json) or the file's own path") from None
        raise UserError(f"{where}: no such file; give the path of a local Hugging Face "
                        "config.json (it is never downloaded)") from None
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"{where}: cannot be read ({error.__class__.__name__}: "
                        f"{getattr(error, 'strerror', None) or error}); give a readable config.json") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise UserError(f"{where}: not JSON ({error.msg} at line {error.lineno} column "
                        f"{error.colno}); give a Hugging Face config.json") from None
    if not isinstance(data, dict):
        raise UserError(f"{where}: not a JSON object; give a Hugging Face config.json")
    family = data.get("model_type")
    if family not in FAMILIES:
        what = "has no 'model_type' field" if family is None else f"has model_type {json.dumps(family)}"
        raise UserError(f"{where}: {what}; this tool builds the families "
                        f"{', '.join(FAMILIES)} (or give a preset: model=NAME)")
    return data


def _gpt2(fields: _Fields) -> ModelShape:
    return ModelShape("gpt2", fields.whole("n_embd"), fields.whole("n_layer"),
                      fields.whole("n_head"), fields.whole("vocab_size"),
                      fields.whole("n_positions"),
                      intermediate_size=fields.data.get("n_inner") and fields.whole("n_inner"),
                      tie_embeddings=fields.flag("tie_word_embeddings", True))


def _dense_layers(fields: _Fields, layers: int) -> tuple[int, ...]:
    """Qwen3-MoE's layers with a dense MLP: mlp_only_layers, and every layer i with
    (i + 1) % decoder_sparse_step != 0 (Qwen3MoeDecoderLayer's rule)."""
    step = fields.whole("decoder_sparse_step", 1)
    only = set(fields.layers("mlp_only_layers"))
    return tuple(i for i in range(layers) if i in only or (i + 1) % step)


def _check_attention(family: str, fields: _Fields, hidden: int, heads: int, kv_heads: int,
                     head_dim: int) -> None:
    """What transformers refuses of the attention's shape: LlamaConfig a width not a multiple
    of the heads, the rotary embedding an odd head width, KV heads that do not divide the heads."""
    if family == "llama" and hidden % heads:
        raise UserError(f"{fields.where}: 'hidden_size' {hidden} is not a multiple of "
                        f"'num_attention_heads' {heads}, which transformers' LlamaConfig "
                        "refuses; make hidden_size a multiple of num_attention_heads")
    if head_dim > 4 and head_dim % 2:
        source = ("'head_dim'" if "head_dim" in fields.data
                  else f"'hidden_size' {hidden} / 'num_attention_heads' {heads}")
        raise UserError(f"{fields.where}: the head width ({source}) is {head_dim}, odd, and "
                        "transformers' rotary embedding needs an even one; give an even "
                        "head_dim")
    if kv_heads > heads or heads % kv_heads:
        raise UserError(f"{fields.where}: 'num_key_value_heads' {kv_heads} does not divide "
                        f"'num_attention_heads' {heads}, which transformers' attention "
                        "cannot group; give a divisor of num_attention_heads")


def _check_rope(fields: _Fields) -> None:
    """A rope_scaling (or rope_parameters) of a type transformers has no rotary embedding for."""
    for name in ("rope_scaling", "rope_parameters"):
        value = fields.data.get(name)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise UserError(f"{fields.where}: '{name}' is {json.dumps(value)}; it must be an "
                            "object (e.g. {\"rope_type\": \"llama3\", ...}) or null")
        kind = value.get("rope_type", value.get("type", "default"))
        if kind not in ROPE_TYPES:
            raise UserError(f"{fields.where}: '{name}' has rope_type {json.dumps(kind)}, which "
                            f"transformers does not build; use one of {', '.join(ROPE_TYPES)}")


def _llama_like(family: str, fields: _Fields) -> ModelShape:
    hidden, heads = fields.whole("hidden_size"), fields.whole("num_attention_heads")
    layers = fields.whole("num_hidden_layers")
    # Qwen3Config's head_dim is 128 whatever the width; the other classes use hidden / heads
    head_dim = fields.whole("head_dim", 128 if family == "qwen3" else hidden // heads)
    kv_heads = fields.whole("num_key_value_heads")
    _check_attention(family, fields, hidden, heads, kv_heads, head_dim)
    _check_rope(fields)
    # the classes that read attention_bias (q/k/v/o biases); Qwen2 always biases q/k/v
    bias = family in ("llama", "qwen3", "qwen3_moe") and fields.flag("attention_bias", False)
    experts = {"qwen3_moe": lambda: fields.whole("num_experts", minimum=0),
               "mixtral": lambda: fields.whole("num_local_experts")}.get(family, lambda: 0)()
    return ModelShape(
        family,  # type: ignore[arg-type]  # one of FAMILIES, checked by _load
        hidden, layers, heads, fields.whole("vocab_size"),
        fields.whole("max_position_embeddings", 4096),
        intermediate_size=fields.whole("intermediate_size"),
        num_kv_heads=kv_heads,
        rms_norm_eps=fields.number("rms_norm_eps", LLAMA_RMS_NORM_EPS),
        head_dim=head_dim,
        tie_embeddings=fields.flag("tie_word_embeddings", False),
        qkv_bias=bias or family == "qwen2", o_bias=bias,
        mlp_bias=family == "llama" and fields.flag("mlp_bias", False),
        qk_norm=family in ("qwen3", "qwen3_moe"),
        num_experts=experts,
        moe_intermediate_size=(fields.whole("moe_intermediate_size")
                               if family == "qwen3_moe" else None),
        dense_layers=_dense_layers(fields, layers) if family == "qwen3_moe" and experts else ())


@functools.lru_cache(maxsize=8)
def read_config_json(path: str) -> ModelShape:
    """The shape a config.json describes, or UserError naming the file and what is wrong: a tensor
    (in either MoE layout) torch cannot size is refused here, not deep in a build or a `plan`."""
    data = _load(path)
    fields = _Fields(f"model.config={path}", data)
    family = data["model_type"]
    shape = _gpt2(fields) if family == "gpt2" else _llama_like(family, fields)
    name, dims = max((tensor for layout in MOE_LAYOUTS for tensor in state_shapes(shape, layout)),
                     key=lambda tensor: math.prod(tensor[1]))
    if math.prod(dims) > MAX_TENSOR_ELEMENTS:
        raise UserError(f"{fields.where}: its {name} would be {' x '.join(map(str, dims))} = "
                        f"{math.prod(dims):.3g} elements, more than torch can size (2^63 bytes "
                        "at fp32); check vocab_size and the other sizes in the file")
    return shape
