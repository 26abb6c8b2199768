"""Time the hooks DCP calls on a storage writer/reader, and count the bytes moved.

We wrap the hook methods of one writer/reader instance (torch is not patched),
keeping their signatures (DCP inspects them) via functools.wraps. From the
timestamps the loop derives where each rank spent a save or load: planning
(local and global plan, including the collective), data I/O, and the commit
(metadata write, gathered by the coordinator) or metadata read.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any


@dataclasses.dataclass
class HookTimeline:
    """Monotonic start/end of each hook call (seconds), and bytes written or read."""

    spans: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    io_bytes: int = 0

    def duration_s(self, hook: str) -> float | None:
        span = self.spans.get(hook)
        return None if span is None else span[1] - span[0]


def _timed(timeline: HookTimeline, name: str, method):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        start = time.monotonic()
        try:
            return method(*args, **kwargs)
        finally:
            timeline.spans[name] = (start, time.monotonic())
    return wrapper


def instrument_writer(writer) -> HookTimeline:
    timeline = HookTimeline()
    for hook in ("prepare_local_plan", "prepare_global_plan", "finish"):
        setattr(writer, hook, _timed(timeline, hook, getattr(writer, hook)))
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
            timeline.spans["write_data"] = (start, time.monotonic())

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
            timeline.spans["read_data"] = (start, time.monotonic())

    reader.read_data = timed_read_data
    return timeline
