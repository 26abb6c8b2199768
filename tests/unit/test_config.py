"""Configuration: composition, validation, presets, sweeps (no ranks, no S3)."""


import pytest

from dcp_fsdp.config.compose import CONF_DIR, compose, expand_sweeps
from dcp_fsdp.config.schema import Command, Dtype, StorageKind
from dcp_fsdp.config.validate import parse_s3_uri
from dcp_fsdp.errors import UserError
from dcp_fsdp.models.presets import PRESETS


def test_defaults_compose_to_tiny_llama_on_embedded_s3():
    cfg = compose("save", [])
    assert cfg.command == Command.save
    assert cfg.model.preset == "tiny_llama" and cfg.model.dtype == Dtype.fp32
    assert cfg.storage.kind == StorageKind.s3 and cfg.storage.uri is None
    assert cfg.iterations == 1 and cfg.results_dir == "results"


def test_user_facing_setting_names():
    cfg = compose("save-and-load", ["model=L7b", "storage.uri=s3://my-bucket/ckpt",
                                    "storage.region=us-east-2", "storage.endpoint=http://h:9000",
                                    "iterations=5", "suffix=abc", "results_dir=/tmp/x", "nproc=2",
                                    "model.dtype=bf16", "state=model_and_optimizer"])
    assert cfg.command == Command.save_and_load
    assert (cfg.model.preset, cfg.storage.uri, cfg.storage.region) == ("L7b", "s3://my-bucket/ckpt",
                                                                        "us-east-2")
    assert (cfg.iterations, cfg.suffix, cfg.nproc) == (5, "abc", 2)


def test_fs_storage_group():
    cfg = compose("save", ["storage=fs", "storage.path=/tmp/ckpt"])
    assert cfg.storage.kind == StorageKind.fs and cfg.storage.path == "/tmp/ckpt"


def test_every_preset_has_a_config_file_and_back():
    files = {path.stem for path in (CONF_DIR / "model").glob("*.yaml")}
    assert files == set(PRESETS)
    assert {"L7b", "L13b", "L30b", "L65b", "L70b", "GPT-4B"} <= files
    assert [name for name in files if "tiny" in name]


@pytest.mark.parametrize("overrides, message", [
    (["model=L8b"], "model=L8b: unknown preset"),
    (["storage=gcs"], "storage=gcs"),
    (["foo=1"], "foo: unknown setting"),
    (["storage.bucket=x"], "storage.bucket: unknown setting"),
    (["iterations=abc"], "iterations"),
    (["iterations=0"], "iterations=0"),
    (["iterations=-3"], "iterations=-3"),
    (["model.dtype=fp16"], "model.dtype"),
    (["storage.uri=http://bucket/x"], "storage.uri=http://bucket/x: not an S3 URI"),
    (["storage.uri=s3://My_Bucket/x"], "not a valid S3 bucket name"),
    (["storage.uri=s3://ab/x"], "not a valid S3 bucket name"),
    (["storage.uri=s3://bucket/x", "storage.part_size_mib=4"], "storage.part_size_mib=4"),
    (["storage.endpoint=http://127.0.0.1:9000"], "storage.uri is not set"),
    (["storage.uri=s3://bucket/x", "storage.metrics_url=127.0.0.1:9327"],
     "storage.metrics_url=127.0.0.1:9327: write it as http(s)://host:port/metrics"),
    (["storage=fs"], "storage.path is not set"),
    (["nproc=0"], "nproc=0"),
])
def test_bad_settings_fail_with_one_line_naming_the_setting(overrides, message):
    with pytest.raises(UserError) as error:
        compose("save", overrides)
    text = str(error.value)
    assert message in text and "\n" not in text


def test_load_without_suffix_is_refused():
    with pytest.raises(UserError, match="suffix is not set"):
        compose("load", ["storage.uri=s3://bucket/x"])


def test_parse_s3_uri():
    assert parse_s3_uri("s3://bucket/a/b/") == ("bucket", "a/b")
    assert parse_s3_uri("s3://bucket") == ("bucket", "")


def test_multirun_sweeps_expand_like_hydra():
    jobs = expand_sweeps(["model=tiny_llama,tiny_gpt2", "iterations=1,2", "nproc=2"])
    assert len(jobs) == 4
    assert ["model=tiny_gpt2", "iterations=2", "nproc=2"] in jobs


# -- settings that would be ignored (a new user's trial) ------------------------------------

