"""Result records: one JSON Lines file per run, everything needed to recompute a table.

Line 1 is the run (`"record": "run"`): configuration, model, cluster, status.
Every further line is one rank's measurement of one save or load
(`"record": "sample"`). See the README's "Record format" section.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import secrets
import sys
from importlib import metadata
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable, Iterable
from urllib.parse import urlsplit, urlunsplit

from dcp_fsdp.contract import ARGV_ENV
from dcp_fsdp.telemetry.record_checks import field_types, parse_line, run_problem, sample_problem

if TYPE_CHECKING:
    from typing import TypeVar

    from _typeshed import DataclassInstance

    from dcp_fsdp.config.schema import BenchmarkConfig

    _Record = TypeVar("_Record", bound=DataclassInstance)

# Bumped whenever a field is added, renamed or changes meaning; readers accept every
# earlier version (missing fields read as their defaults). 1: the first format.
# 2: samples may be op raw_put / raw_get (the ceiling); async save, memory, load-time
# breakdown and read-amplification fields; run.gpus.
# 3: save samples carry stall_s; async saves with training steps interval_s, train_lost_s,
# train_lost_share (and previous_wait_s is real with async_save.steps_between_saves).
# 4: model.replicas > 1 (HSDP): samples carry replica (the rank's replica group) and, for
# loads with model.replica_load=read_once, broadcast_s; bytes is the rank's share of its
# replica's shards (the ranks' sum stays the checkpoint's state bytes).
# 5: train_step_slowdown from the steps' compute time alone (before: their wait for staging
# included); samples carry train_wait_s; init rows fill_s (the value fill inside build_s).
# 5: request summaries carry unparsed and parser (untimed: late); run.server_requests.
# 5: the run line carries suffix_claim (how the saves claimed their suffixes).
# 7: an S3 load's fetched_bytes is its whole GET bodies (the wire, with request statistics);
# request summaries carry broken and bytes_down_broken_max, bytes_down only whole bodies.
SCHEMA_VERSION = 8
# Job id, node count, node list and tasks per node (SLURM_NTASKS_PER_NODE is set only when
# --ntasks-per-node was given; SLURM_TASKS_PER_NODE always is, e.g. "1(x8)").
SLURM_VARIABLES = ("SLURM_JOB_ID", "SLURM_JOB_NAME", "SLURM_JOB_NUM_NODES", "SLURM_NNODES",
                   "SLURM_JOB_NODELIST", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
                   "SLURM_CLUSTER_NAME", "SLURM_JOB_PARTITION")


def new_run_id(command: str) -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{command}-{secrets.token_hex(3)}"


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version()}
    for package in ("dcp_fsdp", "torch", "s3torchconnector", "s3torchconnectorclient",
                    "transformers", "boto3"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    from dcp_fsdp.telemetry.connector_log import PARSER_FORMAT, version_problem

    # the request-log parser's format; null: the installed connector is not a release it
    # was checked on, so it read nothing (telemetry/connector_log.py)
    found["request_parser"] = None if version_problem() else PARSER_FORMAT
    return found


def slurm_environment() -> dict[str, str] | None:
    found = {name.lower().removeprefix("slurm_"): os.environ[name]
             for name in SLURM_VARIABLES if name in os.environ}
    return found or None


def redact_url(url: str | None) -> str | None:
    """Drop any user:password@ from a URL before it is written anywhere."""
    if not url:
        return url
    parts = urlsplit(url)
    if parts.username or parts.password:
        host = parts.hostname or ""
        if parts.port:
            host = f"{host}:{parts.port}"
        return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))
    return url


def config_for_record(cfg: BenchmarkConfig) -> dict[str, Any]:
    """The resolved settings as plain data, with any credentials in URLs removed."""
    from omegaconf import OmegaConf

    container = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True,
                                       enum_to_str=True)
    if not isinstance(container, dict):  # a structured config is a mapping, never a list
        raise TypeError(f"settings resolved to {type(container).__name__}, not a mapping")
    resolved = {str(key): value for key, value in container.items()}
    resolved["storage"]["endpoint"] = redact_url(resolved["storage"]["endpoint"])
    return resolved


def record_path(results_dir: str, run_id: str) -> Path:
    return Path(results_dir) / f"{run_id}.jsonl"


# -- the typed records ---------------------------------------------------------------------

@dataclasses.dataclass
class Sample:
    """One rank's measurement of one save or load (a `"record": "sample"` line)."""

    op: str  # "save" | "load"
    iteration: int  # 1-based
    suffix: str
    rank: int
    host: str
    begin_wall_s: float  # time.time() just after the aligning barrier
    end_wall_s: float
    begin_mono_s: float  # time.monotonic(), same instants (comparable within a host)
    end_mono_s: float
    duration_s: float
    bytes: int  # checkpoint bytes: what this rank's shards hold (saved or loaded)
    barrier_wait_s: float  # time in the aligning barrier before the timer started
    plan_s: float | None = None  # start -> data I/O begins (local + global plan, collective)
    io_s: float | None = None  # write_data / read_data
    commit_s: float | None = None  # data I/O end -> return (save: results gather + .metadata)
    metadata_s: float | None = None  # load: reading .metadata (part of plan_s)
    finish_s: float | None = None  # save, coordinator: writing .metadata
    # S3 requests this rank made inside the timed region (telemetry.summaries.summarize)
    requests: dict[str, Any] | None = None
    # -- schema 2 -------------------------------------------------------------------------
    save_mode: str | None = None  # save: "sync" | "async"
    blocked_s: float | None = None  # save: call -> control back to the training loop
    staged_s: float | None = None  # async save: until the staging copy is done
    persisted_s: float | None = None  # save: call -> upload and .metadata commit done
    previous_wait_s: float | None = None  # async: waiting for the previous upload to finish
    train_steps: int | None = None  # async + train_step_s: steps run while uploading
    # mean step compute time with upload / without - 1 (schema 5; before, waits included)
    train_step_slowdown: float | None = None
    fetched_bytes: int | None = None  # load: bytes read from storage (>= bytes if amplified)
    written_bytes: int | None = None  # save: tensor bytes written to storage by this rank
    # before schema 8, a load's io_s split into the time inside the object streams' reads
    # (io_wait_s, mostly the rank's own copies and page faults) and the rest (copy_s)
    io_wait_s: float | None = None
    copy_s: float | None = None
    stage_s: float | None = None  # save: DCP's own work: staging, serialising (inside io_s)
    upload_s: float | None = None  # save: inside the client's upload calls (inside io_s)
    peak_rss_bytes: int | None = None  # resident memory high-water mark during this op
    cuda_max_allocated_bytes: int | None = None  # CUDA: torch.cuda.max_memory_allocated
    # -- schema 3 -------------------------------------------------------------------------
    # save: call -> the training loop may update weights again (sync: the whole save; async:
    # the call and the staging, previous_wait_s included); >= blocked_s, >= staged_s
    stall_s: float | None = None
    interval_s: float | None = None  # async + train_step_s: call -> the following steps done
    train_lost_s: float | None = None  # interval_s - steps x baseline step: training lost
    train_lost_share: float | None = None  # train_lost_s / interval_s
    # fs load / raw_get: the page cache when the timer started (storage/pagecache.py):
    # "dropped" | "tmpfs-not-droppable" | "resident-after-drop"; None for s3 and saves
    cache_policy: str | None = None
    # minor page faults of this rank during the op (process-wide, getrusage): fresh memory
    # the op touched; a count far apart between two runs means different allocator states
    minor_faults: int | None = None
    # -- schema 4 -------------------------------------------------------------------------
    replica: int | None = None  # model.replicas > 1: this rank's replica group (0 .. R-1)
    # load, replica_load=read_once: seconds in the broadcast along the replicate dimension
    # (inside duration_s; replica 0 after its own read, the others waiting for it)
    broadcast_s: float | None = None
    # -- schema 5 -------------------------------------------------------------------------
    # async + train_step_s: seconds the steps waited before their update for the staging
    # (in train_lost_s; not in the steps' compute time, train_step_slowdown)
    train_wait_s: float | None = None
    # async save: torch's stager stages once (2.11), so this save ran on a fresh one whose
    # staging allocated its pinned / shared buffers again (inside staged_s and stall_s);
    # False: the stager and its buffers are reused from save to save; None: sync
    stager_renewed: bool | None = None
    # -- schema 8: a load's io_s by who spends it (storage/timeline.py, docs/metrics.md) -----
    storage_s: float | None = None  # load: inside the storage client's calls for bytes
    deserialise_s: float | None = None  # load: DCP's own work (torch.load, host copies)
    target_copy_s: float | None = None  # load: copying into the live tensors (GPU: H2D)
    # a load through the tool's own reader (storage.read_ahead), not DCP's: "read_ahead=N";
    # null: DCP's reader. Its io_s parts overlap (fetches run while the rank deserialises)
    reader: str | None = None
    read_ahead_peak_bytes: int | None = None  # the most bytes the tool's reader held at once
    run_id: str | None = None  # set when read back from a record file


