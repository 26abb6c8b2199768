"""What a lent GPU machine must check of the GPU path (issue 23, items 8-15): read_once across
2 replicas, an async cadence with training steps, a killed rank under nccl ending in bounded
time, gloo ranks on a GPU host opening no CUDA context, and the rule that a timed region's
clock stops only once the device's queued work is done.

Marked `gpu` by directory (tests/conftest.py): skipped, with the reason, without CUDA; a test
that needs two devices says so when there is one. At most two ranks, one per GPU. Written for
torch 2.11-2.15 (the lent H100 ships 2.11: see ../shared/device/README.md).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time

import pytest

from dcp_fsdp.rank.device import process_group_timeout_s
from tests.gpu.test_gpu import check_run, cuda_count, ranks
from tests.kit.cli import read_run, read_until, run_cli, s3_args, s3_env, start_cli

COLLECTIVE_TIMEOUT_S = 30  # the killed-rank test's collective_timeout_s and op_timeout_s
# the process group's timeout those give (op_timeout_s + 60: the op watchdog fires first)
GROUP_TIMEOUT_S = process_group_timeout_s(COLLECTIVE_TIMEOUT_S, COLLECTIVE_TIMEOUT_S)
END_SLACK_S = 90  # what the survivor may take beyond it (the watchdog's poll, the abort, exit)


def need_two_gpus() -> None:
    if cuda_count() < 2:
        pytest.skip(f"needs 2 CUDA devices (one per rank), {cuda_count()} here")


def ops(samples: list[dict], op: str) -> list[dict]:
    return sorted((s for s in samples if s["op"] == op), key=lambda s: (s["iteration"], s["rank"]))


@pytest.mark.parametrize("state", ["model", "model_and_optimizer"])
def test_read_once_across_two_replicas_broadcasts_over_nccl(s3, s3_uri, tmp_path, state):
    """Replica 0 reads, replica 1 receives by NCCL broadcast: replica 1 fetches nothing, the
    broadcast is inside the timed load (its clock waits for the copy to land), and every
    loaded shard is verified. With the optimizer's state: AdamW's `step` tensors stay on the
    host, which NCCL refuses; they go over the replicate ranks' gloo group (issue 32)."""
    need_two_gpus()
    result = run_cli(["save-and-load", *s3_args(s3, s3_uri), "backend=nccl", "nproc=2",
                      "model=tiny_llama", "iterations=2", "model.replicas=2", f"state={state}",
                      "model.replica_load=read_once", f"results_dir={tmp_path}"],
                     env=s3_env(s3))
    run, samples = check_run(result, tmp_path, 2)
    loads = ops(samples, "load")
    assert [s["replica"] for s in loads] == [0, 1, 0, 1]
    for s in loads:
        assert 0 < s["broadcast_s"] <= s["duration_s"], s
        if s["replica"] == 1:
            assert s["fetched_bytes"] == 0, s
        else:
            assert s["fetched_bytes"] >= s["bytes"], s
    assert "as 2 replicas (loads: read_once)" in result.stdout


