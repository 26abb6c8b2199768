"""One rank's run, as a session with named phases: join, build, loop, gather, record.

Runs identically under torchrun (env:// rendezvous, any number of nodes) and under our
local launcher. Everything before the loop's first barrier is initialisation: measured
(`InitRow`), recorded apart, never inside a timed region. Every way a run can end
(success, bad input, failure, Ctrl-C / SIGTERM, the op watchdog) goes through `finish`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
import traceback
from typing import TYPE_CHECKING, Any

from dcp_fsdp import contract, log
from dcp_fsdp.process.ending import RankEnding, write_error_file
from dcp_fsdp.process.failures import (answers_from, caused_by_interrupt, collective_error, failure_line,
                                       says_the_line)
from dcp_fsdp.process.signals import STUCK_AFTER_SIGNAL_S, InterruptGuard, PeerFailed, Terminated
from dcp_fsdp.config.schema import BenchmarkConfig, Command, Malloc, StorageKind
from dcp_fsdp.errors import UserError
from dcp_fsdp.process import allocator, lifeline, peers
from dcp_fsdp.rank.memory import lifetime_peak_rss_bytes
from dcp_fsdp.telemetry import records
from dcp_fsdp.telemetry.records import (Allocator, Gpus, InitRow, Integrity, ModelInfo, Requests,
                                        RunRecord, Sample, StorageInfo)

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from dcp_fsdp.models.build import ShardedModel
    from dcp_fsdp.rank.distributed import RankContext
    from dcp_fsdp.rank.loop import CheckpointLoop
    from dcp_fsdp.storage.base import CheckpointStore
    from dcp_fsdp.telemetry.request_log import RequestLog


# A spread of wall clocks worth a line: 10 ms is 1 % of a one-second span.
CLOCK_SPREAD_NOTED_S = 0.010


@dataclasses.dataclass
class RankResult:
    """How a rank's run ended, for its entry point (`cli.end_rank` prints the run's summary from it)."""

    exit_code: int
    run: RunRecord | None = None  # the record, on the rank that wrote it (rank 0)
    samples: list[Sample] = dataclasses.field(default_factory=list)
    record_path: str | None = None


class RankSession:
    def __init__(self, cfg: BenchmarkConfig, process_start_mono: float,
                 guard: InterruptGuard | None = None) -> None:
        self.cfg = cfg
        self.guard = guard or InterruptGuard()
        self.process_start_mono = process_start_mono
        self.ctx: RankContext | None = None  # once joined
        self.loop: CheckpointLoop | None = None  # once built
        self.store: CheckpointStore | None = None  # once opened
        self.request_log: RequestLog | None = None
        # this rank's untimed request summary, and every rank's once gathered (at finish)
        self._untimed: dict | None = None
        self._untimed_all: list[dict | None] | None = None
        self.rank = int(os.environ.get("RANK", "0"))
        self.init = InitRow(rank=self.rank)
        self.record_path: str | None = None  # once rank 0 wrote the record
        self.run = RunRecord(run_id="", command=cfg.command.value, argv=records.command_line(),
                             started_at=records.utc_now(),
                             config=records.config_for_record(cfg))

    def joined(self) -> RankContext:
        if self.ctx is None:
            raise RuntimeError("the rank has not joined the process group yet")
        return self.ctx

    def opened_store(self) -> CheckpointStore:
        if self.store is None:
            raise RuntimeError("the rank has not opened its store yet")
        return self.store

    @property
    def is_coordinator(self) -> bool:
        return self.ctx.is_coordinator if self.ctx is not None else self.rank == 0

    def say(self, message: str) -> None:
        """A progress line, printed once (by rank 0)."""
        if self.is_coordinator:
            log.info(message)

    def start_telemetry(self) -> None:
        """Before anything creates an S3 client: the connector reads its log settings once."""
        if self.cfg.storage.kind != StorageKind.s3 or not self.cfg.request_stats:
            return  # request_stats=false: the connector logs nothing; samples' requests: None
        from dcp_fsdp.telemetry.request_log import open_for_rank

        self.request_log = open_for_rank(self.rank, self.cfg.keep_request_log, self.cfg.storage.client.value)
        if self.request_log is not None:
            os.environ.update(self.request_log.environment())
            # a failed write or read carries its answers to the rank that says the line
            answers_from(functools.partial(self.request_log.error_answers, self.rank))
            from dcp_fsdp.storage.s3_control import observe_clients
            from dcp_fsdp.telemetry.control_plane import count_control_calls

            # our own boto3 calls (pre-flight, manifests, listings): every control-plane
            # client this rank creates, tune's trials and the after-failure probes included
            observe_clients("request-log", functools.partial(
                count_control_calls, record_call=self.request_log.record_control_call))

    def join(self) -> None:
        from dcp_fsdp.rank.device import process_group_timeout_s
        from dcp_fsdp.rank.distributed import broadcast_object, init_distributed, wall_clock_spread_s

        t0 = time.monotonic()
        ctx = self.ctx = init_distributed(self.cfg.backend, process_group_timeout_s(
            self.cfg.collective_timeout_s, self.cfg.op_timeout_s))
        self.rank = self.init.rank = ctx.rank
        self.init.pg_init_s = time.monotonic() - t0
        self.run.run_id = broadcast_object(os.environ.get(contract.RUN_ID_ENV)
                                           or records.new_run_id(self.cfg.command.value))
        # untimed, once: how much of a cross-node wall-clock span may be clock skew
        self.run.clock_spread_s = wall_clock_spread_s()

    def open_store(self) -> None:
        from dcp_fsdp.rank.distributed import rank0_decides
        from dcp_fsdp.storage import layout, make_store

        store = self.store = make_store(self.cfg.storage)
        os.environ.update(store.environment())

        def preflight() -> None:
            if os.environ.get(contract.PREFLIGHT_DONE_ENV) != "1":
                store.preflight(writes=self.cfg.command != Command.load or self.cfg.ceiling)
                if self.cfg.command == Command.load and self.cfg.suffix is not None:
                    layout.check_loadable(store, self.cfg.suffix)
        rank0_decides(self.joined(), preflight)

    def build(self) -> tuple[ShardedModel, dict[str, Any]]:
        from dcp_fsdp.config.validate import dtype_origin
        from dcp_fsdp.models.build import build_sharded_model, dcp_state_dict
        from dcp_fsdp.models.presets import model_shape, tied_words
        from dcp_fsdp.rank.state import state_bytes

        cfg, ctx, store = self.cfg, self.joined(), self.opened_store()
        raised, started_with = cfg.malloc == Malloc.raised, allocator.allocator_environment()
        if raised:  # before the model's memory is allocated (process/allocator.py)
            allocator.raise_glibc_thresholds()
        shape = model_shape(cfg.model)
        t0 = time.monotonic()
        sharded = build_sharded_model(shape, cfg.model.dtype, cfg.state, ctx.device, ctx.world_size,
                                      cfg.seed, cfg.model.replicas, cfg.model.moe_layout.value,
                                      cfg.model.tp)
        self.init.build_s = time.monotonic() - t0
        self.init.fill_s = sharded.fill_s
        t0 = time.monotonic()
        state_dict = dcp_state_dict(sharded.model, sharded.optimizer)
        self.init.state_dict_s = time.monotonic() - t0
        run = self.run
        dtype_from, dtype_words = dtype_origin(cfg.model)
        run.model = model = ModelInfo(
            preset=cfg.model.name, family=shape.family, config=cfg.model.config,
            moe_layout=cfg.model.moe_layout.value, dtype=cfg.model.dtype.value,
            dtype_from=dtype_from, state=cfg.state.value, param_count=sharded.param_count,
            param_bytes=sharded.param_bytes, state_bytes=state_bytes(state_dict))
        run.world_size, run.node_count = ctx.world_size, ctx.node_count
        run.nproc_per_node, run.hostnames = ctx.local_world_size, list(ctx.hostnames)
        run.backend, run.device = ctx.backend, str(ctx.device)
        run.gpus = gpus(ctx.device)
        run.allocator = Allocator.model_validate(allocator.describe(raised, started_with))
        run.storage = StorageInfo.model_validate(
            {**store.describe(), "embedded": os.environ.get(contract.EMBEDDED_ENV) == "1"})
        self.say(f"run {run.run_id}: {cfg.command.value} model={model.preset} "
                 + (f"moe_layout={cfg.model.moe_layout.value} " if shape.num_experts else "")
                 + f"({model.param_count:,} params, {model.dtype}"
                 + (f" ({dtype_words})" if dtype_words else "") + ", "
                 f"{model.state}, {(model.state_bytes or 0) / 2**20:.1f} MiB"
                 + tied_words(shape, cfg.model.dtype.value) + ") "
                 f"world_size={ctx.world_size} nodes={ctx.node_count} "
                 + (f"replicas={cfg.model.replicas} ({cfg.model.replica_load.value} loads) "
                    if cfg.model.replicas > 1 else "")
                 + (f"tp={cfg.model.tp} " if cfg.model.tp > 1 else "")
                 + f"backend={ctx.backend} "
                 f"storage={store.location('')}")
        spread_s = run.clock_spread_s or 0.0
        if ctx.node_count > 1 and spread_s > CLOCK_SPREAD_NOTED_S:
            self.say(f"the nodes' wall clocks read up to {spread_s * 1e3:.0f} ms apart: spans across "
                     "nodes (aggregate MiB/s) carry that much skew; slowest-rank figures carry none")
        self.init.init_s = time.monotonic() - self.process_start_mono
        return sharded, state_dict

    def run_loop(self, sharded: ShardedModel, state_dict: dict[str, Any]) -> None:
        from dcp_fsdp.rank.loop import CheckpointLoop
        from dcp_fsdp.rank.tune_trials import TuneTrials, load_spec

        spec = load_spec()
        if spec is not None:  # `dcp-fsdp tune`: every trial in this one launch
            TuneTrials(self, sharded, state_dict, spec).run()
            return
        loop = self.loop = CheckpointLoop(self.cfg, self.joined(), self.opened_store(), sharded,
                                          state_dict, request_log=self.request_log,
                                          say=self.say, on_timeout=self.on_timeout)
        loop.run()

    def on_timeout(self, message: str) -> None:
        """From the watchdog thread, while the main thread is stuck in native code: record
        the failure (rank 0), say it once, and end the process."""
        log.error(f"rank {self.rank}: {message}")
        self.run.end_cause = contract.EndCause.ERROR.value
        if self.is_coordinator:
            self.write_record("failed", message, self.samples(), [self.init])
        if self.request_log is not None:
            self.request_log.remove()  # os._exit skips every cleanup
        if self.store is not None:
            self.store.close()
        lifeline.remove_multiprocessing_tempdir()
        write_error_file(RankEnding("failed", message, contract.EXIT_FAILED, contract.EndCause.ERROR))
        os._exit(contract.EXIT_FAILED)

    def samples(self) -> list:
        """Every rank's samples of the operations that finished on all of them."""
        return list(self.loop.shared_samples) if self.loop is not None else []

    def gather(self, status: str) -> list[InitRow]:
        """Every rank's init row on rank 0; after a failure only its own (no risk of a hang)."""
        if status != "ok":
            return [self.init]
        from dcp_fsdp.rank.distributed import gather_to_keepers

        gathered = gather_to_keepers((self.init, self._untimed), keepers=1)
        if gathered is None:  # not rank 0: it records, this rank keeps its own
            return [self.init]
        self._untimed_all = [untimed for _, untimed in gathered]
        return [row for row, _ in gathered]

    def write_record(self, status: str, error_line: str | None, samples: list[Sample],
                     init_rows: list[InitRow]) -> Path:
        run = self.run
        run.status, run.error, run.finished_at = status, error_line, records.utc_now()
        run.suffixes = list(self.loop.suffixes) if self.loop is not None else []
        if status != "ok" and self.loop is not None:
            run.incomplete_suffix = self.loop.writing_suffix
        run.integrity = {suffix: Integrity.model_validate(entry) for suffix, entry
                         in (self.loop.integrity if self.loop is not None else {}).items()}
        run.suffix_claim = self.loop.suffix_claim if self.loop is not None else None
        run.init, run.versions = list(init_rows), records.versions()
        run.slurm = records.slurm_environment()
        off, _ = contract.harness_off(os.environ.get(contract.HARNESS_OFF_ENV))
        run.harness_off = sorted(off) or None
        run.rank_start = lifeline.rank_start()
        from dcp_fsdp.telemetry.results_dir import write_record  # falls back if it fails

        return write_record(self.cfg.results_dir, run, samples)

    def writes_record(self, status: str) -> bool:
        """Rank 0 writes the record; if it has ended, the lowest surviving rank of its node does."""
        if self.is_coordinator:
            return True
        if status == "ok":
            return False
        # No signal may have come: a collective with a dead rank 0 fails on its own.
        ended = self.guard.ended_peers = self.guard.ended_peers or peers.ended_local_peers()
        if 0 not in ended:
            return False
        from dcp_fsdp.telemetry.results_dir import record_written

        if record_written(self.cfg.results_dir, self.run.run_id):
            return False  # rank 0 recorded the run before it ended: keep its fuller record
        return self.rank == min(r for r in range(self.rank + 1) if r not in ended)

    def finish(self, status: str, error_line: str | None,
               cause: contract.EndCause = contract.EndCause.OK) -> None:
        from dcp_fsdp.telemetry.summaries import merge_summaries

        self.run.end_cause = cause.value
        if self.store is not None:
            self.store.close()  # what the store made in this process (MSC's profile file)
        if self.request_log is not None:
            answers_from(None)
            self._untimed = self.request_log.finish()
            kept = self.request_log.close(self.cfg.results_dir, self.run.run_id or None, self.rank)
            if kept:
                self.run.request_log_dir = str(kept.parent)
        # what a node must hold per rank
        self.init.peak_rss_bytes = lifetime_peak_rss_bytes()
        init_rows = self.gather(status)
        samples = self.samples()
        if status != "ok":
            lifeline.remove_stale()  # a killed peer's temp dirs (torchrun, Slurm: no launcher after)
        if not (self.writes_record(status) and self.run.run_id):
            return
        if not self.is_coordinator and error_line and cause is not contract.EndCause.PEER_ENDED:
            ended = ", ".join(str(r) for r in self.guard.ended_peers)
            error_line = (f"rank {ended} ended first (killed or crashed); "
                          f"rank {self.rank}: {error_line}")
        if self.request_log is not None:
            # requests made outside every timed region, all ranks (per rank: just the count)
            untimed = self._untimed_all if self._untimed_all is not None else [self._untimed]
            merged = merge_summaries(untimed)
            self.run.untimed_requests = Requests.model_validate(merged) if merged else None
            for row, summary in zip(init_rows, untimed):
                row.untimed_request_count = summary["count"] if summary else None
        self.record_path = str(self.write_record(status, error_line, samples, init_rows))


