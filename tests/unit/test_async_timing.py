"""An async save's figures, checked exactly with a fake `dcp` (torchtitan's way): its
`async_save` returns futures that complete at chosen times of a fake clock, so blocked_s,
staged_s, stall_s, persisted_s and previous_wait_s must equal the chosen times to the bit.
No process group, no storage: rank/async_save.py's arithmetic alone."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any
from unittest import mock

import pytest
import torch
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from dcp_fsdp.config.schema import AsyncSaveConfig
from dcp_fsdp.rank import async_save, train_step
from dcp_fsdp.rank.train_step import StepTimes, TrainStep


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


class DueFuture(Future):
    """Completes when waited for: the fake clock jumps to `due` (if not past it already)."""

    def __init__(self, clock: Clock, due: float) -> None:
        super().__init__()
        self.clock, self.due = clock, due

    def _complete(self) -> None:
        # Its callbacks (the saver's marks) run at `due`, as if it completed on time;
        # afterwards the clock is where the waiter would be.
        later = max(self.clock.now, self.due)
        self.clock.now = self.due
        self.set_result(None)
        self.clock.now = later

    def result(self, timeout=None):
        if not super().done():
            self._complete()
        return super().result(timeout)

    def done(self) -> bool:
        if not super().done() and self.clock.now >= self.due:
            self._complete()
        return super().done()


class FakeDcp:
    """dcp.async_save: the call takes `call_s`; staging is done `staged_after_s` after the
    call began, the upload `persisted_after_s` after it."""

    def __init__(self, clock: Clock, call_s: float, staged_after_s: float,
                 persisted_after_s: float) -> None:
        self.clock = clock
        self.call_s, self.staged_after_s = call_s, staged_after_s
        self.persisted_after_s = persisted_after_s
        self.calls = 0

    def async_save(self, state_dict, **kwargs):
        self.calls += 1
        began = self.clock.now
        self.clock.now += self.call_s
        return AsyncSaveResponse(staging_completion=DueFuture(self.clock, began + self.staged_after_s),
                                 upload_completion=DueFuture(self.clock, began + self.persisted_after_s))


class FakeSteps:
    """The simulated training step: each takes `step_s` of the fake clock."""

    def __init__(self, clock: Clock, step_s: float) -> None:
        self.clock, self.step_s = clock, step_s

    def run(self, count: int, before_update) -> StepTimes:
        steps, waited = [], 0.0
        for index in range(count):
            self.clock.now += self.step_s / 2
            if index == 0:
                before = self.clock.now
                before_update()  # the first update waits for the staging
                waited = self.clock.now - before
            self.clock.now += self.step_s / 2
            steps.append(self.step_s)
        return StepTimes(steps, waited)


@pytest.fixture
def clock():
    clock = Clock()
    with mock.patch.object(async_save.time, "monotonic", clock.monotonic):
        yield clock


def saver(fake: FakeDcp, steps: FakeSteps | TrainStep | None = None, cadence: int = 0):
    with mock.patch.object(async_save, "stager_reusable", return_value=True):
        made: Any = async_save.AsyncSaver(AsyncSaveConfig(), torch.device("cpu"), 0.0)
    made.group, made.stager = object(), None  # "prepared": no process group needed
    made.train_step, made.cadence = steps, cadence
    return made


def test_a_save_with_no_training_waits_for_staging_then_upload(clock):
    fake = FakeDcp(clock, call_s=0.25, staged_after_s=0.75, persisted_after_s=2.0)
    with mock.patch.object(async_save, "dcp", fake):
        timing = saver(fake).save({}, writer=None, begin_mono=clock.now, baseline_s=[])
    assert timing.blocked_s == 0.25
    assert timing.staged_s == 0.75
    assert timing.stall_s == 0.75  # the next update waits for the staged copy
    assert timing.persisted_s == 2.0 and timing.end_mono == 102.0
    assert timing.previous_wait_s == 0.0


def test_a_cadence_overlaps_the_upload_and_the_next_save_waits_for_it(clock):
    fake = FakeDcp(clock, call_s=0.5, staged_after_s=1.0, persisted_after_s=10.0)
    made = saver(fake, FakeSteps(clock, step_s=2.0), cadence=3)
    with mock.patch.object(async_save, "dcp", fake):
        first = made.save({}, writer=None, begin_mono=clock.now, baseline_s=[1.0, 1.0])
        # 3 steps of 2 s from 100.5 (the first update waits for staging at 101.0): 106.5
        assert first.end_mono is None and clock.now == 106.5
        assert first.stall_s == 1.0 and first.interval_s == 6.5
        assert first.train_lost_s == 6.5 - 3 * 1.0
        second = made.save({}, writer=None, begin_mono=clock.now, baseline_s=[1.0, 1.0])
    # the first upload persists at 110.0: the second save waited 3.5 s for it
    assert second.previous_wait_s == 3.5
    assert second.previous_end_mono == 110.0
    assert second.blocked_s == 3.5 + 0.5  # the wait is inside the call's blocked time
    assert made.finish(first).persisted_s == 10.0


def test_step_slowdown_is_compute_time_alone_and_the_staging_wait_is_reported_apart(clock):
    """The real TrainStep on the fake clock (each matmul takes 0.5 s of it): the first step
    computes 1 s, waits 1.5 s for staging before its update, and is as fast as the
    baseline. Its wait is a stall (train_lost_s), not interference: slowdown 0, not
    (3.5 + 2 + 2) / 3 / 2 - 1 = 0.25 as when the wait was counted in the step."""
    fake = FakeDcp(clock, call_s=0.5, staged_after_s=3.0, persisted_after_s=20.0)
    steps = TrainStep(torch.device("cpu"), step_s=1.0)
    steps._a = steps._b = torch.zeros(1, 1)
    steps.matmuls = 2

    def matmul(a, b):
        clock.now += 0.5
        return a

    made = saver(fake, steps, cadence=3)
    with mock.patch.object(async_save, "dcp", fake), \
            mock.patch.object(train_step.time, "perf_counter", clock.monotonic), \
            mock.patch.object(train_step.torch, "mm", matmul):
        baseline = steps.baseline(2)
        assert baseline == [1.0, 1.0]
        begin = clock.now
        timing = made.save({}, writer=None, begin_mono=begin, baseline_s=baseline)
    # 0.5 s call, step 1: 1 s compute, 1.5 s wait (staged at +3.0), steps 2 and 3: 1 s each
    assert timing.train_wait_s == 1.5
    assert timing.train_step_slowdown == 0.0
    assert timing.interval_s == 0.5 + 1.0 + 1.5 + 2.0
    assert timing.train_lost_s == timing.interval_s - 3 * 1.0  # the call and the wait
    assert timing.stall_s == 3.0
@pytest.mark.parametrize("reusable", [True, False])
def test_a_save_records_whether_torchs_stager_was_renewed_for_it(clock, reusable):
    """torch 2.11's stager stages once (stager_reusable() is False there): every save then
    runs on a fresh stager and allocates its staging buffers again; the sample says so."""
    from dcp_fsdp.rank.sample_build import fill_save_figures
    from dcp_fsdp.telemetry.records import Sample

    fake = FakeDcp(clock, call_s=0.25, staged_after_s=0.5, persisted_after_s=1.0)
    made = saver(fake)
    made.reuse_stager = reusable  # what prepare()'s probe found
    with mock.patch.object(async_save, "dcp", fake):
        timing = made.save({}, writer=None, begin_mono=clock.now, baseline_s=[])
    assert timing.stager_renewed is (not reusable)
    sample = Sample(op="save", iteration=1, suffix="s", rank=0, host="h", begin_wall_s=0.0,
                    end_wall_s=1.0, begin_mono_s=0.0, end_mono_s=1.0, duration_s=1.0, bytes=1,
                    barrier_wait_s=0.0)
    fill_save_figures(sample, "async", timing, unreported=False)
    assert sample.stager_renewed is (not reusable)


class _UntouchableMetadata:
    """A checkpoint's global Metadata that must not be walked."""

    @property
    def storage_data(self):
        raise AssertionError("the Metadata was walked although the daemon reported the bytes")


