"""The tool's own reader (storage.read_ahead=N; docs/headroom.md says why and how): N range
fetches in flight on N threads through the same client and settings (`fetch_into`, on the
storage clock and counted as DCP's reads are), while the rank's thread resolves, narrows and
commits each item through DCP's planner as DCP's reader does.
"""

from __future__ import annotations

import functools
import io
import os
import threading
import time
from collections import deque
from concurrent.futures import Future as PoolFuture
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dcp_fsdp.storage.timeline import BusyClock, ByteCounter

if TYPE_CHECKING:
    from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
    from torch.futures import Future

    from dcp_fsdp.storage.timeline import HookTimeline


@dataclass
class RangeGroup:
    """Items of one file that lie back to back, fetched as one range [start, end)."""

    relative_path: str
    start: int
    end: int
    items: list[Any] = field(default_factory=list)  # DCP ReadItems, in file order

    @property
    def length(self) -> int:
        return self.end - self.start


def range_groups(items: list[ReadItem], storage_data: dict[Any, Any],
                 group_bytes: int) -> list[RangeGroup]:
    """The plan's items as range groups: per file (in the plan's order of files), items by
    offset, joined while they touch and the group stays within `group_bytes`."""
    per_file: dict[str, list[ReadItem]] = {}
    for item in items:
        per_file.setdefault(storage_data[item.storage_index].relative_path, []).append(item)
    groups: list[RangeGroup] = []
    for relative_path, file_items in per_file.items():
        current: RangeGroup | None = None
        for item in sorted(file_items, key=lambda i: storage_data[i.storage_index].offset):
            info = storage_data[item.storage_index]
            start, end = info.offset, info.offset + info.length
            if current is not None and start == current.end and end - current.start <= group_bytes:
                current.end = end
                current.items.append(item)
                continue
            if current is not None and start >= current.start and end <= current.end:
                current.items.append(item)  # the same bytes again (a replicated item)
                continue
            current = RangeGroup(relative_path, start, end, [item])
            groups.append(current)
    return groups


class MemorySlice(io.RawIOBase):
    """A read-only, seekable file over a slice of fetched bytes (no copy)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view
        self._length = len(view)
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET, /) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._position, os.SEEK_END: self._length}[whence]
        self._position = max(0, base + offset)
        return self._position

    def _slice(self, start: int, end: int) -> memoryview:
        return self._view[start:end]

    def readinto(self, buffer: Any, /) -> int:
        target = memoryview(buffer).cast("B")
        end = min(self._position + len(target), self._length)
        source = self._slice(self._position, max(self._position, end))
        target[:len(source)] = source
        self._position += len(source)
        return len(source)


class OutsideFraming(OSError):
    """torch.load asked an `ItemFraming` for bytes it does not hold."""


class ItemFraming(MemorySlice):
    """A seekable file over one saved item of which only the first and last `FRAMING_BYTES` were
    read: the zip framing torch.load to the meta device reads (else OutsideFraming)."""

    def __init__(self, head: bytes | bytearray, tail: bytes | bytearray, length: int) -> None:
        super().__init__(memoryview(head))
        self._tail = tail
        self._length = length

    def _slice(self, start: int, end: int) -> memoryview:
        tail_start = self._length - len(self._tail)
        if end <= len(self._view):
            return self._view[start:end]
        if start >= tail_start:
            return memoryview(self._tail)[start - tail_start:end - tail_start]
        raise OutsideFraming(f"bytes {start}-{end} of a {self._length}-byte item")


# What an item's framing read holds at each end: torch.save's first records (the pickle,
# about 0.5 KiB for a tensor) and its zip directory (torch's reader reads the last 4 KiB).
FRAMING_BYTES = 4096


class BufferPool:
    """The fetch buffers (uint8 tensors, pinned on a CUDA rank) kept from one load to the next,
    as a training job keeps its staging buffers: fresh ones cost every load a page fault per
    4 KiB (pinning, far more)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[Any] = []

    def take(self, count: int, size: int, pinned: bool) -> list[Any]:
        """`count` buffers of at least `size` bytes (never resized: views of an earlier
        load's last group may still be alive)."""
        import torch

        with self._lock:
            fitting = [b for b in self._free if b.numel() >= size and b.is_pinned() == pinned]
            self._free = []  # the rest are too small, of the other kind, or too many: dropped
        return fitting[:count] + [torch.empty(max(1, size), dtype=torch.uint8, pin_memory=pinned)
                                  for _ in range(count - len(fitting[:count]))]

    def give(self, buffers: list[Any]) -> None:
        with self._lock:
            self._free.extend(buffers)