def gpus(device: torch.device) -> Gpus | None:
    """The GPU model of this rank's device and the node's count; None on a CPU rank, also on a
    GPU host (get_device_name would open a CUDA context)."""
    if device.type != "cuda":
        return None
    import torch

    return Gpus(model=torch.cuda.get_device_name(device), count=torch.cuda.device_count())


def run_rank(cfg: BenchmarkConfig, process_start_mono: float) -> RankResult:
    log.route_library_logs()  # DCP's failed reads, MSC's errors: one line each, no traceback
    guard = InterruptGuard()
    started: list[RankSession] = []  # the watcher may fire before the session exists
    guard.install(on_stuck=lambda name: _end_stuck_rank(name, started[0] if started else None))
    session = RankSession(cfg, process_start_mono, guard)
    started.append(session)
    ending = RankEnding("ok", None, contract.EXIT_OK, contract.EndCause.OK)
    try:
        session.start_telemetry()
        session.join()
        session.open_store()
        sharded, state_dict = session.build()
        session.run_loop(sharded, state_dict)
    except BaseException as error:
        # The outcome is this error: a signal now (the agent's SIGTERM once a peer died) must
        # not raise inside _outcome (its storage probe takes a moment) and lose the record.
        guard.finishing = True
        ending = _outcome(error, guard, session)
    status, exit_code = ending.status, ending.exit_code
    guard.finishing = True  # e.g. the agent's SIGTERM while a survivor writes the record
    session.finish(status, ending.error_line, ending.cause)
    if status != "ok":
        write_error_file(ending)
    if status != "interrupted":
        from dcp_fsdp.rank.distributed import shutdown

        with contextlib.suppress(BaseException):
            shutdown(aligned=status == "ok")
    if session.record_path is None:
        return RankResult(exit_code)
    return RankResult(exit_code, session.run, session.samples(), session.record_path)


