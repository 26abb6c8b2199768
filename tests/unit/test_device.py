"""The GPU path, by construction (no CUDA here): a fake CUDA device whose synchronize is
recorded proves that every clock closing a timed region is read after the device's work is
done; the device a rank takes, and what its process group is given, with torch.cuda's counts
and torchrun's environment faked."""

from __future__ import annotations

import datetime
import re
import socket
import types
from concurrent.futures import Future
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from dcp_fsdp.config.schema import AsyncSaveConfig, Backend, BenchmarkConfig, StorageConfig, StorageKind
from dcp_fsdp.errors import UserError
from dcp_fsdp.rank import async_save, device, distributed, replicas

FAKE_CUDA = torch.device("cuda", 0)  # a device object needs no CUDA; using it would


class Events:
    """The order of device synchronizes and clock reads, as one list."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self._now = 1000.0

    def synchronize(self, device=None) -> None:
        assert device == FAKE_CUDA, device
        self.seen.append("sync")

    def monotonic(self) -> float:
        self.seen.append("clock")
        self._now += 1.0
        return self._now

    def clock_module(self):
        import time

        return types.SimpleNamespace(monotonic=self.monotonic, time=time.time,
                                     sleep=time.sleep, perf_counter=time.perf_counter,
                                     process_time=time.process_time)


@pytest.fixture
def events(monkeypatch):
    recorded = Events()
    monkeypatch.setattr(torch.cuda, "synchronize", recorded.synchronize)
    return recorded


def test_sync_device_synchronizes_cuda_and_does_nothing_on_cpu(events):
    device.sync_device(torch.device("cpu"))
    assert events.seen == []
    device.sync_device(FAKE_CUDA)
    assert events.seen == ["sync"]


def test_read_once_broadcast_time_ends_after_the_device_is_synchronized(events, monkeypatch):
    """NCCL's work.wait() returns before the copy lands: the broadcast's clock must wait for
    the device, and its start must not carry the load's queued copies."""
    def broadcast(state_dict, group, host_group):
        events.seen.append("broadcast")

    monkeypatch.setattr(replicas, "broadcast_from_first_replica", broadcast)
    monkeypatch.setattr(replicas, "time", events.clock_module())
    mesh: Any = types.SimpleNamespace(get_group=lambda dim: None)
    replicas.read_once_load({}, None, mesh, replica=1, device=FAKE_CUDA)
    assert events.seen == ["sync", "clock", "broadcast", "sync", "clock"]


def test_the_staged_mark_of_an_async_save_is_read_after_the_device_sync(events, monkeypatch):
    """When the stager's future is waited for before its done-callback marked it (a race
    concurrent.futures allows), the mark is taken here: after the device's copies."""
    class Unmarked(Future):
        def add_done_callback(self, fn) -> None:  # the callback has not run yet
            pass

    staging, upload = Unmarked(), Unmarked()
    staging.set_result({})
    upload.set_result(None)

    def fake_async_save(state_dict, **kwargs):
        return async_save.AsyncSaveResponse(staging_completion=staging,
                                            upload_completion=upload)

    monkeypatch.setattr(async_save, "dcp", types.SimpleNamespace(async_save=fake_async_save))
    monkeypatch.setattr(async_save, "time", events.clock_module())
    saver: Any = async_save.AsyncSaver(AsyncSaveConfig(), FAKE_CUDA, 0.0)
    saver.group, saver.stager = object(), None
    events.seen.clear()
    timing = saver.save({}, writer=None, begin_mono=0.0, baseline_s=[])
    assert timing.staged_s is not None
    # blocked_end, then the staged mark after the sync (then the steps' end clock)
    assert events.seen[:3] == ["clock", "sync", "clock"], events.seen


