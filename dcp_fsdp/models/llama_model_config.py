"""The model shapes this benchmark checkpoints: the original awslabs DCP/FSDP benchmark's Llamas
(7B to 70B), the GPT-2-shaped "4B", released models as their config.json files give them, MLPerf
Storage's checkpointing workloads, and small shapes for machines and tests. Shapes only, no torch:
`state_shapes` lists a shape's state by arithmetic, so the light parent sizes a run without torch
(models/modules.py builds the module tree from it).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

LLAMA_RMS_NORM_EPS = 1e-5

Family = Literal["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gpt2"]
# transformers' `model_type` of each family this tool builds (a config.json's "model_type").
FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gpt2")
# model.moe_layout: "hf" is what transformers 5.x builds (a fused gate_up_proj [E, 2I, H] and a
# down_proj [E, H, I] per layer); "grouped" is torchtitan's GroupedExperts (w1, w2, w3).
MOE_LAYOUTS = ("hf", "grouped")


@dataclasses.dataclass(frozen=True)
class ModelShape:
    family: Family
    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
    max_positions: int
    intermediate_size: int | None = None  # llama-like (gpt2: n_inner, None = 4 * hidden)
    num_kv_heads: int | None = None  # llama-like; None: num_heads
    rms_norm_eps: float = LLAMA_RMS_NORM_EPS
    head_dim: int | None = None  # None: hidden / heads (Qwen3-32B: 128, not 5120 / 64)
    tie_embeddings: bool = False  # lm_head is the embedding (GPT-2, small Qwen3)
    qkv_bias: bool = False  # q/k/v projections have biases (Qwen2; attention_bias)
    o_bias: bool = False  # o_proj has a bias (Llama/Qwen3 attention_bias)
    mlp_bias: bool = False  # Llama's mlp_bias
    qk_norm: bool = False  # an RMSNorm over head_dim on q and k per layer (Qwen3)
    num_experts: int = 0  # MoE: experts per sparse layer (0: dense)
    moe_intermediate_size: int | None = None  # Qwen3-MoE's expert width (Mixtral: intermediate)
    dense_layers: tuple[int, ...] = ()  # Qwen3-MoE layers with a dense MLP (mlp_only_layers)

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def expert_intermediate(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size or 4 * self.hidden_size

    def sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` holds experts (else a dense MLP)."""
        return self.num_experts > 0 and layer not in self.dense_layers


def llama(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
          vocab_size: int = 50432, max_positions: int = 4096) -> ModelShape:
    return ModelShape("llama", hidden, layers, heads, vocab_size, max_positions,
                      intermediate_size=intermediate, num_kv_heads=kv_heads)


def gpt2(n_embd: int, n_layer: int, n_head: int, vocab_size: int = 50257,
         n_positions: int = 512) -> ModelShape:
    return ModelShape("gpt2", n_embd, n_layer, n_head, vocab_size, n_positions,
                      tie_embeddings=True)


# The original benchmark's Llama shapes: hidden, intermediate, layers, heads, kv heads (all
# share a vocabulary of 50,432, 4,096 positions and untied embeddings).
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

LLAMA3_VOCAB, QWEN3_VOCAB = 128256, 151936


def llama3(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int = 8) -> ModelShape:
    """Llama 3.1 (meta-llama/Llama-3.1-*B config.json): untied, rope to 131,072; also MLPerf
    Storage v3.0's checkpointing workloads (DLIO's llama3 configs, head_dim hidden // heads as
    DLIO computes it). A width that is not a multiple of the heads (MLPerf's 1t) is built as
    mistral: LlamaConfig refuses it, and Mistral's decoder holds the same tensors."""
    family: Family = "llama" if hidden % heads == 0 else "mistral"
    return ModelShape(family, hidden, layers, heads, LLAMA3_VOCAB, 131072,
                      intermediate_size=intermediate, num_kv_heads=kv_heads)


