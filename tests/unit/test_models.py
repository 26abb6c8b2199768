"""Model presets: true parameter counts, built on the meta device (no memory)."""

from pathlib import Path

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


def test_presets_are_the_shapes_of_llama_model_config():
    """One source of shapes (the card: models built "from llama_model_config"); every model
    yaml's `# Shape:` comment names that module and its own shape."""
    from dcp_fsdp.models import llama_model_config as shapes
    from tests.kit.cli import REPO

    assert PRESETS == {**shapes.LLAMA_SHAPES, **shapes.GPT_SHAPES}
    assert all(PRESETS[name] is shape for name, shape in shapes.LLAMA_SHAPES.items())
    assert {"L7b", "L13b", "L30b", "L65b", "L70b", "L660m", "tiny_llama"} <= set(shapes.LLAMA_SHAPES)
    assert {"GPT-4B", "tiny_gpt2"} <= set(shapes.GPT_SHAPES)
    module = Path(shapes.__file__).resolve().relative_to(REPO)
    for yaml in sorted((REPO / "conf" / "model").glob("*.yaml")):
        first = yaml.read_text().splitlines()[0]
        assert first == f"# Shape: {module} {yaml.stem}", yaml
        assert (REPO / module).is_file() and yaml.stem in PRESETS


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_the_module_tree_holds_transformers_state_exactly(preset):
    """A rank builds models/modules.py's tree, not transformers' class (1.5 s of imports per
    rank): its state is transformers' own, name for name, in the same order, shape and
    dtype, with the same parameters tied, so the checkpoint is the one the HF model saves."""
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    from dcp_fsdp.models.modules import module_tree

    shape = PRESETS[preset]
    model_class = LlamaForCausalLM if shape.family == "llama" else GPT2LMHeadModel
    with torch.device("meta"):
        reference = model_class(hf_config(shape)).to(torch.bfloat16)
        tree = module_tree(shape).to(torch.bfloat16)

    def state(model):
        return [(name, tuple(t.shape), t.dtype) for name, t in model.state_dict().items()]

    def params(model):  # the optimizer's order, and which names share one tensor
        return [(name, tuple(p.shape)) for name, p in model.named_parameters()]

    def tied(model):
        named = list(model.named_parameters(remove_duplicate=False))
        return sorted((a, b) for i, (a, p) in enumerate(named) for b, q in named[i + 1:]
                      if p is q)

    assert state(tree) == state(reference)
    assert params(tree) == params(reference)
    assert tied(tree) == tied(reference)
    assert [n for n, _ in tree.named_buffers()] == []  # every reference buffer is non-persistent
    assert not any(name in reference.state_dict() for name, _ in reference.named_buffers())


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
    from dcp_fsdp.rank.state import flat_tensors, make_state_dict

    sharded = build_sharded_model(preset, Dtype(dtype), CheckpointState.model_and_optimizer,
                                  torch.device("cpu"), 1, seed=7)
    state_dict = make_state_dict(sharded)
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


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_the_parameter_count_from_the_shape_alone_is_the_built_models(preset):
    """What the light parent sizes a run with (no torch) is exactly what a rank builds."""
    from dcp_fsdp.models.llama_model_config import param_count

    assert param_count(PRESETS[preset]) == meta_param_count(preset)
