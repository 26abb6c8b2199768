"""From a planned save's objects to S3 requests, per-prefix rates and projected times
(s3torchconnector over the CRT client): what is counted, and how, is docs/plan.md's "Requests and
prefixes (s3)". The tool's own requests are not counted.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

from dcp_fsdp.units import GET_LIMIT_PER_S, PUT_LIMIT_PER_S
# One rank's reads at a load: (object name, first byte, end) ranges, sorted, each a run of
# items that lie back to back in that object
Reads = tuple[tuple[str, int, int], ...]


@dataclasses.dataclass(frozen=True)
class Prefixes:
    strategy: str  # default | binary | hex | round_robin
    count: int  # distinct prefixes the ranks' keys are spread over

    def of(self, rank: int) -> int:
        return rank % self.count


def prefixes_for(strategy: str, prefix_count: int | None, round_robin: Sequence[str],
                 world_size: int) -> Prefixes:
    if strategy in ("hex", "binary"):
        return Prefixes(strategy, prefix_count or world_size)
    if strategy == "round_robin":
        return Prefixes(strategy, max(1, len(round_robin)))
    return Prefixes("default", 1)


def parts(size_bytes: int, part_bytes: int) -> int:
    """Parts (or ranged GETs) of one object: at least one, even when empty."""
    return max(1, math.ceil(size_bytes / part_bytes))


def put_requests(size_bytes: int, part_bytes: int) -> int:
    """CreateMultipartUpload + UploadParts + CompleteMultipartUpload."""
    return 2 + parts(size_bytes, part_bytes)


@dataclasses.dataclass(frozen=True)
class Requests:
    save_put: int  # PUT-class: multipart requests of every object, + the rename's CopyObject
    save_delete: int  # the rename's DeleteObject (free, but counted against the PUT limit)
    load_get: int  # ranged GETs of every data object once + `.metadata` once per rank
    metadata_gets_per_rank: int


def count_requests(object_sizes: Iterable[int], metadata_bytes: int, world_size: int,
                   part_bytes: int, load_reads: Sequence[Sequence[tuple[str, int, int]]] | None = None,
                   max_gap_bytes: int = 0) -> Requests:
    """`load_reads`: each rank's (object, start, end) reads at a load (build.load_reads), read
    as the connector's dcp_optimized reader reads them; None: each object once, whole."""
    sizes = list(object_sizes)
    save = sum(put_requests(s, part_bytes) for s in sizes) + put_requests(metadata_bytes, part_bytes) + 1
    metadata_gets = parts(metadata_bytes, part_bytes)
    if load_reads is None:
        data_gets = sum(parts(s, part_bytes) for s in sizes)
    else:
        data_gets = sum(rank_read_gets(reads, part_bytes, max_gap_bytes) for reads in load_reads)
    return Requests(save, 1, data_gets + world_size * metadata_gets, metadata_gets)


def merged_ranges(ranges: Iterable[tuple[str, int, int]], max_gap_bytes: int = 0) -> Reads:
    """Sorted (object, start, end) ranges, those of one object at most `max_gap_bytes` apart made one."""
    merged: list[tuple[str, int, int]] = []
    for name, start, end in ranges:
        if merged and merged[-1][0] == name and start - merged[-1][2] <= max_gap_bytes:
            merged[-1] = (name, merged[-1][1], end)
        else:
            merged.append((name, start, end))
    return tuple(merged)


def rank_read_gets(reads: Sequence[tuple[str, int, int]], part_bytes: int,
                   max_gap_bytes: int) -> int:
    """Ranged GETs of one rank's sorted reads: ranges of one object whose gap is at most
    `max_gap_bytes` share a stream (dcp_optimized's range groups), `part_bytes` a GET."""
    return sum(parts(end - start, part_bytes) for _, start, end in merged_ranges(reads, max_gap_bytes))


