"""DCP's own save plan for a world, run in one process: objects, bytes and `.metadata`, built as
docs/plan.md ("How it is built") tells. Times are CPU seconds (time.process_time): a rank has a
core of its own, and wall time on a shared machine would add other work's turns.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import pickle
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from dcp_fsdp.compat import (DATA_OBJECT_SUFFIX, dcp_metadata_version, dedup_save_plans,
                             fake_tensor, split_by_size_and_type, storage_info)
from dcp_fsdp.models.tensor_parallel import shard_block, tp_split_dim
from dcp_fsdp.plan.requests import Reads, merged_ranges
from dcp_fsdp.plan.state import StateTemplate, local_plan, own_copy


@dataclasses.dataclass(frozen=True)
class DataObject:
    rank: int
    name: str  # relative to the checkpoint, as DCP names it: <prefix><n>.distcp
    size_bytes: int


@dataclasses.dataclass(frozen=True)
class GlobalPlan:
    world_size: int
    objects: tuple[DataObject, ...]  # every data object, rank order
    items: int  # write items after deduplication (= storage_data entries)
    local_plan_bytes_max: int  # the largest pickled local plan (gathered to rank 0)
    local_plan_bytes_total: int
    planning_s: float  # rank 0's create_global_plan over all local plans
    metadata_bytes: int
    metadata_pickle_s: float  # rank 0, at the commit
    metadata_unpickle_s: float  # every rank, at a load
    metadata_memory_bytes: int  # the unpickled Metadata's resident memory, measured
    sampled: str | None = None  # how a large world was built from a subset (plan/sample.py)
    # each rank's reads at a load of the same layout (load_reads); None: not laid out item by
    # item (a sampled build without TP or replicas: each rank reads its own objects)
    load_reads: tuple[Reads, ...] | None = None

    def rank_objects(self) -> list[list[int]]:
        """Each rank's object sizes, rank order."""
        out: list[list[int]] = [[] for _ in range(self.world_size)]
        for obj in self.objects:
            out[obj.rank].append(obj.size_bytes)
        return out

    def rank_bytes(self) -> list[int]:
        return [sum(sizes) for sizes in self.rank_objects()]


class _CountingSink(io.RawIOBase):
    """The size of what is written: seekable, as torch.save under skip_data seeks past each
    storage's bytes instead of writing them; the size is the furthest position reached."""

    def __init__(self) -> None:
        self.position = 0
        self.count = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.count}[whence]
        self.position = base + offset
        return self.position

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        self.position += size
        self.count = max(self.count, self.position)
        return size


@functools.lru_cache(maxsize=4096)
def tensor_item_bytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """What DCP writes for one local chunk: torch.save of a fake tensor of that shape, its bytes
    skipped (nothing allocated: a chunk may be larger than this machine's memory)."""
    sink = _CountingSink()
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(fake_tensor(shape, dtype), sink)  # type: ignore[arg-type]  # a raw stream
    return sink.count


def _bytes_item_size(value: Any) -> int:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.tell()


def _rank_results(plan: SavePlan, rank_prefix: str, thread_count: int,
                  value_bytes: dict[str, int]) -> tuple[list[WriteResult], list[tuple[str, int]]]:
    """One rank's write results and files, in FileSystemWriter.write_data's order."""
    results: list[WriteResult] = []
    files = []
    for number, bucket in enumerate(split_by_size_and_type(thread_count, list(plan.items))):
        name = f"{rank_prefix}{number}{DATA_OBJECT_SUFFIX}"
        offset = 0
        for item in sorted(bucket, key=lambda i: i.type != WriteItemType.BYTE_IO):  # bytes first
            data = item.tensor_data  # None: a BYTE_IO item, as long as torch.save of its value
            length = (value_bytes[item.index.fqn] if data is None
                      else tensor_item_bytes(data.properties.dtype, tuple(data.chunk.sizes)))
            # the index as the coordinator unpickles it from this rank's results: its own
            # objects (the file name is one object per file, as in the rank's pickle)
            offset_copy = None if item.index.offset is None else torch.Size(tuple(item.index.offset))
            index = MetadataIndex(own_copy(item.index.fqn), offset_copy, item.index.index)
            results.append(WriteResult(index=index, size_in_bytes=length,
                                       storage_data=storage_info(name, offset, length)))
            offset += length
        files.append((name, offset))
    return results, files


def write_out(global_plans: list[SavePlan], template: StateTemplate, thread_count: int,
              rank_prefix: Callable[[int], str]) -> tuple[list[DataObject], dict[Any, Any]]:
    """(every rank's data objects, `.metadata`'s storage_data) of the final plans, laid out as
    FileSystemWriter writes them. Empties the plans as it goes (memory goes back)."""
    value_bytes = {e.fqn: _bytes_item_size(e.value) for e in template.entries if e.shape is None}
    objects: list[DataObject] = []
    storage_data: dict[Any, Any] = {}
    for rank in range(len(global_plans)):
        results, files = _rank_results(global_plans[rank], rank_prefix(rank), thread_count,
                                       value_bytes)
        global_plans[rank] = SavePlan([])
        storage_data.update({r.index: r.storage_data for r in results})
        objects.extend(DataObject(rank, name, size) for name, size in files)
    return objects, storage_data


