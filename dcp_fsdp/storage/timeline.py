"""What the timed DCP writer and reader (storage/timed_dcp.py) record: the span of each
hook DCP calls on them, the time inside the object streams, and the bytes moved. No torch
here: the records are plain data, and cross a pickle (the process checkpointer's daemon
writes its timeline to a file the rank reads back, `dump` / `load_dump`).

From the timestamps the loop derives where each rank spent a save or load: planning
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

The writer's and reader's file system is a `TimedFileSystem` (storage/timed_fs.py, with its
timed streams): it times the object streams and counts the bytes of every object this rank
uploads (the connector's request log gives no upload sizes).

Inside io_s (per rank; `BusyClock`: wall time with at least one call in progress, so
writer/reader threads > 1 never count an instant twice, and io_s - busy >= 0):
  save: upload_s        = inside the client's write() and close() on its object streams
                          (blocked on the upload, or handing bytes to it: the client's own
                          copy into its upload buffer; the page cache for fs)
        stage_s         = io_s - upload_s (DCP's own work: resolving, copying and
                          serialising tensors, torch.save into the stream)
  load: storage_s       = inside the storage client's calls for the next bytes, where that
                          client waits (`storage_clock`; storage/timed_fs.py and timed_s3.py
                          say where for each client): the connector's chunk iterator,
                          s3fs's fetches, MSC's download (any first call) and ranged reads,
                          the file system's read(). Network waits, and the client's own copy
                          of each part into a Python object (not separable from Python)
        target_copy_s   = copying each loaded tensor into the live one (DCP's
                          `target.copy_()`, timed between the planner's resolve_tensor and
                          commit_tensor: host-to-device on a GPU, a host copy on a CPU)
        deserialise_s   = io_s - storage_s - target_copy_s (DCP's own work: torch.load
                          of each item, its framing, the copies from the client's buffers
                          into fresh storages, and their page faults)
Two perf_counter reads and one uncontended lock per call (calls carry whole tensors or
buffer-sized chunks): nothing per byte.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterator


class BusyClock:
    """Wall time during which at least one timed call was in progress (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._since = 0.0
        self._total = 0.0

    def enter(self) -> None:
        now = time.perf_counter()
        with self._lock:
            if self._active == 0:
                self._since = now
            self._active += 1

    def exit(self) -> None:
        now = time.perf_counter()
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self._total += now - self._since

    def __enter__(self) -> None:  # `with clock:` is enter() and, however it ends, exit()
        self.enter()

    def __exit__(self, *exc_info: object) -> None:
        self.exit()

    def total_s(self) -> float:
        """Closed intervals only: read it when no call is in progress."""
        with self._lock:
            return self._total

    def __getstate__(self) -> dict[str, Any]:  # a lock does not pickle (process checkpointer)
        return {"total": self.total_s()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        self._total = state["total"]


class ByteCounter:
    """Bytes through the object streams so far: what the progress heartbeat reads while an
    operation runs, and what a load fetched (its figure: the difference over read_data).
    The timed streams (storage/timed_fs.py) add what each data call moved, under a lock
    (writer and reader threads); one per call, calls carry whole tensors or buffer-sized
    chunks."""

    def __init__(self) -> None:
        self.total = 0
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # a lock does not pickle (process checkpointer)
        return {"total": self.total}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        self.total = state["total"]

    def add(self, count: int) -> None:
        with self._lock:
            self.total += count


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
    # the tool's reader clocks its own copies into the live tensors (it copies on its
    # threads, between the planner's resolve_tensor and commit_tensor of other items)
    target_copy_by_reader: bool = False
    # multi-storage-client loads: how its files read their objects, "whole" (downloaded
    # whole: under its 512 MiB switch) and/or "ranged" (a ranged GET per read, above it)
    msc_reads: set[str] = dataclasses.field(default_factory=set)
    # The first error an object stream's write or close raised ("S3Exception: ..."): DCP's
    # own error may hide it (TimedWriter.write_data puts it first)
    stream_error: str | None = None
    # bytes through the object streams so far (progress lines; a load's io_bytes is its
    # difference over read_data)
    moved: ByteCounter = dataclasses.field(default_factory=ByteCounter)
    # Where a copy of this timeline in another process (the process checkpointer's daemon)
    # writes what it recorded; None: recorded in place.
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

    def note_stream_error(self, error: BaseException) -> None:
        if self.stream_error is None:
            self.stream_error = f"{type(error).__name__}: {' '.join(str(error).split())[:2000]}"

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