def _outcome(error: BaseException, guard: InterruptGuard, session: RankSession) -> RankEnding:
    """How a run that raised ended; says it once."""
    cause = contract.EndCause
    if guard.signal_name == contract.PEER_FAILED_SIGNAL_NAME or isinstance(error, PeerFailed):
        line = (_stopped_after(guard.ended_peers) if guard.ended_peers
                else "stopped by the launcher after another rank failed (a rank died or raised first)")
        return RankEnding("failed", line, contract.EXIT_FAILED, cause.PEER_ENDED)
    after_peer = _after_a_peer_ended(error, guard, session)
    if after_peer is not None:
        return after_peer
    if guard.signal_name is not None or caused_by_interrupt(error):
        name = guard.signal_name or ("SIGTERM" if isinstance(error, Terminated) else "SIGINT")
        return RankEnding("interrupted", f"interrupted by {name}", contract.EXIT_INTERRUPTED,
                          cause.INTERRUPTED)
    if isinstance(error, UserError):
        if session.is_coordinator:
            log.error(str(error))
        return RankEnding("failed", str(error), contract.EXIT_USER_ERROR, cause.USER_ERROR)
    # anything else, DCP's CheckpointException (a BaseException) included
    says_it = says_the_line(error, session.is_coordinator, joined=session.ctx is not None)
    answers = (session.request_log.error_answers(session.rank) if session.request_log is not None
               else None)
    error_line = failure_line(session.store, error, probe=says_it, error_answers=answers)
    if os.environ.get(contract.DEBUG_ENV):
        traceback.print_exception(error)
    if says_it:
        prefix = (f"rank {session.rank}: "
                  if session.ctx is not None and not collective_error(error) else "")
        log.error(f"{prefix}{error_line}")
    return RankEnding("failed", error_line, contract.EXIT_FAILED, cause.ERROR)


