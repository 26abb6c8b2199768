"""Model presets and config.json models: true parameter counts, and a module tree whose
state is transformers' own, built on the meta device (no memory)."""

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_fsdp.models.llama_model_config import ModelShape, param_count, state_shapes
from dcp_fsdp.models.presets import PRESETS

HF_CONFIGS = Path(__file__).resolve().parents[1] / "data" / "hf_configs"
CONFIG_FILES = sorted(path.name for path in HF_CONFIGS.glob("*.json"))

# The published parameter counts (field notes, "Real model shapes"; the model cards).
PUBLISHED = {
    "L7b": 6_889_410_560,  # ~26,281 MiB in fp32 (field notes)
    "GPT-4B": 2_647_621_120,  # named "4B", really 2.65 B (tied embeddings)
    "llama3_8b": 8_030_261_248,
    "llama3_70b": 70_553_706_496,
    "llama3_405b": 405_853_388_800,
    "qwen3_8b": 8_190_735_360,
    "qwen3_32b": 32_762_123_264,
    "qwen3_30b_a3b": 30_532_122_624,  # "30.5 B" (3.3 B active)
    "mixtral_8x7b": 46_702_792_704,  # "46.7 B" (12.9 B active)
}

# MLPerf Storage v3.0's checkpointing workloads (field notes): DLIO's parameter count,
# `BaseCheckpointing.get_num_parameters` (hidden, layers, heads, kv heads, ffn; vocab 128,256).
MLPERF = {
    "mlperf_llama3_8b": (4096, 32, 32, 8, 14336),
    "mlperf_llama3_70b": (8192, 80, 128, 8, 28672),
    "mlperf_llama3_405b": (16384, 126, 128, 8, 53248),
    "mlperf_llama3_1t": (25872, 128, 192, 32, 98304),
}
MLPERF_COUNTS = {
    "mlperf_llama3_8b": 8_030_261_248,
    "mlperf_llama3_70b": 69_882_617_856,
    "mlperf_llama3_405b": 405_853_388_800,
    "mlperf_llama3_1t": 1_182_081_357_072,
}


def dlio_parameters(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int) -> int:
    """DLIO's count: q and o as hidden x hidden, k and v (hidden // heads) x kv_heads wide."""
    kv_dim = hidden // heads * kv_heads
    per_layer = 2 * hidden + hidden * (hidden + 2 * kv_dim) + hidden * hidden + 3 * ffn * hidden
    return 2 * 128256 * hidden + layers * per_layer + hidden


def hf_config(shape: ModelShape):
    """The transformers config object for a shape (ranks never import transformers). Every
    field that shapes the state is given: the config classes' defaults are not the released
    models (Qwen3Config's head_dim is 128 whatever the width)."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[shape.family]  # its own fields, not the base class's
    if shape.family == "gpt2":
        return config_class(
            vocab_size=shape.vocab_size, n_embd=shape.hidden_size, n_layer=shape.num_layers,
            n_head=shape.num_heads, n_positions=shape.max_positions,
            n_inner=shape.intermediate_size, tie_word_embeddings=shape.tie_embeddings,
            use_cache=False,
            # GPT-2's special token id is 50256; keep it inside a smaller test vocabulary.
            bos_token_id=min(50256, shape.vocab_size - 1),
            eos_token_id=min(50256, shape.vocab_size - 1))
    fields: dict[str, Any] = dict(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size or 4 * shape.hidden_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads or shape.num_heads,
        head_dim=shape.attention_head_dim, max_position_embeddings=shape.max_positions,
        rms_norm_eps=shape.rms_norm_eps, use_cache=False,
        tie_word_embeddings=shape.tie_embeddings)
    if shape.family in ("llama", "qwen3", "qwen3_moe"):
        fields["attention_bias"] = shape.o_bias
    if shape.family == "llama":
        fields["mlp_bias"] = shape.mlp_bias
    if shape.family == "qwen3_moe":
        fields.update(num_experts=shape.num_experts,
                      moe_intermediate_size=shape.expert_intermediate,
                      mlp_only_layers=list(shape.dense_layers), decoder_sparse_step=1)
    if shape.family == "mixtral":
        fields["num_local_experts"] = shape.num_experts
    return config_class(**fields)


def transformers_model(config):
    """transformers' own causal-LM class for a config, built on the meta device."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    with torch.device("meta"):
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config)


def file_config(name: str):
    """transformers' own reading of a config.json (what from_pretrained would build)."""
    from transformers import CONFIG_MAPPING

    data = json.loads((HF_CONFIGS / name).read_text())
    return CONFIG_MAPPING[data["model_type"]].from_dict(data)


