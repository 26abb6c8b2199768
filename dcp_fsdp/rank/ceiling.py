"""The storage's ceiling: the bytes a DCP save wrote, moved raw, with the same client.

After the DCP operations (`ceiling=true`), or alone (`dcp-fsdp ceiling`), every rank
PUTs and then GETs the same number of objects, of the same sizes and relative names, as
its share of the checkpoint, with `storage.thread_count` parallel streams (DCP's writer
uses one thread per object of a rank), aligned by the same barrier and timed the same
way as `dcp.save` / `dcp.load`. What DCP does beyond moving bytes (planning, the
collectives, serialisation, the commit) is absent, so DCP MiB/s / ceiling MiB/s is the
efficiency of the checkpoint path.

  s3: s3torchconnector's own client (`S3Client`, the native Mountpoint CRT client DCP's
      S3StorageWriter/Reader use), built from `S3Store._client_config()`: same part
      size, throughput target, max attempts, path style, endpoint. A fresh client per
      operation, built before the barrier, like the writer/reader DCP gets each time.
      PUT: `put_object` streams, written in part-size chunks of one preallocated buffer.
      GET: the native object stream, read to its end (bytes discarded).
  fs: plain files: os.write of a preallocated buffer in part-size chunks, then fsync
      (as DCP's FileSystemWriter does with storage.sync_files=true, the default); GET:
      readinto one buffer, after the files were dropped from the page cache (untimed,
      storage/pagecache.py) so it reads the file system, not memory.

Objects: `ceiling=true` mirrors the checkpoint just saved (or loaded): each rank's data
objects (`__<rank>_<n>.distcp` under the prefix strategy's folders) with sizes taken from
its `.metadata` (offset + length of the last item in each file: the exact object size).
`dcp-fsdp ceiling` has no checkpoint: the sizes come from DCP's own local save plan of the
rank's state dict, binned into thread_count objects by DCP's own `_split_by_size_and_type`;
each tensor counts its bytes plus torch.save's framing, measured on a one-element tensor
of the same dtype and rank (a few hundred bytes per tensor; the sizes are within 0.1 %
of a real save's for the presets).

Where: never inside a checkpoint, and never where `list` looks: s3
`<uri>.ceiling/<token>/<iteration>/` (a sibling of the checkpoints' prefix;
`s3://bucket/_dcp_fsdp.ceiling/...` when the uri has no prefix, a name no suffix can
take and `list` skips), fs `<path>.ceiling/<token>/<iteration>/`. Each rank removes its
objects after each round (untimed); the directories go with them.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import torch
import torch.distributed as dist

from dcp_fsdp.config.schema import MIB, StorageKind
from dcp_fsdp.errors import BenchmarkFailure
from dcp_fsdp.rank.distributed import all_gather_object, rank0_decides
from dcp_fsdp.storage import layout

if TYPE_CHECKING:
    from dcp_fsdp.rank.loop import CheckpointLoop
    from dcp_fsdp.telemetry.records import Sample

ROOT_CEILING_DIR = layout.CEILING_ROOT  # when the S3 uri is a bare bucket
DATA_OBJECT_SUFFIX = ".distcp"


@dataclasses.dataclass(frozen=True)
class RawObject:
    name: str  # relative to the checkpoint (or ceiling) directory, e.g. "__1_0.distcp"
    size_bytes: int


def rank_prefix(rank: int) -> str:
    """Every DCP writer (fs, and every s3 prefix strategy) names a rank's files __<rank>_<n>."""
    return f"__{rank}_"


def owned_by(name: str, rank: int) -> bool:
    base = name.rsplit("/", 1)[-1]
    return base.startswith(rank_prefix(rank)) and base.endswith(DATA_OBJECT_SUFFIX)


# -- which objects --------------------------------------------------------------------------

def sizes_from_metadata(metadata) -> dict[str, int]:
    """Every data object of a checkpoint -> its size: the end of its last item."""
    sizes: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), end)
    return sizes


def objects_of_rank(sizes: dict[str, int], rank: int) -> list[RawObject]:
    return [RawObject(name, size) for name, size in sorted(sizes.items()) if owned_by(name, rank)]


_FRAMING_BYTES: dict[tuple[torch.dtype, int], int] = {}


def torch_save_framing_bytes(dtype: torch.dtype, ndim: int) -> int:
    """What torch.save adds around one tensor's data (zip records, pickle), measured."""
    key = (dtype, ndim)
    if key not in _FRAMING_BYTES:
        probe = torch.zeros((1,) * ndim, dtype=dtype)
        buffer = io.BytesIO()
        torch.save(probe, buffer)
        _FRAMING_BYTES[key] = buffer.tell() - probe.element_size()
    return _FRAMING_BYTES[key]