@pytest.mark.parametrize("overrides, fragments", [
    (["+iteration=3"], ["+iteration: unknown setting", "did you mean iterations?"]),
    (["+foo=1"], ["+foo: unknown setting"]),
    (["++foo=1"], ["++foo: unknown setting"]),
    (["~foo"], ["~foo: unknown setting"]),
    (["iteratons=3"], ["iteratons: unknown setting", "did you mean iterations?"]),
    (["uri=s3://bucket/x"], ["uri: unknown setting", "did you mean storage.uri?"]),
    (["storage.paht=/x"], ["storage.paht: unknown setting", "did you mean storage.path?"]),
    (["+iterations=3"], ["+iterations: iterations is a setting already", "iterations=VALUE"]),
    (["~model"], ["~model: model cannot be removed"]),
    (["model@x=L7b"], ["package overrides (@) are not supported"]),
    (["iterations=1,2"], ["iterations=1,2: several values need -m"]),
    (["storage.path=/tmp/ckpt"], ["storage.path is used only with storage=fs", "add storage=fs"]),
    (["storage=fs", "storage.path=/x", "storage.uri=s3://bucket/x"],
     ["storage.uri is used only with storage=s3", "remove storage.uri"]),
    (["storage=fs", "storage.path=/x", "storage.endpoint=http://h:9000"],
     ["storage.endpoint is used only with storage=s3"]),
    (["storage=fs", "storage.path=/x", "storage.part_size_mib=16"],
     ["storage.part_size_mib is used only with storage=s3"]),
    (["storage=fs", "storage.path=/x", "storage.region=us-east-2"],
     ["storage.region is used only with storage=s3"]),
])
def test_settings_that_would_be_ignored_are_refused(overrides, fragments):
    with pytest.raises(UserError) as error:
        compose("save", overrides)
    text = str(error.value)
    assert "\n" not in text
    for fragment in fragments:
        assert fragment in text, text


def test_a_hint_to_quote_leads_to_an_accepted_value(tmp_path):
    """Issue 49: a non-ASCII suffix was told to quote it, then refused for not being ASCII;
    a path holding a comma was told to use -m. Each line now gives the fix that is accepted."""
    import json
    import re

    from dcp_fsdp.models.presets import model_shape

    with pytest.raises(UserError) as refused:
        compose("save", ["suffix=é1"])
    line = str(refused.value)
    assert line.startswith("suffix=é1: start with an ASCII letter") and "quote" not in line
    with pytest.raises(UserError, match="region") as refused:
        compose("save", ["storage.region=é1"])
    assert "quote" not in str(refused.value)

    folder = tmp_path / "a,b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 128,
        "intermediate_size": 128}))
    with pytest.raises(UserError) as refused:
        compose("save", [f"model.config={folder}"])
    line = str(refused.value)
    assert "several values need -m" in line and "\n" not in line
    hint = re.search(r"write it as (model\.config='[^']+')", line)
    assert hint, line
    cfg = compose("save", [hint.group(1)])
    assert cfg.model.config == str(folder) and model_shape(cfg.model).num_layers == 1
    with pytest.raises(UserError) as refused:  # a number is no path: no quoting hint
        compose("save", ["iterations=1,2"])
    assert "quote" not in str(refused.value)


def test_settings_both_storages_use_are_accepted_and_force_add_and_delete_work():
    assert compose("save", ["storage=fs", "storage.path=/x", "storage.thread_count=4"]
                   ).storage.thread_count == 4
    assert compose("save", ["++iterations=3"]).iterations == 3
    assert compose("save", ["iterations=3", "~iterations"]).iterations == 1


def test_every_storage_setting_is_classified_by_the_kind_that_uses_it():
    from dcp_fsdp.config.schema import iter_settings
    from dcp_fsdp.config.validate import FS_ONLY, S3_ONLY

    for name, _, _, text in iter_settings():
        if not name.startswith("storage.") or name in ("storage.kind", "storage.thread_count",
                                                       "storage.read_ahead", "storage.read_ahead_mib"):
            continue
        expected = S3_ONLY if text.startswith("s3:") else FS_ONLY
        assert name in expected and text.startswith(("s3:", "fs:")), name


