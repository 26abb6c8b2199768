"""The one structured configuration of a run: every setting, its type, default and meaning. Hydra
composes `conf/config.yaml` onto these dataclasses, so an unknown key or a wrong type fails at
composition. Each field's `help` is the only description of a setting (--help and docs/settings.md
print it); `validate.py` checks what types cannot express."""

from __future__ import annotations

import dataclasses
import enum
import typing
from collections.abc import Iterator
from typing import Any, Optional

from omegaconf import MISSING, OmegaConf


def setting(default: Any, help: str) -> Any:  # noqa: A002 - the field's meaning
    """A dataclass field with its user-facing description."""
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default),
                                 metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


class Command(str, enum.Enum):
    save = "save"
    load = "load"
    save_and_load = "save-and-load"
    ceiling = "ceiling"  # the raw PUT/GET rounds alone (rank/ceiling.py), no DCP


class Dtype(str, enum.Enum):
    fp32 = "fp32"
    bf16 = "bf16"


class CheckpointState(str, enum.Enum):
    model = "model"  # model weights only
    model_and_optimizer = "model_and_optimizer"  # weights + AdamW state (~3x bytes)


class ReplicaLoad(str, enum.Enum):
    every_replica = "every_replica"
    read_once = "read_once"


class MoeLayout(str, enum.Enum):
    hf = "hf"
    grouped = "grouped"


class StorageKind(str, enum.Enum):
    s3 = "s3"
    fs = "fs"


class StorageClient(str, enum.Enum):
    s3torchconnector = "s3torchconnector"
    fsspec = "fsspec"
    msc = "msc"


class PrefixStrategy(str, enum.Enum):
    default = "default"  # __{rank}_ file prefixes in one folder
    binary = "binary"
    hex = "hex"
    round_robin = "round_robin"


class ReaderKind(str, enum.Enum):
    dcp_optimized = "dcp_optimized"
    sequential = "sequential"
    range_based = "range_based"


# Functional form: `async` is a keyword, and OmegaConf matches enum members by name.
SaveMode = enum.Enum("SaveMode", {"sync": "sync", "async": "async"}, type=str)


class AsyncCheckpointer(str, enum.Enum):
    thread = "thread"
    process = "process"


class TrainStepWork(str, enum.Enum):
    matmul = "matmul"
    memory = "memory"


class Protocol(str, enum.Enum):
    default = "default"
    mlperf = "mlperf"


MLPERF_CHECKPOINTS = 10  # MLPerf Storage v3.0: checkpoints written, then reads of the last


class Malloc(str, enum.Enum):
    default = "default"
    raised = "raised"


class Backend(str, enum.Enum):
    auto = "auto"  # nccl when CUDA is present, else gloo
    gloo = "gloo"
    nccl = "nccl"


@dataclasses.dataclass
class ModelConfig:
    preset: str = setting(MISSING, "model shape (group `model=`): llama3_8b, llama3_70b, "
                                   "llama3_405b, qwen3_8b, qwen3_32b, qwen3_30b_a3b, "
                                   "mixtral_8x7b (released models), mlperf_llama3_8b, "
                                   "mlperf_llama3_70b, mlperf_llama3_405b, mlperf_llama3_1t "
                                   "(MLPerf Storage's), L7b, L13b, L30b, L65b, L70b, "
                                   "GPT-4B, L660m, tiny_llama, tiny_gpt2")
    config: Optional[str] = setting(None, "path of a local Hugging Face config.json (or its "
                                          "folder; never downloaded) of a llama, mistral, "
                                          "qwen2, qwen3, qwen3_moe, mixtral or gpt2 model: "
                                          "the state transformers builds from it, in place of "
                                          "the preset")
    moe_layout: MoeLayout = setting(MoeLayout.hf, "mixture-of-experts models only: hf "
                                                  "(transformers 5.x: a fused gate_up_proj and "
                                                  "down_proj per layer) or grouped (torchtitan's "
                                                  "GroupedExperts: w1, w2, w3 per layer)")
    dtype: Dtype = setting(Dtype.fp32, "parameter dtype: fp32 or bf16")
    replicas: int = setting(1, "replica groups (HSDP): the ranks form this many groups, each "
                               "holding a whole copy of the model sharded over its "
                               "nproc/replicas ranks (a 2-D mesh replicate x shard); nproc "
                               "(under torchrun WORLD_SIZE) must be a multiple; a save writes "
                               "each shard once; 1: plain FSDP")
    tp: int = setting(1, "tensor parallel degree: each decoder layer's attention and MLP split "
                         "over this many ranks (q/k/v, gate/up column-wise; o/down row-wise, "
                         "as torchtitan), FSDP over the rest (a mesh dp x tp; with replicas, "
                         "replicate x shard x tp); nproc a multiple of tp x replicas; 1: FSDP "
                         "only; llama-like models")
    replica_load: ReplicaLoad = setting(ReplicaLoad.every_replica,
                                        "replicas > 1: every_replica (each replica reads its "
                                        "shards from storage: replicas x the egress) or "
                                        "read_once (replica 0 reads, then broadcasts to the "
                                        "others along the replicate dimension; timed together)")

    @property
    def name(self) -> str:
        """What lines, records and manifests call the model: the preset, or `config:PATH`."""
        return f"config:{self.config}" if self.config else self.preset


