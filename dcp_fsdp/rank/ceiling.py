"""The storage's ceiling: the bytes a DCP save wrote, moved raw with the same client.

After the DCP operations (`ceiling=true`), or alone (`dcp-fsdp ceiling`), every rank PUTs then GETs
its share of the checkpoint's objects (sizes from its `.metadata`, or from DCP's own local save plan
without a checkpoint) through the store's raw area (storage/raw.py), timed like `dcp.save` /
`dcp.load`: DCP MiB/s / ceiling MiB/s is the checkpoint path's efficiency. Then DCP alone on tmpfs,
and the headroom rounds: docs/metrics.md ("Ceiling and efficiency") and docs/headroom.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import os
import shutil
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType

from dcp_fsdp.config.schema import StorageConfig, StorageKind
from dcp_fsdp.config.validate import MAX_THREAD_COUNT
from dcp_fsdp.units import MIB
from dcp_fsdp.compat import DATA_OBJECT_SUFFIX, saving_rank, split_by_size_and_type
from dcp_fsdp.errors import BenchmarkFailure
from dcp_fsdp.rank.sample_build import timed_region
from dcp_fsdp.rank.distributed import first_problem, rank0_decides, rank0_scatters, sum_over_ranks
from dcp_fsdp.rank.replicas import replica_share
from dcp_fsdp.rank.state import flat_tensors, local_bytes
from dcp_fsdp.models.build import local_tensor
from dcp_fsdp.plan.build import tensor_item_bytes
from dcp_fsdp.process import lifeline
from dcp_fsdp.process.watchdog import op_watchdog
from dcp_fsdp.storage import layout, make_store
from dcp_fsdp.contract import RUN_ID_ENV
from dcp_fsdp.storage.base import CheckpointStore, ceiling_token
from dcp_fsdp.storage.fs import FsStore
from dcp_fsdp.storage.raw import Client
from dcp_fsdp.telemetry.records import Sample


@dataclasses.dataclass(frozen=True)
class RawObject:
    name: str  # relative to the checkpoint (or ceiling) directory, e.g. "__1_0.distcp"
    size_bytes: int


def objects_by_rank(sizes: dict[str, int], world_size: int) -> list[list[RawObject]]:
    """A checkpoint's data objects (name -> size, from its .metadata) per saving rank."""
    per_rank: list[list[RawObject]] = [[] for _ in range(world_size)]
    for name, size in sorted(sizes.items()):
        rank = saving_rank(name)
        if rank is not None and rank < world_size:
            per_rank[rank].append(RawObject(name, size))
    return per_rank


def read_by_rank(written: list[list[RawObject]], replicas: int,
                 read_once: bool) -> list[list[RawObject]]:
    """What each rank's raw GET reads: what its DCP load reads. With R replicas the save wrote
    each shard once, spread over the ranks holding it; a plain load reads every shard once per
    replica, a read-once load only on replica 0 (rank/replicas.py)."""
    if replicas <= 1:
        return written
    shards = len(written) // replicas
    per_shard = [[obj for replica in range(replicas) for obj in written[replica * shards + shard]]
                 for shard in range(shards)]
    return [per_shard[rank % shards] if not read_once or rank < shards else []
            for rank in range(len(written))]