class NcclLike:
    """torch.distributed as the read_once broadcast sees it on a GPU run: the mesh's
    replicate group is NCCL, which refuses a CPU tensor (NCCL's own error), and a gloo group
    over the same ranks moves CPU tensors. This rank receives: a broadcast fills the tensor
    with what replica 0 holds (a meta tensor stands for a CUDA shard: nothing to fill)."""

    REPLICA_0_VALUE = 7.0

    def __init__(self) -> None:
        self.nccl, self.gloo = object(), object()
        self.sent: list[tuple[str, str]] = []

    def get_global_rank(self, group, rank):
        return 0

    def broadcast(self, tensor, src, group, async_op):
        name = "nccl" if group is self.nccl else "gloo"
        if name == "nccl" and tensor.device.type == "cpu":
            raise RuntimeError("No backend type associated with device type cpu")
        self.sent.append((name, tensor.device.type))
        if tensor.device.type == "cpu":
            tensor.fill_(self.REPLICA_0_VALUE)
        return types.SimpleNamespace(wait=lambda: None)


def test_read_once_sends_the_optimizers_cpu_step_over_gloo_not_nccl(monkeypatch):
    """AdamW's `step` stays on the host while the moments are on the GPU: the NCCL group
    would refuse it (issue 32), so it goes over the gloo group and lands in the live tensor."""
    from dcp_fsdp.models.build import create_optimizer_state

    with torch.device("meta"):
        model = torch.nn.Linear(4, 3, bias=False)
    optimizer = torch.optim.AdamW(model.parameters())
    create_optimizer_state(optimizer)
    (state,) = optimizer.state.values()
    assert state["step"].device.type == "cpu" and state["exp_avg"].device.type == "meta"
    state_dict = {"model": {"weight": model.weight}, "optim": {"state": {"weight": state}}}
    fake: Any = NcclLike()
    monkeypatch.setattr(replicas, "dist", fake)
    mesh: Any = types.SimpleNamespace(get_group=lambda dim: fake.nccl)
    replicas.read_once_load(state_dict, None, mesh, replica=1, host_group=fake.gloo)
    assert ("gloo", "cpu") in fake.sent and ("nccl", "meta") in fake.sent
    assert ("nccl", "cpu") not in fake.sent
    assert state["step"].item() == NcclLike.REPLICA_0_VALUE