@dataclasses.dataclass
class StorageConfig:
    kind: StorageKind = setting(StorageKind.s3, "s3 (through storage.client) or fs (DCP's "
                                "FileSystemWriter: the baseline); choose with `storage=s3|fs`")
    client: StorageClient = setting(StorageClient.s3torchconnector,
                                    "s3: the DCP client: s3torchconnector (its S3StorageWriter/"
                                    "Reader), fsspec (torch's FsspecWriter/Reader over s3fs) or "
                                    "msc (NVIDIA multi-storage-client); docs/clients.md")
    uri: Optional[str] = setting(None, "s3: s3://bucket/prefix; unset (and no endpoint): the "
                                       "embedded SeaweedFS server on 127.0.0.1")
    region: Optional[str] = setting(None, "s3: bucket region; default AWS_REGION, "
                                          "AWS_DEFAULT_REGION, else us-east-1")
    endpoint: Optional[str] = setting(None, "s3: http(s)://host:port of an S3-compatible "
                                            "server; default AWS_ENDPOINT_URL")
    part_size_mib: int = setting(8, "s3: multipart part size, MiB (5..5120)")
    throughput_target_gbps: float = setting(10.0, "s3: CRT client throughput target, Gbit/s")
    max_attempts: int = setting(10, "s3: attempts per request before the CRT client "
                                         "gives up, 1..100")
    force_path_style: Optional[bool] = setting(None, "s3: path-style addressing; default true "
                                                     "when an endpoint is set")
    thread_count: int = setting(1, "writer threads per rank, 1..256 (s3 and fs, every client)")
    prefix_strategy: PrefixStrategy = setting(PrefixStrategy.default,
                                              "s3: object key prefixes: default (__{rank}_), "
                                              "binary, hex, round_robin")
    prefix_count: Optional[int] = setting(None, "s3: prefix_strategy=binary or hex only: number of "
                                                "distinct prefixes (null: the connector's)")
    round_robin_prefixes: list[str] = setting([], "s3: prefix_strategy=round_robin only: the "
                                                     "prefixes, e.g. [a,b,c]")
    reader: ReaderKind = setting(ReaderKind.dcp_optimized,
                                 "s3: load reader: dcp_optimized, sequential, range_based")
    max_gap_size_mib: float = setting(32.0, "s3: reader=dcp_optimized only: byte ranges of one "
                                            "object closer than this are read in one stream, "
                                            "MiB (0: no coalescing; 32: the connector's default)")
    read_ahead: int = setting(0, "loads: 0 = DCP's own reader (the figure users get); N >= 1 "
                                 "= the tool's reader, not DCP's: N range fetches in flight "
                                 "while the rank deserialises (0..64; docs/headroom.md)")
    read_ahead_mib: int = setting(64, "storage.read_ahead >= 1: the most bytes of one range "
                                      "fetch, MiB (1..5120); the reader holds at most "
                                      "read_ahead x this (or x the largest item)")
    path: Optional[str] = setting(None, "fs: checkpoint directory (local disk, NFS, Lustre); "
                                        "needs storage=fs")
    sync_files: bool = setting(True, "fs: fsync every file a save writes, inside the timed "
                                     "save (durable writes, DCP's default); false: the save "
                                     "may end with data still in the page cache")
    fsspec_sync_files: bool = setting(False, "s3: client=fsspec only: torch's sync_files; its default "
                                             "true calls a host-wide os.sync() after every file "
                                             "(s3fs files have no fsync), which makes no S3 write "
                                             "more durable: false unless you measure that default")
    fsspec_block_size_mib: int = setting(50, "s3: client=fsspec only: s3fs's block size, MiB: its "
                                             "multipart part size on a save (parts go one after "
                                             "another) and its read-ahead on a load (s3fs: 50)")
    fsspec_max_pool_connections: int = setting(10, "s3: client=fsspec only: botocore's connection "
                                                   "pool per rank (its default: 10)")
    msc_part_size_mib: int = setting(32, "s3: client=msc only: multipart part size, MiB (MSC: 32)")
    msc_multipart_threshold_mib: int = setting(64, "s3: client=msc only: objects at least this large "
                                                   "upload in parts, MiB (MSC: 64)")
    msc_max_concurrency: int = setting(8, "s3: client=msc only: threads per object upload/download "
                                          "(MSC: 8)")
    msc_prefetch_threads: int = setting(1, "s3: client=msc only: a load's files downloaded this many "
                                           "at a time before DCP reads them, each once, 1..256 "
                                           "(MSC: 1, no prefetch)")
    msc_rust_client: bool = setting(False, "s3: client=msc only: MSC's Rust client for data requests "
                                           "(MSC's default: off)")
    connect_timeout_s: float = setting(3.0, "s3: seconds the pre-flight check waits to "
                                                    "connect (0..600]")
    metrics_url: Optional[str] = setting(None, "s3: the server's Prometheus endpoint "
                                               "(SeaweedFS: its -metricsPort /metrics): the run's "
                                               "request counts are checked against its counters; "
                                               "the embedded server sets it")