@dataclasses.dataclass
class InitRow:
    """One rank's untimed set-up: never part of any figure."""

    rank: int
    pg_init_s: float | None = None  # joining the process group
    build_s: float | None = None  # meta build, fully_shard, materialise and fill the shards
    state_dict_s: float | None = None  # the sharded state dict DCP saves
    init_s: float | None = None  # process start -> ready for the first timed operation
    peak_rss_bytes: int | None = None  # peak resident memory of the rank process
    untimed_request_count: int | None = None  # S3 requests outside every timed region
    # the value fill inside build_s (schema 5): a real restart loads instead, so the
    # restart time of `report --node-mtbf-hours` leaves it out
    fill_s: float | None = None


@dataclasses.dataclass
class RunRecord:
    """The first line of a record file (`"record": "run"`): what ran, where, and how it ended."""

    run_id: str
    command: str
    status: str = "unknown"  # ok | failed | interrupted
    end_cause: str | None = None  # contract.EndCause: why it ended (decided on, never the error text)
    error: str | None = None
    argv: list[str] = dataclasses.field(default_factory=list)
    started_at: str | None = None
    finished_at: str | None = None
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    model: dict[str, Any] | None = None  # preset, family, dtype, state, param_count, ...
    world_size: int | None = None
    node_count: int | None = None
    nproc_per_node: int | None = None
    # After a barrier, how far apart the ranks' wall clocks read (max - min, least of a few
    # rounds; barrier jitter included): the most skew a cross-node span_s can carry.
    # slowest_rank figures (each rank's own monotonic clock) carry none.
    clock_spread_s: float | None = None
    hostnames: list[str] = dataclasses.field(default_factory=list)
    backend: str | None = None
    device: str | None = None
    gpus: dict[str, Any] | None = None  # CUDA: {"model": name, "count": per node}
    # schema 8: the allocator rank 0 runs (process/allocator.py): {"name": "glibc 2.36" |
    # "jemalloc" | ..., "thresholds": "default" | "raised" (malloc=), "environment": the
    # MALLOC_* / GLIBC_TUNABLES / LD_PRELOAD variables the ranks had}
    allocator: dict[str, Any] | None = None
    storage: dict[str, Any] | None = None
    suffixes: list[str] = dataclasses.field(default_factory=list)
    # The suffix a save was writing when the run failed or was interrupted: objects (and
    # maybe open multipart uploads) left there, no .metadata, never loadable.
    incomplete_suffix: str | None = None
    # How each rank that did not end cleanly ended, as torch's elastic agent saw it (written
    # by the launcher): {global rank: {exitcode, signal, message, timestamp, node_oom_kills}}.
    rank_failures: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    integrity: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    # How the saves claimed their suffixes (storage/layout.py): conditional_write (S3
    # If-None-Match: *), exclusive_create (fs O_EXCL), not_atomic (the server ignores the
    # condition: a check, then a write); None when no save chose one.
    suffix_claim: str | None = None
    init: list[InitRow] = dataclasses.field(default_factory=list)
    versions: dict[str, str | None] = dataclasses.field(default_factory=dict)
    slurm: dict[str, str] | None = None
    untimed_requests: dict[str, Any] | None = None
    # storage.metrics_url: the record's request counts against the server's own (the launcher)
    server_requests: dict[str, Any] | None = None
    request_log_dir: str | None = None
    # `dcp-fsdp tune` trials: {"trial": n, "role": defaults|search|repeat, "settings": {...}}
    tune: dict[str, Any] | None = None
    # benchmark-only: instrumentation pieces left out of the timed path (contract.HARNESS_OFF_ENV)
    harness_off: list[str] | None = None
    # How the recording rank's process started (from 2026-11-29): "exec" (a fresh interpreter,
    # as torchrun and every measured run start it) or "fork" (from our agent, the test suite's
    # contract.FORK_RANKS_TEST_ONLY_ENV); null: an older record, or one the launcher wrote
    rank_start: str | None = None
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> dict[str, Any]:
        return {"record": "run", **dataclasses.asdict(self)}


