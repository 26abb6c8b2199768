"""Machine and environment checks of the launcher (launch/checks.py), the record's fallback
location, and the CLI's help, version and argument handling: no ranks, no server."""

from __future__ import annotations

import json
import tempfile

import pytest

from dcp_fsdp import cli
from dcp_fsdp.config.compose import compose
from dcp_fsdp.config.schema import Backend, iter_settings
from dcp_fsdp.config.usage import settings_rows
from dcp_fsdp.errors import UserError
from dcp_fsdp.launch import checks


@pytest.fixture
def fallback_tmp(tmp_path, monkeypatch):
    """$TMPDIR for this test: the fallback record location lies under it."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    return tmp_path / "tmp" / "dcp-fsdp-results"


# -- results_dir ---------------------------------------------------------------------------

def test_results_dir_that_is_a_file_or_under_a_file_is_refused(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for path, words in ((blocker, "it is a file"), (blocker / "sub" / "dir", "a-file is a file")):
        with pytest.raises(UserError) as error:
            checks.check_results_dir(str(path))
        assert f"results_dir={path}" in str(error.value) and words in str(error.value)
        assert "choose a directory you can write to" in str(error.value)


def test_results_dir_that_can_be_made_passes_and_is_not_created(tmp_path):
    checks.check_results_dir(str(tmp_path / "new" / "results"))
    assert not (tmp_path / "new").exists()
    assert list(tmp_path.iterdir()) == []  # the probe file is gone


def test_rank_record_falls_back_when_results_dir_cannot_be_written(tmp_path, fallback_tmp,
                                                                   capsys):
    from dcp_fsdp.rank.session import RankSession

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    cfg = compose("save", [f"results_dir={blocker / 'results'}"])
    session = RankSession(cfg, 0.0)
    session.run.run_id = "20260101-000000-save-abcdef"
    path = session.write_record("ok", None, [], [session.init])
    assert path.parent == fallback_tmp and path.exists()
    assert json.loads(path.read_text().splitlines()[0])["run_id"] == session.run.run_id
    warning = capsys.readouterr().err
    assert f"results_dir={blocker / 'results'}" in warning and str(path) in warning


def test_launcher_failure_record_falls_back_too(tmp_path, fallback_tmp):
    from dcp_fsdp.launch import aftermath
    from dcp_fsdp.launch.aftermath import RanksOutcome

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    cfg = compose("save", [f"results_dir={blocker}"])
    aftermath.settle(cfg, "20260101-000000-save-fedcba",
                     RanksOutcome(1, "failed", "rank 0 was killed by SIGKILL"))
    assert checks.record_written(cfg.results_dir, "20260101-000000-save-fedcba")
    assert (fallback_tmp / "20260101-000000-save-fedcba.jsonl").exists()


# -- the model ------------------------------------------------------------------------------

def test_a_preset_with_no_shape_is_refused_before_anything_starts(tmp_path):
    """The settings layer knows the conf/model files; the launch knows the shapes
    (models/llama_model_config.py): a preset no shape has is refused by both launch paths."""
    with pytest.raises(UserError, match="model=L8b: unknown preset; choose one of GPT-4B"):
        compose("save", ["model.preset=L8b", f"results_dir={tmp_path}"])
    cfg = compose("save", [f"results_dir={tmp_path}"])
    cfg.model.preset = "mine"  # what a conf/model/mine.yaml naming no shape would give
    with pytest.raises(UserError, match="model.preset=mine: no such model shape; choose one "
                                        "of L7b, .*llama_model_config"):
        checks.check_launch(cfg)
    with pytest.raises(UserError, match="model.preset=mine"):
        checks.check_model(cfg)


# -- cores and devices ---------------------------------------------------------------------

def test_nproc_beyond_the_cores_is_refused():
    limit = checks.usable_cores() * checks.RANKS_PER_CORE
    checks.check_nproc(limit)
    with pytest.raises(UserError, match=f"nproc={limit + 1}: this machine has"):
        checks.check_nproc(limit + 1)


def _never_called():
    raise AssertionError("gloo needs no device count")


@pytest.mark.parametrize("backend, ranks, devices, message", [
    (Backend.gloo, 64, _never_called, None),
    (Backend.auto, 4, lambda: 0, None),  # auto without CUDA: gloo
    (Backend.auto, 2, lambda: 2, None),
    (Backend.nccl, 1, lambda: 0, "backend=nccl needs CUDA devices, and none is visible"),
    (Backend.nccl, 2, lambda: 1, "nproc=2: only 1 CUDA device(s) visible here and backend=nccl"),
    (Backend.auto, 8, lambda: 4, "nproc=8: only 4 CUDA device(s) visible here and backend=auto"),
])
def test_devices_for_the_backend(backend, ranks, devices, message):
    if message is None:
        checks.check_devices(backend, ranks, devices)
        return
    with pytest.raises(UserError) as error:
        checks.check_devices(backend, ranks, devices)
    assert message in str(error.value)


def test_the_device_count_of_this_machine_matches_torch():
    import torch

    checks.cuda_device_count.cache_clear()
    assert checks.cuda_device_count() == torch.cuda.device_count()


# -- environment variables -----------------------------------------------------------------

@pytest.mark.parametrize("env, overrides, message", [
    ({"OMP_NUM_THREADS": "abc"}, [], "OMP_NUM_THREADS='abc': must be a positive whole number"),
    ({"OMP_NUM_THREADS": "0"}, [], "OMP_NUM_THREADS='0'"),
    ({"OMP_NUM_THREADS": "-2"}, [], "OMP_NUM_THREADS='-2'"),
    ({"AWS_ENDPOINT_URL": "localhost:9000"}, ["storage.uri=s3://bucket/x"],
     "AWS_ENDPOINT_URL=localhost:9000: write it as http(s)://host:port"),
    ({"AWS_ENDPOINT_URL_S3": "nonsense"}, ["storage.uri=s3://bucket/x"], "AWS_ENDPOINT_URL_S3="),
    ({"AWS_ENDPOINT_URL": "http://127.0.0.1:9000"}, [],
     "storage.uri is not set but AWS_ENDPOINT_URL is"),
    ({"AWS_REGION": "us east 1"}, ["storage.uri=s3://bucket/x"], "AWS_REGION='us east 1'"),
    ({"AWS_DEFAULT_REGION": ""}, ["storage.uri=s3://bucket/x"], "AWS_DEFAULT_REGION=''"),
    ({"S3_TORCH_CONNECTOR_DEBUG_LOGS": "debug"}, [],
     "S3_TORCH_CONNECTOR_DEBUG_LOGS is set, but request_stats=true"),
    ({"DCP_FSDP_CONFIG": "/tmp/x.yaml"}, [], "DCP_FSDP_CONFIG is set"),
    ({"AWS_MAX_ATTEMPTS": "0"}, [], "AWS_MAX_ATTEMPTS='0': must be a positive whole number"),
    ({"AWS_RETRY_MODE": "bogus"}, [], "AWS_RETRY_MODE='bogus': botocore takes legacy, standard, "
                                      "adaptive"),
    ({"DCP_FSDP_TEST_ONLY_FORK_RANKS": "yes"}, [],
     "DCP_FSDP_TEST_ONLY_FORK_RANKS='yes': a test-only switch, 1 (forked ranks) or 0; unset"),
])
def test_environment_variables_we_read(monkeypatch, env, overrides, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cfg = compose("save", overrides)
    with pytest.raises(UserError) as error:
        checks.check_environment(cfg)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_an_empty_endpoint_variable_counts_as_unset_as_botocore_reads_it(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    cfg = compose("save", ["storage.uri=s3://bucket/x"])
    assert checks.check_endpoint_environment(cfg) == "AWS_ENDPOINT_URL"
    monkeypatch.setenv("AWS_ENDPOINT_URL", "")
    assert checks.check_endpoint_environment(cfg) is None


SECRET_ENDPOINT = "http://AKIAKEY:s3cr3tPW@127.0.0.1:1"  # port 1: nothing listens


@pytest.mark.parametrize("command", ["save-and-load", "tune", "list", "delete", "clean-uploads",
                                     "load"])
@pytest.mark.parametrize("variable", [None, "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"])
def test_an_endpoint_with_credentials_is_refused_without_repeating_them(
        command, variable, tmp_path, monkeypatch, capsys):
    """Issue 49 item 10: `user:password@` in the endpoint reached the record (argv,
    storage.endpoint) and the cannot-connect error. Refused in one line naming the setting
    or variable and where the keys go, before any connection, rank or record."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "a")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "b")
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    args = [command, "storage.uri=s3://bucket/x", f"results_dir={tmp_path}", "suffix=x"]
    if variable is None:
        args.append(f"storage.endpoint={SECRET_ENDPOINT}")
    else:
        monkeypatch.setenv(variable, SECRET_ENDPOINT)
    assert cli.main(args) == 2
    captured = capsys.readouterr()
    assert "s3cr3tPW" not in captured.out + captured.err and "AKIAKEY" not in captured.err
    line = captured.err.strip()
    assert "\n" not in line, line
    assert f"{variable or 'storage.endpoint'} holds credentials" in line, line
    assert "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in line
    assert list(tmp_path.iterdir()) == []  # no record


