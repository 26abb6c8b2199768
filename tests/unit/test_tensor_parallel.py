"""model.tp without ranks: the layouts refused (one line each), which tensors TP splits, the
memory a rank holds, and `plan`'s blocks tiling every tensor exactly once (the measured
comparison with a real tp=2 x dp=2 save: tests/integration/test_tensor_parallel.py)."""

from __future__ import annotations

import math
import re

import pytest

from dcp_fsdp.config.schema import CheckpointState, Dtype
from dcp_fsdp.errors import UserError
from dcp_fsdp.models.llama_model_config import llama
from dcp_fsdp.models.presets import PRESETS
from dcp_fsdp.models.tensor_parallel import check_tp, tp_split_dim
from dcp_fsdp.plan.state import local_plan, state_template


@pytest.mark.parametrize("shape, tp, replicas, world, fragments", [
    (PRESETS["tiny_llama"], 2, 1, 3, ["model.tp=2", "nproc=3 is not a multiple of 2", "nproc=4",
                                      "or model.tp=1"]),
    (PRESETS["tiny_llama"], 2, 2, 6, ["not a multiple of 4 (model.tp x model.replicas=2)",
                                      "nproc=8"]),
    (PRESETS["tiny_llama"], 8, 1, 8, ["4 attention heads", "model.tp one of 1, 2, 4"]),
    (llama(256, 688, 2, 8, 2), 4, 1, 8, ["2 KV heads", "model.tp one of 1, 2"]),
    (llama(256, 690, 2, 4, 4), 4, 1, 8, ["690 intermediate size", "model.tp one of 1, 2 ("]),
    (PRESETS["tiny_gpt2"], 2, 1, 2, ["not gpt2"]),
])
def test_layouts_that_do_not_split_are_refused(shape, tp, replicas, world, fragments):
    with pytest.raises(UserError) as refused:
        check_tp(shape, tp, replicas, world, "nproc")
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"model.tp={tp}:")
    for fragment in fragments:
        assert fragment in line, line


@pytest.mark.parametrize("shape, tp, world", [
    (llama(384, 1536, 2, 6, 2), 4, 12),  # "1, 2, 3, 6": 3 splits the 6 heads, not 2 KV heads
    (llama(256, 688, 2, 8, 2), 4, 8),
    (llama(256, 690, 2, 4, 4), 4, 8),  # 3, 5, 6 split the width, not the 4 heads
    (PRESETS["tiny_llama"], 3, 2),  # the model first: nproc=3 would be refused for tp=3
    (PRESETS["tiny_llama"], 2, 3),
    (PRESETS["llama3_8b"], 3, 8),
])
def test_every_tp_and_nproc_a_refusal_names_is_accepted(shape, tp, world):
    """Issue 49: 'use model.tp one of 1, 2, 3' where 3 was refused for the KV heads, and
    'use nproc=3' where tp=3 was refused for the heads: a hint leads to no second refusal."""
    with pytest.raises(UserError) as refused:
        check_tp(shape, tp, 1, world, "nproc")
    line = str(refused.value)
    choices = re.search(r"model\.tp one of ([\d, ]+)", line) or re.search(r"model\.tp=(1)$", line)
    assert choices, line
    for other in map(int, choices.group(1).split(", ")):
        check_tp(shape, other, 1, world, "nproc")
    multiple = re.search(r"use nproc=(\d+)", line)
    if multiple:  # the model splits at this tp: only the world was short
        check_tp(shape, tp, 1, int(multiple.group(1)), "nproc")


def test_even_layouts_pass():
    check_tp(PRESETS["tiny_llama"], 2, 2, 8, "nproc")
    check_tp(PRESETS["llama3_8b"], 8, 1, 1024, "world_size")
    check_tp(PRESETS["tiny_gpt2"], 1, 1, 3, "nproc")  # tp=1: any model, any world
    check_tp(PRESETS["qwen3_30b_a3b"], 4, 1, 8, "nproc")  # attention only: experts stay FSDP


def test_the_projections_are_split_as_torchtitans_llama_plan():
    assert tp_split_dim("model.model.layers.3.self_attn.k_proj.weight") == 0
    assert tp_split_dim("model.model.layers.3.self_attn.q_proj.bias") == 0
    assert tp_split_dim("optim.state.model.layers.3.mlp.gate_proj.weight.exp_avg") == 0
    assert tp_split_dim("model.model.layers.3.mlp.down_proj.weight") == 1
    assert tp_split_dim("optim.state.model.layers.3.self_attn.o_proj.weight.exp_avg_sq") == 1
    for whole in ("model.model.layers.3.self_attn.o_proj.bias", "model.lm_head.weight",
                  "model.model.embed_tokens.weight", "model.model.layers.3.input_layernorm.weight",
                  "model.model.layers.3.self_attn.q_norm.weight",
                  "model.model.layers.3.mlp.experts.down_proj", "model.model.layers.3.mlp.gate.weight"):
        assert tp_split_dim(whole) is None, whole


@pytest.mark.parametrize("world, replicas, tp", [(4, 1, 2), (6, 1, 2), (8, 2, 2), (4, 1, 4)])
def test_plan_blocks_tile_every_tensor_once_per_replica(world, replicas, tp):
    """Over the world every element of every tensor is in replicas x (tp for a tensor TP
    leaves whole, else 1) blocks: DCP's coordinator keeps one of the identical ones."""
    template = state_template("tiny_llama", Dtype.fp32, CheckpointState.model_and_optimizer)
    held: dict[str, int] = {}
    for rank in range(world):
        for item in local_plan(template, rank, world, replicas, tp).items:
            if item.tensor_data is not None and len(item.tensor_data.size) > 0:
                chunk = item.tensor_data.chunk
                assert all(o + s <= n for o, s, n in zip(chunk.offsets, chunk.sizes,
                                                         item.tensor_data.size))
                held[item.index.fqn] = held.get(item.index.fqn, 0) + math.prod(chunk.sizes)
    for entry in template.entries:
        if entry.sharded and entry.shape is not None:
            copies = replicas * (tp if tp_split_dim(entry.fqn) is None else 1)
            assert held[entry.fqn] == copies * math.prod(entry.shape), entry.fqn
