"""save_mode=async: dcp.async_save, timed as a training loop sees it (docs/async.md defines each
figure). Without a cadence each save waits for its own upload while steps run; with
async_save.steps_between_saves=K the loop runs K steps and moves on with the upload in flight,
as a training loop does. The upload runs DCP's collectives on a gloo group of its own, so the
training loop's group is never used from two threads at once (and nccl-only default groups,
which async_save refuses, still work). The process checkpointer's daemon is started untimed
and dies with its rank: a killed rank must not leave an uploader that could commit .metadata.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from dcp_fsdp import compat
from dcp_fsdp.config.schema import AsyncCheckpointer, AsyncSaveConfig
from dcp_fsdp.process.lifeline import DiesWithParent
from dcp_fsdp.rank.device import sync_device
from dcp_fsdp.rank.train_step import StepTimes, TrainStep, slowdown


@dataclasses.dataclass
class AsyncTiming:
    blocked_s: float
    staged_s: float | None
    persisted_s: float
    previous_wait_s: float
    end_mono: float | None  # persisted (None while the upload is in flight)
    train_steps: int | None = None
    train_step_slowdown: float | None = None
    # the Metadata the upload returned, until the sample is built: this rank's written bytes
    # where the daemon's timed writer reported none (sample_build.fill_save_figures)
    metadata: Any = dataclasses.field(default=None, repr=False)
    stall_s: float | None = None
    interval_s: float | None = None
    train_lost_s: float | None = None
    train_lost_share: float | None = None
    train_wait_s: float | None = None
    stager_renewed: bool | None = None  # torch's stager stages once: a fresh one per save
    # In flight (cadence): the upload, its completion marks, and the previous upload's end.
    begin_mono: float = 0.0
    upload: Future | None = dataclasses.field(default=None, repr=False)
    marks: dict = dataclasses.field(default_factory=dict, repr=False)
    previous_end_mono: float | None = None


def staging_options(config: AsyncSaveConfig, accelerator: bool) -> StagingOptions:
    """torch's StagingOptions: pinned memory and non-blocking copies only with an accelerator
    (torch refuses the latter without one); shared memory only for the process checkpointer (a
    thread needs none, and a container's small /dev/shm would fail a large model)."""
    process = config.checkpointer == AsyncCheckpointer.process
    return StagingOptions(use_pinned_memory=config.pinned_memory and accelerator,
                          use_shared_memory=config.shared_memory and process,
                          use_async_staging=config.async_staging,
                          use_non_blocking_copy=config.non_blocking_copy and accelerator)


def stager_reusable() -> bool:
    """Whether one DefaultStager can stage twice. torch 2.11's cannot: its _stage() ends by
    closing its StateDictStager, which clears the deepcopy table built only in __init__, so
    the second save of a run fails with `KeyError: <class 'type'>` (pytorch/pytorch#183413).
    Probed on a two-entry state dict (milliseconds, untimed), not by version number."""
    probe = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                         use_async_staging=False, use_non_blocking_copy=False))
    try:
        for _ in range(2):
            probe.stage({"tensor": torch.zeros(1), "nested": {"step": 1}})
    except Exception:  # any failure of the second stage: do not reuse
        return False
    finally:
        probe.close()
    return True


def rank_bytes(metadata: Any, rank: int) -> int | None:
    """Bytes of this rank's data files in a checkpoint's Metadata (`__<rank>_<n>.distcp`)."""
    storage = getattr(metadata, "storage_data", None)
    if not storage:
        return None
    return sum(info.length for info in storage.values() if compat.saving_rank(info.relative_path) == rank)


def _fill_training(timing: AsyncTiming, steps: StepTimes, baseline_s: list[float],
                   interval_s: float) -> None:
    """What the steps until the next save paid: slowdown (compute alone), staging wait, time lost."""
    timing.train_wait_s = steps.wait_s
    steps_s = steps.compute_s
    timing.train_steps = len(steps_s)
    timing.train_step_slowdown = slowdown(steps_s, baseline_s)
    timing.interval_s = interval_s
    if baseline_s and interval_s > 0:
        baseline_step_s = sum(baseline_s) / len(baseline_s)
        timing.train_lost_s = interval_s - len(steps_s) * baseline_step_s
        timing.train_lost_share = timing.train_lost_s / interval_s


