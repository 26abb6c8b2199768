"""The one timed loop behind save, load and save-and-load.

Per iteration and phase: choose the suffix (rank 0, broadcast), build the
writer/reader, align the ranks with a barrier, and time only `dcp.save` /
`dcp.load`. Suffix choice, writer construction, verification and the optional
delay all happen outside the timers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dcp_fsdp import contract
from dcp_fsdp.config.schema import BenchmarkConfig, Command, ReplicaLoad
from dcp_fsdp.errors import BenchmarkFailure, UserError
from dcp_fsdp.models import values
from dcp_fsdp.models.build import ShardedModel, local_tensor, replica_of
from dcp_fsdp.rank import verify
from dcp_fsdp.rank.distributed import RankContext, all_gather_object, rank0_decides
from dcp_fsdp.rank.sample_build import OpClocks, build_sample, fill_save_figures
from dcp_fsdp.storage.timeline import HookTimeline
from dcp_fsdp.rank.memory import PeakMemory
from dcp_fsdp.rank.progress import Heartbeat
from dcp_fsdp.rank.replicas import read_once_load, replica_share
from dcp_fsdp.rank.state import apply_state_dict, flat_tensors
from dcp_fsdp.rank.watchdog import Watchdog
from dcp_fsdp.storage import layout
from dcp_fsdp.storage.base import CheckpointStore
from dcp_fsdp.telemetry.records import Sample


def take_timeline_file(timeline: HookTimeline) -> None:
    """What the daemon's copy of `timeline` recorded, taken in and its file removed."""
    timeline.load_dump()
    if timeline.dump_path is not None:
        Path(timeline.dump_path).unlink(missing_ok=True)


