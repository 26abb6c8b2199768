"""The presets' module trees in plain torch: the state of transformers' `LlamaForCausalLM`
and `GPT2LMHeadModel` (parameter names, shapes, dtypes, registration order, GPT-2's tied
embeddings), without importing transformers.

A rank never runs the model: it builds the state DCP saves and loads. Importing transformers
cost every rank about 1.5 s of CPU (5.23.0 on the 2-core VM: half of a tiny_llama rank's
start-up, paid again by every rank of every node), for classes whose only use here is their
parameters. `tests/unit/test_models.py` holds these trees to transformers' own classes for
every preset, built on the meta device: the same state dict keys in the same order, the same
shapes and dtypes, the same tying. Buffers that transformers keeps out of the state dict
(Llama's rotary `inv_freq`, GPT-2's attention mask) are left out: DCP never sees them.
"""

from __future__ import annotations

import torch
from torch import nn

from dcp_fsdp.models.llama_model_config import ModelShape

# transformers' defaults for the configs hf_config builds (GPT2Config.layer_norm_epsilon).
GPT2_LAYER_NORM_EPS = 1e-5


class RMSNorm(nn.Module):
    """LlamaRMSNorm's state: one weight per hidden unit."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))


class Conv1D(nn.Module):
    """GPT-2's Conv1D: a linear layer whose weight is stored (in, out), transposed."""

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(out_features))


class LlamaAttention(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        hidden, heads = shape.hidden_size, shape.num_heads
        head_dim = hidden // heads
        kv_dim = head_dim * (shape.num_kv_heads or heads)
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)


class LlamaMLP(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        hidden = shape.hidden_size
        intermediate = shape.intermediate_size or 4 * hidden
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(shape)
        self.mlp = LlamaMLP(shape)
        self.input_layernorm = RMSNorm(shape.hidden_size)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size)


class LlamaModel(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size)


class Llama(nn.Module):
    """LlamaForCausalLM's state (untied embeddings, no biases)."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.model = LlamaModel(shape)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)


class GPT2Attention(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.c_attn = Conv1D(3 * hidden, hidden)
        self.c_proj = Conv1D(hidden, hidden)


class GPT2MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.c_fc = Conv1D(4 * hidden, hidden)
        self.c_proj = Conv1D(hidden, 4 * hidden)


class GPT2Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden, eps=GPT2_LAYER_NORM_EPS)
        self.attn = GPT2Attention(hidden)
        self.ln_2 = nn.LayerNorm(hidden, eps=GPT2_LAYER_NORM_EPS)
        self.mlp = GPT2MLP(hidden)


class GPT2Model(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        hidden = shape.hidden_size
        self.wte = nn.Embedding(shape.vocab_size, hidden)
        self.wpe = nn.Embedding(shape.max_positions, hidden)
        self.h = nn.ModuleList(GPT2Block(hidden) for _ in range(shape.num_layers))
        self.ln_f = nn.LayerNorm(hidden, eps=GPT2_LAYER_NORM_EPS)


class GPT2(nn.Module):
    """GPT2LMHeadModel's state: lm_head.weight is transformer.wte.weight (tied)."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.transformer = GPT2Model(shape)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight


def module_tree(shape: ModelShape) -> nn.Module:
    """The module tree of a shape, built on the current default device (meta for a rank)."""
    return Llama(shape) if shape.family == "llama" else GPT2(shape)