class AsyncSaver:
    """One per rank: the stager, the upload group, the daemon and the step (all untimed)."""

    def __init__(self, config: AsyncSaveConfig, device: torch.device, train_step_s: float) -> None:
        self.process = config.checkpointer == AsyncCheckpointer.process
        self.device = device
        # Pinned staging by the rank's device, not the machine's: a gloo rank on a GPU host
        # would pin host memory, and open a CUDA context on GPU 0 to do it.
        self.options = staging_options(config, accelerator=device.type != "cpu")
        self.stager: DefaultStager | None = None
        self.reuse_stager = True  # False where torch's stager stages once (stager_reusable)
        self._stager_used = False
        self.group = None
        self.train_step = (TrainStep(device, train_step_s, config.train_step_work)
                           if train_step_s > 0 else None)
        # Steps between saves (a cadence: the upload outlives the save call), or 0.
        self.cadence = config.steps_between_saves if self.train_step is not None else 0
        self._pending: AsyncTiming | None = None  # the last save, until its upload is waited for
        self._baseline_s: list[float] | None = None

    def prepare(self) -> None:
        """Before the first timed save, on every rank (collective): group, stager, daemon, step."""
        if self.group is not None:
            return
        self.group = dist.new_group(backend="gloo")
        self.reuse_stager = stager_reusable()
        self.stager = self.new_stager()
        if self.process:
            # What async_save would do inside the first timed save (seconds), from the main
            # thread, which lives as long as the rank (PDEATHSIG follows the creating thread).
            compat.start_checkpoint_daemon(self.group, DiesWithParent)
        if self.train_step is not None:
            self.train_step.calibrate()

    def new_stager(self) -> DefaultStager:
        """torch's stager; on a CPU rank compat.host_stager's (torch's opens a CUDA context on a GPU host)."""
        if self.device.type == "cpu" and self.options.use_async_staging:
            return compat.host_stager(self.options)
        return DefaultStager(self.options)

    def renew_stager(self) -> None:
        """A fresh stager where torch's cannot stage twice, once the previous save is persisted
        (with a cadence, in the next save's wait)."""
        if self.reuse_stager or not self._stager_used:
            return
        if self.stager is not None:
            self.stager.close()
        self.stager = self.new_stager()
        self._stager_used = False

    def baseline(self) -> list[float]:
        """Right before a save (untimed): step times with no checkpoint in flight. With a
        cadence the previous upload may still run here: then the last clean baseline holds."""
        if self.train_step is None:
            return []
        in_flight = self._pending is not None and self._pending.upload is not None and \
            not self._pending.upload.done()
        if in_flight and self._baseline_s is not None:
            return self._baseline_s
        self._baseline_s = self.train_step.baseline()
        return self._baseline_s

    def wait_previous(self) -> tuple[float, float | None]:
        """Wait for the previous save's upload (raises if it failed): (seconds waited, its end)."""
        previous, self._pending = self._pending, None
        if previous is None or previous.upload is None:
            return 0.0, None
        start = time.monotonic()
        previous.upload.result()
        self.renew_stager()
        return time.monotonic() - start, previous.marks.get("persisted", time.monotonic())

    def finish(self, timing: AsyncTiming) -> AsyncTiming:
        """Wait for `timing`'s upload (unless a later save did) and fill its persisted figures."""
        if timing.upload is None:
            raise RuntimeError("finish() of a save that has no upload in flight")
        metadata = timing.upload.result()  # a failed upload raises here, as dcp.save would
        if self._pending is timing:  # no later save holds the stager yet
            self._pending = None
            self.renew_stager()
        persisted = timing.marks.get("persisted", time.monotonic())
        timing.persisted_s = persisted - timing.begin_mono
        timing.end_mono = persisted
        timing.metadata = metadata
        timing.upload = None
        return timing

    def save(self, state_dict: dict, writer: Any, begin_mono: float,
             baseline_s: list[float]) -> AsyncTiming:
        """One async save from `begin_mono` (the barrier's release), persisted on return; with a
        cadence, after its steps, the upload maybe still in flight (end_mono None: see `finish`)."""
        previous_wait_s, previous_end = self.wait_previous()
        response = dcp.async_save(
            state_dict, storage_writer=writer, process_group=self.group,
            async_checkpointer_type=(AsyncCheckpointerType.PROCESS if self.process
                                     else AsyncCheckpointerType.THREAD),
            async_stager=self.stager)
        # No device synchronize here: with async staging the copies run on torch's staging
        # stream after the call returns, and a device-wide sync would put them in blocked_s.
        blocked_end = time.monotonic()
        self._stager_used = True
        marks: dict[str, float] = {}  # when each future completed (first time only)
        staging = None
        if isinstance(response, AsyncSaveResponse):
            staging = response.staging_completion
            staging.add_done_callback(lambda _: marks.setdefault("staged", time.monotonic()))
            upload = response.upload_completion
        else:
            upload = response
        upload.add_done_callback(lambda _: marks.setdefault("persisted", time.monotonic()))
        timing = AsyncTiming(blocked_s=blocked_end - begin_mono, staged_s=None, persisted_s=0.0,
                             previous_wait_s=previous_wait_s, end_mono=None,
                             begin_mono=begin_mono, upload=upload, marks=marks,
                             previous_end_mono=previous_end,
                             stager_renewed=not self.reuse_stager)
        self._pending = timing

        def staging_done() -> None:  # what an optimizer step must wait for before updating
            if staging is not None:
                staging.result()
                sync_device(self.device)  # (torch syncs its staging stream; any other copy)
                marks.setdefault("staged", time.monotonic())  # its callback may not have run yet

        steps = None
        if self.train_step is not None:
            steps = (self.train_step.run(self.cadence, staging_done) if self.cadence
                     else self.train_step.run_until(upload.done, staging_done))
        staging_done()  # (done where a step ran; without steps the next update would wait here)
        steps_end = time.monotonic()
        staged = marks.get("staged")
        timing.staged_s = None if staged is None else staged - begin_mono
        timing.stall_s = max(blocked_end, staged or blocked_end) - begin_mono
        if steps is not None:
            _fill_training(timing, steps, baseline_s,
                           (steps_end if steps.compute_s else max(blocked_end, staged or 0.0)) - begin_mono)
        return timing if self.cadence else self.finish(timing)