def test_an_endpoint_with_credentials_and_no_uri_is_not_repeated():
    """The 'storage.uri is not set' line repeats the endpoint: the credentials are refused
    first."""
    with pytest.raises(UserError) as error:
        compose("save", [f"storage.endpoint={SECRET_ENDPOINT}"])
    assert "holds credentials" in str(error.value) and "s3cr3tPW" not in str(error.value)


def test_tune_refuses_protocol_mlperf_before_anything_starts(tmp_path, capsys):
    """Issue 49 item 7: tune's 1- and 3-iteration trials were recorded with protocol=mlperf
    and reported as MLPerf Storage figures. Refused in one line, nothing started or written
    (a server or rank would be a process: refused in tests/unit)."""
    assert cli.main(["tune", "protocol=mlperf", f"results_dir={tmp_path}"]) == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and line.startswith("dcp-fsdp: error: protocol=mlperf: tune's trials"), line
    assert "save-and-load protocol=mlperf" in line
    assert list(tmp_path.iterdir()) == []


def test_environment_that_is_fine(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    monkeypatch.setenv("S3_TORCH_CONNECTOR_DEBUG_LOGS", "debug")  # request_stats=false: theirs
    checks.check_environment(compose("save", ["storage.uri=s3://bucket/x", "request_stats=false"]))
    monkeypatch.setenv("AWS_ENDPOINT_URL", "nonsense")  # storage=fs does not read it
    checks.check_environment(compose("save", ["storage=fs", "storage.path=/x"]))


@pytest.mark.parametrize("env, message", [
    ({"RANK": "0"}, "RANK is set but WORLD_SIZE is not"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, "MASTER_ADDR is not"),
    ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK='x'"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
     "RANK must be below WORLD_SIZE"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h", "MASTER_PORT": "70000"},
     "MASTER_PORT=70000"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1",
      "LOCAL_RANK": "-1"}, "LOCAL_RANK='-1'"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1",
      "DCP_FSDP_RUN_ID": "../x"}, "DCP_FSDP_RUN_ID='../x'"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1",
      "DCP_FSDP_ARGV": "{"}, "DCP_FSDP_ARGV is not a JSON list"),
])
def test_torchrun_variables(monkeypatch, env, message):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "DCP_FSDP_RUN_ID", "DCP_FSDP_ARGV"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UserError) as error:
        checks.check_torchrun_environment()
    assert message in str(error.value)


