"""save_mode=async with the process checkpointer stages into /dev/shm (64 MiB in a Docker
container by default): the parent refuses, before any rank, a node whose shards do not fit,
in one line naming the setting and the fix. /dev/shm's free space is faked."""

from __future__ import annotations

import shutil
from collections import namedtuple

import pytest

from dcp_fsdp.units import MIB
from dcp_fsdp.config.compose import compose
from dcp_fsdp.errors import UserError
from dcp_fsdp.launch import checks

Usage = namedtuple("Usage", "total used free")
PROCESS_ASYNC = ["save_mode=async", "async_save.checkpointer=process"]


@pytest.fixture
def shm_free(monkeypatch):
    """Set /dev/shm's free bytes (other paths answer as they really do)."""
    real = shutil.disk_usage
    state = {"free": 64 * MIB}

    def disk_usage(path):
        if str(path) == checks.SHM_PATH:
            return Usage(state["free"], 0, state["free"])
        return real(path)

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    return state


def config(*overrides: str, nproc: int = 2):
    return compose("save", ["model=L660m", "model.dtype=bf16", f"nproc={nproc}",
                            "storage.uri=s3://bench/p", "storage.endpoint=http://127.0.0.1:1",
                            *overrides])


def test_a_docker_sized_shm_refuses_the_process_checkpointer_before_any_rank(shm_free):
    cfg = config(*PROCESS_ASYNC)
    need = checks.state_bytes_estimate(cfg)  # 2 ranks on this node: the whole state
    assert need > shm_free["free"]
    with pytest.raises(UserError) as error:
        checks.check_launch(cfg)
    line = str(error.value)
    assert "\n" not in line
    for part in ("async_save.checkpointer=process", "/dev/shm", "docker run --shm-size=",
                 "async_save.checkpointer=thread", f"{need / 2**30:.2f} GiB", "0.06 GiB free"):
        assert part in line, line


def test_enough_shm_or_another_staging_passes(shm_free):
    cfg = config(*PROCESS_ASYNC)
    shm_free["free"] = checks.state_bytes_estimate(cfg)
    checks.check_staging_space(cfg, 2, 2)
    shm_free["free"] = 64 * MIB
    for overrides in (["save_mode=async"],  # the thread checkpointer stages in its memory
                      [*PROCESS_ASYNC, "async_save.shared_memory=false"], []):
        checks.check_staging_space(config(*overrides), 2, 2)


def test_the_need_is_this_nodes_share_of_the_shards(shm_free):
    cfg = config(*PROCESS_ASYNC, "state=model_and_optimizer", "model.replicas=2", nproc=8)
    state = checks.state_bytes_estimate(cfg)
    # 4 of 16 ranks on this node, 2 replicas: each rank holds 1/8 of the state
    shm_free["free"] = state * 2 * 4 // 16
    checks.check_staging_space(cfg, 4, 16)
    shm_free["free"] -= 1
    with pytest.raises(UserError, match="the 4 rank"):
        checks.check_staging_space(cfg, 4, 16)


def test_each_torchrun_rank_checks_its_nodes_share_before_joining(shm_free, monkeypatch,
                                                                  tmp_path):
    from dcp_fsdp.cli import check_torchrun_rank

    for name, value in {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0",
                        "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("DCP_FSDP_RUN_ID", raising=False)
    monkeypatch.delenv("DCP_FSDP_ARGV", raising=False)
    cfg = config(*PROCESS_ASYNC, f"results_dir={tmp_path}", "backend=gloo")
    with pytest.raises(UserError, match="the 2 rank"):
        check_torchrun_rank(cfg)
    shm_free["free"] = checks.state_bytes_estimate(cfg) // 2  # 2 of 4 ranks on this node
    check_torchrun_rank(cfg)
