"""What the timed DCP writer and reader (storage/timed_dcp.py) record: each hook's span, the
time inside the object streams, the bytes moved. Plain data, no torch: it crosses a pickle
(the process checkpointer's daemon writes its timeline to a file the rank reads back).

The loop derives each rank's phases from the spans and splits io_s by the clocks (upload_s,
storage_s, target_copy_s: docs/metrics.md, "Per-rank fields and phases"). A `BusyClock` costs
two perf_counter reads and one uncontended lock per call (calls carry whole tensors or
buffer-sized chunks), and threads > 1 never count an instant twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class BusyClock:
    """Wall time during which at least one timed call was in progress (thread-safe)."""

    def __init__(self, total: float = 0.0) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._since = 0.0
        self._total = total

    def enter(self) -> None:
        now = time.perf_counter()
        with self._lock:
            if self._active == 0:
                self._since = now
            self._active += 1

    def exit(self, *exc_info: object) -> None:
        now = time.perf_counter()
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self._total += now - self._since

    __enter__ = enter  # `with clock:` is enter() and, however it ends, exit()
    __exit__ = exit

    def total_s(self) -> float:
        """Closed intervals only: read it when no call is in progress."""
        with self._lock:
            return self._total

    def __reduce__(self) -> tuple[Any, ...]:  # a lock does not pickle (process checkpointer)
        return type(self), (self.total_s(),)


class ByteCounter:
    """Bytes counted under a lock (several threads add), and the most at once: through the object
    streams so far (the progress heartbeat reads it while an operation runs), or what the
    read-ahead reader holds, fetched or in flight (it adds a negative count as it frees them)."""

    def __init__(self, total: int = 0) -> None:
        self.total = self.peak = total
        self._lock = threading.Lock()

    def __reduce__(self) -> tuple[Any, ...]:  # a lock does not pickle (process checkpointer)
        return type(self), (self.total,)

    def add(self, count: int) -> None:
        with self._lock:
            self.total += count
            self.peak = max(self.peak, self.total)


@dataclasses.dataclass
class HookTimeline:
    """Monotonic start/end of each hook call (seconds), and bytes written or read."""

    spans: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    io_bytes: int = 0
    # object path -> bytes written through the writer's streams (data files and .metadata)
    object_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    # time inside the client's storage calls (see the module docstring)
    storage_clock: BusyClock = dataclasses.field(default_factory=BusyClock)
    # storage_clock's total over the data-I/O hook (write_data / read_data), seconds
    storage_s: float | None = None
    # load: seconds copying loaded tensors into the live ones (TimedLoadPlanner)
    target_copy_s: float | None = None
    # load through the tool's reader (storage/read_ahead.py): the most bytes it held at once
    read_ahead_peak_bytes: int | None = None
    # the tool's reader clocks its own copies into the live tensors (on its threads)
    target_copy_by_reader: bool = False
    # multi-storage-client loads: "whole" (downloaded whole, under 512 MiB) and/or "ranged"
    msc_reads: set[str] = dataclasses.field(default_factory=set)
    # the first error an object stream's write or close raised: DCP's own error may hide it
    stream_error: str | None = None
    # bytes through the object streams so far (a load's io_bytes: its difference over read_data)
    moved: ByteCounter = dataclasses.field(default_factory=ByteCounter)
    # where a copy in another process (the process checkpointer's daemon) writes what it recorded
    dump_path: str | None = None

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

    def io_started(self) -> tuple[float, float, int]:
        """At the start of the data-I/O hook: (monotonic start, stream clock, bytes moved)."""
        return time.monotonic(), self.storage_clock.total_s(), self.moved.total

    def io_ended(self, hook: str, started: tuple[float, float, int]) -> None:
        start, busy_before, _ = started
        self.storage_s = self.storage_clock.total_s() - busy_before
        self.record(hook, start, time.monotonic())

    @contextlib.contextmanager
    def span(self, hook: str) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            self.record(hook, start, time.monotonic())

    # -- across processes: CLOCK_MONOTONIC is one clock for every process of a host --------
    def dump(self) -> None:
        """Write what this copy recorded to `dump_path` (atomically), if it has one."""
        if self.dump_path is None:
            return
        data = {"spans": self.spans, "io_bytes": self.io_bytes,
                "object_bytes": self.object_bytes, "storage_s": self.storage_s,
                "moved_bytes": self.moved.total, "stream_error": self.stream_error,
                "target_copy_s": self.target_copy_s}
        tmp = Path(f"{self.dump_path}.tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(self.dump_path)

    def load_dump(self) -> bool:
        """Take in what another process's copy wrote to `dump_path`; False if it wrote
        nothing (the timed writer did not run there)."""
        if self.dump_path is None:
            return False
        try:
            data = json.loads(Path(self.dump_path).read_text())
        except (OSError, ValueError):
            return False
        self.spans.update({name: (float(a), float(b)) for name, (a, b) in data["spans"].items()})
        self.io_bytes = int(data["io_bytes"])
        self.object_bytes.update({str(k): int(v) for k, v in data["object_bytes"].items()})
        self.storage_s = data["storage_s"]
        self.moved.total = int(data["moved_bytes"])
        self.stream_error = data.get("stream_error")
        self.target_copy_s = data.get("target_copy_s")
        return True