def planned_objects(state_dict: dict[str, Any], rank: int, thread_count: int,
                    name_prefix: str) -> list[RawObject]:
    """The objects this rank's DCP save would write (`dcp-fsdp ceiling` alone)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import _split_by_size_and_type
    from torch.distributed.checkpoint.planner import WriteItemType

    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict, storage_meta=None, is_coordinator=rank == 0)
    items = planner.create_local_plan().items
    objects = []
    for number, bucket in enumerate(_split_by_size_and_type(thread_count, items)):
        size = 0
        for item in bucket:
            if item.type == WriteItemType.BYTE_IO:
                size += len(planner.resolve_data(item).getbuffer())
            else:
                # the local chunk's bytes (tensor_data.size is the global tensor's)
                dtype, sizes = item.tensor_data.properties.dtype, item.tensor_data.chunk.sizes
                size += (math.prod(sizes) * torch._utils._element_size(dtype)
                         + torch_save_framing_bytes(dtype, len(sizes)))
        objects.append(RawObject(f"{name_prefix}{number}{DATA_OBJECT_SUFFIX}", size))
    return objects


# -- where ----------------------------------------------------------------------------------

def s3_ceiling_prefix(prefix: str, token: str) -> str:
    return f"{prefix}.ceiling/{token}" if prefix else f"{ROOT_CEILING_DIR}/{token}"


def fs_ceiling_dir(root: Path, token: str) -> Path:
    return root.parent / f"{root.name}.ceiling" / token


# -- moving bytes ---------------------------------------------------------------------------

def _chunks(size: int, chunk: int) -> Iterable[int]:
    full, rest = divmod(size, chunk)
    return [chunk] * full + ([rest] if rest else [])


class S3Mover:
    """PUT/GET/DELETE through s3torchconnector's S3Client (the native CRT client)."""

    def __init__(self, store, token: str) -> None:
        self.store = store
        self.bucket = store.target.bucket
        self.base = s3_ceiling_prefix(store.target.prefix, token)
        self.chunk_bytes = store.config.part_size_mib * MIB
        # Random bytes: no storage layer can compress or deduplicate them away.
        self.payload = os.urandom(self.chunk_bytes)
        self._tails: dict[int, bytes] = {}

    def key(self, iteration: int, obj: RawObject) -> str:
        return f"{self.base}/{iteration}/{obj.name}"

    def new_client(self):
        """A client built now (outside the timer), as S3Store.warm_up does for DCP's."""
        from s3torchconnector._s3client import S3Client

        client = S3Client(self.store.region, s3client_config=self.store._client_config())
        client._client  # noqa: B018 - property access builds the native client
        return client

    def prepare(self, objects: list[RawObject]) -> None:
        for obj in objects:
            rest = obj.size_bytes % self.chunk_bytes
            if rest and rest not in self._tails:
                self._tails[rest] = self.payload[:rest]

    def put(self, client, iteration: int, obj: RawObject) -> None:
        writer = client.put_object(self.bucket, self.key(iteration, obj))
        for length in _chunks(obj.size_bytes, self.chunk_bytes):
            writer.write(self.payload if length == self.chunk_bytes else self._tails[length])
        writer.close()

    def get(self, client, iteration: int, obj: RawObject) -> int:
        received = 0
        for chunk in client._client.get_object(self.bucket, self.key(iteration, obj)):
            received += len(chunk)
        return received

    def remove(self, client, iteration: int, objects: list[RawObject]) -> None:
        for obj in objects:
            client.delete_object(self.bucket, self.key(iteration, obj))


