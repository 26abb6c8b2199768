"""The model shapes this benchmark checkpoints: the `llama_model_config` of the original
awslabs DCP/FSDP benchmark (Llama 7B to 70B), the GPT-2-shaped "4B" of the training
scripts it grew from, and small shapes for machines and tests that cannot hold those.

Shapes only, no weights: `models/presets.py` names them for `model=...` (one
`conf/model/<name>.yaml` each); `models/modules.py` builds one as a module tree whose state is
that of the transformers model `hf_config`'s config makes (the tests compare the two).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

# What every Llama preset of the original benchmark shares (untied embeddings, no KV cache:
# see hf_config).
LLAMA_VOCAB_SIZE = 50432
LLAMA_MAX_POSITIONS = 4096
LLAMA_RMS_NORM_EPS = 1e-5
LLAMA_COMMON = dict(vocab_size=LLAMA_VOCAB_SIZE, max_position_embeddings=LLAMA_MAX_POSITIONS,
                    rms_norm_eps=LLAMA_RMS_NORM_EPS)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    family: Literal["llama", "gpt2"]
    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
    max_positions: int
    intermediate_size: int | None = None  # llama only (gpt2 uses 4 * hidden)
    num_kv_heads: int | None = None  # llama only
    rms_norm_eps: float = LLAMA_RMS_NORM_EPS


def llama(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
          vocab_size: int = LLAMA_VOCAB_SIZE,
          max_positions: int = LLAMA_MAX_POSITIONS) -> ModelShape:
    return ModelShape("llama", hidden, layers, heads, vocab_size, max_positions,
                      intermediate_size=intermediate, num_kv_heads=kv_heads)


def gpt2(n_embd: int, n_layer: int, n_head: int, vocab_size: int = 50257,
         n_positions: int = 512) -> ModelShape:
    return ModelShape("gpt2", n_embd, n_layer, n_head, vocab_size, n_positions)


# The original benchmark's Llama shapes: hidden, intermediate, layers, heads, kv heads.
LLAMA_SHAPES: dict[str, ModelShape] = {
    "L7b": llama(4096, 11008, 32, 32, 32),  # ~6.89 B parameters
    "L13b": llama(5120, 13824, 40, 40, 40),
    "L30b": llama(6656, 17920, 60, 52, 52),
    "L65b": llama(8192, 22016, 80, 64, 64),
    "L70b": llama(8192, 28672, 80, 64, 8),
    # 0.66 B params, Llama-shaped (L7b's vocabulary, half its width, 9 layers): 1.23 GiB in
    # bf16, the smallest checkpoint of at least 1 GiB, for benchmarks on small machines.
    "L660m": llama(2048, 5504, 9, 16, 16),
    # Tiny (tens of MB) for tests and the demo.
    "tiny_llama": llama(256, 688, 4, 4, 4, vocab_size=8192, max_positions=512),
}

# GPT-4B: n_embd 2560, 32 layers, 32 heads, 512 positions. Its real parameter count is
# ~2.65 B (tied embeddings), which every record states, so nobody has to trust the name.
GPT_SHAPES: dict[str, ModelShape] = {
    "GPT-4B": gpt2(2560, 32, 32),
    "tiny_gpt2": gpt2(256, 4, 4, vocab_size=8192, n_positions=512),
}


def param_count(shape: ModelShape) -> int:
    """The parameters `hf_config(shape)` builds, by arithmetic (no torch, no transformers:
    the light parent sizes a run with it). Llama: untied embeddings, no biases; GPT-2: tied
    embeddings, learned positions, biases and two LayerNorm vectors per norm."""
    hidden, layers = shape.hidden_size, shape.num_layers
    if shape.family == "llama":
        kv_dim = hidden // shape.num_heads * (shape.num_kv_heads or shape.num_heads)
        intermediate = shape.intermediate_size or 4 * hidden
        per_layer = 2 * hidden * hidden + 2 * hidden * kv_dim + 3 * hidden * intermediate \
            + 2 * hidden
        return 2 * shape.vocab_size * hidden + layers * per_layer + hidden
    per_layer = (2 * 2 * hidden  # two LayerNorms
                 + hidden * 3 * hidden + 3 * hidden  # c_attn
                 + hidden * hidden + hidden  # attention c_proj
                 + hidden * 4 * hidden + 4 * hidden  # c_fc
                 + 4 * hidden * hidden + hidden)  # mlp c_proj
    return (shape.vocab_size + shape.max_positions) * hidden + layers * per_layer + 2 * hidden


def hf_config(shape: ModelShape):
    """The transformers config object for a shape."""
    if shape.family == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=shape.vocab_size,
            hidden_size=shape.hidden_size,
            intermediate_size=shape.intermediate_size or 4 * shape.hidden_size,
            num_hidden_layers=shape.num_layers,
            num_attention_heads=shape.num_heads,
            num_key_value_heads=shape.num_kv_heads,
            max_position_embeddings=shape.max_positions,
            rms_norm_eps=shape.rms_norm_eps,
            use_cache=False,
            tie_word_embeddings=False,
        )
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=shape.vocab_size,
        n_embd=shape.hidden_size,
        n_layer=shape.num_layers,
        n_head=shape.num_heads,
        n_positions=shape.max_positions,
        use_cache=False,
        # GPT-2's special token id is 50256; keep it inside a smaller test vocabulary.
        bos_token_id=min(50256, shape.vocab_size - 1),
        eos_token_id=min(50256, shape.vocab_size - 1),
    )
