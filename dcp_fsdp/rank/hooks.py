"""Time the hooks DCP calls on a storage writer/reader, and count the bytes moved.

We wrap the hook methods of one writer/reader instance (torch is not patched),
keeping their signatures (DCP inspects them) via functools.wraps. From the
timestamps the loop derives where each rank spent a save or load: planning
(local and global plan, including the collective), data I/O, and the commit
(metadata write, gathered by the coordinator) or metadata read.

Phases, per rank (monotonic clock; see loop.CheckpointLoop._sample):
  save: plan_s   = dcp.save start -> write_data start (set-up, local plan, the gather to
                   the coordinator, global plan, the scatter back: a collective)
        io_s     = write_data (every object of this rank written, futures waited on)
        commit_s = write_data end -> dcp.save returns (results gathered, the coordinator's
                   `finish` writes .metadata, the broadcast back: a collective)
        finish_s = the coordinator's `finish` alone (.metadata upload + rename)
  load: plan_s   = dcp.load start -> read_data start (includes metadata_s, reading .metadata)
        io_s     = read_data
        commit_s = read_data end -> dcp.load returns (the closing all_gather: waiting for
                   the slowest rank)

The writer's file-system `create_stream` is wrapped too, to count the bytes of every
object this rank uploads (the connector's request log gives no upload sizes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import time
from typing import Any


@dataclasses.dataclass
class HookTimeline:
    """Monotonic start/end of each hook call (seconds), and bytes written or read."""

    spans: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    io_bytes: int = 0
    # object path -> bytes written through the writer's streams (data files and .metadata)
    object_bytes: dict[str, int] = dataclasses.field(default_factory=dict)

    def duration_s(self, hook: str) -> float | None:
        span = self.spans.get(hook)
        return None if span is None else span[1] - span[0]

    def record(self, name: str, start: float, end: float) -> None:
        """A hook called more than once (read_metadata's fallback) spans first start to last end."""
        previous = self.spans.get(name)
        self.spans[name] = (start if previous is None else previous[0], end)

    @property
    def uploaded_bytes(self) -> int | None:
        return sum(self.object_bytes.values()) if self.object_bytes else None


def _timed(timeline: HookTimeline, name: str, method):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        start = time.monotonic()
        try:
            return method(*args, **kwargs)
        finally:
            timeline.record(name, start, time.monotonic())
    return wrapper


def _count_uploads(writer, timeline: HookTimeline) -> None:
    """Wrap this writer's fs.create_stream: bytes of each object it writes ("wb")."""
    fs = getattr(writer, "fs", None)
    create_stream = getattr(fs, "create_stream", None)
    if create_stream is None:
        return
    lock = threading.Lock()

    @contextlib.contextmanager
    def counting_create_stream(path, mode):
        with create_stream(path, mode) as stream:
            yield stream
            if "w" in mode:
                try:
                    size = int(stream.tell())
                except Exception:  # a stream that cannot tell: leave it uncounted
                    return
                with lock:
                    timeline.object_bytes[str(path)] = size

    fs.create_stream = counting_create_stream


def instrument_writer(writer) -> HookTimeline:
    timeline = HookTimeline()
    for hook in ("prepare_local_plan", "prepare_global_plan", "finish"):
        setattr(writer, hook, _timed(timeline, hook, getattr(writer, hook)))
    _count_uploads(writer, timeline)
    write_data = writer.write_data

    @functools.wraps(write_data)
    def timed_write_data(plan, planner):
        start = time.monotonic()
        try:
            future = write_data(plan, planner)
            future.wait()  # DCP waits right after this call anyway; we time the I/O itself
            timeline.io_bytes = sum(
                getattr(result.storage_data, "length", 0) or 0 for result in future.value())
            return future
        finally:
            timeline.record("write_data", start, time.monotonic())

    writer.write_data = timed_write_data
    return timeline


def instrument_reader(reader) -> HookTimeline:
    timeline = HookTimeline()
    for hook in ("read_metadata", "prepare_local_plan", "prepare_global_plan"):
        setattr(reader, hook, _timed(timeline, hook, getattr(reader, hook)))
    read_data = reader.read_data

    @functools.wraps(read_data)
    def timed_read_data(plan, planner):
        start = time.monotonic()
        storage_data: dict[Any, Any] = getattr(reader, "storage_data", {}) or {}
        indices = {item.storage_index for item in plan.items}
        timeline.io_bytes = sum(getattr(storage_data.get(index), "length", 0) or 0
                                for index in indices)
        try:
            future = read_data(plan, planner)
            future.wait()
            return future
        finally:
            timeline.record("read_data", start, time.monotonic())

    reader.read_data = timed_read_data
    return timeline
