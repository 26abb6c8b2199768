"""Model presets: the shapes of real LLMs (and tiny ones for tests), with no weights.

The Llama shapes are those of the original awslabs benchmark's `llama_model_config`.
GPT-4B is the "~4B" GPT-2-shaped model of the training scripts this tool grew
from; its real parameter count is ~2.65 B (tied embeddings), which every record
states, so nobody has to trust the name.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

LLAMA_COMMON = dict(vocab_size=50432, max_position_embeddings=4096, rms_norm_eps=1e-5)


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
    rms_norm_eps: float = 1e-5


def _llama(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
           vocab_size: int = 50432, max_positions: int = 4096) -> ModelShape:
    return ModelShape("llama", hidden, layers, heads, vocab_size, max_positions,
                      intermediate_size=intermediate, num_kv_heads=kv_heads)


def _gpt2(n_embd: int, n_layer: int, n_head: int, vocab_size: int = 50257,
          n_positions: int = 512) -> ModelShape:
    return ModelShape("gpt2", n_embd, n_layer, n_head, vocab_size, n_positions)


PRESETS: dict[str, ModelShape] = {
    "L7b": _llama(4096, 11008, 32, 32, 32),
    "L13b": _llama(5120, 13824, 40, 40, 40),
    "L30b": _llama(6656, 17920, 60, 52, 52),
    "L65b": _llama(8192, 22016, 80, 64, 64),
    "L70b": _llama(8192, 28672, 80, 64, 8),
    "GPT-4B": _gpt2(2560, 32, 32),
    # 0.66 B params, Llama-shaped (L7b's vocabulary, half its width, 9 layers): 1.23 GiB in
    # bf16, the smallest checkpoint of at least 1 GiB, for benchmarks on small machines.
    "L660m": _llama(2048, 5504, 9, 16, 16),
    # Tiny presets (tens of MB) for tests and the demo.
    "tiny_llama": _llama(256, 688, 4, 4, 4, vocab_size=8192, max_positions=512),
    "tiny_gpt2": _gpt2(256, 4, 4, vocab_size=8192, n_positions=512),
}


def hf_config(shape: ModelShape):
    """The transformers config object for a shape."""
    if shape.family == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=shape.vocab_size,
            hidden_size=shape.hidden_size,
            intermediate_size=shape.intermediate_size,
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