class DeviceCopies:
    """How each tensor reaches its target. On a CUDA rank: on a side stream without blocking,
    a buffer reused once its copies are done (an event per buffer), all waited for in
    `finish`. Elsewhere: `target.copy_()`, as DCP does."""

    def __init__(self, cuda: bool) -> None:
        import torch

        self.stream = torch.cuda.Stream() if cuda else None
        self._copied: dict[int, Any] = {}  # id(buffer) -> the event after its last copy

    def copy(self, target: Any, tensor: Any) -> None:
        import torch

        if self.stream is None or target.device.type != "cuda":
            target.copy_(tensor)
            return
        with torch.cuda.stream(self.stream):
            target.copy_(tensor, non_blocking=True)

    def copied_from(self, buffer: Any) -> None:
        """Every copy out of `buffer` so far is enqueued: mark it."""
        if self.stream is not None:
            import torch

            event = torch.cuda.Event()
            event.record(self.stream)
            self._copied[id(buffer)] = event

    def reusable(self, buffer: Any) -> None:
        """Wait until the copies out of `buffer` are done (before a fetch overwrites it)."""
        event = self._copied.pop(id(buffer), None)
        if event is not None:
            event.synchronize()

    def finish(self) -> float:
        """Wait for every copy; the seconds waited."""
        if self.stream is None:
            return 0.0
        started = time.perf_counter()
        self.stream.synchronize()
        return time.perf_counter() - started


POOL = BufferPool()


def read_exactly(stream: Any, start: int, target: memoryview, name: Any) -> None:
    """Fill `target` from `stream` at `start` (a seek and readinto until full)."""
    stream.seek(start)
    filled = 0
    while filled < len(target):
        count = stream.readinto(target[filled:])
        if not count:
            raise OSError(f"{name}: ended {len(target) - filled} bytes before {start + len(target)}")
        filled += count


def lands_in_place(meta: Any, target: Any, req: Any) -> bool:
    """Whether an item's data record is, byte for byte, its whole target (a dense saved tensor,
    read whole, into a contiguous CPU tensor of its dtype and shape)."""
    whole = all(offset == 0 for offset in req.storage_offsets) and list(req.lengths) == list(meta.shape)
    dense = (meta.is_contiguous() and meta.storage_offset() == 0 and meta.numel() > 0
             and meta.untyped_storage().nbytes() == meta.numel() * meta.element_size())
    return (whole and dense and target.device.type == "cpu" and target.is_contiguous()
            and target.dtype == meta.dtype and target.shape == meta.shape)


def narrowed(req: Any, tensor: Any, target: Any) -> Any:
    """`tensor` narrowed to the part `req` reads, its size checked against `target`'s (as DCP's reader)."""
    from dcp_fsdp.compat import narrow_tensor_by_index

    tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
    if target.size() != tensor.size():
        raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs {tensor.size()}")
    return tensor


def tensor_bytes(tensor: Any) -> memoryview:
    """A contiguous CPU tensor's memory as writable bytes (no copy)."""
    import torch

    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


def in_flight(width: int, jobs: Iterator[tuple[Any, ...]], fetch: Callable[..., Any],
              finish: Callable[..., None]) -> None:
    """`fetch(*job)` on `width` threads, at most `width` in flight, then `finish(*job, fetched)` on the
    caller's thread in the jobs' order. A job is drawn from `jobs` (on the caller's thread) only when
    a thread is free; on an error, the fetches not yet begun are cancelled."""
    pending: deque[tuple[tuple[Any, ...], PoolFuture[Any]]] = deque()
    with ThreadPoolExecutor(width, thread_name_prefix="read-ahead") as pool:
        try:
            while True:
                while len(pending) < width and (job := next(jobs, None)) is not None:
                    pending.append((job, pool.submit(fetch, *job)))
                if not pending:
                    return
                job, fetched = pending.popleft()
                finish(*job, fetched.result())
        finally:
            for _, fetched in pending:
                fetched.cancel()


