"""On CUDA devices (marked `gpu` by tests/conftest.py: skipped, with the reason, where there
are none): nccl save-and-load, async save with pinned staging, CUDA peak memory, and the
launcher's device-count check. One rank per GPU, at most two."""

from __future__ import annotations

import pytest

from tests.integration.test_bad_input import assert_refused
from tests.kit.cli import read_run, run_cli, s3_args, s3_env


def cuda_count() -> int:
    import torch

    return torch.cuda.device_count()


def ranks() -> int:
    return min(cuda_count(), 2)


def shard_bytes(run) -> float:
    return run["model"]["state_bytes"] / run["world_size"]


def check_run(result, tmp_path, nproc):
    assert result.returncode == 0, result.stderr[-3000:]
    run, samples = read_run(tmp_path)
    assert run["status"] == "ok"
    assert run["backend"] == "nccl" and run["device"].startswith("cuda")
    assert run["gpus"]["count"] == cuda_count()
    assert run["world_size"] == nproc
    assert run["integrity"] and all(e["checked"] for e in run["integrity"].values())
    for s in samples:
        # Model and optimizer state live on the GPU: every operation's CUDA peak holds
        # at least this rank's shards.
        assert s["cuda_max_allocated_bytes"] >= shard_bytes(run), s
    return run, samples


def test_nccl_save_and_load(s3, s3_uri, tmp_path):
    nproc = ranks()
    result = run_cli(["save-and-load", *s3_args(s3, s3_uri), "backend=nccl", f"nproc={nproc}",
                      "model=tiny_llama", "iterations=2", f"results_dir={tmp_path}"],
                     env=s3_env(s3))
    run, samples = check_run(result, tmp_path, nproc)
    assert sorted((s["op"], s["iteration"]) for s in samples) == sorted(
        (op, it) for op in ("save", "load") for it in (1, 2) for _ in range(nproc))


def test_the_tool_s_reader_copies_to_the_device_on_a_side_stream(s3, s3_uri, tmp_path):
    """storage.read_ahead on a GPU: pinned fetch buffers, non-blocking copies on a side
    stream (storage/read_ahead.py DeviceCopies), every load verified bit for bit; the
    copies' wait is in target_copy_s."""
    nproc = ranks()
    result = run_cli(["save-and-load", *s3_args(s3, s3_uri), "backend=nccl", f"nproc={nproc}",
                      "model=tiny_llama", "iterations=2", "storage.read_ahead=4",
                      f"results_dir={tmp_path}"], env=s3_env(s3))
    _, samples = check_run(result, tmp_path, nproc)
    loads = [s for s in samples if s["op"] == "load"]
    assert loads and all(s["reader"] == "read_ahead=4" and s["target_copy_s"] >= 0 for s in loads)


@pytest.mark.parametrize("checkpointer", ["thread", "process"])
def test_async_save_with_pinned_staging(s3, s3_uri, tmp_path, checkpointer):
    nproc = ranks()
    result = run_cli(["save-and-load", *s3_args(s3, s3_uri), "backend=nccl", f"nproc={nproc}",
                      "model=tiny_llama", "iterations=2", "save_mode=async",
                      f"async_save.checkpointer={checkpointer}", "async_save.pinned_memory=true",
                      f"results_dir={tmp_path}"], env=s3_env(s3))
    run, samples = check_run(result, tmp_path, nproc)
    assert run["config"]["async_save"]["pinned_memory"] is True
    saves = [s for s in samples if s["op"] == "save"]
    assert len(saves) == 2 * nproc
    for s in saves:
        assert s["save_mode"] == "async"
        assert 0 <= s["blocked_s"] <= s["persisted_s"], s
        assert 0 <= s["staged_s"] <= s["persisted_s"], s


def test_more_ranks_than_cuda_devices_is_refused_by_the_launcher(tmp_path):
    count = cuda_count()
    result = run_cli(["save", f"nproc={count + 1}", f"results_dir={tmp_path}"])
    assert_refused(result, f"nproc={count + 1}: only {count} CUDA device(s)", within_s=20)