@dataclasses.dataclass
class AsyncSaveConfig:
    """dcp.async_save's options (torch's StagingOptions and checkpointer type)."""

    checkpointer: AsyncCheckpointer = setting(AsyncCheckpointer.thread,
                                              "async: upload in a thread or a separate process")
    pinned_memory: bool = setting(True, "async: stage into pinned host memory (CUDA only: "
                                        "ignored, i.e. off, without a GPU)")
    shared_memory: bool = setting(True, "async: stage into shared memory (process checkpointer "
                                        "only: ignored with checkpointer=thread)")
    async_staging: bool = setting(True, "async: stage in a background thread (blocked time "
                                        "shrinks to scheduling the copy)")
    non_blocking_copy: bool = setting(True, "async: non-blocking device-to-host copies (CUDA "
                                            "only: ignored, i.e. off, without a GPU)")
    steps_between_saves: int = setting(0, "async + train_step_s: training steps between saves; "
                                          "the loop trains on while the upload runs and the "
                                          "next save waits only for an upload still in flight "
                                          "(previous_wait_s); 0: each save trains until its "
                                          "own upload is done")
    train_step_work: TrainStepWork = setting(TrainStepWork.matmul,
                                             "async + train_step_s: the simulated step's work: "
                                             "matmul (fp32 matmuls, compute-bound: on a GPU it "
                                             "barely contends with staging's copies) or memory "
                                             "(an add over vectors beyond the caches, "
                                             "bandwidth-bound like an optimizer update)")


@dataclasses.dataclass
class TuneConfig:
    """`dcp-fsdp tune`: the search for the best connector settings."""

    budget_s: float = setting(600.0, "tune: wall-clock budget for the whole search, seconds")
    trials: Optional[int] = setting(None, "tune: stop after this many trials (whichever of "
                                          "budget_s and trials comes first)")
    repeats: int = setting(4, "tune: final rounds, each finalist measured beside the defaults "
                              "(with 4, a setting no better than the defaults passes the "
                              "recommendation rule by chance 1 time in 70)")


