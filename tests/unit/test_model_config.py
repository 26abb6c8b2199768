"""model.config=PATH and model.moe_layout: what is refused, in one line naming the setting
and the fix, before any rank starts; and plan's view of both expert layouts."""

import json
from pathlib import Path

import pytest

from dcp_fsdp.config.compose import compose
from dcp_fsdp.errors import UserError
from dcp_fsdp.launch import checks

HF_CONFIGS = Path(__file__).resolve().parents[1] / "data" / "hf_configs"
QWEN3 = json.loads((HF_CONFIGS / "qwen3_tied.json").read_text())


def refusal(tmp_path, text: str) -> str:
    """The launcher's line for a config.json holding `text`."""
    path = tmp_path / "config.json"
    path.write_text(text)
    cfg = compose("save", [f"model.config={path}", f"results_dir={tmp_path}"])
    with pytest.raises(UserError) as caught:
        checks.check_model(cfg)
    line = str(caught.value)
    assert "\n" not in line and line.startswith(f"model.config={path}: ")
    return line


@pytest.mark.parametrize("text, expected", [
    ("{not json", "not JSON (Expecting property name enclosed in double quotes at line 1 column 2)"),
    ("[1, 2]", "not a JSON object"),
    (json.dumps({"model_type": "bert", "hidden_size": 768}),
     'has model_type "bert"; this tool builds the families llama, mistral, qwen2, qwen3, '
     "qwen3_moe, mixtral, gpt2"),
    (json.dumps({"hidden_size": 768}), "has no 'model_type' field"),
    (json.dumps({k: v for k, v in QWEN3.items() if k != "num_key_value_heads"}),
     "no 'num_key_value_heads' field; a qwen3 config.json needs hidden_size, num_hidden_layers, "
     "num_attention_heads, num_key_value_heads, vocab_size, intermediate_size"),
    (json.dumps({**QWEN3, "model_type": "qwen3_moe"}), "no 'num_experts' field"),
    (json.dumps({**QWEN3, "vocab_size": None}), "'vocab_size' is null; a qwen3 config.json needs "),
    (json.dumps({**QWEN3, "hidden_size": "256"}), "'hidden_size' is \"256\"; it must be a whole number"),
    (json.dumps({**QWEN3, "num_hidden_layers": 0}), "'num_hidden_layers' is 0; it must be a whole "
                                                    "number, 1 or more"),
    (json.dumps({**QWEN3, "tie_word_embeddings": "yes"}), "'tie_word_embeddings' is \"yes\"; it must "
                                                          "be true or false"),
])
def test_a_bad_config_json_is_refused_in_one_line_naming_it(tmp_path, text, expected):
    assert expected in refusal(tmp_path, text)


LLAMA = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 1000,
         "intermediate_size": 512}


@pytest.mark.parametrize("change, expected", [
    ({"hidden_size": 250}, "'hidden_size' 250 is not a multiple of 'num_attention_heads' 8, "
                           "which transformers' LlamaConfig refuses"),
    ({"hidden_size": 250, "model_type": "mistral"},
     "the head width ('hidden_size' 250 / 'num_attention_heads' 8) is 31, odd"),
    ({"head_dim": 33}, "the head width ('head_dim') is 33, odd"),
    ({"num_key_value_heads": 3}, "'num_key_value_heads' 3 does not divide 'num_attention_heads' 8"),
    ({"num_key_value_heads": 16}, "'num_key_value_heads' 16 does not divide 'num_attention_heads' 8"),
    ({"rope_scaling": {"rope_type": "bogus", "factor": 2.0}},
     "'rope_scaling' has rope_type \"bogus\", which transformers does not build; use one of "
     "default, linear"),
    ({"rope_parameters": {"type": "bogus"}}, "'rope_parameters' has rope_type \"bogus\""),
    ({"rope_scaling": "linear"}, "'rope_scaling' is \"linear\"; it must be an object"),
])
def test_a_config_transformers_refuses_is_refused_naming_the_field(tmp_path, change, expected):
    """Issue 49 item 2: built and benchmarked before, though transformers builds none of them."""
    assert expected in refusal(tmp_path, json.dumps({**LLAMA, **change}))