def test_the_host_group_of_a_replicate_dimension_is_gloo_over_its_ranks(one_rank_group):
    """models/build.py's replicate_host_group on a real (one-rank gloo) mesh: the torch
    calls it makes exist in this release and give a gloo group over the same ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    from dcp_fsdp.models.build import REPLICATE_DIM, SHARD_DIM, replicate_host_group

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=(REPLICATE_DIM, SHARD_DIM))
    group = replicate_host_group(mesh)
    assert dist.get_backend(group) == "gloo"
    assert dist.get_process_group_ranks(group) == [0]
    step = torch.tensor(5.0)
    dist.broadcast(step, src=0, group=group)
    assert step.item() == 5.0


@pytest.fixture(scope="module")
def one_rank_group():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("op", ["save", "load"])
def test_the_timed_operation_ends_its_clock_after_the_device_sync(one_rank_group, events,
                                                                   monkeypatch, tmp_path, op):
    """CheckpointLoop._timed on a real one-rank group and a real fs checkpoint, its device a
    fake CUDA one: the last clock read (end_mono) comes after a synchronize that follows
    the operation."""
    from dcp_fsdp.config.schema import CheckpointState, Dtype
    from dcp_fsdp.models.build import build_sharded_model
    from dcp_fsdp.rank import loop as loop_module
    from dcp_fsdp.models.build import dcp_state_dict
    from dcp_fsdp.storage import make_store

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 0)
    storage = StorageConfig(kind=StorageKind.fs, path=str(tmp_path))
    cfg = BenchmarkConfig(storage=storage)
    sharded = build_sharded_model("tiny_llama", Dtype.fp32, CheckpointState.model,
                                  torch.device("cpu"), 1, seed=1)
    ctx = distributed.RankContext(0, 1, 0, 1, "gloo", FAKE_CUDA, node_count=1, hostnames=("host",))
    loop = loop_module.CheckpointLoop(cfg, ctx, make_store(storage), sharded,
                                      dcp_state_dict(sharded.model, sharded.optimizer), None, lambda line: None,
                                      lambda message: None)
    if op == "load":
        loop._timed("save", 1, "x")
    real_load, real_save = loop_module.dcp.load, loop_module.dcp.save

    def noted(call):
        def run(*args, **kwargs):
            result = call(*args, **kwargs)
            events.seen.append(op)
            return result
        return run

    monkeypatch.setattr(loop_module, "dcp", types.SimpleNamespace(
        load=noted(real_load), save=noted(real_save)))
    from dcp_fsdp.rank import sample_build

    monkeypatch.setattr(sample_build, "time", events.clock_module())  # the timed region's clocks
    events.seen.clear()
    sample = loop._timed(op, 1, "x").result()
    assert not callable(sample) and sample.duration_s > 0
    after_op = events.seen[events.seen.index(op):]
    assert "sync" in after_op and after_op[-1] == "clock", events.seen
    assert after_op.index("sync") < len(after_op) - 1


# -- which device a rank takes (item 9) ------------------------------------------------------

@pytest.mark.parametrize("local_rank, ranks_here, visible, bound, expected", [
    (3, 4, 4, False, 3),  # every rank sees the node's 4 GPUs
    (3, 4, 8, False, 3),
    (3, 4, 1, True, 0),  # Slurm --gpus-per-task=1: each sees only its own
    (0, 1, 1, False, 0),
])
def test_cuda_index_uses_the_visible_devices(local_rank, ranks_here, visible, bound, expected):
    assert device.cuda_index(local_rank, ranks_here, visible, bound) == expected


@pytest.mark.parametrize("ranks_here, visible, bound, message", [
    (4, 1, False, "nproc=4: only 1 CUDA device(s) visible here"),
    (4, 2, False, "LOCAL_WORLD_SIZE=4: each rank sees 2 CUDA devices"),
    (4, 2, True, "LOCAL_WORLD_SIZE=4: each rank sees 2 CUDA devices"),
])
def test_cuda_index_refuses_two_ranks_on_one_device(ranks_here, visible, bound, message):
    with pytest.raises(UserError, match=re.escape(message)):
        device.cuda_index(1, ranks_here, visible, bound)


@pytest.mark.parametrize("visible_env, count, expected", [
    ("5", 1, torch.device("cuda", 0)),  # bound per task: LOCAL_RANK 2 would not exist
    (None, 4, torch.device("cuda", 2)),
    ("0,1,2,3", 4, torch.device("cuda", 2)),
])
def test_rank_device_under_slurm_bindings(monkeypatch, visible_env, count, expected):
    if visible_env is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible_env)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    assert distributed.rank_device("nccl", 2, 4) == expected
    assert distributed.rank_device("gloo", 2, 4) == torch.device("cpu")


def test_the_torchrun_check_accepts_one_bound_gpu_per_task(monkeypatch):
    from dcp_fsdp.launch import checks

    checks.check_devices(Backend.nccl, 4, lambda: 1, bound_per_task=True)
    with pytest.raises(UserError, match=re.escape("nproc=4: only 1 CUDA device(s)")):
        checks.check_devices(Backend.nccl, 4, lambda: 1, bound_per_task=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1234")
    assert device.one_device_per_task()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert not device.one_device_per_task()


# -- pinned staging by the rank's device (item 10) --------------------------------------------

def test_pinned_staging_follows_the_ranks_device_not_the_machine(monkeypatch):
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)  # a GPU host
    gloo_rank = async_save.AsyncSaver(AsyncSaveConfig(), torch.device("cpu"), 0.0)
    assert not gloo_rank.options.use_pinned_memory
    assert not gloo_rank.options.use_non_blocking_copy
    nccl_rank = async_save.AsyncSaver(AsyncSaveConfig(), FAKE_CUDA, 0.0)
    assert nccl_rank.options.use_pinned_memory and nccl_rank.options.use_non_blocking_copy


def test_a_cpu_ranks_stager_stages_in_its_thread_without_an_accelerator_stream(monkeypatch):
    """torch's DefaultStager makes torch.Stream() (a CUDA context on GPU 0) whenever the
    machine has an accelerator; a gloo rank's must not."""
    def no_stream(*args, **kwargs):
        raise AssertionError("a CPU rank made an accelerator stream")

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch, "Stream", no_stream)
    saver = async_save.AsyncSaver(AsyncSaveConfig(), torch.device("cpu"), 0.0)
    assert saver.options.use_async_staging
    stager = saver.new_stager()
    try:
        staged = stager.stage({"weight": torch.arange(4.0)})
        assert isinstance(staged, Future)  # staged in the stager's thread
        assert torch.equal(staged.result()["weight"], torch.arange(4.0))
    finally:
        stager.close()


