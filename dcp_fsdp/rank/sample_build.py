"""One timed operation's sample, from its clocks and what the timed writer or reader
recorded (storage/timeline.py): the phases (barrier's release -> plan_s -> io_s, split by who
spends it -> commit_s -> done) are computed here alone; docs/metrics.md defines each.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Iterator

import torch.distributed as dist

from dcp_fsdp.config.schema import StorageClient
from dcp_fsdp.process.wire_meter import HOOKED_WATCH_PERIOD_S, WATCH_PERIOD_S, WireMeter, endpoint_port
from dcp_fsdp.rank.device import sync_device
from dcp_fsdp.storage.s3_target import resolve_endpoint
from dcp_fsdp.storage.timeline import HookTimeline
from dcp_fsdp.telemetry.records import Sample


@dataclasses.dataclass
class RegionClocks:
    """The clock reads of one timed region (monotonic, wall and the process's CPU, seconds)."""

    barrier_start: float = 0.0  # monotonic, entering the aligning barrier
    begin_mono: float = 0.0  # the barrier's release
    begin_wall: float = 0.0
    end_mono: float | None = None  # after the work and the device's queued work are done
    end_wall: float | None = None
    begin_cpu: float = 0.0  # time.process_time(): every thread of the rank's process
    end_cpu: float | None = None


@contextlib.contextmanager
def timed_region(device: Any, watchdog: Any) -> Iterator[RegionClocks]:
    """The one timed region of every operation (DCP's and the raw ceiling's): the ranks aligned
    by a barrier, `watchdog` armed around the work, the clocks closed after the device's work."""
    clocks = RegionClocks(barrier_start=time.monotonic())
    dist.barrier()
    clocks.begin_mono, clocks.begin_wall = time.monotonic(), time.time()
    clocks.begin_cpu = time.process_time()
    with watchdog:
        yield clocks
        sync_device(device)  # queued CUDA work ends before the clock is read
        clocks.end_mono, clocks.end_wall = time.monotonic(), time.time()
        clocks.end_cpu = time.process_time()


@dataclasses.dataclass
class OpInProgress:
    """One timed operation: what was prepared untimed, its clocks, and what the timed block measured."""

    op: str
    iteration: int
    suffix: str
    timeline: HookTimeline
    pickled: bool  # the process checkpointer's daemon holds the writer (and its timeline)
    storage_io: Any = None
    cache_policy: str | None = None
    baseline_s: list[float] = dataclasses.field(default_factory=list)
    planner: Any = None
    region: RegionClocks = dataclasses.field(default_factory=RegionClocks)
    timing: Any = None  # an async save's AsyncTiming
    broadcast_s: float | None = None
    peak_rss: int | None = None
    cuda_peak: int | None = None
    minor_faults: int | None = None
    reader: str | None = None  # a load through the tool's reader: "read_ahead=N"
    wire: Any = None  # a load's process/wire_meter.WireMeter (S3 with request statistics)


def build_sample(run: OpInProgress, end_mono: float, rank: int, host: str, state_bytes: int,
                 replica: int | None, request_log: Any) -> Sample:
    """`state_bytes`: checkpoint bytes, what this rank's shards hold (every throughput
    divides these; with replicas, its replica's share); written_bytes / fetched_bytes: what
    it moved to / from storage (fetched > bytes is read amplification: `_fetched_bytes`)."""
    op, timeline, region = run.op, run.timeline, run.region
    end_wall = region.begin_wall + (end_mono - region.begin_mono)
    # A cadence overlaps saves: this one's requests start after the previous upload's end.
    window_wall = region.begin_wall
    if run.timing is not None and run.timing.previous_end_mono is not None:
        window_wall += max(0.0, run.timing.previous_end_mono - region.begin_mono)
    io_span = timeline.spans.get("write_data" if op == "save" else "read_data")
    io_s = None if io_span is None else io_span[1] - io_span[0]
    requests = None if request_log is None else request_log.window(
        window_wall, end_wall, timeline.uploaded_bytes if op == "save" else None, moved_bytes=timeline.io_bytes)
    return Sample(
        op=op, iteration=run.iteration, suffix=run.suffix, rank=rank, host=host,
        begin_wall_s=region.begin_wall, end_wall_s=end_wall,
        begin_mono_s=region.begin_mono, end_mono_s=end_mono,
        duration_s=end_mono - region.begin_mono, bytes=state_bytes, replica=replica,
        # an async save's upload outlives the region (and a process checkpointer's is not ours)
        cpu_s=(region.end_cpu - region.begin_cpu
               if region.end_cpu is not None and end_mono == region.end_mono else None),
        written_bytes=timeline.io_bytes if op == "save" else None,
        fetched_bytes=_fetched_bytes(timeline, requests, run.wire) if op == "load" else None,
        barrier_wait_s=region.begin_mono - region.barrier_start,
        plan_s=None if io_span is None else io_span[0] - region.begin_mono,
        io_s=io_s,
        commit_s=None if io_span is None else end_mono - io_span[1],
        metadata_s=timeline.duration_s("read_metadata"),
        finish_s=timeline.duration_s("finish"),
        requests=requests,
        peak_rss_bytes=run.peak_rss, cuda_max_allocated_bytes=run.cuda_peak,
        cache_policy=run.cache_policy, minor_faults=run.minor_faults, reader=run.reader,
        msc_reads="+".join(sorted(timeline.msc_reads, reverse=True)) or None,
        read_ahead_peak_bytes=timeline.read_ahead_peak_bytes, broadcast_s=run.broadcast_s,
        **_io_split(timeline, op, io_s),
    )


def _io_split(timeline: HookTimeline, op: str, io_s: float | None) -> dict[str, Any]:
    """io_s by who spends it: inside the client's storage calls (a save's upload_s, a load's
    storage_s), and the rest (a save's stage_s; a load's copy into the live tensors and DCP's own
    work); never below zero: the clocks differ by microseconds at most."""
    if io_s is None or timeline.storage_s is None:
        return {}
    busy_s = min(timeline.storage_s, io_s)
    rest_s = io_s - busy_s
    if op == "save":
        return {"upload_s": busy_s, "stage_s": rest_s}
    copied_s = None if timeline.target_copy_s is None else min(timeline.target_copy_s, rest_s)
    return {"storage_s": busy_s, "target_copy_s": copied_s, "deserialise_s": rest_s - (copied_s or 0.0)}


def start_wire_meter(op: str, request_log: Any, storage: Any) -> Any:
    """A load's wire meter (S3 with request statistics), watching from before its barrier
    until its sample is built; None otherwise, or where it cannot read."""
    if op != "load" or request_log is None:
        return None
    meter = WireMeter(endpoint_port(resolve_endpoint(storage)))
    if not meter.available():
        return None
    meter.start()
    hooked = storage.client != StorageClient.s3torchconnector  # its GET hooks name every socket
    meter.watch(HOOKED_WATCH_PERIOD_S if hooked else WATCH_PERIOD_S)
    return meter


@contextlib.contextmanager
def wire_closed_on_error(wire: Any) -> Iterator[None]:
    """A load's wire meter told the load starts (entered after the barrier: it scans fast while
    the load's connections open), and closed (its watching thread stopped) where the load
    raises: its sample, which would close it, is never built."""
    if wire is not None:
        wire.hurry()
    try:
        yield
    except BaseException:
        if wire is not None:
            wire.close()
        raise


def _fetched_bytes(timeline: HookTimeline, requests: dict[str, Any] | None,
                   wire: Any = None) -> int:
    """What the kernel received on the rank's sockets to the endpoint, HTTP heads included, where
    its meter is exact: a GET cut mid-body then counts what came down of it, so the requests'
    `bytes_down_broken_max` becomes 0. Else the request log's whole GET bodies (lines all parsed),
    else the streams': what DCP read, blind to a GET's body that broke and came again."""
    if wire is not None:
        received, exact = wire.received(), wire.exact
        wire.close()
        if exact and requests is not None and not requests.get("unparsed"):
            requests["bytes_down_broken_max"] = 0
            return int(received)
    if requests and not requests.get("unparsed") and requests.get("bytes_down") is not None:
        return int(requests["bytes_down"])
    return timeline.io_bytes


def fill_save_figures(sample: Sample, save_mode: str, timing: Any, unreported: bool) -> None:
    """A save's figures of what training paid: a sync save blocks until committed; an async
    one (`timing`: AsyncTiming) from its own marks. `unreported`: the daemon wrote no
    timeline, so the written bytes come from the checkpoint's Metadata."""
    sample.save_mode = save_mode
    if timing is None:  # sync: control comes back when the checkpoint is committed
        sample.blocked_s = sample.persisted_s = sample.stall_s = sample.duration_s
        return
    sample.blocked_s, sample.staged_s = timing.blocked_s, timing.staged_s
    sample.persisted_s, sample.previous_wait_s = timing.persisted_s, timing.previous_wait_s
    sample.train_steps, sample.train_step_slowdown = timing.train_steps, timing.train_step_slowdown
    sample.train_wait_s, sample.stager_renewed = timing.train_wait_s, timing.stager_renewed
    sample.stall_s, sample.interval_s = timing.stall_s, timing.interval_s
    sample.train_lost_s, sample.train_lost_share = timing.train_lost_s, timing.train_lost_share
    if unreported and timing.metadata is not None:
        from dcp_fsdp.rank.async_save import rank_bytes

        sample.written_bytes = rank_bytes(timing.metadata, sample.rank)
    timing.metadata = None  # the global Metadata: not kept past its sample