@pytest.mark.parametrize("change", [{"num_key_value_heads": 2}, {"head_dim": 4},
                                    {"rope_scaling": {"type": "linear", "factor": 2.0}},
                                    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
                                    {"rope_scaling": None}])
def test_a_config_transformers_builds_is_taken(tmp_path, change):
    from dcp_fsdp.models.hf_json import read_config_json

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA, **change}))
    assert read_config_json(str(path)).num_layers == 2


def test_the_rope_types_are_those_transformers_builds():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from dcp_fsdp.models.hf_json import ROPE_TYPES

    assert set(ROPE_TYPES) == {"default", *ROPE_INIT_FUNCTIONS}


def test_a_folder_without_a_config_json_says_so(tmp_path):
    cfg = compose("save", [f"model.config={tmp_path}", f"results_dir={tmp_path}"])
    with pytest.raises(UserError, match=r": a folder without a config.json; give the folder of a "
                                        r"downloaded model \(it holds config.json\) or the file's own path$"):
        checks.check_model(cfg)


def test_a_missing_file_is_refused_and_never_downloaded(tmp_path):
    cfg = compose("save", ["model.config=Qwen/Qwen3-8B", f"results_dir={tmp_path}"])
    with pytest.raises(UserError, match=r"^model.config=Qwen/Qwen3-8B: no such file; give the path "
                                        r"of a local Hugging Face config.json \(it is never downloaded\)$"):
        checks.check_model(cfg)


def test_a_folder_holding_config_json_is_taken(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3))
    from dcp_fsdp.models.presets import model_shape

    cfg = compose("save", [f"model.config={tmp_path}", f"results_dir={tmp_path}"])
    assert model_shape(cfg.model).head_dim == 48 and cfg.model.name == f"config:{tmp_path}"


def test_the_grouped_layout_of_a_model_without_experts_is_refused(tmp_path):
    cfg = compose("save", ["model=llama3_8b", "model.moe_layout=grouped", f"results_dir={tmp_path}"])
    with pytest.raises(UserError, match=r"^model.moe_layout=grouped: model=llama3_8b has no experts "
                                        r".*; leave model.moe_layout at hf$"):
        checks.check_model(cfg)


def test_the_memory_check_sizes_a_config_json_model(tmp_path):
    """The light parent's estimate (no torch) is the file's parameter count x dtype bytes."""
    from dcp_fsdp.models.llama_model_config import param_count
    from dcp_fsdp.models.presets import model_shape

    cfg = compose("save", [f"model.config={HF_CONFIGS / 'mixtral_4x.json'}", "model.dtype=bf16",
                           f"results_dir={tmp_path}"])
    assert checks.state_bytes_estimate(cfg) == 2 * param_count(model_shape(cfg.model)) == 2 * 9_050_368


def test_plan_shows_both_expert_layouts(capsys, monkeypatch):
    """`dcp-fsdp plan` of an MoE model: tensors, .metadata and planning of each layout (the
    unpickling child, a torch import per plan, is tests/integration/test_plan.py's)."""
    from dcp_fsdp.plan import build
    from dcp_fsdp.cli import main

    monkeypatch.setattr(build, "unpickle_cost", lambda blob: (0.0, len(blob)))

    assert main(["plan", f"model.config={HF_CONFIGS / 'mixtral_4x.json'}", "--world-size=4",
                 "storage=fs", "storage.path=/tmp/unused"]) == 0
    out = capsys.readouterr().out
    assert "model: 9,050,368 parameters (mixtral, 4 experts per sparse layer, moe_layout hf)" in out
    hf = next(line for line in out.splitlines() if line.startswith("  hf (this plan): "))
    grouped = next(line for line in out.splitlines() if line.startswith("  grouped: "))
    # 4 layers: hf 2 expert tensors + a router each, grouped 3 + a router
    base = 1 + 4 * 6 + 1 + 1  # embedding, q/k/v/o + 2 norms per layer, final norm, lm_head
    assert hf.startswith(f"  hf (this plan): {base + 4 * 3} tensors, ")
    assert grouped.startswith(f"  grouped: {base + 4 * 4} tensors, ")
    assert ".metadata" in grouped and "global planning" in grouped