def load_reads(template: StateTemplate, world_size: int, replicas: int, tp: int,
               storage_data: dict[Any, Any]) -> tuple[Reads, ...]:
    """What each rank reads at a load of the same layout: every item its state needs, wherever
    DCP's deduplication had it written; an empty chunk nothing. Adjacent ranges are one."""
    where = {(index.fqn, None if index.offset is None else tuple(index.offset)):
             (info.relative_path, info.offset, info.length)
             for index, info in storage_data.items()}
    shards = world_size // (replicas * tp)
    tp_dims = {e.fqn: tp_split_dim(e.fqn) if tp > 1 else None for e in template.entries}
    out = []
    for rank in range(world_size):
        shard, tp_rank = (rank // tp) % shards, rank % tp
        ranges = []
        for entry in template.entries:
            if entry.shape is None:
                key: tuple[str, tuple[int, ...] | None] = (entry.fqn, None)
            elif not entry.sharded:
                key = (entry.fqn, ())
            else:
                offsets, sizes = shard_block(entry.shape, shards, shard, tp_dims[entry.fqn], tp,
                                             tp_rank)
                if 0 in sizes:
                    continue
                key = (entry.fqn, offsets)
            name, offset, length = where[key]
            ranges.append((name, offset, offset + length))
        out.append(merged_ranges(sorted(ranges)))
    return tuple(out)


def build_global_plan(template: StateTemplate, world_size: int, replicas: int, thread_count: int,
                      rank_prefix: Callable[[int], str], checkpoint_id: str | Path,
                      tp: int = 1) -> GlobalPlan:
    """DCP's save of `template` by `world_size` ranks, planned and laid out in this process."""
    plans = [local_plan(template, rank, world_size, replicas, tp) for rank in range(world_size)]
    plan_bytes = len(pickle.dumps(plans[0]))  # what each rank sends
    start = time.process_time()
    global_plans, metadata = DefaultSavePlanner().create_global_plan(plans)
    planning_s = time.process_time() - start
    del plans
    objects, storage_data = write_out(global_plans, template, thread_count, rank_prefix)
    reads = load_reads(template, world_size, replicas, tp, storage_data)
    metadata.version = dcp_metadata_version()
    metadata.storage_data = storage_data
    metadata.storage_meta = StorageMeta(checkpoint_id=checkpoint_id, save_id=str(uuid.uuid4()))
    start = time.process_time()
    blob = pickle.dumps(metadata)
    pickle_s = time.process_time() - start
    items = len(storage_data)
    del metadata, storage_data, global_plans
    unpickle_s, memory = unpickle_cost(blob)
    return GlobalPlan(world_size, tuple(objects), items, plan_bytes, plan_bytes * world_size,
                      planning_s, len(blob), pickle_s, unpickle_s, memory, load_reads=reads)


def laid_out(template: StateTemplate, world_size: int, replicas: int, thread_count: int,
             rank_prefix: Callable[[int], str], tp: int = 1) -> tuple[list[DataObject], tuple[Reads, ...]]:
    """(every data object, each rank's reads at a load) of the whole world, item by item, as
    build_global_plan lays them out, without its validation and `.metadata` (plan/sample.py)."""
    plans = [local_plan(template, rank, world_size, replicas, tp) for rank in range(world_size)]
    final = dedup_save_plans(plans)
    del plans
    objects, storage_data = write_out(final, template, thread_count, rank_prefix)
    return objects, load_reads(template, world_size, replicas, tp, storage_data)


_UNPICKLE_CHILD = """
import os, pickle, sys, time
from dcp_fsdp.process.collector import paused_for_imports
with paused_for_imports():  # as a rank imports them
    import torch.distributed.checkpoint  # DCP's classes, as a rank has them imported
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
blob = sys.stdin.buffer.read()
before = rss()
start = time.process_time()
metadata = pickle.loads(blob)
seconds = time.process_time() - start
memory = rss() - before
for _ in range(2):  # the best of 3: on a shared machine one try may wait for a core
    del metadata
    start = time.process_time()
    metadata = pickle.loads(blob)
    seconds = min(seconds, time.process_time() - start)
print(seconds, memory)
"""


def unpickle_cost(blob: bytes) -> tuple[float, int]:
    """(seconds, resident bytes) to unpickle `.metadata` in a fresh child, as each rank of a
    load does (this process's objects and freed memory would distort it); the best of 3."""
    child = subprocess.run([sys.executable, "-c", _UNPICKLE_CHILD], input=blob,
                           capture_output=True, check=True)
    seconds, memory = child.stdout.split()
    return float(seconds), int(memory)