@pytest.mark.parametrize("overrides, message", [
    (["iterations=1.5"], "iterations: Value '1.5'"),
    (["iterations=99999999999"], "iterations=99999999999: must be 1 or more, at most 1000000"),
    (["verify=maybe"], "give true or false"),
    (["storage.round_robin_prefixes=a"], "give a list"),
    (["results_dir="], "results_dir is empty"),
    (["delay_s=-1"], "delay_s=-1: must be 0 or more"),
    (["delay_s=nan"], "delay_s=nan: give a finite number"),
    (["op_timeout_s=inf"], "op_timeout_s=inf: give a finite number"),
    (["op_timeout_s=0"], "op_timeout_s=0: must be more than 0"),
    (["collective_timeout_s=0"], "collective_timeout_s=0: must be more than 0"),
    (["collective_timeout_s=-5"], "collective_timeout_s=-5"),
    (["collective_timeout_s=1e12"], "collective_timeout_s=1e+12: must be more than 0, at most"),
    (["seed=-1"], "seed=-1: must be 0 or more"),
    (["progress_interval_s=0"], "progress_interval_s=0: must be more than 0"),
    (["progress_interval_s=-1"], "progress_interval_s=-1"),
    (["tune.budget_s=0"], "tune.budget_s=0: must be more than 0"),
    (["tune.budget_s=-60"], "tune.budget_s=-60"),
    (["tune.repeats=0"], "tune.repeats=0: must be 1 or more"),
    (["tune.trials=0"], "tune.trials=0: must be 1 or more"),
    (["train_step_s=-1"], "train_step_s=-1: must be 0 or more"),
    (["train_step_s=0.5"], "train_step_s=0.5: training steps run only while an async save"),
    (["save_mode=async", "async_save.steps_between_saves=10"],
     "async_save.steps_between_saves=10: the steps between saves need a step length; add "
     "train_step_s="),
    (["async_save.steps_between_saves=-1"], "async_save.steps_between_saves=-1: must be 0 or more"),
    (["storage.thread_count=0"], "storage.thread_count=0: must be 1 or more"),
    (["storage.thread_count=100000"], "storage.thread_count=100000: must be 1 or more, at most"),
    (["storage.max_attempts=0"], "storage.max_attempts=0"),
    (["storage.max_attempts=1000000"], "storage.max_attempts=1000000"),
    (["storage.throughput_target_gbps=0"], "storage.throughput_target_gbps=0"),
    (["storage.connect_timeout_s=0"], "storage.connect_timeout_s=0"),
    (["storage.part_size_mib=100000"], "storage.part_size_mib=100000"),
    (["storage.prefix_count=4"], "storage.prefix_count=4 is used only with "
                                 "storage.prefix_strategy=binary or hex"),
    (["storage.prefix_strategy=hex", "storage.prefix_count=0"], "storage.prefix_count=0"),
    (["storage.round_robin_prefixes=[a,b]"], "used only with storage.prefix_strategy=round_robin"),
    (["storage.prefix_strategy=round_robin", "storage.round_robin_prefixes=[a,b/c]"],
     "'b/c' is not a key prefix"),
    (["storage.uri=s3://bucket/x", "storage.region=us east"], "storage.region='us east'"),
    (["storage.uri=s3://bucket/x", "storage.region="], "storage.region=''"),
    (["storage.uri=s3://bucket/x", "storage.endpoint="], "storage.endpoint=: write it as"),
    (["storage.uri="], "storage.uri=: not an S3 URI"),
    (["backend=mpi"], "backend: Invalid value 'mpi'"),
    (["save_mode=later"], "save_mode"),
    (["state=full"], "state: Invalid value 'full', expected one of [model, model_and_optimizer]"),
])
def test_wrong_values_fail_with_one_line_naming_the_setting(overrides, message):
    with pytest.raises(UserError) as error:
        compose("save", overrides)
    text = str(error.value)
    assert message in text and "\n" not in text, text


def test_async_save_options_with_sync_saves_are_fine():
    cfg = compose("save", ["async_save.checkpointer=process", "async_save.pinned_memory=false"])
    assert cfg.async_save.pinned_memory is False
    assert compose("save", ["save_mode=async", "train_step_s=0.5"]).train_step_s == 0.5


def test_protocol_mlperf_fixes_ten_iterations():
    """MLPerf Storage v3.0: 10 saves, then 10 loads of the last (rank/loop.py); iterations=10
    given as well is the same run, any other count is refused (tests/integration/test_mlperf.py)."""
    from dcp_fsdp.config.schema import Protocol

    assert compose("save-and-load", []).protocol == Protocol.default
    for given in ([], ["iterations=10"]):
        cfg = compose("save-and-load", ["protocol=mlperf", *given])
        assert cfg.protocol == Protocol.mlperf and cfg.iterations == 10
    with pytest.raises(UserError, match=r"^iterations=1: protocol=mlperf fixes 10 saves"):
        compose("save-and-load", ["protocol=mlperf", "iterations=1"])
    with pytest.raises(UserError, match=r"^protocol=mlperf: .* \(not load\)"):
        compose("load", ["protocol=mlperf", "suffix=s"])


def test_protocol_mlperf_refuses_verify_false():
    """Issue 49: docs/mlperf.md promises every load of the protocol verified bit for bit;
    verify=false dropped that without a word. It is refused in one line naming the fix."""
    compose("save-and-load", ["verify=false"])  # the default protocol may skip it
    with pytest.raises(UserError) as refused:
        compose("save-and-load", ["protocol=mlperf", "verify=false"])
    line = str(refused.value)
    assert line.startswith("verify=false: protocol=mlperf verifies every load") and "\n" not in line
    assert "drop verify=false, or drop protocol=mlperf" in line