@dataclasses.dataclass(frozen=True)
class PrefixLoad:
    peak_put_per_s: float  # the busiest prefix during a save's upload
    peak_get_per_s: float  # the busiest prefix during a load's reads (data objects)
    metadata_get_burst: int  # GETs of the one `.metadata` key at a load's start
    recommended_count: int | None  # hex prefix_count that keeps both under S3's limits
    single_rank_over: bool  # one rank alone passes a limit: no prefix count helps


def prefix_load(rank_objects: Sequence[Sequence[int]], prefixes: Prefixes, part_bytes: int,
                rank_rate_bytes_s: float, metadata_gets_per_rank: int) -> PrefixLoad:
    """Peak request rates per prefix while every rank moves its objects at the given rate."""
    put_rates, get_rates = [], []
    for sizes in rank_objects:
        seconds = max(sum(sizes), 1) / rank_rate_bytes_s
        put_rates.append(sum(put_requests(s, part_bytes) for s in sizes) / seconds)
        get_rates.append(sum(parts(s, part_bytes) for s in sizes) / seconds)
    put_sum = [0.0] * prefixes.count
    get_sum = [0.0] * prefixes.count
    for rank, (put, get) in enumerate(zip(put_rates, get_rates)):
        put_sum[prefixes.of(rank)] += put
        get_sum[prefixes.of(rank)] += get
    world = len(rank_objects)
    max_put, max_get = max(put_rates, default=0.0), max(get_rates, default=0.0)
    single_over = max_put > PUT_LIMIT_PER_S or max_get > GET_LIMIT_PER_S
    recommended = None
    if not single_over and world:
        per_prefix = min(PUT_LIMIT_PER_S // max(max_put, 1e-9), GET_LIMIT_PER_S // max(max_get, 1e-9))
        recommended = math.ceil(world / max(1, int(min(per_prefix, world))))
    return PrefixLoad(max(put_sum), max(get_sum), world * metadata_gets_per_rank, recommended,
                      single_over)


@dataclasses.dataclass(frozen=True)
class Projection:
    nodes: int
    ranks: int
    save_s: float
    load_s: float
    save_throttled: bool  # the busiest prefix's requests, not the bytes, set the save's time
    load_throttled: bool


def project(nodes: int, ranks: int, max_rank_bytes: int, planning_s: float, metadata_bytes: int,
            metadata_pickle_s: float, metadata_unpickle_s: float, save_rate_bytes_s: float,
            load_rate_bytes_s: float, busiest_prefix_puts: int, busiest_prefix_gets: int,
            metadata_get_burst: int) -> Projection:
    """A save's and a load's time at this size (docs/plan.md): the slowest rank's bytes at the
    measured rate, plus `.metadata`'s costs, with a prefix's requests at S3's limit as a floor."""
    save_io = max_rank_bytes / save_rate_bytes_s
    save_floor = busiest_prefix_puts / PUT_LIMIT_PER_S
    save = (planning_s + max(save_io, save_floor) + metadata_pickle_s
            + metadata_bytes / save_rate_bytes_s)
    load_io = max_rank_bytes / load_rate_bytes_s
    load_floor = busiest_prefix_gets / GET_LIMIT_PER_S
    metadata_read = max(metadata_bytes / load_rate_bytes_s, metadata_get_burst / GET_LIMIT_PER_S)
    load = metadata_read + metadata_unpickle_s + max(load_io, load_floor)
    return Projection(nodes, ranks, save, load, save_floor > save_io, load_floor > load_io)


def busiest_prefix_requests(rank_objects: Sequence[Sequence[int]], prefixes: Prefixes,
                            part_bytes: int) -> tuple[int, int]:
    """(PUT-class requests of a save, GETs of a load's data) on the busiest prefix."""
    puts = [0] * prefixes.count
    gets = [0] * prefixes.count
    for rank, sizes in enumerate(rank_objects):
        puts[prefixes.of(rank)] += sum(put_requests(s, part_bytes) for s in sizes)
        gets[prefixes.of(rank)] += sum(parts(s, part_bytes) for s in sizes)
    return max(puts, default=0), max(gets, default=0)
