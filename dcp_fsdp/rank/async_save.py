"""save_mode=async: dcp.async_save, timed as a training loop sees it.

One save, per rank (monotonic clock, from the call after the aligning barrier):
  previous_wait_s  waiting for the previous save's upload (a rank holds one in flight)
  blocked_s        the call until control is back in the training loop (staging, or only
                   scheduling it with async_staging, plus previous_wait_s)
  staged_s         until the staged copy is complete, when torch reports it separately
                   (async_staging: AsyncSaveResponse.staging_completion)
  persisted_s      until the upload future is done: every object written and the coordinator's
                   .metadata committed. Only then is the checkpoint loadable, so the loop waits
                   for it before the manifest, the checksums or a load.

With train_step_s > 0 a simulated training step (train_step.py) runs back to back while the
upload proceeds: train_steps, and train_step_slowdown against a baseline taken just before.

The upload runs DCP's collectives on a gloo group of its own, created once (untimed), so the
training loop's group is never used from two threads at once (and nccl-only default groups,
which async_save refuses, still work). The process checkpointer's daemon is started once,
untimed, before the first timed save, and is made to die with its rank: a killed rank must
not leave an uploader behind that could still commit .metadata.
"""

from __future__ import annotations

import dataclasses
import re
import time
from concurrent.futures import Future
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from dcp_fsdp.config.schema import AsyncCheckpointer, AsyncSaveConfig
from dcp_fsdp.rank.train_step import TrainStep, slowdown

_RANK_FILE = re.compile(r"(?:^|/)__(\d+)_\d+\.distcp$")


@dataclasses.dataclass
class AsyncTiming:
    blocked_s: float
    staged_s: float | None
    persisted_s: float
    previous_wait_s: float
    end_mono: float  # persisted
    train_steps: int | None = None
    train_step_slowdown: float | None = None
    bytes_written: int | None = None  # this rank's data bytes, from the returned Metadata


def staging_options(config: AsyncSaveConfig, accelerator: bool) -> StagingOptions:
    """torch's StagingOptions. Pinned memory and non-blocking copies only with an
    accelerator (pinned host memory helps device-to-host copies alone, and torch refuses
    non-blocking copies without one); shared memory only for the process checkpointer (it
    hands the staged copy to the daemon without pickling the bytes; a thread needs none, and
    a container's small /dev/shm would fail a large model)."""
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
    total = 0
    for info in storage.values():
        match = _RANK_FILE.search(str(getattr(info, "relative_path", "")))
        if match and int(match[1]) == rank:
            total += int(getattr(info, "length", 0) or 0)
    return total


class AsyncSaver:
    """One per rank: the stager, the upload group, the daemon and the step (all untimed)."""

    def __init__(self, config: AsyncSaveConfig, device: torch.device, train_step_s: float,
                 rank: int) -> None:
        self.config = config
        self.rank = rank
        self.process = config.checkpointer == AsyncCheckpointer.process
        self.options = staging_options(config, torch.accelerator.is_available())
        self.stager: DefaultStager | None = None
        self.reuse_stager = True  # False where torch's stager stages once (stager_reusable)
        self.group = None
        self.train_step = TrainStep(device, train_step_s) if train_step_s > 0 else None
        self._pending: Future | None = None

    @property
    def pickles_writer(self) -> bool:
        """The process checkpointer sends the writer to its daemon: it must stay picklable
        (no instance-level hook wrappers), and a client built here would be of no use there."""
        return self.process

    def prepare(self) -> None:
        """Before the first timed save, on every rank (collective): the upload group, the
        stager, the daemon, the step calibration."""
        if self.group is not None:
            return
        self.group = dist.new_group(backend="gloo")
        self.reuse_stager = stager_reusable()
        self.stager = DefaultStager(self.options)
        if self.process:
            # What async_save would do inside the first timed save: spawn the daemon and
            # join its process group (seconds). Started from the main thread, which lives as
            # long as the rank (PDEATHSIG follows the creating thread). The thread
            # checkpointer never touches the daemon's internals.
            from dcp_fsdp import compat

            compat.start_checkpoint_daemon(self.group)
        if self.train_step is not None:
            self.train_step.calibrate()

    def renew_stager(self) -> None:
        """A fresh stager for the next save, where torch's cannot stage twice. Called once
        the save is persisted, so its (small) cost lies outside every timed region; its
        staging cache would be emptied by torch on that release anyway."""
        self.stager.close()
        self.stager = DefaultStager(self.options)

    def baseline(self) -> list[float]:
        """Right before a save (untimed): step times with no checkpoint in flight."""
        return self.train_step.baseline() if self.train_step is not None else []

    def wait_previous(self) -> float:
        if self._pending is None:
            return 0.0
        start = time.monotonic()
        try:
            self._pending.result()
        finally:
            self._pending = None
        return time.monotonic() - start

    def save(self, state_dict: dict, writer: Any, begin_mono: float,
             baseline_s: list[float]) -> AsyncTiming:
        """One async save from `begin_mono` (just after the barrier) until it is persisted."""
        previous_wait_s = self.wait_previous()
        response = dcp.async_save(
            state_dict, storage_writer=writer, process_group=self.group,
            async_checkpointer_type=(AsyncCheckpointerType.PROCESS if self.process
                                     else AsyncCheckpointerType.THREAD),
            async_stager=self.stager)
        blocked_end = time.monotonic()
        marks: dict[str, float] = {}

        def mark(name: str) -> Callable[[Future], None]:
            return lambda _future: marks.setdefault(name, time.monotonic())

        if isinstance(response, AsyncSaveResponse):
            response.staging_completion.add_done_callback(mark("staged"))
            upload = response.upload_completion
        else:
            upload = response
        upload.add_done_callback(mark("persisted"))
        self._pending = upload
        steps = self.train_step.run_until(upload.done) if self.train_step is not None else None
        metadata = upload.result()  # a failed upload raises here, as dcp.save would
        self._pending = None
        persisted = marks.get("persisted", time.monotonic())
        staged = marks.get("staged")
        if not self.reuse_stager:
            self.renew_stager()  # after the marks: outside the timed region
        return AsyncTiming(
            blocked_s=blocked_end - begin_mono,
            staged_s=None if staged is None else staged - begin_mono,
            persisted_s=persisted - begin_mono, previous_wait_s=previous_wait_s,
            end_mono=persisted,
            train_steps=None if steps is None else len(steps),
            train_step_slowdown=None if steps is None else slowdown(steps, baseline_s),
            bytes_written=rank_bytes(metadata, self.rank))