@pytest.mark.parametrize("preset", ["model=qwen3_8b", "model.preset=qwen3_8b"])
def test_a_preset_beside_a_config_json_is_refused(tmp_path, preset):
    """Both name the model: one would be ignored."""
    with pytest.raises(UserError, match=r"^model=qwen3_8b and model.config=.*qwen3_tied.json both "
                                        r"name the model: give one of them$"):
        compose("save", [preset, f"model.config={HF_CONFIGS / 'qwen3_tied.json'}",
                         f"results_dir={tmp_path}"])


def test_a_load_of_another_model_names_the_settings_it_was_saved_with(tmp_path):
    """The rank's line for a checkpoint whose tensors differ: a config.json model is the
    setting model.config=PATH, the default layout is not named."""
    from dcp_fsdp.rank.state import mismatch_error

    path = HF_CONFIGS / "mixtral_4x.json"
    cfg = compose("load", [f"model.config={path}", "model.moe_layout=grouped", "model.dtype=fp32",
                           "suffix=s1", f"results_dir={tmp_path}"])
    manifest = {"model": f"config:{path}", "model.moe_layout": "hf", "model.dtype": "fp32",
                "state": "model"}
    line = str(mismatch_error("s1", cfg, "it has no tensor 'x'", manifest))
    assert line == (f"suffix=s1: checkpoint does not match model.config={path} "
                    "model.moe_layout=grouped model.dtype=fp32 state=model (it has no tensor 'x'); "
                    f"load it with model.config={path} model.dtype=fp32 state=model")


def _llama_json(path: Path, vocab_size: int) -> Path:
    path.write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": vocab_size,
        "intermediate_size": 128}))
    return path


def test_a_vocabulary_changed_since_the_save_is_not_told_to_load_with_what_was_typed(tmp_path):
    """Issue 49: after a config.json's vocabulary changed, the line said 'load it with
    model.config=mut', the very settings given. Before any rank (a manifest without
    model.shape) and in the rank's own comparison, the fix is the file as it was."""
    from dcp_fsdp.launch.preflight import _check_same_shape
    from dcp_fsdp.models.hf_json import read_config_json
    from dcp_fsdp.models.llama_model_config import state_shapes
    from dcp_fsdp.models.presets import model_shape
    from dcp_fsdp.rank.state import mismatch_error
    from dcp_fsdp.storage.metadata_peek import TensorEntry

    path = _llama_json(tmp_path / "config.json", 1000)
    cfg = compose("load", [f"model.config={path}", "suffix=s1", f"results_dir={tmp_path}"])
    saved = {f"model.{name}": TensorEntry(dims, "float32")
             for name, dims in state_shapes(model_shape(cfg.model))}
    manifest = {"model": f"config:{path}", "model.moe_layout": "hf", "model.dtype": "fp32",
                "state": "model"}  # saved before manifests held model.shape
    assert _check_same_shape("s1", cfg, manifest, saved) is False  # the same file: loads
    _llama_json(path, 1200)
    read_config_json.cache_clear()
    with pytest.raises(UserError) as refused:
        _check_same_shape("s1", cfg, manifest, saved)
    line = str(refused.value)
    assert "[1000, 64] there but [1200, 64] here" in line and "load it with" not in line
    assert "restore the file as it was at the save" in line and "\n" not in line

    line = str(mismatch_error("s1", cfg, "'model.model.embed_tokens.weight' differs", manifest))
    assert "load it with" not in line and "restore the file as it was at the save" in line


