"""The one timed loop behind save, load and save-and-load.

Per iteration and phase: choose the suffix (rank 0, broadcast), build the
writer/reader, align the ranks with a barrier, and time only `dcp.save` /
`dcp.load`. Suffix choice, writer construction, verification and the optional
delay all happen outside the timers.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dcp_fsdp.config.schema import BenchmarkConfig, Command
from dcp_fsdp.errors import BenchmarkFailure, UserError
from dcp_fsdp.models.build import ShardedModel, local_tensor
from dcp_fsdp.rank import digests
from dcp_fsdp.rank.distributed import RankContext, all_gather_object, rank0_decides
from dcp_fsdp.rank.hooks import HookTimeline, instrument_reader, instrument_writer
from dcp_fsdp.rank.state import apply_state_dict, flat_tensors
from dcp_fsdp.storage import layout
from dcp_fsdp.storage.base import CheckpointStore
from dcp_fsdp.telemetry.records import Sample


class Watchdog:
    """Calls `on_timeout(message)` from a timer thread if the block runs too long.

    A stalled S3 request blocks inside native code, where no Python exception can
    reach it; the callback ends the process instead (after recording the failure).
    """

    def __init__(self, timeout_s: float, on_timeout: Callable[[str], None], message: str) -> None:
        self.timer = threading.Timer(timeout_s, on_timeout, args=(message,))
        self.timer.daemon = True

    def __enter__(self) -> "Watchdog":
        self.timer.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.timer.cancel()


class CheckpointLoop:
    def __init__(self, cfg: BenchmarkConfig, ctx: RankContext, store: CheckpointStore,
                 sharded: ShardedModel, state_dict: dict[str, Any], request_log,
                 say: Callable[[str], None], on_timeout: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.on_timeout = on_timeout
        self.ctx = ctx
        self.store = store
        self.sharded = sharded
        self.state_dict = state_dict
        self.request_log = request_log  # telemetry.request_log.RequestLog, or None
        self.log = say
        self.samples: list[Sample] = []
        self.suffixes: list[str] = []
        # Per suffix loaded: {"checked": bool, "reason": why not} (recorded on the run line).
        self.integrity: dict[str, dict[str, Any]] = {}
        self._expected_checksums: dict[str, dict[str, int] | None] = {}
        self.host = socket.gethostname()

    # -- suffixes ------------------------------------------------------------------------
    def _choose_save_suffix(self, iteration: int) -> str:
        return rank0_decides(self.ctx, lambda: layout.save_suffix(
            self.store, self.cfg.suffix, self.cfg.iterations, iteration, self.suffixes))

    def _check_matches_checkpoint(self, suffix: str) -> None:
        """Before timing a load: the checkpoint must hold this model's tensors and shapes."""
        def decide() -> None:
            reader = self.store.reader(suffix)
            reader.reset(self.store.location(suffix))
            stored = reader.read_metadata().state_dict_metadata
            problem = None
            for key, tensor in flat_tensors(self.state_dict).items():
                entry = stored.get(key)
                if entry is None or not hasattr(entry, "size"):
                    problem = f"it has no tensor '{key}'"
                    break
                if tuple(entry.size) != tuple(tensor.shape):
                    problem = (f"'{key}' is {list(entry.size)} there but "
                               f"{list(tensor.shape)} here")
                    break
                if entry.properties.dtype != tensor.dtype:
                    problem = f"'{key}' is {entry.properties.dtype} there but {tensor.dtype} here"
                    break
            if problem is None:
                return
            manifest = layout.read_manifest(self.store, suffix) or {}
            saved_with = " ".join(f"{k}={manifest[k]}" for k in
                                  ("model", "model.dtype", "state") if k in manifest)
            fix = f"load it with {saved_with}" if saved_with else "load it with the settings it was saved with"
            raise UserError(
                f"suffix={suffix}: checkpoint does not match model={self.cfg.model.preset} "
                f"model.dtype={self.cfg.model.dtype.value} state={self.cfg.state.value} "
                f"({problem}); {fix}")
        rank0_decides(self.ctx, decide)

    # -- one timed operation -------------------------------------------------------------
    def _timed(self, op: str, iteration: int, suffix: str) -> Sample:
        if op == "save":
            storage_io = self.store.writer(suffix)
            timeline = instrument_writer(storage_io)
        else:
            storage_io = self.store.reader(suffix)
            timeline = instrument_reader(storage_io)
        self.store.warm_up(storage_io)

        barrier_start = time.monotonic()
        dist.barrier()
        begin_mono = time.monotonic()
        begin_wall = time.time()
        with Watchdog(self.cfg.op_timeout_s, self.on_timeout,
                      f"{op} iteration {iteration} (suffix {suffix}) did not finish within "
                      f"op_timeout_s={self.cfg.op_timeout_s:g}; the storage stalled or is "
                      "too slow: raise op_timeout_s or check the endpoint"):
            if op == "save":
                dcp.save(self.state_dict, storage_writer=storage_io)
            else:
                dcp.load(self.state_dict, storage_reader=storage_io)
        end_mono = time.monotonic()
        end_wall = time.time()
        return self._sample(op, iteration, suffix, timeline, barrier_start, begin_mono,
                            begin_wall, end_mono, end_wall)

    def _sample(self, op, iteration, suffix, timeline: HookTimeline, barrier_start, begin_mono,
                begin_wall, end_mono, end_wall) -> Sample:
        io_hook = "write_data" if op == "save" else "read_data"
        io_span = timeline.spans.get(io_hook)
        return Sample(
            op=op, iteration=iteration, suffix=suffix, rank=self.ctx.rank, host=self.host,
            begin_wall_s=begin_wall, end_wall_s=end_wall, begin_mono_s=begin_mono,
            end_mono_s=end_mono, duration_s=end_mono - begin_mono, bytes=timeline.io_bytes,
            barrier_wait_s=begin_mono - barrier_start,
            plan_s=None if io_span is None else io_span[0] - begin_mono,
            io_s=None if io_span is None else io_span[1] - io_span[0],
            commit_s=None if io_span is None else end_mono - io_span[1],
            metadata_s=timeline.duration_s("read_metadata"),
            finish_s=timeline.duration_s("finish"),
            requests=(None if self.request_log is None else self.request_log.window(
                begin_wall, end_wall, timeline.uploaded_bytes if op == "save" else None)),
        )

    # -- verification (save-and-load) ----------------------------------------------------
    def _clear(self) -> None:
        """Zero every live tensor before a verified load, so a load that reads nothing fails."""
        with torch.no_grad():
            for tensor in flat_tensors(self.state_dict).values():
                local_tensor(tensor).zero_()

    def _verify_against(self, expected: dict[str, str], what: str) -> None:
        """Every rank compares its shards' digests; all ranks raise together on a mismatch."""
        bad = digests.mismatches(flat_tensors(self.state_dict), expected)
        reports = all_gather_object(bad[:1])
        if any(reports):
            rank, keys = next((rank, keys) for rank, keys in enumerate(reports) if keys)
            raise BenchmarkFailure(f"{what} (tensor '{keys[0]}', rank {rank}'s shard)")

    # -- integrity (checksums stored with each checkpoint) ---------------------------------
    def _digest_saved(self, suffix: str) -> dict[str, str] | None:
        """Digests of what was just saved: stored with the checkpoint and/or kept for the
        save-and-load check (digests, not a copy: no second model in memory)."""
        keep = self.cfg.command == Command.save_and_load and self.cfg.verify
        if not (self.cfg.integrity or keep):
            return None
        sums = digests.shard_checksums(flat_tensors(self.state_dict))
        if self.cfg.integrity:
            self.store.put_small(suffix, layout.checksum_object_name(self.ctx.rank),
                                   digests.encode(self.ctx.rank, self.ctx.world_size, sums))
        return sums if keep else None

    def _load_expected_checksums(self, suffix: str) -> None:
        """Read this rank's checksums for `suffix` (once, untimed); agree on checking or not."""
        if suffix in self._expected_checksums:
            return
        expected, reason = None, None
        if not self.cfg.integrity:
            reason = "integrity=false"
        else:
            stored = digests.decode(self.store.get_small(suffix,
                                                             layout.checksum_object_name(self.ctx.rank)))
            if stored is None:
                reason = "no checksums stored with this checkpoint"
            elif stored["world_size"] != self.ctx.world_size:
                reason = (f"saved with world_size={stored['world_size']}, loaded with "
                          f"{self.ctx.world_size}: shards differ")
            else:
                expected = stored["checksums"]
        reasons = all_gather_object(reason)
        reason = next((r for r in reasons if r), None)
        self._expected_checksums[suffix] = None if reason else expected
        self.integrity[suffix] = {"checked": reason is None, "reason": reason}
        if reason and self.cfg.integrity:
            self.log(f"integrity check of suffix={suffix} skipped: {reason}")

    def _verify_checksums(self, suffix: str, iteration: int) -> None:
        expected = self._expected_checksums.get(suffix)
        if expected is not None:
            self._verify_against(
                expected, f"integrity: load iteration {iteration} of suffix={suffix} read data "
                "that does not match the checksums recorded at save: the checkpoint's objects "
                "are corrupt")

    # -- the loop ------------------------------------------------------------------------
    def run(self) -> list[Sample]:
        command = self.cfg.command
        # `dcp-fsdp ceiling`: no DCP operation, only the raw rounds at the end
        dcp_iterations = 0 if command == Command.ceiling else self.cfg.iterations
        for iteration in range(1, dcp_iterations + 1):
            if command in (Command.save, Command.save_and_load):
                suffix = self._choose_save_suffix(iteration)
                self.samples.append(self._timed("save", iteration, suffix))
                self.suffixes.append(suffix)
                saved_digests = self._digest_saved(suffix)
                self._write_manifest(suffix)
                self.log(f"saved suffix={suffix} at {self.store.location(suffix)} "
                         f"(iteration {iteration}/{self.cfg.iterations})")
            else:
                suffix = self.cfg.suffix
                if iteration == 1:
                    self._check_matches_checkpoint(suffix)
                    self.suffixes.append(suffix)
            if command == Command.save_and_load:
                self._pause()
                if saved_digests is not None:
                    self._clear()
                self.samples.append(self._timed("load", iteration, suffix))
                if saved_digests is not None:
                    self._verify_against(
                        saved_digests, f"save-and-load iteration {iteration}: data loaded from "
                        f"suffix={suffix} differs from what was saved")
                    self.integrity[suffix] = {"checked": True, "reason": None}
                else:
                    self.integrity[suffix] = {"checked": False,
                                              "reason": "verify=false and integrity=false"}
                apply_state_dict(self.sharded, self.state_dict)
            elif command == Command.load:
                self._load_expected_checksums(suffix)
                self.samples.append(self._timed("load", iteration, suffix))
                self._verify_checksums(suffix, iteration)
                apply_state_dict(self.sharded, self.state_dict)
            if iteration < self.cfg.iterations:
                self._pause()
        if self.cfg.ceiling or command == Command.ceiling:
            from dcp_fsdp.rank.ceiling import run_ceiling

            self._pause()
            self.samples.extend(run_ceiling(self))
        dist.barrier()
        return self.samples

    def _pause(self) -> None:
        if self.cfg.delay_s > 0:
            time.sleep(self.cfg.delay_s)

    def _write_manifest(self, suffix: str) -> None:
        """A small description of the checkpoint (after .metadata: not part of the commit)."""
        if not self.ctx.is_coordinator:
            return
        manifest = {"model": self.cfg.model.preset, "model.dtype": self.cfg.model.dtype.value,
                    "state": self.cfg.state.value, "world_size": self.ctx.world_size,
                    "param_count": self.sharded.param_count,
                    "integrity": digests.ALGORITHM if self.cfg.integrity else None}
        self.store.put_small(suffix, layout.MANIFEST_NAME, layout.encode_manifest(manifest))