def planned_objects(state_dict: dict[str, Any], rank: int, thread_count: int,
                    name_prefix: str) -> list[RawObject]:
    """The objects this rank's DCP save would write (`dcp-fsdp ceiling` alone)."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict, storage_meta=None, is_coordinator=rank == 0)
    items = planner.create_local_plan().items
    objects = []
    for number, bucket in enumerate(split_by_size_and_type(thread_count, items)):
        size = 0
        for item in bucket:
            if item.type == WriteItemType.BYTE_IO:
                data = planner.resolve_data(item)
                size += len(data.getbuffer()) if isinstance(data, io.BytesIO) else data.nbytes
            else:  # the local chunk's (tensor_data.size is the global tensor's), as plan sizes it
                size += tensor_item_bytes(item.tensor_data.properties.dtype, tuple(item.tensor_data.chunk.sizes))
        objects.append(RawObject(f"{name_prefix}{number}{DATA_OBJECT_SUFFIX}", size))
    return objects


class Mover:
    """This rank's raw objects, one folder per iteration, in the store's raw area."""

    def __init__(self, store: CheckpointStore, token: str, chunk_bytes: int) -> None:
        self.area = store.raw_area(token)
        self.chunk_bytes = chunk_bytes
        # Random bytes: no storage layer can compress or deduplicate them away.
        self.payload = os.urandom(chunk_bytes)

    @staticmethod
    def name(iteration: int, obj: RawObject) -> str:
        return f"{iteration}/{obj.name}"

    def new_client(self) -> Client:
        """A client built now (outside the timer), as the store's warm_up does for DCP's."""
        return self.area.open()

    def prepare(self, iteration: int, objects: list[RawObject]) -> None:
        """Untimed: the iteration's folders made."""
        self.area.prepare(self.name(iteration, obj) for obj in objects)

    def put(self, client: Client, iteration: int, obj: RawObject) -> None:
        full, rest = divmod(obj.size_bytes, self.chunk_bytes)
        self.area.put(client, self.name(iteration, obj),
                      [self.payload] * full + ([memoryview(self.payload)[:rest]] if rest else []))

    def get(self, client: Client, iteration: int, obj: RawObject) -> int:
        return self.area.get(client, self.name(iteration, obj))

    def get_into(self, client: Client, iteration: int, obj: RawObject, landing: TensorLanding) -> int:
        return landing.land(lambda target: self.area.get_into(client, self.name(iteration, obj), target))

    def put_live(self, client: Client, iteration: int, obj: RawObject, live: LiveBytes) -> None:
        self.area.put(client, self.name(iteration, obj), live.chunks(obj.size_bytes, self.chunk_bytes))

    def drop_cache(self, iteration: int, objects: list[RawObject]) -> str | None:
        """Untimed: the objects out of any local cache; the policy that held (None: none, e.g. S3)."""
        return self.area.drop_cache(self.name(iteration, obj) for obj in objects)

    def remove(self, client: Client, iteration: int, objects: list[RawObject]) -> None:
        self.area.delete(client, [self.name(iteration, obj) for obj in objects])


