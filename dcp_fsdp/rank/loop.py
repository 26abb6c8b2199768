"""The one timed loop behind save, load and save-and-load: per iteration and phase, rank 0
chooses the suffix, each rank builds its writer or reader, a barrier aligns the ranks, and only
`dcp.save` / `dcp.load` is timed (suffix, writer, verification and delay_s are all untimed).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dcp_fsdp import contract
from dcp_fsdp.compat import save_planner
from dcp_fsdp.config.schema import BenchmarkConfig, Command, Protocol, ReplicaLoad
from dcp_fsdp.errors import UserError
from dcp_fsdp.models import values
from dcp_fsdp.models.build import ShardedModel, replica_of
from dcp_fsdp.models.presets import shape_digest
from dcp_fsdp.rank.distributed import RankContext, drop_cache_on_node, gather_to_keepers, rank0_decides
from dcp_fsdp.rank.sample_build import (OpInProgress, build_sample, fill_save_figures,
                                        start_wire_meter, timed_region, wire_closed_on_error)
from dcp_fsdp.storage.timeline import HookTimeline
from dcp_fsdp.rank.memory import PeakMemory
from dcp_fsdp.process import lifeline
from dcp_fsdp.process.failures import caused_by_interrupt
from dcp_fsdp.process.progress import Heartbeat
from dcp_fsdp.process.wire_meter import progress_measure
from dcp_fsdp.storage.timed_dcp import TimedLoadPlanner
from dcp_fsdp.storage.timed_fs import expect_metadata, metadata_changed
from dcp_fsdp.rank.replicas import held_bytes, read_once_load, replica_share
from dcp_fsdp.rank.state import (apply_state_dict, checkable_seed, checkpoint_mismatch, local_bytes,
                                 mismatch_error, verify_values, zero_local_tensors)
from dcp_fsdp.process.watchdog import op_watchdog
from dcp_fsdp.storage import layout, make_store
from dcp_fsdp.storage.base import CheckpointStore
from dcp_fsdp.storage.s3_target import resolve_endpoint
from dcp_fsdp.telemetry.records import Sample

if TYPE_CHECKING:
    from dcp_fsdp.rank.async_save import AsyncSaver
    from dcp_fsdp.telemetry.request_log import RequestLog


class SampleHandle:
    """An operation's sample: there at once, or (an async save with a cadence, its upload in
    flight) once `result()` has waited for the upload; torchtitan's shape of a pending save."""

    def __init__(self, finish: Callable[[], Sample]) -> None:
        self._finish: Callable[[], Sample] | None = finish
        self._sample: Sample | None = None

    def done(self) -> bool:
        return self._finish is None

    def result(self) -> Sample:
        if self._finish is not None:
            self._sample, self._finish = self._finish(), None
        assert self._sample is not None
        return self._sample