def qwen3(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int) -> ModelShape:
    """Qwen3 8B and larger: head_dim 128 whatever hidden / heads is, q/k norms, untied."""
    return ModelShape("qwen3", hidden, layers, heads, QWEN3_VOCAB, 40960, rms_norm_eps=1e-6,
                      intermediate_size=intermediate, num_kv_heads=kv_heads, head_dim=128,
                      qk_norm=True)


# Released models, every field from the published config.json (field notes, "Real model
# shapes"); parameter counts are the published ones (tests/unit/test_models.py holds them).
RELEASED_SHAPES: dict[str, ModelShape] = {
    "llama3_8b": llama3(4096, 14336, 32, 32),  # 8,030,261,248
    "llama3_70b": llama3(8192, 28672, 80, 64),  # 70,553,706,496
    "llama3_405b": llama3(16384, 53248, 126, 128),  # 405,853,388,800
    "qwen3_8b": qwen3(4096, 12288, 36, 32, 8),  # 8,190,735,360
    "qwen3_32b": qwen3(5120, 25600, 64, 64, 8),  # 32,762,123,264
    # 48 layers of 128 experts (top 8), each 768 wide: 30.53 B parameters, 3.35 B active
    "qwen3_30b_a3b": ModelShape("qwen3_moe", 2048, 48, 32, QWEN3_VOCAB, 40960,
                                rms_norm_eps=1e-6, intermediate_size=6144, num_kv_heads=4,
                                head_dim=128, qk_norm=True, num_experts=128,
                                moe_intermediate_size=768),
    # 32 layers of 8 experts (top 2), each 14,336 wide: 46.70 B parameters
    "mixtral_8x7b": ModelShape("mixtral", 4096, 32, 32, 32000, 32768, intermediate_size=14336,
                               num_kv_heads=8, num_experts=8),
}


# MLPerf's shapes, which are not all Llama's: its 70b has 128 heads of 64 (Llama 3.1 70B: 64
# of 128), so its k/v projections are half as wide (69.88 B parameters, not 70.55 B).
MLPERF_SHAPES: dict[str, ModelShape] = {
    "mlperf_llama3_8b": llama3(4096, 14336, 32, 32, 8),  # 8,030,261,248 (Llama 3.1 8B)
    "mlperf_llama3_70b": llama3(8192, 28672, 80, 128, 8),  # 69,882,617,856
    "mlperf_llama3_405b": llama3(16384, 53248, 126, 128, 8),  # 405,853,388,800
    # 192 heads of 25,872 // 192 = 134 make q 25,728 wide, where DLIO's count takes it as
    # hidden x hidden: 1,182,081,357,072 parameters, 953,745,408 (0.08 %) fewer than DLIO's
    "mlperf_llama3_1t": llama3(25872, 98304, 128, 192, 32),
}


# (name, shape) per parameter, in the module tree's named_parameters order
Tensors = list[tuple[str, tuple[int, ...]]]


def _linear(name: str, out_features: int, in_features: int, bias: bool) -> Tensors:
    weight: Tensors = [(f"{name}.weight", (out_features, in_features))]
    return weight + [(f"{name}.bias", (out_features,))] if bias else weight


def _experts(prefix: str, shape: ModelShape, moe_layout: str) -> Tensors:
    experts, hidden, width = shape.num_experts, shape.hidden_size, shape.expert_intermediate
    if moe_layout == "grouped":  # torchtitan's GroupedExperts: one tensor per projection
        return [(f"{prefix}.w1", (experts, width, hidden)), (f"{prefix}.w2", (experts, hidden, width)),
                (f"{prefix}.w3", (experts, width, hidden))]
    return [(f"{prefix}.gate_up_proj", (experts, 2 * width, hidden)),
            (f"{prefix}.down_proj", (experts, hidden, width))]