def test_the_daemons_report_is_the_written_bytes_and_the_metadata_is_walked_only_without_it():
    """At 1,000 ranks the returned Metadata holds every rank's entries: each rank walking it
    after every save is a cost that grows with the world size, for a figure the daemon's
    timed writer already reported (its timeline file)."""
    from types import SimpleNamespace

    from dcp_fsdp.rank.sample_build import fill_save_figures
    from dcp_fsdp.telemetry.records import Sample

    def sample() -> Sample:
        return Sample(op="save", iteration=1, suffix="s", rank=1, host="h", begin_wall_s=0.0,
                      end_wall_s=1.0, begin_mono_s=0.0, end_mono_s=1.0, duration_s=1.0, bytes=1,
                      barrier_wait_s=0.0, written_bytes=70)

    reported = sample()
    timing = async_save.AsyncTiming(0.0, None, 1.0, 0.0, 1.0, metadata=_UntouchableMetadata())
    fill_save_figures(reported, "async", timing, unreported=False)
    assert reported.written_bytes == 70 and timing.metadata is None

    info = SimpleNamespace(relative_path="__1_0.distcp", length=30)
    walked = sample()
    timing = async_save.AsyncTiming(0.0, None, 1.0, 0.0, 1.0,
                                    metadata=SimpleNamespace(storage_data={"a": info, "b": info}))
    fill_save_figures(walked, "async", timing, unreported=True)
    assert walked.written_bytes == 60 and timing.metadata is None


def test_a_sample_handle_waits_once_and_keeps_its_sample():
    from dcp_fsdp.rank.loop import SampleHandle

    from dcp_fsdp.telemetry.records import Sample

    sample = Sample(op="save", iteration=1, suffix="s", rank=0, host="h", begin_wall_s=0.0,
                    end_wall_s=1.0, begin_mono_s=0.0, end_mono_s=1.0, duration_s=1.0, bytes=1,
                    barrier_wait_s=0.0)
    calls: list[str] = []

    def wait_for_upload() -> Sample:
        calls.append("waited")
        return sample

    handle = SampleHandle(wait_for_upload)
    assert not handle.done() and calls == []
    assert handle.result() is handle.result() is sample
    assert handle.done() and calls == ["waited"]