class CheckpointLoop:
    def __init__(self, cfg: BenchmarkConfig, ctx: RankContext, store: CheckpointStore,
                 sharded: ShardedModel, state_dict: dict[str, Any], request_log,
                 say: Callable[[str], None], on_timeout: Callable[[str], None],
                 async_saver: Any = None) -> None:
        self.cfg = cfg
        # save_mode=async: created on first use, or handed in to be shared (tune's trials)
        self.async_saver = async_saver
        self.on_timeout = on_timeout
        self.ctx = ctx
        self.store = store
        self.sharded = sharded
        self.state_dict = state_dict
        self.request_log = request_log  # telemetry.request_log.RequestLog, or None
        self.log = say
        self.samples: list[Sample] = []  # this rank's
        # Every rank's samples of each finished operation, shared right after it (untimed):
        # a run cut short by an interrupt or a failure still records whole operations.
        self.shared_samples: list[Sample] = []
        self.suffixes: list[str] = []
        self.suffix_claim: str | None = None  # how the saves' suffixes were claimed (layout)
        self.writing_suffix: str | None = None  # a save in progress: incomplete if we stop
        # The last save, recorded once its upload is done: (sample or a wait for it, suffix,
        # iteration).
        self._pending_save: tuple[Sample | Callable[[], Sample], str, int] | None = None
        self._timeline_dir: Path | None = None  # process checkpointer: see _timeline_file
        # Per suffix loaded: {"checked": bool, "reason": why not} (recorded on the run line).
        self.integrity: dict[str, dict[str, Any]] = {}
        self._expected_checksums: dict[str, int | None] = {}  # suffix -> seed to check with
        self.host = socket.gethostname()
        # model.replicas > 1 (HSDP): this rank's replica group; bytes count its share
        self.replicas = sharded.replicas
        self.replica = replica_of(ctx.rank, ctx.world_size, self.replicas)[0]
        self.read_once = (self.replicas > 1
                          and cfg.model.replica_load == ReplicaLoad.read_once)
        # benchmark-only (benchmarks/harness_cost.py): instrumentation left out of the timer
        self.harness_off, _ = contract.harness_off(os.environ.get(contract.HARNESS_OFF_ENV))

    # -- suffixes ------------------------------------------------------------------------
    def _timeline_file(self, suffix: str) -> str:
        """Where the process checkpointer's daemon writes one save's timeline (a directory
        of this rank's, named by its pid: a killed rank's is removed by the next launch)."""
        if self._timeline_dir is None:
            from dcp_fsdp import lifeline

            self._timeline_dir = lifeline.owned_tempdir("dcp-fsdp-timeline-")
        return str(self._timeline_dir / f"{suffix}.json")

    def _choose_save_suffix(self, iteration: int) -> str:
        """Rank 0 claims the suffix (layout.save_suffix) before any rank writes into it."""
        suffix, self.suffix_claim = rank0_decides(self.ctx, lambda: layout.save_suffix(
            self.store, self.cfg.suffix, self.cfg.iterations, iteration, self.suffixes))
        return suffix

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
    def _timed(self, op: str, iteration: int, suffix: str) -> Sample | Callable[[], Sample]:
        """The operation's sample, or (an async save with a cadence, its upload in flight)
        a function that waits for the upload and returns it."""
        # Created on first use (per rank, untimed): the async saver and the memory marks.
        saver = None
        if op == "save" and self.cfg.save_mode.value == "async":
            saver = self.async_saver
            if saver is None:
                from dcp_fsdp.rank.async_save import AsyncSaver

                saver = self.async_saver = AsyncSaver(
                    self.cfg.async_save, self.ctx.device, self.cfg.train_step_s, self.ctx.rank)
        memory = getattr(self, "_memory", None)
        if memory is None:
            memory = self._memory = PeakMemory(self.ctx.device, self.log)
        # The process checkpointer pickles the writer into its daemon: the timed writer's
        # copy there writes its timeline to a file, read back once the upload is done.
        pickled = op == "save" and saver is not None and saver.pickles_writer
        timeline = HookTimeline(dump_path=self._timeline_file(suffix) if pickled else None)
        timed = None if "hooks" in self.harness_off else timeline
        storage_io = (self.store.writer(suffix, timed) if op == "save"
                      else self.store.reader(suffix, timed))
        if not pickled:  # (a client built here would not be the one that uploads)
            self.store.warm_up(storage_io)
        # fs: the load reads the file system, not the page cache its save left (untimed)
        cache_policy = self.store.drop_cache(suffix) if op == "load" else None
        baseline_s: list[float] = []
        if saver is not None:
            saver.prepare()  # collective, first save only
            baseline_s = saver.baseline()

        planner = None
        if op == "save" and saver is None:
            from dcp_fsdp.compat import save_planner

            storage = self.cfg.storage  # plans carry file prefixes: one cache per layout
            planner = save_planner(self.cfg.plan_caching, f"{storage.kind.value}:"
                                   f"{storage.prefix_strategy.value}:{storage.prefix_count}:"
                                   f"{','.join(storage.round_robin_prefixes)}")
        # Built before the barrier: its expected-bytes sum walks the state dict.
        heartbeat = self._heartbeat(op, iteration, None if pickled else timeline)
        marks = "memory" not in self.harness_off
        if marks:
            memory.begin()
        message = (f"{op} iteration {iteration} (suffix {suffix}) did not finish within "
                   f"op_timeout_s={self.cfg.op_timeout_s:g}; the storage stalled or is "
                   "too slow: raise op_timeout_s or check the endpoint")
        watchdog = contextlib.nullcontext() if "watchdog" in self.harness_off else Watchdog(
            self.cfg.op_timeout_s, self.on_timeout, message)
        barrier_start = time.monotonic()
        dist.barrier()
        begin_mono = time.monotonic()
        begin_wall = time.time()
        timing = None
        broadcast_s = None
        with watchdog, heartbeat:
            if saver is not None:
                timing = saver.save(self.state_dict, storage_io, begin_mono, baseline_s)
            elif op == "save":
                dcp.save(self.state_dict, storage_writer=storage_io, planner=planner)
            elif self.read_once:  # replica 0 reads, the others receive (rank/replicas.py)
                broadcast_s = read_once_load(self.state_dict, storage_io, self.sharded.mesh,
                                             self.replica)
            else:
                dcp.load(self.state_dict, storage_reader=storage_io)
        peak_rss, cuda_peak = memory.end() if marks else (None, None)
        minor_faults = memory.minor_faults if marks else None  # (finish may run later)

        def finish() -> Sample:
            if saver is not None and timing is not None and timing.end_mono is None:
                # the upload is still in flight
                with Watchdog(self.cfg.op_timeout_s, self.on_timeout, message):
                    saver.finish(timing)
            if pickled:
                take_timeline_file(timeline)
            end_mono = time.monotonic() if timing is None else timing.end_mono
            if end_mono is None:
                raise RuntimeError(f"{op} iteration {iteration}: the upload never ended")
            end_wall = begin_wall + (end_mono - begin_mono)
            # A cadence overlaps saves: this one's requests start after the previous upload's.
            window_wall = begin_wall
            if timing is not None and timing.previous_end_mono is not None:
                window_wall += max(0.0, timing.previous_end_mono - begin_mono)
            clocks = OpClocks(barrier_start, begin_mono, begin_wall, end_mono, end_wall,
                              window_wall)
            sample = build_sample(
                op, iteration, suffix, timeline, clocks, self.ctx.rank, self.host,
                replica_share(verify.local_bytes(self.state_dict), self.replicas, self.replica),
                self.replica if self.replicas > 1 else None, self.request_log)
            sample.peak_rss_bytes, sample.cuda_max_allocated_bytes = peak_rss, cuda_peak
            sample.cache_policy = cache_policy
            sample.minor_faults = minor_faults
            sample.broadcast_s = broadcast_s
            if op == "save":
                fill_save_figures(sample, self.cfg.save_mode.value, timing, pickled)
            return sample

        if timing is not None and timing.end_mono is None:
            return finish  # the loop completes it once the upload is waited for
        return finish()

    def _heartbeat(self, op: str, iteration: int, timeline: HookTimeline | None):
        """Rank 0's progress lines during the operation (progress=true), else nothing."""
        if not (self.cfg.progress and self.ctx.is_coordinator):
            return contextlib.nullcontext()
        moved = None if timeline is None else (lambda: timeline.moved.total)
        expected = verify.local_bytes(self.state_dict)
        return Heartbeat(f"{op} iteration {iteration}", moved, expected,
                         self.cfg.progress_interval_s, self.log)

    def keep(self, sample: Sample) -> None:
        """Record one finished operation of this rank, and share it with rank 0's record."""
        self.samples.append(sample)
        self.shared_samples.extend(all_gather_object(sample))

    # -- verification (untimed; rank/verify.py) -----------------------------------------
    def _clear(self) -> None:
        """Zero every live tensor before a verified load: the model already holds the values
        a load must bring, so without this a load that read nothing would pass."""
        with torch.no_grad():
            for tensor in flat_tensors(self.state_dict).values():
                local_tensor(tensor).zero_()

    def _verify_against(self, seed: int, what: str) -> None:
        """Every rank recomputes its shards' values and compares them bit for bit; all ranks
        raise together on a mismatch, naming the first one."""
        reports = all_gather_object(verify.first_mismatch(self.state_dict, seed))
        for rank, report in enumerate(reports):
            if report:
                key, index = report
                raise BenchmarkFailure(f"{what} (tensor '{key}' element {index}, rank {rank}'s "
                                       "shard)")

    def _load_expected_checksums(self, suffix: str) -> None:
        """Once per suffix, untimed: the seed its values were made with (its manifest), or why
        it cannot be checked. Every rank gets the same answer from rank 0."""
        if suffix in self._expected_checksums:
            return
        if self.cfg.integrity:
            seed, reason = rank0_decides(self.ctx, lambda: verify.checkable_seed(
                layout.read_manifest(self.store, suffix)))
        else:
            seed, reason = None, "integrity=false"
        self._expected_checksums[suffix] = seed
        self.integrity[suffix] = {"checked": reason is None, "reason": reason}
        if reason and self.cfg.integrity:
            self.log(f"integrity check of suffix={suffix} skipped: {reason}")

    def _verify_checksums(self, suffix: str, iteration: int) -> None:
        seed = self._expected_checksums.get(suffix)
        if seed is not None:
            self._verify_against(
                seed, f"integrity: load iteration {iteration} of suffix={suffix} read data "
                "that differs from the values it was saved with: the checkpoint's objects are "
                "corrupt")

    # -- the loop ------------------------------------------------------------------------
    def run(self) -> list[Sample]:
        """Every operation of the run; every rank's samples."""
        try:
            return self._run_operations()
        finally:
            if self._timeline_dir is not None:
                shutil.rmtree(self._timeline_dir, ignore_errors=True)

    def _run_operations(self) -> list[Sample]:
        command = self.cfg.command
        # `dcp-fsdp ceiling`: no DCP operation, only the raw rounds at the end
        dcp_iterations = 0 if command == Command.ceiling else self.cfg.iterations
        for iteration in range(1, dcp_iterations + 1):
            if command in (Command.save, Command.save_and_load):
                suffix = self._choose_save_suffix(iteration)
                self._note_writing(suffix)
                done = self._timed("save", iteration, suffix)
                self._complete_pending()  # the previous save (this one waited for its upload)
                self._pending_save = (done, suffix, iteration)
                # A load needs the checkpoint committed; the last save's upload ends the run.
                if not callable(done) or command == Command.save_and_load or \
                        iteration == self.cfg.iterations:
                    self._complete_pending()
            else:
                suffix = self._load_suffix()
                if iteration == 1:
                    self._check_matches_checkpoint(suffix)
                    self.suffixes.append(suffix)
            if command == Command.save_and_load:
                self._pause()
                if self.cfg.verify:
                    self._clear()
                self.keep(self._timed_now("load", iteration, suffix))
                if self.cfg.verify:
                    self._verify_against(
                        self.cfg.seed, f"save-and-load iteration {iteration}: data loaded from "
                        f"suffix={suffix} differs from what was saved")
                    self.integrity[suffix] = {"checked": True, "reason": None}
                else:
                    self.integrity[suffix] = {"checked": False, "reason": "verify=false"}
                apply_state_dict(self.sharded, self.state_dict)
            elif command == Command.load:
                self._load_expected_checksums(suffix)
                if self._expected_checksums[suffix] is not None:
                    self._clear()
                self.keep(self._timed_now("load", iteration, suffix))
                self._verify_checksums(suffix, iteration)
                apply_state_dict(self.sharded, self.state_dict)
            if iteration < self.cfg.iterations:
                self._pause()
        if self.cfg.ceiling or command == Command.ceiling:
            from dcp_fsdp.rank.ceiling import run_ceiling

            self._pause()
            for sample in run_ceiling(self):
                self.keep(sample)
        dist.barrier()
        return self.samples

    def _timed_now(self, op: str, iteration: int, suffix: str) -> Sample:
        """The operation's sample, waited for if it is an upload in flight."""
        done = self._timed(op, iteration, suffix)
        return done() if callable(done) else done

    def _load_suffix(self) -> str:
        if self.cfg.suffix is None:  # the config's validation requires one for a load
            raise UserError("load needs suffix=: the checkpoint to load")
        return self.cfg.suffix

    def _complete_pending(self) -> None:
        """Record the last save once its upload is done: its sample, manifest and log line."""
        pending, self._pending_save = self._pending_save, None
        if pending is None:
            return
        done, suffix, iteration = pending
        self.keep(done() if callable(done) else done)
        self.suffixes.append(suffix)  # a run cut short names only the saves that completed
        self._write_manifest(suffix)
        if self.writing_suffix == suffix:  # (with a cadence the next save may be under way)
            self._note_writing(None)
        self.log(f"saved suffix={suffix} at {self.store.location(suffix)} "
                 f"(iteration {iteration}/{self.cfg.iterations})")

    def _note_writing(self, suffix: str | None) -> None:
        """The save in progress (None: none), for the record and the launcher's file."""
        self.writing_suffix = suffix
        path = os.environ.get(contract.WRITING_SUFFIX_FILE_ENV)
        if path and self.ctx.is_coordinator:
            with open(path, "w") as f:
                f.write(suffix or "")

    def _pause(self) -> None:
        if self.cfg.delay_s > 0:
            time.sleep(self.cfg.delay_s)

    def _write_manifest(self, suffix: str) -> None:
        """A small description of the checkpoint (after .metadata: not part of the commit)."""
        if not self.ctx.is_coordinator:
            return
        manifest = {"model": self.cfg.model.preset, "model.dtype": self.cfg.model.dtype.value,
                    "state": self.cfg.state.value, "world_size": self.ctx.world_size,
                    "replicas": self.replicas,
                    "param_count": self.sharded.param_count,
                    # what a load needs to recompute every value (rank/verify.py)
                    "values": values.GENERATOR, "seed": self.cfg.seed}
        self.store.put_small(suffix, layout.MANIFEST_NAME, layout.encode_manifest(manifest))