class CheckpointLoop:
    def __init__(self, cfg: BenchmarkConfig, ctx: RankContext, store: CheckpointStore,
                 sharded: ShardedModel, state_dict: dict[str, Any], request_log: RequestLog | None,
                 say: Callable[[str], None], on_timeout: Callable[[str], None],
                 async_saver: Any = None) -> None:
        self.cfg = cfg
        # save_mode=async: handed in to be shared (tune's trials), else made here (untimed)
        if async_saver is None and cfg.save_mode.value == "async":
            from dcp_fsdp.rank.async_save import AsyncSaver

            async_saver = AsyncSaver(cfg.async_save, ctx.device, cfg.train_step_s)
        self.async_saver = async_saver
        self.on_timeout = on_timeout
        self.ctx = ctx
        self.store = store
        self.sharded = sharded
        self.state_dict = state_dict
        self.request_log = request_log
        self.log = say
        self._memory = PeakMemory(ctx.device, say)
        self.samples: list[Sample] = []  # this rank's
        # every rank's samples, shared after each operation: a run cut short records them whole
        self.shared_samples: list[Sample] = []
        self.suffixes: list[str] = []
        self.suffix_claim: str | None = None  # how the saves' suffixes were claimed (layout)
        self.writing_suffix: str | None = None  # a save in progress: incomplete if we stop
        self._pending_save: SampleHandle | None = None  # the last save, until its upload is done
        self._timeline_dir: Path | None = None  # process checkpointer: see _prepare
        self.integrity: dict[str, dict[str, Any]] = {}  # suffix loaded: {"checked", "reason"} for the run line
        self._manifest_seed: int | None = None  # `dcp-fsdp load`: the seed its values are checked with
        # rank 0: a checkpoint's .metadata (by suffix), read (screened) once per run
        self.metadata_facts = functools.cache(functools.partial(layout.metadata_facts, store))
        self._screened_sha256: dict[str, str] = {}  # suffix -> SHA-256 of the screened .metadata DCP must read
        self.host = socket.gethostname()
        # model.replicas > 1 (HSDP): this rank's replica group; bytes count its share
        self.replicas = sharded.replicas
        self.replica = replica_of(ctx.rank, ctx.world_size, self.replicas)[0]
        self.read_once = self.replicas > 1 and cfg.model.replica_load == ReplicaLoad.read_once
        # benchmark-only (benchmarks/harness_cost.py): instrumentation left out of the timer
        self.harness_off, _ = contract.harness_off(os.environ.get(contract.HARNESS_OFF_ENV))

    def _check_matches_checkpoint(self, suffix: str) -> None:
        """Before timing a load: the checkpoint must hold this model's tensors and shapes."""
        def decide() -> str:
            # the run's one read of this .metadata, screened (or the launcher's, handed over)
            facts = self.metadata_facts(suffix)
            if layout.handed_metadata_facts(suffix) is None:  # (else the launcher checked them)
                layout.check_objects_whole(self.store, suffix, facts, self.cfg.storage.prefix_strategy.value)
            if self.cfg.ceiling:
                layout.check_mirrorable(facts, self.ctx.world_size, suffix)
            problem = checkpoint_mismatch(facts.tensors, self.state_dict)
            if problem is not None:
                raise mismatch_error(suffix, self.cfg, problem,
                                     layout.manifest_if_readable(self.store, suffix))
            return facts.sha256
        self._screened_sha256[suffix] = rank0_decides(self.ctx, decide)

    def _timed(self, op: str, iteration: int, suffix: str,
               store: CheckpointStore | None = None) -> SampleHandle:
        """The operation's sample, now or (an async save with a cadence) once its upload is
        waited for. `store`: not the run's (the ceiling's tmpfs rounds: sync saves only)."""
        saver = self.async_saver if op == "save" and store is None else None  # (save_mode=async only)
        run = self._prepare(op, iteration, suffix, saver, store or self.store)
        # Built before the barrier: its expected-bytes sum walks the state dict.
        heartbeat = self._heartbeat(op, iteration, None if run.pickled else run.timeline)
        marks = "memory" not in self.harness_off
        if marks:
            self._memory.begin()
        message = (f"{op} iteration {iteration} (suffix {suffix}) did not finish within "
                   f"op_timeout_s={self.cfg.op_timeout_s:g}; the storage stalled or is "
                   "too slow: raise op_timeout_s or check the endpoint")
        watchdog = contextlib.nullcontext() if "watchdog" in self.harness_off else op_watchdog(
            self.cfg.op_timeout_s, self.on_timeout, message)
        with timed_region(self.ctx.device, watchdog) as run.region, heartbeat, \
                wire_closed_on_error(run.wire):
            if saver is not None:
                run.timing = saver.save(self.state_dict, run.storage_io, run.region.begin_mono,
                                        run.baseline_s)
            elif op == "save":
                dcp.save(self.state_dict, storage_writer=run.storage_io, planner=run.planner)
            elif self.read_once:  # replica 0 reads, the others receive (rank/replicas.py)
                run.broadcast_s = read_once_load(self.state_dict, run.storage_io, self.sharded.mesh,
                                                 self.replica, self.ctx.device,
                                                 self.sharded.host_group, self.sharded.load_group)
            else:
                self._dcp_load(run, suffix)
        run.peak_rss, run.cuda_peak = self._memory.end() if marks else (None, None)
        run.minor_faults = self._memory.minor_faults if marks else None  # (finish may run later)
        handle = SampleHandle(functools.partial(self._complete, run, saver, message))
        if run.timing is None or run.timing.end_mono is not None:
            handle.result()  # done now; else the loop completes it once the upload is waited for
        return handle

    def _prepare(self, op: str, iteration: int, suffix: str, saver: AsyncSaver | None,
                 store: CheckpointStore) -> OpInProgress:
        """Everything an operation needs before its barrier (untimed)."""
        # The process checkpointer pickles the writer into its daemon (no instance-level hook
        # wrappers): its copy there writes the timeline to a file, read once the upload is done,
        # in a directory of this rank's (named by its pid: a killed rank's is removed by the next launch).
        pickled = op == "save" and saver is not None and saver.process
        dump_path = None
        if pickled:
            self._timeline_dir = self._timeline_dir or lifeline.owned_tempdir("dcp-fsdp-timeline-")
            dump_path = str(self._timeline_dir / f"{suffix}.json")
        run = OpInProgress(op, iteration, suffix, pickled=pickled, timeline=HookTimeline(dump_path=dump_path))
        timed = None if "hooks" in self.harness_off else run.timeline
        read_ahead = getattr(getattr(store, "config", None), "read_ahead", 0)
        run.reader = f"read_ahead={read_ahead}" if op == "load" and read_ahead else None
        run.storage_io = (store.writer(suffix, timed, host_state=self.ctx.device.type == "cpu")
                          if op == "save"
                          else store.reader(suffix, timed))
        if op == "load" and suffix in self._screened_sha256:  # a checkpoint not this run's
            expect_metadata(run.storage_io, self._screened_sha256[suffix])
        if not pickled:  # (a client built here would not be the one that uploads)
            events = store.warm_up(run.storage_io)
            if self.request_log is not None:  # storage.client=fsspec|msc: botocore's hooks
                for emitter in events:
                    self.request_log.hook_client(emitter)
        # fs: the load reads the file system, not the page cache its save left (untimed)
        run.cache_policy = drop_cache_on_node(store, suffix, self.ctx) if op == "load" else None
        if saver is not None:
            saver.prepare()  # collective, first save only
            run.baseline_s = saver.baseline()
        run.wire = start_wire_meter(op, self.request_log, self.cfg.storage)
        if op == "load" and timed is not None:  # the copy into the live tensors timed
            run.planner = TimedLoadPlanner(timed)
        if op == "save" and saver is None:
            storage = self.cfg.storage  # plans carry file prefixes: one cache per layout
            # (another store's plans name other files: never from this run's cache)
            run.planner = save_planner(self.cfg.plan_caching and store is self.store,
                                       f"{storage.kind.value}:"
                                       f"{storage.prefix_strategy.value}:{storage.prefix_count}:"
                                       f"{','.join(storage.round_robin_prefixes)}")
        return run

    def _complete(self, run: OpInProgress, saver: AsyncSaver | None, message: str) -> Sample:
        """The operation's sample, once it is done (an async save: its upload waited for)."""
        timing = run.timing
        if saver is not None and timing is not None and timing.end_mono is None:
            with op_watchdog(self.cfg.op_timeout_s, self.on_timeout, message):  # upload in flight
                saver.finish(timing)
        daemon_reported = False  # the daemon's copy of the timeline, taken in (none: not timed)
        if run.pickled:
            daemon_reported = run.timeline.load_dump()
            Path(str(run.timeline.dump_path)).unlink(missing_ok=True)
        end_mono = run.region.end_mono if timing is None else timing.end_mono
        if end_mono is None:
            raise RuntimeError(f"{run.op} iteration {run.iteration}: the upload never ended")
        sample = build_sample(
            run, end_mono, self.ctx.rank, self.host,
            replica_share(held_bytes(self.state_dict, self.sharded.mesh), self.replicas, self.replica),
            self.replica if self.replicas > 1 else None, self.request_log)
        if run.op == "save":
            fill_save_figures(sample, self.cfg.save_mode.value, timing,
                              run.pickled and not daemon_reported)
        return sample

    def _heartbeat(self, op: str, iteration: int,
                   timeline: HookTimeline | None) -> Heartbeat | contextlib.nullcontext[None]:
        """Rank 0's progress lines during the operation (progress=true), else nothing."""
        if not (self.cfg.progress and self.ctx.is_coordinator):
            return contextlib.nullcontext()
        streams = None if timeline is None else (lambda: timeline.moved.total)
        # the endpoint as the client resolves it, environment included: the meter counts that port only
        moved, verb, note, start = progress_measure(
            op, self.cfg.storage.kind.value == "s3", resolve_endpoint(self.cfg.storage), streams)
        return Heartbeat(f"{op} iteration {iteration}", moved, local_bytes(self.state_dict),
                         self.cfg.progress_interval_s, self.log, verb, note, start)

    def keep(self, sample: Sample) -> None:
        """One finished operation of this rank, also handed to rank 0 and rank 1 (it records if 0 died)."""
        self.samples.append(sample)
        gathered = gather_to_keepers(sample)
        self.shared_samples.extend(gathered if gathered is not None else [sample])

    def _expected_seed(self, suffix: str) -> int | None:
        """Untimed: the seed the values of `suffix` were made with (its manifest), or None and why
        they cannot be checked. Every rank gets the same answer from rank 0."""
        if not self.cfg.integrity:
            self.integrity[suffix] = {"checked": False, "reason": "integrity=false"}
            return None
        seed, reason = rank0_decides(self.ctx, lambda: checkable_seed(
            layout.read_manifest(self.store, suffix)))
        if reason is not None:  # checked: said once a load of it completed and was checked
            self.integrity[suffix] = {"checked": False, "reason": reason}
            self.log(f"integrity check of suffix={suffix} skipped: {reason}")
        return seed

    def run(self) -> list[Sample]:
        try:
            return self._run_operations()
        finally:
            if self._timeline_dir is not None:
                shutil.rmtree(self._timeline_dir, ignore_errors=True)

    def _run_operations(self) -> list[Sample]:
        command = self.cfg.command
        # MLPerf Storage v3.0 (protocol=mlperf): every save first, then as many loads, all of
        # the last checkpoint; nothing else is timed (config/validate.py: apply_protocol)
        mlperf = self.cfg.protocol == Protocol.mlperf
        # `dcp-fsdp ceiling`: no DCP operation, only the raw rounds at the end
        dcp_iterations = 0 if command == Command.ceiling else self.cfg.iterations
        for iteration in range(1, dcp_iterations + 1):
            if command in (Command.save, Command.save_and_load):
                suffix = self._save(iteration)
            else:
                suffix = self._load_suffix()
                if iteration == 1:
                    self._check_matches_checkpoint(suffix)
                    self.suffixes.append(suffix)
                    self._manifest_seed = self._expected_seed(suffix)
            if command == Command.save_and_load and not mlperf:
                self._pause()
                self._verified_load(iteration, suffix)
            elif command == Command.load:
                self._verified_load(iteration, suffix)
            if iteration < self.cfg.iterations:
                self._pause()
        for iteration in range(1, self.cfg.iterations + 1) if mlperf else ():
            self._pause()
            self._verified_load(iteration, suffix)
        if self.cfg.ceiling or command == Command.ceiling:
            from dcp_fsdp.rank.ceiling import run_ceiling

            self._pause()
            for sample in run_ceiling(self):
                self.keep(sample)
        dist.barrier()
        return self.samples

    def _save(self, iteration: int) -> str:
        """One timed save (async: started, the previous one completed); its suffix."""
        # rank 0 claims the suffix (layout.save_suffix) before any rank writes into it
        suffix, self.suffix_claim = rank0_decides(self.ctx, lambda: layout.save_suffix(
            self.store, self.cfg.suffix, self.cfg.iterations, iteration, self.suffixes))
        self._note_writing(suffix)
        handle = self._timed("save", iteration, suffix)
        self._complete_pending()  # the previous save (this one waited for its upload)
        self._pending_save = handle
        # A load needs the checkpoint committed; the last save's upload ends the run.
        if handle.done() or self.cfg.command == Command.save_and_load or \
                iteration == self.cfg.iterations:
            self._complete_pending()
        return suffix

    def _dcp_load(self, run: OpInProgress, suffix: str) -> None:
        """dcp.load; one that failed as the checkpoint was deleted under it says so (_MISSING_SAID)."""
        try:
            dcp.load(self.state_dict, storage_reader=run.storage_io, planner=run.planner)
        except (Exception, dcp.CheckpointException) as error:  # DCP's is a BaseException
            changed = metadata_changed(run.storage_io)
            if changed is not None:  # DCP says "metadata is None"; the cause is this
                raise UserError(f"suffix={suffix}: {changed}") from error
            # only an error saying something is missing is probed (a signal or a peer's failure
            # DCP wrapped must not wait: their records name them)
            if caused_by_interrupt(error) or not _says_missing(error) or self._still_complete(suffix):
                raise
            raise UserError(f"suffix={suffix}: the checkpoint was deleted while the load ran "
                            f"(its .metadata is gone from {self.store.location(suffix)}); "
                            "nothing was loaded: load another suffix") from error

    def _still_complete(self, suffix: str) -> bool:
        """After a failed load: whether the checkpoint is still there (unanswered: yes, its error stands)."""
        try:
            return make_store(self.cfg.storage, after_failure=True).is_complete(suffix)
        except Exception:
            return True

    def _verified_load(self, iteration: int, suffix: str) -> None:
        """A timed load; then, its values' seed known (`dcp-fsdp load`: its manifest's; save-and-load: the
        run's, verify=true), every shard compared with them; the model's values restored (untimed)."""
        if self.cfg.command == Command.load:
            seed, unchecked = self._manifest_seed, None
            mismatch = (f"integrity: load iteration {iteration} of suffix={suffix} read data that "
                        "differs from the values it was saved with: the checkpoint's objects are corrupt")
        else:
            seed, unchecked = self.cfg.seed if self.cfg.verify else None, "verify=false"
            mismatch = (f"save-and-load iteration {iteration}: data loaded from suffix={suffix} "
                        "differs from what was saved")
        if seed is not None:  # else a load that read nothing would pass
            zero_local_tensors(self.state_dict)
        self.keep(self._timed("load", iteration, suffix).result())
        if seed is not None:  # (a failed load checked nothing)
            verify_values(self.state_dict, seed, mismatch)
            self.integrity[suffix] = {"checked": True, "reason": None}
        elif unchecked is not None:
            self.integrity[suffix] = {"checked": False, "reason": unchecked}
        apply_state_dict(self.sharded, self.state_dict)

    def timed_on(self, store: CheckpointStore, op: str, iteration: int, suffix: str, recorded_as: str) -> Sample:
        """A sync save or a load on another store (the ceiling's rounds), timed as the run's are
        (no claim, manifest or verification), recorded as op `recorded_as`."""
        return self._timed(op, iteration, suffix, store).result().model_copy(update={"op": recorded_as})

    def _load_suffix(self) -> str:
        if self.cfg.suffix is None:  # the config's validation requires one for a load
            raise UserError("load needs suffix=: the checkpoint to load")
        return self.cfg.suffix

    def _complete_pending(self) -> None:
        """Record the last save once its upload is done: its sample, manifest and log line."""
        pending, self._pending_save = self._pending_save, None
        if pending is None:
            return
        sample = pending.result()
        self.keep(sample)
        suffix = sample.suffix
        self.suffixes.append(suffix)  # a run cut short names only the saves that completed
        self._write_manifest(suffix)
        if self.writing_suffix == suffix:  # (with a cadence the next save may be under way)
            self._note_writing(None)
        self.log(f"saved suffix={suffix} at {self.store.location(suffix)} "
                 f"(iteration {sample.iteration}/{self.cfg.iterations})")

    def _note_writing(self, suffix: str | None) -> None:
        """The save in progress (None: none), for the record and the launcher's file."""
        self.writing_suffix = suffix
        path = os.environ.get(contract.WRITING_SUFFIX_FILE_ENV)
        if path and self.ctx.is_coordinator:
            Path(path).write_text(suffix or "")

    def _pause(self) -> None:
        if self.cfg.delay_s > 0:
            time.sleep(self.cfg.delay_s)

    def _write_manifest(self, suffix: str) -> None:
        """A small description of the checkpoint (after .metadata: not part of the commit)."""
        if not self.ctx.is_coordinator:
            return
        manifest = {"model": self.cfg.model.name, "model.shape": shape_digest(self.cfg.model),
                    "model.moe_layout": self.cfg.model.moe_layout.value,
                    "model.dtype": self.cfg.model.dtype.value,
                    "state": self.cfg.state.value, "world_size": self.ctx.world_size,
                    "replicas": self.replicas, "tp": self.cfg.model.tp,
                    "param_count": self.sharded.param_count,
                    # what a load needs to recompute every value (rank/state.py)
                    "values": values.GENERATOR, "seed": self.cfg.seed}
        self.store.put_small(suffix, layout.MANIFEST_NAME, layout.encode_manifest(manifest))


# What DCP's and the clients' errors say when an object or .metadata is not there (the
# connector's S3Exception carries the service's words only; HTTP 404 as a word of its own,
# never a part of a number such as 0.404 s).
_MISSING_SAID = re.compile(r"metadata is None|NoSuchKey|Not Found|(?<![\d.])404(?![\d.])|No such file|"
                           r"does not exist|FileNotFoundError")


def _says_missing(error: BaseException) -> bool:
    """Whether a failed load's error, or one it was raised from, says something is missing."""
    chain: list[BaseException] = []
    link: BaseException | None = error
    while link is not None and link not in chain:  # a chain may loop back on itself
        chain.append(link)
        link = link.__cause__ or link.__context__
    return any(isinstance(link, FileNotFoundError) or _MISSING_SAID.search(str(link))
               for link in chain)