class ReadAhead:
    """Mixin before a client's DCP reader (after `TimedReader`): `read_data` with `read_ahead`
    range fetches in flight. It uses the reader's `fs`, `path`, `storage_data` and transforms."""

    fs: Any
    path: Any
    storage_data: dict[Any, Any]
    timeline: HookTimeline

    # Whether the client's stream reads any range into any memory cheaply (files), so each item
    # lands straight in its target (`_land`); elsewhere range groups (one request each) into buffers.
    lands_directly = False

    def __init__(self, *args: Any, read_ahead: int, group_bytes: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read_ahead = read_ahead
        self.group_bytes = group_bytes

    # -- fetching (the threads) ------------------------------------------------------------
    def fetch_into(self, path: Any, start: int, target: memoryview) -> None:
        """Fill `target` with object `path`'s bytes from `start`: a seek and readinto on the
        reader's (timed) stream; clients with a ranged call of their own override this."""
        with self.fs.create_stream(path, "rb") as stream:
            read_exactly(stream, start, target, path)

    def clocked_into(self, target: memoryview, fetch: Callable[[], bytes]) -> None:
        """A client's own ranged call (returning bytes), on the storage clock and counted in
        the bytes moved as the timed streams count reads, copied into `target`."""
        with self.timeline.storage_clock:
            data = fetch()
        if len(data) != len(target):
            raise OSError(f"a ranged read returned {len(data)} of {len(target)} bytes")
        self.timeline.moved.add(len(data))
        target[:] = data

    def _fetch(self, group: RangeGroup, buffer: Any) -> memoryview:
        view = buffer.numpy().data[:group.length]
        self.fetch_into(self.fs.concat_path(self.path, group.relative_path), group.start, view)
        return view

    # -- the rank's thread -----------------------------------------------------------------
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        import torch
        from torch.futures import Future

        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()  # a GPU rank
        held = ByteCounter()
        copy_s = (self._land(plan, planner, held) if self.lands_directly and not cuda
                  else self._read_groups(plan, planner, cuda, held))
        self.timeline.read_ahead_peak_bytes = held.peak
        self.timeline.target_copy_s = (self.timeline.target_copy_s or 0.0) + copy_s
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_groups(self, plan: LoadPlan, planner: LoadPlanner, cuda: bool, held: ByteCounter) -> float:
        """Range groups fetched on N threads into N buffers of the largest group (reused); the
        rank's thread reads each tensor where it lies in them and copies it into its target."""
        groups = range_groups(plan.items, self.storage_data, self.group_bytes)
        largest = max((group.length for group in groups), default=0)
        buffers = POOL.take(min(self.read_ahead, len(groups)), largest, pinned=cuda)
        copies = DeviceCopies(cuda)

        def started() -> Iterator[tuple[RangeGroup, Any]]:
            for index, group in enumerate(groups):  # fewer than N in flight: the buffer's last group is done
                buffer = buffers[index % len(buffers)]
                copies.reusable(buffer)
                held.add(group.length)
                yield group, buffer

        try:
            in_flight(self.read_ahead, started(), self._fetch,
                      functools.partial(self._consume, planner=planner, copies=copies, held=held))
        finally:
            waited_s = copies.finish()
        POOL.give(buffers)  # after the pool's threads ended: no fetch still writes into one
        return waited_s

    # -- landing: each item straight into its target (files) -------------------------------
    def _land(self, plan: LoadPlan, planner: LoadPlanner, held: ByteCounter) -> float:
        """Each item on one of N threads, in file order, read straight into its target (else read
        whole and copied); the rank's thread resolves and commits each target, in order."""
        from torch.distributed.checkpoint.planner import LoadItemType

        copies = BusyClock()
        self.timeline.target_copy_by_reader = True
        ordered = sorted(plan.items, key=lambda req: (self.storage_data[req.storage_index].relative_path,
                                                      self.storage_data[req.storage_index].offset))
        resolved = ((req, None if req.type == LoadItemType.BYTE_IO else planner.resolve_tensor(req).detach())
                    for req in ordered)
        in_flight(self.read_ahead, resolved, functools.partial(self._land_item, held=held, copies=copies),
                  functools.partial(self._finish_item, planner=planner, copies=copies, held=held))
        return copies.total_s()

    def _land_item(self, req: Any, target: Any, held: ByteCounter, copies: BusyClock) -> bytearray | None:
        """On a reading thread: `req`'s item into `target`; the item's bytes where the rank's
        thread must handle them (bytes, a transformed item: it releases them from `held`)."""
        from dcp_fsdp.compat import saved_tensor_layout

        info = self.storage_data[req.storage_index]
        path = self.fs.concat_path(self.path, info.relative_path)
        with self.fs.create_stream(path, "rb") as stream:
            if (target is not None and not getattr(info, "transform_descriptors", None)
                    and info.length > 2 * FRAMING_BYTES):  # its framing read first
                head, tail = bytearray(FRAMING_BYTES), bytearray(FRAMING_BYTES)
                read_exactly(stream, info.offset, memoryview(head), path)
                read_exactly(stream, info.offset + info.length - FRAMING_BYTES, memoryview(tail), path)
                meta, data_offset = saved_tensor_layout(lambda: ItemFraming(head, tail, info.length))
                if lands_in_place(meta, target, req):
                    read_exactly(stream, info.offset + data_offset, tensor_bytes(target), path)
                    return None
            held.add(info.length)
            item = bytearray(info.length)
            read_exactly(stream, info.offset, memoryview(item), path)
        if target is None or getattr(info, "transform_descriptors", None):
            return item
        tensor = narrowed(req, self._tensor(req, info, memoryview(item)), target)
        try:
            with copies:
                target.copy_(tensor)
        finally:
            held.add(-info.length)
        return None

    def _finish_item(self, req: Any, target: Any, item: bytearray | None, planner: LoadPlanner,
                     copies: BusyClock, held: ByteCounter) -> None:
        """On the rank's thread, in order: a byte item loaded, a transformed one
        deserialised and copied, each tensor committed; its bytes released from `held`."""
        info = self.storage_data[req.storage_index]
        if target is None:
            planner.load_bytes(req, io.BytesIO(self._stream(req, info, memoryview(item or b"")).read(-1)))
        else:
            if item is not None:
                tensor = narrowed(req, self._tensor(req, info, memoryview(item)), target)
                with copies:
                    target.copy_(tensor)
            planner.commit_tensor(req, target)
        held.add(-len(item or b""))

    def _consume(self, group: RangeGroup, buffer: Any, view: memoryview, planner: LoadPlanner,
                 copies: DeviceCopies, held: ByteCounter) -> None:
        """Each item of a fetched group as DCP's read_data handles it, except that a tensor is read where
        it lies in the fetched bytes and copied once, into its target; then the buffer and `held` freed."""
        from torch.distributed.checkpoint.planner import LoadItemType

        for req in group.items:
            info = self.storage_data[req.storage_index]
            begin = info.offset - group.start
            item = view[begin:begin + info.length]
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(self._stream(req, info, item).read(-1)))
                continue
            tensor = self._tensor(req, info, item)  # before resolve_tensor: the copy is timed from there
            target = planner.resolve_tensor(req).detach()
            copies.copy(target, narrowed(req, tensor, target))
            planner.commit_tensor(req, target)
        copies.copied_from(buffer)
        held.add(-group.length)

    def _stream(self, req: Any, info: Any, item: memoryview) -> Any:
        from dcp_fsdp.compat import load_stream

        return load_stream(self, req, info, MemorySlice(item))

    def _tensor(self, req: Any, info: Any, item: memoryview) -> Any:
        """The saved tensor: a view of the fetched bytes, or where DCP transformed the item,
        torch.load of the transformed stream, as DCP does."""
        import torch

        from dcp_fsdp.compat import saved_tensor_view

        if not getattr(info, "transform_descriptors", None):
            return saved_tensor_view(item, MemorySlice)
        stream = self._stream(req, info, item)
        seekable = stream if stream.seekable() else io.BytesIO(stream.read(-1))
        return torch.load(seekable, map_location="cpu", weights_only=True)
