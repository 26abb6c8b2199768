"""Result records: one JSON Lines file per run, everything needed to recompute a table.

Line 1 is the run (`"record": "run"`): configuration, model, cluster, status.
Every further line is one rank's measurement of one save or load
(`"record": "sample"`). See docs/record-format.md.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import secrets
import sys
from importlib import metadata
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated, Any, Callable, Iterable
from urllib.parse import urlsplit, urlunsplit

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, PlainSerializer, PrivateAttr,
                      SerializationInfo, SerializerFunctionWrapHandler, StrictBool, StrictFloat,
                      StrictInt, StrictStr, ValidationError, ValidationInfo,
                      ValidatorFunctionWrapHandler, model_serializer, model_validator)
from pydantic_core import PydanticCustomError, from_json

from dcp_fsdp.contract import ARGV_ENV
from dcp_fsdp.log import printable

if TYPE_CHECKING:
    from dcp_fsdp.config.schema import BenchmarkConfig

# Bumped whenever a field is added, renamed or changes meaning; readers accept every earlier
# version (missing fields read as their defaults). Each version's changes: docs/record-format.md.
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

    # null: the installed connector is not a release the request-log parser was checked on
    found["request_parser"] = None if version_problem() else PARSER_FORMAT
    return found


def slurm_environment() -> dict[str, str] | None:
    found = {name.lower().removeprefix("slurm_"): os.environ[name]
             for name in SLURM_VARIABLES if name in os.environ}
    return found or None


def redact_url(url: str | None) -> str | None:
    """Drop any user:password@ from a URL before it is written anywhere."""
    parts = urlsplit(url or "")
    if not (parts.username or parts.password):
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def config_for_record(cfg: BenchmarkConfig) -> Settings:
    """The resolved settings as plain data, with any credentials in URLs removed."""
    from omegaconf import OmegaConf

    container = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True,
                                       enum_to_str=True)
    if not isinstance(container, dict):  # a structured config is a mapping, never a list
        raise TypeError(f"settings resolved to {type(container).__name__}, not a mapping")
    resolved = {str(key): value for key, value in container.items()}
    resolved["storage"]["endpoint"] = redact_url(resolved["storage"]["endpoint"])
    return Settings.model_validate(resolved)


def record_path(results_dir: str, run_id: str) -> Path:
    return Path(results_dir) / f"{run_id}.jsonl"


# -- the typed records (pydantic v2) -------------------------------------------------------
# Reading is strict (JSON's true is no integer, "1" no number); building one in a rank is
# lax. Every number is never below zero, except the Signed ones (a ratio or time lost against
# a baseline); none reaches 2**63 (pandas' int64 holds no more).
MAX_MAGNITUDE = 2**63
READ = {"read": True}  # model_validate(context=READ): a record file's line, ranges checked
SHOWN = {"printable": True}  # model_dump(context=SHOWN): every text escaped (log.printable)


def _ranged(signed: bool) -> AfterValidator:
    def check(value: float, info: ValidationInfo) -> float:
        if info.context != READ:  # a rank writes what it measured (a clock read out of
            return value  # order must not cost the run its record); the reader judges it
        if isinstance(value, float) and not math.isfinite(value):
            raise PydanticCustomError("finite_number", "not a finite number")
        if abs(value) >= MAX_MAGNITUDE:  # a 401-digit integer cannot even become a float
            raise PydanticCustomError("less_than", "out of range")
        if value < 0 and not signed:
            raise PydanticCustomError("greater_than_equal", "negative")
        return value
    return AfterValidator(check)


Count = Annotated[int, _ranged(signed=False)]
Measure = Annotated[float, _ranged(signed=False)]
Signed = Annotated[float, _ranged(signed=True)]


def _text(value: str, info: SerializationInfo) -> str:
    # a record is anyone's who can write the results directory: no ESC or newline to the terminal
    return printable(value) if info.context == SHOWN else value


Text = Annotated[str, PlainSerializer(_text)]
# one resolved setting (config/schema.py): enums are written as their names
Setting = StrictBool | StrictInt | StrictFloat | Annotated[StrictStr, PlainSerializer(_text)] \
    | list[Text] | None


class Block(BaseModel):
    """A nested block: typed on the way in, written with exactly the keys its writer gave,
    in its order, so the JSON is what the dict literals wrote before (a block of an older
    record keeps its missing keys missing); unknown keys (a newer writer's) are dropped."""

    model_config = ConfigDict(extra="ignore")
    _order: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _keep_order(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        block = handler(data)
        if isinstance(data, dict) and isinstance(block, Block):
            block.keep_order(tuple(data))
        return block

    def keep_order(self, keys: tuple[str, ...]) -> None:
        self._order = keys

    @model_serializer(mode="wrap")
    def _as_written(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        found = handler(self)
        return {key: found[key] for key in self._order if key in found}


class Percentiles(Block):
    """Latency quantiles and the max, ms (telemetry.histograms.percentiles_ms)."""

    p50: Measure | None = None
    p90: Measure | None = None
    p99: Measure | None = None
    max: Measure | None = None


class TypeSummary(Block):
    """One request type's figures in a window (telemetry.summaries._type_entry)."""

    count: Count | None = None
    failed: Count | None = None
    misses: Count | None = None
    throttled: Count | None = None
    retries: Count | None = None
    status: dict[str, Count] | None = None  # HTTP status (or "none"): requests
    latency_ms: Percentiles | None = None
    latency_hist: dict[str, Count] | None = None  # histogram bucket: requests
    bytes: Count | None = None


class Requests(Block):
    """S3 requests of one window (telemetry.summaries.summarize, merge_summaries)."""

    count: Count | None = None
    ok: Count | None = None
    failed: Count | None = None
    misses: Count | None = None
    throttled: Count | None = None
    retries: Count | None = None
    canceled: Count | None = None
    success_ratio: Measure | None = None
    seconds: Measure | None = None
    req_per_s: Measure | None = None
    bytes_down: Count | None = None
    broken: Count | None = None
    bytes_down_broken_max: Count | None = None
    bytes_up: Count | None = None
    unparsed: Count | None = None
    late: Count | None = None
    parser: Text | None = None
    status: dict[str, Count] | None = None
    latency_ms: Percentiles | None = None
    ttfb_ms: Percentiles | None = None
    ttfb_hist: dict[str, Count] | None = None
    by_type: dict[str, TypeSummary] | None = None  # request type: its figures
    control_plane: dict[str, dict[str, Count]] | None = None  # boto3 call: status: calls


class _SettingsGroup(Block):
    """Settings by name, every value one setting; the named fields are typed further."""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, Setting] = Field(init=False)


class ModelSettings(_SettingsGroup):
    preset: Text | None = None  # a group label in the report: text, never a list


class StorageSettings(_SettingsGroup):
    kind: Text | None = None  # group labels in the report: text
    endpoint: Text | None = None
    region: Text | None = None


class Settings(_SettingsGroup):
    """The resolved settings (config/schema.py's BenchmarkConfig, no secrets), groups as objects."""

    model: ModelSettings | None = None
    storage: StorageSettings | None = None
    async_save: dict[str, Setting] | None = None
    tune: dict[str, Setting] | None = None


class ModelInfo(Block):
    """What was built: the preset, its family, dtype, state and sizes (rank/session.py)."""

    preset: Text | None = None
    family: Text | None = None
    config: Text | None = None
    moe_layout: Text | None = None
    dtype: Text | None = None
    dtype_from: Text | None = None
    state: Text | None = None
    param_count: Count | None = None
    param_bytes: Count | None = None
    state_bytes: Count | None = None


class Gpus(Block):
    model: Text | None = None
    count: Count | None = None  # per node


class Allocator(Block):
    """The allocator rank 0 runs (process/allocator.py)."""

    name: Text | None = None  # "glibc 2.36" | "jemalloc" | ...
    thresholds: Text | None = None  # "default" | "raised" (malloc=)
    environment: dict[str, Text] | None = None  # MALLOC_*, GLIBC_TUNABLES, LD_PRELOAD


class StorageInfo(Block):
    """Where the checkpoints went (the stores' describe(); no secrets)."""

    kind: Text | None = None
    path: Text | None = None  # fs
    uri: Text | None = None  # s3 from here on
    bucket: Text | None = None
    region: Text | None = None
    endpoint: Text | None = None
    force_path_style: bool | None = None
    client: Text | None = None
    retry_mode: Text | None = None
    max_attempts: Count | None = None
    client_versions: dict[str, Text | None] | None = None
    embedded: bool | None = None  # the launcher's own SeaweedFS


class RankFailure(Block):
    """How a rank that did not end cleanly ended: torch's agent (launch/agent.py), its error file."""

    local_rank: Count | None = None
    pid: Count | None = None
    exitcode: int | None = None  # negative: the signal's number
    signal: Text | None = None
    message: Text | None = None
    timestamp: Measure | None = None
    node_oom_kills: Count | None = None
    status: Text | None = None
    error: Text | None = None
    cause: Text | None = None


class Integrity(Block):
    checked: bool | None = None
    reason: Text | None = None


class ServerRequests(Block):
    """The record's request counts against the server's own (telemetry.server_counters)."""

    source: Text | None = None
    match: bool | None = None
    record: dict[str, Count] | None = None  # "<server type> <code>": requests
    server: dict[str, Count] | None = None
    differences: dict[str, int] | None = None  # record - server
    incomplete: list[Text] | None = None
    cause: Text | None = None
    unanswered: Count | None = None


class TuneTrial(Block):
    trial: Count | None = None
    role: Text | None = None  # defaults | search | repeat | ceiling
    settings: dict[str, Setting] | None = None  # setting: value


class _Record(BaseModel):
    # lax where a rank builds one (an int where a float goes), strict where a file is read
    model_config = ConfigDict(extra="ignore", validate_assignment=True)


class Sample(_Record):
    """One rank's measurement of one save or load (a `"record": "sample"` line)."""

    op: Text  # "save" | "load"
    iteration: Count  # 1-based
    suffix: Text
    rank: Count
    host: Text
    begin_wall_s: Measure  # time.time() just after the aligning barrier
    end_wall_s: Measure
    begin_mono_s: Measure  # time.monotonic(), same instants (comparable within a host)
    end_mono_s: Measure
    duration_s: Measure
    bytes: Count  # checkpoint bytes: what this rank's shards hold (saved or loaded)
    barrier_wait_s: Measure  # time in the aligning barrier before the timer started
    plan_s: Measure | None = None  # start -> data I/O begins (local + global plan, collective)
    io_s: Measure | None = None  # write_data / read_data
    commit_s: Measure | None = None  # data I/O end -> return (save: results gather + .metadata)
    metadata_s: Measure | None = None  # load: reading .metadata (part of plan_s)
    finish_s: Measure | None = None  # save, coordinator: writing .metadata
    requests: Requests | None = None  # S3 requests inside the timed region (telemetry.summaries)
    # -- schema 2 -------------------------------------------------------------------------
    save_mode: Text | None = None  # save: "sync" | "async"
    blocked_s: Measure | None = None  # save: call -> control back to the training loop
    staged_s: Measure | None = None  # async save: until the staging copy is done
    persisted_s: Measure | None = None  # save: call -> upload and .metadata commit done
    previous_wait_s: Measure | None = None  # async: waiting for the previous upload to finish
    train_steps: Count | None = None  # async + train_step_s: steps run while uploading
    # mean step compute time with upload / without - 1 (schema 5; before, waits included)
    train_step_slowdown: Signed | None = None
    fetched_bytes: Count | None = None  # load: bytes read from storage (>= bytes if amplified)
    written_bytes: Count | None = None  # save: tensor bytes written to storage by this rank
    # before schema 8: a load's io_s inside the streams' reads (io_wait_s), and the rest
    io_wait_s: Measure | None = None
    copy_s: Measure | None = None
    stage_s: Measure | None = None  # save: DCP's own work: staging, serialising (inside io_s)
    upload_s: Measure | None = None  # save: inside the client's upload calls (inside io_s)
    peak_rss_bytes: Count | None = None  # resident memory high-water mark during this op
    cuda_max_allocated_bytes: Count | None = None  # CUDA: torch.cuda.max_memory_allocated
    # -- schema 3 -------------------------------------------------------------------------
    stall_s: Measure | None = None  # save: call -> training may update weights again (async: + staging)
    interval_s: Measure | None = None  # async + train_step_s: call -> the following steps done
    train_lost_s: Signed | None = None  # interval_s - steps x baseline step: training lost
    train_lost_share: Signed | None = None  # train_lost_s / interval_s
    cache_policy: Text | None = None  # fs load / raw_get: the page cache at the start (storage/pagecache.py)
    minor_faults: Count | None = None  # the rank's minor page faults in the op (getrusage): fresh memory touched
    # -- schema 4 -------------------------------------------------------------------------
    replica: Count | None = None  # model.replicas > 1: this rank's replica group (0 .. R-1)
    broadcast_s: Measure | None = None  # load, replica_load=read_once: in the broadcast (inside duration_s)
    # -- schema 5 -------------------------------------------------------------------------
    train_wait_s: Measure | None = None  # async + train_step_s: the steps' wait for staging (in train_lost_s)
    stager_renewed: bool | None = None  # async: a fresh stager (torch 2.11 stages once) allocated buffers again
    # -- schema 8: a load's io_s by who spends it (storage/timeline.py, docs/metrics.md) -----
    storage_s: Measure | None = None  # load: inside the storage client's calls for bytes
    deserialise_s: Measure | None = None  # load: DCP's own work (torch.load, host copies)
    target_copy_s: Measure | None = None  # load: copying into the live tensors (GPU: H2D)
    reader: Text | None = None  # the tool's own reader: "read_ahead=N" (its io_s parts overlap); null: DCP's
    read_ahead_peak_bytes: Count | None = None  # the most bytes the tool's reader held at once
    msc_reads: Text | None = None  # MSC loads: "whole" | "ranged" | "whole+ranged" (its 512 MiB switch)
    cpu_s: Measure | None = None  # the rank process's CPU seconds in the timed region, every thread
    run_id: Text | None = None  # set when read back from a record file

    @model_validator(mode="after")
    def _spans_forward(self) -> Sample:
        for begin, end in (("begin_wall_s", "end_wall_s"), ("begin_mono_s", "end_mono_s")):
            if getattr(self, end) < getattr(self, begin):
                raise PydanticCustomError("span", f"{end} before {begin}")
        return self


class InitRow(_Record):
    """One rank's untimed set-up: never part of any figure."""

    rank: Count
    pg_init_s: Measure | None = None  # joining the process group
    build_s: Measure | None = None  # meta build, fully_shard, materialise and fill the shards
    state_dict_s: Measure | None = None  # the sharded state dict DCP saves
    init_s: Measure | None = None  # process start -> ready for the first timed operation
    peak_rss_bytes: Count | None = None  # peak resident memory of the rank process
    untimed_request_count: Count | None = None  # S3 requests outside every timed region
    fill_s: Measure | None = None  # the value fill in build_s: a real restart loads instead (--node-mtbf-hours)


class RunRecord(_Record):
    """The first line of a record file (`"record": "run"`): what ran, where, and how it ended."""

    run_id: Text
    command: Text
    status: Text = "unknown"  # ok | failed | interrupted
    end_cause: Text | None = None  # contract.EndCause: why it ended (decided on, never the error text)
    error: Text | None = None
    argv: list[Text] = []
    started_at: Text | None = None
    finished_at: Text | None = None
    config: Settings = Settings()
    model: ModelInfo | None = None
    world_size: Count | None = None
    node_count: Count | None = None
    nproc_per_node: Count | None = None
    # after a barrier, the ranks' wall clocks' max - min: the most skew a cross-node span_s can carry
    clock_spread_s: Measure | None = None
    hostnames: list[Text] = []
    backend: Text | None = None
    device: Text | None = None
    gpus: Gpus | None = None  # CUDA only
    allocator: Allocator | None = None  # schema 8
    storage: StorageInfo | None = None
    suffixes: list[Text] = []
    incomplete_suffix: Text | None = None  # a failed or interrupted run's save's suffix: never loadable
    rank_failures: dict[str, RankFailure] = {}
    integrity: dict[str, Integrity] = {}  # suffix: whether its loads were checked
    suffix_claim: Text | None = None  # conditional_write | exclusive_create | not_atomic; None: no save
    init: list[InitRow] = []
    versions: dict[str, Text | None] = {}
    slurm: dict[str, Text] | None = None
    untimed_requests: Requests | None = None
    # storage.metrics_url: the record's request counts against the server's own (the launcher)
    server_requests: ServerRequests | None = None
    request_log_dir: Text | None = None
    tune: TuneTrial | None = None  # `dcp-fsdp tune` trials only
    # benchmark-only: instrumentation pieces left out of the timed path (contract.HARNESS_OFF_ENV)
    harness_off: list[Text] | None = None
    rank_start: Text | None = None  # how the recording rank started: "exec" | "fork" (tests'); null: unknown
    schema_version: Count = SCHEMA_VERSION

    def to_json(self, context: dict[str, bool] | None = None) -> dict[str, Any]:
        return {"record": "run", **self.model_dump(context=context)}


def write_records(path: Path, run: RunRecord, samples: Iterable[Sample]) -> Path:
    """Write the run line and sample lines atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(out: IO[str]) -> None:
        out.write(json.dumps(run.to_json()) + "\n")
        for sample in samples:
            row = sample.model_dump(exclude={"run_id"})
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
    lost_sample: bool = True  # the line may have been a rank's measurement: the figures lack it
    unknown: bool = False  # not JSON, of no known kind: a lost sample only if the samples fall short


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


# what a field's wrong value is, by pydantic's error type
_WRONG = {"int_type": "is not an integer", "float_type": "is not a number",
          "finite_number": "is not a finite number", "greater_than_equal": "is negative",
          "less_than": "is out of range (2**63 or more)", "string_type": "is not text",
          "list_type": "is not a list", "dict_type": "is not an object",
          "model_type": "is not an object", "bool_type": "is not true or false"}


def _problem(error: ValidationError, row: dict[str, Any]) -> str:
    """The first wrong field of `row`, as its path in the line (`init[0].rank`) and what is
    wrong, not its value: many bad lines share one reason (one note per reason)."""
    first = error.errors()[0]
    if first["type"] == "span":  # Sample's own check
        return first["msg"]
    names: list[str] = []
    value: Any = row
    for part in first["loc"]:
        if isinstance(part, int) and isinstance(value, list):
            names[-1] += f"[{part}]"
        elif isinstance(value, dict) and (part in value or first["type"] == "missing"):
            names.append(str(part))
        else:  # a union's member (a setting's kinds): the value is of none of them
            return f"{'.'.join(names)} is not a setting"
        value = value.get(part) if isinstance(value, dict) else value[part]
    name = ".".join(names)
    if first["type"] == "missing":
        return f"no {name}"
    return f"{name} {_WRONG.get(first['type'], 'is of the wrong kind')}"


def _read_line(text: str, number: int, into: RecordFile) -> None:
    """One line into `into`: a run, a sample, or a SkippedLine with the reason."""
    try:
        row = from_json(text)
    except ValueError as error:  # not JSON, or deeper than the parser goes (or any record)
        unreadable = "nested too deeply" if "recursion limit" in str(error) else "not JSON"
        # a sample line: its start cut off after a few characters (write_records begins every
        # sample line so), or whole enough to say it is one
        sample = ('{"record": "sample"'.startswith(text) or '"record": "sample"' in text
                  or '"record":"sample"' in text)
        why = "a sample line cut off or damaged" if sample else "damaged or not a record line"
        into.skipped.append(SkippedLine(number, f"{unreadable} ({why})", lost_sample=sample,
                                        unknown=not sample))
        return
    kind = row.get("record") if isinstance(row, dict) else None
    try:
        if kind == "run":
            # the one migration: a record from before schema_version was written is version 0
            into.runs.append(RunRecord.model_validate({"schema_version": 0, **row}, strict=True,
                                                     context=READ))
        elif kind == "sample":
            into.samples.append(Sample.model_validate(row, strict=True, context=READ))
        else:  # not a measurement this reader knows: the figures lose nothing by it
            into.skipped.append(SkippedLine(number, "not a run or sample line",
                                            lost_sample=False))
    except ValidationError as error:
        # a bad run line is not a measurement: the file's other runs and samples lose nothing
        into.skipped.append(SkippedLine(number, f"{kind} line: {_problem(error, row)}",
                                        lost_sample=kind == "sample"))


def read_record_file(path: Path) -> RecordFile:
    """A record file's run(s) and samples; every line that cannot be read is skipped, with
    its line number and reason (the models' ValidationError)."""
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
