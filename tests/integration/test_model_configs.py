"""model.config=PATH end to end: a small Qwen3-style config.json (tied embeddings, head_dim
not hidden / heads) and a small Mixtral-style one (4 experts) saved and loaded by 2 real
ranks, every load verified, and the checkpoint's tensors those of transformers' own model for
the same file; a released preset this machine cannot hold is refused in seconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.kit.cli import read_run, run_cli

HF_CONFIGS = Path(__file__).resolve().parents[1] / "data" / "hf_configs"


def transformers_state(name: str) -> dict[str, tuple[int, ...]]:
    """{DCP key: shape} of the model transformers builds from the file (state dict keys,
    tied ones included, as DCP's get_model_state_dict gives them)."""
    from transformers import CONFIG_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING

    data = json.loads((HF_CONFIGS / name).read_text())
    config = CONFIG_MAPPING[data["model_type"]].from_dict(data)
    with torch.device("meta"):
        model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config)
    return {f"model.{key}": tuple(tensor.shape) for key, tensor in model.state_dict().items()}


def checkpoint_state(path: Path) -> dict[str, tuple[int, ...]]:
    """{key: global shape} of every tensor a checkpoint's .metadata holds."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(path)).read_metadata()
    return {key: tuple(entry.size) for key, entry in metadata.state_dict_metadata.items()
            if hasattr(entry, "size")}


def assert_every_load_verified(run: dict) -> None:
    assert run["status"] == "ok", run["error"]
    assert run["integrity"] and all(entry["checked"] for entry in run["integrity"].values())


@pytest.mark.parametrize("name, layout, family", [
    ("qwen3_tied.json", "hf", "qwen3"),
    ("mixtral_4x.json", "hf", "mixtral"),
])
def test_a_config_json_saves_and_loads_on_two_ranks_as_transformers_state(tmp_path, name,
                                                                          layout, family):
    config = HF_CONFIGS / name
    result = run_cli(["save-and-load", f"model.config={config}", f"model.moe_layout={layout}",
                      "nproc=2", "storage=fs", f"storage.path={tmp_path / 'ckpt'}",
                      f"results_dir={tmp_path / 'results'}"])
    assert result.returncode == 0, result.stderr
    run, _ = read_run(tmp_path / "results")
    assert_every_load_verified(run)
    assert run["model"]["family"] == family and run["model"]["config"] == str(config)
    assert f"model=config:{config} " in result.stderr + result.stdout
    # the file's torch_dtype (bfloat16), said (issue 49)
    assert (f"({run['model']['param_count']:,} params, bf16 (the config.json's torch_dtype "
            "bfloat16), ") in result.stderr + result.stdout
    assert run["model"]["dtype"] == "bf16" and run["model"]["dtype_from"] == "config.json"
    (suffix,) = run["suffixes"]
    assert checkpoint_state(tmp_path / "ckpt" / suffix) == transformers_state(name)
    if family == "mixtral":  # the other layout's load is refused by the launcher, with the fix
        load = run_cli(["load", f"model.config={config}", "model.moe_layout=grouped",
                        f"suffix={suffix}", "nproc=1", "storage=fs",
                        f"storage.path={tmp_path / 'ckpt'}", f"results_dir={tmp_path / 'loads'}"])
        assert load.returncode != 0 and "Traceback" not in load.stderr
        assert load.stderr.strip().splitlines()[-1] == (
            f"dcp-fsdp: error: suffix={suffix}: checkpoint was saved with model.config={config} "
            f"model.dtype=bf16 state=model, not model.moe_layout=grouped; load it with "
            f"model.config={config} model.dtype=bf16 state=model")


def test_the_grouped_layout_saves_and_loads_on_the_embedded_s3(tmp_path):
    """No storage settings: the embedded SeaweedFS; torchtitan's w1/w2/w3 per layer."""
    result = run_cli(["save-and-load", f"model.config={HF_CONFIGS / 'mixtral_4x.json'}",
                      "model.moe_layout=grouped", "nproc=2", f"results_dir={tmp_path}"])
    assert result.returncode == 0, result.stderr
    run, _ = read_run(tmp_path)
    assert_every_load_verified(run)
    assert run["storage"]["embedded"] and run["model"]["moe_layout"] == "grouped"
    assert run["model"]["param_count"] == 9_050_368