def test_torchrun_local_world_size_is_the_ranks_here(monkeypatch):
    for name, value in {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
                        "MASTER_ADDR": "h", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    assert checks.check_torchrun_environment() == 4


# -- help, version, arguments --------------------------------------------------------------

def test_version(capsys):
    from dcp_fsdp import __version__

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"dcp-fsdp {__version__}"


@pytest.mark.parametrize("command", ["save", "load", "save-and-load", "list"])
def test_command_help_lists_every_setting_with_its_default(command, capsys):
    assert cli.main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: dcp-fsdp {command}")
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    for name, _, default, _ in settings_rows():  # defaults as config.yaml makes them
        assert name in rows, name
        assert default in rows[name].split(), (name, rows[name])
    assert len(settings_rows()) == len(list(iter_settings()))


def test_unknown_command_suggests_the_closest(capsys):
    assert cli.main(["sav"]) == 2
    assert "did you mean save?" in capsys.readouterr().err


def test_dashed_setting_names_are_refused(capsys):
    assert cli.main(["save", "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert "'--nproc': settings are written key=value" in err and "nproc=VALUE" in err


def test_a_sweep_is_checked_whole_before_its_first_job_runs(tmp_path, capsys):
    code = cli.main(["save", "-m", "iterations=1,abc", f"results_dir={tmp_path}"])
    captured = capsys.readouterr()
    assert code == 2
    assert "multirun job 2/2 (iterations=abc)" in captured.err
    assert "multirun job 1/2" not in captured.out  # nothing ran
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("overrides, suggested, not_suggested", [
    (["model.dtype=fp32", "state=model_and_optimizer"], ["model.dtype=bf16", "state=model"], []),
    (["model.dtype=bf16", "state=model_and_optimizer"], ["state=model"], ["model.dtype=bf16"]),
    (["model.dtype=fp32", "state=model"], ["model.dtype=bf16"], ["state=model"]),
    (["model.dtype=bf16", "state=model"], [], ["model.dtype=bf16", "state=model"]),
])
def test_memory_refusal_suggests_only_what_would_change_something(monkeypatch, overrides,
                                                                  suggested, not_suggested):
    # the trial's case 117: model.dtype=bf16 was suggested to a run that had it
    monkeypatch.setattr(checks, "available_memory_bytes", lambda: 1)
    cfg = compose("save", ["model=L7b", "backend=gloo", *overrides])
    with pytest.raises(UserError) as refusal:
        checks.check_memory(cfg, 1, 1)
    fix = str(refusal.value).split("Choose ", 1)[1]
    assert "a smaller model=" in fix and "more nodes" in fix
    for setting in suggested:
        assert setting in fix
    for setting in not_suggested:
        assert setting not in fix


def test_a_cpu_quota_is_read_and_caps_the_usable_cores(tmp_path, monkeypatch):
    """Issue 31: a container's CPU quota was not named; cgroup v2's cpu.max says it."""
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("150000 100000\n")
    assert checks.cpu_quota_cores(str(cpu_max)) == 1.5
    cpu_max.write_text("max 100000\n")
    assert checks.cpu_quota_cores(str(cpu_max)) is None
    assert checks.cpu_quota_cores(str(tmp_path / "absent")) is None
    monkeypatch.setattr(checks, "cpu_quota_cores", lambda: 1.5)
    monkeypatch.setattr(checks.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert checks.usable_cores() == 2


def test_low_process_limits_and_a_small_quota_are_named(monkeypatch):
    """Issue 31: `ulimit -n` / `ulimit -v` and a CPU quota were not named before a run."""
    import resource

    limits = {resource.RLIMIT_NOFILE: (256, 4096), resource.RLIMIT_AS: (8 * 2**30, 8 * 2**30)}
    monkeypatch.setattr(resource, "getrlimit", lambda which: limits[which])
    notes = checks.host_limit_notes(nproc=4, quota=1.5)
    assert [note.split(":")[0] for note in notes] == [
        "ulimit -n is 256", "ulimit -v is 8388608 KiB",
        "this container's CPU quota is 1.50 core(s) for nproc=4 ranks"]
    limits = {resource.RLIMIT_NOFILE: (65536, 65536),
              resource.RLIMIT_AS: (resource.RLIM_INFINITY, resource.RLIM_INFINITY)}
    monkeypatch.setattr(checks, "cpu_quota_cores", lambda: None)  # no quota
    assert checks.host_limit_notes(nproc=2) == []
    monkeypatch.setattr(checks, "cpu_quota_cores", lambda: 4.0)  # a quota the ranks fit
    assert checks.host_limit_notes(nproc=2) == []


def test_the_launchers_environment_block_restores_what_it_set(monkeypatch):
    import os

    from dcp_fsdp.process.environ import environment

    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    with pytest.raises(RuntimeError):
        with environment({"AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": "http://127.0.0.1:1"}):
            assert os.environ["AWS_REGION"] == "us-east-1"
            raise RuntimeError("the store failed")
    assert os.environ["AWS_REGION"] == "eu-west-1" and "AWS_ENDPOINT_URL" not in os.environ