class TensorLanding:
    """Where the storage-into-tensors GET lands each object, made before the timer: a touched
    host tensor of the largest object's size; on CUDA two pinned ones in turn, each copied to
    the device without blocking while the next one lands."""

    def __init__(self, size_bytes: int, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.hosts = [torch.zeros(max(1, size_bytes), dtype=torch.uint8, pin_memory=cuda)
                      for _ in range(2 if cuda else 1)]
        self.on_device = torch.empty(max(1, size_bytes), dtype=torch.uint8, device=device) if cuda else None
        self.copied: list[Any] = [None] * len(self.hosts)  # CUDA events of each host's last copy
        self._next = 0

    def land(self, fetch: Callable[[memoryview], int]) -> int:
        index, self._next = self._next, (self._next + 1) % len(self.hosts)
        if self.copied[index] is not None:
            self.copied[index].synchronize()
        host = self.hosts[index]
        count = fetch(host.numpy().data.cast("B"))
        if self.on_device is not None:
            self.on_device[:count].copy_(host[:count], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self.copied[index] = event
        return count


class LiveBytes:
    """The rank's live tensors as bytes, what the storage-into-tensors PUT reads: device
    tensors copied to the host a chunk at a time, as DCP's writer does."""

    def __init__(self, state_dict: dict[str, Any]) -> None:
        flat = (local_tensor(t).detach().contiguous().reshape(-1).view(torch.uint8)
                for t in flat_tensors(state_dict).values())
        self.tensors = [tensor for tensor in flat if tensor.numel()]

    def chunks(self, size_bytes: int, chunk_bytes: int) -> Iterable[memoryview]:
        """`size_bytes` of the live tensors' bytes in chunks of at most `chunk_bytes`, cycling
        through them (an object's size and its tensors' need not match: only bytes move)."""
        if not self.tensors:
            raise BenchmarkFailure("the storage-into-tensors PUT found no tensor bytes on this rank")
        left, index, offset = size_bytes, 0, 0
        while left:
            tensor = self.tensors[index]
            take = min(left, chunk_bytes, tensor.numel() - offset)
            part = tensor[offset:offset + take]
            yield (part if part.device.type == "cpu" else part.cpu()).numpy().data
            left, offset = left - take, offset + take
            if offset == tensor.numel():
                index, offset = (index + 1) % len(self.tensors), 0


class Ceiling:
    def __init__(self, loop: Any) -> None:
        """`loop`: the CheckpointLoop whose store and state this mirrors (loop.py imports us)."""
        self.loop = loop
        self.cfg = loop.cfg
        self.rank = loop.ctx.rank
        token = rank0_decides(loop.ctx, lambda: ceiling_token(os.environ.get(RUN_ID_ENV)))
        self.mover = Mover(loop.store, token, self.cfg.storage.part_size_mib * MIB)

    def objects(self) -> tuple[list[RawObject], list[RawObject], str]:
        """This rank's objects to PUT (its save's) and GET (its load's); the suffix mirrored ("ceiling": none)."""
        loop = self.loop
        replicas, read_once = loop.replicas, loop.read_once
        if loop.suffixes:
            suffix = loop.suffixes[-1]

            def share_out() -> list[tuple[list[RawObject], list[RawObject]]]:
                facts = loop.metadata_facts(suffix)  # the run's one read of it, screened
                layout.check_mirrorable(facts, loop.ctx.world_size, suffix)
                if replicas > 1:  # which files a shard's ranks read depends on the saving mesh
                    layout.check_replicas_mirrorable(layout.read_manifest(loop.store, suffix),
                                                     replicas, suffix)
                written = objects_by_rank(facts.object_sizes, loop.ctx.world_size)
                return list(zip(written, read_by_rank(written, replicas, read_once)))
            put, get = rank0_scatters(loop.ctx, share_out)
            return put, get, suffix
        # planned (no checkpoint): the ranks of one shard index plan the same objects; a
        # deduplicated save spreads them over the shard's replicas: object i to replica i mod R
        shard = self.rank % (loop.ctx.world_size // replicas)
        planned = planned_objects(loop.state_dict, shard, self.cfg.storage.thread_count,
                                  loop.store.data_object_prefix(shard))
        writes = [obj for number, obj in enumerate(planned) if number % replicas == loop.replica]
        reads = not read_once or self.rank == shard
        return writes, (planned if reads else []), "ceiling"

    def run(self) -> list[Sample]:
        put_objects, get_objects, suffix = self.objects()
        put_bytes, get_bytes = (sum(o.size_bytes for o in objects)
                                for objects in (put_objects, get_objects))
        object_count, byte_count, read_count = sum_over_ranks(
            len(put_objects), put_bytes, get_bytes)
        loop = self.loop
        loop.log(f"ceiling: {object_count} objects, "
                      f"{byte_count / MIB:.1f} MiB in all, mirroring "
                      f"{'suffix=' + suffix if suffix != 'ceiling' else 'the planned save'}; "
                      f"raw PUT with {self.cfg.storage.thread_count} stream(s) per rank, then GET "
                      "with one (as DCP's reader)"
                      + (f", {read_count / MIB:.1f} MiB read as the load reads them "
                         f"(model.replicas={loop.replicas})" if read_count != byte_count else ""))
        # the bytes a load counts are the checkpoint's once, whoever reads (rank/replicas.py)
        counted_get_bytes = (replica_share(get_bytes, loop.replicas, loop.replica)
                             if loop.replicas > 1 and not loop.read_once else get_bytes)
        samples = []
        threads = max(1, self.cfg.storage.thread_count)
        # the storage-into-tensors rounds' buffers and views, made before any timer
        landing = TensorLanding(max((o.size_bytes for o in get_objects), default=0),
                                loop.ctx.device)
        live = LiveBytes(loop.state_dict)
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ceiling") as pool:
            # (op, objects, (bytes counted, bytes moved), streams, move): a GET reads with one stream, the
            # objects in turn, as DCP's reader does (FileSystemReader.read_data, the connector's with it)
            puts = (put_objects, (put_bytes, put_bytes), pool)
            gets = (get_objects, (counted_get_bytes, get_bytes), None)
            rounds = (("raw_put", *puts, self.mover.put), ("raw_get", *gets, self.mover.get),
                      ("raw_get_tensors", *gets, functools.partial(self.mover.get_into, landing=landing)),
                      ("raw_put_tensors", *puts, functools.partial(self.mover.put_live, live=live)))
            for iteration in range(1, self.cfg.iterations + 1):
                self.mover.prepare(iteration, put_objects)
                # each row carries its own iteration's DCP suffix, not the one whose sizes it mirrors
                own = loop.suffixes[iteration - 1] if len(loop.suffixes) >= iteration else suffix
                try:
                    for op, objects, nbytes, streams, move in rounds:
                        samples.append(self._timed(op, iteration, own, objects, nbytes, streams, move))
                finally:  # after the last collective: no rank still reads these; each rank its
                    # own objects (no collective: also after a failure)
                    self.mover.remove(self.mover.new_client(), iteration, put_objects)
        return samples

    def _timed(self, op: str, iteration: int, suffix: str, objects: list[RawObject],
               nbytes: tuple[int, int], pool: ThreadPoolExecutor | None,
               move: Callable[[Client, int, RawObject], object]) -> Sample:
        """`nbytes`: (the bytes the sample counts, the bytes it moves)."""
        failure = client = cache_policy = None
        try:  # a rank that fails here still meets the others in the collectives below (it
            # must not remove objects another rank is about to read)
            client = self.mover.new_client()
            cache_policy = (self.mover.drop_cache(iteration, objects) if op.startswith("raw_get")
                            else None)
        except Exception as error:
            failure = f"{type(error).__name__}: {error}"
        watchdog = op_watchdog(self.cfg.op_timeout_s, self.loop.on_timeout,
                               f"ceiling {op} iteration {iteration} did not finish within "
                               f"op_timeout_s={self.cfg.op_timeout_s:g}; the storage stalled or is too "
                               "slow: raise op_timeout_s or check the endpoint")
        with timed_region(self.loop.ctx.device, watchdog) as region:  # the one DCP's ops use
            try:  # list(): re-raises the first failure of any stream
                if failure is None:
                    list((pool.map if pool is not None else map)(
                        lambda obj: move(client, iteration, obj), objects))
            except Exception as error:  # every rank learns of it below, none hangs
                failure = f"{type(error).__name__}: {error}"
        found = first_problem(failure)
        if found is not None:
            raise BenchmarkFailure(f"ceiling {op} iteration {iteration} failed on rank {found[0]}: {found[1]}")
        request_log = self.loop.request_log
        end_mono, end_wall = float(region.end_mono or 0.0), float(region.end_wall or 0.0)
        duration = end_mono - region.begin_mono
        counted, moved = nbytes
        return Sample(
            op=op, iteration=iteration, suffix=suffix, rank=self.rank, host=self.loop.host,
            begin_wall_s=region.begin_wall, end_wall_s=end_wall, begin_mono_s=region.begin_mono,
            end_mono_s=end_mono, duration_s=duration, bytes=counted,
            fetched_bytes=moved if op.startswith("raw_get") else None,
            barrier_wait_s=region.begin_mono - region.barrier_start, io_s=duration,
            cache_policy=cache_policy,
            requests=(None if request_log is None else request_log.window(
                region.begin_wall, end_wall, moved if op.startswith("raw_put") else None,
                moved_bytes=moved)))


# -- DCP alone: the same dcp.save / dcp.load on storage that is memory ---------------------

MEMORY_HEADROOM = 1.25  # free tmpfs space wanted over the node's checkpoint bytes


def dcp_alone(loop: Any) -> list[Sample]:
    """The run's own dcp.save then dcp.load, per iteration, on a tmpfs directory: DCP when
    storage is as fast as memory. One node only (the .metadata is in rank 0's memory);
    skipped, with a line, where tmpfs lacks the room. The next launch reaps a killed run's."""
    ctx = loop.ctx
    if ctx.node_count > 1:
        loop.log("ceiling: DCP alone (tmpfs) is measured on one node only; skipped")
        return []
    needed = sum_over_ranks(local_bytes(loop.state_dict))[0] * MEMORY_HEADROOM

    def make_dir() -> str:
        memory = lifeline.MEMORY_DIR
        if not os.path.isdir(memory) or shutil.disk_usage(memory).free < needed:
            return ""
        return str(lifeline.owned_tempdir("dcp-fsdp-mem-", memory))
    directory = rank0_decides(ctx, make_dir)
    if not directory:
        loop.log(f"ceiling: DCP alone skipped: {lifeline.MEMORY_DIR} lacks {needed / MIB:.0f} MiB free")
        return []
    store = FsStore(StorageConfig(kind=StorageKind.fs, path=directory, sync_files=False,
                                  thread_count=loop.cfg.storage.thread_count))
    try:
        samples = [loop.timed_on(store, op, iteration, f"dcp-alone-{iteration}", f"mem_{op}")
                   for iteration in range(1, loop.cfg.iterations + 1) for op in ("save", "load")]
        dist.barrier()  # no rank still reads it (after a failure: no collective, peers may be gone)
    finally:
        if ctx.rank == 0:
            shutil.rmtree(directory, ignore_errors=True)
    return samples


# -- headroom (docs/headroom.md): the run's last checkpoint loaded through the tool's reader
# (`ra_load`), its state saved with twice the files per rank (`tc_save`) --------------------

READ_AHEAD = 8  # fetches in flight when the run itself used DCP's reader


def _read_ahead_loads(loop: Any) -> list[Sample]:
    if not loop.suffixes:  # `dcp-fsdp ceiling`: no checkpoint
        return []
    storage = loop.cfg.storage
    store = make_store(dataclasses.replace(storage, read_ahead=storage.read_ahead or READ_AHEAD))
    return [loop.timed_on(store, "load", iteration, loop.suffixes[-1], "ra_load")
            for iteration in range(1, loop.cfg.iterations + 1)]


def _more_files_saves(loop: Any) -> list[Sample]:
    """DCP's save of the same state with twice the files per rank, into the ceiling area."""
    storage = loop.cfg.storage
    threads = min(MAX_THREAD_COUNT, 2 * storage.thread_count)
    if threads == storage.thread_count:
        return []
    token = rank0_decides(loop.ctx, lambda: ceiling_token(os.environ.get(RUN_ID_ENV)))
    area = loop.store.raw_area(f"files-{token}").location  # never inside a checkpoint
    place = {"uri": area} if storage.kind.value == "s3" else {"path": area}
    store = make_store(dataclasses.replace(storage, thread_count=threads, **place))
    samples = []
    try:
        for iteration in range(1, loop.cfg.iterations + 1):
            samples.append(loop.timed_on(store, "save", iteration, f"save-{iteration}", "tc_save"))
            dist.barrier()  # every rank's objects are written before rank 0 removes them
            if loop.ctx.rank == 0:
                store.delete(f"save-{iteration}")
    finally:  # after a failure, no collective (peers may be gone): what rank 0 finds goes
        if loop.ctx.rank == 0:
            _remove_area(store, storage.kind.value, area, loop.cfg.iterations)
    return samples


def _remove_area(store: CheckpointStore, kind: str, area: str, iterations: int) -> None:
    """The more-files saves' objects and open uploads (a save cut short leaves both)."""
    for iteration in range(1, iterations + 1):
        suffix = f"save-{iteration}"
        with contextlib.suppress(Exception):  # the run's outcome stands; list / clean-uploads show the rest
            store.abort_uploads(suffix)
            store.delete(suffix)
    if kind == "fs":  # the emptied area, and `<path>.ceiling` above it when nothing else is there
        for directory in (Path(area), Path(area).parent):
            try:
                directory.rmdir()
            except OSError:  # not empty (another round's files) or gone
                return


def run_ceiling(loop: Any) -> list[Sample]:
    return Ceiling(loop).run() + dcp_alone(loop) + _read_ahead_loads(loop) + _more_files_saves(loop)