# How long a rank's own error waits to see a node sibling ended (failures only).
PEER_END_GRACE_S = 0.5


def _after_a_peer_ended(error: BaseException, guard: InterruptGuard,
                        session: RankSession) -> RankEnding | None:
    """A rank whose own error came after a sibling on its node had already ended: a
    consequence (gloo's "Connection closed by peer"), not the root cause, though by time alone
    it would seem first (the agent notes a killed rank's end only when it next looks). The
    sibling gets PEER_END_GRACE_S to be seen ended: a killed process closes its sockets a
    moment before it is gone. None otherwise, and for the errors every rank raises together."""
    if (guard.signal_name is not None or collective_error(error)
            or caused_by_interrupt(error)):
        return None
    ended = guard.ended_peers or peers.ended_local_peers()
    deadline = time.monotonic() + PEER_END_GRACE_S
    while not ended and time.monotonic() < deadline:
        time.sleep(0.05)
        ended = peers.ended_local_peers()
    if not ended:
        return None
    guard.ended_peers = ended
    said = " ".join(str(error).split())[:300] or type(error).__name__
    return RankEnding("failed", f"{_stopped_after(ended)}: {said}", contract.EXIT_FAILED,
                      contract.EndCause.PEER_ENDED)


def _stopped_after(ended: Any) -> str:
    return (f"stopped after rank {', '.join(str(r) for r in ended)} ended first (killed, or "
            "failed; its own line or the launcher's says why)")


