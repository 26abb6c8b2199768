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

Inside io_s (per rank; `BusyClock`: wall time with at least one call in progress, so
writer/reader threads > 1 never count an instant twice, and io_s - busy >= 0):
  save: upload_s = inside the object streams' write() and close() (the connector's
                   PutObject / multipart stream: blocked on the upload, or on the page cache
                   for fs); stage_s = io_s - upload_s (resolving, copying and serialising
                   tensors: torch.save into the stream)
  load: io_wait_s = inside the object streams' read() / readinto() (waiting for bytes from
                    storage); copy_s = io_s - io_wait_s (deserialising and copying into the
                    live tensors, host-to-device included)
Two perf_counter reads and one uncontended lock per call (calls carry whole tensors or
buffer-sized chunks): nothing per byte.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import time


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

    def total_s(self) -> float:
        """Closed intervals only: read it when no call is in progress."""
        with self._lock:
            return self._total

    def wrap(self, method):
        def timed(*args, **kwargs):
            self.enter()
            try:
                return method(*args, **kwargs)
            finally:
                self.exit()
        return timed


class _TimedStream:
    """A stand-in for a stream whose methods cannot be replaced (built-in file objects):
    the timed methods are its own, everything else goes to the stream."""

    def __init__(self, stream, timed: dict) -> None:
        self._stream = stream
        self.__dict__.update(timed)

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def __iter__(self):
        return iter(self._stream)


class ByteCounter:
    """Bytes through the object streams so far: what the progress heartbeat reads while an
    operation runs, and what a load fetched (its figure: the difference over read_data).
    Counted at the outermost call only (a reader's read() may call its own readinto(), both
    wrapped), under a lock (reader threads); one per call, calls carry whole tensors or
    buffer-sized chunks."""

    def __init__(self) -> None:
        self.total = 0
        self._lock = threading.Lock()
        self._depth = threading.local()

    def wrap(self, name: str, method):
        def counted(*args, **kwargs):
            depth = getattr(self._depth, "value", 0)
            self._depth.value = depth + 1
            try:
                result = method(*args, **kwargs)
            finally:
                self._depth.value = depth
            if depth:
                return result
            moved = 0
            if name == "write" and args and hasattr(args[0], "__len__"):
                moved = len(args[0])
            elif name == "readinto" and isinstance(result, int):
                moved = result
            elif name == "read" and isinstance(result, (bytes, bytearray, memoryview)):
                moved = len(result)
            if moved:
                with self._lock:
                    self.total += moved
            return result
        return counted


def _time_stream(stream, clock: BusyClock, names: tuple[str, ...],
                 counter: ByteCounter | None = None):
    """`stream` with `names` timed by `clock` (and counted): the same object where its
    attributes can be set (the connector's S3Writer / S3Reader), else a thin stand-in."""
    timed = {name: clock.wrap(getattr(stream, name) if counter is None
                              else counter.wrap(name, getattr(stream, name)))
             for name in names if hasattr(stream, name)}
    try:
        for name, method in timed.items():
            setattr(stream, name, method)
        return stream
    except (AttributeError, TypeError):
        return _TimedStream(stream, timed)


@dataclasses.dataclass
class HookTimeline:
    """Monotonic start/end of each hook call (seconds), and bytes written or read."""

    spans: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    io_bytes: int = 0
    # object path -> bytes written through the writer's streams (data files and .metadata)
    object_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    # time inside the object streams' data calls (see the module docstring)
    stream_clock: BusyClock = dataclasses.field(default_factory=BusyClock)
    # stream_clock's total over the data-I/O hook (write_data / read_data), seconds
    stream_io_s: float | None = None
    # bytes through the object streams so far (progress lines; a load's io_bytes is its
    # difference over read_data)
    moved: ByteCounter = dataclasses.field(default_factory=ByteCounter)

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
    """Wrap this writer's fs.create_stream: bytes of each object it writes ("wb"), and the
    time spent inside its write() and close() calls."""
    fs = getattr(writer, "fs", None)
    create_stream = getattr(fs, "create_stream", None)
    if create_stream is None:
        return
    lock = threading.Lock()

    @contextlib.contextmanager
    def counting_create_stream(path, mode):
        with create_stream(path, mode) as stream:
            if "w" in mode:
                stream = _time_stream(stream, timeline.stream_clock, ("write", "close"),
                                      timeline.moved)
            yield stream
            if "w" in mode:
                try:
                    size = int(stream.tell())
                except Exception:  # a stream that cannot tell: leave it uncounted
                    return
                with lock:
                    timeline.object_bytes[str(path)] = size

    fs.create_stream = counting_create_stream


def _time_reads(reader, timeline: HookTimeline) -> None:
    """Wrap this reader's fs.create_stream: time inside each object stream's read calls."""
    fs = getattr(reader, "fs", None)
    create_stream = getattr(fs, "create_stream", None)
    if create_stream is None:
        return

    @contextlib.contextmanager
    def timed_create_stream(path, mode):
        with create_stream(path, mode) as stream:
            if "r" in mode:
                stream = _time_stream(stream, timeline.stream_clock, ("read", "readinto"),
                                      timeline.moved)
            yield stream

    fs.create_stream = timed_create_stream


def instrument_writer(writer) -> HookTimeline:
    timeline = HookTimeline()
    for hook in ("prepare_local_plan", "prepare_global_plan", "finish"):
        setattr(writer, hook, _timed(timeline, hook, getattr(writer, hook)))
    _count_uploads(writer, timeline)
    write_data = writer.write_data

    @functools.wraps(write_data)
    def timed_write_data(plan, planner):
        start = time.monotonic()
        busy_before = timeline.stream_clock.total_s()
        try:
            future = write_data(plan, planner)
            future.wait()  # DCP waits right after this call anyway; we time the I/O itself
            timeline.io_bytes = sum(
                getattr(result.storage_data, "length", 0) or 0 for result in future.value())
            return future
        finally:
            timeline.stream_io_s = timeline.stream_clock.total_s() - busy_before
            timeline.record("write_data", start, time.monotonic())

    writer.write_data = timed_write_data
    return timeline


def instrument_reader(reader) -> HookTimeline:
    timeline = HookTimeline()
    for hook in ("read_metadata", "prepare_local_plan", "prepare_global_plan"):
        setattr(reader, hook, _timed(timeline, hook, getattr(reader, hook)))
    _time_reads(reader, timeline)
    read_data = reader.read_data

    @functools.wraps(read_data)
    def timed_read_data(plan, planner):
        start = time.monotonic()
        busy_before = timeline.stream_clock.total_s()
        # what the client received through the object streams, not what the plan named:
        # a resharded load that reads a saved item whole for a part of it fetches more
        fetched_before = timeline.moved.total
        try:
            future = read_data(plan, planner)
            future.wait()
            return future
        finally:
            timeline.io_bytes = timeline.moved.total - fetched_before
            timeline.stream_io_s = timeline.stream_clock.total_s() - busy_before
            timeline.record("read_data", start, time.monotonic())

    reader.read_data = timed_read_data
    return timeline
