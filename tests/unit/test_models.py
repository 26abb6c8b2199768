"""Model presets: true parameter counts, built on the meta device (no memory)."""

import pytest
import torch

from dcp_fsdp.models.presets import PRESETS, hf_config


def meta_param_count(preset: str) -> int:
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    shape = PRESETS[preset]
    model_class = LlamaForCausalLM if shape.family == "llama" else GPT2LMHeadModel
    with torch.device("meta"):
        model = model_class(hf_config(shape))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("preset, expected", [
    ("L7b", 6_889_410_560),  # ~26,281 MiB in fp32 (field notes)
    ("GPT-4B", 2_647_621_120),  # named "4B", really 2.65 B (tied embeddings)
])
def test_parameter_counts(preset, expected):
    assert meta_param_count(preset) == expected


def test_llama_shapes_match_the_reference_table():
    table = {"L7b": (4096, 11008, 32, 32, 32), "L13b": (5120, 13824, 40, 40, 40),
             "L30b": (6656, 17920, 60, 52, 52), "L65b": (8192, 22016, 80, 64, 64),
             "L70b": (8192, 28672, 80, 64, 8)}
    for name, (hidden, inter, layers, heads, kv) in table.items():
        config = hf_config(PRESETS[name])
        assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers,
                config.num_attention_heads, config.num_key_value_heads) == (hidden, inter, layers,
                                                                           heads, kv)
        assert config.vocab_size == 50432 and config.max_position_embeddings == 4096
        assert config.tie_word_embeddings is False and config.use_cache is False


@pytest.mark.parametrize("preset", ["tiny_llama", "tiny_gpt2"])
def test_tiny_presets_are_tens_of_mb(preset):
    fp32_mib = meta_param_count(preset) * 4 / 2**20
    assert 5 < fp32_mib < 100