class FsMover:
    """Plain file writes (fsync'd, as DCP's FileSystemWriter does) and reads."""

    def __init__(self, store, token: str) -> None:
        self.base = fs_ceiling_dir(store.root, token)
        self.chunk_bytes = store.config.part_size_mib * MIB
        self.sync_files = store.config.sync_files
        self.payload = memoryview(os.urandom(self.chunk_bytes))

    def path(self, iteration: int, obj: RawObject) -> Path:
        return self.base / str(iteration) / obj.name

    def new_client(self):
        return None

    def prepare(self, objects: list[RawObject]) -> None:
        pass

    def make_dirs(self, iteration: int, objects: list[RawObject]) -> None:
        for obj in objects:
            self.path(iteration, obj).parent.mkdir(parents=True, exist_ok=True)

    def put(self, client, iteration: int, obj: RawObject) -> None:
        fd = os.open(self.path(iteration, obj), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for length in _chunks(obj.size_bytes, self.chunk_bytes):
                view = self.payload[:length]
                while view:
                    view = view[os.write(fd, view):]
            if self.sync_files:
                os.fsync(fd)
        finally:
            os.close(fd)

    def drop_cache(self, iteration: int, objects: list[RawObject]) -> str:
        """Before the timed GET: these files out of the page cache (the policy that held)."""
        from dcp_fsdp.storage import pagecache

        return pagecache.drop(self.path(iteration, obj) for obj in objects)

    def get(self, client, iteration: int, obj: RawObject) -> int:
        buffer = bytearray(self.chunk_bytes)
        received = 0
        with open(self.path(iteration, obj), "rb", buffering=0) as source:
            while count := source.readinto(buffer):
                received += count
        return received

    def remove(self, client, iteration: int, objects: list[RawObject]) -> None:
        """Unlink this rank's files, then every directory up to <path>.ceiling that is now
        empty (the last rank to get here removes them; no barrier, so a failed round
        cleans up too)."""
        top = self.base.parent
        for obj in objects:
            path = self.path(iteration, obj)
            path.unlink(missing_ok=True)
            directory = path.parent
            while directory != top.parent:
                try:
                    directory.rmdir()
                except OSError:  # not empty (another rank's files) or already gone
                    break
                directory = directory.parent


# -- the timed rounds -----------------------------------------------------------------------

class Ceiling:
    def __init__(self, loop: "CheckpointLoop") -> None:
        self.loop = loop
        self.cfg = loop.cfg
        self.rank = loop.ctx.rank
        store = loop.store
        token = rank0_decides(loop.ctx, lambda: secrets.token_hex(4))
        self.mover = (S3Mover(store, token) if store.kind == StorageKind.s3.value
                      else FsMover(store, token))
        self.token = token

    def objects(self) -> tuple[list[RawObject], str]:
        """This rank's objects and the suffix they mirror ("ceiling" when none)."""
        loop = self.loop
        if loop.suffixes:
            suffix = loop.suffixes[-1]

            def read_sizes() -> dict[str, int]:
                reader = loop.store.reader(suffix)
                reader.reset(loop.store.location(suffix))
                return sizes_from_metadata(reader.read_metadata())
            return objects_of_rank(rank0_decides(loop.ctx, read_sizes), self.rank), suffix
        if loop.store.kind == StorageKind.s3.value:
            name_prefix = loop.store._prefix_strategy()(self.rank)
        else:
            name_prefix = rank_prefix(self.rank)
        return planned_objects(loop.state_dict, self.rank, self.cfg.storage.thread_count,
                               name_prefix), "ceiling"

    def run(self) -> list["Sample"]:
        objects, suffix = self.objects()
        total = sum(o.size_bytes for o in objects)
        counts = all_gather_object((len(objects), total))
        self.loop.log(f"ceiling: {sum(c for c, _ in counts)} objects, "
                      f"{sum(b for _, b in counts) / MIB:.1f} MiB in all, mirroring "
                      f"{'suffix=' + suffix if suffix != 'ceiling' else 'the planned save'}; "
                      f"raw PUT then GET, {self.cfg.storage.thread_count} stream(s) per rank")
        self.mover.prepare(objects)
        samples = []
        threads = max(1, self.cfg.storage.thread_count)
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ceiling") as pool:
            for iteration in range(1, self.cfg.iterations + 1):
                if isinstance(self.mover, FsMover):
                    self.mover.make_dirs(iteration, objects)
                try:
                    samples.append(self._timed("raw_put", iteration, suffix, objects, total,
                                               pool, self.mover.put))
                    samples.append(self._timed("raw_get", iteration, suffix, objects, total,
                                               pool, self.mover.get))
                finally:
                    self._remove(iteration, objects)
        return samples

    def _timed(self, op, iteration, suffix, objects, total, pool, move) -> "Sample":
        from dcp_fsdp.rank.loop import Watchdog
        from dcp_fsdp.telemetry.records import Sample

        client = self.mover.new_client()
        cache_policy = (self.mover.drop_cache(iteration, objects)
                        if op == "raw_get" and isinstance(self.mover, FsMover) else None)
        barrier_start = time.monotonic()
        dist.barrier()
        begin_mono = time.monotonic()
        begin_wall = time.time()
        with Watchdog(self.cfg.op_timeout_s, self.loop.on_timeout,
                      f"ceiling {op} iteration {iteration} did not finish within "
                      f"op_timeout_s={self.cfg.op_timeout_s:g}; the storage stalled or is too "
                      "slow: raise op_timeout_s or check the endpoint"):
            failure = None
            try:  # list(): re-raises the first failure of any stream
                list(pool.map(lambda obj: move(client, iteration, obj), objects))
            except Exception as error:  # every rank learns of it below, none hangs
                failure = f"{type(error).__name__}: {error}"
        end_mono = time.monotonic()
        end_wall = time.time()
        failures = all_gather_object(failure)
        if any(failures):
            rank = next(r for r, f in enumerate(failures) if f)
            raise BenchmarkFailure(f"ceiling {op} iteration {iteration} failed on rank {rank}: "
                                   f"{failures[rank]}")
        request_log = self.loop.request_log
        duration = end_mono - begin_mono
        return Sample(
            op=op, iteration=iteration, suffix=suffix, rank=self.rank, host=self.loop.host,
            begin_wall_s=begin_wall, end_wall_s=end_wall, begin_mono_s=begin_mono,
            end_mono_s=end_mono, duration_s=duration, bytes=total,
            barrier_wait_s=begin_mono - barrier_start, io_s=duration, cache_policy=cache_policy,
            requests=(None if request_log is None else request_log.window(
                begin_wall, end_wall, total if op == "raw_put" else None)))

    def _remove(self, iteration: int, objects: list[RawObject]) -> None:
        """Untimed: each rank removes its own objects (no collective: also after a failure)."""
        self.mover.remove(self.mover.new_client(), iteration, objects)


def run_ceiling(loop: "CheckpointLoop") -> list["Sample"]:
    return Ceiling(loop).run()