@pytest.mark.parametrize("fields, given, dtype, origin", [
    ({"torch_dtype": "bfloat16"}, [], "bf16", ("config.json", "the config.json's torch_dtype bfloat16")),
    ({"dtype": "bfloat16"}, [], "bf16", ("config.json", "the config.json's dtype bfloat16")),
    ({"dtype": "float32", "torch_dtype": "bfloat16"}, [], "fp32",
     ("config.json", "the config.json's dtype float32")),  # transformers 4.56+ writes dtype
    ({"torch_dtype": "float16"}, [], "bf16",
     ("config.json", "the config.json's torch_dtype float16, as many bytes")),
    ({"torch_dtype": "bfloat16"}, ["model.dtype=fp32"], "fp32",
     ("model.dtype", "model.dtype given; the config.json's torch_dtype is bfloat16")),
    ({"torch_dtype": "float64"}, ["model.dtype=bf16"], "bf16",
     ("model.dtype", "model.dtype given; the config.json's torch_dtype is float64")),
    ({}, [], "fp32", ("model.dtype", "the config.json names no dtype: model.dtype's")),
])
def test_a_config_json_model_is_built_in_the_files_dtype_unless_given(tmp_path, fields, given,
                                                                      dtype, origin):
    """Issue 49: a config.json saying bfloat16 ran in fp32 without a word (Llama-3.1-8B: 29.9
    GiB, not 15.0). The file's dtype is used unless model.dtype is given, and said."""
    from dcp_fsdp.config.validate import dtype_origin

    path = _llama_json(tmp_path / "config.json", 1000)
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    cfg = compose("save", [f"model.config={tmp_path}", *given, f"results_dir={tmp_path}"])
    assert cfg.model.dtype.value == dtype
    assert dtype_origin(cfg.model) == origin


def test_a_config_json_dtype_the_tool_does_not_build_is_refused_naming_the_fix(tmp_path):
    path = _llama_json(tmp_path / "config.json", 1000)
    path.write_text(json.dumps({**json.loads(path.read_text()), "torch_dtype": "float64"}))
    with pytest.raises(UserError) as refused:
        compose("save", [f"model.config={path}", f"results_dir={tmp_path}"])
    assert str(refused.value) == (
        f"model.config={path}: 'torch_dtype' is 'float64', which this tool does not build "
        "(float32, bfloat16, float16 as bfloat16); give model.dtype=fp32 or model.dtype=bf16")


def test_presets_keep_their_dtype():
    from dcp_fsdp.config.validate import dtype_origin

    for preset, dtype in (("llama3_8b", "bf16"), ("L7b", "fp32"), ("mlperf_llama3_8b", "bf16"),
                          ("tiny_llama", "fp32")):
        cfg = compose("save", [f"model={preset}"])
        assert cfg.model.dtype.value == dtype and dtype_origin(cfg.model) == ("model.dtype", "")


def test_plan_says_the_dtype_used_and_what_tied_embeddings_add(capsys, monkeypatch):
    """Issue 49: `plan` names where the dtype came from, and that tied embeddings are saved
    twice (DCP writes lm_head and the embedding apart: the state is more than parameters x
    dtype by vocab x hidden x dtype)."""
    from dcp_fsdp.cli import main
    from dcp_fsdp.models.presets import PRESETS, tied_extra_bytes
    from dcp_fsdp.plan import build

    monkeypatch.setattr(build, "unpickle_cost", lambda blob: (0.0, len(blob)))
    assert main(["plan", f"model.config={HF_CONFIGS / 'qwen3_tied.json'}", "--world-size=2",
                 "storage=fs", "storage.path=/tmp/unused"]) == 0
    out = capsys.readouterr().out
    head, model, state = out.splitlines()[:3]
    assert " bf16 (the config.json's torch_dtype bfloat16) model, 2 rank(s)" in head
    extra = 4096 * 256 * 2  # vocab x hidden x bf16
    assert model.endswith(f"of bf16 weights; tied embeddings: saved twice, +{extra / 2**20:.1f} "
                          "MiB (in the state below)"), model
    params = 2 * int(model.split(" parameters")[0].removeprefix("model: ").replace(",", ""))
    assert state.startswith(f"state: {(params + extra) / 2**20:.1f} MiB in "), state
    assert tied_extra_bytes(PRESETS["GPT-4B"], "bf16") == 5_552_558_080 - 5_295_242_240  # measured
    assert tied_extra_bytes(PRESETS["llama3_8b"], "bf16") == 0