def test_a_released_model_this_machine_cannot_hold_is_refused_in_seconds(tmp_path):
    """llama3_405b in bf16 is 756 GiB: one line from the light parent's arithmetic (no
    torch, no build), as L70b is."""
    result = run_cli(["save", "model=llama3_405b", "nproc=1", "storage=fs",
                      f"storage.path={tmp_path / 'c'}", f"results_dir={tmp_path / 'r'}"])
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("dcp-fsdp: error:")]
    assert len(errors) == 1 and "model=llama3_405b model.dtype=bf16" in errors[0], result.stderr
    assert "756.0 GiB of state" in errors[0] and "Traceback" not in result.stderr
    assert result.elapsed_s < 15, f"took {result.elapsed_s:.1f} s"
    assert not (tmp_path / "c").exists()


def test_a_config_json_is_identified_by_its_content_not_its_path(tmp_path):
    """Issue 49 item 1: a load against a config.json edited since the save (2 layers, then 1)
    is refused in one line before any rank (it loaded part of the checkpoint and reported a
    load); an identical copy elsewhere, or the same file by a relative path, loads it."""
    model = tmp_path / "mut"
    model.mkdir()
    data = json.loads((HF_CONFIGS / "qwen3_tied.json").read_text())
    (model / "config.json").write_text(json.dumps({**data, "num_hidden_layers": 2}))
    store = ["storage=fs", f"storage.path={tmp_path / 'ckpt'}"]
    save = run_cli(["save", f"model.config={model}", "nproc=1", "suffix=s1", *store,
                    f"results_dir={tmp_path / 'saves'}"])
    assert save.returncode == 0, save.stderr
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "config.json").write_text((model / "config.json").read_text())

    for n, (config, cwd) in enumerate([(str(copy / "config.json"), tmp_path),
                                       ("mut", tmp_path)]):
        load = run_cli(["load", f"model.config={config}", "nproc=1", "suffix=s1", *store,
                        f"results_dir={tmp_path / f'loads{n}'}"], cwd=cwd)
        assert load.returncode == 0, load.stderr
        run, _ = read_run(tmp_path / f"loads{n}")
        assert_every_load_verified(run)

    (model / "config.json").write_text(json.dumps({**data, "num_hidden_layers": 1}))
    edited = run_cli(["load", f"model.config={model}", "nproc=1", "suffix=s1", *store,
                      f"results_dir={tmp_path / 'edited'}"])
    assert edited.returncode == 2 and "Traceback" not in edited.stderr, edited.stderr
    errors = [line for line in edited.stderr.splitlines() if line.startswith("dcp-fsdp: error:")]
    assert errors == [edited.stderr.strip().splitlines()[-1]] and errors[0].startswith(
        f"dcp-fsdp: error: suffix=s1: checkpoint was saved from another model than "
        f"model.config={model} describes now (was the file edited since the save?): its "
        "tensors differ ("), edited.stderr
    assert not list((tmp_path / "edited").glob("**/*.jsonl"))  # no rank ran, nothing recorded

    # a checkpoint saved before the manifest named the shape: its tensors decide, still
    # before any rank
    manifest_path = tmp_path / "ckpt" / "s1" / "dcp_fsdp.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["model.shape"]
    manifest_path.write_text(json.dumps(manifest))
    older = run_cli(["load", f"model.config={model}", "nproc=1", "suffix=s1", *store,
                     f"results_dir={tmp_path / 'older'}"])
    assert older.returncode == 2 and "Traceback" not in older.stderr, older.stderr
    assert "which this model has not" in older.stderr.strip().splitlines()[-1], older.stderr
    assert not list((tmp_path / "older").glob("**/*.jsonl"))