def _llama_layer(prefix: str, shape: ModelShape, layer: int, moe_layout: str) -> Tensors:
    hidden, head_dim = shape.hidden_size, shape.attention_head_dim
    q_dim = shape.num_heads * head_dim
    kv_dim = (shape.num_kv_heads or shape.num_heads) * head_dim
    attn = f"{prefix}.self_attn"
    out = (_linear(f"{attn}.q_proj", q_dim, hidden, shape.qkv_bias)
           + _linear(f"{attn}.k_proj", kv_dim, hidden, shape.qkv_bias)
           + _linear(f"{attn}.v_proj", kv_dim, hidden, shape.qkv_bias)
           + _linear(f"{attn}.o_proj", hidden, q_dim, shape.o_bias))
    if shape.qk_norm:
        out += [(f"{attn}.q_norm.weight", (head_dim,)), (f"{attn}.k_norm.weight", (head_dim,))]
    if shape.sparse(layer):
        gate: Tensors = [(f"{prefix}.mlp.gate.weight", (shape.num_experts, hidden))]
        experts = _experts(f"{prefix}.mlp.experts", shape, moe_layout)
        # transformers registers Mixtral's router before its experts, Qwen3-MoE's after
        out += gate + experts if shape.family == "mixtral" else experts + gate
    else:
        width = shape.intermediate_size or 4 * hidden
        out += (_linear(f"{prefix}.mlp.gate_proj", width, hidden, shape.mlp_bias)
                + _linear(f"{prefix}.mlp.up_proj", width, hidden, shape.mlp_bias)
                + _linear(f"{prefix}.mlp.down_proj", hidden, width, shape.mlp_bias))
    return out + [(f"{prefix}.input_layernorm.weight", (hidden,)),
                  (f"{prefix}.post_attention_layernorm.weight", (hidden,))]


def _gpt2_layer(prefix: str, shape: ModelShape) -> Tensors:
    hidden = shape.hidden_size
    inner = shape.intermediate_size or 4 * hidden

    def conv1d(name: str, out_features: int, in_features: int) -> Tensors:  # weight is (in, out)
        return [(f"{prefix}.{name}.weight", (in_features, out_features)),
                (f"{prefix}.{name}.bias", (out_features,))]

    def norm(name: str) -> Tensors:
        return [(f"{prefix}.{name}.weight", (hidden,)), (f"{prefix}.{name}.bias", (hidden,))]

    return (norm("ln_1") + conv1d("attn.c_attn", 3 * hidden, hidden)
            + conv1d("attn.c_proj", hidden, hidden) + norm("ln_2")
            + conv1d("mlp.c_fc", inner, hidden) + conv1d("mlp.c_proj", hidden, inner))


def state_shapes(shape: ModelShape, moe_layout: str = "hf") -> Tensors:
    """(name, shape) of every parameter, in transformers' named_parameters order, a tied one
    once: by arithmetic (no torch), for the light parent, `plan` and models/modules.py."""
    hidden, vocab = shape.hidden_size, shape.vocab_size
    if shape.family == "gpt2":
        out: Tensors = [("transformer.wte.weight", (vocab, hidden)),
               ("transformer.wpe.weight", (shape.max_positions, hidden))]
        for layer in range(shape.num_layers):
            out += _gpt2_layer(f"transformer.h.{layer}", shape)
        out += [("transformer.ln_f.weight", (hidden,)), ("transformer.ln_f.bias", (hidden,))]
    else:
        out = [("model.embed_tokens.weight", (vocab, hidden))]
        for layer in range(shape.num_layers):
            out += _llama_layer(f"model.layers.{layer}", shape, layer, moe_layout)
        out.append(("model.norm.weight", (hidden,)))
    if not shape.tie_embeddings:
        out.append(("lm_head.weight", (vocab, hidden)))
    return out


def param_count(shape: ModelShape) -> int:
    """The model's parameters (the same in either MoE layout)."""
    return sum(math.prod(dims) for _, dims in state_shapes(shape))