@pytest.mark.parametrize("work", ["matmul", "memory"])
def test_async_cadence_with_training_steps_on_the_gpu(s3, s3_uri, tmp_path, work):
    """Pinned, non-blocking staging on a CUDA rank with training steps between saves: the
    figures hold together, and the record says whether torch renewed its stager. Both kinds
    of simulated step (async_save.train_step_work): the memory-bound one contends with
    staging's copies, the matmuls barely do."""
    from dcp_fsdp.rank.async_save import stager_reusable

    nproc = ranks()
    steps = 2
    result = run_cli(["save-and-load", *s3_args(s3, s3_uri), "backend=nccl", f"nproc={nproc}",
                      "model=tiny_llama", "iterations=3", "save_mode=async",
                      "train_step_s=0.05", f"async_save.steps_between_saves={steps}",
                      f"async_save.train_step_work={work}",
                      f"results_dir={tmp_path}"], env=s3_env(s3))
    run, samples = check_run(result, tmp_path, nproc)
    assert run["config"]["async_save"]["pinned_memory"] is True
    saves = ops(samples, "save")
    assert len(saves) == 3 * nproc
    renewed = not stager_reusable()  # torch 2.11: True (its stager stages once)
    for s in saves:
        assert s["save_mode"] == "async" and s["train_steps"] == steps, s
        assert 0 <= s["blocked_s"] <= s["stall_s"] <= s["interval_s"], s
        assert s["staged_s"] is None or s["staged_s"] <= s["stall_s"], s
        assert s["persisted_s"] >= (s["staged_s"] or 0), s  # the upload reads the staged copy
        assert s["train_step_slowdown"] is not None, s
        assert s["stager_renewed"] is renewed, s
        if s["iteration"] == 1:
            assert s["previous_wait_s"] == 0, s
    assert "training stalled" in result.stdout
    assert ("stager_renewed" in result.stdout) is renewed


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_killed_rank_under_nccl_ends_its_peer_in_bounded_time(s3, s3_uri, tmp_path):
    """Two ranks started as a scheduler without torchrun would (srun: no agent to kill the
    survivor): SIGKILL rank 1 after the first save. Rank 0 then waits in an NCCL collective,
    where no Python signal handler runs; with TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (set by
    rank/device.py), op_timeout_s and collective_timeout_s, it must end by itself, non-zero,
    in bounded time (the process group's timeout, not torch's 600 s default)."""
    need_two_gpus()
    port = _free_port()
    args = ["save-and-load", *s3_args(s3, s3_uri), "backend=nccl", "model=tiny_llama",
            "iterations=200", "integrity=false", f"collective_timeout_s={COLLECTIVE_TIMEOUT_S}",
            f"op_timeout_s={COLLECTIVE_TIMEOUT_S}",
            f"results_dir={tmp_path}"]
    processes = [start_cli(args, {**s3_env(s3), "RANK": str(rank), "LOCAL_RANK": str(rank),
                                  "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                           unset=("TORCH_NCCL_ASYNC_ERROR_HANDLING",))  # ours must set it
                 for rank in (0, 1)]
    survivor, victim = processes
    try:
        read_until(survivor, "saved suffix=", timeout_s=300)
        victim.kill()
        victim.wait(timeout=30)
        killed_at = time.monotonic()
        output, _ = survivor.communicate(timeout=GROUP_TIMEOUT_S + END_SLACK_S)
        ended_s = time.monotonic() - killed_at
    except subprocess.TimeoutExpired:
        raise AssertionError(f"rank 0 still running {GROUP_TIMEOUT_S + END_SLACK_S} s "
                             "after rank 1 was killed: a dead peer hangs nccl") from None
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    assert survivor.returncode != 0, output[-3000:]
    assert ended_s < GROUP_TIMEOUT_S + END_SLACK_S


def _compute_pids() -> set[int]:
    answer = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                            capture_output=True, text=True, timeout=30)
    return {int(word) for word in answer.stdout.split() if word.isdigit()}


def test_gloo_ranks_on_a_gpu_host_open_no_cuda_context(s3, s3_uri, tmp_path):
    """backend=gloo with async saves at their defaults (pinned memory, async staging) on a
    machine with GPUs: the ranks stage into plain host memory and make no CUDA stream, so
    no rank ever appears among nvidia-smi's compute processes."""
    if shutil.which("nvidia-smi") is None:
        pytest.skip("needs nvidia-smi to list the processes holding a CUDA context")
    before = _compute_pids()
    seen: set[int] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.update(_compute_pids() - before - {os.getpid()})
            done.wait(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        result = run_cli(["save-and-load", *s3_args(s3, s3_uri), "backend=gloo", "nproc=2",
                          "model=tiny_llama", "iterations=2", "save_mode=async",
                          "train_step_s=0.02", f"results_dir={tmp_path}"], env=s3_env(s3))
    finally:
        done.set()
        watcher.join(timeout=30)
    assert result.returncode == 0, result.stderr[-3000:]
    run, samples = read_run(tmp_path)
    assert run["status"] == "ok" and run["backend"] == "gloo" and run["device"] == "cpu"
    assert run["gpus"] is None  # naming the host's GPUs would initialise CUDA in the rank
    assert all(s["cuda_max_allocated_bytes"] is None for s in samples)
    assert not seen, f"processes that opened a CUDA context during a gloo run: {sorted(seen)}"


# -- the synchronize-before-clock rule, on the real device -----------------------------------

@pytest.fixture(scope="module")
def one_nccl_rank():
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1, device_id=device)
    yield device
    dist.destroy_process_group()


def _cycles_for(seconds: float) -> int:
    """GPU clock cycles that torch.cuda._sleep spins for about `seconds` (measured)."""
    import torch

    probe = 50_000_000
    torch.cuda._sleep(probe)  # warm-up
    torch.cuda.synchronize()
    started = time.monotonic()
    torch.cuda._sleep(probe)
    torch.cuda.synchronize()
    return int(probe * seconds / (time.monotonic() - started))


@pytest.mark.parametrize("op", ["save", "load"])
def test_the_timed_clock_waits_for_work_queued_on_the_device(one_nccl_rank, tmp_path, op,
                                                             monkeypatch):
    """The operation leaves ~1 s of kernel work queued on the GPU when it returns (as an
    asynchronous copy would); the sample's duration must include it."""
    import torch

    from dcp_fsdp.config.schema import (BenchmarkConfig, CheckpointState, Dtype, StorageConfig,
                                        StorageKind)
    from dcp_fsdp.models.build import build_sharded_model
    from dcp_fsdp.rank import loop as loop_module
    from dcp_fsdp.rank.distributed import RankContext
    from dcp_fsdp.models.build import dcp_state_dict
    from dcp_fsdp.storage import make_store

    device = one_nccl_rank
    storage = StorageConfig(kind=StorageKind.fs, path=str(tmp_path))
    sharded = build_sharded_model("tiny_llama", Dtype.fp32, CheckpointState.model, device, 1,
                                  seed=3)
    ctx = RankContext(rank=0, world_size=1, local_rank=0, local_world_size=1, backend="nccl",
                      device=device, node_count=1, hostnames=(socket.gethostname(),))
    loop = loop_module.CheckpointLoop(BenchmarkConfig(storage=storage), ctx, make_store(storage),
                                      sharded, dcp_state_dict(sharded.model, sharded.optimizer), None,
                                      lambda line: None, lambda message: None)
    if op == "load":
        loop._timed("save", 1, "x")
    queued_s = 1.0
    cycles = _cycles_for(queued_s)
    real = getattr(loop_module.dcp, op)

    def then_queue_work(*args, **kwargs):
        result = real(*args, **kwargs)
        torch.cuda._sleep(cycles)  # returns at once; the GPU is busy for ~queued_s
        return result

    original = loop_module.dcp
    monkeypatch.setattr(loop_module, "dcp", type("Dcp", (), {
        "save": staticmethod(original.save), "load": staticmethod(original.load),
        op: staticmethod(then_queue_work)}))
    sample = loop._timed(op, 1, "x" if op == "load" else "y").result()
    assert not callable(sample)
    assert sample.duration_s >= 0.9 * queued_s, sample
