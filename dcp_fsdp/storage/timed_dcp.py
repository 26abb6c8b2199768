"""DCP's storage writers and readers, timed: subclasses of the store's own classes that override
the hooks DCP calls and record each one's span on a `HookTimeline` (docs/architecture.md,
"Timing DCP"). Nothing is assigned on an instance after it is built, so a writer pickled into
the process checkpointer's daemon is timed there too (`HookTimeline.dump_path`). Ranks only.
"""

from __future__ import annotations

import inspect
import time
from typing import TYPE_CHECKING, Any, TypeVar

from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter

from dcp_fsdp.errors import StorageStreamError
from dcp_fsdp.process.failures import answered
from dcp_fsdp.storage.read_ahead import ReadAhead
from dcp_fsdp.storage.timed_fs import TimedFileSystem, TimedReadStream
from dcp_fsdp.storage.timeline import HookTimeline

if TYPE_CHECKING:
    import torch

    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

    _Plan = TypeVar("_Plan", SavePlan, LoadPlan)  # the writer's plans, or the reader's


class _TimedPlanning:
    """The timed writer's and reader's `timeline=`, `TimedFileSystem` and planning hooks."""

    timeline: HookTimeline
    fs: Any
    # where this client's reads wait for storage (storage/timed_fs.py): its class says
    read_stream: type[TimedReadStream] = TimedReadStream

    def __init__(self, *args: Any, timeline: HookTimeline, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # the DCP class after the mixin builds self.fs
        self.timeline = timeline
        self.fs = TimedFileSystem(self.fs, timeline, self.read_stream)

    def prepare_local_plan(self, plan: _Plan) -> _Plan:
        with self.timeline.span("prepare_local_plan"):
            return super().prepare_local_plan(plan)  # type: ignore[misc]  # a mixin (as finish)

    def prepare_global_plan(self, plans: list[_Plan]) -> list[_Plan]:
        with self.timeline.span("prepare_global_plan"):
            return super().prepare_global_plan(plans)  # type: ignore[misc]  # a mixin (as finish)


class TimedWriter(_TimedPlanning):
    """Mixin before a DCP `FileSystemWriter` subclass: its hooks and streams timed on `self.timeline`."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        started = self.timeline.io_started()
        try:
            future = super().write_data(plan, planner)  # type: ignore[misc]  # a mixin (as finish)
            future.wait()  # DCP waits right after this call anyway; we time the I/O itself
            self.timeline.io_bytes = sum(
                getattr(result.storage_data, "length", 0) or 0 for result in future.value())
            return future
        except Exception as error:
            first = _stream_error_first(self.timeline.stream_error, error)
            said: Exception | None = answered(first or error) or first
            if said is not None:
                raise said from None  # its text whole: DCP pickles errors without their cause
            raise
        finally:
            self.timeline.io_ended("write_data", started)
            self.timeline.dump()  # in the process checkpointer's daemon: for the rank

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        with self.timeline.span("finish"):
            super().finish(metadata, results)  # type: ignore[misc]  # a mixin: the DCP class after it has it
        self.timeline.dump()


def _stream_error_first(hidden: str | None, error: Exception) -> StorageStreamError | None:
    """Where an object stream failed first (`hidden`, the timeline's) and DCP raised something
    else (torch's zip writer: "unexpected pos"), the stream's error: the cause (trial case 20);
    None where no stream failed, or `error` is its error."""
    said = " ".join(str(error).split())
    if hidden is None or hidden.split(": ", 1)[-1][:200] in said:
        return None
    return StorageStreamError(f"{hidden} (then DCP: {type(error).__name__}: {said[:200]})")


class TimedReader(_TimedPlanning):
    """Mixin before a DCP `FileSystemReader` subclass: times its hooks on `self.timeline`; a
    load's bytes are what came through the object streams during read_data (not the plan's)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        parent = super().read_metadata  # type: ignore[misc]  # a mixin (as finish)
        if kwargs and "kwargs" not in inspect.signature(parent).parameters:
            kwargs = {}  # DCP passes rank= and process_group= only where the reader takes them
        with self.timeline.span("read_metadata"):
            return parent(*args, **kwargs)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        started = self.timeline.io_started()
        try:
            future = super().read_data(plan, planner)  # type: ignore[misc]  # a mixin (as finish)
            future.wait()
            return future
        except Exception as error:
            led = answered(error)
            if led is not None:
                raise led from None
            raise
        finally:
            self.timeline.io_bytes = self.timeline.moved.total - started[2]
            self.timeline.io_ended("read_data", started)


class TimedLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with the copy of each loaded tensor into the live one timed:
    DCP's reader `target.copy_()`s between `resolve_tensor` and `commit_tensor`, so the time
    between the two calls is that copy (`HookTimeline.target_copy_s`)."""

    def __init__(self, timeline: HookTimeline) -> None:
        super().__init__()
        self._timeline = timeline
        self._resolved_at: float | None = None

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        tensor = super().resolve_tensor(read_item)
        self._resolved_at = time.perf_counter()
        return tensor

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        # not where the tool's reader copies (on its threads)
        if self._resolved_at is not None and not self._timeline.target_copy_by_reader:
            copied_s = time.perf_counter() - self._resolved_at
            self._timeline.target_copy_s = (self._timeline.target_copy_s or 0.0) + copied_s
        self._resolved_at = None
        super().commit_tensor(read_item, tensor)


class TimedFileSystemWriter(TimedWriter, FileSystemWriter):
    pass  # the timeline= argument and set-up: _TimedPlanning.__init__


class TimedFileSystemReader(TimedReader, FileSystemReader):
    pass


class TimedReadAheadFileSystemReader(TimedReader, ReadAhead, FileSystemReader):
    """The tool's reader (storage.read_ahead=N) over files: each item read straight into its target."""

    lands_directly = True