@dataclasses.dataclass
class BenchmarkConfig:
    command: Command = setting(Command.save, "set by the subcommand; not a setting to give")
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    storage: StorageConfig = dataclasses.field(default_factory=StorageConfig)
    state: CheckpointState = setting(CheckpointState.model,
                                     "what is checkpointed: model, or model_and_optimizer "
                                     "(adds AdamW moments, ~3x bytes)")
    iterations: int = setting(1, "saves (and loads) per run, 1..1000000")
    protocol: Protocol = setting(Protocol.default, "save-and-load: default (iterations x "
                                                   "(save, load)) or mlperf (MLPerf Storage "
                                                   "v3.0: 10 saves, then 10 loads of the last, "
                                                   "the page cache dropped (fs); iterations "
                                                   "fixed at 10; MLPerf's figure printed beside "
                                                   "ours: docs/mlperf.md)")
    suffix: Optional[str] = setting(None, "checkpoint name under the uri/path; load: required; "
                                          "save: default a fresh time-stamped one")
    delay_s: float = setting(0.0, "pause between phases, never inside a timer, "
                                  "seconds (0..86400)")
    verify: bool = setting(True, "save-and-load: compare every loaded shard, bit for bit, with "
                                 "what was saved")
    integrity: bool = setting(True, "load: recompute the values every loaded shard must hold "
                                    "(from the manifest's seed, any world size) and compare "
                                    "them bit for bit")
    results_dir: str = setting("results", "where the run's record (JSON Lines) is "
                                          "written; checked writable before any rank starts; "
                                          "if writing fails at the end: $TMPDIR/dcp-fsdp-results/")
    nproc: int = setting(1, "ranks to launch on this machine (ignored under "
                            "torchrun); at most 4 per CPU core, and with CUDA (nccl) "
                            "one per visible device")
    backend: Backend = setting(Backend.auto, "process group: auto (nccl with CUDA, else gloo), "
                                             "gloo, nccl")
    seed: int = setting(0, "seed of the random weights, 0..2^32-1")
    collective_timeout_s: float = setting(600.0, "process-group timeout, seconds (0..604800]; "
                                                 "raised to op_timeout_s + 60 when lower, so a "
                                                 "stuck save or load ends by the op watchdog, "
                                                 "with a record")
    op_timeout_s: float = setting(3600.0, "a save or load taking longer fails the run (a stalled "
                                          "server never hangs it)")
    keep_request_log: bool = setting(False, "keep each rank's raw connector request log in "
                                            "<results_dir>/<run_id>.requests/")
    request_stats: bool = setting(True, "s3: per-request statistics from the connector's log "
                                        "(false: the log is off)")
    save_mode: SaveMode = setting(SaveMode.sync, "sync (dcp.save) or async (dcp.async_save: "
                                                 "blocked_s vs persisted_s)")
    async_save: AsyncSaveConfig = dataclasses.field(default_factory=AsyncSaveConfig)
    plan_caching: bool = setting(False, "sync saves: DCP's save plan caching (DefaultSavePlanner("
                                        "enable_plan_caching=True)): a save whose local plans "
                                        "did not change skips sending them to the coordinator")
    train_step_s: float = setting(0.0, "async: length of a simulated training step (matmuls on "
                                       "the rank's device) run while the upload proceeds; 0: off; "
                                       "needs save_mode=async")
    malloc: Malloc = setting(Malloc.default, "the ranks' glibc allocator: default, or raised "
                                             "(mmap threshold 256 MiB, trim threshold 1 GiB, one "
                                             "arena: large blocks stay mapped; docs/metrics.md)")
    ceiling: bool = setting(False, "after the DCP operations, move the same bytes raw (PUT then "
                                   "GET, same client settings): the storage's ceiling")
    progress: bool = setting(True, "rank 0 prints a heartbeat every progress_interval_s during "
                                   "a save or load")
    progress_interval_s: float = setting(10.0, "seconds between progress heartbeats (> 0)")
    tune: TuneConfig = dataclasses.field(default_factory=TuneConfig)


def iter_settings(node: type = BenchmarkConfig, prefix: str = "") -> Iterator[tuple[str, str, Any, str]]:
    """(dotted name, type name, default, help) for every user setting, in schema order."""
    hints = typing.get_type_hints(node)
    for field in dataclasses.fields(node):
        kind = hints[field.name]
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            yield from iter_settings(kind, f"{prefix}{field.name}.")
        elif field.name != "command":
            default = (field.default_factory() if field.default_factory is not dataclasses.MISSING
                       else field.default)
            yield (f"{prefix}{field.name}", _type_name(kind, str(field.type)), default,
                   field.metadata.get("help", ""))


def _type_name(kind: Any, annotation: str) -> str:
    """An enum's values (a|b), Optional[] or not; else the annotation, list[str] as list."""
    for member_type in (kind, *typing.get_args(kind)):
        if isinstance(member_type, type) and issubclass(member_type, enum.Enum):
            return "|".join(member.value for member in member_type)
    return annotation.replace("Optional[", "").replace("]", "").replace("list[str", "list")


def format_default(value: Any) -> str:
    if value is MISSING or value == "???":
        return "(required)"
    if isinstance(value, enum.Enum):
        return value.value
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(str(v) for v in value) + "]"
    return str(value)


def to_config(node: Any) -> BenchmarkConfig:
    """The typed config of an OmegaConf node built on `BenchmarkConfig` (`to_object` returns any container)."""
    return typing.cast(BenchmarkConfig, OmegaConf.to_object(node))
