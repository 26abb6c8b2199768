"""The one structured configuration of a run, and its validation.

Hydra composes `conf/config.yaml` (model and storage groups) onto these
dataclasses, so an unknown key or a value of the wrong type fails at
composition. `validate` then checks what types cannot express, before any
rank starts work. Every error names the setting and the fix.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Optional

from omegaconf import MISSING

from dcp_fsdp.errors import UserError
from dcp_fsdp.llama_model_config import PRESETS

MIB = 2**20
S3_MIN_PART_SIZE_MIB = 5  # S3 rejects multipart parts below 5 MiB (except the last)
S3_MAX_PART_SIZE_MIB = 5 * 1024


class Command(str, enum.Enum):
    save = "save"
    load = "load"
    save_and_load = "save-and-load"


class Dtype(str, enum.Enum):
    fp32 = "fp32"
    bf16 = "bf16"


class CheckpointState(str, enum.Enum):
    model = "model"  # model weights only
    model_and_optimizer = "model_and_optimizer"  # weights + AdamW state (~3x bytes)


class StorageKind(str, enum.Enum):
    s3 = "s3"
    fs = "fs"


class PrefixStrategy(str, enum.Enum):
    default = "default"  # __{rank}_ file prefixes in one folder
    binary = "binary"
    hex = "hex"
    round_robin = "round_robin"


class ReaderKind(str, enum.Enum):
    dcp_optimized = "dcp_optimized"
    sequential = "sequential"
    range_based = "range_based"


class Backend(str, enum.Enum):
    auto = "auto"  # nccl when CUDA is present, else gloo
    gloo = "gloo"
    nccl = "nccl"


@dataclasses.dataclass
class ModelConfig:
    preset: str = MISSING
    dtype: Dtype = Dtype.fp32


@dataclasses.dataclass
class StorageConfig:
    kind: StorageKind = StorageKind.s3
    # s3: s3://bucket/prefix. Unset (with no endpoint) starts the embedded server.
    uri: Optional[str] = None
    region: Optional[str] = None  # default: AWS_REGION / AWS_DEFAULT_REGION, else us-east-1
    endpoint: Optional[str] = None  # S3-compatible servers; default: AWS_ENDPOINT_URL
    part_size_mib: int = 8
    throughput_target_gbps: float = 10.0
    max_attempts: int = 10
    force_path_style: Optional[bool] = None  # default: true when an endpoint is set
    thread_count: int = 1
    prefix_strategy: PrefixStrategy = PrefixStrategy.default
    prefix_count: Optional[int] = None  # binary / hex: number of distinct prefixes
    round_robin_prefixes: list[str] = dataclasses.field(default_factory=list)
    reader: ReaderKind = ReaderKind.dcp_optimized
    # fs: a directory (local disk, NFS, Lustre)
    path: Optional[str] = None
    # Fail fast on a dead endpoint: seconds the pre-flight check waits to connect.
    connect_timeout_s: float = 3.0


@dataclasses.dataclass
class BenchmarkConfig:
    command: Command = Command.save
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    storage: StorageConfig = dataclasses.field(default_factory=StorageConfig)
    state: CheckpointState = CheckpointState.model
    iterations: int = 1
    suffix: Optional[str] = None
    delay_s: float = 0.0  # save-and-load: pause between phases, never inside a timer
    verify: bool = True  # save-and-load: compare every loaded shard with what was saved
    integrity: bool = True  # store a SHA-256 per tensor shard at save; verify at every load
    results_dir: str = "results"
    nproc: int = 1  # ranks to launch on this machine when not under torchrun
    backend: Backend = Backend.auto
    seed: int = 0
    collective_timeout_s: float = 600.0
    # A save or load taking longer than this fails the run (a stalled server never hangs it).
    op_timeout_s: float = 3600.0
    # Keep the connector's raw per-request log of each rank in <results_dir>/<run_id>.requests/
    keep_request_log: bool = False


_S3_URI = re.compile(r"^s3://(?P<bucket>[^/]+)(?:/(?P<prefix>.*))?$")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_SUFFIX = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """(bucket, prefix without slashes at either end) or UserError."""
    match = _S3_URI.match(uri)
    if not match:
        raise UserError(f"storage.uri={uri}: not an S3 URI; write it as s3://bucket/prefix")
    bucket, prefix = match["bucket"], (match["prefix"] or "").strip("/")
    if not _BUCKET.match(bucket) or ".." in bucket or re.match(r"^\d+\.\d+\.\d+\.\d+$", bucket):
        raise UserError(
            f"storage.uri={uri}: '{bucket}' is not a valid S3 bucket name; use 3-63 lowercase "
            "letters, digits, dots and hyphens, starting and ending with a letter or digit")
    return bucket, prefix


def validate(cfg: BenchmarkConfig) -> None:
    """Checks beyond types. Raises UserError naming the setting and the fix."""
    if cfg.model.preset not in PRESETS:
        raise UserError(f"model={cfg.model.preset}: unknown preset; choose one of "
                        + ", ".join(PRESETS))
    if cfg.iterations < 1:
        raise UserError(f"iterations={cfg.iterations}: must be 1 or more")
    if cfg.nproc < 1:
        raise UserError(f"nproc={cfg.nproc}: must be 1 or more")
    if cfg.op_timeout_s <= 0:
        raise UserError(f"op_timeout_s={cfg.op_timeout_s}: must be positive (seconds)")
    if cfg.delay_s < 0:
        raise UserError(f"delay_s={cfg.delay_s}: must be 0 or more")
    if cfg.command == Command.load and not cfg.suffix:
        raise UserError("suffix is not set: `load` needs the suffix a save printed, e.g. "
                        "suffix=2026-11-22-13-45-ab12 (`dcp-fsdp list` shows them)")
    if cfg.suffix is not None and not _SUFFIX.match(cfg.suffix):
        raise UserError(f"suffix={cfg.suffix}: use letters, digits, '.', '_' and '-' only")
    storage = cfg.storage
    if storage.kind == StorageKind.fs:
        if not storage.path:
            raise UserError("storage.path is not set: give the directory for storage=fs, "
                            "e.g. storage.path=/fsx/checkpoints")
        return
    if storage.uri is not None:
        parse_s3_uri(storage.uri)
    elif storage.endpoint:
        raise UserError(f"storage.uri is not set but storage.endpoint={storage.endpoint} is: "
                        "give the bucket too, e.g. storage.uri=s3://my-bucket/checkpoints")
    if storage.endpoint is not None and not re.match(r"^https?://[^/\s]+/?$", storage.endpoint):
        raise UserError(f"storage.endpoint={storage.endpoint}: write it as http(s)://host:port")
    if not S3_MIN_PART_SIZE_MIB <= storage.part_size_mib <= S3_MAX_PART_SIZE_MIB:
        raise UserError(f"storage.part_size_mib={storage.part_size_mib}: S3 multipart parts must "
                        f"be {S3_MIN_PART_SIZE_MIB}..{S3_MAX_PART_SIZE_MIB} MiB")
    if storage.max_attempts < 1:
        raise UserError(f"storage.max_attempts={storage.max_attempts}: must be 1 or more")
    if storage.thread_count < 1:
        raise UserError(f"storage.thread_count={storage.thread_count}: must be 1 or more")
    if storage.throughput_target_gbps <= 0:
        raise UserError(f"storage.throughput_target_gbps={storage.throughput_target_gbps}: "
                        "must be positive")
    if storage.prefix_strategy == PrefixStrategy.round_robin and not storage.round_robin_prefixes:
        raise UserError("storage.round_robin_prefixes is empty: prefix_strategy=round_robin needs "
                        "a list, e.g. 'storage.round_robin_prefixes=[a,b,c]'")
