"""The simulated training step (async interference), the async save helpers, and the
busy-time clock behind stage/upload and io_wait/copy."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from dcp_fsdp.config.schema import AsyncCheckpointer, AsyncSaveConfig, TrainStepWork
from dcp_fsdp.rank import train_step
from dcp_fsdp.rank.async_save import AsyncSaver, rank_bytes, staging_options
from dcp_fsdp.storage.timeline import BusyClock


def test_matmuls_for_a_step():
    assert train_step.matmuls_for(0.05, 0.01) == 5
    assert train_step.matmuls_for(0.05, 0.2) == 1  # never zero work
    assert train_step.matmuls_for(0.05, 0.0) == 1


def test_a_step_waits_for_staging_before_its_update_and_says_how_long(monkeypatch):
    step = train_step.TrainStep(torch.device("cpu"), 0.01)
    step.calibrate()
    order: list[str] = []
    # The wait moves the step's clock on by an hour, wholly inside the step: the compute times
    # leave it out whatever the machine's load (a real 0.5 s sleep against a 10 ms step failed
    # CI once at 0.70 s of compute, on a loaded machine).
    jump_s, real_clock = 3600.0, time.perf_counter
    jumped = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + jumped[0])

    def staged() -> None:
        jumped[0] += jump_s
        order.append("staged")

    times = step.run(3, before_update=staged)
    assert order == ["staged"]  # only the first step after a save waits
    assert times.wait_s >= jump_s and step.stall_wait_s == 0.0  # the last step did not wait
    assert len(times.compute_s) == 3 and times.compute_s[0] < jump_s
    first = train_step.TrainStep(torch.device("cpu"), 0.01)
    first.calibrate()
    first.step(lambda: time.sleep(0.1))
    assert first.stall_wait_s >= 0.1


def test_slowdown_is_relative_to_the_baseline_mean():
    assert train_step.slowdown([0.3, 0.3], [0.1, 0.2, 0.3]) == pytest.approx(0.5)  # 0.3/0.2 - 1
    assert train_step.slowdown([0.2], [0.2]) == pytest.approx(0.0)
    assert train_step.slowdown([], [0.1]) is None
    assert train_step.slowdown([0.1], []) is None


def test_calibrated_step_runs_fixed_work_of_about_the_asked_length():
    step = train_step.TrainStep(torch.device("cpu"), 0.02)
    step.calibrate()
    assert step.matmuls >= 1
    times = step.baseline()
    assert len(times) == train_step.BASELINE_STEPS and all(t > 0 for t in times)
    # Loose: the machine is shared; the point is "tens of milliseconds", not seconds.
    assert min(times) < 0.02 * 20


def test_run_until_stops_between_steps():
    step = train_step.TrainStep(torch.device("cpu"), 0.005)
    step.calibrate()
    calls = iter([False, False, True])
    assert len(step.run_until(lambda: next(calls))) == 2


def test_staging_options_without_an_accelerator_turn_pinned_and_non_blocking_off():
    config = AsyncSaveConfig(checkpointer=AsyncCheckpointer.process)
    cpu = staging_options(config, accelerator=False)
    assert not cpu.use_pinned_memory and not cpu.use_non_blocking_copy
    assert cpu.use_shared_memory == config.shared_memory
    assert cpu.use_async_staging == config.async_staging
    gpu = staging_options(config, accelerator=True)
    assert gpu.use_pinned_memory == config.pinned_memory
    assert gpu.use_non_blocking_copy == config.non_blocking_copy


def test_shared_memory_only_for_the_process_checkpointer():
    thread = AsyncSaveConfig(checkpointer=AsyncCheckpointer.thread, shared_memory=True)
    assert not staging_options(thread, accelerator=False).use_shared_memory
    process = AsyncSaveConfig(checkpointer=AsyncCheckpointer.process, shared_memory=False)
    assert not staging_options(process, accelerator=False).use_shared_memory


def test_rank_bytes_from_checkpoint_metadata():
    info = lambda path, length: SimpleNamespace(relative_path=path, length=length)  # noqa: E731
    metadata = SimpleNamespace(storage_data={
        1: info("__0_0.distcp", 100), 2: info("__0_0.distcp", 50),
        3: info("ab12/__1_0.distcp", 70), 4: info("__10_0.distcp", 5)})
    assert rank_bytes(metadata, 0) == 150
    assert rank_bytes(metadata, 1) == 70
    assert rank_bytes(metadata, 10) == 5
    assert rank_bytes(SimpleNamespace(storage_data={}), 0) is None


def test_busy_clock_counts_overlapping_calls_once():
    clock = BusyClock()
    barrier = threading.Barrier(4)  # 3 threads and this one

    def busy():
        barrier.wait()
        clock.enter()
        time.sleep(0.05)
        clock.exit()

    threads = [threading.Thread(target=busy) for _ in range(3)]
    for thread in threads:
        thread.start()
    start = time.perf_counter()
    barrier.wait()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    assert 0.04 < clock.total_s() <= wall + 0.01  # not 3 x 0.05


# -- on a GPU: the step's own stream, not the device (issue 32) ----------------------------

def test_a_cuda_step_waits_for_its_own_stream_not_the_whole_device(monkeypatch):
    """A device-wide synchronize would also wait for an async save's staging copies on the
    stager's stream and count them as the step's compute: the step records an event on its
    (current) stream and waits for that. A fake CUDA device: the work itself runs on CPU."""
    seen: list = []
    stream = object()

    class Event:
        def record(self, on) -> None:
            seen.append(("record", on))

        def synchronize(self) -> None:
            seen.append("event.synchronize")

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: seen.append("device-wide"))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: stream if device == cuda else None)
    step = train_step.TrainStep(cuda, 0.01)
    step._a, step._b = torch.ones(8, 8), torch.ones(8, 8)  # as calibrate() leaves them
    step.step()
    assert seen == [("record", stream), "event.synchronize"]


def test_the_memory_bound_step_calibrates_and_runs_vector_adds():
    step = train_step.TrainStep(torch.device("cpu"), 0.05, TrainStepWork.memory)
    step.calibrate()
    assert step._a is not None and step._a.dim() == 1 and step._out is not None
    assert step._a.numel() >= 2**16 and step.matmuls >= 1
    times = step.baseline()
    assert len(times) == train_step.BASELINE_STEPS and all(t > 0 for t in times)
    assert torch.equal(step._out[:4], torch.full((4,), 3.0))  # 1 + 2: the add ran


def test_train_step_work_is_a_setting_and_needs_a_step_length():
    from dcp_fsdp.config.compose import compose
    from dcp_fsdp.errors import UserError

    cfg = compose("save", ["save_mode=async", "train_step_s=0.05",
                           "async_save.train_step_work=memory"])
    assert cfg.async_save.train_step_work == TrainStepWork.memory
    saver_step = AsyncSaver(cfg.async_save, torch.device("cpu"), cfg.train_step_s).train_step
    assert saver_step is not None and saver_step.work == TrainStepWork.memory
    with pytest.raises(UserError, match="async_save.train_step_work=memory: the simulated"):
        compose("save", ["save_mode=async", "async_save.train_step_work=memory"])