# -- a process group that fails in bounded time (item 12) ------------------------------------

@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_nccl_gets_async_error_handling_and_the_collective_timeout(monkeypatch, backend):
    seen: dict = {}

    def init_process_group(**kwargs):
        seen.update(kwargs, env=device.os.environ.get(device.NCCL_ASYNC_ERROR_HANDLING_ENV))

    monkeypatch.delenv(device.NCCL_ASYNC_ERROR_HANDLING_ENV, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    fake_dist = types.SimpleNamespace(is_initialized=lambda: False, get_rank=lambda: 1,
                                      get_world_size=lambda: 2,
                                      init_process_group=init_process_group)
    with mock.patch.object(distributed, "dist", fake_dist), \
            mock.patch.object(distributed, "gather_to_keepers", lambda obj, keepers=2: None), \
            mock.patch.object(distributed, "sum_over_ranks", lambda *values: (1,) * len(values)), \
            mock.patch.object(distributed, "wall_clock_spread_s", lambda: 0.0):
        ctx = distributed.init_distributed(Backend(backend), timeout_s=120.0)
    assert seen["timeout"] == datetime.timedelta(seconds=120)
    if backend == "nccl":
        assert seen["env"] == "1" and ctx.device == torch.device("cuda", 1)
    else:
        assert seen["env"] is None and ctx.device == torch.device("cpu")


# -- the record's GPUs: a gloo rank on a GPU host initialises no CUDA ------------------------

def test_a_cpu_ranks_record_asks_cuda_nothing_on_a_gpu_host(monkeypatch):
    """torch.cuda.get_device_name initialises CUDA in the process (a context on a GPU
    host): a CPU rank's run.gpus stays empty without it; a CUDA rank names its own device."""
    from dcp_fsdp.rank import session

    asked: list = []

    def lazy_init() -> None:
        asked.append("_lazy_init")

    def device_name(which=None) -> str:
        asked.append(("get_device_name", which))
        return "NVIDIA H100 80GB HBM3"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU host
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "_lazy_init", lazy_init)
    monkeypatch.setattr(torch.cuda, "get_device_name", device_name)
    assert session.gpus(torch.device("cpu")) is None
    assert asked == []
    assert session.gpus(FAKE_CUDA) == session.Gpus(model="NVIDIA H100 80GB HBM3", count=4)
    assert asked == [("get_device_name", FAKE_CUDA)]


# -- the op watchdog fires before the process group's timeout (issue 32) ---------------------

@pytest.mark.parametrize("collective_s, op_s, expected", [
    (600.0, 3600.0, 3660.0),  # the defaults: NCCL's 600 s would end a stuck save first
    (30.0, 30.0, 90.0),
    (7200.0, 3600.0, 7200.0),  # a longer collective timeout is kept
])
def test_the_process_group_times_out_after_the_op_watchdog(collective_s, op_s, expected):
    assert device.process_group_timeout_s(collective_s, op_s) == expected
    assert device.process_group_timeout_s(collective_s, op_s) >= op_s + device.RECORD_MARGIN_S


def test_a_rank_joins_with_the_timeout_past_op_timeout_s(monkeypatch):
    """What RankSession.join hands init_distributed at the defaults (collective_timeout_s 600,
    op_timeout_s 3600): a stuck save must end by the watchdog (which writes the record), not
    by NCCL tearing the process down after 600 s."""
    from dcp_fsdp.rank.session import RankSession

    given: list[float] = []

    def init_distributed(backend, timeout_s):
        given.append(timeout_s)
        return distributed.RankContext(0, 1, 0, 1, "gloo", torch.device("cpu"), 1, ("host",))

    monkeypatch.setattr(distributed, "init_distributed", init_distributed)
    monkeypatch.setattr(distributed, "broadcast_object", lambda obj, src=0: obj)
    monkeypatch.setattr(distributed, "wall_clock_spread_s", lambda: 0.0)
    cfg = BenchmarkConfig()
    RankSession(cfg, process_start_mono=0.0).join()
    assert given == [cfg.op_timeout_s + device.RECORD_MARGIN_S]
    assert given[0] > cfg.collective_timeout_s