def _from_dict(cls: type[_Record], row: dict[str, Any]) -> _Record:
    """A dataclass from a record line: unknown keys (newer writers) are dropped, missing
    ones (older writers) take their defaults."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{key: value for key, value in row.items() if key in names})


def run_from_json(row: dict[str, Any]) -> RunRecord:
    run = _from_dict(RunRecord, {**row, "schema_version": row.get("schema_version", 0)})
    run.init = [_from_dict(InitRow, r) if isinstance(r, dict) else r for r in (run.init or [])]
    return run


def sample_from_json(row: dict[str, Any]) -> Sample:
    return _from_dict(Sample, row)


def write_records(path: Path, run: RunRecord, samples: Iterable[Sample]) -> Path:
    """Write the run line and sample lines atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(out: IO[str]) -> None:
        out.write(json.dumps(run.to_json()) + "\n")
        for sample in samples:
            row = {key: value for key, value in dataclasses.asdict(sample).items()
                   if key != "run_id"}
            out.write(json.dumps({"record": "sample", "run_id": run.run_id, **row}) + "\n")
    replace_atomically(path, write)
    return path


def replace_atomically(path: Path, write: Callable[[IO[str]], None]) -> None:
    """`path` holds what `write` wrote, or is as it was: written beside it and renamed over
    it. A write that fails (the disk full) leaves no temporary file behind."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        with open(tmp, "w") as out:
            write(out)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@dataclasses.dataclass(frozen=True)
class SkippedLine:
    """A line of a record file that was not read, and why."""

    line: int  # 1-based, as an editor shows it
    reason: str
    # the line may have been a rank's measurement (a broken sample line, or not JSON that
    # begins or names a sample line): the run's figures would be short of it
    # (analysis.completeness)
    lost_sample: bool = True
    # not JSON and nothing in it says what it was (a stray line, damage): it is a lost
    # sample only if the run's samples fall short of their count (analysis.completeness)
    unknown: bool = False


@dataclasses.dataclass
class RecordFile:
    path: Path
    runs: list[RunRecord]
    samples: list[Sample]
    skipped: list[SkippedLine] = dataclasses.field(default_factory=list)

    @property
    def bad_lines(self) -> int:
        """Lines that may have held a measurement and could not be read."""
        return sum(1 for skipped in self.skipped if skipped.lost_sample)

    @property
    def unknown_lines(self) -> int:
        """Lines that are not JSON and not recognisably a sample (SkippedLine.unknown)."""
        return sum(1 for skipped in self.skipped if skipped.unknown)


_SAMPLE_FIELDS = field_types(Sample)
_RUN_FIELDS = field_types(RunRecord)
_INIT_FIELDS = field_types(InitRow)


def _read_line(text: str, number: int, into: RecordFile) -> None:
    """One line into `into`: a run, a sample, or a SkippedLine with the reason."""
    row, unreadable = parse_line(text)
    if unreadable:
        if _names_a_sample(text):
            into.skipped.append(SkippedLine(number, f"{unreadable} (a sample line cut off or "
                                                    "damaged)"))
        else:
            into.skipped.append(SkippedLine(number, f"{unreadable} (damaged or not a record "
                                                    "line)", lost_sample=False, unknown=True))
        return
    if not isinstance(row, dict):
        into.skipped.append(SkippedLine(number, "not a JSON object"))
        return
    kind = row.get("record")
    if kind == "run":
        problem = run_problem(row, _RUN_FIELDS, _INIT_FIELDS)
        if problem:
            # not a measurement: the file's other runs and samples lose nothing by it
            into.skipped.append(SkippedLine(number, f"run line: {problem}", lost_sample=False))
        else:
            into.runs.append(run_from_json(row))
    elif kind == "sample":
        problem = sample_problem(row, _SAMPLE_FIELDS)
        if problem:
            into.skipped.append(SkippedLine(number, f"sample line: {problem}"))
        else:
            into.samples.append(sample_from_json(row))
    else:  # not a measurement this reader knows: the figures lose nothing by it
        into.skipped.append(SkippedLine(number, "not a run or sample line", lost_sample=False))


_SAMPLE_START = '{"record": "sample"'  # how write_record begins every sample line


def _names_a_sample(text: str) -> bool:
    """A line that is not JSON but was a sample line: its start cut off after a few
    characters, or whole enough to say `"record": "sample"`."""
    return (_SAMPLE_START.startswith(text) or '"record": "sample"' in text
            or '"record":"sample"' in text)


def read_record_file(path: Path) -> RecordFile:
    """A record file's run(s) and samples; every line that cannot be read is skipped, with
    its line number and reason (telemetry.record_checks)."""
    parsed = RecordFile(Path(path), [], [])
    with open(path, errors="replace") as source:
        for number, line in enumerate(source, start=1):
            if line.strip():
                _read_line(line.strip(), number, parsed)
    return parsed


def command_line() -> list[str]:
    if os.environ.get(ARGV_ENV):
        return json.loads(os.environ[ARGV_ENV])
    program = Path(sys.argv[0]).name
    if program == "__main__.py":  # `python -m dcp_fsdp` or `torchrun ... -m dcp_fsdp`
        program = "python -m dcp_fsdp"
    return [program] + sys.argv[1:]