def _end_stuck_rank(signal_name: str, session: RankSession | None) -> None:
    """The signal watcher's end of a rank whose main thread stayed in native code after a
    signal (an upload's close waiting on its parts, a stalled storage): the record, when
    this rank keeps it; the outcome where the agent reads it; the end, now."""
    peer_ended = signal_name == contract.PEER_FAILED_SIGNAL_NAME
    ending = RankEnding("failed" if peer_ended else "interrupted",
                        f"{'stopped' if peer_ended else 'interrupted'} by {signal_name}; still "
                        f"inside a storage or native call {STUCK_AFTER_SIGNAL_S:g} s later (an "
                        "upload or download in progress, or a stalled storage): ended there",
                        contract.EXIT_FAILED if peer_ended else contract.EXIT_INTERRUPTED,
                        contract.EndCause.PEER_ENDED if peer_ended else contract.EndCause.INTERRUPTED)
    recorded = False
    # the main thread is held in native code (the GIL free): the samples are still here; a
    # failure here or in the cleanup still lets the outcome below reach the agent
    with contextlib.suppress(BaseException):
        if session is not None and session.run.run_id and session.writes_record(ending.status):
            session.run.end_cause = ending.cause.value
            session.write_record(ending.status, ending.error_line, session.samples(), [session.init])
            recorded = True
    with contextlib.suppress(BaseException):
        if session is not None and session.request_log is not None:
            session.request_log.remove()  # os._exit skips every cleanup
        lifeline.remove_multiprocessing_tempdir()
    # A note, not an error line: this rank may only be a bystander, and the launcher names
    # the first cause from the error files.
    log.info(f"rank {os.environ.get('RANK', '?')}: {ending.error_line}"
             + ("" if recorded else " (without its record: another rank keeps it)"))
    write_error_file(ending)
    os._exit(ending.exit_code)
