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