def file_shape(name: str) -> ModelShape:
    from dcp_fsdp.models.hf_json import read_config_json

    return read_config_json(str(HF_CONFIGS / name))


def meta_param_count(preset: str) -> int:
    return sum(p.numel() for p in transformers_model(hf_config(PRESETS[preset])).parameters())


@pytest.mark.parametrize("preset, expected", sorted(PUBLISHED.items()))
def test_parameter_counts_are_the_published_ones(preset, expected):
    assert param_count(PRESETS[preset]) == expected


@pytest.mark.parametrize("preset", sorted(MLPERF))
def test_mlperf_workloads_are_dlios_shapes_and_counts(preset):
    """MLPerf's shapes as DLIO sizes them: every count equals DLIO's but the 1t's, whose
    192 heads of 25,872 // 192 = 134 make q and o 25,728 wide where DLIO counts hidden."""
    hidden, layers, heads, kv_heads, ffn = MLPERF[preset]
    config = hf_config(PRESETS[preset])
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.intermediate_size, config.vocab_size,
            config.tie_word_embeddings, config.head_dim) == (hidden, layers, heads, kv_heads, ffn,
                                                             128256, False, hidden // heads)
    # LlamaConfig refuses 25,872 / 192; Mistral's decoder is Llama's tensors by the same names
    assert config.model_type == ("mistral" if preset == "mlperf_llama3_1t" else "llama")
    assert param_count(PRESETS[preset]) == MLPERF_COUNTS[preset]
    narrower = 2 * layers * hidden * (hidden - heads * (hidden // heads))
    assert param_count(PRESETS[preset]) == dlio_parameters(*MLPERF[preset]) - narrower
    assert (narrower == 0) == (preset != "mlperf_llama3_1t")


def test_mlperf_70b_is_not_llama_3_1_70b():
    """MLPerf's 70b has 128 heads of 64 (Llama 3.1 70B: 64 of 128): k and v half as wide."""
    assert PRESETS["mlperf_llama3_70b"].attention_head_dim == 64
    assert PUBLISHED["llama3_70b"] - MLPERF_COUNTS["mlperf_llama3_70b"] == 80 * 2 * 8192 * 512


@pytest.mark.parametrize("preset", sorted(PUBLISHED) + sorted(MLPERF))
def test_plan_states_the_published_parameter_count_and_its_bytes(preset):
    """`dcp-fsdp plan model=NAME` prints this line (plan/render.py)."""
    from dcp_fsdp.config.compose import compose
    from dcp_fsdp.plan.render import model_line

    cfg = compose("save", [f"model={preset}"])
    count = {**PUBLISHED, **MLPERF_COUNTS}[preset]
    width = {"bf16": 2, "fp32": 4}[cfg.model.dtype.value]
    assert model_line(cfg).startswith(f"model: {count:,} parameters (")
    assert f"{count * width:,} B" in model_line(cfg)


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


def test_released_shapes_are_the_published_configs():
    """Field notes, "Real model shapes": hidden, intermediate, layers, heads, KV heads,
    head_dim, vocabulary, tied; experts and their width for the MoE models."""
    table = {
        "llama3_8b": (4096, 14336, 32, 32, 8, 128, 128256, False),
        "llama3_70b": (8192, 28672, 80, 64, 8, 128, 128256, False),
        "llama3_405b": (16384, 53248, 126, 128, 8, 128, 128256, False),
        "qwen3_8b": (4096, 12288, 36, 32, 8, 128, 151936, False),
        "qwen3_32b": (5120, 25600, 64, 64, 8, 128, 151936, False),  # head_dim != 5120 / 64
        "qwen3_30b_a3b": (2048, 6144, 48, 32, 4, 128, 151936, False),
        "mixtral_8x7b": (4096, 14336, 32, 32, 8, 128, 32000, False),
    }
    for name, row in table.items():
        config = hf_config(PRESETS[name])
        assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers,
                config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                config.vocab_size, config.tie_word_embeddings) == row, name
    assert PRESETS["qwen3_30b_a3b"].num_experts == 128
    assert hf_config(PRESETS["qwen3_30b_a3b"]).moe_intermediate_size == 768
    assert hf_config(PRESETS["mixtral_8x7b"]).num_local_experts == 8
    assert all(PRESETS[name].qk_norm for name in ("qwen3_8b", "qwen3_32b", "qwen3_30b_a3b"))


def test_presets_are_the_shapes_of_llama_model_config():
    """One source of shapes (the card: models built "from llama_model_config"); every model
    yaml's `# Shape:` comment names that module and its own shape."""
    from dcp_fsdp.models import llama_model_config as shapes
    from tests.kit.cli import REPO

    assert PRESETS == {**shapes.LLAMA_SHAPES, **shapes.GPT_SHAPES, **shapes.RELEASED_SHAPES,
                       **shapes.MLPERF_SHAPES}
    assert set(MLPERF) == set(shapes.MLPERF_SHAPES)
    assert all(PRESETS[name] is shape for name, shape in shapes.LLAMA_SHAPES.items())
    assert {"L7b", "L13b", "L30b", "L65b", "L70b", "L660m", "tiny_llama"} <= set(shapes.LLAMA_SHAPES)
    assert {"GPT-4B", "tiny_gpt2"} <= set(shapes.GPT_SHAPES)
    assert set(PUBLISHED) - {"L7b", "GPT-4B"} == set(shapes.RELEASED_SHAPES)
    module = Path(shapes.__file__).resolve().relative_to(REPO)
    for yaml in sorted((REPO / "conf" / "model").glob("*.yaml")):
        first = yaml.read_text().splitlines()[0]
        assert first == f"# Shape: {module} {yaml.stem}", yaml
        assert (REPO / module).is_file() and yaml.stem in PRESETS


def test_the_config_files_are_every_family():
    """A config.json of every family model.config takes is held to transformers below."""
    from dcp_fsdp.models.llama_model_config import FAMILIES

    assert {file_shape(name).family for name in CONFIG_FILES} == set(FAMILIES)


def _state(model):
    return [(name, tuple(t.shape), t.dtype) for name, t in model.state_dict().items()]


def _params(model):  # the optimizer's order, and which names share one tensor
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def _tied(model):
    named = list(model.named_parameters(remove_duplicate=False))
    return sorted((a, b) for i, (a, p) in enumerate(named) for b, q in named[i + 1:] if p is q)


def _assert_same_state(tree, reference):
    assert _state(tree) == _state(reference)
    assert _params(tree) == _params(reference)
    assert _tied(tree) == _tied(reference)
    assert [n for n, _ in tree.named_buffers()] == []  # every reference buffer is non-persistent
    assert not any(name in reference.state_dict() for name, _ in reference.named_buffers())


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_the_module_tree_holds_transformers_state_exactly(preset):
    """A rank builds models/modules.py's tree, not transformers' class (1.5 s of imports per
    rank): its state is transformers' own, name for name, in the same order, shape and
    dtype, with the same parameters tied, so the checkpoint is the one the HF model saves."""
    from dcp_fsdp.models.modules import module_tree

    shape = PRESETS[preset]
    reference = transformers_model(hf_config(shape)).to(torch.bfloat16)
    with torch.device("meta"):
        tree = module_tree(shape).to(torch.bfloat16)
    _assert_same_state(tree, reference)


@pytest.mark.parametrize("name", CONFIG_FILES)
def test_a_config_json_builds_the_state_transformers_builds_from_it(name):
    """model.config=PATH: the file read here (no transformers) gives the tree whose state is
    that of the model transformers builds from the same file (tied embeddings, head_dim not
    hidden / heads, GQA, biases, q/k norms, experts and routers, dense layers among sparse)."""
    from dcp_fsdp.models.modules import module_tree

    reference = transformers_model(file_config(name))
    with torch.device("meta"):
        tree = module_tree(file_shape(name))
    _assert_same_state(tree, reference)
    assert param_count(file_shape(name)) == sum(p.numel() for p in reference.parameters())


def _layouts(shape: ModelShape) -> list[str]:
    return ["hf", "grouped"] if shape.num_experts else ["hf"]


@pytest.mark.parametrize("model", sorted(PRESETS) + CONFIG_FILES)
def test_the_shapes_by_arithmetic_are_the_module_trees(model):
    """What the light parent sizes a run with (no torch) and plan counts is exactly what a
    rank builds, in either expert layout."""
    from dcp_fsdp.models.modules import module_tree

    shape = PRESETS[model] if model in PRESETS else file_shape(model)
    for layout in _layouts(shape):
        with torch.device("meta"):
            tree = module_tree(shape, layout)
        assert state_shapes(shape, layout) == _params(tree), layout


@pytest.mark.parametrize("model", ["qwen3_30b_a3b", "mixtral_8x7b", "qwen3_moe.json"])
def test_the_grouped_layout_is_torchtitans_grouped_experts(model):
    """moe_layout=grouped: w1 [E, I, H], w2 [E, H, I], w3 [E, I, H] (torchtitan's
    GroupedExperts) where hf has gate_up_proj [E, 2I, H] and down_proj [E, H, I]; every other
    tensor, and the parameter count, the same."""
    shape = PRESETS[model] if model in PRESETS else file_shape(model)
    experts, hidden, width = shape.num_experts, shape.hidden_size, shape.expert_intermediate
    hf, grouped = dict(state_shapes(shape, "hf")), dict(state_shapes(shape, "grouped"))
    layer = next(i for i in range(shape.num_layers) if shape.sparse(i))
    prefix = f"model.layers.{layer}.mlp.experts."
    assert hf[prefix + "gate_up_proj"] == (experts, 2 * width, hidden)
    assert hf[prefix + "down_proj"] == (experts, hidden, width)
    assert (grouped[prefix + "w1"], grouped[prefix + "w2"], grouped[prefix + "w3"]) == (
        (experts, width, hidden), (experts, hidden, width), (experts, width, hidden))
    assert ({k: v for k, v in hf.items() if ".experts." not in k}
            == {k: v for k, v in grouped.items() if ".experts." not in k})
    sparse = sum(shape.sparse(i) for i in range(shape.num_layers))
    assert len(grouped) - len(hf) == sparse
    assert sum(map(_numel, hf.values())) == sum(map(_numel, grouped.values()))


def _numel(dims) -> int:
    count = 1
    for size in dims:
        count *= size
    return count


@pytest.mark.parametrize("preset", ["tiny_llama", "tiny_gpt2"])
def test_tiny_presets_are_tens_of_mb(preset):
    fp32_mib = meta_param_count(preset) * 4 / 2**20
    assert 5 < fp32_mib < 100


@pytest.fixture(scope="module")
def one_rank_group():
    """A gloo group of one (this process): enough for fully_shard and DTensors."""
    import socket

    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("preset, dtype", [("tiny_llama", "bf16"), ("tiny_gpt2", "fp32")])
def test_built_shards_hold_their_values_in_the_target_dtype_on_the_device(one_rank_group,
                                                                          preset, dtype):
    from dcp_fsdp.config.schema import CheckpointState, Dtype
    from dcp_fsdp.models.build import TORCH_DTYPES, build_sharded_model, local_tensor
    from dcp_fsdp.rank import state as verify
    from dcp_fsdp.rank.state import flat_tensors
    from dcp_fsdp.models.build import dcp_state_dict

    sharded = build_sharded_model(preset, Dtype(dtype), CheckpointState.model_and_optimizer,
                                  torch.device("cpu"), 1, seed=7)
    state_dict = dcp_state_dict(sharded.model, sharded.optimizer)
    flat = flat_tensors(state_dict)
    for key, tensor in flat.items():
        local = local_tensor(tensor)
        assert local.device.type == "cpu"
        want = torch.float32 if key.endswith(".step") else TORCH_DTYPES[Dtype(dtype)]
        assert local.dtype == want, key
    # the AdamW state exists without an optimizer step (no gradients were made)
    assert any(key.endswith(".exp_avg_sq") for key in flat)
    assert all(param.grad is None for param in sharded.model.parameters())
    # the keys the builder filled by are the keys a load verifies by
    assert verify.first_mismatch(state_dict, seed=7) is None
    assert verify.first_mismatch(state_dict, seed=8) is not None
    assert verify.local_bytes(state_dict) == sum(t.numel() * t.element_size()
                                                 for t in flat.values())


@pytest.mark.parametrize("name, layout", [("mixtral_4x.json", "grouped"),
                                          ("qwen3_tied.json", "hf")])
def test_a_config_json_model_is_built_sharded_and_filled(one_rank_group, name, layout):
    """The 3-D expert tensors and the tied embedding go through FSDP2 and the value fill like
    the presets' tensors do, and verify."""
    from dcp_fsdp.config.schema import CheckpointState, Dtype
    from dcp_fsdp.models.build import build_sharded_model
    from dcp_fsdp.rank import state as verify
    from dcp_fsdp.models.build import dcp_state_dict

    shape = file_shape(name)
    sharded = build_sharded_model(shape, Dtype.bf16, CheckpointState.model, torch.device("cpu"),
                                  1, seed=3, moe_layout=layout)
    assert sharded.param_count == param_count(shape)
    state_dict = dcp_state_dict(sharded.model, sharded.optimizer)
    assert verify.first_mismatch(state_dict, seed=3) is None
