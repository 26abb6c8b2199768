"""The models' module trees in plain torch: the state of transformers' `LlamaForCausalLM`,
`MistralForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`,
`MixtralForCausalLM` and `GPT2LMHeadModel` (parameter names, shapes, dtypes, registration
order, tied embeddings), without importing transformers.

A rank never runs the model: it builds the state DCP saves and loads. Importing transformers
cost every rank about 1.5 s of CPU (5.23.0 on the 2-core VM: half of a tiny_llama rank's
start-up, paid again by every rank of every node), for classes whose only use here is their
parameters. `tests/unit/test_models.py` holds these trees to transformers' own classes for
every preset and a config of every family, built on the meta device: the same state dict keys
in the same order, the same shapes and dtypes, the same tying. Buffers that transformers keeps
out of the state dict (the rotary `inv_freq`, GPT-2's attention mask) are left out: DCP never
sees them.

The Llama-like families differ only in what `ModelShape` says (biases, head_dim, q/k norms,
experts), so one set of classes builds them all. Experts come in two layouts
(`model.moe_layout`): transformers 5.x's fused `gate_up_proj` / `down_proj` (hf), or
torchtitan's GroupedExperts `w1` / `w2` / `w3` (grouped).
"""

from __future__ import annotations

import torch
from torch import nn

from dcp_fsdp.models.llama_model_config import ModelShape

# transformers' defaults for the configs hf_config builds (GPT2Config.layer_norm_epsilon).
GPT2_LAYER_NORM_EPS = 1e-5


class RMSNorm(nn.Module):
    """LlamaRMSNorm's state: one weight per unit."""

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
    """Grouped-query attention with head_dim of its own (Qwen3-32B: 128 where hidden / heads
    is 80), optional biases (Qwen2: q/k/v) and Qwen3's per-head q/k norms."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        hidden, head_dim = shape.hidden_size, shape.attention_head_dim
        q_dim = shape.num_heads * head_dim
        kv_dim = head_dim * (shape.num_kv_heads or shape.num_heads)
        self.q_proj = nn.Linear(hidden, q_dim, bias=shape.qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_dim, bias=shape.qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_dim, bias=shape.qkv_bias)
        self.o_proj = nn.Linear(q_dim, hidden, bias=shape.o_bias)
        if shape.qk_norm:
            self.q_norm = RMSNorm(head_dim)
            self.k_norm = RMSNorm(head_dim)


class LlamaMLP(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        hidden = shape.hidden_size
        intermediate = shape.intermediate_size or 4 * hidden
        self.gate_proj = nn.Linear(hidden, intermediate, bias=shape.mlp_bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=shape.mlp_bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=shape.mlp_bias)


class Router(nn.Module):
    """MixtralTopKRouter / Qwen3MoeTopKRouter's state: one row per expert."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape.num_experts, shape.hidden_size))


class FusedExperts(nn.Module):
    """transformers 5.x's MixtralExperts / Qwen3MoeExperts: every expert's gate and up
    projections in one tensor, their down projections in another."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        experts, hidden, width = shape.num_experts, shape.hidden_size, shape.expert_intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * width, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, width))


class GroupedExperts(nn.Module):
    """torchtitan's GroupedExperts: one tensor per projection holding every expert."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        experts, hidden, width = shape.num_experts, shape.hidden_size, shape.expert_intermediate
        self.w1 = nn.Parameter(torch.empty(experts, width, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, width))
        self.w3 = nn.Parameter(torch.empty(experts, width, hidden))


class SparseMoeBlock(nn.Module):
    def __init__(self, shape: ModelShape, moe_layout: str) -> None:
        super().__init__()
        experts = GroupedExperts if moe_layout == "grouped" else FusedExperts
        # registration order is state dict order: Mixtral's router comes first, Qwen3-MoE's last
        if shape.family == "mixtral":
            self.gate = Router(shape)
            self.experts = experts(shape)
        else:
            self.experts = experts(shape)
            self.gate = Router(shape)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, shape: ModelShape, layer: int, moe_layout: str) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(shape)
        self.mlp = SparseMoeBlock(shape, moe_layout) if shape.sparse(layer) else LlamaMLP(shape)
        self.input_layernorm = RMSNorm(shape.hidden_size)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size)


class LlamaModel(nn.Module):
    def __init__(self, shape: ModelShape, moe_layout: str) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(shape, layer, moe_layout)
                                    for layer in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size)


class Llama(nn.Module):
    """The *ForCausalLM state of every Llama-like family (lm_head tied or not)."""

    def __init__(self, shape: ModelShape, moe_layout: str = "hf") -> None:
        super().__init__()
        self.model = LlamaModel(shape, moe_layout)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        if shape.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight


class GPT2Attention(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.c_attn = Conv1D(3 * hidden, hidden)
        self.c_proj = Conv1D(hidden, hidden)


class GPT2MLP(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.c_fc = Conv1D(inner, hidden)
        self.c_proj = Conv1D(hidden, inner)


class GPT2Block(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden, eps=GPT2_LAYER_NORM_EPS)
        self.attn = GPT2Attention(hidden)
        self.ln_2 = nn.LayerNorm(hidden, eps=GPT2_LAYER_NORM_EPS)
        self.mlp = GPT2MLP(hidden, inner)


class GPT2Model(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        hidden = shape.hidden_size
        inner = shape.intermediate_size or 4 * hidden  # GPT2Config.n_inner
        self.wte = nn.Embedding(shape.vocab_size, hidden)
        self.wpe = nn.Embedding(shape.max_positions, hidden)
        self.h = nn.ModuleList(GPT2Block(hidden, inner) for _ in range(shape.num_layers))
        self.ln_f = nn.LayerNorm(hidden, eps=GPT2_LAYER_NORM_EPS)


class GPT2(nn.Module):
    """GPT2LMHeadModel's state: lm_head.weight is transformer.wte.weight unless the config
    unties them."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.transformer = GPT2Model(shape)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        if shape.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight


def module_tree(shape: ModelShape, moe_layout: str = "hf") -> nn.Module:
    """The module tree of a shape, built on the current default device (meta for a rank)."""
    return GPT2(shape) if shape.family == "gpt2" else Llama(shape, moe_layout)
